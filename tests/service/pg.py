"""A real PostgreSQL server for the tests: the machine's PostgreSQL binaries (Debian's
``postgresql`` package: ``/usr/lib/postgresql/<version>/bin``) run ``initdb`` into a temp dir
and ``pg_ctl start`` on a free loopback port; stopped and removed afterwards. One server per
test session, one fresh database per test (``CREATE DATABASE``).

PostgreSQL refuses to run as root; as root (a container, CI) the server runs as the
``postgres`` user the Debian package creates.
"""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

#: The version the README's set-up installs (Debian 12's); another installed one is used
#: when it is missing.
PREFERRED = "15"


def bindir() -> Path | None:
    dirs = sorted(glob.glob("/usr/lib/postgresql/*/bin"),
                  key=lambda d: (Path(d).parent.name != PREFERRED, d))
    for d in dirs:
        if (Path(d) / "initdb").exists() and (Path(d) / "pg_ctl").exists():
            return Path(d)
    return None


def missing() -> str | None:
    """Why no server can be started here, or None."""
    if bindir() is None:
        return ("PostgreSQL binaries not found under /usr/lib/postgresql/*/bin (install the "
                "Debian package: apt-get install postgresql, see README set-up)")
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed (pip install -e '.[postgres]', see README)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no 'postgres' user to run the server as"
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    def __init__(self) -> None:
        self.bin = bindir()
        self.root = Path(tempfile.mkdtemp(prefix="difftape-pg-"))
        self.data = self.root / "data"
        self.port = _free_port()
        self.prefix: list[str] = []
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
            self.prefix = ["runuser", "-u", "postgres", "--"]
        self.log = self.root / "server.log"

    def _run(self, *args: str) -> None:
        subprocess.run([*self.prefix, *args], check=True, capture_output=True, timeout=120)

    def start(self) -> PostgresServer:
        self._run(str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres",
                  "--auth=trust", "--encoding=UTF8", "--no-sync")
        # Loopback only, the socket in the temp dir, durability off (a test database).
        opts = (f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.root} "
                "-c fsync=off -c synchronous_commit=off -c full_page_writes=off "
                "-c max_connections=200")
        try:
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.log),
                      "-o", opts, "-w", "-t", "60", "start")
        except subprocess.CalledProcessError as e:
            raise RuntimeError(f"PostgreSQL did not start: {e.stderr!r}\n"
                               f"{self.log.read_text(errors='replace')}") from None
        return self

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        """A fresh, empty database; its URL."""
        import psycopg

        name = "t_" + secrets.token_hex(6)
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def drop_database(self, url: str) -> None:
        import psycopg

        name = url.rsplit("/", 1)[1]
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    def restart(self) -> None:
        """Stop and start the server (connections break; data stays)."""
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-m",
                  "fast", "-w", "restart")

    def stop(self) -> None:
        try:
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate",
                      "-w", "stop")
        except subprocess.CalledProcessError:
            pass
        shutil.rmtree(self.root, ignore_errors=True)
