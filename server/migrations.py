"""The gateway database's schema, as a numbered list of migrations and the one runner that
applies them (SQLite and PostgreSQL alike: see ``dbconn``).

A migration is never edited once released: a change of schema is a new entry at the end.
``schema_migrations`` records which ran. The runner holds the database's writer lock (SQLite's
``BEGIN IMMEDIATE``, a PostgreSQL advisory lock) for the whole run, so gateways starting
together against one database migrate it once. Databases made before this runner (SQLite
files of earlier versions, with no ``schema_migrations``) are adopted by migration 1, whose
``CREATE TABLE IF NOT EXISTS`` leaves their tables as they are; 2 and 3 then finish what the
old per-start fix-ups did.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from .dbconn import Connection, Transaction

log = logging.getLogger("difftape.server")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    #: SQL statements (with ``{id_pk}``), or a function of the open transaction.
    steps: tuple[str, ...] | Callable[[Transaction], None]


def _token_id() -> str:
    return "tk_" + secrets.token_hex(6)


_USERS = ("CREATE TABLE {name} (id {id_pk}, name TEXT NOT NULL UNIQUE, created DOUBLE "
          "PRECISION NOT NULL, job_seconds DOUBLE PRECISION NOT NULL DEFAULT 0)")

INITIAL = (
    _USERS.replace("CREATE TABLE {name}", "CREATE TABLE IF NOT EXISTS users"),
    # A user may hold several tokens (one per machine or program), each revocable on its
    # own; only a token's SHA-256 is stored, and its first characters to tell it apart.
    """CREATE TABLE IF NOT EXISTS tokens (
        id TEXT PRIMARY KEY,
        "user" BIGINT NOT NULL REFERENCES users(id),
        sha256 TEXT NOT NULL UNIQUE,
        prefix TEXT NOT NULL,
        created DOUBLE PRECISION NOT NULL)""",
    'CREATE INDEX IF NOT EXISTS tokens_user ON tokens("user")',
    """CREATE TABLE IF NOT EXISTS sessions (
        id TEXT PRIMARY KEY,
        owner BIGINT NOT NULL REFERENCES users(id),
        arch TEXT NOT NULL,
        state TEXT NOT NULL,
        worker TEXT,
        field_bytes BIGINT NOT NULL DEFAULT 0,
        fields TEXT NOT NULL DEFAULT '{}',
        saved_path TEXT,
        lost_reason TEXT,
        created DOUBLE PRECISION NOT NULL,
        last_activity DOUBLE PRECISION NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS sessions_owner ON sessions(owner)",
    # One row per field: quota accounting and upload checks.
    """CREATE TABLE IF NOT EXISTS fields (
        session TEXT NOT NULL,
        id INTEGER NOT NULL,
        nbytes BIGINT NOT NULL,
        shape TEXT,
        roles TEXT NOT NULL,
        PRIMARY KEY (session, id))""",
    """CREATE TABLE IF NOT EXISTS kernels (
        session TEXT NOT NULL,
        kernel_id TEXT NOT NULL,
        ir TEXT NOT NULL,
        PRIMARY KEY (session, kernel_id))""",
    """CREATE TABLE IF NOT EXISTS jobs (
        owner BIGINT NOT NULL,
        id TEXT NOT NULL,
        session TEXT NOT NULL,
        state TEXT NOT NULL,
        ops TEXT NOT NULL,
        ops_sha256 TEXT NOT NULL,
        done INTEGER NOT NULL DEFAULT 0,
        total INTEGER NOT NULL,
        result TEXT,
        problem TEXT,
        created DOUBLE PRECISION NOT NULL,
        started DOUBLE PRECISION,
        finished DOUBLE PRECISION,
        PRIMARY KEY (owner, id))""",
)


def _tokens_out_of_users(tx: Transaction) -> None:
    """Databases from before the tokens table kept one token hash per user, in a
    ``users.token_sha256`` column: move them to the tokens table and drop the column
    (rebuilding the table, which is how SQLite drops a UNIQUE column)."""
    if "token_sha256" not in tx.columns("users"):
        return
    for r in tx.execute("SELECT id, token_sha256, created FROM users"):
        tx.execute('INSERT INTO tokens (id, "user", sha256, prefix, created) VALUES '
                   "(?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                   (_token_id(), r["id"], r["token_sha256"], "dt_", r["created"]))
    tx.execute(_USERS.replace("{name}", "users_new"))
    tx.execute("INSERT INTO users_new (id, name, created, job_seconds) "
               "SELECT id, name, created, job_seconds FROM users")
    tx.execute("DROP TABLE users")
    tx.execute("ALTER TABLE users_new RENAME TO users")


def _fields_out_of_sessions(tx: Transaction) -> None:
    """Databases from before the fields table kept a JSON blob per session in
    ``sessions.fields``: one row per field instead, and the column goes."""
    if "fields" not in tx.columns("sessions"):
        return
    for row in tx.execute("SELECT id, fields FROM sessions WHERE fields != '{}'"):
        try:
            blob = json.loads(row["fields"])
            rows = [(row["id"], int(fid), int(f["n"]), None, ",".join(f["roles"]))
                    for fid, f in blob.items()]
        except (ValueError, KeyError, TypeError, AttributeError):
            rows = []
        tx.executemany("INSERT INTO fields (session, id, nbytes, shape, roles) VALUES "
                       "(?, ?, ?, ?, ?) ON CONFLICT (session, id) DO UPDATE SET "
                       "nbytes = excluded.nbytes, roles = excluded.roles", rows)
    tx.execute("ALTER TABLE sessions DROP COLUMN fields")


SHARED_GATEWAYS = (
    # Gateways on one database: each running one registers, renews its lease (``heartbeat``,
    # the database's clock) and holds its sessions' engines.
    """CREATE TABLE gateways (
        id TEXT PRIMARY KEY,
        url TEXT,
        state TEXT NOT NULL,
        started DOUBLE PRECISION NOT NULL,
        heartbeat DOUBLE PRECISION NOT NULL)""",
    # Which gateway runs the session's engine (NULL: none, e.g. saved and stopped); when its
    # fields were last saved; whether they changed since (written before a change is sent
    # to the engine); whether it was brought back from an older save than its last change.
    "ALTER TABLE sessions ADD COLUMN gateway TEXT",
    "ALTER TABLE sessions ADD COLUMN saved_at DOUBLE PRECISION",
    "ALTER TABLE sessions ADD COLUMN dirty INTEGER NOT NULL DEFAULT 0",
    "ALTER TABLE sessions ADD COLUMN rolled_back INTEGER NOT NULL DEFAULT 0",
    # Sessions active when a server of an earlier version stopped without saving them had
    # unsaved fields: settled as lost by the first gateway's start, as they were before.
    "UPDATE sessions SET dirty = 1 WHERE state = 'active'",
    "CREATE INDEX sessions_gateway ON sessions(gateway)",
    "ALTER TABLE jobs ADD COLUMN gateway TEXT",
    # Field bytes being allocated now, per user, across gateways (the quota counts them).
    """CREATE TABLE reservations (
        id TEXT PRIMARY KEY,
        owner BIGINT NOT NULL,
        gateway TEXT NOT NULL,
        nbytes BIGINT NOT NULL)""",
    # Counters other processes watch: 'tokens' moves on each revocation or rotation.
    "CREATE TABLE counters (name TEXT PRIMARY KEY, value BIGINT NOT NULL)",
    "INSERT INTO counters (name, value) VALUES ('tokens', 0)",
)

def _engines_by_name(tx: Transaction) -> None:
    # What a session asked its engine to reserve on a cluster (JSON: {"cpus", "gpus"}), so
    # that it resumes with the same on any gateway; NULL: the defaults.
    tx.execute("ALTER TABLE sessions ADD COLUMN resources TEXT")
    # How many times a gateway took the session (created, resumed or took it over): an
    # engine every gateway reaches (a Ray actor) refuses calls with an older epoch.
    tx.execute("ALTER TABLE sessions ADD COLUMN epoch BIGINT NOT NULL DEFAULT 0")
    # This database's own id: the names of the Ray actors its gateways start carry it, so
    # that gateways of another database on the same cluster never take them for their own.
    tx.execute("INSERT INTO counters (name, value) VALUES ('instance', ?)",
               (secrets.randbits(47),))

SESSION_SCRATCH = (
    # The scratch memory the user's quota reserves for the session's engine (stack pools,
    # print buffers, launch contexts...), counted beside every session's field bytes; 0
    # whenever no engine runs it (the engine's scratch goes with it).
    "ALTER TABLE sessions ADD COLUMN scratch_bytes BIGINT NOT NULL DEFAULT 0",
)

MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "initial schema", INITIAL),
    Migration(2, "tokens table replaces users.token_sha256", _tokens_out_of_users),
    Migration(3, "fields table replaces sessions.fields", _fields_out_of_sessions),
    Migration(4, "gateways sharing one database", SHARED_GATEWAYS),
    Migration(5, "session resources and epochs (engines on a Ray cluster)", _engines_by_name),
    Migration(6, "scratch memory of sessions in the user's quota", SESSION_SCRATCH),
)

LATEST = MIGRATIONS[-1].version


class SchemaTooNew(RuntimeError):
    """The database was migrated by a newer difftape than this one."""


def migrate(conn: Connection) -> list[int]:
    """Apply the migrations this database lacks, in order, in one transaction under the
    writer lock; the versions applied."""
    applied: list[int] = []
    with conn.transaction(exclusive=True) as tx:
        tx.execute("CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY "
                   "KEY, name TEXT NOT NULL, applied DOUBLE PRECISION NOT NULL)")
        done = {r["version"] for r in tx.execute("SELECT version FROM schema_migrations")}
        newer = [v for v in done if v > LATEST]
        if newer:
            raise SchemaTooNew(f"the database has schema version {max(newer)}, newer than "
                               f"this difftape's {LATEST}: upgrade difftape on this machine")
        for m in MIGRATIONS:
            if m.version in done:
                continue
            if callable(m.steps):
                m.steps(tx)
            else:
                for stmt in m.steps:
                    tx.execute(stmt)
            tx.execute("INSERT INTO schema_migrations (version, name, applied) VALUES "
                       "(?, ?, ?)", (m.version, m.name, time.time()))
            applied.append(m.version)
    if applied:
        log.info("database migrated to schema version %d (applied %s)", LATEST, applied)
    return applied
