"""Authentication and isolation: tokens are required, users see only their own things."""

import httpx

from .conftest import problem, setup_session


def test_probes_need_no_token(service):
    assert httpx.get(service.url + "/livez").json()["status"] == "ok"
    r = httpx.get(service.url + "/readyz")
    assert r.status_code == 200, r.text
    assert r.json()["checks"] == {"worker": "ok", "device": "ok", "cache": "ok",
                                  "database": "ok"}


def test_missing_and_bad_tokens_are_401(service):
    with service.client(user=None) as anon:
        for method, path in [("GET", "/v1/sessions"), ("POST", "/v1/sessions"),
                             ("GET", "/metrics"), ("GET", "/v1/jobs/j1")]:
            r = anon.request(method, path)
            problem(r, 401)
            assert r.headers["www-authenticate"] == "Bearer"
    with service.client(user=None, headers={"Authorization": "Bearer dt_not-a-token"}) as bad:
        problem(bad.get("/v1/sessions"), 401)
    with service.client(user=None, headers={"Authorization": "Basic YWxpY2U6eA=="}) as basic:
        problem(basic.get("/v1/sessions"), 401)


def test_other_users_session_is_404(service, alice, bob, session, kernels):
    ids = setup_session(alice, session, kernels, "double")
    fid = kernels.x.id
    for method, path, kw in [
        ("GET", f"/v1/sessions/{session}", {}),
        ("DELETE", f"/v1/sessions/{session}", {}),
        ("POST", f"/v1/sessions/{session}/resume", {}),
        ("GET", f"/v1/sessions/{session}/fields/{fid}/data", {}),
        ("POST", f"/v1/sessions/{session}/fields/{fid}/data/fill", {"json": {"value": 1}}),
        ("POST", f"/v1/sessions/{session}/kernels/{ids['double']}/launch", {"json": {}}),
        ("POST", f"/v1/sessions/{session}/batch", {"json": {"ops": []}}),
        ("POST", f"/v1/sessions/{session}/jobs",
         {"json": {"ops": [{"op": "clear_grads"}]}}),
    ]:
        problem(bob.request(method, path, **kw), 404)
    assert session not in [s["session_id"] for s in bob.get("/v1/sessions").json()["sessions"]]
    # ... and alice's session is untouched by bob's attempts.
    assert alice.get(f"/v1/sessions/{session}").json()["state"] == "active"
    assert session in [s["session_id"] for s in alice.get("/v1/sessions").json()["sessions"]]


def test_other_users_job_is_404(alice, bob, session):
    r = alice.post(f"/v1/sessions/{session}/jobs",
                   json={"ops": [{"op": "clear_grads"}], "job_id": "mine-1"})
    assert r.status_code == 202, r.text
    for method, path in [("GET", "/v1/jobs/mine-1"), ("GET", "/v1/jobs/mine-1/result"),
                         ("POST", "/v1/jobs/mine-1/cancel"), ("GET", "/v1/jobs/mine-1/events")]:
        problem(bob.request(method, path), 404)
    # Job ids are per user: bob may use the same id for a job of his own.
    sid = bob.post("/v1/sessions", json={}).json()["session_id"]
    try:
        r = bob.post(f"/v1/sessions/{sid}/jobs",
                     json={"ops": [{"op": "clear_duals"}], "job_id": "mine-1"})
        assert r.status_code == 202 and r.json()["session_id"] == sid, r.text
    finally:
        bob.delete(f"/v1/sessions/{sid}")


def test_deleted_session_is_gone(alice):
    sid = alice.post("/v1/sessions", json={}).json()["session_id"]
    assert alice.delete(f"/v1/sessions/{sid}").status_code == 204
    problem(alice.get(f"/v1/sessions/{sid}"), 404)
    problem(alice.delete(f"/v1/sessions/{sid}"), 404)


def test_token_create_stores_only_a_hash(tmp_path):
    import hashlib
    import sqlite3
    import subprocess
    import sys

    def create(name):
        return subprocess.run([sys.executable, "-m", "difftape.cli", "token", "create", name,
                               "--data-dir", str(tmp_path)], capture_output=True, text=True,
                              timeout=60)

    out = create("erin")
    token = out.stdout.strip()
    assert out.returncode == 0 and token.startswith("dt_") and len(token) > 40
    db_bytes = (tmp_path / "difftape.sqlite3").read_bytes()
    wal = tmp_path / "difftape.sqlite3-wal"
    if wal.exists():
        db_bytes += wal.read_bytes()
    assert token.encode() not in db_bytes
    with sqlite3.connect(str(tmp_path / "difftape.sqlite3")) as db:
        (stored,) = db.execute("SELECT sha256 FROM tokens JOIN users ON users.id = "
                               "tokens.user WHERE name = 'erin'").fetchone()
    assert stored == hashlib.sha256(token.encode()).hexdigest()
    # A second create gives the user another token (see test_first_contact.py).
    again = create("erin")
    assert again.returncode == 0 and again.stdout.strip() not in ("", token)
