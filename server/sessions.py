"""Sessions: which worker runs a user's fields and kernels, and their life cycle.

active -> (idle for the timeout) -> culled (fields saved under the data dir, worker stopped)
-> (any request, or POST .../resume) -> active again; a worker that dies makes its session
lost (410 SessionLostError), and only that session.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
import time
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from .db import Database, FieldRecord, User
from .problems import ProblemError, quota, server_stopping, session_lost
from .settings import Settings
from .worker import EngineWorker, WorkerGone, WorkerPool

log = logging.getLogger("difftape.server")

ITEMSIZE = {"f16": 2, "f32": 4, "f64": 8, "i8": 1, "i16": 2, "i32": 4, "i64": 8,
            "u8": 1, "u16": 2, "u32": 4, "u64": 8}


def field_nbytes(dtype: str, shape: list[int], element_shape: list[int]) -> int:
    return ITEMSIZE[dtype] * math.prod(shape) * math.prod(element_shape)


@dataclass
class Live:
    """A session whose worker runs (or is being started) in this gateway."""

    sid: str
    owner: int
    worker: EngineWorker | None = None
    inflight: int = 0
    last_activity: float = field(default_factory=time.time)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # state transitions
    resources: dict[str, float] | None = None  # what the session asked for (a cluster's)
    changes: int = 0  # ops that may have changed its fields, counted for checkpoints
    saved_changes: int = 0  # ``changes`` when the last checkpoint was taken
    saved_at: float | None = None  # when (time.time()) the last checkpoint was taken
    dirty_since: float | None = None  # first change after that checkpoint (monotonic)


#: Ops that change no field: they do not make a checkpoint due.
READ_ONLY_OPS = frozenset({"read", "get_item", "get_bytes", "stats", "save"})


class SessionManager:
    def __init__(self, settings: Settings, db: Database, pool: WorkerPool, metrics) -> None:
        """``pool`` is a ``WorkerPool`` (local processes) or a ``RayWorkerPool``: both
        hand out ``EngineWorker`` handles."""
        self.settings = settings
        self.db = db
        self.pool = pool
        self.metrics = metrics
        self.live: dict[str, Live] = {}
        self._reserved: dict[int, int] = {}  # user -> field bytes being allocated now
        self._creating: dict[int, int] = {}  # user -> sessions being started now
        self._room = asyncio.Lock()  # worker starts, against the server-wide limit
        self.stopping = False  # a graceful stop began: no new work
        settings.sessions_dir.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ lookup
    def row(self, user: User, sid: str):
        """The session's row if ``user`` owns it; 404 otherwise (never 403: a user does not
        learn that another user's session exists)."""
        row = self.db.session(sid)
        if row is None or row["owner"] != user.id or row["state"] == "deleted":
            raise ProblemError(404, f"no session {sid!r}")
        return row

    def _entry(self, sid: str, owner: int) -> Live:
        e = self.live.get(sid)
        if e is None:
            e = self.live[sid] = Live(sid, owner)
        return e

    # ------------------------------------------------------------------ create / delete
    def check_resources(self, resources: dict[str, float] | None) -> dict[str, float] | None:
        """A session's resource request, checked against the server's limits (422 when it
        exceeds them or cannot be honoured here); None when it asked for nothing."""
        if not resources:
            return None
        cpus, gpus = resources.get("cpus"), resources.get("gpus")
        if cpus is not None and cpus > self.settings.max_session_cpus:
            raise ProblemError(422, f"a session may reserve at most "
                                    f"{self.settings.max_session_cpus:g} CPUs, not {cpus:g}")
        if gpus:
            if gpus > self.settings.max_session_gpus:
                raise ProblemError(422, f"a session may reserve at most "
                                        f"{self.settings.max_session_gpus:g} GPUs, not {gpus:g}")
            if gpus > 1 and gpus != int(gpus):
                raise ProblemError(422, f"GPUs: a fraction of one device (< 1) or whole "
                                        f"devices, not {gpus:g}")
            if self.settings.arch != "cuda":
                raise ProblemError(422, f"this server runs kernels on {self.settings.arch}: a "
                                        "GPU reserved for the session would sit idle; ask for "
                                        "CPUs, or use a server run with --arch cuda")
        self.pool.check(resources)
        return resources

    async def create(self, user: User, resources: dict[str, float] | None = None) -> str:
        """Start a session (its engine: a local worker process, or a Ray actor reserving
        ``resources``); quotas first, then the server-wide worker limit."""
        if self.stopping:
            raise server_stopping()
        resources = self.check_resources(resources)
        n = self.db.count_live_sessions(user.id) + self._creating.get(user.id, 0)
        if n >= self.settings.quota_sessions:
            raise quota("sessions", f"session quota reached: {n} of "
                                    f"{self.settings.quota_sessions} sessions in use")
        self._creating[user.id] = self._creating.get(user.id, 0) + 1
        try:
            async with self._room:
                await self._make_room()
                worker = await self.pool.get(resources)
                sid = "s_" + secrets.token_hex(12)
                self.db.insert_session(sid, user.id, self.settings.arch, worker.address)
                e = self._entry(sid, user.id)
                e.worker = worker
                e.resources = resources
                if resources:
                    self._resources_path(sid).write_text(json.dumps(resources))
        finally:
            self._creating[user.id] -= 1
        return sid

    async def _make_room(self) -> None:
        """At the server-wide worker limit, save and stop the least recently used idle
        session (any user's: it resumes on its next request); 503 if every one is busy.
        Called with ``self._room`` held, so concurrent starts cannot overshoot."""
        running = [e for e in self.live.values() if e.worker is not None]
        if len(running) < self.settings.max_workers:
            return
        for e in sorted(running, key=lambda e: e.last_activity):
            if e.inflight or e.worker.lock.locked() or e.lock.locked():
                continue
            async with e.lock:
                if e.inflight or e.worker is None:
                    continue
                await self._save_and_stop(e)
                if e.worker is None:
                    log.info("session %s saved and stopped to make room", e.sid)
                    return
        raise ProblemError(503, f"the server runs its limit of {self.settings.max_workers} "
                                "sessions and all are busy; try again later",
                           headers={"Retry-After": "5"})

    async def delete(self, user: User, sid: str) -> None:
        row = self.row(user, sid)
        # Marked deleted first, so that a request still running on the worker (which is
        # about to fail) does not turn the session into a "lost" one.
        self.db.update_session(sid, state="deleted", field_bytes=0, worker=None)
        self.db.drop_fields(sid)
        e = self.live.pop(sid, None)
        self._retire(e)
        if e is not None and e.worker is not None:
            if e.worker.lock.locked():
                e.worker.kill()  # busy (a long kernel, a job): no need to wait for it
            else:
                await self._stop(e.worker)
        self.db.drop_kernels(sid)
        if row["saved_path"]:
            Path(row["saved_path"]).unlink(missing_ok=True)
        self._resources_path(sid).unlink(missing_ok=True)

    def _resources_path(self, sid: str) -> Path:
        """Where a session's resource request is kept, so that it resumes with the same."""
        return self.settings.sessions_dir / f"{sid}.resources.json"

    def _resources_of(self, e: Live) -> dict[str, float] | None:
        if e.resources is None:
            try:
                e.resources = json.loads(self._resources_path(e.sid).read_text())
            except (OSError, ValueError):
                e.resources = None
        return e.resources

    def _retire(self, e: Live | None) -> None:
        """Move the worker's last reported counters to the retired ones (call it as the
        entry leaves ``live`` or loses its worker: a scrape then counts them once)."""
        if e is not None and e.worker is not None:
            self.metrics.retire(e.worker.stats)

    async def _stop(self, worker) -> None:
        """Stop a retired worker; what it did since its last report (a session deleted or
        culled before any scrape: all of it) is retired from its final counters."""
        before = replace(worker.stats)
        await asyncio.get_running_loop().run_in_executor(None, worker.stop)
        self.metrics.retire(worker.stats.since(before))

    # ------------------------------------------------------------------ running ops
    def _fast(self, user: User, sid: str) -> Live | None:
        """The live entry of a running session of ``user``: no database round trip."""
        e = self.live.get(sid)
        if (e is not None and e.owner == user.id and e.worker is not None
                and e.worker.gone is None and not e.lock.locked()):
            return e
        return None

    def check(self, user: User, sid: str) -> None:
        """404 unless ``user`` owns ``sid`` (cheap for running sessions)."""
        if self._fast(user, sid) is None:
            self.row(user, sid)

    @asynccontextmanager
    async def use(self, user: User, sid: str):
        """The session's worker, resumed if culled; counts as activity."""
        if self.stopping:
            raise server_stopping()
        e = self._fast(user, sid)
        if e is None:
            row = self.row(user, sid)
            if row["state"] == "lost":
                raise session_lost(f"session {sid} was lost: {row['lost_reason']}")
            e = self._entry(sid, user.id)
            async with e.lock:
                row = self.db.session(sid)  # it may have changed while we waited
                if row["state"] == "deleted":
                    raise ProblemError(404, f"no session {sid!r}")
                if row["state"] == "lost":
                    raise session_lost(f"session {sid} was lost: {row['lost_reason']}")
                if row["state"] == "culled" and row["lost_reason"]:
                    # Its engine was lost while no request of its own ran (a checkpoint or
                    # a cull found it gone): this request is told, the next one resumes it.
                    self.db.update_session(sid, lost_reason=None)
                    raise session_lost(f"session {sid} was lost: {row['lost_reason']}")
                if row["state"] == "culled" or e.worker is None:
                    await self._resume(e, row)
                e.inflight += 1
        else:
            # No await between the check and this increment: culling (which takes e.lock
            # and then looks at inflight) cannot slip in between.
            e.inflight += 1
        e.last_activity = time.time()
        try:
            yield e
        finally:
            e.inflight -= 1
            e.last_activity = time.time()

    async def call(self, user: User, sid: str, op: dict, payload=None):
        async with self.use(user, sid) as e:
            return await self.call_live(e, op, payload)

    async def call_live(self, e: Live, op: dict, payload=None):
        if op.get("op") not in READ_ONLY_OPS:
            e.changes += 1
            if e.dirty_since is None:
                e.dirty_since = time.monotonic()
        try:
            return await e.worker.call(op, payload, timeout=self.settings.kernel_time_limit_s)
        except WorkerGone as g:
            raise self._gone(e, g) from None

    def _gone(self, e: Live, g: WorkerGone, *, told: bool = True) -> ProblemError:
        """The 410 for a request whose session's engine was lost (``_lose`` says what
        becomes of the session). ``told``: the 410 reaches the session's client (not so for
        the gateway's own saves: its next request is told then)."""
        resumes = self._lose(e, g.reason)
        if resumes and told:
            self.db.update_session(e.sid, lost_reason=None)  # this request is told
        if g.timeout:
            return ProblemError(410, f"session {e.sid} was lost: {g.reason}{resumes}",
                                difftape_error="KernelTimeoutError",
                                title="Kernel time limit exceeded")
        return session_lost(f"session {e.sid} was lost: {g.reason}{resumes}")

    def _lose(self, e: Live, reason: str) -> str:
        """The session's engine is gone: without a checkpoint the session is lost; with one
        it is marked culled from that checkpoint (so that the next request resumes it, on
        another node if need be). Returns what the 410 adds about that."""
        if self.live.get(e.sid) is e:
            self.live.pop(e.sid)
            self._retire(e)
            self.metrics.workers_lost.inc()
        if e.worker is not None:
            e.worker.kill()
        row = self.db.session(e.sid)
        if row is None or row["state"] == "deleted":
            return ""
        saved = row["saved_path"]
        if (self.settings.checkpoint_every and saved and not self.stopping
                and Path(saved).exists()):
            age = time.time() - (e.saved_at or Path(saved).stat().st_mtime)
            note = (f"; it resumes on its next request from its fields as saved {age:.1f} s "
                    f"ago (every change since then is undone)")
            log.warning("session %s lost its engine: %s%s", e.sid, reason, note)
            self.db.update_session(e.sid, state="culled", lost_reason=reason + note,
                                   worker=None)
            return note
        log.warning("session %s lost: %s", e.sid, reason)
        self.db.update_session(e.sid, state="lost", lost_reason=reason, worker=None,
                               field_bytes=0)
        self.db.drop_fields(e.sid)
        return ""

    # ------------------------------------------------------------------ quotas
    def check_batch_size(self, n: int) -> None:
        limit = self.settings.max_batch_ops
        if n > limit:
            raise quota("batch_ops", f"{n} ops in one batch or job; at most {limit} (send "
                                     "them in several)")

    def check_field_quota(self, user: User, extra: int) -> None:
        used = self.db.field_bytes_of(user.id) + self._reserved.get(user.id, 0)
        limit = self.settings.quota_field_bytes
        if used + extra > limit:
            raise quota("field_bytes", f"field memory quota exceeded: {used} bytes in use + "
                                       f"{extra} requested > {limit} bytes")

    @contextmanager
    def reserve_fields(self, user: User, extra: int):
        """Check the quota and hold ``extra`` bytes while the worker allocates them, so that
        concurrent requests cannot together overrun it; the caller accounts for what was
        made before the reservation ends."""
        if not extra:
            yield
            return
        self.check_field_quota(user, extra)
        self._reserved[user.id] = self._reserved.get(user.id, 0) + extra
        try:
            yield
        finally:
            self._reserved[user.id] -= extra

    def account_fields(self, sid: str, created: dict[int, FieldRecord],
                       companions: list[tuple[int, str]]) -> None:
        """Record created fields and companions added later, so the quota sees
        ``.grad``/``.dual`` storage too: the rows touched and the session's byte count, never
        the whole table."""
        if not created and not companions:
            return
        known = self.db.field_records(sid, set(created) | {fid for fid, _ in companions})
        rows: dict[int, FieldRecord] = {}
        delta = 0
        for fid, rec in created.items():
            old = rows.get(fid) or known.get(fid)
            roles = list(rec.roles)
            if old is not None:
                delta -= old.total
                roles += [r for r in old.roles if r not in roles]
            rows[fid] = FieldRecord(rec.nbytes, rec.shape, roles)
            delta += rows[fid].total
        for fid, role in companions:
            rec = rows.get(fid) or known.get(fid)
            if rec is None:
                continue
            for r in (["grad"] if role == "grad_dual" else []) + [role]:
                if r not in rec.roles:
                    rec.roles.append(r)
                    delta += rec.nbytes
            rows[fid] = rec
        self.db.put_fields(sid, rows, delta)

    @staticmethod
    def created_record(op: dict) -> FieldRecord:
        """The record of a ``create_field`` op (or body)."""
        n = field_nbytes(op["dtype"], op["shape"], op["element_shape"])
        roles = ["data"] + (["grad"] if op.get("needs_grad") else []) + (
            ["dual"] if op.get("needs_dual") else [])
        return FieldRecord(n, list(op["shape"]) + list(op["element_shape"]), roles)

    def plan_fields(self, sid: str, ops: list[dict]):
        """Storage a batch allocates: (created, companions, bytes) for the quota."""
        created: dict[int, FieldRecord] = {}
        companions, extra = [], 0
        if not any(op["op"] in ("create_field", "companion") for op in ops):
            return created, companions, extra
        known = self.db.field_records(sid, {op["id"] for op in ops if op["op"] == "companion"})
        for op in ops:
            if op["op"] == "create_field":
                rec = created[op["id"]] = self.created_record(op)
                extra += rec.total
            elif op["op"] == "companion":
                companions.append((op["id"], op["role"]))
                rec = created.get(op["id"]) or known.get(op["id"])
                if rec is not None and op["role"] not in rec.roles:
                    extra += rec.nbytes
        return created, companions, extra

    def record_kernels(self, sid: str, ops: list[dict], results: list) -> None:
        """Remember kernels a batch registered (the session's kernel table)."""
        for op, res in zip(ops, results, strict=False):
            if op["op"] == "register" and isinstance(res, dict) and "kernel_id" in res:
                self.db.add_kernel(sid, str(res["kernel_id"]), json.dumps(op["ir"]))

    # ------------------------------------------------------------------ cull / resume
    async def _resume(self, e: Live, row) -> None:
        async with self._room:
            await self._make_room()
            worker = await self.pool.get(self._resources_of(e))
            e.worker = worker  # counted by the next _make_room, even before it is loaded
        # A session whose engine was lost comes back from its last checkpoint: kernels
        # registered after it may name fields it does not have (the client was told, 410).
        after_loss = bool(self.settings.checkpoint_every)
        try:
            timeout = self.settings.kernel_time_limit_s
            if row["saved_path"]:
                restored = await worker.load(row["saved_path"], timeout=timeout)
                self._record_restored(e.sid, row, restored.get("fields", []))
            for k in self.db.kernels_of(e.sid):
                try:
                    await worker.call({"op": "register", "ir": json.loads(k["ir"])},
                                      timeout=timeout)
                except ProblemError as p:
                    if not after_loss or p.status >= 500:
                        raise
                    log.info("session %s: kernel %s not restored: %s", e.sid,
                             k["kernel_id"], p.detail)
        except (ProblemError, WorkerGone) as err:
            worker.kill()
            e.worker = None
            if self.stopping:
                # The server began to stop meanwhile: the saved session stays as it was
                # (culled, its save untouched) and resumes after the restart.
                raise server_stopping() from None
            reason = getattr(err, "detail", None) or getattr(err, "reason", str(err))
            self.db.update_session(e.sid, state="lost", lost_reason=f"resume failed: {reason}")
            self.live.pop(e.sid, None)
            raise session_lost(f"session {e.sid} could not be resumed: {reason}") from None
        e.worker = worker
        if self.settings.checkpoint_every and row["saved_path"]:
            # The save is the session's state now: it stays as its first checkpoint.
            e.changes = e.saved_changes = 0
            e.saved_at, e.dirty_since = time.time(), None
            self.db.update_session(e.sid, state="active", worker=worker.address,
                                   lost_reason=None)
        else:
            if row["saved_path"]:
                Path(row["saved_path"]).unlink(missing_ok=True)
            # The save is consumed: after a crash the session must not come back with stale
            # data.
            self.db.update_session(e.sid, state="active", worker=worker.address,
                                   saved_path=None, lost_reason=None)
        log.info("session %s resumed on %s", e.sid, worker.address)

    def _record_restored(self, sid: str, row, fields: list[dict]) -> None:
        """The session's field records (the quota's and the upload shape check's) as the
        engine restored them: a checkpoint may predate fields the records still list."""
        records: dict[int, FieldRecord] = {}
        for d in fields:
            rec = self.created_record({"dtype": d["dtype"], "shape": d["shape"],
                                       "element_shape": d["element_shape"]})
            rec.roles = ["data" if r == "primal" else r for r in d["roles"]]
            records[int(d["id"])] = rec
        self.db.drop_fields(sid)
        total = sum(r.total for r in records.values())
        self.db.put_fields(sid, records, total - int(row["field_bytes"] or 0))

    async def resume(self, user: User, sid: str) -> None:
        async with self.use(user, sid):
            pass

    async def cull_idle(self, now: float | None = None) -> list[str]:
        """Save and stop sessions idle for longer than the timeout; notice dead workers."""
        now = now or time.time()
        culled = []
        for e in list(self.live.values()):
            if e.worker is not None and e.worker.gone is None and not e.worker.alive():
                if not e.worker.lock.locked():
                    self._lose(e, "the session's worker process died")
                continue
            if (e.worker is None or e.inflight or e.worker.lock.locked()
                    or now - e.last_activity < self.settings.idle_session_timeout_s):
                continue
            async with e.lock:
                if e.inflight or e.worker is None:
                    continue
                await self._save_and_stop(e)
                culled.append(e.sid)
        for e in self.live.values():
            self.db.update_session(e.sid, last_activity=e.last_activity)
        return culled

    def _save_path(self, sid: str) -> str:
        return str(self.settings.sessions_dir / f"{sid}.npz")

    async def _save(self, e: Live) -> str:
        """Save the session's fields and kernels where the gateway keeps them (a Ray actor
        sends them back through the object store); the path. 410 if the engine is gone."""
        path = self._save_path(e.sid)
        try:
            await e.worker.save(path, timeout=self.settings.kernel_time_limit_s)
        except WorkerGone as g:
            raise self._gone(e, g, told=False) from None
        return path

    async def checkpoint(self, e: Live) -> bool:
        """Save a running session that changed since its last checkpoint (``e.lock`` held
        by the caller, the session idle); True if a checkpoint was taken."""
        if e.worker is None or e.changes == e.saved_changes:
            return False
        changes, started = e.changes, time.time()
        try:
            path = await self._save(e)
        except ProblemError as p:
            log.error("could not checkpoint session %s: %s", e.sid, p.detail)
            return False
        e.saved_changes, e.saved_at = changes, started
        e.dirty_since = None if e.changes == changes else e.dirty_since
        self.db.update_session(e.sid, saved_path=path)
        self.metrics.checkpoints.inc()
        return True

    async def checkpoint_due(self, now: float | None = None) -> list[str]:
        """Checkpoint every idle session whose first unsaved change is at least
        ``checkpoint_every`` seconds old (a busy one is checkpointed once its op ends)."""
        every = self.settings.checkpoint_every
        if not every or self.stopping:
            return []
        now = time.monotonic() if now is None else now
        done = []
        for e in list(self.live.values()):
            if (e.worker is None or e.worker.gone is not None or e.dirty_since is None
                    or now - e.dirty_since < every or e.worker.lock.locked()
                    or e.lock.locked()):
                continue
            async with e.lock:
                if e.worker is not None and await self.checkpoint(e):
                    done.append(e.sid)
        return done

    async def _save_and_stop(self, e: Live) -> None:
        try:
            path = await self._save(e)
        except ProblemError as p:  # a 410: the session was lost meanwhile (see _lose)
            log.error("could not save session %s: %s", e.sid, p.detail)
            return
        self.db.update_session(e.sid, state="culled", saved_path=path, worker=None,
                               last_activity=e.last_activity, lost_reason=None)
        self._retire(e)
        worker, e.worker = e.worker, None
        await self._stop(worker)
        log.info("session %s culled after %.0f s idle; fields saved to %s", e.sid,
                 time.time() - e.last_activity, path)

    async def drain(self, run_deadline: float, save_deadline: float) -> None:
        """The graceful stop (``time.monotonic`` deadlines): refuse new work, save every
        idle session now, let running operations finish until ``run_deadline`` and then
        stop their workers (the caller gets a SessionLostError saying the server stopped),
        and stop saves still unfinished at ``save_deadline``. Sessions are independent:
        one long kernel delays no one else's save."""
        self.stopping = True
        entries = [e for e in self.live.values()
                   if e.worker is not None and e.worker.gone is None]
        for e in entries:
            e.worker.draining = True
        await asyncio.gather(*(self._drain_one(e, run_deadline, save_deadline)
                               for e in entries), return_exceptions=True)

    async def _drain_one(self, e: Live, run_deadline: float, save_deadline: float) -> None:
        worker = e.worker

        async def save() -> None:
            async with e.lock:
                if e.worker is worker:
                    await self._save_and_stop(e)

        task = asyncio.ensure_future(save())
        await asyncio.wait([task], timeout=max(0.0, run_deadline - time.monotonic()))
        reason = ("the server stopped while an operation of this session ran (it did not "
                  "finish within the shutdown grace period)")
        if not task.done() and worker.current == "save":
            # The user's operation is over; the save itself has until save_deadline.
            await asyncio.wait([task], timeout=max(0.0, save_deadline - time.monotonic()))
            reason = "the server stopped before this session could be saved"
        if task.done():
            return
        log.warning("session %s: %s", e.sid, reason)
        if worker.gone is None:
            worker.gone = WorkerGone(reason)
        worker.kill()
        await asyncio.wait([task])

    async def shutdown(self) -> None:
        """Save every session so that a restarted server can resume them."""
        async def save(e: Live) -> None:
            async with e.lock:
                await self._save_and_stop(e)

        # Concurrently: each session has its own worker, and a container's stop grace period
        # (often 30 s) must cover them all.
        await asyncio.gather(*(save(e) for e in list(self.live.values())
                               if e.worker is not None and e.worker.gone is None),
                             return_exceptions=True)
        self.live.clear()

    def recover(self) -> None:
        """At start-up: sessions the database calls active have no worker any more."""
        for row in self.db.sessions_in("active"):
            self.db.update_session(row["id"], state="lost", worker=None, field_bytes=0,
                                   lost_reason="the server stopped without saving it")
            self.db.drop_fields(row["id"])
