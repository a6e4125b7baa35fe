"""Every error is problem JSON naming the difftape exception; bad input never crashes."""

import os
import re

import httpx
import pytest

from .conftest import problem, setup_session


def test_framework_errors_are_problems(alice, session):
    problem(alice.get("/v1/nowhere"), 404)
    problem(alice.put("/v1/sessions"), 405)
    body = problem(alice.post(f"/v1/sessions/{session}/fields", json={"id": "x"}), 422)
    assert body["errors"] and all("loc" in e for e in body["errors"])
    # A body that is not JSON at all is malformed (400), like a broken .npy.
    problem(alice.post(f"/v1/sessions/{session}/batch", content=b"{not json",
                       headers={"Content-Type": "application/json"}), 400)
    problem(alice.post(f"/v1/sessions/{session}/batch",
                       json={"ops": [{"op": "exec", "code": "import os"}]}), 422)
    problem(alice.get("/v1/sessions/..%2f..%2fetc"), 404)


def test_malformed_ir_is_422(alice, session, kernels):
    setup_session(alice, session, kernels)
    good = kernels.ir("double")
    cases = [
        {"name": "k"},                                             # no body, no params
        {**good, "body": [["no_such_op", None, [], None, []]]},    # unknown op
        {**good, "body": [["add", "f32", [5, 6], None, []]]},      # dangling operands
        {**good, "buffers": [[{"t": ["field", 999, "primal"]}, "f32", [16], "x", 0]]},
        {**good, "params": "nope"},
    ]
    for ir in cases:
        r = alice.post(f"/v1/sessions/{session}/kernels", json={"ir": ir})
        body = r.json()
        assert r.status_code == 422, (ir, r.text)
        assert body["difftape_error"] in ("IRValidationError", "CompileError"), body
    # The session survived all of that.
    r = alice.post(f"/v1/sessions/{session}/kernels", json={"ir": good})
    assert r.status_code == 200, r.text


def test_malformed_location_tables_are_422(alice, session, kernels):
    """Statement locations are validated like the rest of the IR: a table of the wrong shape,
    an index out of range, a huge or control-character text is a 422 naming the place."""
    setup_session(alice, session, kernels)
    good = kernels.ir("poke")
    locs = good["locations"]
    nstmts = sum(locs["runs"][1::2])
    cases = [
        ("not a table", "x", r"'locations' must be an object"),
        ("extra key", {**locs, "code": "import os"}, "has the keys"),
        ("file index", {**locs, "lines": [[5, 1, "t"]]}, r"lines\[0\]\[0\]: file index"),
        ("line zero", {**locs, "lines": [[0, 0, "t"]]}, r"lines\[0\]\[1\]: line numbers"),
        ("text type", {**locs, "lines": [[0, 1, 7]]}, "a line's text must be a string"),
        ("huge text", {**locs, "lines": [[0, 1, "x" * 100_000]]}, "0 to 512 characters"),
        ("control text", {**locs, "lines": [[0, 1, "a\x1b[2Jb"]]}, "control characters"),
        ("empty file", {**locs, "files": [""]}, "1 to 4096 characters"),
        ("too many files", {**locs, "files": ["f"] * 300}, "300 files, at most 256"),
        ("run index", {**locs, "runs": [9, nstmts]}, r"runs\[0\]: line index 9"),
        ("run too long", {**locs, "runs": [0, nstmts + 1]}, r"runs\[1\]: a run of"),
        ("runs short", {**locs, "runs": [0, nstmts - 1]}, "runs cover"),
        ("odd runs", {**locs, "runs": [0]}, "pairs"),
        ("runs flood", {**locs, "runs": [0, 1] * (nstmts + 1)}, "pairs"),
    ]
    for name, table, reason in cases:
        r = alice.post(f"/v1/sessions/{session}/kernels", json={"ir": {**good,
                                                                       "locations": table}})
        body = problem(r, 422, "IRValidationError")
        assert body["detail"].startswith("locations"), (name, body)
        assert re.search(reason, body["detail"]), (name, body["detail"])
    assert alice.post(f"/v1/sessions/{session}/kernels", json={"ir": good}).status_code == 200


def test_the_server_quotes_locations_and_reads_no_file(alice, session, kernels):
    """A location naming a file on the server is data: the bounds error quotes the text the
    IR carried, never the file's (the server reads no file a client names)."""
    setup_session(alice, session, kernels)
    ir = kernels.ir("poke")
    server_file = os.path.abspath(__file__)  # on the server's disk too (same machine)
    ir["locations"] = {**ir["locations"], "files": [server_file],
                       "lines": [[0, 1, "the text the client sent"]] * len(
                           ir["locations"]["lines"])}
    r = alice.post(f"/v1/sessions/{session}/kernels", json={"ir": ir})
    assert r.status_code == 200, r.text
    kid = r.json()["kernel_id"]
    body = problem(alice.post(f"/v1/sessions/{session}/kernels/{kid}/launch",
                              json={"args": [kernels.n + 5]}), 422, "IndexOutOfRangeError")
    assert body["detail"].endswith(f"in kernel 'poke', {server_file}:1\n"
                                   "    the text the client sent"), body["detail"]
    with open(server_file) as f:
        assert f.readline().strip() not in body["detail"]


def test_bad_index_is_an_error_response_not_a_crash(alice, session, kernels):
    ids = setup_session(alice, session, kernels, "poke")
    url = f"/v1/sessions/{session}/kernels/{ids['poke']}/launch"
    # IndexOutOfRangeError: the KernelAssertionError (and IndexError) of the bounds checks
    body = problem(alice.post(url, json={"args": [kernels.n + 5]}), 422,
                   "IndexOutOfRangeError")
    assert body["kernel"] in (None, "poke")
    problem(alice.post(url, json={"args": [-1]}), 422, "IndexOutOfRangeError")
    assert alice.post(url, json={"args": [3]}).status_code == 200
    problem(alice.post(url, json={"args": []}), 422, "ArgumentError")
    r = alice.get(f"/v1/sessions/{session}/fields/{kernels.y.id}/data/item",
                  params={"index": "3"})
    assert r.json()["value"] == 1.0
    problem(alice.get(f"/v1/sessions/{session}/fields/{kernels.y.id}/data/item",
                      params={"index": "99"}), 422, "EngineError")
    problem(alice.post(f"/v1/sessions/{session}/kernels/deadbeef/launch", json={}), 422,
            "EngineError")
    for bad in ("1,x", "1;2", ",".join(["0"] * 9)):
        problem(alice.get(f"/v1/sessions/{session}/fields/{kernels.y.id}/data/item",
                          params={"index": bad}), 422)


def test_batch_error_reports_its_index(alice, session, kernels):
    ids = setup_session(alice, session, kernels, "poke")
    ops = [{"op": "launch", "kernel_id": ids["poke"], "args": [1]},
           {"op": "fill", "id": kernels.x.id, "value": 2.5},
           {"op": "launch", "kernel_id": ids["poke"], "args": [1000]},
           {"op": "fill", "id": kernels.x.id, "value": 7}]
    body = problem(alice.post(f"/v1/sessions/{session}/batch", json={"ops": ops}), 422,
                   "IndexOutOfRangeError")
    assert body["index"] == 2
    r = alice.get(f"/v1/sessions/{session}/fields/{kernels.x.id}/data/item",
                  params={"index": "0"})
    assert r.json()["value"] == 2.5  # ops before the failure ran, those after did not


def test_host_and_origin_guards(service, alice, session):
    # DNS rebinding: a foreign Host is refused even with a valid token.
    problem(alice.get("/v1/sessions", headers={"Host": "evil.example"}), 400)
    problem(httpx.get(service.url + "/livez", headers={"Host": "attacker.test:8000"}), 400)
    assert alice.get("/v1/sessions", headers={"Host": f"localhost:{service.port}"}) \
        .status_code == 200
    # CSRF: state-changing requests from a browser origin are refused...
    r = alice.post("/v1/sessions", json={}, headers={"Origin": "https://evil.example"})
    problem(r, 403)
    problem(alice.delete(f"/v1/sessions/{session}", headers={"Origin": "null"}), 403)
    assert alice.get(f"/v1/sessions/{session}").json()["state"] == "active"
    # ... reads are not state-changing (and need the token anyway).
    assert alice.get("/v1/sessions", headers={"Origin": "https://evil.example"}) \
        .status_code == 200


def test_server_binds_loopback_by_default(monkeypatch):
    from difftape.server.settings import Settings

    s = Settings(_env_file=None)
    assert s.host == "127.0.0.1" and s.port == 8000 and "*" not in s.allowed_hosts
    assert s.allowed_origins == []
    # A specific bind address is an allowed Host; a wildcard bind adds nothing.
    assert "10.1.2.3" in Settings(host="10.1.2.3").host_names
    assert Settings(host="0.0.0.0").host_names == s.allowed_hosts
    # Lists from the environment are comma-separated.
    monkeypatch.setenv("DIFFTAPE_ALLOWED_HOSTS", "lab.example, gpu1.example")
    assert Settings().allowed_hosts == ["lab.example", "gpu1.example"]


def test_default_gpus_for_sessions_need_a_cuda_server():
    """DIFFTAPE_SESSION_GPUS (a cluster's GPU worker group) reserves devices for every
    session: refused at start on a CPU server rather than holding GPUs no kernel uses."""
    from pydantic import ValidationError

    from difftape.server.settings import Settings

    with pytest.raises(ValidationError, match="set --arch cuda"):
        Settings(_env_file=None, session_gpus=0.5, cluster="auto")
    with pytest.raises(ValidationError, match="needs --cluster"):
        Settings(_env_file=None, session_gpus=0.5, arch="cuda")
    assert Settings(_env_file=None, session_gpus=0.5, arch="cuda",
                    cluster="auto").session_gpus == 0.5


def test_internal_errors_are_problems_too(tmp_path):
    """An engine bug is a 500 problem (not a dropped connection), a worker exiting on its
    own a 410; the server carries on."""
    from .conftest import start_server

    server = start_server(tmp_path / "data", users=("alice",),
                          engine="tests.service.faulty_engine:FaultyEngine")
    try:
        with server.client() as c:
            sid = c.post("/v1/sessions", json={}).json()["session_id"]
            r = c.post(f"/v1/sessions/{sid}/fields", json={"id": 1, "dtype": "f32",
                                                           "shape": [4]})
            assert r.status_code == 201, r.text
            problem(c.post(f"/v1/sessions/{sid}/fields/1/data/fill", json={"value": 1}), 500)
            assert c.get(f"/v1/sessions/{sid}/fields/1/data").status_code == 200
            body = problem(c.post(f"/v1/sessions/{sid}/batch",
                                  json={"ops": [{"op": "clear_duals"}]}), 410,
                           "SessionLostError")
            assert "exit code 3" in body["detail"]
            assert c.post("/v1/sessions", json={}).status_code == 201
    finally:
        server.stop()


def test_field_offsets_over_http(alice, session):
    """``offset`` of ``POST .../fields`` (and ``create_field``): taken, and a malformed one
    refused as a problem naming the error."""
    base = f"/v1/sessions/{session}/fields"
    r = alice.post(base, json={"id": 71, "dtype": "f32", "shape": [4, 2], "offset": [-2, 5]})
    assert r.status_code == 201, r.text
    problem(alice.post(base, json={"id": 72, "dtype": "f32", "shape": [4],
                                   "offset": [2**31]}), 422)
    body = problem(alice.post(base, json={"id": 73, "dtype": "f32", "shape": [4],
                                          "offset": [2**31 - 4]}), 422, "ShapeError")
    assert "does not fit in i32" in body["detail"], body
    body = problem(alice.post(base, json={"id": 74, "dtype": "f32", "shape": [4, 2],
                                          "offset": [1]}), 422, "ShapeError")
    assert "one entry per axis" in body["detail"], body


def test_a_database_error_is_a_503(tmp_path):
    """The gateway's database failing under a request (here a trigger makes creating a
    session fail) is the server's fault and worth a retry: a 503 problem with Retry-After,
    the database's message in the server's log and not in the answer; once the database
    works again, the retry succeeds. (Before, a 500.)"""
    from .conftest import start_server

    server = start_server(tmp_path / "data", users=("alice",), spare_workers=0)
    try:
        with server.client() as c:
            with server.db() as db:
                db.execute("CREATE TRIGGER sessions_fail BEFORE INSERT ON sessions BEGIN "
                           "SELECT RAISE(ABORT, 'the disk is on fire'); END")
            r = c.post("/v1/sessions", json={})
            body = problem(r, 503)
            assert "database failed; retry" in body["detail"] and r.headers["retry-after"]
            assert "on fire" not in r.text and "the disk is on fire" in server.log()
            with server.db() as db:
                db.execute("DROP TRIGGER sessions_fail")
            assert c.post("/v1/sessions", json={}).status_code == 201
    finally:
        server.stop()


def test_a_database_error_under_the_token_lookup_is_a_503(tmp_path):
    """The token lookup runs in a middleware, before the routes: a database failing there
    is the same 503 with Retry-After as under a route, the reason in the log only (before:
    an error escaping the middleware, a bare 500). Here the tokens table is renamed away, so
    looking up a token not yet remembered fails."""
    from .conftest import start_server

    server = start_server(tmp_path / "data", users=("alice", "bob"), spare_workers=0)
    try:
        with server.client("alice") as alice, server.client("bob") as bob:
            assert alice.get("/v1/sessions").status_code == 200  # alice's token remembered
            with server.db() as db:
                db.execute("ALTER TABLE tokens RENAME TO tokens_away")
            r = bob.get("/v1/sessions")
            body = problem(r, 503)
            assert "database failed; retry" in body["detail"] and r.headers["retry-after"]
            assert "tokens_away" not in r.text and "no such table: tokens" in server.log()
            assert alice.get("/v1/sessions").status_code == 200
            with server.db() as db:
                db.execute("ALTER TABLE tokens_away RENAME TO tokens")
            assert bob.get("/v1/sessions").status_code == 200
    finally:
        server.stop()
