"""Server configuration: command-line flags or ``DIFFTAPE_*`` environment variables.

One pydantic-settings model so that a container (environment), a systemd unit (flags) and the
tests (keyword arguments) configure the server the same way, with the same validation.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


def _default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local",
                                                            "share")
    return Path(base) / "difftape-server"


class Settings(BaseSettings):
    """Everything an operator can set. Defaults are safe for one machine: loopback only,
    modest quotas, a kernel time limit."""

    model_config = SettingsConfigDict(env_prefix="DIFFTAPE_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    arch: Literal["cpu", "cuda"] = "cpu"
    data_dir: Path = Field(default_factory=_default_data_dir)

    # Safety limits
    max_body_bytes: int = Field(512 * 1024 * 1024, gt=0,
                                description="largest request body accepted (413 above it)")
    # JSON is parsed whole in the gateway (arrays never travel as JSON), so it gets a
    # smaller limit than array bodies.
    max_json_bytes: int = Field(64 * 1024 * 1024, gt=0,
                                description="largest non-array request body (413 above it)")
    kernel_time_limit_s: float = Field(300.0, gt=0,
                                       description="one launch/batch/job op; the worker is "
                                                   "killed when it runs longer")
    # A graceful stop (SIGTERM/SIGINT) saves every session within this many seconds: running
    # operations get half of it to finish (then their workers are stopped and those
    # sessions lost, their callers told so), the rest is for saving. Keep it below the
    # orchestrator's own grace period (Kubernetes terminationGracePeriodSeconds, Docker
    # stop_grace_period, systemd TimeoutStopSec), which ends in SIGKILL.
    shutdown_grace_s: float = Field(25.0, gt=0)
    idle_session_timeout_s: float = Field(3600.0, gt=0)
    cull_interval_s: float = Field(30.0, gt=0)
    worker_start_timeout_s: float = Field(120.0, gt=0)

    # Per-user quotas
    quota_field_bytes: int = Field(4 * 1024**3, ge=0)
    quota_sessions: int = Field(16, ge=0)
    quota_job_seconds: float = Field(24 * 3600.0, ge=0)
    # Objects, not only bytes: each field and kernel costs the worker (and the gateway's
    # bookkeeping) something however small it is. Per session.
    quota_session_fields: int = Field(10_000, ge=0)
    quota_session_kernels: int = Field(2_000, ge=0)
    # Ops in one batch or job (the client sends at most 4096 at once).
    max_batch_ops: int = Field(10_000, ge=1, le=100_000)

    # Worker processes for sessions, server-wide: at the limit, the least recently used idle
    # session is saved and stopped (it resumes on its next request); 503 if all are busy.
    max_workers: int = Field(64, ge=1)

    # Jobs run from one queue per device; this many at once.
    job_concurrency: int = Field(1, ge=1)
    # Spawned, initialised workers kept ready so that creating a session does not wait for
    # a Python start-up and an LLVM initialisation.
    # Threads of each worker's program (0: one per core). Many sessions on few cores
    # oversubscribe the machine; an operator may cap this.
    worker_threads: int = Field(0, ge=0)
    spare_workers: int = Field(1, ge=0, le=16)

    # DNS rebinding and CSRF protection. Host names are compared without the port; "*" allows
    # any (only behind a proxy that checks Host itself).
    allowed_hosts: Annotated[list[str], NoDecode] = ["127.0.0.1", "localhost", "::1"]
    allowed_origins: Annotated[list[str], NoDecode] = []
    # Users (names, as `difftape token create NAME` made them) whose token shows everyone's
    # sessions and jobs on the status page (/status); other users see their own and figures
    # over the whole server without names, as /metrics gives every token.
    admins: Annotated[list[str], NoDecode] = []

    # "module:Class" of the engine run in the workers. An operator setting, never a client's.
    engine: str = "difftape.server.engine:Engine"

    # Run sessions' engines as Ray actors on this cluster instead of local worker processes:
    # "auto" (the local node's cluster), a GCS address "HOST:PORT", or a Ray client address
    # "ray://HOST:PORT". None: local worker processes (the default; nothing else changes).
    cluster: str | None = None
    # On a cluster, where each node keeps compiled code (its own disk, or a shared directory).
    cluster_cache_dir: Path = Field(default_factory=lambda: Path(tempfile.gettempdir())
                                    / "difftape-cache")
    # CPUs a session's engine actor reserves when its creation asks for none; a session may
    # ask for up to max_session_cpus / max_session_gpus (fractions share one device).
    session_cpus: float = Field(1.0, gt=0)
    # GPUs (a fraction shares one device) a session's actor reserves when it asks for none:
    # on a GPU cluster (--arch cuda) every session needs one to run its kernels.
    session_gpus: float = Field(0.0, ge=0)
    max_session_cpus: float = Field(16.0, gt=0)
    max_session_gpus: float = Field(1.0, ge=0)
    # Where the gateway and its workers share memory for large payloads: /dev/shm (or the
    # temp dir without one). When it is full, payloads go through the workers' pipes.
    shm_dir: Path | None = None
    # One JSON line per request on stderr (user, session, op, status, duration, bytes).
    access_log: bool = True

    # Scale-out (README "Scale out"). The database: SQLite under the data dir unless this
    # is a postgresql:// URL, which gateways on several machines may share.
    database_url: str | None = None
    # Where sessions' saved fields live: a directory every gateway of one database reaches
    # (a shared file system) when there are several; <data-dir>/sessions by default.
    sessions_dir: Path | None = None
    # How other gateways reach this one (requests for the sessions it runs are forwarded
    # here): http://HOST:PORT from --host/--port unless set (needed with a wildcard bind).
    gateway_url: str | None = None
    # A gateway renews its lease in the database every third of this; one whose lease ran
    # out is dead, and its sessions resume on other gateways from their last save.
    gateway_lease_s: float = Field(30.0, gt=0)
    # A session's changed fields are saved (checkpointed; the session keeps running) at its
    # first idle moment once they are this old, so that a session whose engine is lost (a
    # worker process or Ray actor killed, its node lost, its gateway killed) loses at most
    # about this much work: it resumes from that save on its next request, on any gateway
    # and node, and is told so once (410). 0: saved only when culled or at a graceful stop.
    checkpoint_s: float = Field(60.0, ge=0)

    @field_validator("arch", mode="before")
    @classmethod
    def _not_remote(cls, v):
        """DIFFTAPE_ARCH=remote is a program's setting (run me on a server); a shell that
        exports it for programs must not start a server that cannot run anything."""
        if v == "remote":
            raise ValueError("'remote' sends a program's kernels to a server; the server "
                             "itself runs them on 'cpu' or 'cuda': pass --arch cpu or unset "
                             "DIFFTAPE_ARCH for the server")
        return v

    @model_validator(mode="after")
    def _gpus_need_cuda(self):
        """A default GPU reservation on a CPU server would hold devices no kernel uses, and
        without a cluster nothing would reserve it: refused, not ignored."""
        if self.session_gpus and self.arch != "cuda":
            raise ValueError(f"DIFFTAPE_SESSION_GPUS={self.session_gpus:g} reserves GPUs for "
                             f"sessions whose kernels run on {self.arch}: set --arch cuda, or "
                             "leave it 0")
        if self.session_gpus and not self.cluster:
            raise ValueError("DIFFTAPE_SESSION_GPUS is what a session's Ray actor reserves: "
                             "it needs --cluster (local worker processes reserve nothing)")
        return self

    @field_validator("database_url")
    @classmethod
    def _postgres_only(cls, v):
        """A URL the gateway cannot open is refused at start, not at the first request."""
        if v in (None, ""):
            return None
        if not v.startswith(("postgresql://", "postgres://")):
            raise ValueError("DIFFTAPE_DATABASE_URL must be a postgresql:// URL (leave it "
                             "unset for the SQLite database under the data dir)")
        return v

    @field_validator("allowed_hosts", "allowed_origins", "admins", mode="before")
    @classmethod
    def _split(cls, v):
        """Environment variables give comma-separated lists (``a.example,b.example``)."""
        if isinstance(v, str):
            return [x.strip() for x in v.split(",") if x.strip()]
        return v

    @property
    def host_names(self) -> list[str]:
        """Allowed Host names: the configured ones plus the address the server binds, when
        that is one address (a wildcard bind needs names configured explicitly)."""
        names = list(self.allowed_hosts)
        if self.host not in ("0.0.0.0", "::", "") and self.host not in names:
            names.append(self.host)
        if self.gateway_url:  # forwarded requests from other gateways name it
            from urllib.parse import urlsplit

            name = urlsplit(self.gateway_url).hostname
            if name and name not in names:
                names.append(name)
        return names

    @property
    def cache_dir(self) -> Path:
        """Compiled code, shared by all sessions and kept across restarts."""
        return self.data_dir / "cache"

    @property
    def saved_dir(self) -> Path:
        """Saved sessions' fields (culled, checkpointed, or saved at a stop)."""
        return self.sessions_dir or self.data_dir / "sessions"

    @property
    def workers_dir(self) -> Path:
        """Which gateway started which worker (to stop those a dead gateway left)."""
        return self.data_dir / "workers"

    @property
    def db_path(self) -> Path:
        return self.data_dir / "difftape.sqlite3"

    @property
    def database(self) -> str | Path:
        """What ``Database`` opens: the PostgreSQL URL, else the SQLite file."""
        return self.database_url or self.db_path

    @property
    def advertised_url(self) -> str | None:
        """This gateway's address for the others (None: a wildcard bind with no
        ``gateway_url``, which only a single gateway can do without)."""
        if self.gateway_url:
            return self.gateway_url.rstrip("/")
        if self.host in ("0.0.0.0", "::", ""):
            return None
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"
