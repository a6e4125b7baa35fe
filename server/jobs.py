"""Asynchronous jobs: one queue per device, fair share between users.

A user who submits a hundred jobs must not starve one who submits one, so the runner takes
jobs round-robin over users (each user's own jobs in submission order). A job runs its ops
one at a time on its session's worker, which gives progress and lets a cancel take effect
between ops. States live in the database; progress streams to SSE listeners.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
import time
from collections import deque
from dataclasses import dataclass, field

from difftape.graph import wire

from .db import Database, User
from .problems import ProblemError, quota, server_stopping
from .sessions import SessionManager

log = logging.getLogger("difftape.server")

TERMINAL = ("succeeded", "failed", "cancelled")


@dataclass
class Job:
    owner: User
    id: str
    sid: str
    ops: list[dict]
    state: str = "queued"
    done: int = 0
    cancel: bool = False
    version: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def bump(self) -> None:
        """Wake SSE listeners (each waits on the event it saw; a new one replaces it)."""
        self.version += 1
        ev, self.changed = self.changed, asyncio.Event()
        ev.set()


class JobScheduler:
    def __init__(self, settings, db: Database, sessions: SessionManager, metrics) -> None:
        self.settings = settings
        self.db = db
        self.sessions = sessions
        self.metrics = metrics
        self.device = settings.arch
        self.pending: dict[int, deque[Job]] = {}
        self.turn: deque[int] = deque()  # users with pending jobs, in round-robin order
        self.active: dict[tuple[int, str], Job] = {}
        self._wake = asyncio.Event()
        self.gateway_id: str | None = None  # this gateway's, set by the Service
        self._runners: list[asyncio.Task] = []
        self.stopping = False  # a graceful stop began: running jobs stop before their next op

    # ------------------------------------------------------------------ life cycle
    def start(self) -> None:
        # Jobs a stopped gateway left unfinished were failed when it was reaped
        # (SessionManager.reap): their sessions' workers did not survive it.
        self._runners = [asyncio.ensure_future(self._run_forever())
                         for _ in range(self.settings.job_concurrency)]

    async def stop(self) -> None:
        for t in self._runners:
            t.cancel()
        for t in self._runners:
            try:
                await t
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass

    # ------------------------------------------------------------------ submit / query
    async def submit(self, user: User, sid: str, ops: list[dict], job_id: str | None):
        """(job row, created?) for a submission; resubmitting an id returns the same job."""
        if self.stopping:
            raise server_stopping()
        self.sessions.row(user, sid)
        text = json.dumps(ops, sort_keys=True)
        sha = hashlib.sha256(text.encode()).hexdigest()
        if job_id is not None:
            row = self.db.job(user.id, job_id)
            if row is not None:
                if row["ops_sha256"] != sha or row["session"] != sid:
                    raise ProblemError(409, f"job {job_id!r} exists with different ops or "
                                            "session", title="Job id in use")
                return row, False
        used = self.db.job_seconds(user.id)
        if used >= self.settings.quota_job_seconds:
            raise quota("job_seconds", f"job time quota used up: {used:.1f} s of "
                                       f"{self.settings.quota_job_seconds:g} s")
        job_id = job_id or "j_" + secrets.token_hex(12)
        if not self.db.insert_job(user.id, job_id, sid, text, sha, len(ops),
                                  gateway=self.gateway_id):
            return self.db.job(user.id, job_id), False  # a concurrent identical submission
        job = Job(user, job_id, sid, ops)
        self.active[(user.id, job_id)] = job
        if user.id not in self.pending:
            self.pending[user.id] = deque()
            self.turn.append(user.id)
        self.pending[user.id].append(job)
        self._depth()
        self._wake.set()
        return self.db.job(user.id, job_id), True

    def row(self, user: User, job_id: str):
        row = self.db.job(user.id, job_id)
        if row is None:
            raise ProblemError(404, f"no job {job_id!r}")
        return row

    def live(self, user: User, job_id: str) -> Job | None:
        return self.active.get((user.id, job_id))

    def cancel(self, user: User, job_id: str):
        row = self.row(user, job_id)
        job = self.live(user, job_id)
        if job is None or row["state"] in TERMINAL:
            return row
        job.cancel = True
        if job.state == "queued":
            q = self.pending.get(user.id)
            if q is not None and job in q:
                q.remove(job)
            self._finish(job, "cancelled", None, None)
        return self.db.job(user.id, job_id)

    # ------------------------------------------------------------------ running
    def _depth(self) -> None:
        self.metrics.queue_depth.labels(self.device).set(
            sum(len(q) for q in self.pending.values()))

    def _next(self) -> Job | None:
        """Round-robin over users: the next user's oldest job."""
        while self.turn:
            uid = self.turn.popleft()
            q = self.pending.get(uid)
            if not q:
                self.pending.pop(uid, None)
                continue
            job = q.popleft()
            if q:
                self.turn.append(uid)
            else:
                del self.pending[uid]
            self._depth()
            return job
        return None

    async def _run_forever(self) -> None:
        while True:
            job = self._next()
            if job is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                await self._run(job)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a runner must survive any one job
                log.exception("job %s crashed the runner", job.id)
                self._finish(job, "failed", None, ProblemError(500, "internal error"))

    async def _run(self, job: Job) -> None:
        started = time.time()
        job.state = "running"
        self.db.update_job(job.owner.id, job.id, state="running", started=started)
        job.bump()
        results = []
        printed = None  # what the job's ops printed, capped as one request's (wire.OUTPUT)
        t0 = time.perf_counter()
        try:
            async with self.sessions.use(job.owner, job.sid) as live:
                for op in job.ops:
                    if job.cancel:
                        break
                    if self.stopping:
                        raise server_stopping()
                    if self.db.job_seconds(job.owner.id) + (time.perf_counter() - t0) \
                            > self.settings.quota_job_seconds:
                        raise quota("job_seconds", "job time quota used up while the job ran")
                    created, comps, extra = self.sessions.plan_fields(job.sid, [op])
                    with self.sessions.reserve_fields(job.owner, extra):
                        result, _ = await self.sessions.call_live(live, op)
                        if created or comps:
                            self.sessions.account_fields(job.sid, created, comps)
                    self.sessions.record_kernels(job.sid, [op], [result])
                    if op.get("op") == "launch":
                        self.metrics.launches.labels(op.get("variant", "primal")).inc()
                    if isinstance(result, dict) and wire.OUTPUT in result:
                        printed = wire.merge_output(printed, result.pop(wire.OUTPUT))
                    results.append(result)
                    job.done += 1
                    job.bump()
        except ProblemError as p:
            self._account(job, t0)
            printed = wire.merge_output(printed, p.extra.get(wire.OUTPUT))
            if printed is not None:
                p.extra[wire.OUTPUT] = printed
            self._finish(job, "failed", None, p)
            return
        self._account(job, t0)
        if job.cancel:
            self._finish(job, "cancelled", None, None)
        else:
            self._finish(job, "succeeded", results if printed is None else
                         {"results": results, wire.OUTPUT: printed}, None)

    def _account(self, job: Job, t0: float) -> None:
        self.db.add_job_seconds(job.owner.id, time.perf_counter() - t0)

    def _finish(self, job: Job, state: str, results, problem: ProblemError | None) -> None:
        job.state = state
        self.db.update_job(job.owner.id, job.id, state=state, done=job.done,
                           finished=time.time(),
                           result=json.dumps(results, allow_nan=True)
                           if results is not None else None,
                           problem=json.dumps(problem.body()) if problem else None)
        self.metrics.jobs.labels(state).inc()
        self.active.pop((job.owner.id, job.id), None)
        job.bump()
