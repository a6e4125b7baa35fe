"""Gateways on one PostgreSQL database (README "Scale out"): real uvicorn gateways in
subprocesses, a real PostgreSQL server started by the fixtures (``pg.py``). A token and a
session made through one gateway work through the other (requests for a session another
gateway runs are forwarded to it); a gateway killed with SIGKILL loses no session (its
sessions resume from their last save, on another gateway or on its own restart, and a
change made after that save is reported, never silently dropped); concurrent clients on
both gateways get their own results."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest

from .conftest import npy, problem, setup_session, start_server


def _pair(tmp_path, pg_url, users=("alice", "bob"), **settings):
    """Gateways A and B: one database, one directory of saved sessions, own data dirs."""
    settings = {"database_url": pg_url, "sessions_dir": tmp_path / "saved", **settings}
    a = start_server(tmp_path / "a", users=users, **settings)
    try:
        b = start_server(tmp_path / "b", users=(), tokens=a.tokens, **settings)
    except BaseException:
        a.stop()
        raise
    return a, b


def _gateway_id(server) -> str:
    return (server.data_dir / "gateway.lock").read_text().strip()


def _row(pg_url: str, sid: str) -> dict:
    import psycopg
    from psycopg.rows import dict_row

    with psycopg.connect(pg_url, row_factory=dict_row) as conn:
        return conn.execute("SELECT * FROM sessions WHERE id = %s", (sid,)).fetchone()


def _raw(client, sid: str, fid: int, role: str = "data") -> bytes:
    r = client.get(f"/v1/sessions/{sid}/fields/{fid}/{role}",
                   headers={"Accept": "application/octet-stream"})
    assert r.status_code == 200, r.text
    return r.content


def _cli(server, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "difftape.cli", "token", *args, "--data-dir",
                           str(server.data_dir)], capture_output=True, text=True, timeout=60,
                          env=server.env)


def test_two_gateways_serve_the_same_users_and_sessions(tmp_path, pg_url, kernels):
    a, b = _pair(tmp_path, pg_url)
    try:
        ca, cb = a.client("alice"), b.client("alice")
        # A session made through A, worked through both: its engine stays in A.
        sid = ca.post("/v1/sessions", json={}).json()["session_id"]
        assert cb.get(f"/v1/sessions/{sid}").json()["state"] == "active"
        assert sid in [s["session_id"] for s in cb.get("/v1/sessions").json()["sessions"]]
        ids = setup_session(cb, sid, kernels, "double", "square_sum")
        x = (np.arange(kernels.n, dtype=np.float32) - 7.25) / 3
        assert cb.put(f"/v1/sessions/{sid}/fields/{kernels.x.id}/data",
                      content=npy(x)).status_code == 204
        r = cb.post(f"/v1/sessions/{sid}/kernels/{ids['double']}/launch", json={})
        assert r.status_code == 200, r.text
        y_b, y_a = _raw(cb, sid, kernels.y.id), _raw(ca, sid, kernels.y.id)
        assert y_b == y_a == (2 * x).astype(np.float32).tobytes()  # bit for bit
        # The batch fast path and the FastAPI routes, forwarded alike.
        r = cb.post(f"/v1/sessions/{sid}/batch", json={"ops": [
            {"op": "launch", "kernel_id": ids["double"], "variant": "primal", "args": []},
            {"op": "get_item", "id": kernels.y.id, "role": "data", "index": [3]}]})
        assert r.status_code == 200 and r.json()["results"][1]["value"] == float(2 * x[3])
        assert _row(pg_url, sid)["gateway"] == _gateway_id(a)
        # A job submitted through B runs in A; its record and result read through either.
        r = cb.post(f"/v1/sessions/{sid}/jobs", json={"ops": [
            {"op": "launch", "kernel_id": ids["double"], "variant": "primal", "args": []}],
            "job_id": "through-b"})
        assert r.status_code == 202, r.text
        deadline = time.monotonic() + 60
        while ca.get("/v1/jobs/through-b").json()["state"] != "succeeded":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert cb.get("/v1/jobs/through-b/result").json()["results"] == [{"result": None}]
        # Another user's session is nobody else's, through either gateway.
        with b.client("bob") as bob:
            problem(bob.get(f"/v1/sessions/{sid}/fields/{kernels.x.id}/data"), 404)
        # A token made for the shared database works on both at once; revoked, on neither.
        made = _cli(b, "create", "carol")
        assert made.returncode == 0, made.stderr
        token = made.stdout.strip()
        for s in (a, b):
            assert httpx.get(s.url + "/v1/sessions", headers={
                "Authorization": f"Bearer {token}"}).status_code == 200
        assert _cli(a, "revoke", token).returncode == 0
        deadline = time.monotonic() + 3
        for s in (a, b):
            while httpx.get(s.url + "/v1/sessions", headers={
                    "Authorization": f"Bearer {token}"}).status_code != 401:
                assert time.monotonic() < deadline, "a revoked token still works"
                time.sleep(0.1)
        # Deleted through B: gone everywhere, its engine stopped in A.
        assert cb.delete(f"/v1/sessions/{sid}").status_code == 204
        problem(ca.get(f"/v1/sessions/{sid}"), 404)
        ca.close()
        cb.close()
    finally:
        a.stop()
        b.stop()


def test_a_killed_gateway_loses_no_session(tmp_path, pg_url, kernels):
    """SIGKILL gateway A: its session, saved a moment before, resumes in A's restart at once
    (A's data dir names the dead gateway) with its fields bit for bit. Then SIGKILL B, which
    runs the session now, right after a change it had no time to save: once B's lease runs
    out the session resumes in A from its last save, and the first request is told (410)
    that the change is lost; the next ones see the saved fields."""
    settings = {"checkpoint_s": 1.5, "gateway_lease_s": 3}
    a, b = _pair(tmp_path, pg_url, users=("alice",), **settings)
    restarted = None
    try:
        with a.client() as ca:
            sid = ca.post("/v1/sessions", json={}).json()["session_id"]
            ids = setup_session(ca, sid, kernels, "double")
            x = np.linspace(-3, 5, kernels.n, dtype=np.float32)
            ca.put(f"/v1/sessions/{sid}/fields/{kernels.x.id}/data", content=npy(x))
            assert ca.post(f"/v1/sessions/{sid}/kernels/{ids['double']}/launch",
                           json={}).status_code == 200
        deadline = time.monotonic() + 30
        while _row(pg_url, sid)["dirty"]:  # saved at its first idle moment
            assert time.monotonic() < deadline, "the session was never saved"
            time.sleep(0.1)
        a.proc.kill()
        a.proc.wait()
        restarted = start_server(a.data_dir, users=(), tokens=a.tokens, **{
            "database_url": pg_url, "sessions_dir": tmp_path / "saved", **settings})
        with restarted.client() as c:
            t0 = time.monotonic()
            assert _raw(c, sid, kernels.y.id) == (2 * x).tobytes()
            assert time.monotonic() - t0 < 3, "A's restart waited for the dead A's lease"
            assert _raw(c, sid, kernels.x.id) == x.tobytes()
        # Move it to B (A's restart releases it when idle: cull), then kill B after a change.
        with restarted.client() as c, b.client() as cb:
            assert _row(pg_url, sid)["gateway"] == _gateway_id(restarted)
            c.post(f"/v1/sessions/{sid}/resume")
            restarted.proc.send_signal(2)  # a graceful stop saves and releases it
            restarted.proc.wait(60)
            assert _row(pg_url, sid)["state"] == "culled"
            restarted = start_server(a.data_dir, users=(), tokens=a.tokens, **{
                "database_url": pg_url, "sessions_dir": tmp_path / "saved", **settings})
            assert _raw(cb, sid, kernels.x.id) == x.tobytes()  # resumed in B
            assert _row(pg_url, sid)["gateway"] == _gateway_id(b)
            changed = np.full(kernels.n, 42.0, np.float32)
            assert cb.put(f"/v1/sessions/{sid}/fields/{kernels.x.id}/data",
                          content=npy(changed)).status_code == 204
            b.proc.kill()
            b.proc.wait()
            assert _row(pg_url, sid)["dirty"] == 1  # the database knew before B died
        with restarted.client() as c:
            t0 = time.monotonic()
            r = c.get(f"/v1/sessions/{sid}/fields/{kernels.x.id}/data")
            body = problem(r, 410, "SessionLostError")
            assert "restored from its fields saved at" in body["detail"], body
            assert time.monotonic() - t0 < settings["gateway_lease_s"] + 5
            assert _raw(c, sid, kernels.x.id) == x.tobytes()  # the save, not 42s
            assert _raw(c, sid, kernels.y.id) == (2 * x).tobytes()
            assert c.post(f"/v1/sessions/{sid}/kernels/{ids['double']}/launch",
                          json={}).status_code == 200
            assert c.get(f"/v1/sessions/{sid}").json()["state"] == "active"
    finally:
        for s in (a, b, restarted):
            if s is not None:
                s.stop()


def test_concurrent_clients_on_both_gateways(tmp_path, pg_url, kernels):
    """Clients on both gateways at once, each request of each going to A or B in turn: every
    result is its own client's, bit for bit; and one user's session quota holds across the
    two gateways when sessions are created on both at once."""
    users = ("u0", "u1", "u2", "u3", "u4", "u5", "carol")
    a, b = _pair(tmp_path, pg_url, users=users, quota_sessions=2)
    errors: list[str] = []
    rounds = 12

    def client(i: int) -> None:
        user = users[i]
        cs = [a.client(user), b.client(user)]
        try:
            r = cs[i % 2].post("/v1/sessions", json={})
            sid = r.json()["session_id"]
            kid = setup_session(cs[(i + 1) % 2], sid, kernels, "double")["double"]
            for k in range(rounds):
                c = cs[k % 2]
                x = np.full(kernels.n, i * 1000 + k + 0.5, np.float32)
                r = c.put(f"/v1/sessions/{sid}/fields/{kernels.x.id}/data", content=npy(x))
                if r.status_code != 204:
                    errors.append(f"{user} put {r.status_code} {r.text[:200]}")
                    return
                r = cs[(k + 1) % 2].post(f"/v1/sessions/{sid}/kernels/{kid}/launch", json={})
                if r.status_code != 200:
                    errors.append(f"{user} launch {r.status_code} {r.text[:200]}")
                    return
                if _raw(c, sid, kernels.y.id) != (2 * x).tobytes():
                    errors.append(f"{user} round {k}: wrong result")
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"{user}: {e!r}")
        finally:
            for c in cs:
                c.close()

    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors
        codes, barrier = [], threading.Barrier(6)

        def create(i: int) -> None:
            with (a if i % 2 else b).client("carol") as c:
                barrier.wait()
                codes.append(c.post("/v1/sessions", json={}).status_code)

        threads = [threading.Thread(target=create, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert sorted(codes) == [201, 201, 429, 429, 429, 429], codes
    finally:
        a.stop()
        b.stop()


@pytest.mark.parametrize("bad", ["sqlite:///x.db", "mysql://h/db"])
def test_a_database_url_that_is_not_postgresql_is_refused(bad):
    from pydantic import ValidationError

    from difftape.server.settings import Settings

    with pytest.raises(ValidationError, match="postgresql://"):
        Settings(database_url=bad)
