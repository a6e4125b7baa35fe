"""Scratch memory in the per-user memory quota, across a user's sessions and gateways.

A session's engine holds scratch memory beside its fields (here the CPU print sink, 1 MiB,
taken with the first kernel that prints; on a GPU also stack pools, snapshot blocks, the
print buffer). The user's quota counts it with every session's fields: the gateway reserves
it in the database (``sessions.scratch_bytes``) when the engine asks for it, so a user with
several sessions cannot hold the quota several times over, and the bytes one session holds
are refused to another (429 naming the session that holds them). It is freed when the
session's engine stops (deleted, culled, the gateway restarted or killed).

Real servers on loopback: one gateway on SQLite, and two gateways on one PostgreSQL
database with the user's sessions on different gateways.
"""

import base64
import time

import numpy as np
import pytest

from difftape.graph import wire

from .conftest import problem, setup_session, start_server

pytestmark = pytest.mark.difftape_only

SINK = wire.MAX_OUTPUT_BYTES  # the CPU print sink
QUOTA = SINK + SINK // 2  # room for one session's print sink, not two


@pytest.fixture
def say_ir(kernels):
    """A kernel that prints (its first launch takes the print sink), as a client sends it."""
    return kernels.ir("say")


@pytest.fixture(scope="module")
def quota_server(tmp_path_factory):
    """One gateway on SQLite with the small quota, for tests that each use their own user
    (a quota is per user)."""
    server = start_server(tmp_path_factory.mktemp("quota"), users=("carol", "dave"),
                          quota_field_bytes=QUOTA, spare_workers=0)
    yield server
    server.stop()


def _session(client, say_ir) -> tuple[str, str]:
    """A new session with ``say`` registered: (session id, kernel id)."""
    r = client.post("/v1/sessions", json={})
    assert r.status_code == 201, r.text
    sid = r.json()["session_id"]
    r = client.post(f"/v1/sessions/{sid}/batch", json={"ops": [{"op": "register",
                                                                 "ir": say_ir}]})
    assert r.status_code == 200, r.text
    return sid, r.json()["results"][0]["kernel_id"]


def _say(client, sid: str, kid: str, k: int):
    """Launch ``say(k)`` (in a batch: its answer carries what the kernel printed)."""
    return client.post(f"/v1/sessions/{sid}/batch", json={"ops": [
        {"op": "launch", "kernel_id": kid, "args": [k]}]})


def _printed(r) -> str:
    assert r.status_code == 200 and "output" in r.json(), r.text
    return base64.b64decode(r.json()["output"]["b64"]).decode()


def _scratch(client, sid: str) -> int:
    return client.get(f"/v1/sessions/{sid}").json()["scratch_bytes"]


def _servers(backend: str, tmp_path, request, **settings):
    """(gateway of bob's first session, gateway of his second): one gateway on SQLite, two
    on one PostgreSQL database."""
    settings = {"quota_field_bytes": QUOTA, "spare_workers": 0, **settings}
    if backend == "sqlite":
        a = start_server(tmp_path / "a", users=("alice", "bob"), **settings)
        return a, a
    from .test_scale_out import _pair

    return _pair(tmp_path, request.getfixturevalue("pg_url"), **settings)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_scratch_of_one_session_is_refused_to_another(backend, tmp_path, request, say_ir):
    """bob's first session prints (its engine takes the 1 MiB print sink, reserved in his
    quota); his second session, on another gateway with PostgreSQL, cannot take a second
    sink (429 naming the first session and what it holds), nor a field that fits the quota
    only without the first session's scratch; alice is unaffected; once the first session
    is deleted, the second prints."""
    a, b = _servers(backend, tmp_path, request)
    try:
        with a.client("bob") as ca, b.client("bob") as cb, b.client("alice") as alice:
            s1, k1 = _session(ca, say_ir)
            assert _printed(_say(ca, s1, k1, 1)) == "k is 1\n"
            held = _scratch(ca, s1)
            assert SINK <= held <= QUOTA
            assert _scratch(cb, s1) == held  # the database's figure, on either gateway
            s2, k2 = _session(cb, say_ir)
            body = problem(_say(cb, s2, k2, 2), 429, "QuotaExceededError")
            assert body["limit"] == "field_bytes"
            detail = body["detail"]
            assert (f"memory quota exceeded: the print sink (kernel 'say' prints) needs "
                    f"{SINK + 24} bytes of scratch memory") in detail, detail  # + its header
            assert f"in session {s2}" in detail and f"quota is {QUOTA} bytes" in detail
            assert f"session {s1}: 0 bytes of fields, {held} of scratch" in detail, detail
            assert "Delete sessions you no longer need" in detail
            assert _scratch(cb, s2) < SINK
            # Fields count the other session's scratch too.
            free = QUOTA - held - _scratch(cb, s2)
            big = {"id": 7, "dtype": "u8", "shape": [free + 1]}
            body = problem(cb.post(f"/v1/sessions/{s2}/fields", json=big), 429,
                           "QuotaExceededError")
            assert body["limit"] == "field_bytes"
            assert "memory quota exceeded" in body["detail"], body
            r = cb.post(f"/v1/sessions/{s2}/fields", json={**big, "shape": [free]})
            assert r.status_code == 201, r.text
            # Another user's quota is their own.
            s3, k3 = _session(alice, say_ir)
            assert _printed(_say(alice, s3, k3, 3)) == "k is 3\n"
            # The first session's scratch goes with it: the second one prints now.
            assert ca.delete(f"/v1/sessions/{s1}").status_code == 204
            assert _printed(_say(cb, s2, k2, 4)) == "k is 4\n"
            assert _scratch(cb, s2) >= SINK
            metrics = cb.get("/metrics").text
            assert 'difftape_scratch_asks_total{outcome="refused"} 1.0' in metrics, metrics
    finally:
        a.stop()
        if b is not a:
            b.stop()


def test_a_restart_frees_the_scratch_of_stopped_engines(tmp_path, say_ir):
    """A graceful stop saves and stops every session: their engines' scratch goes with
    them (0 in the database), so after the restart the user's quota holds what the new
    engines take, whichever session takes it first."""
    settings = {"quota_field_bytes": QUOTA, "spare_workers": 0}
    a = start_server(tmp_path / "a", users=("bob",), **settings)
    restarted = None
    try:
        with a.client("bob") as c:
            s1, k1 = _session(c, say_ir)
            s2, k2 = _session(c, say_ir)
            assert _printed(_say(c, s1, k1, 1)) == "k is 1\n"
            problem(_say(c, s2, k2, 2), 429, "QuotaExceededError")
        a.stop()
        with a.db() as db:
            rows = db.execute("SELECT state, scratch_bytes FROM sessions").fetchall()
        assert sorted(rows) == [("culled", 0), ("culled", 0)]
        restarted = start_server(a.data_dir, users=(), tokens=a.tokens, **settings)
        with restarted.client("bob") as c:
            assert _printed(_say(c, s2, k2, 3)) == "k is 3\n"  # resumed: s1 holds nothing
            body = problem(_say(c, s1, k1, 4), 429, "QuotaExceededError")
            held = _scratch(c, s2)
            assert f"session {s2}: 0 bytes of fields, {held} of scratch" in body["detail"]
            assert held >= SINK > _scratch(c, s1)
    finally:
        for s in (a, restarted):
            if s is not None:
                s.stop()


def test_a_killed_gateways_scratch_is_freed_with_its_lease(tmp_path, pg_url, say_ir):
    """Gateway A, running bob's session that holds a print sink, is killed (SIGKILL): its
    engines died with it, and once its lease has run out gateway B settles its sessions
    (saved: culled, still counted in the quota), their scratch freed, so bob's session on
    B can take the memory."""
    from .test_scale_out import _pair, _row

    a, b = _pair(tmp_path, pg_url, users=("bob",), quota_field_bytes=QUOTA, spare_workers=0,
                 gateway_lease_s=3, checkpoint_s=1)
    try:
        with a.client("bob") as ca, b.client("bob") as cb:
            s1, k1 = _session(ca, say_ir)
            assert _printed(_say(ca, s1, k1, 1)) == "k is 1\n"
            s2, k2 = _session(cb, say_ir)
            deadline = time.monotonic() + 30
            while _row(pg_url, s1)["dirty"]:  # saved, so that it stays a live session
                assert time.monotonic() < deadline, "the session was never saved"
                time.sleep(0.1)
            assert _row(pg_url, s1)["scratch_bytes"] >= SINK  # a save keeps the engine
            a.proc.kill()
            a.proc.wait()
            t0 = time.monotonic()
            while (r := _say(cb, s2, k2, 2)).status_code == 429:
                assert time.monotonic() - t0 < 3 + 10, r.text  # the lease, and a renewal
                time.sleep(0.2)
            assert _printed(r) == "k is 2\n"
            info = cb.get(f"/v1/sessions/{s1}").json()
            assert (info["state"], info["scratch_bytes"]) == ("culled", 0)
    finally:
        a.stop()
        b.stop()


def test_a_database_error_during_an_ask_is_a_503(quota_server, say_ir):
    """The gateway's database fails while it answers an engine's ask for scratch memory
    (here a trigger makes raising a session's scratch reservation fail): the request gets
    a 503 with Retry-After saying the gateway could not reserve the memory (the server's
    fault, retryable), not a 429 (the quota); nothing was taken, and the retry, with the
    database working again, runs. (Before, a 429 QuotaExceededError.)"""
    a = quota_server
    with a.client("carol") as c:
        sid, kid = _session(c, say_ir)
        with a.db() as db:
            db.execute("CREATE TRIGGER scratch_fails BEFORE UPDATE OF scratch_bytes ON "
                       "sessions WHEN NEW.scratch_bytes > OLD.scratch_bytes BEGIN "
                       "SELECT RAISE(ABORT, 'the disk is on fire'); END")
        try:
            r = _say(c, sid, kid, 1)
        finally:
            with a.db() as db:
                db.execute("DROP TRIGGER scratch_fails")
        body = problem(r, 503)
        assert "the gateway could not reserve the memory" in body["detail"], body
        assert "retry" in body["detail"] and "on fire" not in body["detail"]  # logged
        assert "the disk is on fire" in a.log()
        assert r.headers["retry-after"]
        assert _scratch(c, sid) < SINK
        assert _printed(_say(c, sid, kid, 2)) == "k is 2\n"


DEEP = 100_000  # walk's steps: 800 KB of stack per thread (a 1 MiB allocation), past the
# half MiB the quota leaves beside one print sink


def _data(c, sid: str, fid: int, role: str = "data") -> np.ndarray:
    r = c.get(f"/v1/sessions/{sid}/fields/{fid}/{role}",
              headers={"Accept": "application/octet-stream"})
    assert r.status_code == 200, r.text
    return np.frombuffer(r.content, dtype=r.headers["X-Dtype"])


def stacks_in_the_quota(ca, cb, kernels) -> None:
    """bob's first session (through ``ca``) prints: its engine asks for the print sink
    past its grant and is granted. His second (``cb``) runs a gradient whose reverse-mode
    stacks, grown by the engine's threads while it runs, need more than the quota leaves:
    refused (429) naming the kernel and the first session; nothing of the gradient is
    accumulated (each thread stopped at its first index). Once the first session is
    deleted, the gradient runs and is right."""
    s1, k1 = _session(ca, kernels.ir("say"))
    assert _printed(_say(ca, s1, k1, 1)) == "k is 1\n"
    held = _scratch(ca, s1)
    assert SINK <= held <= QUOTA
    r = cb.post("/v1/sessions", json={})
    assert r.status_code == 201, r.text
    s2 = r.json()["session_id"]
    walk = setup_session(cb, s2, kernels, "walk")["walk"]
    x = np.linspace(0.1, 1.5, kernels.n, dtype=np.float32)
    r = cb.put(f"/v1/sessions/{s2}/fields/{kernels.x.id}/data", content=x.tobytes(),
               headers={"Content-Type": "application/octet-stream", "X-Dtype": "float32",
                        "X-Shape": str(kernels.n)})
    assert r.status_code == 204, r.text
    r = cb.post(f"/v1/sessions/{s2}/fields/{kernels.y.id}/grad/fill", json={"value": 1.0})
    assert r.status_code == 204, r.text
    grad = {"variant": "grad", "args": [DEEP]}
    body = problem(cb.post(f"/v1/sessions/{s2}/kernels/{walk}/launch", json=grad), 429,
                   "QuotaExceededError")
    detail = body["detail"]
    assert body["limit"] == "field_bytes" and body["kernel"] == "walk_grad", body
    assert "the reverse-mode stacks of kernel 'walk_grad' needs" in detail, detail
    assert f"session {s1}: 0 bytes of fields, {held} of scratch" in detail, detail
    assert "stopped partway" in detail
    assert not _data(cb, s2, kernels.x.id, "grad").any()
    assert ca.delete(f"/v1/sessions/{s1}").status_code == 204
    r = cb.post(f"/v1/sessions/{s2}/kernels/{walk}/launch", json=grad)
    assert r.status_code == 200, r.text
    assert _scratch(cb, s2) >= DEEP * 8  # a thread's stack at least
    s, g = x.astype(np.float64), np.ones(kernels.n)
    for _ in range(DEEP):
        g *= np.cos(s)
        s = np.sin(s)
    np.testing.assert_allclose(_data(cb, s2, kernels.x.id, "grad"), g, rtol=1e-3, atol=1e-6)


def test_reverse_mode_stacks_are_in_the_quota(quota_server, kernels):
    """:func:`stacks_in_the_quota` on local worker processes (their threads ask through the
    worker's pipe while the kernel runs). (Before, the stacks were never counted: the
    gradient ran, past the quota.)"""
    with quota_server.client("dave") as c:
        stacks_in_the_quota(c, c, kernels)
