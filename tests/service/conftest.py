"""Shared fixtures of the service tests: real uvicorn servers on free loopback ports.

``service`` (session scope) is one server with generous limits and two users; ``limited``
(module scope, built with ``start_server``) has tiny quotas and a short kernel time limit.
Servers run in subprocesses (``python -m difftape.server``), exactly as deployed, each with a
fresh data dir and tokens made by ``difftape token create``.
"""

from __future__ import annotations

import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def create_tokens(data_dir: Path, names, env: dict | None = None) -> dict[str, str]:
    """``difftape token create NAME`` for each name, in one interpreter (each start costs
    seconds on a busy machine); ``env``: the server's environment (its database)."""
    names = list(names)
    if not names:
        return {}
    code = ("import sys\nfrom difftape.cli import main\n"
            "for name in sys.argv[2:]:\n"
            "    assert main(['token', 'create', name, '--data-dir', sys.argv[1]]) == 0\n")
    out = subprocess.run([sys.executable, "-c", code, str(data_dir), *names], check=True,
                         capture_output=True, text=True, timeout=60, env=env)
    tokens = out.stdout.split()
    assert len(tokens) == len(names), out
    return dict(zip(names, tokens, strict=True))


@dataclass
class Server:
    """A running server: its URL, data dir, users' tokens and process."""

    url: str
    port: int
    data_dir: Path
    tokens: dict[str, str]
    proc: subprocess.Popen
    log_path: Path
    env: dict = field(default_factory=dict)

    def client(self, user: str = "alice", **kwargs) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.tokens[user]}"} if user else {}
        headers.update(kwargs.pop("headers", {}))
        return httpx.Client(base_url=self.url, headers=headers, timeout=120, **kwargs)

    def db(self) -> sqlite3.Connection:
        return sqlite3.connect(str(self.data_dir / "difftape.sqlite3"))

    def worker_pid(self, sid: str) -> int:
        with self.db() as db:
            (worker,) = db.execute("SELECT worker FROM sessions WHERE id = ?",
                                   (sid,)).fetchone()
        return int(worker.split(":")[1])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 30) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_server(data_dir: Path, users=("alice", "bob"), tokens: dict | None = None,
                 wait_ready: bool = True, wrap: list[str] | None = None, **settings) -> Server:
    """Start ``python -m difftape.server`` with ``DIFFTAPE_<NAME>`` settings; wait until
    /readyz says ready (or only /livez with ``wait_ready=False``). ``wrap`` is a command
    that execs the server's command line it is given as arguments (e.g. ``unshare``)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update({f"DIFFTAPE_{k.upper()}": str(v) for k, v in settings.items()})
    env.setdefault("DIFFTAPE_WORKER_THREADS", "2")
    tokens = dict(tokens or {})
    tokens.update(create_tokens(data_dir, [u for u in users if u not in tokens], env))
    port = free_port()
    log_path = data_dir / f"server-{port}.log"
    logf = open(log_path, "wb")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen([*(wrap or []), sys.executable, "-m", "difftape.server", "--port",
                             str(port), "--data-dir", str(data_dir)], env=env, stdout=logf,
                            stderr=subprocess.STDOUT, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    server = Server(url, port, data_dir, tokens, proc, log_path, env)
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()}")
        try:
            probe = "/readyz" if wait_ready else "/livez"
            if httpx.get(url + probe, timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"server did not become ready:\n{server.log()}")
        time.sleep(0.1)


@pytest.fixture(scope="session")
def service(tmp_path_factory):
    """One shared server (generous limits) for the whole test session."""
    server = start_server(tmp_path_factory.mktemp("service"), max_body_bytes=64 * 2**20,
                          quota_sessions=200, kernel_time_limit_s=120)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def limited(tmp_path_factory):
    """A server with tiny quotas, a short kernel time limit and fast idle culling."""
    server = start_server(tmp_path_factory.mktemp("limited"),
                          users=("alice", "bob", "carol", "dave"),
                          quota_sessions=3, quota_field_bytes=1 << 20, quota_job_seconds=0.5,
                          quota_session_fields=20, quota_session_kernels=3, max_batch_ops=200,
                          kernel_time_limit_s=1.5, idle_session_timeout_s=2,
                          cull_interval_s=0.5, max_body_bytes=1 << 20,
                          max_json_bytes=256 << 10)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def postgres():
    """A PostgreSQL server for the test session (``pg.py``)."""
    from . import pg

    why = pg.missing()
    if why is not None:
        pytest.skip(why)
    server = pg.PostgresServer().start()
    yield server
    server.stop()


@pytest.fixture
def pg_url(postgres) -> str:
    """A fresh PostgreSQL database, dropped afterwards."""
    url = postgres.create_database()
    yield url
    postgres.drop_database(url)


@pytest.fixture(params=["sqlite", "postgresql"])
def db_target(request, tmp_path):
    """What ``Database`` opens, on each backend: an SQLite file, a PostgreSQL database."""
    if request.param == "sqlite":
        return tmp_path / "difftape.sqlite3"
    return request.getfixturevalue("pg_url")


@pytest.fixture
def alice(service):
    with service.client("alice") as c:
        yield c


@pytest.fixture
def bob(service):
    with service.client("bob") as c:
        yield c


@pytest.fixture
def session(alice):
    """A fresh session of alice's, deleted afterwards."""
    r = alice.post("/v1/sessions", json={})
    assert r.status_code == 201, r.text
    sid = r.json()["session_id"]
    yield sid
    alice.delete(f"/v1/sessions/{sid}")


def problem(r: httpx.Response, status: int, difftape_error: str | None = None) -> dict:
    """Assert ``r`` is a problem response with this status (and difftape_error)."""
    assert r.status_code == status, (r.status_code, r.text[:500])
    assert r.headers["content-type"].startswith("application/problem+json"), r.headers
    body = r.json()
    assert body["status"] == status and isinstance(body["detail"], str), body
    assert body["difftape_error"] == difftape_error, body
    return body


def npy(arr: np.ndarray) -> bytes:
    import io

    f = io.BytesIO()
    np.save(f, arr, allow_pickle=True)
    return f.getvalue()


def from_npy(body: bytes) -> np.ndarray:
    import io

    return np.load(io.BytesIO(body), allow_pickle=False)


@pytest.fixture(scope="session")
def kernels():
    from .kernels_ir import Kernels

    return Kernels()


def setup_session(client: httpx.Client, sid: str, kernels, *names: str) -> dict:
    """Create the test fields and register kernels in ``sid``; kernel name -> id."""
    ops = kernels.create_ops() + [{"op": "register", "ir": kernels.ir(n)} for n in names]
    r = client.post(f"/v1/sessions/{sid}/batch", json={"ops": ops})
    assert r.status_code == 200, r.text
    res = r.json()["results"]
    return {n: res[len(kernels.fields) + i]["kernel_id"] for i, n in enumerate(names)}


def init_remote(request, kind: str, **init) -> None:
    """``ti.init(arch=ti.remote, ...)`` over HTTP to the shared server (``kind="http"``),
    in-process (``"inproc"``), or in-process to an engine whose kernels run on a GPU grid
    (``"grid"``: a ``--arch cuda`` server's engine on the pycuda stand-in, which runs the
    CUDA target's lowering on the simulated grid; the test's ``monkeypatch`` installs it)."""
    import difftape as ti
    from difftape.client import LocalTransport

    if kind == "http":
        service = request.getfixturevalue("service")
        ti.init(arch=ti.remote, server=service.url, token=service.tokens["alice"], **init)
    elif kind == "grid":
        from cuda_standin import FakeDriver, use

        use(request.getfixturevalue("monkeypatch"), FakeDriver())
        ti.init(arch=ti.remote, transport=LocalTransport(arch="cuda"), **init)
    else:
        assert kind == "inproc", kind
        ti.init(arch=ti.remote, transport=LocalTransport(), **init)


def remote_runner(request, kind: str):
    """A function running a program remotely (``ti.init`` options ``init``) the ``kind`` way
    of :func:`init_remote`, then resetting; ``.kind`` says which. (Modules whose ``remote``
    fixture takes more kinds build theirs with it.)"""
    import difftape as ti

    def run(program, **init):
        init_remote(request, kind, **init)
        try:
            return program()
        finally:
            ti.reset()

    run.kind = kind
    return run


@pytest.fixture(params=["http", "inproc"])
def remote(request):
    """Runs a program remotely: over HTTP to the shared server, or in-process."""
    return remote_runner(request, request.param)
