"""Engine worker processes and the gateway's handle on them.

Registering and launching kernels runs native code, so it happens only here, in processes
started with ``spawn`` (a fork would copy the gateway's threads, sockets and event loop into a
process that then loads LLVM). A worker that crashes takes only its own session with it.

Wire protocol over a ``multiprocessing`` pipe, no pickle of anything: every message is one
JSON frame (``send_bytes``). A small payload follows as one raw-bytes frame (the JSON says
``"_payload": true``); a large one (field data) goes through a memory-mapped file the two
processes share (``"_shm": nbytes``), because pushing megabytes through a socket pair costs
a context switch per socket buffer and several copies (measured: ~26 ms for a 4 MB round
trip on 2 busy cores, against ~2 copies' worth through the mapping). Requests are engine op
dicts; replies are ``{"ok": result}`` or ``{"error": {"type", "bases", "message", "kernel",
"index"}}``. One request is in flight per worker, so the mapping needs no locking.
"""

from __future__ import annotations

import asyncio
import ctypes
import importlib
import json
import logging
import mmap
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from difftape.errors import error_location

from .problems import ProblemError, engine_problem, server_stopping, session_lost

log = logging.getLogger("difftape.server")

_ctx = multiprocessing.get_context("spawn")


SHM_MIN = 64 * 1024  # payloads from this size on travel through the shared mapping
_SHM_INITIAL = 1 << 20
# A buffer that grew past this for one big transfer is shrunk back once the transfer is done:
# shared memory is scarce (a container's /dev/shm is 64 MiB by default), and one session's
# upload must not keep it.
SHM_KEEP = 8 << 20


class NoRoom(OSError):
    """The shared-memory folder has no room for the buffer: the payload goes through the
    pipe instead."""


def _reserve(fd: int, size: int) -> None:
    """Give the file ``size`` bytes *with* their pages: a file only grown with ``ftruncate``
    is sparse, and a write through the mapping into a page tmpfs cannot supply kills the
    process with SIGBUS. ``posix_fallocate`` fails with ENOSPC instead, before any write."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        raise NoRoom(e.errno, f"no room for a {size}-byte shared buffer: {e.strerror}") from None


class SharedBuffer:
    """A file mapped by the gateway and one worker. The gateway creates it and unlinks it
    once the worker has opened it too, so nothing is left behind when either dies. The side
    that needs more room grows the file (reserving its pages); the gateway shrinks it back
    after a big transfer. Either side checks the file's size before it writes and remaps
    when a header names another size, so neither ever touches a page past the end."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDWR)
        self.size = os.fstat(self.fd).st_size
        self.map = mmap.mmap(self.fd, self.size)

    @staticmethod
    def folder(configured: str | os.PathLike | None = None) -> str:
        if configured:
            return str(configured)
        return "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()

    @staticmethod
    def create(folder: str | None = None) -> str | None:
        """A new file named after this (gateway) process, so that files left by a gateway
        that died before its worker opened them can be recognised and removed; None when
        the folder has no room (the worker then moves every payload through its pipe)."""
        fd, path = tempfile.mkstemp(prefix=f"difftape-{os.getpid()}-",
                                    dir=SharedBuffer.folder(folder))
        try:
            _reserve(fd, _SHM_INITIAL)
        except NoRoom as e:
            log.warning("%s; worker payloads go through its pipe", e)
            os.close(fd)
            os.unlink(path)
            return None
        os.close(fd)
        return path

    @staticmethod
    def remove_stale(folder: str | None = None) -> int:
        """Unlink buffer files whose gateway process no longer exists."""
        removed = 0
        folder = SharedBuffer.folder(folder)
        for name in os.listdir(folder):
            parts = name.split("-")
            if len(parts) != 3 or parts[0] != "difftape" or not parts[1].isdigit():
                continue
            try:
                os.kill(int(parts[1]), 0)
                continue  # its gateway is alive
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
            try:
                os.unlink(os.path.join(folder, name))
                removed += 1
            except OSError:
                pass
        return removed

    def _remap(self, size: int) -> None:
        old, self.map = self.map, mmap.mmap(self.fd, size)
        self.size = size
        try:
            old.close()
        except BufferError:
            pass  # a view of the old mapping is still alive; it unmaps when that dies

    def put(self, data) -> int:
        """Copy ``data`` into the mapping; NoRoom if the file cannot grow to hold it."""
        view = memoryview(data).cast("B")
        n = view.nbytes
        actual = os.fstat(self.fd).st_size  # the other side may have shrunk or grown it
        if actual != self.size:
            self._remap(actual)
        if n > self.size:
            size = max(n, 2 * self.size)
            try:
                _reserve(self.fd, size)
            except NoRoom:
                if size == n:
                    raise
                _reserve(self.fd, n)
                size = n
            self._remap(size)
        self.map[:n] = view
        return n

    def get(self, n: int, size: int) -> memoryview:
        if size != self.size:
            self._remap(size)
        return memoryview(self.map)[:n]

    def shrink(self) -> None:
        """Give back the pages of a buffer that grew past SHM_KEEP (gateway side, while the
        worker waits for its next request)."""
        if self.size > SHM_KEEP:
            os.ftruncate(self.fd, _SHM_INITIAL)
            self._remap(_SHM_INITIAL)

    def close(self) -> None:
        try:
            self.map.close()
        except BufferError:
            pass
        os.close(self.fd)


_no_room_logged = False


def _frames(msg: dict, payload, shm: SharedBuffer | None) -> list:
    """The frames of one message: its JSON, then the payload when it does not travel
    through the mapping (small, no mapping, or no room in it)."""
    global _no_room_logged
    msg = dict(msg)
    if payload is not None:
        nbytes = memoryview(payload).nbytes
        if shm is not None and nbytes >= SHM_MIN:
            try:
                msg["_shm"] = shm.put(payload)
                msg["_shm_size"] = shm.size
                payload = None
            except NoRoom as e:
                if not _no_room_logged:
                    log.warning("%s; large payloads go through the worker pipes (slower). "
                                "Give the shared-memory folder more room (docker: shm_size)",
                                e)
                    _no_room_logged = True
    # The payload's size, so that the reader can take a big one off the event loop.
    msg["_payload"] = memoryview(payload).nbytes if payload is not None else False
    frames = [json.dumps(msg, allow_nan=True).encode()]
    if payload is not None:
        frames.append(payload)
    return frames


def _write(conn, frames: list) -> None:
    for f in frames:
        conn.send_bytes(f)


def _send(conn, msg: dict, payload, shm: SharedBuffer | None = None) -> None:
    _write(conn, _frames(msg, payload, shm))


def _big(frames: list) -> bool:
    return len(frames) > 1 and memoryview(frames[1]).nbytes >= SHM_MIN


def _finish_recv(conn, msg: dict, shm: SharedBuffer | None, copy: bool):
    size = msg.pop("_payload", False)
    payload = conn.recv_bytes() if size is not False and size is not None else None
    n = msg.pop("_shm", None)
    shm_size = msg.pop("_shm_size", None)
    if n is not None and shm is None:
        raise EOFError("the shared buffer is closed")
    if n is not None:
        view = shm.get(int(n), int(shm_size))
        if copy:
            payload = bytes(view)
            view.release()
        else:
            payload = view
    return msg, payload


def _recv(conn, shm: SharedBuffer | None = None, *, copy: bool = True):
    """(message, payload). A payload from the mapping is a view unless ``copy``; a view must
    be released before the next message."""
    return _finish_recv(conn, json.loads(conn.recv_bytes()), shm, copy)


def _error_dict(e: BaseException) -> dict:
    return {"type": type(e).__name__,
            "bases": [c.__name__ for c in type(e).__mro__],
            "message": getattr(e, "bare_message", None) or str(e),
            "kernel": getattr(e, "kernel", None),
            "location": error_location(e),
            "index": getattr(e, "op_index", None),
            "output": getattr(e, "printed", None),  # what the request printed before it
            "limit": getattr(e, "limit", None) if isinstance(getattr(e, "limit", None), str)
            else None}


#: A worker that stops itself because an op ran past the kernel time limit exits with this.
EXIT_TIME_LIMIT = 124
#: ... and with this when it finds its gateway gone.
EXIT_ORPHANED = 125


def _die_with(parent: int | None) -> None:
    """Have the kernel kill this process when its gateway dies, however it dies (``kill -9``
    included): a worker whose gateway is gone serves no one, and one stuck in an endless
    kernel would burn a core until the machine restarts. The signal is tied to the thread
    that started the process: the gateway starts workers from its event-loop (main)
    thread."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if parent is not None and os.getppid() != parent:
        os._exit(EXIT_ORPHANED)  # the gateway died before the line above took effect


class _Watchdog(threading.Thread):
    """The worker's own guard, independent of the gateway: exits the process when an op
    runs past the kernel time limit (plus a little slack, so the gateway, which reports a
    KernelTimeoutError, normally acts first) or when the gateway is gone. A thread can do
    this while a kernel runs: native code runs without the GIL."""

    def __init__(self, parent: int | None, limit: float | None) -> None:
        super().__init__(name="difftape-watchdog", daemon=True)
        self.parent = parent
        self.limit = None if limit is None else limit + max(1.0, 0.05 * limit)
        self.busy_since: float | None = None

    def run(self) -> None:
        while True:
            time.sleep(0.25)
            if self.parent is not None and os.getppid() != self.parent:
                os._exit(EXIT_ORPHANED)
            t = self.busy_since
            if self.limit is not None and t is not None and time.monotonic() - t > self.limit:
                os._exit(EXIT_TIME_LIMIT)


def _reply_or_quit(conn, msg: dict) -> bool:
    """Send a control reply; False if the gateway has gone (it stopped, or gave up waiting)
    meanwhile: nobody is left to tell, and that is no error worth a traceback."""
    try:
        _send(conn, msg, None)
        return True
    except OSError:  # BrokenPipeError, ConnectionResetError
        return False


def _ask(conn, ask: dict) -> dict:
    """Ask the gateway, within the op being served, for more of the user's memory quota
    (``Engine._grant``); its answer. The gateway reads the ask in place of the op's reply
    and writes its answer before it waits for that reply again."""
    _send(conn, {"ask": ask}, None)
    return _recv(conn)[0]


def worker_main(conn, engine_spec: str, engine_kwargs: dict, shm_path: str | None = None,
                parent: int | None = None, time_limit: float | None = None) -> None:
    """The worker's loop: build the engine, say ready, then serve ops until EOF."""
    _die_with(parent)
    # Ctrl-C on the server goes to the whole process group; the gateway decides when workers
    # stop (after saving their sessions), so ignore it here.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watchdog = _Watchdog(parent, time_limit)
    watchdog.start()
    cache_dir = engine_kwargs.get("cache_dir")
    if cache_dir:
        os.environ["DIFFTAPE_CACHE_DIR"] = cache_dir
    try:
        module, _, cls = engine_spec.partition(":")
        engine = getattr(importlib.import_module(module), cls)(**engine_kwargs)
    except BaseException as e:  # noqa: BLE001 - reported to the gateway, then exit
        _reply_or_quit(conn, {"error": _error_dict(e)})
        return
    shm = SharedBuffer(shm_path) if shm_path else None
    if getattr(engine, "scratch_grant", None) is not None:
        engine.ask_scratch = lambda ask: _ask(conn, ask)
    if not _reply_or_quit(conn, {"ok": {"pid": os.getpid()}}):
        return
    while True:
        try:
            # The engine reads a mapped payload in place (np.frombuffer + copy into the
            # field): one copy from the gateway's buffer to the field.
            op, payload = _recv(conn, shm, copy=False)
        except (EOFError, OSError):
            return
        if op.get("op") == "_shutdown":
            try:  # the last counters, so that the gateway's metrics keep them
                final = engine.execute({"op": "stats"}, None)[0]
            except Exception:  # noqa: BLE001 - an engine without stats
                final = {}
            close = getattr(engine, "close", None)
            if close is not None:
                close()  # its thread pool would otherwise hold up the process's exit
            _reply_or_quit(conn, {"ok": final})
            return
        watchdog.busy_since = time.monotonic()
        try:
            result, out = engine.execute(op, payload)
            reply = {"ok": result if result is not None else {}}
        except Exception as e:  # noqa: BLE001 - every error becomes a reply
            reply, out = {"error": _error_dict(e)}, None
        finally:
            watchdog.busy_since = None
            if isinstance(payload, memoryview):
                payload.release()
            payload = None
        try:
            _send(conn, reply, out, shm)
        except (BrokenPipeError, OSError):
            return


# Threads that wait on worker pipes. Most of the time they sit in poll(), so many are cheap;
# the event loop's default executor (cpu_count + 4 threads) would cap concurrent sessions.
_executor = ThreadPoolExecutor(max_workers=256, thread_name_prefix="difftape-pipe")


class StartLost(RuntimeError):
    """An engine died while starting for a reason outside it (a Ray actor placed on a node
    the cluster had not yet found lost): ``EnginePool`` starts another while its start
    timeout lasts, where a local process that dies at start (a broken set-up) fails at once."""


class WorkerGone(Exception):
    """The worker process died or was killed; ``reason`` says which."""

    def __init__(self, reason: str, *, timeout: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.timeout = timeout


def reachable_by_name(address: str | None) -> bool:
    """Whether every gateway of the database reaches the engine at ``address`` (a named Ray
    actor, ``ray:...``), not only the gateway that started it (a local worker process): a
    request for such a session is served by whichever gateway gets it, never forwarded."""
    return bool(address) and address.startswith("ray:")


class WorkerMoved(Exception):
    """The engine refused the call, which did not run: another gateway of the database took
    the session over since this one last did (a Ray actor any gateway reaches by name;
    ``server/raycluster.py``). A local worker process never raises it."""


#: how a CUDA engine's modules were loaded (``runtime/cuda.py`` CodeLoads), counted as such
CODE_LOADS = ("cubin_cached", "cubin_assembled", "ptx_jit")


@dataclass
class WorkerStats:
    """The last stats a worker reported (kept after it stops, for monotonic counters)."""

    launches: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    compile_s: float = 0.0
    field_bytes: int = 0
    scratch_bytes: int = 0  # held (the engine's ``scratch``), and reserved in the quota
    scratch_granted: int = 0
    # CUDA engines: module loads by kind (CODE_LOADS), and the device as last reported
    code_loads: dict[str, int] = field(default_factory=dict)
    device: dict[str, Any] | None = None

    @classmethod
    def from_reply(cls, s: dict) -> WorkerStats:
        """From the engine's ``stats`` op."""
        loads = s.get("code_loads") or {}
        return cls(launches=int(s.get("launches", 0)), cache_hits=int(s.get("cache_hits", 0)),
                   cache_misses=int(s.get("cache_misses", 0)),
                   compile_s=float(s.get("compile_s", 0)),
                   field_bytes=int(s.get("field_bytes", 0)),
                   scratch_bytes=sum(int(v) for v in (s.get("scratch") or {}).values()),
                   scratch_granted=int(s.get("scratch_grant") or 0),
                   code_loads={k: int(loads.get(k, 0)) for k in CODE_LOADS},
                   device=s.get("device"))

    def since(self, before: WorkerStats) -> WorkerStats:
        """The counters' growth since ``before`` (the same worker's earlier figures)."""
        return WorkerStats(self.launches - before.launches, self.cache_hits - before.cache_hits,
                           self.cache_misses - before.cache_misses,
                           self.compile_s - before.compile_s, 0, 0, 0,
                           {k: self.code_loads.get(k, 0) - before.code_loads.get(k, 0)
                            for k in CODE_LOADS})


def _start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot), which with the pid identifies it:
    a pid alone may have been reused. None if it does not exist (or there is no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    if fields[0] == b"Z":
        return None  # a zombie: already dead
    return int(fields[19])


class WorkerRegistry:
    """Which gateway started which worker, one small file per worker under the data dir, so
    that a starting gateway can stop workers a dead gateway left behind. Workers die with
    their gateway (``_die_with``); this covers what that cannot (a platform without it, a
    worker caught between fork and that call)."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = str(folder)
        os.makedirs(self.folder, exist_ok=True)

    def add(self, pid: int) -> None:
        entry = {"gateway": os.getpid(), "gateway_start": _start_time(os.getpid()),
                 "start": _start_time(pid)}
        with open(os.path.join(self.folder, f"{pid}.json"), "w") as f:
            json.dump(entry, f)

    def remove(self, pid: int) -> None:
        try:
            os.unlink(os.path.join(self.folder, f"{pid}.json"))
        except OSError:
            pass

    def reap(self) -> list[int]:
        """Kill the still-running workers of gateways that are gone; the pids killed."""
        killed = []
        for name in os.listdir(self.folder):
            if not name.endswith(".json") or not name[:-5].isdigit():
                continue
            pid = int(name[:-5])
            try:
                with open(os.path.join(self.folder, name)) as f:
                    entry = json.load(f)
                gateway, g_start, start = entry["gateway"], entry["gateway_start"], entry["start"]
            except (OSError, ValueError, KeyError, TypeError):
                self.remove(pid)
                continue
            if gateway == os.getpid() or (g_start is not None
                                          and _start_time(gateway) == g_start):
                continue  # its gateway still runs (this one, or another on this data dir)
            if start is not None and _start_time(pid) == start:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                    log.warning("stopped worker %d left running by a gateway that died", pid)
                except OSError:
                    pass
            self.remove(pid)
        return killed


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _expire(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


class EngineWorker:
    """What the gateway holds for a session's engine: a local worker process (``Worker``) or
    a Ray actor (``difftape.server.raycluster.RayWorker``). Calls are serialized by ``lock``;
    ``gone`` is set once the engine is lost (every later call raises it). The rules both
    follow (which ops run, how a reply or an overrun ends) are here, once; the two differ
    only in how an op reaches the engine."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.gone: WorkerGone | None = None
        self.draining = False  # the server is stopping: only a save may still run
        self.current: str | None = None  # the op in flight
        self.stats = WorkerStats()
        # Answers the engine's asks for more of the user's memory quota (``_answer_ask``);
        # set by the gateway holding the session.
        self.on_ask: Callable[[dict], dict] | None = None
        # The session's epoch in the database when this gateway last took it: an engine any
        # gateway reaches (a Ray actor) refuses calls with an older epoch than it has seen
        # (``WorkerMoved``); a local worker, only ever reached by its own gateway, ignores it.
        self.epoch = 0

    @property
    def address(self) -> str:
        raise NotImplementedError

    def alive(self) -> bool:
        raise NotImplementedError

    def wait_ready(self, timeout: float) -> None:
        """Block until the engine is built (blocking; run in a thread)."""
        raise NotImplementedError

    async def call(self, op: dict, payload=None, *, timeout: float) -> tuple[dict, Any]:
        """Run one engine op: ``(result, payload)``; ProblemError for engine errors,
        WorkerGone once the engine is lost (or the op ran past ``timeout``)."""
        raise NotImplementedError

    def kill(self) -> None:
        """Stop the engine now; a call in flight gets WorkerGone."""
        raise NotImplementedError

    def stop(self, timeout: float = 5.0) -> None:
        """Take the last counters and stop the engine (blocking)."""
        raise NotImplementedError

    def _admit(self, op: dict) -> None:
        """Whether ``op`` may run now (called holding ``lock``): not on a lost engine, and
        nothing but a save while the server stops."""
        if self.gone is not None:
            raise self.gone
        if self.draining and op.get("op") != "save":
            raise server_stopping()

    def _overran(self, timeout: float, what: str) -> WorkerGone:
        """The op ran past the kernel time limit: the engine (``what``) is stopped and the
        session lost, with that reason."""
        self.gone = WorkerGone(f"the operation ran longer than the kernel time limit "
                               f"({timeout:g} s); its {what} was stopped", timeout=True)
        self.kill()
        return self.gone

    def _answer_ask(self, ask: Any) -> dict:
        """The answer to an engine's ask (``{"grant": bytes}``, ``{"refuse": why}`` or
        ``{"unavailable": why}``: ``Engine._grant``)."""
        if not isinstance(ask, dict) or self.on_ask is None:
            return {"refuse": "memory quota: no more memory for a request that is no longer "
                              "awaited"}
        try:
            return self.on_ask(ask)
        except ProblemError as p:  # the quota's (429) is a refusal, the server's a failure
            return {"refuse" if p.status == 429 else "unavailable": p.detail}
        except Exception as e:  # noqa: BLE001 - the engine waits for an answer
            # The gateway's fault (its database failed), not the request's: a 503, retried.
            log.exception("could not answer an engine's ask for memory")
            return {"unavailable": "memory quota: the gateway could not reserve the memory "
                                   f"(it failed: {type(e).__name__}, in its log); retry"}

    @staticmethod
    def _answer(reply: dict, payload) -> tuple[dict, Any]:
        """The engine's reply (``{"ok": result}`` or ``{"error": ...}``) as ``call``
        returns it."""
        if "error" in reply:
            raise engine_problem(reply["error"])
        return reply["ok"], payload

    def _keep_stats(self, final: Any) -> None:
        """Keep the engine's last ``stats`` reply (sent as it stops) as the final counters."""
        if isinstance(final, dict) and "cache_misses" in final:
            self.stats = WorkerStats.from_reply(final)


class Worker(EngineWorker):
    """One engine process; calls are serialized (a session's ops run in order).

    Construct it on the event loop's thread (the main thread): the worker's parent-death
    signal is tied to the thread that starts it."""

    def __init__(self, engine_spec: str, engine_kwargs: dict, *, shm_dir: str | None = None,
                 time_limit: float | None = None,
                 registry: WorkerRegistry | None = None) -> None:
        super().__init__()
        self._conn, child = _ctx.Pipe(duplex=True)
        self._shm_path: str | None = SharedBuffer.create(shm_dir)
        self.shm = SharedBuffer(self._shm_path) if self._shm_path else None
        self.proc = _ctx.Process(target=worker_main,
                                 args=(child, engine_spec, engine_kwargs, self._shm_path,
                                       os.getpid(), time_limit),
                                 daemon=True, name="difftape-worker")
        self.proc.start()
        child.close()  # so that the worker's death reads as EOF here
        self.pid = self.proc.pid
        self.registry = registry
        if registry is not None:
            registry.add(self.pid)
        self._unread = 0  # replies of cancelled calls still to be read
        self._io = threading.Lock()

    @property
    def address(self) -> str:
        return f"local:{self.pid}"

    def alive(self) -> bool:
        return self.proc.is_alive()

    def _close_shm(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None

    def _unlink_shm(self) -> None:
        if self._shm_path is not None:
            try:
                os.unlink(self._shm_path)
            except OSError:
                pass
            self._shm_path = None

    def wait_ready(self, timeout: float) -> None:
        try:
            msg, _ = self._exchange(None, None, timeout)
        finally:
            self._unlink_shm()  # both sides have it open (or the worker never will)
        if "error" in msg:
            self.kill()
            err = msg["error"]
            raise RuntimeError(f"worker could not start its engine: {err['type']}: "
                               f"{err['message']}")

    def _exchange(self, op: dict | None, payload, timeout: float) -> tuple[dict, bytes | None]:
        with self._io:
            if self.gone is not None:
                raise self.gone
            try:
                return self._exchange_locked(op, payload, timeout)
            finally:
                if self.gone is not None:
                    self._close_channel()

    def _exchange_locked(self, op, payload, timeout: float) -> tuple[dict, bytes | None]:
        try:
            if op is not None:
                _send(self._conn, op, payload, self.shm)
            deadline = time.monotonic() + timeout
            while not self._conn.poll(min(0.25, max(0.0, deadline - time.monotonic()))):
                if not self.proc.is_alive():
                    raise self._died()
                if time.monotonic() >= deadline:
                    raise self._overran(timeout, "worker")
            return _recv(self._conn, self.shm)
        except (EOFError, BrokenPipeError, ConnectionResetError, OSError):
            raise self._died() from None

    def _died(self) -> WorkerGone:
        self.proc.join(timeout=1)
        code = self.proc.exitcode
        if code == EXIT_TIME_LIMIT:
            self.gone = WorkerGone("the operation ran longer than the kernel time limit; its "
                                   "worker stopped itself", timeout=True)
            return self.gone
        how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        self.gone = WorkerGone(f"the session's worker process died ({how})")
        return self.gone

    async def _reply(self, timeout: float) -> tuple[dict, bytes | None]:
        """Wait (in the loop) until the pipe is readable, then read one reply. A bare future
        woken by the reader callback, with a timer for the limit: no task, event or
        ``wait_for`` per op (this runs once per request)."""
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        fd = self._conn.fileno()
        loop.add_reader(fd, _wake, ready)
        timer = loop.call_later(timeout, _expire, ready)
        try:
            await ready
        except TimeoutError:
            raise self._overran(timeout, "worker") from None
        finally:
            timer.cancel()
            loop.remove_reader(fd)
            # uvloop (libuv) makes a watched descriptor non-blocking; the reads below, and
            # the next request's writes, expect a blocking one.
            os.set_blocking(fd, True)
        msg = json.loads(self._conn.recv_bytes())
        size = msg.get("_payload")
        if isinstance(size, int) and not isinstance(size, bool) and size >= SHM_MIN:
            # A big payload in the pipe (no room in shared memory): read it off the loop.
            return await loop.run_in_executor(_executor, _finish_recv, self._conn, msg,
                                              self.shm, True)
        return _finish_recv(self._conn, msg, self.shm, True)

    async def _write(self, frames: list) -> None:
        if not _big(frames):
            _write(self._conn, frames)
            return
        # Megabytes through the pipe (no room in shared memory) would hold the event loop
        # until the worker has read them: write from a thread, and finish the write even if
        # the call is cancelled, so no other request's frames interleave with these.
        fut = asyncio.get_running_loop().run_in_executor(_executor, _write, self._conn, frames)
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            await asyncio.wait([fut])
            raise

    async def call(self, op: dict, payload=None, *, timeout: float) -> tuple[dict, bytes | None]:
        """Run one engine op; raise ProblemError for engine errors, WorkerGone if it died.

        The request is written and the reply read in the event loop, woken by the pipe
        becoming readable: no thread hop per op (two context switches, which on a busy
        2-core machine cost more than the op). The worker reads requests as they come and
        writes replies whole, so these reads and writes do not wait on it for long."""
        async with self.lock:
            self._admit(op)
            sent = False
            try:
                # A call cancelled while its op ran left that op's reply in the pipe: read
                # it first, so replies stay paired with their requests.
                while self._unread:
                    stale, _ = await self._reply(timeout)
                    if "ask" in stale:  # that op still runs, and waits for an answer
                        _write(self._conn, _frames(self._answer_ask(None), None, None))
                        continue
                    self._unread -= 1
                frames = _frames(op, payload, self.shm)
                sent = True
                self.current = op.get("op")
                await self._write(frames)
                msg, out = await self._reply(timeout)
                while "ask" in msg:  # the engine needs more of the quota to go on
                    _write(self._conn, _frames(self._answer_ask(msg["ask"]), None, None))
                    msg, out = await self._reply(timeout)
                sent = False
                self.current = None
                if self.shm is not None:
                    self.shm.shrink()  # the worker waits for its next request now
            except (EOFError, OSError, ValueError):
                # EOF: the worker died; OSError/ValueError: its pipe or buffer is closed.
                if self.gone is None:
                    self._died()
                raise self.gone from None
            finally:
                if sent and self.gone is None:
                    self._unread += 1  # cancelled between request and reply
                if self.gone is not None:
                    self._close_channel()
        return self._answer(msg, out)

    def kill(self) -> None:
        """Stop the process now. The pipe and the mapping are closed here only if no call
        is using them; otherwise that call closes them once it has let go of the pipe (its
        descriptor must not be closed, and its number reused, while the event loop still
        watches it)."""
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        if self.registry is not None and not self.proc.is_alive():
            self.registry.remove(self.pid)
        self._unlink_shm()
        if self.gone is None:
            self.gone = WorkerGone("the worker was stopped")
        if not self.lock.locked() and self._io.acquire(blocking=False):
            try:
                self._close_channel()
            finally:
                self._io.release()

    def _close_channel(self) -> None:
        self._close_shm()
        try:
            self._conn.close()
        except OSError:
            pass

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the worker to exit; kill it if it does not (blocking). Its reply carries its
        last counters: ``self.stats`` is final afterwards."""
        if self.gone is None and self.proc.is_alive():
            try:
                with self._io:
                    _send(self._conn, {"op": "_shutdown"}, None)
                    if self._conn.poll(timeout):
                        self._keep_stats(_recv(self._conn)[0].get("ok"))
            except (EOFError, OSError, ValueError):
                pass
            self.proc.join(timeout=timeout)
        self.gone = self.gone or WorkerGone("the worker was stopped")
        self.kill()


class EnginePool:
    """What both pools share: ``spare`` ready engines of the default resources, topped up in
    the background whenever one is taken, and the start state /readyz reports. A pool
    says how it starts one engine (``_spawn``) and which resources it takes (``resources``,
    ``check``); the local one (``WorkerPool``) and the Ray one
    (``difftape.server.raycluster.RayWorkerPool``)."""

    #: What the log calls one engine.
    kind = "worker"

    def __init__(self, engine_spec: str, engine_kwargs: dict, spare: int,
                 start_timeout: float) -> None:
        self.engine_spec = engine_spec
        self.engine_kwargs = engine_kwargs
        self.spare = spare
        self.start_timeout = start_timeout
        self.default: dict[str, float] = {}  # the resources of a spare
        self._ready: list[EngineWorker] = []
        self._filling: asyncio.Task | None = None
        self._fill_lock = asyncio.Lock()
        self.started_ok = False
        self.start_error: str | None = None

    def check(self, asked: dict[str, float] | None) -> None:
        """A 422 ProblemError when sessions asking ``asked`` could never be placed."""
        raise NotImplementedError

    def resources(self, asked: dict[str, float] | None) -> dict[str, float]:
        """The session's resources: what it asked, over the defaults."""
        return {**self.default, **(asked or {})}

    def _spawn(self, resources: dict[str, float]) -> EngineWorker:
        """Start one engine (on the event loop's thread); ``_start`` waits for it."""
        raise NotImplementedError

    async def _start(self, resources: dict[str, float]) -> EngineWorker:
        """One ready engine within ``start_timeout``; one lost while starting (``StartLost``)
        is replaced, after a pause that doubles, while the timeout lasts."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.start_timeout
        pause = 0.25
        while True:
            try:
                w = self._spawn(resources)
                await loop.run_in_executor(_executor, w.wait_ready,
                                           max(0.1, deadline - loop.time()))
                break
            except StartLost as e:
                if loop.time() + pause < deadline:
                    log.warning("a %s died while starting (%s); starting another", self.kind, e)
                    await asyncio.sleep(pause)
                    pause = min(4.0, 2 * pause)
                    continue
                self.start_error = str(e)
                raise
            except Exception as e:
                self.start_error = str(e)
                raise
        self.started_ok, self.start_error = True, None
        return w

    async def fill(self) -> None:
        async with self._fill_lock:  # the start-up probe and a refill must not both start one
            while len(self._ready) < self.spare:
                self._ready.append(await self._start(self.default))

    def _refill_soon(self) -> None:
        if self.spare and (self._filling is None or self._filling.done()):
            self._filling = asyncio.ensure_future(self._fill_quietly())

    async def _fill_quietly(self) -> None:
        try:
            await self.fill()
        except Exception as e:  # noqa: BLE001 - reported through /readyz
            log.error("could not start a spare %s: %s", self.kind, e)

    async def get(self, resources: dict[str, float] | None = None) -> EngineWorker:
        """A ready engine with these resources (a spare, if one of the default is alive)."""
        res = self.resources(resources)
        if res == self.default:
            while self._ready:
                w = self._ready.pop()
                if w.alive():
                    self._refill_soon()
                    return w
        try:
            w = await self._start(res)
        except Exception as e:
            raise ProblemError(503, f"could not start a worker: {e}") from e
        if res == self.default:
            self._refill_soon()
        return w

    async def close(self) -> None:
        if self._filling is not None:
            self._filling.cancel()
        loop = asyncio.get_running_loop()
        for w in self._ready:
            await loop.run_in_executor(_executor, w.stop)
        self._ready.clear()


class WorkerPool(EnginePool):
    """Local worker processes (``Worker``), on this gateway's machine."""

    def __init__(self, engine_spec: str, engine_kwargs: dict, spare: int,
                 start_timeout: float, *, shm_dir: str | None = None,
                 time_limit: float | None = None, registry: WorkerRegistry | None = None
                 ) -> None:
        super().__init__(engine_spec, engine_kwargs, spare, start_timeout)
        self.shm_dir = shm_dir
        self.time_limit = time_limit
        self.registry = registry

    def _spawn(self, resources: dict[str, float]) -> Worker:
        # Started here, on the loop's thread (see Worker); ``_start`` waits in a thread.
        return Worker(self.engine_spec, self.engine_kwargs, shm_dir=self.shm_dir,
                      time_limit=self.time_limit, registry=self.registry)

    def check(self, resources: dict[str, float] | None) -> None:
        """Sessions of local workers take no resource requests: a request that could not be
        honoured is refused, not ignored."""
        if resources:
            raise ProblemError(422, "this server runs sessions in local worker processes, "
                                    "which take no 'resources'; run it with --cluster (a Ray "
                                    "cluster) to place sessions by CPUs and GPUs")

    def resources(self, asked: dict[str, float] | None) -> dict[str, float]:
        self.check(asked)
        return {}


__all__ = ["EnginePool", "EngineWorker", "StartLost", "Worker", "WorkerGone", "WorkerMoved",
           "WorkerPool", "WorkerRegistry", "reachable_by_name", "session_lost", "worker_main"]
