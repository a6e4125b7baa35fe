"""The gateway application: ``create_app(settings)``.

The gateway authenticates, keeps the session and job tables, and forwards engine ops to the
session's worker process. It never imports the compiler or runs a kernel itself.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import secrets
import sys
import time
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI

from . import coalesce, problems
from .db import Database
from .fastpath import BatchFastPath
from .forward import ForwardMiddleware
from .jobs import JobScheduler
from .metrics import Metrics
from .middleware import AuthMiddleware, GuardMiddleware, RequestMiddleware
from .models import Problem
from .routers import batch, fields, health, jobs, kernels, sessions, status
from .sessions import Live, SessionManager
from .settings import Settings
from .status import CpuSampler
from .worker import SharedBuffer, WorkerGone, WorkerPool, WorkerRegistry, WorkerStats

if TYPE_CHECKING:
    from .raycluster import RayWorkerPool

log = logging.getLogger("difftape.server")


class Service:
    """Everything one running gateway owns; routers reach it as ``app.state.service``."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        settings.cache_dir.mkdir(parents=True, exist_ok=True)
        # This process's id among the gateways of its database, and the one that ran on
        # this data dir before it (certainly dead: the lock on the data dir was free).
        self.gateway_id = "g_" + secrets.token_hex(8)
        self._dir_lock, self.previous_gateway = self._lock_data_dir(settings)
        self.db = Database(settings.database)
        self.metrics = Metrics()
        self.shm_dir = str(settings.shm_dir) if settings.shm_dir else None
        self.registry = WorkerRegistry(settings.workers_dir)
        engine_kwargs = {"cache_dir": str(settings.cache_dir),
                         "num_threads": settings.worker_threads,
                         "max_fields": settings.quota_session_fields,
                         "max_kernels": settings.quota_session_kernels,
                         "max_memory_bytes": settings.quota_field_bytes,
                         # Scratch past this is asked of the gateway, which reserves it in
                         # the user's quota across sessions (SessionManager.grant_scratch).
                         "scratch_grant": 0,
                         "arch": settings.arch}
        self.pool: WorkerPool | RayWorkerPool
        if settings.cluster:
            # Function-level: Ray is an optional extra, loaded only with a cluster.
            from .raycluster import RayWorkerPool, connect

            resources = connect(settings.cluster)
            log.info("sessions run as Ray actors on %s (%s)", settings.cluster,
                     ", ".join(f"{k} {v:g}" for k, v in sorted(resources.items())
                               if k in ("CPU", "GPU")))
            self.pool = RayWorkerPool(
                settings.engine, {**engine_kwargs, "cache_dir": str(settings.cluster_cache_dir)},
                spare=settings.spare_workers, start_timeout=settings.worker_start_timeout_s,
                default_cpus=settings.session_cpus, default_gpus=settings.session_gpus,
                worker_threads=settings.worker_threads)
        else:
            self.pool = WorkerPool(settings.engine, engine_kwargs,
                                   spare=settings.spare_workers,
                                   start_timeout=settings.worker_start_timeout_s,
                                   shm_dir=self.shm_dir,
                                   time_limit=settings.kernel_time_limit_s,
                                   registry=self.registry)
        # Names of Ray actors carry them (RayWorkerPool.reap).
        self.pool.gateway_id, self.pool.instance = self.gateway_id, self.db.instance()
        self.sessions = SessionManager(settings, self.db, self.pool, self.metrics)
        self.sessions.gateway_id = self.gateway_id
        self.metrics.sessions = self.sessions
        self.jobs = JobScheduler(settings, self.db, self.sessions, self.metrics)
        self.jobs.gateway_id = self.gateway_id
        self.forward: ForwardMiddleware | None = None  # set by create_app
        self.started = time.monotonic()  # the status page's uptime
        self.cpu_sampler = CpuSampler()  # the status page's CPU figures
        self._tasks: list[asyncio.Task] = []
        self._drain: asyncio.Task | None = None

    @staticmethod
    def _lock_data_dir(settings: Settings):
        """Hold ``<data-dir>/gateway.lock`` for the life of this process: one gateway per data
        dir (its workers, shared memory and registry are per dir), and the id written there
        by the one before names a gateway that is certainly gone once the lock is free (the
        kernel drops it with the process, kill -9 included)."""
        path = settings.data_dir / "gateway.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RuntimeError(f"another gateway runs on the data dir {settings.data_dir}; "
                               "give each gateway its own data dir (they share the database "
                               "and DIFFTAPE_SESSIONS_DIR)") from None
        previous = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or None
        return fd, previous

    async def start(self) -> None:
        SharedBuffer.remove_stale(self.shm_dir)
        self.registry.reap()  # workers a gateway that died (kill -9, OOM) left running
        url = self.settings.advertised_url
        self.db.register_gateway(self.gateway_id, url, replaces=self.previous_gateway)
        os.ftruncate(self._dir_lock, 0)
        os.pwrite(self._dir_lock, self.gateway_id.encode(), 0)
        self._renewed()
        if url is None and self.db.backend != "sqlite":
            log.warning("this gateway binds a wildcard address and has no DIFFTAPE_GATEWAY_URL:"
                        " other gateways of its database cannot forward requests to it")
        # What gateways that died held (this data dir's last one's too).
        self.sessions.reap(orphans=True)
        await self.sessions.reap_engines()
        self.jobs.start()
        self._tasks.append(asyncio.ensure_future(self._probe()))
        self._tasks.append(asyncio.ensure_future(self._cull_forever()))
        self._tasks.append(asyncio.ensure_future(self._lease_forever()))

    def _renewed(self) -> None:
        """The lease was renewed now: sessions may run for two thirds of it (the last third
        is the margin before another gateway may declare this one dead)."""
        self.sessions.lease_deadline = (time.monotonic()
                                        + self.settings.gateway_lease_s * 2 / 3)

    async def _lease_forever(self) -> None:
        """Renew this gateway's lease every third of it, and settle what dead gateways
        held. A gateway declared dead (it stalled past its lease) drops its sessions, which
        others may have taken over, and registers again as a new gateway."""
        while True:
            await asyncio.sleep(self.settings.gateway_lease_s / 3)
            try:
                if self.db.renew_gateway(self.gateway_id):
                    self._renewed()
                else:
                    log.error("gateway %s was declared dead (its lease ran out): its sessions"
                              " are dropped here and resume from their saves", self.gateway_id)
                    self.sessions.drop_all("this gateway's lease ran out")
                    self.gateway_id = "g_" + secrets.token_hex(8)
                    self.sessions.gateway_id = self.jobs.gateway_id = self.gateway_id
                    self.pool.gateway_id = self.gateway_id
                    self.db.register_gateway(self.gateway_id, self.settings.advertised_url)
                    os.ftruncate(self._dir_lock, 0)
                    os.pwrite(self._dir_lock, self.gateway_id.encode(), 0)
                    self._renewed()
                self.sessions.reap()
                await self.sessions.reap_engines()
            except Exception:  # noqa: BLE001 - the database may come back; keep trying
                log.exception("renewing the gateway's lease failed")

    @property
    def stopping(self) -> bool:
        return self._drain is not None

    async def drain(self) -> None:
        """The graceful stop, within ``shutdown_grace_s``: refuse new work (503), let running
        operations finish for half of it (then stop their workers: their callers get a
        SessionLostError saying why), and save every other session meanwhile. It does not
        wait for requests to end first: one long kernel must not cost every other user
        their session. Idempotent."""
        if self._drain is None:
            self._drain = asyncio.ensure_future(self._drain_now())
        await asyncio.shield(self._drain)

    async def _drain_now(self) -> None:
        for t in self._tasks:
            t.cancel()
        grace = self.settings.shutdown_grace_s
        now = time.monotonic()
        self.jobs.stopping = True
        await self.sessions.drain(run_deadline=now + grace / 2,
                                  save_deadline=now + max(grace / 2, grace - 1.0))
        await self.jobs.stop()

    async def stop(self) -> None:
        await self.drain()
        await self.sessions.shutdown()
        await self.pool.close()
        if self.forward is not None:
            await self.forward.aclose()
        try:
            self.db.stop_gateway(self.gateway_id)
        except Exception:  # noqa: BLE001 - its lease runs out as well
            log.exception("could not record the gateway's stop")
        self.db.close()
        os.close(self._dir_lock)
        if self.settings.cluster:
            import ray

            ray.shutdown()  # every session's actor was saved and stopped above

    async def _probe(self) -> None:
        """Start a worker once (the spare, if any) so /readyz knows the engine loads."""
        try:
            if self.pool.spare:
                await self.pool.fill()
            else:
                w = await self.pool.get()
                await asyncio.get_running_loop().run_in_executor(None, w.stop)
        except Exception as e:  # noqa: BLE001 - reported by /readyz
            log.error("worker probe failed: %s", e)

    async def _cull_forever(self) -> None:
        interval = min(self.settings.cull_interval_s, self.settings.idle_session_timeout_s / 2,
                       self.settings.checkpoint_s / 2 or float("inf"))
        while True:
            await asyncio.sleep(interval)
            try:
                await self.sessions.cull_idle()
            except Exception:  # noqa: BLE001 - the loop must go on
                log.exception("culling failed")

    # ------------------------------------------------------------------ helpers for routers
    async def refresh_stats(self, live: Live) -> None:
        """Ask the worker (already held by the caller) for its counters."""
        try:
            s, _ = await live.worker.call({"op": "stats"}, timeout=10)
        except (problems.ProblemError, WorkerGone):
            return
        live.worker.stats = WorkerStats.from_reply(s)

    async def refresh_all_stats(self) -> None:
        """Idle workers only: a scrape must not wait behind a long kernel."""
        for e in list(self.sessions.live.values()):
            if e.worker is not None and e.worker.gone is None and not e.worker.lock.locked():
                await self.refresh_stats(e)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    service = Service(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    app = FastAPI(
        title="difftape service",
        version="1",
        description="Compile and run difftape kernels remotely. Kernels travel as validated "
                    "IR, arrays as `.npy` or raw bytes; every error is an RFC 7807 problem "
                    "whose `difftape_error` names the exception class the client raises. "
                    "See server/PROTOCOL.md.",
        lifespan=lifespan,
        responses={422: {"model": Problem, "content": {"application/problem+json": {}}}},
    )
    app.state.service = service
    problems.install(app, service.db.conn.Error)
    for r in (sessions, fields, kernels, batch, jobs, health, status):
        app.include_router(r.router)
    # Outermost last: request id and access log, then Host/Origin/size, then the token, then
    # forwarding to the gateway that runs the session (server/forward.py), then the batch
    # request's fast path (server/fastpath.py).
    app.add_middleware(BatchFastPath, service=service)
    app.add_middleware(ForwardMiddleware, service=service)
    app.add_middleware(AuthMiddleware, users=service.db.user_by_token,
                       database_error=service.db.conn.Error)
    app.add_middleware(GuardMiddleware, allowed_hosts=settings.host_names,
                       allowed_origins=settings.allowed_origins,
                       max_body_bytes=settings.max_body_bytes,
                       max_json_bytes=settings.max_json_bytes)
    app.add_middleware(RequestMiddleware, histogram=service.metrics.latency,
                       log=settings.access_log)
    return app


def _configure_logging(settings: Settings) -> None:
    """The gateway's own messages and the JSON access log on stderr (the container log)."""
    server_log = logging.getLogger("difftape.server")
    if not server_log.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
        server_log.addHandler(h)
        server_log.setLevel(logging.INFO)
        server_log.propagate = False
    access = logging.getLogger("difftape.access")
    if settings.access_log and not access.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(message)s"))
        access.addHandler(h)
        access.setLevel(logging.INFO)
        access.propagate = False


def serve(settings: Settings, *, log_level: str = "info", access_log: bool = False) -> None:
    """Run the gateway under uvicorn (``difftape serve``), with a graceful stop that saves
    sessions before waiting for connections (see ``Service.drain``). ``access_log`` is
    uvicorn's own plain-text one, on top of the JSON one (``settings.access_log``)."""
    import uvicorn

    app = create_app(settings)
    service: Service = app.state.service

    class _Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            t0 = time.monotonic()
            for server in self.servers:
                server.close()  # no new connections while the sessions are saved
            await service.drain()
            # Whatever still holds a connection (an event stream, a slow reader) has the
            # rest of the grace period.
            left = settings.shutdown_grace_s - (time.monotonic() - t0)
            self.config.timeout_graceful_shutdown = max(0.5, left - 0.5)
            await super().shutdown(sockets)

    # Small responses leave in one write (server/coalesce.py): one wake-up of the client.
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=log_level,
                            access_log=access_log, http=coalesce.protocol())
    _configure_logging(settings)
    _Server(config).run()
