"""The gateway's database (SQLite under the data dir): users, sessions, kernels, jobs.

The session table is the explicit session -> worker map the design asks for, so that a later
gateway can point sessions at workers on other machines. SQLite in WAL mode lets the
``difftape token create`` command add users while a server runs. Only the gateway process
writes here; one connection guarded by a lock is plenty for its small, fast statements.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import sqlite3
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS users (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    created REAL NOT NULL,
    job_seconds REAL NOT NULL DEFAULT 0
);
-- A user may hold several tokens (one per machine or program), each revocable on its own.
CREATE TABLE IF NOT EXISTS tokens (
    id TEXT PRIMARY KEY,          -- "tk_..." as `difftape token list` shows it
    user INTEGER NOT NULL REFERENCES users(id),
    sha256 TEXT NOT NULL UNIQUE,  -- the token itself is shown once and never stored
    prefix TEXT NOT NULL,         -- its first characters, to tell tokens apart in a list
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS tokens_user ON tokens(user);
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    owner INTEGER NOT NULL REFERENCES users(id),
    arch TEXT NOT NULL,
    state TEXT NOT NULL,          -- active | culled | lost | deleted
    worker TEXT,                  -- where its engine runs ("local:<pid>")
    field_bytes INTEGER NOT NULL DEFAULT 0,
    fields TEXT NOT NULL DEFAULT '{}',   -- unused (databases before the fields table)
    saved_path TEXT,
    lost_reason TEXT,
    created REAL NOT NULL,
    last_activity REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS sessions_owner ON sessions(owner);
-- One row per field: quota accounting and upload checks (a row per create, never a rewrite
-- of the session's whole table).
CREATE TABLE IF NOT EXISTS fields (
    session TEXT NOT NULL,
    id INTEGER NOT NULL,
    nbytes INTEGER NOT NULL,      -- bytes of one storage role (the data)
    shape TEXT,                   -- full array shape (field + element), JSON
    roles TEXT NOT NULL,          -- storage roles that exist, comma-separated
    PRIMARY KEY (session, id)
);
CREATE TABLE IF NOT EXISTS kernels (
    session TEXT NOT NULL,
    kernel_id TEXT NOT NULL,
    ir TEXT NOT NULL,
    PRIMARY KEY (session, kernel_id)
);
CREATE TABLE IF NOT EXISTS jobs (
    owner INTEGER NOT NULL,
    id TEXT NOT NULL,
    session TEXT NOT NULL,
    state TEXT NOT NULL,          -- queued | running | succeeded | failed | cancelled
    ops TEXT NOT NULL,
    ops_sha256 TEXT NOT NULL,
    done INTEGER NOT NULL DEFAULT 0,
    total INTEGER NOT NULL,
    result TEXT,
    problem TEXT,
    created REAL NOT NULL,
    started REAL,
    finished REAL,
    PRIMARY KEY (owner, id)
);
"""


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
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._users: dict[str, User] = {}  # token hash -> user, see user_by_token
        self._checked = time.monotonic()
        self._version = None
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None,
                                   timeout=30)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        self._migrate()

    def _migrate(self) -> None:
        """Bring databases of earlier versions up to this schema."""
        self._migrate_tokens()
        self._migrate_fields()

    def _migrate_tokens(self) -> None:
        """Databases from before the tokens table kept one token hash per user, in a
        ``users.token_sha256`` column: move them to the tokens table and drop the column
        (rebuilding the table, which is how SQLite drops a UNIQUE column)."""
        with self.transaction(immediate=True) as db:
            cols = [r["name"] for r in db.execute("PRAGMA table_info(users)")]
            if "token_sha256" not in cols:
                return
            for r in db.execute("SELECT id, token_sha256, created FROM users").fetchall():
                db.execute("INSERT OR IGNORE INTO tokens (id, user, sha256, prefix, created) "
                           "VALUES (?, ?, ?, ?, ?)",
                           (_token_id(), r["id"], r["token_sha256"], "dt_", r["created"]))
            db.execute("CREATE TABLE users_new (id INTEGER PRIMARY KEY, name TEXT NOT NULL "
                       "UNIQUE, created REAL NOT NULL, job_seconds REAL NOT NULL DEFAULT 0)")
            db.execute("INSERT INTO users_new (id, name, created, job_seconds) "
                       "SELECT id, name, created, job_seconds FROM users")
            db.execute("DROP TABLE users")
            db.execute("ALTER TABLE users_new RENAME TO users")

    def _migrate_fields(self) -> None:
        """Databases from before the fields table kept a JSON blob per session."""
        for row in self.execute("SELECT id, fields FROM sessions WHERE fields != '{}'"):
            try:
                blob = json.loads(row["fields"])
                rows = [(row["id"], int(fid), int(f["n"]), None, ",".join(f["roles"]))
                        for fid, f in blob.items()]
            except (ValueError, KeyError, TypeError):
                rows = []
            with self.transaction() as db:
                db.executemany("INSERT OR REPLACE INTO fields (session, id, nbytes, shape, "
                               "roles) VALUES (?, ?, ?, ?, ?)", rows)
                db.execute("UPDATE sessions SET fields = '{}' WHERE id = ?", (row["id"],))

    @contextmanager
    def transaction(self, *, immediate: bool = False):
        """Several statements under the lock, committed together. ``immediate`` takes the
        database's write lock at once (a read-then-write that another process, such as a
        ``difftape token`` command next to a running server, must not interleave with)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE" if immediate else "BEGIN")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def execute(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def ping(self) -> bool:
        try:
            self.execute("SELECT 1")
            return True
        except sqlite3.Error:
            return False

    # -------------------------------------------------------------- users and tokens
    def create_user(self, name: str) -> str:
        """Add a user and return their first token (see :meth:`create_token`)."""
        try:
            self.execute("INSERT INTO users (name, created) VALUES (?, ?)", (name, time.time()))
        except sqlite3.IntegrityError:
            raise ValueError(f"a user named {name!r} exists already") from None
        return self.create_token(name)

    def create_token(self, name: str) -> str:
        """A new token for the existing user ``name``. Only its hash is stored, so it is
        shown once; the user's other tokens stay valid."""
        token = "dt_" + secrets.token_urlsafe(32)
        with self.transaction(immediate=True) as db:
            row = db.execute("SELECT id FROM users WHERE name = ?", (name,)).fetchone()
            if row is None:
                raise ValueError(f"no user named {name!r} (`difftape token list` shows them)")
            db.execute("INSERT INTO tokens (id, user, sha256, prefix, created) VALUES "
                       "(?, ?, ?, ?, ?)", (_token_id(), row["id"], hash_token(token),
                                           token[:TOKEN_PREFIX], time.time()))
        return token

    def has_user(self, name: str) -> bool:
        return bool(self.execute("SELECT 1 FROM users WHERE name = ?", (name,)))

    def tokens(self, name: str | None = None) -> list[TokenInfo]:
        """The tokens (every user's, or ``name``'s), oldest first."""
        rows = self.execute(
            "SELECT t.id, u.name, t.prefix, t.created FROM tokens t JOIN users u ON "
            "u.id = t.user" + (" WHERE u.name = ?" if name is not None else "") +
            " ORDER BY t.created, t.id", (name,) if name is not None else ())
        return [TokenInfo(r["id"], r["name"], r["prefix"], r["created"]) for r in rows]

    def _find_tokens(self, db, ref: str) -> list[sqlite3.Row]:
        """The token ``ref`` names: its id (``tk_...``) or the token itself (``dt_...``)."""
        return db.execute("SELECT t.id, t.user, u.name FROM tokens t JOIN users u ON "
                          "u.id = t.user WHERE t.id = ? OR t.sha256 = ?",
                          (ref, hash_token(ref))).fetchall()

    def revoke(self, ref: str | None = None, *, user: str | None = None) -> list[TokenInfo]:
        """Delete one token (``ref``: its id or the token itself) or every token of
        ``user``; the tokens deleted. A running server stops accepting them within
        :data:`REVOKE_DELAY_S`."""
        with self.transaction(immediate=True) as db:
            rows = self._select_for_change(db, ref, user)
            db.executemany("DELETE FROM tokens WHERE id = ?", [(r["id"],) for r in rows])
        return [TokenInfo(r["id"], r["name"], "", 0.0) for r in rows]

    def rotate(self, ref: str | None = None, *, user: str | None = None
               ) -> tuple[str, list[TokenInfo]]:
        """Replace one token (or all of ``user``'s) by a new one, in one transaction; the new
        token and the ones it replaced."""
        token = "dt_" + secrets.token_urlsafe(32)
        with self.transaction(immediate=True) as db:
            rows = self._select_for_change(db, ref, user)
            db.executemany("DELETE FROM tokens WHERE id = ?", [(r["id"],) for r in rows])
            db.execute("INSERT INTO tokens (id, user, sha256, prefix, created) VALUES "
                       "(?, ?, ?, ?, ?)", (_token_id(), rows[0]["user"], hash_token(token),
                                           token[:TOKEN_PREFIX], time.time()))
        return token, [TokenInfo(r["id"], r["name"], "", 0.0) for r in rows]

    def _select_for_change(self, db, ref: str | None, user: str | None) -> list[sqlite3.Row]:
        if (ref is None) == (user is None):
            raise ValueError("name one token (its id or the token) or one user")
        if ref is not None:
            rows = self._find_tokens(db, ref)
            if not rows:
                raise ValueError(f"no token {ref!r}: give a token id from `difftape token "
                                 f"list` or the token itself")
            return rows
        rows = db.execute("SELECT t.id, t.user, u.name FROM tokens t JOIN users u ON "
                          "u.id = t.user WHERE u.name = ?", (user,)).fetchall()
        if not rows:
            if db.execute("SELECT 1 FROM users WHERE name = ?", (user,)).fetchone() is None:
                raise ValueError(f"no user named {user!r}")
            raise ValueError(f"user {user!r} has no tokens (make one with `difftape token "
                             f"create {user}`)")
        return rows

    def user_by_token(self, token: str) -> User | None:
        """The token's user, or None. Known tokens are remembered, so most requests cost no
        database statement; the cache is dropped once another process (``difftape token
        revoke``/``rotate``) has changed the database, checked at most every
        :data:`REVOKE_DELAY_S`. Unknown tokens are looked up each time (``token create`` may
        have just run)."""
        now = time.monotonic()
        if now - self._checked > REVOKE_DELAY_S:
            self._checked = now
            # data_version changes when another connection commits (never for our own).
            version = self.execute("PRAGMA data_version")[0][0]
            if version != self._version:
                self._version = version
                self._users.clear()
        h = hash_token(token)
        user = self._users.get(h)
        if user is None:
            rows = self.execute("SELECT u.id, u.name FROM tokens t JOIN users u ON "
                                "u.id = t.user WHERE t.sha256 = ?", (h,))
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

    # -------------------------------------------------------------- sessions
    def insert_session(self, sid: str, owner: int, arch: str, worker: str) -> None:
        now = time.time()
        self.execute("INSERT INTO sessions (id, owner, arch, state, worker, created, "
                     "last_activity) VALUES (?, ?, ?, 'active', ?, ?, ?)",
                     (sid, owner, arch, worker, now, now))

    def session(self, sid: str) -> sqlite3.Row | None:
        rows = self.execute("SELECT * FROM sessions WHERE id = ?", (sid,))
        return rows[0] if rows else None

    def sessions_of(self, owner: int) -> list[sqlite3.Row]:
        return self.execute("SELECT * FROM sessions WHERE owner = ? AND state != 'deleted' "
                            "ORDER BY created", (owner,))

    def sessions_in(self, *states: str) -> list[sqlite3.Row]:
        marks = ",".join("?" * len(states))
        return self.execute(f"SELECT * FROM sessions WHERE state IN ({marks})", states)

    def update_session(self, sid: str, **cols) -> None:
        if "fields" in cols and not isinstance(cols["fields"], str):
            cols["fields"] = json.dumps(cols["fields"])
        sets = ", ".join(f"{k} = ?" for k in cols)
        self.execute(f"UPDATE sessions SET {sets} WHERE id = ?", (*cols.values(), sid))

    def count_live_sessions(self, owner: int) -> int:
        return self.execute("SELECT COUNT(*) AS n FROM sessions WHERE owner = ? AND state IN "
                            "('active', 'culled')", (owner,))[0]["n"]

    def field_bytes_of(self, owner: int) -> int:
        rows = self.execute("SELECT COALESCE(SUM(field_bytes), 0) AS n FROM sessions WHERE "
                            "owner = ? AND state IN ('active', 'culled')", (owner,))
        return int(rows[0]["n"])

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

    def put_fields(self, sid: str, records: dict[int, FieldRecord], delta_bytes: int) -> None:
        """Insert or replace these records and move the session's byte count by
        ``delta_bytes``, in one transaction."""
        with self.transaction() as db:
            db.executemany("INSERT OR REPLACE INTO fields (session, id, nbytes, shape, roles) "
                           "VALUES (?, ?, ?, ?, ?)",
                           [(sid, fid, r.nbytes, json.dumps(r.shape) if r.shape is not None
                             else None, ",".join(r.roles)) for fid, r in records.items()])
            db.execute("UPDATE sessions SET field_bytes = field_bytes + ? WHERE id = ?",
                       (delta_bytes, sid))

    def drop_fields(self, sid: str) -> None:
        self.execute("DELETE FROM fields WHERE session = ?", (sid,))

    # -------------------------------------------------------------- kernels
    def add_kernel(self, sid: str, kernel_id: str, ir_json: str) -> None:
        self.execute("INSERT OR IGNORE INTO kernels (session, kernel_id, ir) VALUES (?, ?, ?)",
                     (sid, kernel_id, ir_json))

    def kernels_of(self, sid: str) -> list[sqlite3.Row]:
        return self.execute("SELECT kernel_id, ir FROM kernels WHERE session = ?", (sid,))

    def drop_kernels(self, sid: str) -> None:
        self.execute("DELETE FROM kernels WHERE session = ?", (sid,))

    # -------------------------------------------------------------- jobs
    def insert_job(self, owner: int, job_id: str, sid: str, ops_json: str, ops_sha: str,
                   total: int) -> bool:
        """Insert a queued job; False if this user has a job with this id already (the
        idempotent resubmission case)."""
        try:
            self.execute("INSERT INTO jobs (owner, id, session, state, ops, ops_sha256, total, "
                         "created) VALUES (?, ?, ?, 'queued', ?, ?, ?, ?)",
                         (owner, job_id, sid, ops_json, ops_sha, total, time.time()))
            return True
        except sqlite3.IntegrityError:
            return False

    def job(self, owner: int, job_id: str) -> sqlite3.Row | None:
        rows = self.execute("SELECT * FROM jobs WHERE owner = ? AND id = ?", (owner, job_id))
        return rows[0] if rows else None

    def update_job(self, owner: int, job_id: str, **cols) -> None:
        sets = ", ".join(f"{k} = ?" for k in cols)
        self.execute(f"UPDATE jobs SET {sets} WHERE owner = ? AND id = ?",
                     (*cols.values(), owner, job_id))

    def jobs_in(self, *states: str) -> list[sqlite3.Row]:
        marks = ",".join("?" * len(states))
        return self.execute(f"SELECT * FROM jobs WHERE state IN ({marks}) ORDER BY created",
                            states)
