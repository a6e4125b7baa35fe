"""``difftape.client.connect``: explicit sessions, jobs, and the client's error mapping
against a real server."""

import os
import signal
import sys
import time

import numpy as np
import pytest

import difftape as ti
from difftape.client import (
    AuthenticationError,
    RemoteError,
    SessionLostError,
    as_job,
    connect,
)


@pytest.fixture
def conn(service):
    with connect(service.url, service.tokens["alice"]) as c:
        yield c


def counter_program():
    """Fields and a kernel that counts its launches (so a job that ran twice shows)."""
    hits = ti.field(ti.i32, shape=())
    data = ti.field(ti.f32, shape=1000)

    @ti.kernel
    def bump(k: ti.f32):
        hits[None] += 1
        for i in data:
            data[i] = data[i] * 0.5 + k

    return hits, data, bump


def test_program_in_an_explicit_session(conn):
    s = conn.create_session()
    try:
        assert any(info["session_id"] == s.session_id for info in conn.sessions())
        ti.init(arch=ti.remote, session=s)
        hits, data, bump = counter_program()
        a = np.random.default_rng(1).random(1000, dtype=np.float32)
        data.from_numpy(a)
        for k in range(3):
            bump(float(k))
        assert hits[None] == 3
        expect = a
        for k in range(3):
            expect = expect * np.float32(0.5) + np.float32(k)
        np.testing.assert_allclose(data.to_numpy(), expect, rtol=1e-6)
        fid = data.id
        ti.reset()  # the program ends; the session it joined does not
        assert s.info()["state"] == "active"
        assert s.read(fid, "data", np.float32, (1000,)).tobytes() == \
            data_bytes_after(a, 3)
    finally:
        s.delete()
    with pytest.raises(RemoteError) as info:
        s.info()
    assert info.value.status == 404


def data_bytes_after(a: np.ndarray, n: int) -> bytes:
    for k in range(n):
        a = a * np.float32(0.5) + np.float32(k)
    return a.astype(np.float32).tobytes()


def test_jobs_run_once_per_client_id(conn, service):
    ti.init(arch=ti.remote, server=service.url, token=service.tokens["alice"])
    try:
        from difftape.ir import serialize
        from difftape.runtime import program

        hits, data, bump = counter_program()
        bump(0.0)  # registered now, so both passes below send the same ops
        ti.sync()
        job_id = f"t-{os.getpid()}-{time.monotonic_ns()}"
        for _attempt in range(2):
            # The second pass is a client re-running the same block after a dropped
            # connection: the same id and ops give the same job, and nothing runs again.
            with as_job(job_id, progress=False) as status:
                for _ in range(50):
                    bump(1.0)
            assert status["job_id"] == job_id and status["state"] == "succeeded"
            assert status["done"] == status["total"]
            assert hits[None] == 51
        # Explicitly, through a Session: submit, wait, result; resubmission is the same job.
        sess = conn.session(program.get().remote.session_id)
        kid = serialize.fingerprint(bump.build_ir(program.get(), ()))
        ops = [{"op": "launch", "kernel_id": kid, "variant": "primal", "args": [2.0]}] * 7
        job = sess.submit(ops, job_id + "-b")
        assert job.wait(progress=False)["state"] == "succeeded"
        again = sess.submit(ops, job_id + "-b")
        assert again.job_id == job.job_id and again.status()["state"] == "succeeded"
        assert again.result() == [{"result": None}] * 7
        assert hits[None] == 58
        with pytest.raises(RemoteError) as info:  # same id, other ops: refused
            sess.submit(ops[:1], job_id + "-b")
        assert info.value.status == 409
    finally:
        ti.reset()


def test_failed_job_raises_the_kernel_error(service):
    ti.init(arch=ti.remote, server=service.url, token=service.tokens["alice"])
    try:
        x = ti.field(ti.f32, shape=4)

        @ti.kernel
        def poke(i: ti.i32):
            x[i] = 1.0

        with pytest.raises(ti.KernelAssertionError), as_job(progress=False):
            poke(1)
            poke(4)
        assert x.to_numpy().tolist() == [0, 1, 0, 0]
    finally:
        ti.reset()


def test_bad_token(service):
    with pytest.raises(AuthenticationError):
        ti.init(arch=ti.remote, server=service.url, token="dt_not-a-token")
    ti.reset()
    with connect(service.url, None) as c, pytest.raises(AuthenticationError):
        c.sessions()


def test_unreachable_server():
    """The error says what to check: a server running at that URL (through the tunnel, from
    a laptop), and where the URL came from (a default when nothing named one)."""
    with pytest.raises(RemoteError, match="cannot reach") as e:
        ti.init(arch=ti.remote, server="http://127.0.0.1:9", token="x", timeout=5)
    ti.reset()
    msg = str(e.value)
    assert "difftape serve" in msg and "ssh -N -L" in msg, msg
    assert "DIFFTAPE_SERVER" in msg and "http://127.0.0.1:8000" in msg, msg


def test_killed_worker_is_a_lost_session(service):
    ti.init(arch=ti.remote, server=service.url, token=service.tokens["alice"])
    try:
        from difftape.runtime import program

        x = ti.field(ti.f32, shape=8)
        x.fill(2.0)
        assert x[3] == 2.0
        os.kill(service.worker_pid(program.get().remote.session_id), signal.SIGKILL)
        with pytest.raises(SessionLostError):
            x.fill(3.0)
            ti.sync()
        assert issubclass(SessionLostError, ti.DifftapeError)
    finally:
        ti.reset()
    # Everyone else carries on.
    ti.init(arch=ti.remote, server=service.url, token=service.tokens["alice"])
    try:
        y = ti.field(ti.f32, shape=2)
        y.fill(1.5)
        assert y.to_numpy().tolist() == [1.5, 1.5]
    finally:
        ti.reset()


def test_connection_session_and_job_reprs_say_what_they_are(conn, service):
    from difftape.client.session import Job

    assert repr(conn) == f"<difftape.client.Connection to {service.url}>"
    s = conn.create_session()
    try:
        assert repr(s) == f"<difftape.client.Session {s.session_id} on {service.url}>"
    finally:
        s.delete()
    job = Job(conn, "j-1", {"state": "running", "done": 3, "total": 10})
    assert repr(job) == "<difftape.client.Job j-1: running, 3 of 10 ops done>"
    assert repr(Job(conn, "j-2")) == "<difftape.client.Job j-2: submitted>"


def test_job_wait_shows_progress_with_tqdm(service, conn, capsys, monkeypatch):
    """Job.wait draws the job's ops as a tqdm bar (a widget in Jupyter, stderr here), none
    with progress=False; progress=True without tqdm is refused, saying how to install it."""
    pytest.importorskip("tqdm", reason="pip install tqdm (the test extra)")
    from difftape.ir import serialize
    from difftape.runtime import program, progress

    ti.init(arch=ti.remote, server=service.url, token=service.tokens["alice"])
    try:
        hits, _data, bump = counter_program()
        bump(0.0)
        ti.sync()
        sess = conn.session(program.get().remote.session_id)
        kid = serialize.fingerprint(bump.build_ir(program.get(), ()))
        ops = [{"op": "launch", "kernel_id": kid, "variant": "primal", "args": [1.0]}] * 5
        capsys.readouterr()
        assert sess.submit(ops).wait(progress=True)["state"] == "succeeded"
        err = capsys.readouterr().err
        assert "job j_" in err and "5/5" in err and "succeeded" in err, err
        assert sess.submit(ops).wait(progress=False)["state"] == "succeeded"
        assert capsys.readouterr().err == ""
        assert hits[None] == 11
        monkeypatch.setitem(sys.modules, "tqdm.auto", None)
        assert progress.bar(1, "x").__class__.__name__ == "_NoBar"
        with pytest.raises(ti.DifftapeError, match="pip install tqdm"):
            sess.submit(ops).wait(progress=True)
    finally:
        ti.reset()
