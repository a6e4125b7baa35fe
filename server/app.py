"""The gateway application: ``create_app(settings)``.

The gateway authenticates, keeps the session and job tables, and forwards engine ops to the
session's worker process. It never imports the compiler or runs a kernel itself.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI

from . import problems
from .db import Database
from .jobs import JobScheduler
from .metrics import Metrics
from .middleware import GuardMiddleware, TimingMiddleware
from .models import Problem
from .routers import batch, fields, health, jobs, kernels, sessions
from .sessions import Live, SessionManager
from .settings import Settings
from .worker import SharedBuffer, WorkerGone, WorkerPool, WorkerStats

log = logging.getLogger("difftape.server")


class Service:
    """Everything one running gateway owns; routers reach it as ``app.state.service``."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        settings.cache_dir.mkdir(parents=True, exist_ok=True)
        self.db = Database(settings.db_path)
        self.metrics = Metrics()
        self.pool = WorkerPool(settings.engine,
                               {"cache_dir": str(settings.cache_dir),
                                "num_threads": settings.worker_threads},
                               spare=settings.spare_workers,
                               start_timeout=settings.worker_start_timeout_s)
        self.sessions = SessionManager(settings, self.db, self.pool, self.metrics)
        self.metrics.sessions = self.sessions
        self.jobs = JobScheduler(settings, self.db, self.sessions, self.metrics)
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        SharedBuffer.remove_stale()
        self.sessions.recover()
        self.jobs.start()
        self._tasks.append(asyncio.ensure_future(self._probe()))
        self._tasks.append(asyncio.ensure_future(self._cull_forever()))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await self.jobs.stop()
        await self.sessions.shutdown()
        await self.pool.close()
        self.db.close()

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
        interval = min(self.settings.cull_interval_s, self.settings.idle_session_timeout_s / 2)
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
        live.worker.stats = WorkerStats(
            launches=int(s.get("launches", 0)), cache_hits=int(s.get("cache_hits", 0)),
            cache_misses=int(s.get("cache_misses", 0)), compile_s=float(s.get("compile_s", 0)),
            field_bytes=int(s.get("field_bytes", 0)))

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
    problems.install(app)
    for r in (sessions, fields, kernels, batch, jobs, health):
        app.include_router(r.router)
    app.add_middleware(TimingMiddleware, histogram=service.metrics.latency)
    app.add_middleware(GuardMiddleware, allowed_hosts=settings.host_names,
                       allowed_origins=settings.allowed_origins,
                       max_body_bytes=settings.max_body_bytes,
                       max_json_bytes=settings.max_json_bytes)
    return app
