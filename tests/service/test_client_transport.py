"""The client's HTTP transport (``difftape.client.transport.HttpTransport``): requests with
their body in memory (batches, a replayed graph's one request per step) go over one
keep-alive connection, each written whole in one send, so that the gateway wakes once per
request; streamed bodies, https and proxied URLs stay with httpx. Against a real server, and
against a stub server for what a real one does rarely (closing an idle connection, dying
mid-request)."""

from __future__ import annotations

import base64
import json
import os
import resource
import socket
import threading

import numpy as np
import pytest

from difftape.client.errors import RemoteError
from difftape.client.transport import HttpTransport


class _Counting:
    """``socket.create_connection`` replaced: counts the connections made and the write
    calls (``send``/``sendall``) on them."""

    def __init__(self, monkeypatch) -> None:
        self.connections = 0
        self.writes = 0
        real = socket.create_connection
        counter = self

        class Sock(socket.socket):
            def send(self, data, *args):
                counter.writes += 1
                return super().send(data, *args)

            def sendall(self, data, *args):
                counter.writes += 1
                return super().sendall(data, *args)

        def create_connection(*args, **kwargs):
            s = real(*args, **kwargs)
            counter.connections += 1
            timeout = s.gettimeout()
            out = Sock(fileno=s.detach())
            out.settimeout(timeout)
            return out

        monkeypatch.setattr(socket, "create_connection", create_connection)


def test_batch_is_one_write_on_one_connection(service, monkeypatch):
    """Each batch request is one write (headers and body together) on a connection kept
    for the next: httpx wrote the headers and the body in two sends, waking the gateway
    twice per step."""
    counting = _Counting(monkeypatch)
    t = HttpTransport(service.url, service.tokens["alice"])
    try:
        sid = t.create_session()
        t.batch(sid, [{"op": "create_field", "id": 1, "dtype": "f32", "shape": [4],
                       "element_shape": []},
                      {"op": "fill", "id": 1, "value": 2.5}])
        before = counting.writes
        for _ in range(5):
            (res,) = t.batch(sid, [{"op": "get_bytes", "id": 1, "role": "primal"}])
            got = np.frombuffer(base64.b64decode(res["b64"]), np.float32)
            np.testing.assert_array_equal(got, np.full(4, 2.5, np.float32))
        assert counting.writes - before == 5
        assert counting.connections == 1
        t.delete_session(sid)
    finally:
        t.close()


def test_threads_share_a_transport(service):
    """Requests made at once from several threads all get their own answers (one on the
    kept connection, the others through httpx)."""
    t = HttpTransport(service.url, service.tokens["alice"])
    try:
        sid = t.create_session()
        t.batch(sid, [{"op": "create_field", "id": k, "dtype": "f32", "shape": [],
                       "element_shape": []} for k in range(1, 5)]
                + [{"op": "fill", "id": k, "value": float(k)} for k in range(1, 5)])
        errors, seen = [], {}

        def read(k: int) -> None:
            try:
                for _ in range(10):
                    (res,) = t.batch(sid, [{"op": "get_item", "id": k, "index": []}])
                    seen.setdefault(k, set()).add(res["value"])
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=read, args=(k,)) for k in range(1, 5)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors, errors
        assert seen == {k: {float(k)} for k in range(1, 5)}
        t.delete_session(sid)
    finally:
        t.close()


class _Stub:
    """An HTTP/1.1 server on a raw socket that answers ``{"n": request number}`` and then,
    per ``plan`` (one entry per request), keeps the connection ("keep"), closes it after
    answering ("close": an idle keep-alive timeout, seen by the client before it reuses the
    connection), or closes it without answering ("drop")."""

    def __init__(self, plan: list[str]) -> None:
        self.plan = plan
        self.requests: list[tuple[int, str]] = []  # (connection number, request line)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn_no = 0
        while len(self.requests) < len(self.plan):
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            conn_no += 1
            with conn:
                buf = b""
                while len(self.requests) < len(self.plan):
                    while b"\r\n\r\n" not in buf:
                        chunk = conn.recv(65536)
                        if not chunk:
                            break
                        buf += chunk
                    if b"\r\n\r\n" not in buf:
                        break
                    head, _, buf = buf.partition(b"\r\n\r\n")
                    lines = head.decode().split("\r\n")
                    length = next((int(x.split(":")[1]) for x in lines
                                   if x.lower().startswith("content-length:")), 0)
                    while len(buf) < length:
                        buf += conn.recv(65536)
                    buf = buf[length:]
                    self.requests.append((conn_no, lines[0]))
                    what = self.plan[len(self.requests) - 1]
                    if what == "drop":
                        break
                    body = json.dumps({"n": len(self.requests)}).encode()
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: " + str(len(body)).encode() +
                                 b"\r\n\r\n" + body)
                    if what == "close":
                        break

    def close(self) -> None:
        self.listener.close()
        self.thread.join(5)


def test_connection_closed_while_idle_is_replaced():
    """The server closes the kept connection after answering (its keep-alive timeout): the
    next request, a POST that is never repeated, goes on a new connection and succeeds."""
    stub = _Stub(["close", "keep", "keep"])
    t = HttpTransport(stub.url, "tok")
    try:
        assert t.lean is not None
        assert t.json("POST", "/a", {"x": 1}) == {"n": 1}
        threading.Event().wait(0.2)  # the close arrives
        assert t.json("POST", "/b", {"x": 2}) == {"n": 2}
        assert t.json("POST", "/c", {"x": 3}) == {"n": 3}
    finally:
        t.close()
        stub.close()
    assert stub.requests == [(1, "POST /a HTTP/1.1"), (2, "POST /b HTTP/1.1"),
                             (2, "POST /c HTTP/1.1")]


def test_dropped_post_is_not_repeated_and_get_is():
    """A connection lost after the request was sent: a POST (which may have run) raises and
    is sent once; a GET is sent again, on a new connection."""
    stub = _Stub(["drop", "drop", "keep"])
    t = HttpTransport(stub.url, "tok")
    try:
        with pytest.raises(RemoteError, match="POST /a: connection to .* failed"):
            t.json("POST", "/a", {"x": 1})
        assert t.json("GET", "/b") == {"n": 3}
    finally:
        t.close()
        stub.close()
    assert stub.requests == [(1, "POST /a HTTP/1.1"), (2, "GET /b HTTP/1.1"),
                             (3, "GET /b HTTP/1.1")]


def test_https_and_proxies_keep_httpx(monkeypatch):
    """Over https (a TLS reverse proxy) or an HTTP proxy from the environment, every
    request goes through httpx (its trust store, its proxy support)."""
    for var in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    assert HttpTransport("http://127.0.0.1:9", "t").lean is not None
    assert HttpTransport("https://example.org", "t").lean is None
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.example:3128")
    assert HttpTransport("http://127.0.0.1:9", "t").lean is None


def test_descriptor_past_select_limit():
    """The kept connection is checked before reuse with ``poll``: ``select`` raised
    ValueError for a socket descriptor past 1023 (a process with many files open)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"needs 1200 open files; the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    stub = _Stub(["keep", "keep"])
    t = HttpTransport(stub.url, "tok")
    try:
        assert t.json("POST", "/a", {}) == {"n": 1}
        assert t.lean.sock.fileno() > 1023
        assert t.json("POST", "/b", {}) == {"n": 2}
    finally:
        t.close()
        stub.close()
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
