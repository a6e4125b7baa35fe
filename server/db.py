"""The gateway's database: users and tokens, sessions, fields, kernels, jobs, and the
gateways that share it.

SQLite under the data dir by default (WAL mode, so ``difftape token create`` can add users
while a server runs); PostgreSQL when ``DIFFTAPE_DATABASE_URL=postgresql://...`` is set, so
that several gateways serve the same users and sessions (see ``dbconn`` for the two backends
and ``migrations`` for the schema). The session table is the session -> gateway -> worker
map: which gateway runs a session's engine, where its fields were last saved and whether
they changed since.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from .dbconn import Connection, is_postgres_url
from .migrations import migrate


def hash_token(token: str) -> str:
    """Tokens are 256-bit random strings, so a fast hash is enough: nothing to brute-force,
    unlike passwords, and the lookup by hash costs one index probe per request."""
    return hashlib.sha256(token.encode()).hexdigest()


#: A revoked or rotated token stops working on a running server within this many seconds.
REVOKE_DELAY_S = 1.0
#: How many leading characters of a token are stored, to tell a user's tokens apart.
TOKEN_PREFIX = 8


def _token_id() -> str:
    return "tk_" + secrets.token_hex(6)


#: Sessions whose engine every gateway reaches by its name (a Ray actor, ``ray:...``).
_BY_NAME = "substr(COALESCE(worker, ''), 1, 4) = 'ray:'"

#: Why a session is lost when its gateway died with changes it had not saved yet.
LOST_WITH_GATEWAY = ("the gateway running it stopped (killed or crashed) before its latest "
                     "changes were saved")


@dataclass(frozen=True)
class User:
    id: int
    name: str


@dataclass(frozen=True)
class TokenInfo:
    """A token as ``difftape token list`` shows it: never the token itself."""

    id: str
    user: str
    prefix: str
    created: float


@dataclass
class FieldRecord:
    """What the gateway knows of a field: bytes per storage role, its full array shape (None
    for fields recorded before shapes were), and which roles have storage."""

    nbytes: int
    shape: list[int] | None
    roles: list[str]

    @property
    def total(self) -> int:
        return self.nbytes * len(self.roles)


class Database:
    """The gateway's tables on SQLite (a path) or PostgreSQL (a ``postgresql://`` URL)."""

    def __init__(self, target: str | Path) -> None:
        self.conn = Connection(target)
        self.path = None if is_postgres_url(target) else Path(target)
        self._users: dict[str, User] = {}  # token hash -> user, see user_by_token
        self._checked = time.monotonic()
        self._version = None
        migrate(self.conn)

    @property
    def backend(self) -> str:
        """``sqlite`` or ``postgresql``."""
        return self.conn.dialect.name

    @property
    def IntegrityError(self) -> type[Exception]:  # noqa: N802 - an exception class
        return self.conn.IntegrityError

    def transaction(self, *, exclusive: bool = False):
        return self.conn.transaction(exclusive=exclusive)

    def close(self) -> None:
        self.conn.close()

    def execute(self, sql: str, args: tuple = ()) -> list:
        return self.conn.execute(sql, args)

    def change(self, sql: str, args: tuple = ()) -> int:
        return self.conn.change(sql, args)

    def ping(self) -> bool:
        try:
            self.execute("SELECT 1")
            return True
        except self.conn.Error:
            return False

    # -------------------------------------------------------------- users and tokens
    def create_user(self, name: str) -> str:
        """Add a user and return their first token (see :meth:`create_token`)."""
        try:
            self.execute("INSERT INTO users (name, created) VALUES (?, ?)", (name, time.time()))
        except self.IntegrityError:
            raise ValueError(f"a user named {name!r} exists already") from None
        return self.create_token(name)

    def create_token(self, name: str) -> str:
        """A new token for the existing user ``name``. Only its hash is stored, so it is
        shown once; the user's other tokens stay valid."""
        token = "dt_" + secrets.token_urlsafe(32)
        with self.transaction(exclusive=True) as tx:
            row = tx.one("SELECT id FROM users WHERE name = ?", (name,))
            if row is None:
                raise ValueError(f"no user named {name!r} (`difftape token list` shows them)")
            tx.execute('INSERT INTO tokens (id, "user", sha256, prefix, created) VALUES '
                       "(?, ?, ?, ?, ?)", (_token_id(), row["id"], hash_token(token),
                                           token[:TOKEN_PREFIX], time.time()))
        return token

    def has_user(self, name: str) -> bool:
        return bool(self.execute("SELECT 1 FROM users WHERE name = ?", (name,)))

    def tokens(self, name: str | None = None) -> list[TokenInfo]:
        """The tokens (every user's, or ``name``'s), oldest first."""
        rows = self.execute(
            'SELECT t.id, u.name, t.prefix, t.created FROM tokens t JOIN users u ON '
            'u.id = t."user"' + (" WHERE u.name = ?" if name is not None else "") +
            " ORDER BY t.created, t.id", (name,) if name is not None else ())
        return [TokenInfo(r["id"], r["name"], r["prefix"], r["created"]) for r in rows]

    @staticmethod
    def _find_tokens(tx, ref: str) -> list:
        """The token ``ref`` names: its id (``tk_...``) or the token itself (``dt_...``)."""
        return tx.execute('SELECT t.id, t."user", u.name FROM tokens t JOIN users u ON '
                          'u.id = t."user" WHERE t.id = ? OR t.sha256 = ?',
                          (ref, hash_token(ref)))

    def revoke(self, ref: str | None = None, *, user: str | None = None) -> list[TokenInfo]:
        """Delete one token (``ref``: its id or the token itself) or every token of
        ``user``; the tokens deleted. Running servers stop accepting them within
        :data:`REVOKE_DELAY_S`."""
        with self.transaction(exclusive=True) as tx:
            rows = self._select_for_change(tx, ref, user)
            tx.executemany("DELETE FROM tokens WHERE id = ?", [(r["id"],) for r in rows])
            tx.execute("UPDATE counters SET value = value + 1 WHERE name = 'tokens'")
        return [TokenInfo(r["id"], r["name"], "", 0.0) for r in rows]

    def rotate(self, ref: str | None = None, *, user: str | None = None
               ) -> tuple[str, list[TokenInfo]]:
        """Replace one token (or all of ``user``'s) by a new one, in one transaction; the new
        token and the ones it replaced."""
        token = "dt_" + secrets.token_urlsafe(32)
        with self.transaction(exclusive=True) as tx:
            rows = self._select_for_change(tx, ref, user)
            tx.executemany("DELETE FROM tokens WHERE id = ?", [(r["id"],) for r in rows])
            tx.execute('INSERT INTO tokens (id, "user", sha256, prefix, created) VALUES '
                       "(?, ?, ?, ?, ?)", (_token_id(), rows[0]["user"], hash_token(token),
                                           token[:TOKEN_PREFIX], time.time()))
            tx.execute("UPDATE counters SET value = value + 1 WHERE name = 'tokens'")
        return token, [TokenInfo(r["id"], r["name"], "", 0.0) for r in rows]

    def _select_for_change(self, tx, ref: str | None, user: str | None) -> list:
        if (ref is None) == (user is None):
            raise ValueError("name one token (its id or the token) or one user")
        if ref is not None:
            rows = self._find_tokens(tx, ref)
            if not rows:
                raise ValueError(f"no token {ref!r}: give a token id from `difftape token "
                                 f"list` or the token itself")
            return rows
        rows = tx.execute('SELECT t.id, t."user", u.name FROM tokens t JOIN users u ON '
                          'u.id = t."user" WHERE u.name = ?', (user,))
        if not rows:
            if tx.one("SELECT 1 AS one FROM users WHERE name = ?", (user,)) is None:
                raise ValueError(f"no user named {user!r}")
            raise ValueError(f"user {user!r} has no tokens (make one with `difftape token "
                             f"create {user}`)")
        return rows

    def user_by_token(self, token: str) -> User | None:
        """The token's user, or None. Known tokens are remembered, so most requests cost no
        database statement; the cache is dropped once any process (another gateway, a
        ``difftape token revoke``/``rotate``) has revoked a token, which moves the 'tokens'
        counter, checked at most every :data:`REVOKE_DELAY_S`. Unknown tokens are looked
        up each time (``token create`` may have just run)."""
        now = time.monotonic()
        if now - self._checked > REVOKE_DELAY_S:
            self._checked = now
            version = self.execute("SELECT value FROM counters WHERE name = 'tokens'")
            version = version[0]["value"] if version else None
            if version != self._version:
                self._version = version
                self._users.clear()
        h = hash_token(token)
        user = self._users.get(h)
        if user is None:
            rows = self.execute('SELECT u.id, u.name FROM tokens t JOIN users u ON '
                                'u.id = t."user" WHERE t.sha256 = ?', (h,))
            if not rows:
                return None
            user = self._users[h] = User(rows[0]["id"], rows[0]["name"])
        return user

    def add_job_seconds(self, user_id: int, seconds: float) -> None:
        self.execute("UPDATE users SET job_seconds = job_seconds + ? WHERE id = ?",
                     (seconds, user_id))

    def job_seconds(self, user_id: int) -> float:
        rows = self.execute("SELECT job_seconds FROM users WHERE id = ?", (user_id,))
        return float(rows[0]["job_seconds"]) if rows else 0.0

    # -------------------------------------------------------------- gateways
    def register_gateway(self, gid: str, url: str | None, *, replaces: str | None = None
                         ) -> None:
        """Record a starting gateway (its lease begins now, by the database's clock).
        ``replaces``: the gateway that ran on this data dir before, now certainly dead
        (its lock on the data dir was free), so its sessions need not wait for its lease."""
        with self.transaction() as tx:
            if replaces:
                tx.execute("UPDATE gateways SET state = 'dead' WHERE id = ?", (replaces,))
            tx.execute("INSERT INTO gateways (id, url, state, started, heartbeat) VALUES "
                       "(?, ?, 'live', {now}, {now})", (gid, url))

    def renew_gateway(self, gid: str) -> bool:
        """Renew the gateway's lease; False if it is no longer live (declared dead)."""
        return self.change("UPDATE gateways SET heartbeat = {now} WHERE id = ? AND "
                           "state = 'live'", (gid,)) == 1

    def stop_gateway(self, gid: str) -> None:
        self.execute("UPDATE gateways SET state = 'stopped' WHERE id = ?", (gid,))

    def gateway(self, gid: str, lease_s: float):
        """The gateway's row with ``live`` (1 while its lease runs), or None."""
        rows = self.execute(
            "SELECT id, url, state, CASE WHEN state = 'live' AND heartbeat >= {now} - ? THEN "
            "1 ELSE 0 END AS live FROM gateways WHERE id = ?", (lease_s, gid))
        return rows[0] if rows else None

    def reap_gateways(self, lease_s: float, problem_json: str, *, orphans: bool = False
                      ) -> list[str]:
        """Declare dead the gateways whose lease ran out, and settle what dead gateways
        held: their sessions are released (``culled``: resumed from their last save by the
        next request on any gateway; brought back from a save older than their last change:
        ``rolled_back``, told to the next request; changed and never saved: ``lost``),
        their unfinished jobs fail with ``problem_json``, their field reservations and their
        engines' scratch memory (stopped with them) go, and then their rows. Sessions whose
        engine any gateway reaches by name (a Ray actor, which outlives its gateway, with
        its scratch) stay active: they only lose their holder, and the next gateway to
        take them (``adopt_sessions``) goes on with the same engine. ``orphans``
        (at a gateway's start) also settles active sessions and unfinished jobs that name
        no gateway at all, left by a server of an earlier version.
        Every gateway runs it at start and with each lease renewal; idempotent. The
        sessions settled."""
        with self.transaction() as tx:
            tx.execute("UPDATE gateways SET state = 'dead' WHERE state = 'live' AND "
                       "heartbeat < {now} - ?", (lease_s,))
            dead = [r["id"] for r in tx.execute("SELECT id FROM gateways WHERE state != "
                                                "'live'")]
            if not dead and not orphans:
                return []
            held = f"gateway IN ({','.join('?' * len(dead))})" if dead else "1 = 0"
            if orphans:
                held = f"(gateway IS NULL OR {held})"
            args = tuple(dead)
            anyhow = held
            held += f" AND NOT {_BY_NAME}"
            sids = [r["id"] for r in tx.execute(
                f"SELECT id FROM sessions WHERE {held} AND state = 'active'", args)]
            if sids:
                lost = [r["id"] for r in tx.execute(
                    f"SELECT id FROM sessions WHERE {held} AND state = 'active' AND dirty = 1 "
                    "AND saved_path IS NULL", args)]
                tx.executemany("UPDATE sessions SET state = 'lost', lost_reason = ?, worker = "
                               "NULL, gateway = NULL, field_bytes = 0, scratch_bytes = 0 "
                               "WHERE id = ?",
                               [(LOST_WITH_GATEWAY, sid) for sid in lost])
                tx.executemany("DELETE FROM fields WHERE session = ?", [(s,) for s in lost])
                tx.execute(f"UPDATE sessions SET state = 'culled', rolled_back = dirty, "
                           f"dirty = 0, worker = NULL, gateway = NULL, scratch_bytes = 0 "
                           f"WHERE {held} AND state = 'active'", args)
            if dead:
                # Claimed and not resumed yet, or deleted meanwhile: only the holder goes.
                tx.execute(f"UPDATE sessions SET gateway = NULL, worker = NULL, "
                           f"scratch_bytes = 0 WHERE {held}", args)
                tx.execute(f"UPDATE sessions SET gateway = NULL WHERE {anyhow} AND "
                           f"{_BY_NAME}", args)
            held = anyhow
            tx.execute(f"UPDATE jobs SET state = 'failed', finished = ?, problem = ? WHERE "
                       f"{held} AND state IN ('queued', 'running')",
                       (time.time(), problem_json, *args))
            if dead:
                tx.execute(f"DELETE FROM reservations WHERE {held}", args)
                tx.execute(f"DELETE FROM gateways WHERE id IN ({','.join('?' * len(dead))})",
                           args)
        return sids

    def adopt_sessions(self, gid: str, lease_s: float) -> list[str]:
        """Take the active sessions whose engine any gateway reaches by name (Ray actors)
        and that no live gateway holds (theirs died) for ``gid``; their ids."""
        with self.transaction() as tx:
            sids = [r["id"] for r in tx.execute(
                f"SELECT id FROM sessions WHERE state = 'active' AND {_BY_NAME} AND (gateway "
                "IS NULL OR gateway NOT IN (SELECT id FROM gateways WHERE state = 'live' AND "
                "heartbeat >= {now} - ?))", (lease_s,))]
            tx.executemany("UPDATE sessions SET gateway = ?, epoch = epoch + 1 WHERE id = ?",
                           [(gid, sid) for sid in sids])
        return sids

    def instance(self) -> str:
        """This database's id (hex): every gateway of it reads the same one."""
        rows = self.execute("SELECT value FROM counters WHERE name = 'instance'")
        return f"{int(rows[0]['value']):012x}"

    def live_gateways(self, lease_s: float) -> set[str]:
        return {r["id"] for r in self.execute(
            "SELECT id FROM gateways WHERE state = 'live' AND heartbeat >= {now} - ?",
            (lease_s,))}

    def engines_by_name(self) -> set[str]:
        """The addresses of the engines sessions run on that any gateway reaches by name."""
        return {r["worker"] for r in self.execute(
            f"SELECT worker FROM sessions WHERE {_BY_NAME} AND state != 'deleted'")}

    # -------------------------------------------------------------- sessions
    def insert_session(self, sid: str, owner: int, arch: str, gateway: str,
                       limit: int, resources: str | None = None) -> int | None:
        """Insert an active session held by ``gateway`` unless the owner has ``limit`` live
        sessions already (then that count, and nothing inserted): one exclusive
        transaction, so gateways creating sessions at once cannot overrun the quota."""
        now = time.time()
        with self.transaction(exclusive=True) as tx:
            n = int(tx.one("SELECT COUNT(*) AS n FROM sessions WHERE owner = ? AND state IN "
                           "('active', 'culled')", (owner,))["n"])
            if n >= limit:
                return n
            tx.execute("INSERT INTO sessions (id, owner, arch, state, gateway, created, "
                       "last_activity, resources) VALUES (?, ?, ?, 'active', ?, ?, ?, ?)",
                       (sid, owner, arch, gateway, now, now, resources))
        return None

    def remove_session(self, sid: str) -> None:
        """Forget a session that never started (its engine could not be had)."""
        self.execute("DELETE FROM sessions WHERE id = ?", (sid,))

    def session(self, sid: str):
        rows = self.execute("SELECT * FROM sessions WHERE id = ?", (sid,))
        return rows[0] if rows else None

    def session_holder(self, sid: str, owner: int, lease_s: float):
        """Where ``owner``'s session ``sid`` runs: ``gateway``, its ``url`` and ``live``
        (1 while that gateway's lease runs); None if there is no such session."""
        rows = self.execute(
            "SELECT s.gateway, s.worker, g.url, CASE WHEN g.state = 'live' AND g.heartbeat >= "
            "{now} - ? THEN 1 ELSE 0 END AS live FROM sessions s LEFT JOIN gateways g ON g.id "
            "= s.gateway WHERE s.id = ? AND s.owner = ? AND s.state != 'deleted'",
            (lease_s, sid, owner))
        return rows[0] if rows else None

    def sessions_of(self, owner: int) -> list:
        return self.execute("SELECT * FROM sessions WHERE owner = ? AND state != 'deleted' "
                            "ORDER BY created", (owner,))

    def update_session(self, sid: str, *, holder: str | None = None, **cols) -> bool:
        """Set columns of the session; with ``holder``, only while that gateway holds it
        (a gateway that lost a session, e.g. declared dead while stalled, changes nothing).
        Whether the row changed."""
        sets = ", ".join(f"{k} = ?" for k in cols)
        where, args = "id = ?", [*cols.values(), sid]
        if holder is not None:
            where += " AND gateway = ?"
            args.append(holder)
        return self.change(f"UPDATE sessions SET {sets} WHERE {where}", args) == 1

    def claim_session(self, sid: str, gateway: str) -> bool:
        """Take a session no gateway holds (saved and stopped), for ``gateway`` to run its
        engine; False if another gateway holds it, or it is lost or deleted."""
        return self.change("UPDATE sessions SET gateway = ?, epoch = epoch + 1 WHERE id = ? "
                           "AND state IN ('active', 'culled') AND (gateway IS NULL OR "
                           "gateway = ?)", (gateway, sid, gateway)) == 1

    def take_session(self, sid: str, gateway: str, worker: str) -> bool:
        """Take an active session whose engine any gateway reaches by name (``worker``, a
        Ray actor) for ``gateway``, from whichever gateway held it, live or not: its epoch
        goes up, so the engine refuses the former holder's calls from now on. False if
        it no longer runs on that engine (culled, lost, deleted, or resumed elsewhere)."""
        return self.change("UPDATE sessions SET gateway = ?, epoch = epoch + 1 WHERE id = ? "
                           "AND state = 'active' AND worker = ?", (gateway, sid, worker)) == 1

    def count_live_sessions(self, owner: int) -> int:
        return int(self.execute("SELECT COUNT(*) AS n FROM sessions WHERE owner = ? AND state "
                                "IN ('active', 'culled')", (owner,))[0]["n"])

    #: What a user's live sessions hold of their memory quota: fields and scratch memory.
    _HELD = ("SELECT COALESCE(SUM(field_bytes + scratch_bytes), 0) AS n FROM sessions WHERE "
             "owner = ? AND state IN ('active', 'culled')")

    def held_bytes_of(self, owner: int) -> int:
        """The memory the owner's live sessions hold: fields, and their engines' scratch."""
        return int(self.execute(self._HELD, (owner,))[0]["n"])

    def reserve_bytes(self, owner: int, gateway: str, nbytes: int, limit: int
                      ) -> tuple[str | None, int]:
        """Reserve ``nbytes`` of the owner's memory quota while an engine allocates them:
        (reservation id, bytes in use before), or (None, bytes in use) past ``limit``.
        Exclusive, so concurrent requests on any gateways cannot together overrun it."""
        with self.transaction(exclusive=True) as tx:
            used = int(tx.one(self._HELD, (owner,))["n"])
            used += int(tx.one("SELECT COALESCE(SUM(nbytes), 0) AS n FROM reservations "
                               "WHERE owner = ?", (owner,))["n"])
            if used + nbytes > limit:
                return None, used
            rid = "r_" + secrets.token_hex(8)
            tx.execute("INSERT INTO reservations (id, owner, gateway, nbytes) VALUES "
                       "(?, ?, ?, ?)", (rid, owner, gateway, nbytes))
        return rid, used

    def grow_scratch(self, sid: str, owner: int, need: int, want: int, limit: int
                     ) -> tuple[int | None, list, int]:
        """Raise the scratch memory reserved for session ``sid`` (its engine's, counted in
        the owner's quota beside every live session's fields and scratch) to ``want``
        bytes, or as much of it as the quota leaves, at least ``need``: (the new
        reservation, ...), or (None, the owner's live sessions' rows, bytes of field
        reservations) when not even ``need`` fits. One exclusive transaction, so sessions
        on any gateways cannot both take the last bytes. Never lowers it."""
        with self.transaction(exclusive=True) as tx:
            rows = tx.execute("SELECT id, field_bytes, scratch_bytes FROM sessions WHERE "
                              "owner = ? AND state IN ('active', 'culled') ORDER BY created",
                              (owner,))
            reserved = int(tx.one("SELECT COALESCE(SUM(nbytes), 0) AS n FROM reservations "
                                  "WHERE owner = ?", (owner,))["n"])
            mine = next((r for r in rows if r["id"] == sid), None)
            if mine is None:
                return None, rows, reserved
            held = sum(int(r["field_bytes"]) + int(r["scratch_bytes"]) for r in rows)
            free = limit - reserved - held + int(mine["scratch_bytes"])
            if free < need:
                return None, rows, reserved
            grant = max(int(mine["scratch_bytes"]), min(want, free))
            tx.execute("UPDATE sessions SET scratch_bytes = ? WHERE id = ?", (grant, sid))
        return grant, rows, reserved

    def reserved_bytes_of(self, owner: int) -> int:
        return int(self.execute("SELECT COALESCE(SUM(nbytes), 0) AS n FROM reservations WHERE "
                                "owner = ?", (owner,))[0]["n"])

    def release_bytes(self, rid: str) -> None:
        self.execute("DELETE FROM reservations WHERE id = ?", (rid,))

    # -------------------------------------------------------------- fields
    def field_records(self, sid: str, ids=None) -> dict[int, FieldRecord]:
        """The session's field records (only ``ids``, when given)."""
        if ids is not None:
            ids = list(ids)
            if not ids:
                return {}
            rows = []
            for i in range(0, len(ids), 500):
                chunk = ids[i:i + 500]
                rows += self.execute(
                    f"SELECT id, nbytes, shape, roles FROM fields WHERE session = ? AND id IN "
                    f"({','.join('?' * len(chunk))})", (sid, *chunk))
        else:
            rows = self.execute("SELECT id, nbytes, shape, roles FROM fields WHERE session = ?",
                                (sid,))
        return {r["id"]: FieldRecord(r["nbytes"], json.loads(r["shape"]) if r["shape"] else None,
                                     r["roles"].split(",") if r["roles"] else [])
                for r in rows}

    _PUT_FIELD = ("INSERT INTO fields (session, id, nbytes, shape, roles) VALUES (?, ?, ?, ?, ?) "
                  "ON CONFLICT (session, id) DO UPDATE SET nbytes = excluded.nbytes, "
                  "shape = excluded.shape, roles = excluded.roles")

    @staticmethod
    def _field_rows(sid: str, records: dict[int, FieldRecord]) -> list[tuple]:
        return [(sid, fid, r.nbytes, json.dumps(r.shape) if r.shape is not None else None,
                 ",".join(r.roles)) for fid, r in records.items()]

    def put_fields(self, sid: str, records: dict[int, FieldRecord], delta_bytes: int) -> None:
        """Insert or replace these records and move the session's byte count by
        ``delta_bytes``, in one transaction."""
        with self.transaction() as tx:
            tx.executemany(self._PUT_FIELD, self._field_rows(sid, records))
            tx.execute("UPDATE sessions SET field_bytes = field_bytes + ? WHERE id = ?",
                       (delta_bytes, sid))

    def set_fields(self, sid: str, records: dict[int, FieldRecord]) -> None:
        """Replace the session's records by these (the fields a resumed engine has)."""
        with self.transaction() as tx:
            tx.execute("DELETE FROM fields WHERE session = ?", (sid,))
            tx.executemany(self._PUT_FIELD, self._field_rows(sid, records))
            tx.execute("UPDATE sessions SET field_bytes = ? WHERE id = ?",
                       (sum(r.total for r in records.values()), sid))

    def drop_fields(self, sid: str) -> None:
        self.execute("DELETE FROM fields WHERE session = ?", (sid,))

    # -------------------------------------------------------------- kernels
    def add_kernel(self, sid: str, kernel_id: str, ir_json: str) -> None:
        self.execute("INSERT INTO kernels (session, kernel_id, ir) VALUES (?, ?, ?) "
                     "ON CONFLICT (session, kernel_id) DO NOTHING", (sid, kernel_id, ir_json))

    def kernels_of(self, sid: str) -> list:
        return self.execute("SELECT kernel_id, ir FROM kernels WHERE session = ?", (sid,))

    def drop_kernel(self, sid: str, kernel_id: str) -> None:
        self.execute("DELETE FROM kernels WHERE session = ? AND kernel_id = ?", (sid, kernel_id))

    def drop_kernels(self, sid: str) -> None:
        self.execute("DELETE FROM kernels WHERE session = ?", (sid,))

    # -------------------------------------------------------------- jobs
    def insert_job(self, owner: int, job_id: str, sid: str, ops_json: str, ops_sha: str,
                   total: int, gateway: str | None = None) -> bool:
        """Insert a queued job, run by ``gateway``; False if this user has a job with this
        id already (the idempotent resubmission case)."""
        return self.change(
            "INSERT INTO jobs (owner, id, session, state, ops, ops_sha256, total, created, "
            "gateway) VALUES (?, ?, ?, 'queued', ?, ?, ?, ?, ?) ON CONFLICT (owner, id) DO "
            "NOTHING", (owner, job_id, sid, ops_json, ops_sha, total, time.time(),
                        gateway)) == 1

    def job(self, owner: int, job_id: str):
        rows = self.execute("SELECT * FROM jobs WHERE owner = ? AND id = ?", (owner, job_id))
        return rows[0] if rows else None

    def job_holder(self, owner: int, job_id: str, lease_s: float):
        """Where an unfinished job of ``owner`` runs: ``gateway``, ``url``, ``live``; None
        for a finished or unknown job (any gateway answers for those)."""
        rows = self.execute(
            "SELECT j.gateway, g.url, CASE WHEN g.state = 'live' AND g.heartbeat >= {now} - ? "
            "THEN 1 ELSE 0 END AS live FROM jobs j LEFT JOIN gateways g ON g.id = j.gateway "
            "WHERE j.owner = ? AND j.id = ? AND j.state IN ('queued', 'running')",
            (lease_s, owner, job_id))
        return rows[0] if rows else None

    def update_job(self, owner: int, job_id: str, **cols) -> None:
        sets = ", ".join(f"{k} = ?" for k in cols)
        self.execute(f"UPDATE jobs SET {sets} WHERE owner = ? AND id = ?",
                     (*cols.values(), owner, job_id))

    def jobs_in(self, *states: str) -> list:
        marks = ",".join("?" * len(states))
        return self.execute(f"SELECT * FROM jobs WHERE state IN ({marks}) ORDER BY created",
                            states)

    # -------------------------------------------------------------- the status page
    _STATUS_SESSION = ("SELECT s.id, s.owner, u.name AS user_name, s.state, s.gateway, s.worker, "
                       "s.field_bytes, s.scratch_bytes, s.created, s.last_activity, s.resources "
                       "FROM sessions s JOIN users u ON u.id = s.owner WHERE s.state IN "
                       "('active', 'culled')")
    # Never the ops or results: a job's may be megabytes.
    _STATUS_JOB = ("SELECT j.id, j.owner, u.name AS user_name, j.session, j.state, j.done, "
                   "j.total, j.created, j.started, j.finished, j.gateway FROM jobs j JOIN "
                   "users u ON u.id = j.owner WHERE ")

    def status_sessions(self, owner: int | None = None) -> list:
        """Live sessions (active or culled) of ``owner``, or everyone's, oldest first, with
        their owner's name."""
        if owner is None:
            return self.execute(self._STATUS_SESSION + " ORDER BY s.created")
        return self.execute(self._STATUS_SESSION + " AND s.owner = ? ORDER BY s.created",
                            (owner,))

    def status_jobs(self, owner: int | None = None, finished: int = 10) -> list:
        """Queued and running jobs of ``owner`` (or everyone's), oldest first, then the
        ``finished`` that ended last, with their owner's name."""
        mine, args = ("", ()) if owner is None else (" AND j.owner = ?", (owner,))
        unfinished = self.execute(self._STATUS_JOB + "j.state IN ('queued', 'running')" + mine
                                  + " ORDER BY j.created", args)
        ended = self.execute(self._STATUS_JOB + "j.state NOT IN ('queued', 'running')" + mine
                             + " ORDER BY j.finished DESC LIMIT ?", (*args, finished))
        return [*unfinished, *ended]

    def usage(self, owner: int | None = None) -> list:
        """Per user (``owner`` alone, or every user): live sessions, their field bytes and
        the job seconds used, the figures the quotas limit."""
        mine, args = ("", ()) if owner is None else (" WHERE u.id = ?", (owner,))
        return self.execute(
            "SELECT u.id, u.name, u.job_seconds, (SELECT COUNT(*) FROM sessions s WHERE "
            "s.owner = u.id AND s.state IN ('active', 'culled')) AS sessions, (SELECT "
            "COALESCE(SUM(s.field_bytes), 0) FROM sessions s WHERE s.owner = u.id AND s.state "
            "IN ('active', 'culled')) AS field_bytes, (SELECT COALESCE(SUM(s.scratch_bytes), 0) "
            "FROM sessions s WHERE s.owner = u.id AND s.state IN ('active', 'culled')) AS "
            "scratch_bytes FROM users u" + mine + " ORDER BY u.name",
            args)
