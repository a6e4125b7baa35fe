"""The service under faults, hostile clients and routine operations (issue 13).

Real servers on loopback ports, real worker processes killed for real, and a real 32 MiB
tmpfs as the server's /dev/shm (in a private mount namespace made with ``unshare``, as root
or through an unprivileged user namespace; skipped where neither is allowed).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import npy, problem, setup_session, start_server
from .test_gateway_workers import _alive

ENDLESS = 2**31 - 1  # steps of the `endless` kernel: it runs for as long as a test could


# ---------------------------------------------------------------------- helpers
def raw_request(port: int, head: str, body_part: bytes = b"", timeout: float = 10.0):
    """Send a request's head and only the start of its body; return (status, headers, body)
    of the answer, which must come without the rest of the body."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body_part)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        head_bytes, _, rest = data.partition(b"\r\n\r\n")
        lines = head_bytes.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in
                   (ln.partition(":") for ln in lines[1:])}
        n = int(headers.get("content-length", 0))
        while len(rest) < n:
            chunk = s.recv(65536)
            if not chunk:
                break
            rest += chunk
        return status, headers, rest


def metric(client: httpx.Client, name: str) -> float:
    total = 0.0
    for fam in text_string_to_metric_families(client.get("/metrics").text):
        total += sum(s.value for s in fam.samples if s.name == name)
    return total


def start_time(pid: int) -> int | None:
    from difftape.server.worker import _start_time

    return _start_time(pid)


def wait_dead(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def launch_in_thread(client: httpx.Client, sid: str, kid: str, args: list) -> tuple:
    out: dict = {}

    def run():
        try:
            out["r"] = client.post(f"/v1/sessions/{sid}/kernels/{kid}/launch",
                                   json={"args": args})
        except httpx.HTTPError as e:
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    return t, out


# ---------------------------------------------------------------------- 1 / 5: small /dev/shm
SHM_MIB = 32


def _tmpfs_wrap(folder: str) -> list[str]:
    """A command prefix that runs the server in a private mount namespace where ``folder``
    is a fresh ``SHM_MIB`` MiB tmpfs (it goes away with the server)."""
    mount = f'mount -t tmpfs -o size={SHM_MIB}m tmpfs "$0" && exec "$@"'
    for prefix in (["unshare", "--mount", "--propagation", "private"],
                   ["unshare", "--user", "--map-root-user", "--mount", "--propagation",
                    "private"]):
        try:
            ok = subprocess.run([*prefix, "sh", "-c", mount, str(folder), "true"],
                                capture_output=True, timeout=30).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if ok:
            return [*prefix, "sh", "-c", mount, str(folder)]
    pytest.skip("cannot mount a small tmpfs here (needs root or unprivileged user "
                "namespaces with unshare)")


@pytest.fixture(scope="module")
def small_shm(tmp_path_factory):
    """A server whose /dev/shm is a 32 MiB tmpfs (Docker gives 64 MiB by default)."""
    base = tmp_path_factory.mktemp("small_shm")
    server = start_server(base / "data", users=("alice",), wrap=_tmpfs_wrap("/dev/shm"),
                          max_body_bytes=80 << 20, spare_workers=1)
    server.shm = "/dev/shm"
    yield server
    server.stop()


def shm_used(server) -> int:
    """Bytes in use on the server's tmpfs, seen through its own mount namespace."""
    st = os.statvfs(f"/proc/{server.proc.pid}/root{server.shm}")
    assert st.f_blocks * st.f_frsize <= SHM_MIB << 20  # it is the small tmpfs
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def test_upload_larger_than_shared_memory(small_shm):
    """48 MiB into a 32 MiB /dev/shm: the payload goes through the pipe instead (no SIGBUS
    for the gateway or the worker), both ways, and the buffers shrink back afterwards."""
    n = 12 << 20  # float32: 48 MiB
    with small_shm.client() as c:
        sid = c.post("/v1/sessions", json={}).json()["session_id"]
        r = c.post(f"/v1/sessions/{sid}/fields", json={"id": 1, "dtype": "f32", "shape": [n]})
        assert r.status_code == 201, r.text
        x = np.arange(n, dtype=np.float32)
        raw = {"Content-Type": "application/octet-stream", "X-Dtype": "f32", "X-Shape": str(n)}
        r = c.put(f"/v1/sessions/{sid}/fields/1/data", content=x.tobytes(), headers=raw)
        assert r.status_code == 204, (r.status_code, r.text[:300], small_shm.log()[-2000:])
        back = c.get(f"/v1/sessions/{sid}/fields/1/data",
                     headers={"Accept": "application/octet-stream"})
        assert back.status_code == 200 and back.content == x.tobytes()
        # 12 MiB fits in shared memory; afterwards the gateway gives the pages back.
        m = 3 << 20
        r = c.post(f"/v1/sessions/{sid}/fields", json={"id": 2, "dtype": "f32", "shape": [m]})
        y = np.arange(m, dtype=np.float32) * 2
        r = c.put(f"/v1/sessions/{sid}/fields/2/data", content=y.tobytes(),
                  headers={**raw, "X-Shape": str(m)})
        assert r.status_code == 204, r.text
        assert c.get(f"/v1/sessions/{sid}/fields/2/data",
                     headers={"Accept": "application/octet-stream"}).content == y.tobytes()
        assert shm_used(small_shm) <= 4 << 20  # 1 MiB per worker (this one and the spare)
        assert c.get("/livez").status_code == 200
        c.delete(f"/v1/sessions/{sid}")
    assert small_shm.proc.poll() is None, small_shm.log()[-2000:]


def test_upload_that_cannot_fit_is_refused_before_its_body(small_shm):
    """A 48 MiB upload to a 1-element field is refused from its headers (raw) or its .npy
    header, before the rest of the body is sent, and keeps no memory."""
    big = 12 << 20
    with small_shm.client() as c:
        sid = c.post("/v1/sessions", json={}).json()["session_id"]
        r = c.post(f"/v1/sessions/{sid}/fields", json={"id": 1, "dtype": "f32", "shape": [1]})
        assert r.status_code == 201, r.text
        token = small_shm.tokens["alice"]
        path = f"/v1/sessions/{sid}/fields/1/data"
        head = (f"PUT {path} HTTP/1.1\nHost: 127.0.0.1\nAuthorization: Bearer {token}\n"
                f"Content-Length: {4 * big}\n")
        status, _, body = raw_request(small_shm.port, head + "Content-Type: application/"
                                      f"octet-stream\nX-Dtype: f32\nX-Shape: {big}\n")
        assert status == 422 and json.loads(body)["difftape_error"] == "ShapeError", body
        header = npy(np.zeros(big, np.float32))[:128]
        status, _, body = raw_request(small_shm.port, head.replace(
            f"Content-Length: {4 * big}", f"Content-Length: {len(header) + 4 * big}")
            + "Content-Type: application/x-npy\n", header)
        assert status == 422 and json.loads(body)["difftape_error"] == "ShapeError", body
        assert shm_used(small_shm) <= 4 << 20
        # The field is untouched and the session works.
        r = c.get(f"/v1/sessions/{sid}/fields/1/data/item", params={"index": "0"})
        assert r.json() == {"value": 0.0}
        c.delete(f"/v1/sessions/{sid}")


# ---------------------------------------------------------------------- 3: killed gateway
def test_workers_die_with_a_killed_gateway_and_are_reaped(tmp_path, kernels):
    """kill -9 of the gateway takes its workers with it, even one in an endless kernel; a
    starting gateway stops workers a dead gateway of its data dir left running (here a
    stand-in process registered as one), and only those."""
    data = tmp_path / "data"
    first = start_server(data, users=("alice",), kernel_time_limit_s=60)
    stand_ins = []
    restarted = None
    try:
        with first.client() as a:
            sid = a.post("/v1/sessions", json={}).json()["session_id"]
            ids = setup_session(a, sid, kernels, "endless")
            pid = first.worker_pid(sid)
            t, _out = launch_in_thread(a, sid, ids["endless"], [ENDLESS])
            time.sleep(0.5)
            entries = list((data / "workers").glob("*.json"))
            assert entries, "the gateway did not register its workers"
            entry = json.loads(entries[0].read_text())
            first.proc.kill()
            first.proc.wait()
            try:
                assert wait_dead(pid, 5), "the worker outlived its gateway"
            finally:
                if _alive(pid):
                    os.kill(pid, signal.SIGKILL)
            t.join(30)
        # Stand-ins for workers that survived their gateway: one registered as the dead
        # gateway's (to be stopped), one whose registration names another process that
        # once had its pid (to be left alone).
        for _ in range(2):
            stand_ins.append(subprocess.Popen([sys.executable, "-c",
                                               "import time; time.sleep(120)"]))
        for p, start in ((stand_ins[0], start_time(stand_ins[0].pid)),
                         (stand_ins[1], start_time(stand_ins[1].pid) - 1)):
            (data / "workers" / f"{p.pid}.json").write_text(json.dumps({**entry,
                                                                        "start": start}))
        restarted = start_server(data, users=(), tokens=first.tokens, wait_ready=False)
        assert stand_ins[0].wait(10) == -signal.SIGKILL
        assert stand_ins[1].poll() is None
        assert not (data / "workers" / f"{stand_ins[0].pid}.json").exists()
        with restarted.client() as a:
            assert a.get(f"/v1/sessions/{sid}").json()["state"] == "lost"
    finally:
        first.stop()
        for p in stand_ins:
            if p.poll() is None:
                p.kill()
                p.wait()
        if restarted is not None:
            restarted.stop()


def test_worker_enforces_the_time_limit_itself(tmp_path, kernels):
    """A worker stops itself when an op runs past its time limit, even if its gateway does
    not (here the gateway waits 60 s): the call fails as a kernel timeout."""
    import asyncio

    from difftape.server.worker import Worker, WorkerGone

    async def main():
        loop = asyncio.get_running_loop()
        w = Worker("difftape.server.engine:Engine", {"cache_dir": str(tmp_path),
                                                     "num_threads": 1}, time_limit=0.5)
        try:
            await loop.run_in_executor(None, w.wait_ready, 120)
            for f in kernels.create_ops():
                await w.call(f, timeout=60)
            kid = (await w.call({"op": "register", "ir": kernels.ir("endless")},
                                timeout=60))[0]["kernel_id"]
            t0 = time.monotonic()
            with pytest.raises(WorkerGone) as e:
                await w.call({"op": "launch", "kernel_id": kid, "args": [ENDLESS]},
                             timeout=60)
            assert e.value.timeout and time.monotonic() - t0 < 10
        finally:
            await loop.run_in_executor(None, w.stop)

    asyncio.run(main())


# ---------------------------------------------------------------------- 4: auth first
def test_token_is_checked_before_the_body(service):
    """Without a token, a 48 MiB body gets its 401 from the headers alone (before the body
    is sent), and a body that is not even JSON is a 401, not a 422."""
    head = ("POST /v1/sessions/s_x/batch HTTP/1.1\nHost: 127.0.0.1\n"
            f"Content-Type: application/json\nContent-Length: {48 << 20}\n")
    status, headers, body = raw_request(service.port, head, b'{"ops": [' + b" " * 65536)
    assert status == 401 and headers["www-authenticate"] == "Bearer", body
    status, _, _ = raw_request(service.port, head.replace(
        "Host:", "Authorization: Bearer dt_wrong\nHost:"), b"{")
    assert status == 401
    with service.client(user=None) as anon:
        problem(anon.post("/v1/sessions/s_x/batch", content=b"{",
                          headers={"Content-Type": "application/json"}), 401)


# ---------------------------------------------------------------------- 6: object quotas
def test_object_quotas(limited, kernels):
    """Per session at most 20 fields and 3 kernels here, at most 200 ops per batch or job:
    429s naming the limit, counted exactly (re-creating or re-registering is free)."""
    with limited.client("dave") as c:
        sid = c.post("/v1/sessions", json={}).json()["session_id"]
        try:
            ids = setup_session(c, sid, kernels, "double", "square_sum", "poke")
            r = c.post(f"/v1/sessions/{sid}/kernels", json={"ir": kernels.ir("spin")})
            assert problem(r, 429, "QuotaExceededError")["limit"] == "kernels"
            r = c.post(f"/v1/sessions/{sid}/kernels", json={"ir": kernels.ir("double")})
            assert r.status_code == 200 and r.json()["kernel_id"] == ids["double"]
            ops = [{"op": "create_field", "id": 100 + i, "dtype": "u8", "shape": [1]}
                   for i in range(18)]
            r = c.post(f"/v1/sessions/{sid}/batch", json={"ops": ops})
            body = problem(r, 429, "QuotaExceededError")
            assert body["limit"] == "fields" and body["index"] == 17  # 3 + 17 = 20
            r = c.post(f"/v1/sessions/{sid}/fields", json={"id": 100, "dtype": "u8",
                                                           "shape": [1]})
            assert r.status_code == 201  # exists already: no new object
            r = c.post(f"/v1/sessions/{sid}/fields", json={"id": 999, "dtype": "u8",
                                                           "shape": [1]})
            assert problem(r, 429, "QuotaExceededError")["limit"] == "fields"
            many = [{"op": "clear_grads"}] * 201
            r = c.post(f"/v1/sessions/{sid}/batch", json={"ops": many})
            assert problem(r, 429, "QuotaExceededError")["limit"] == "batch_ops"
            r = c.post(f"/v1/sessions/{sid}/jobs", json={"ops": many})
            assert problem(r, 429, "QuotaExceededError")["limit"] == "batch_ops"
            assert c.post(f"/v1/sessions/{sid}/batch",
                          json={"ops": many[:200]}).status_code == 200
        finally:
            c.delete(f"/v1/sessions/{sid}")


# ---------------------------------------------------------------------- 7 / 8: bad bodies
def test_validation_errors_are_capped(alice, session):
    """20,000 bad ops (about 300 KiB) give a small 422 that counts what it leaves out."""
    r = alice.post(f"/v1/sessions/{session}/batch",
                   json={"ops": [{"op": "launch"}] * 20_000})
    body = problem(r, 422)
    assert len(r.content) < 16 << 10, len(r.content)
    assert 1 <= len(body["errors"]) <= 20
    assert body["errors_omitted"] == 20_000 - len(body["errors"])


def test_malformed_npy_headers_are_400(alice, session, kernels):
    """Headers numpy's parser chokes on in various ways (an unterminated literal makes it
    raise tokenize.TokenError) are bad bodies: 400, and the connection stays usable."""
    r = alice.post(f"/v1/sessions/{session}/batch", json={"ops": kernels.create_ops()})
    assert r.status_code == 200, r.text
    path = f"/v1/sessions/{session}/fields/{kernels.x.id}/data"
    for header in (b"{'descr': '<f4', 'fortran_order': False, 'shape': (16,",
                   b"{'descr': '<f4', 'fortran_order': False, 'shape': " + b"(" * 3000,
                   b"{'descr': '<f4', 'fortran_order': False, 'shape': (16,), 'x': '\xff'}",
                   b"\x00" * 40):
        header += b" " * (63 - (10 + len(header)) % 64) + b"\n"
        body = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header + b"\0" * 64
        problem(alice.put(path, content=body), 400)
    assert alice.get(path).status_code == 200


# ---------------------------------------------------------------------- 9 / 10: metrics
def test_metrics_show_no_session_ids(service, alice, bob):
    sid = bob.post("/v1/sessions", json={}).json()["session_id"]
    try:
        text = alice.get("/metrics").text
        assert sid not in text and "session=" not in text
        assert "difftape_sessions_running" in text
    finally:
        bob.delete(f"/v1/sessions/{sid}")


def test_workers_lost_are_counted(service, alice, kernels):
    before = metric(alice, "difftape_workers_lost_total")
    sid = alice.post("/v1/sessions", json={}).json()["session_id"]
    try:
        os.kill(service.worker_pid(sid), signal.SIGKILL)
        time.sleep(0.2)
        problem(alice.post(f"/v1/sessions/{sid}/batch", json={"ops": []}), 410,
                "SessionLostError")
        assert metric(alice, "difftape_workers_lost_total") == before + 1
    finally:
        alice.delete(f"/v1/sessions/{sid}")


# ---------------------------------------------------------------------- 11: /docs
def test_the_servers_own_origin_may_send_requests(service, alice):
    """/docs ("Try it out") posts with the server's own Origin: allowed (whatever the
    scheme: behind a TLS proxy the page is https). Other origins, another port or another
    name of the same host included, stay refused."""
    own = f"http://127.0.0.1:{service.port}"
    # Past the Origin check: the route answers (no such session here).
    problem(alice.post("/v1/sessions/s_none/resume", headers={"Origin": own}), 404)
    problem(alice.delete("/v1/sessions/s_none", headers={"Origin": own + "/"}), 404)
    for origin in (f"http://127.0.0.1:{service.port + 1}", f"http://localhost:{service.port}",
                   "http://127.0.0.1", "null"):
        problem(alice.post("/v1/sessions/s_none/resume", headers={"Origin": origin}), 403)


# ---------------------------------------------------------------------- request ids, logs
def test_request_ids_and_access_log(service, alice, session):
    r = alice.get(f"/v1/sessions/{session}/fields/999/data")
    rid = r.headers["x-request-id"]
    assert r.json()["request_id"] == rid
    token = service.tokens["alice"]
    deadline = time.monotonic() + 5
    while True:
        lines = [json.loads(ln) for ln in service.log().splitlines()
                 if ln.startswith("{") and rid in ln]
        if lines or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert len(lines) == 1, service.log()[-2000:]
    line = lines[0]
    assert line["user"] == "alice" and line["session"] == session
    assert line["status"] == r.status_code and line["bytes_out"] == len(r.content)
    assert line["op"] == "GET /v1/sessions/{sid}/fields/{fid}/{role}"
    assert isinstance(line["duration_ms"], float)
    assert token not in service.log()


# ---------------------------------------------------------------------- fault injection
class _Client(threading.Thread):
    """Writes x = k, launches y = 2 x and reads y back, for k = 1, 2, ... until an error;
    remembers the last x the server acknowledged and whether a later write's fate is
    unknown (its answer lost with the connection)."""

    def __init__(self, server, user: str, kernels, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.server, self.user, self.kernels, self.stop_event = server, user, kernels, stop
        self.acked = 0.0
        self.unknown: float | None = None
        self.rounds = 0
        self.outcome: object = None  # the error that ended the loop
        self.wrong: list[str] = []
        self.sid = ""

    def run(self) -> None:
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.outcome = e

    def _run(self) -> None:
        k = self.kernels
        with self.server.client(self.user) as c:
            self.sid = c.post("/v1/sessions", json={}).json()["session_id"]
            kid = setup_session(c, self.sid, k, "double")["double"]
            base = f"/v1/sessions/{self.sid}"
            value = 0.0
            while not self.stop_event.is_set():
                value += 1
                try:
                    self.unknown = value
                    r = c.put(f"{base}/fields/{k.x.id}/data",
                              content=npy(np.full(k.n, value, np.float32)))
                    self.unknown = None  # answered: written (204) or not
                    if r.status_code == 204:
                        self.acked = value
                        r = c.post(f"{base}/kernels/{kid}/launch", json={})
                    if r.status_code == 200:
                        r = c.get(f"{base}/fields/{k.y.id}/data",
                                  headers={"Accept": "application/octet-stream"})
                    if r.status_code == 200:
                        y = np.frombuffer(r.content, np.float32)
                        if not (y == 2 * value).all():
                            self.wrong.append(f"round {value}: y = {y[:3]}...")
                        self.rounds += 1
                        continue
                    self.outcome = r
                except httpx.TransportError as e:
                    self.outcome = e
                return


def test_fault_injection(tmp_path, kernels):
    """Under a steady load of four clients, and a fifth whose kernel runs for ever: kill
    one client's worker, then SIGTERM the gateway and restart it. The gateway stops within
    its grace period (it does not wait for the endless kernel to save the others); every
    request got its result or a typed error; every saved field is what its client last
    wrote; the endless kernel's caller was told its session was lost, and why."""
    data = tmp_path / "data"
    users = ("alice", "bob", "carol", "dave")
    grace = 4.0
    first = start_server(data, users=(*users, "erin"), shutdown_grace_s=grace,
                         spare_workers=2)
    restarted = None
    stop = threading.Event()
    clients = [_Client(first, u, kernels, stop) for u in users]
    try:
        with first.client("erin") as e:
            endless_sid = e.post("/v1/sessions", json={}).json()["session_id"]
            kid = setup_session(e, endless_sid, kernels, "endless")["endless"]
        for c in clients:
            c.start()
        deadline = time.monotonic() + 60
        while min(c.rounds for c in clients) < 3:
            assert time.monotonic() < deadline, "the clients made no progress"
            assert all(c.is_alive() for c in clients), [c.outcome for c in clients]
            time.sleep(0.05)
        with first.client("erin") as e:
            endless, endless_out = launch_in_thread(e, endless_sid, kid, [ENDLESS])
            time.sleep(0.3)
            os.kill(first.worker_pid(clients[0].sid), signal.SIGKILL)
            time.sleep(0.3)
            assert endless.is_alive()
            t0 = time.monotonic()
            first.proc.send_signal(signal.SIGTERM)
            try:
                first.proc.wait(grace + 4)
            except subprocess.TimeoutExpired:
                first.proc.kill()
                pytest.fail(f"the server did not stop within its {grace} s grace period")
            assert time.monotonic() - t0 <= grace + 1.5
            endless.join(10)
        problem(endless_out["r"], 410, "SessionLostError")
        stop.set()
        for c in clients:
            c.join(30)
        for c in clients:
            assert not c.wrong, (c.user, c.wrong)
            out = c.outcome
            if isinstance(out, httpx.Response):  # a typed error: a problem naming its cause
                assert out.status_code in (410, 503), (c.user, out.status_code, out.text)
                body = out.json()
                assert out.headers["content-type"] == "application/problem+json"
                if out.status_code == 410:
                    assert body["difftape_error"] == "SessionLostError", body
            else:  # the server had stopped: nothing more reached it
                assert isinstance(out, httpx.TransportError | type(None)), (c.user, out)
        assert isinstance(clients[0].outcome, httpx.Response) and \
            clients[0].outcome.status_code == 410
        restarted = start_server(data, users=(), tokens=first.tokens, wait_ready=False)
        with restarted.client("erin") as e:
            info = e.get(f"/v1/sessions/{endless_sid}").json()
            assert info["state"] == "lost" and "server stopped" in info["lost_reason"], info
        for c in clients:
            with restarted.client(c.user) as h:
                info = h.get(f"/v1/sessions/{c.sid}").json()
                if c is clients[0]:
                    assert info["state"] == "lost", info
                    continue
                assert info["state"] == "culled", (c.user, info)
                r = h.get(f"/v1/sessions/{c.sid}/fields/{kernels.x.id}/data",
                          headers={"Accept": "application/octet-stream"})
                x = np.frombuffer(r.content, np.float32)
                assert x[0] in (c.acked, c.unknown) and (x == x[0]).all(), \
                    (c.user, x[:3], c.acked, c.unknown)
    finally:
        stop.set()
        first.stop()
        if restarted is not None:
            restarted.stop()
