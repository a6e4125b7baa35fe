"""The gateway's database on both backends (SQLite, and a real PostgreSQL started by the
fixtures): migrations, users and tokens, quotas that hold across gateways, the gateways'
leases and what a dead gateway leaves behind."""

from __future__ import annotations

import sqlite3
import threading
import time

import pytest

from difftape.server.db import LOST_WITH_GATEWAY, Database, FieldRecord
from difftape.server.migrations import LATEST, MIGRATIONS, migrate


def _users(db: Database, *names: str) -> list[int]:
    for name in names:
        db.create_user(name)
    return [db.execute("SELECT id FROM users WHERE name = ?", (n,))[0]["id"] for n in names]


def test_migrations_run_once_and_record_versions(db_target):
    db = Database(db_target)
    rows = db.execute("SELECT version FROM schema_migrations ORDER BY version")
    assert [r["version"] for r in rows] == [m.version for m in MIGRATIONS]
    assert migrate(db.conn) == []  # nothing left to apply
    other = Database(db_target)  # a second gateway's start
    assert [r["version"] for r in other.execute("SELECT version FROM schema_migrations")] \
        == [m.version for m in MIGRATIONS]
    other.close()
    db.close()


def _all_at_once(n: int, fn) -> list[int]:
    """Run ``fn(i)`` for i < n on n threads released together by one barrier; the ``i`` for
    which it returned true."""
    won, barrier = [], threading.Barrier(n)

    def run(i: int) -> None:
        barrier.wait()
        if fn(i):
            won.append(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return won


def _start_together(target, n: int = 4) -> tuple[list[Database], list[Exception]]:
    """``n`` gateways opening ``target`` at once, each on its own thread: (the databases
    that opened, the errors the others raised)."""
    errors, dbs = [], []

    def start():
        try:
            dbs.append(Database(target))
        except Exception as e:  # noqa: BLE001 - collected for the assertion
            errors.append(e)

    threads = [threading.Thread(target=start) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return dbs, errors


def test_gateways_starting_together_migrate_once(db_target):
    """Several gateways opening one fresh database at once: the runner's lock makes one of
    them migrate it, and every one starts."""
    dbs, errors = _start_together(db_target)
    assert not errors, errors
    assert dbs[0].execute("SELECT COUNT(*) AS n FROM schema_migrations")[0]["n"] == LATEST
    for db in dbs:
        db.close()


def test_sqlite_gateways_starting_together_on_fresh_files(tmp_path):
    """On a fresh SQLite file, switching to WAL while other connections open it answered
    "database is locked" at once (SQLite calls no busy handler there): about 1 start in 25
    of four gateways at once failed. 60 fresh files, four gateways each, all start."""
    for k in range(60):
        dbs, errors = _start_together(tmp_path / f"g{k}.sqlite3")
        assert not errors, (k, errors)
        for db in dbs:
            db.close()


def test_users_and_tokens(db_target):
    db = Database(db_target)
    token = db.create_user("ann")
    with pytest.raises(ValueError, match="exists already"):
        db.create_user("ann")
    second = db.create_token("ann")
    assert db.user_by_token(token).name == db.user_by_token(second).name == "ann"
    assert [t.user for t in db.tokens("ann")] == ["ann", "ann"]
    with pytest.raises(ValueError, match="no user named"):
        db.create_token("nobody")
    new, old = db.rotate(token)
    assert [t.user for t in old] == ["ann"] and db.user_by_token(new).name == "ann"
    # Only hashes are stored.
    stored = {r["sha256"] for r in db.execute("SELECT sha256 FROM tokens")}
    assert not {token, second, new} & stored and len(stored) == 2
    db.close()


def test_a_token_revoked_through_one_gateway_stops_working_on_another(db_target):
    """Each gateway remembers known tokens; a revocation anywhere (another gateway's
    database connection, the ``difftape token`` command) reaches it within the delay."""
    from difftape.server import db as dbmod

    a, b = Database(db_target), Database(db_target)
    token = a.create_user("ben")
    assert b.user_by_token(token).name == "ben"  # remembered by b now
    a.revoke(token)
    deadline = time.monotonic() + dbmod.REVOKE_DELAY_S + 1.0
    while b.user_by_token(token) is not None:
        assert time.monotonic() < deadline, "b still accepts the revoked token"
        time.sleep(0.05)
    a.close()
    b.close()


def test_wide_numbers_keep_their_precision(db_target):
    """Field byte counts past 2**31 and fractional job seconds, exactly (BIGINT, DOUBLE
    PRECISION columns on PostgreSQL, where INTEGER is 32 bits and REAL is 4 bytes)."""
    db = Database(db_target)
    (uid,) = _users(db, "cy")
    assert db.insert_session("s_big", uid, "cpu", "g_x", limit=4) is None
    big = 3 * 2**31 + 7
    db.put_fields("s_big", {1: FieldRecord(big, [big // 4], ["data", "grad"])}, 2 * big)
    assert db.held_bytes_of(uid) == 2 * big
    assert db.field_records("s_big")[1] == FieldRecord(big, [big // 4], ["data", "grad"])
    total = 0.0
    for s in (0.1, 1e-7, 12345.678901234):
        db.add_job_seconds(uid, s)
        total += s
    assert db.job_seconds(uid) == total
    db.close()


def test_session_quota_holds_across_gateways(db_target):
    """Two gateways (two connections) creating one user's sessions at once: the quota's
    check and the insert are one exclusive transaction, so exactly ``limit`` are made."""
    gateways = [Database(db_target) for _ in range(2)]
    (uid,) = _users(gateways[0], "dee")
    made = _all_at_once(8, lambda i: gateways[i % 2].insert_session(
        f"s_{i}", uid, "cpu", f"g_{i % 2}", limit=3) is None)
    assert len(made) == 3 and gateways[0].count_live_sessions(uid) == 3
    for g in gateways:
        g.close()


def test_field_reservations_hold_across_gateways(db_target):
    gateways = [Database(db_target) for _ in range(2)]
    (uid,) = _users(gateways[0], "eve")
    rids = {}

    def reserve(i: int) -> bool:
        rids[i], _used = gateways[i % 2].reserve_bytes(uid, f"g_{i % 2}", 400, limit=1000)
        return rids[i] is not None

    got = [rids[i] for i in _all_at_once(6, reserve)]
    assert len(got) == 2 and gateways[0].reserved_bytes_of(uid) == 800
    gateways[1].release_bytes(got[0])
    assert gateways[0].reserved_bytes_of(uid) == 400
    for g in gateways:
        g.close()


def test_scratch_grants_hold_across_gateways(db_target):
    """Sessions of one user on two gateways growing their scratch at once: each grant is one
    exclusive transaction over every live session's fields and scratch and the field
    reservations, so the last bytes go to one session only; granted scratch counts against
    field reservations too; a grant never shrinks, and ``want`` is cut to what is free."""
    gateways = [Database(db_target) for _ in range(2)]
    (uid,) = _users(gateways[0], "zed")
    for i in range(6):
        gateways[0].insert_session(f"s_{i}", uid, "cpu", f"g_{i % 2}", limit=10)
    gateways[0].put_fields("s_0", {1: FieldRecord(100, [100], ["data"])}, 100)
    got = _all_at_once(6, lambda i: gateways[i % 2].grow_scratch(
        f"s_{i}", uid, 300, 300, 1000)[0] is not None)
    assert len(got) == 3 and gateways[0].held_bytes_of(uid) == 100 + 3 * 300
    rid, used = gateways[1].reserve_bytes(uid, "g_1", 1, limit=1000)
    assert rid is None and used == 1000
    winner = got[0]
    grant, _, _ = gateways[0].grow_scratch(f"s_{winner}", uid, 10, 10, 1000)
    assert grant == 300  # never lowered
    # Another session: refused, with what the others hold.
    loser = next(i for i in range(6) if i not in got)
    grant, rows, reserved = gateways[0].grow_scratch(f"s_{loser}", uid, 1, 1, 1000)
    assert grant is None and reserved == 0
    assert {r["id"]: (r["field_bytes"], r["scratch_bytes"]) for r in rows}[f"s_{winner}"] == \
        (100 if winner == 0 else 0, 300)
    # A session whose engine stopped holds no scratch: its bytes go to the next ask.
    gateways[0].update_session(f"s_{winner}", state="culled", scratch_bytes=0)
    grant, _, _ = gateways[1].grow_scratch(f"s_{loser}", uid, 100, 10**6, 1000)
    assert grant == 300
    for g in gateways:
        g.close()


def test_jobs_are_inserted_once(db_target):
    db = Database(db_target)
    (uid,) = _users(db, "fay")
    assert db.insert_job(uid, "j1", "s", "[]", "sha", 0, gateway="g_1")
    assert not db.insert_job(uid, "j1", "s", "[]", "sha", 0, gateway="g_2")
    assert db.job(uid, "j1")["gateway"] == "g_1"
    db.close()


def test_claiming_a_saved_session_is_one_gateways(db_target):
    """A culled session requested on two gateways at once resumes on exactly one."""
    gateways = [Database(db_target) for _ in range(2)]
    (uid,) = _users(gateways[0], "gus")
    gateways[0].insert_session("s_c", uid, "cpu", "g_0", limit=4)
    gateways[0].update_session("s_c", holder="g_0", state="culled", gateway=None)
    wins = _all_at_once(2, lambda i: gateways[i].claim_session("s_c", f"g_{i}"))
    assert len(wins) == 1
    assert gateways[0].session("s_c")["gateway"] == f"g_{wins[0]}"
    # The holder's word only: the other gateway cannot change it.
    loser = 1 - wins[0]
    assert not gateways[loser].update_session("s_c", holder=f"g_{loser}", dirty=1)
    for g in gateways:
        g.close()


def test_a_dead_gateways_sessions_jobs_and_reservations_are_settled(db_target):
    """A gateway whose lease ran out is declared dead by the next reap: of its sessions,
    one never changed resumes as it began, one changed after its last save comes back from
    that save (``rolled_back``), one changed and never saved is lost; its unfinished jobs
    fail, its reservations go. A live gateway's sessions are untouched."""
    db = Database(db_target)
    (uid,) = _users(db, "hal")
    db.register_gateway("g_dead", "http://127.0.0.1:1")
    db.register_gateway("g_live", "http://127.0.0.1:2")
    for sid, holder in (("s_clean", "g_dead"), ("s_saved", "g_dead"), ("s_unsaved", "g_dead"),
                        ("s_other", "g_live")):
        db.insert_session(sid, uid, "cpu", holder, limit=10)
        db.update_session(sid, dirty=1)
    db.update_session("s_clean", dirty=0)
    db.update_session("s_saved", saved_path="/x/s_saved-1.npz", saved_at=1.0)
    db.put_fields("s_unsaved", {1: FieldRecord(8, [2], ["data"])}, 8)
    db.insert_job(uid, "j_dead", "s_saved", "[]", "sha", 1, gateway="g_dead")
    db.insert_job(uid, "j_live", "s_other", "[]", "sha", 1, gateway="g_live")
    db.reserve_bytes(uid, "g_dead", 100, limit=10**6)
    for sid in ("s_clean", "s_saved", "s_unsaved", "s_other"):  # their engines' scratch
        assert db.grow_scratch(sid, uid, 50, 50, limit=10**6)[0] == 50
    time.sleep(1.2)
    assert db.renew_gateway("g_live")
    assert db.reap_gateways(1.0, '{"status": 410}') and not db.renew_gateway("g_dead")
    s = {sid: db.session(sid) for sid in ("s_clean", "s_saved", "s_unsaved", "s_other")}
    assert (s["s_clean"]["state"], s["s_clean"]["rolled_back"]) == ("culled", 0)
    assert (s["s_saved"]["state"], s["s_saved"]["rolled_back"]) == ("culled", 1)
    assert s["s_saved"]["saved_path"] == "/x/s_saved-1.npz"
    assert s["s_unsaved"]["state"] == "lost"
    assert s["s_unsaved"]["lost_reason"] == LOST_WITH_GATEWAY
    assert db.field_records("s_unsaved") == {}
    assert all(s[k]["gateway"] is None for k in ("s_clean", "s_saved", "s_unsaved"))
    assert (s["s_other"]["state"], s["s_other"]["gateway"]) == ("active", "g_live")
    assert db.job(uid, "j_dead")["state"] == "failed"
    assert db.job(uid, "j_dead")["problem"] == '{"status": 410}'
    assert db.job(uid, "j_live")["state"] == "queued"
    assert db.reserved_bytes_of(uid) == 0
    # The dead gateway's engines died with it, their scratch with them; the live one's stays.
    assert {k: r["scratch_bytes"] for k, r in s.items()} == {
        "s_clean": 0, "s_saved": 0, "s_unsaved": 0, "s_other": 50}
    assert db.held_bytes_of(uid) == 50
    assert db.gateway("g_dead", 1.0) is None and db.gateway("g_live", 1.0)["live"] == 1
    assert db.reap_gateways(1.0, "{}") == []  # idempotent
    db.close()


def test_sessions_on_ray_actors_outlive_their_gateway(db_target):
    """A session whose engine is a named Ray actor (any gateway reaches it) is taken over by
    whichever gateway gets its request, the epoch going up each time, and keeps its engine
    when its gateway dies: the reap leaves it active with no holder (not culled, not lost)
    and a gateway with a cluster adopts it. Its resources are in its row."""
    db = Database(db_target)
    (uid,) = _users(db, "ida")
    db.register_gateway("g_a", "http://127.0.0.1:1")
    db.register_gateway("g_b", "http://127.0.0.1:2")
    actor = "ray:difftape/difftape-g_a-0123"
    assert db.insert_session("s_ray", uid, "cpu", "g_a", limit=4, resources='{"cpus": 1.5}') \
        is None
    db.update_session("s_ray", worker=actor, dirty=1)
    assert db.grow_scratch("s_ray", uid, 70, 70, limit=1000)[0] == 70
    assert db.session("s_ray")["resources"] == '{"cpus": 1.5}'
    assert db.session("s_ray")["epoch"] == 0
    # Taken over from a live gateway (no forwarding for actors): B holds it, epoch 1, and
    # A's word no longer counts.
    assert db.take_session("s_ray", "g_b", actor)
    row = db.session("s_ray")
    assert (row["gateway"], row["epoch"], row["dirty"]) == ("g_b", 1, 1)
    assert not db.update_session("s_ray", holder="g_a", dirty=0)
    assert not db.take_session("s_ray", "g_a", "ray:difftape/another-actor")
    assert db.engines_by_name() == {actor}
    # B dies: the reap settles nothing of the actor's session but its holder.
    time.sleep(1.2)
    assert db.renew_gateway("g_a")
    assert db.reap_gateways(1.0, "{}") == []
    row = db.session("s_ray")
    assert (row["state"], row["gateway"], row["worker"], row["dirty"]) == \
        ("active", None, actor, 1)
    assert row["scratch_bytes"] == 70  # the actor, and its scratch, live on
    assert db.live_gateways(1.0) == {"g_a"}
    assert db.adopt_sessions("g_a", 1.0) == ["s_ray"]
    row = db.session("s_ray")
    assert (row["gateway"], row["epoch"]) == ("g_a", 2)
    assert db.adopt_sessions("g_a", 1.0) == []  # held by a live gateway now
    # Culled (saved and stopped): no longer on that actor, so not taken over.
    db.update_session("s_ray", holder="g_a", state="culled", worker=None, gateway=None)
    assert not db.take_session("s_ray", "g_b", actor)
    db.close()


def test_the_gateway_before_on_a_data_dir_is_dead_at_once(db_target):
    """A gateway starting on a data dir names the one that ran there before (its lock on
    the dir was free, so it is gone): its sessions are settled without waiting for its
    lease."""
    db = Database(db_target)
    (uid,) = _users(db, "ida")
    db.register_gateway("g_before", None)
    db.insert_session("s_1", uid, "cpu", "g_before", limit=4)
    db.register_gateway("g_after", None, replaces="g_before")
    assert db.reap_gateways(3600.0, "{}") == ["s_1"]
    assert db.session("s_1")["state"] == "culled"
    db.close()


# The schema as the last release without the migration runner made it (SQLite only).
PRE_RUNNER = """
CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, created REAL NOT NULL,
    job_seconds REAL NOT NULL DEFAULT 0);
CREATE TABLE tokens (id TEXT PRIMARY KEY, user INTEGER NOT NULL REFERENCES users(id),
    sha256 TEXT NOT NULL UNIQUE, prefix TEXT NOT NULL, created REAL NOT NULL);
CREATE INDEX tokens_user ON tokens(user);
CREATE TABLE sessions (id TEXT PRIMARY KEY, owner INTEGER NOT NULL REFERENCES users(id),
    arch TEXT NOT NULL, state TEXT NOT NULL, worker TEXT, field_bytes INTEGER NOT NULL DEFAULT 0,
    fields TEXT NOT NULL DEFAULT '{}', saved_path TEXT, lost_reason TEXT, created REAL NOT NULL,
    last_activity REAL NOT NULL);
CREATE INDEX sessions_owner ON sessions(owner);
CREATE TABLE fields (session TEXT NOT NULL, id INTEGER NOT NULL, nbytes INTEGER NOT NULL,
    shape TEXT, roles TEXT NOT NULL, PRIMARY KEY (session, id));
CREATE TABLE kernels (session TEXT NOT NULL, kernel_id TEXT NOT NULL, ir TEXT NOT NULL,
    PRIMARY KEY (session, kernel_id));
CREATE TABLE jobs (owner INTEGER NOT NULL, id TEXT NOT NULL, session TEXT NOT NULL,
    state TEXT NOT NULL, ops TEXT NOT NULL, ops_sha256 TEXT NOT NULL,
    done INTEGER NOT NULL DEFAULT 0, total INTEGER NOT NULL, result TEXT, problem TEXT,
    created REAL NOT NULL, started REAL, finished REAL, PRIMARY KEY (owner, id));
INSERT INTO users (id, name, created) VALUES (1, 'old', 1.0);
INSERT INTO tokens VALUES ('tk_1', 1, 'abc', 'dt_x', 1.0);
INSERT INTO sessions (id, owner, arch, state, worker, field_bytes, fields, saved_path, created,
    last_activity) VALUES ('s_active', 1, 'cpu', 'active', 'local:1', 64,
    '{"1": {"n": 32, "roles": ["data", "grad"]}}', NULL, 1.0, 1.0);
INSERT INTO sessions (id, owner, arch, state, saved_path, created, last_activity)
    VALUES ('s_culled', 1, 'cpu', 'culled', '/d/sessions/s_culled.npz', 1.0, 1.0);
INSERT INTO jobs (owner, id, session, state, ops, ops_sha256, total, created)
    VALUES (1, 'j_run', 's_active', 'running', '[]', 'x', 1, 1.0);
"""


def test_a_database_from_before_the_migration_runner_is_adopted(tmp_path):
    """Its tables are kept and migrated; what its server left (an active session it never
    saved, a running job) is settled as that server's restart settled it (lost, failed);
    a culled session stays resumable."""
    path = tmp_path / "difftape.sqlite3"
    with sqlite3.connect(str(path)) as old:
        old.executescript(PRE_RUNNER)
    old.close()
    db = Database(path)
    assert db.execute("SELECT COUNT(*) AS n FROM schema_migrations")[0]["n"] == LATEST
    with db.transaction() as tx:
        assert "fields" not in tx.columns("sessions")
    assert db.field_records("s_active") == {1: FieldRecord(32, None, ["data", "grad"])}
    assert [t.user for t in db.tokens()] == ["old"]
    assert db.reap_gateways(30.0, '{"status": 410}', orphans=True) == ["s_active"]
    assert db.session("s_active")["state"] == "lost"
    assert db.session("s_culled")["state"] == "culled"
    assert db.session("s_culled")["saved_path"] == "/d/sessions/s_culled.npz"
    assert db.job(1, "j_run")["state"] == "failed"
    db.close()
