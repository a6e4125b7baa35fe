"""How the client reaches an engine: over HTTP (the service) or in-process (tests, debugging).

Both transports offer the same four calls, ``batch``, ``write``, ``read`` and ``close``, so the
remote runtime above them is the same code whether the engine runs behind a gateway or in this
interpreter. Arrays always travel as raw bytes with a dtype and a shape, never as JSON lists.
"""

from __future__ import annotations

import http.client
import json
import os
import select
import socket
import sys
import threading
import time
import urllib.parse
import urllib.request
from typing import Any

import numpy as np

from difftape.graph import wire

from .errors import RemoteError, error_from_problem

#: Transfers at least this large show a progress bar on stderr (when stderr is a terminal).
PROGRESS_BYTES = 64 << 20
_CHUNK = 1 << 20


class _Progress:
    """A minimal one-line progress bar on stderr, only for large transfers on a terminal."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done = label, total, 0
        self.enabled = total >= PROGRESS_BYTES and sys.stderr.isatty()
        self._last = 0.0

    def update(self, n: int) -> None:
        self.done += n
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last < 0.1 and self.done < self.total:
            return
        self._last = now
        frac = self.done / max(1, self.total)
        bar = "#" * int(30 * frac)
        sys.stderr.write(f"\r{self.label} [{bar:<30}] {self.done / 2**20:.0f}/"
                         f"{self.total / 2**20:.0f} MiB")
        if self.done >= self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


class TransportStats:
    """What a program cost on the wire: HTTP requests (round trips, retries included) and
    body bytes each way (``ti.remote_stats()``)."""

    __slots__ = ("round_trips", "bytes_sent", "bytes_received")

    def __init__(self) -> None:
        self.round_trips = 0
        self.bytes_sent = 0
        self.bytes_received = 0

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self.__slots__}


class _Unreachable(Exception):
    """No connection could be made (nothing was sent)."""


class _Broken(Exception):
    """The connection failed after the request may have been sent."""


class _Response:
    """What ``HttpTransport.request`` answers from a :class:`_LeanConnection`: the parts of
    an ``httpx.Response`` the transport reads."""

    __slots__ = ("status_code", "content")

    def __init__(self, status_code: int, content: bytes) -> None:
        self.status_code = status_code
        self.content = content

    def json(self) -> Any:
        return json.loads(self.content)

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")


def _readable(sock: socket.socket) -> bool:
    """Whether ``sock`` has something to read now (``poll``: ``select`` refuses descriptors
    past 1023, which a process with many files open reaches)."""
    if hasattr(select, "poll"):
        p = select.poll()
        p.register(sock, select.POLLIN)
        return bool(p.poll(0))
    return bool(select.select([sock], [], [], 0)[0])


class _LeanConnection:
    """One keep-alive HTTP/1.1 connection for requests whose body is in memory (every JSON
    request: the batch a program sends per step, a replayed graph's one request).

    Why not httpx for these: on every such request httpx parses and merges URLs, builds
    header models and steps h11's state machine, about 0.5 ms of client CPU per request on
    a small VM (measured 0.7 ms against 0.2 ms here), which lies on the path of every step,
    and it writes the headers and the body in two sends, so the gateway wakes twice. Here
    the request is written whole with one ``sendall`` (``TCP_NODELAY``, as httpx sets it)
    and the standard library's ``http.client.HTTPResponse`` reads the answer
    (Content-Length, chunked or close-delimited). A connection the server has closed while
    idle (uvicorn's keep-alive timeout) is noticed before it is reused, as httpx does.
    Only plain-HTTP URLs that no proxy variable applies to come here
    (:meth:`applies`): over https (a TLS reverse proxy) or a proxy, httpx, with its trust
    store and proxy support, sends every request."""

    def __init__(self, url: str, headers: dict[str, str], *, timeout: float,
                 connect_timeout: float, retries: int) -> None:
        parts = urllib.parse.urlsplit(url)
        self.address = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.prefix = parts.path.rstrip("/")
        host = parts.netloc.rpartition("@")[2]
        lines = [f"Host: {host}"] + [f"{k}: {v}" for k, v in headers.items()]
        self.head = "\r\n".join(lines).encode("latin-1")
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.retries = retries
        self.sock: socket.socket | None = None
        # One request at a time: a request made while another thread's is in flight
        # goes through httpx (``HttpTransport.request``).
        self.busy = threading.Lock()

    @staticmethod
    def applies(url: str, headers: dict[str, str]) -> bool:
        """Whether requests to ``url`` can go this way: plain HTTP, no proxy from the
        environment (``HTTP_PROXY``/``ALL_PROXY``, which httpx would use), and headers
        that are plain one-line text (anything else is for httpx to refuse)."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            return False
        proxies = urllib.request.getproxies()
        if proxies.get("http") or proxies.get("all"):
            return False
        text = "".join(f"{k}{v}" for k, v in headers.items())
        return text.isascii() and "\r" not in text and "\n" not in text

    def _connect(self, timeout: float) -> socket.socket:
        """A new connection, retried ``retries`` times after 0, 0.5, 1... s (httpx's
        connection retries)."""
        delay = 0.0
        for attempt in range(self.retries + 1):
            try:
                sock = socket.create_connection(self.address, timeout=timeout)
            except TimeoutError:
                raise
            except OSError as e:
                if attempt == self.retries:
                    raise _Unreachable(str(e)) from e
                time.sleep(delay)
                delay = 0.5 if not delay else 2 * delay
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def send(self, method: str, path: str, body: bytes | None, headers: dict[str, str],
             timeout: float | None) -> _Response:
        """One request and its whole answer. Raises ``TimeoutError``, :class:`_Unreachable`
        (nothing sent) or :class:`_Broken`."""
        timeout = self.timeout if timeout is None else timeout
        sock = self.sock
        if sock is not None and _readable(sock):
            self.close()  # readable while idle: the server closed it (or broke the protocol)
            sock = None
        if sock is None:
            sock = self.sock = self._connect(min(timeout, self.connect_timeout))
        body = body or b""
        extra = "".join(f"\r\n{k}: {v}" for k, v in headers.items())
        request = b"".join((f"{method} {self.prefix}{path} HTTP/1.1\r\n".encode("latin-1"),
                            self.head, extra.encode("latin-1"),
                            f"\r\nContent-Length: {len(body)}\r\n\r\n".encode("latin-1"),
                            body))
        try:
            sock.settimeout(timeout)
            sock.sendall(request)
            resp = http.client.HTTPResponse(sock, method=method)
            try:
                resp.begin()
                content = resp.read()
            finally:
                resp.close()
        except TimeoutError:
            self.close()
            raise
        except (OSError, http.client.HTTPException) as e:
            self.close()
            raise _Broken(str(e) or type(e).__name__) from e
        if resp.will_close:
            self.close()
        return _Response(resp.status, content)


def _role_path(role: str) -> str:
    return "data" if role == "primal" else role


class HttpTransport:
    """The service over HTTP: one ``httpx.Client`` (keep-alive connections), timeouts, and
    retries only where repeating a request cannot do anything twice."""

    def __init__(self, url: str, token: str | None, *, timeout: float = 300.0,
                 retries: int = 2) -> None:
        try:
            import httpx
        except ImportError:
            from difftape.errors import DifftapeError

            raise DifftapeError("the difftape client needs httpx: pip install "
                                "'difftape[client]'") from None
        self._httpx = httpx
        self.url = url.rstrip("/")
        headers = {"User-Agent": "difftape-client"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        # Connection failures (nothing was sent) are retried by httpx for every method.
        self.client = httpx.Client(
            base_url=self.url, headers=headers,
            timeout=httpx.Timeout(timeout, connect=10.0),
            transport=httpx.HTTPTransport(retries=retries))
        # Requests with their body in memory (JSON: batches, replays) take the lean
        # connection where it applies; streamed bodies (array uploads and downloads, job
        # events) take httpx.
        self.lean = _LeanConnection(self.url, {**headers, "Accept": "*/*"}, timeout=timeout,
                                    connect_timeout=10.0, retries=retries) \
            if _LeanConnection.applies(self.url, headers) else None
        self.retries = retries
        self.stats = TransportStats()

    # ------------------------------------------------------------------ plumbing
    def _unreachable_hint(self) -> str:
        """What to check when nothing answers at the URL: that a server runs there, the
        tunnel a laptop reaches it through, and where the URL came from."""
        port = urllib.parse.urlsplit(self.url).port or 8000
        return (f"Is a difftape server running there? Start one with `difftape serve` (port "
                f"8000 by default); from a laptop, open the SSH tunnel to it first: `ssh -N -L "
                f"{port}:127.0.0.1:{port} HOST`. The URL is ti.init(server=...), else "
                f"DIFFTAPE_SERVER, else http://127.0.0.1:8000")

    def request(self, method: str, path: str, *, idempotent: bool | None = None,
                **kwargs: Any):
        """Send one request; map error responses to exceptions. Requests that may have
        reached the server are repeated only when ``idempotent`` (GET/PUT/DELETE by default)."""
        if idempotent is None:
            idempotent = method in ("GET", "PUT", "DELETE", "HEAD")
        content = kwargs.pop("content", None)
        lean = self.lean
        if lean is not None and not (isinstance(content, bytes | None)
                                     and kwargs.keys() <= {"headers", "timeout"}
                                     and lean.busy.acquire(blocking=False)):
            lean = None
        try:
            return self._request(method, path, idempotent, content, lean, kwargs)
        finally:
            if lean is not None:
                lean.busy.release()

    def _request(self, method: str, path: str, idempotent: bool, content: Any,
                 lean: _LeanConnection | None, kwargs: dict):
        httpx = self._httpx
        attempt = 0
        while True:
            try:
                # A callable body makes a fresh (e.g. streamed) body for every attempt.
                body = content() if callable(content) else content
                self.stats.round_trips += 1
                if lean is not None:
                    resp = lean.send(method, path, body, kwargs.get("headers") or {},
                                     kwargs.get("timeout"))
                else:
                    resp = self.client.request(method, path, content=body, **kwargs)
                break
            except (httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError,
                    _Broken) as e:
                attempt += 1
                if not idempotent or attempt > self.retries:
                    raise RemoteError(f"{method} {path}: connection to {self.url} failed: "
                                      f"{e}") from e
                time.sleep(0.05 * attempt)
            except (httpx.TimeoutException, TimeoutError) as e:
                raise RemoteError(f"{method} {path}: timed out talking to {self.url}") from e
            except (httpx.TransportError, _Unreachable) as e:
                raise RemoteError(f"{method} {path}: cannot reach {self.url}: {e}. "
                                  f"{self._unreachable_hint()}") from e
        if isinstance(content, bytes):
            self.stats.bytes_sent += len(content)  # (array uploads count their own)
        self.stats.bytes_received += len(resp.content)
        if resp.status_code >= 400:
            raise self._error(resp)
        return resp

    @staticmethod
    def _error(resp) -> Exception:
        """The exception for an error response; what the request's kernels printed before
        the error (``output``) is written to ``sys.stdout`` now, before it is raised, as a
        local run prints those lines before it raises."""
        try:
            body = resp.json()
        except ValueError:
            body = resp.text
        if isinstance(body, dict):
            wire.show_output(body.get(wire.OUTPUT))
        return error_from_problem(resp.status_code, body)

    def json(self, method: str, path: str, body: Any = None, **kwargs: Any) -> Any:
        content = None
        headers = kwargs.pop("headers", {})
        if body is not None:
            # allow_nan: kernel arguments and constants may be inf/NaN; Python's json (and so
            # the gateway) reads them back.
            content = json.dumps(body, separators=(",", ":")).encode()
            headers = {**headers, "Content-Type": "application/json"}
        resp = self.request(method, path, content=content, headers=headers, **kwargs)
        if resp.status_code == 204 or not resp.content:
            return None
        return resp.json()

    # ------------------------------------------------------------------ sessions
    def create_session(self) -> str:
        return self.json("POST", "/v1/sessions", {})["session_id"]

    def delete_session(self, sid: str) -> None:
        # Short: this runs from ti.reset() and at interpreter exit, never worth a long wait.
        self.request("DELETE", f"/v1/sessions/{sid}", timeout=10.0)

    # ------------------------------------------------------------------ engine ops
    def batch(self, sid: str, ops: list[dict]) -> list[dict]:
        """Run ``ops``; their results. What their kernels printed goes to ``sys.stdout``."""
        body = self.json("POST", f"/v1/sessions/{sid}/batch", {"ops": ops})
        wire.show_output(body.get(wire.OUTPUT))
        return body["results"]

    def write(self, sid: str, fid: int, role: str, arr: np.ndarray) -> None:
        arr = np.ascontiguousarray(arr)
        headers = {"Content-Type": "application/octet-stream", "X-Dtype": arr.dtype.name,
                   "X-Shape": ",".join(str(s) for s in arr.shape)}
        path = f"/v1/sessions/{sid}/fields/{fid}/{_role_path(role)}"
        progress = _Progress(f"upload field {fid}", arr.nbytes)
        if progress.enabled:
            view = memoryview(arr).cast("B")

            def chunks():
                for k in range(0, len(view), _CHUNK):
                    part = bytes(view[k:k + _CHUNK])
                    progress.update(len(part))
                    yield part

            headers["Content-Length"] = str(arr.nbytes)
            self.stats.bytes_sent += arr.nbytes
            self.request("PUT", path, content=chunks, headers=headers)
        else:
            # The array's own memory as the body (no copy); a fresh iterator per attempt.
            view = memoryview(arr).cast("B") if arr.nbytes else memoryview(b"")
            headers["Content-Length"] = str(arr.nbytes)
            self.stats.bytes_sent += arr.nbytes
            self.request("PUT", path, content=lambda: iter([view]), headers=headers)

    def read(self, sid: str, fid: int, role: str, dtype: np.dtype,
             shape: tuple[int, ...]) -> np.ndarray:
        """The field's bytes straight into a new array (one copy, no JSON)."""
        httpx = self._httpx
        out = np.empty(shape, dtype=dtype)
        view = memoryview(out).cast("B") if out.nbytes else memoryview(b"")
        path = f"/v1/sessions/{sid}/fields/{fid}/{_role_path(role)}"
        progress = _Progress(f"download field {fid}", out.nbytes)
        for attempt in range(self.retries + 1):
            try:
                self.stats.round_trips += 1
                with self.client.stream("GET", path, headers={
                        "Accept": "application/octet-stream"}) as resp:
                    if resp.status_code >= 400:
                        resp.read()
                        raise self._error(resp)
                    pos = 0
                    for chunk in resp.iter_bytes():
                        end = pos + len(chunk)
                        if end > out.nbytes:
                            raise RemoteError(f"GET {path}: more bytes than {shape} {dtype}")
                        view[pos:end] = chunk
                        pos = end
                        self.stats.bytes_received += len(chunk)
                        progress.update(len(chunk))
                if pos != out.nbytes:
                    raise RemoteError(f"GET {path}: got {pos} bytes, expected {out.nbytes}")
                return out
            except (httpx.ReadError, httpx.RemoteProtocolError) as e:
                if attempt >= self.retries:
                    raise RemoteError(f"GET {path}: connection to {self.url} failed: {e}") \
                        from e
            except httpx.TransportError as e:
                raise RemoteError(f"GET {path}: cannot reach {self.url}: {e}") from e
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.lean is not None:
            self.lean.close()
        self.client.close()


class LocalTransport:
    """An :class:`~difftape.server.engine.Engine` in this interpreter, behind the same calls.

    Every op goes through a JSON round trip and every error through the same problem mapping
    as over HTTP, so what works here works over the wire (minus the network)."""

    def __init__(self, engine=None, **engine_kwargs: Any) -> None:
        self._owns_engine = engine is None
        if engine is None:
            from difftape.server.engine import Engine

            engine = Engine(**engine_kwargs)
        self.engine = engine
        self._sessions = 0
        self.stats = TransportStats()

    def create_session(self) -> str:
        self._sessions += 1
        return f"local-{self._sessions}"

    def delete_session(self, sid: str) -> None:
        pass

    def _run(self, op: dict, payload: bytes | None = None) -> tuple[Any, bytes | None]:
        from difftape.errors import DifftapeError, error_location

        text = json.dumps(op)
        self.stats.round_trips += 1
        self.stats.bytes_sent += len(text) + (len(payload) if payload is not None else 0)
        op = json.loads(text)
        try:
            result, out = self.engine.execute(op, payload)
        except DifftapeError as e:
            body = {"detail": getattr(e, "bare_message", None) or str(e),
                    "difftape_error": type(e).__name__, "kernel": getattr(e, "kernel", None),
                    "location": error_location(e), "index": getattr(e, "op_index", None)}
            wire.show_output(getattr(e, "printed", None))
            raise error_from_problem(422, body) from None
        text = json.dumps(result)
        self.stats.bytes_received += len(text) + (memoryview(out).nbytes if out is not None
                                                  else 0)
        return json.loads(text), out

    def batch(self, sid: str, ops: list[dict]) -> list[dict]:
        """Run ``ops``; their results. What their kernels printed goes to ``sys.stdout``."""
        body = self._run({"op": "batch", "ops": ops})[0]
        wire.show_output(body.get(wire.OUTPUT))
        return body["results"]

    def write(self, sid: str, fid: int, role: str, arr: np.ndarray) -> None:
        arr = np.ascontiguousarray(arr)
        self._run({"op": "write", "id": fid, "role": role, "dtype": arr.dtype.name,
                   "shape": list(arr.shape)}, arr.tobytes())

    def read(self, sid: str, fid: int, role: str, dtype: np.dtype,
             shape: tuple[int, ...]) -> np.ndarray:
        meta, data = self._run({"op": "read", "id": fid, "role": role})
        return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape).copy()

    def close(self) -> None:
        """Stop the worker threads of the engine this transport made (one given to it
        belongs to the caller); it starts them again if used after this."""
        if self._owns_engine:
            self.engine.close()


def default_server() -> str:
    return os.environ.get("DIFFTAPE_SERVER", "http://127.0.0.1:8000")


def default_token() -> str | None:
    return os.environ.get("DIFFTAPE_TOKEN") or None
