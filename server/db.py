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
    token_sha256 TEXT NOT NULL UNIQUE,
    created REAL NOT NULL,
    job_seconds REAL NOT NULL DEFAULT 0
);
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


@dataclass(frozen=True)
class User:
    id: int
    name: str


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
        self._users: dict[str, User] = {}
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None,
                                   timeout=30)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        self._migrate()

    def _migrate(self) -> None:
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
    def transaction(self):
        """Several statements under the lock, committed together."""
        with self._lock:
            self._db.execute("BEGIN")
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

    # -------------------------------------------------------------- users
    def create_user(self, name: str) -> str:
        """Add a user and return their token; only its hash is stored, so it is shown once."""
        token = "dt_" + secrets.token_urlsafe(32)
        try:
            self.execute("INSERT INTO users (name, token_sha256, created) VALUES (?, ?, ?)",
                         (name, hash_token(token), time.time()))
        except sqlite3.IntegrityError:
            raise ValueError(f"a user named {name!r} exists already") from None
        return token

    def user_by_token(self, token: str) -> User | None:
        """Known tokens are remembered (there is no revocation yet; one would clear this);
        unknown ones are looked up each time, since ``token create`` may have just run."""
        h = hash_token(token)
        user = self._users.get(h)
        if user is None:
            rows = self.execute("SELECT id, name FROM users WHERE token_sha256 = ?", (h,))
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
