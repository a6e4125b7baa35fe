"""Sessions: which worker runs a user's fields and kernels, and their life cycle.

active -> (idle for the timeout) -> culled (fields saved to the saved-sessions dir, worker
stopped) -> (any request, or POST .../resume) -> active again; a worker that dies makes its
session lost (410 SessionLostError), and only that session.

Several gateways may share one database (README "Scale out"): a session's engine runs in the
gateway that holds it (``sessions.gateway``), requests reaching another gateway are forwarded
there (``forward.py``), and a culled session is claimed by whichever gateway gets its next
request. Changed fields are saved (checkpointed) once they are ``checkpoint_s`` old, at an
idle moment; the database learns that a session changed *before* the change is sent to its
engine (``dirty``), so when its gateway dies the session resumes elsewhere from its last save
and, if it had changed since, its next request is told so (410) instead of computing on
older fields unawares.
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
from .problems import ProblemError, quota, server_stopping, session_lost, session_moved
from .settings import Settings
from .worker import Worker, WorkerGone, WorkerPool

log = logging.getLogger("difftape.server")

ITEMSIZE = {"f16": 2, "f32": 4, "f64": 8, "i8": 1, "i16": 2, "i32": 4, "i64": 8,
            "u8": 1, "u16": 2, "u32": 4, "u64": 8}


def field_nbytes(dtype: str, shape: list[int], element_shape: list[int]) -> int:
    return ITEMSIZE[dtype] * math.prod(shape) * math.prod(element_shape)


#: Ops that change nothing a save would hold (kernels are in the database and registered
#: again on resume), so they do not make a session's saved fields stale.
KEEPS_FIELDS = frozenset({"read", "get_item", "get_bytes", "stats", "register"})


def changes_fields(op: dict) -> bool:
    """Whether running ``op`` may change the session's fields (conservatively: yes unless
    it is a read, or a batch of reads)."""
    name = op.get("op")
    if name == "batch":
        return any(changes_fields(o) for o in op.get("ops", ()))
    return name not in KEEPS_FIELDS


@dataclass
class Live:
    """A session whose worker runs (or is being started) in this gateway."""

    sid: str
    owner: int
    worker: Worker | None = None
    inflight: int = 0
    last_activity: float = field(default_factory=time.time)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # state transitions
    # Changed since its last save (the database says so too); since when (monotonic).
    dirty: bool = False
    dirty_since: float = 0.0
    saved_path: str | None = None  # its last save, replaced by the next one
    checkpointing: bool = False


class SessionManager:
    def __init__(self, settings: Settings, db: Database, pool: WorkerPool, metrics) -> None:
        self.settings = settings
        self.db = db
        self.pool = pool
        self.metrics = metrics
        self.live: dict[str, Live] = {}
        self._room = asyncio.Lock()  # worker starts, against the server-wide limit
        self.stopping = False  # a graceful stop began: no new work
        # This gateway's id in the database (set by the Service before it serves), and the
        # monotonic time until which its lease there is certainly held: past it (the
        # database unreachable, the event loop stalled) it runs no session's op, since
        # another gateway may be taking its sessions over.
        self.gateway_id = ""
        self.lease_deadline = math.inf
        self._tasks: set[asyncio.Task] = set()
        settings.saved_dir.mkdir(parents=True, exist_ok=True)

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
    async def create(self, user: User) -> str:
        if self.stopping:
            raise server_stopping()
        self._check_lease()
        sid = "s_" + secrets.token_hex(12)
        # The row first: it holds the user's quota slot (against every gateway's creations)
        # while the worker starts.
        n = self.db.insert_session(sid, user.id, self.settings.arch, self.gateway_id,
                                   self.settings.quota_sessions)
        if n is not None:
            raise quota("sessions", f"session quota reached: {n} of "
                                    f"{self.settings.quota_sessions} sessions in use")
        try:
            async with self._room:
                await self._make_room()
                worker = await self.pool.get()
                e = self._entry(sid, user.id)
                e.worker = worker
        except BaseException:
            self.live.pop(sid, None)
            self.db.remove_session(sid)
            raise
        self.db.update_session(sid, worker=worker.address)
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
        self.db.update_session(sid, state="deleted", field_bytes=0, worker=None, gateway=None,
                               dirty=0)
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

    def _check_lease(self) -> None:
        if time.monotonic() > self.lease_deadline:
            raise ProblemError(503, "this gateway cannot renew its lease in the database, so "
                                    "it runs no session until it can; try again (another "
                                    "gateway may take the session over)",
                               headers={"Retry-After": "2"})

    def reap(self, *, orphans: bool = False) -> list[str]:
        """Settle what dead gateways held (see ``Database.reap_gateways``)."""
        problem = {"type": "about:blank", "title": "Session lost", "status": 410,
                   "detail": "the gateway running the job stopped before it finished",
                   "difftape_error": "SessionLostError", "kernel": None}
        return self.db.reap_gateways(self.settings.gateway_lease_s, json.dumps(problem),
                                     orphans=orphans)

    @asynccontextmanager
    async def use(self, user: User, sid: str, *, changes: bool = True):
        """The session's worker, resumed if culled (or if the gateway that ran it died);
        counts as activity. ``changes``: the caller may change fields (the database is told
        before the first such op after a save)."""
        if self.stopping:
            raise server_stopping()
        self._check_lease()
        e = self._fast(user, sid)
        if e is None:
            row = self.row(user, sid)
            if row["state"] == "lost":
                raise session_lost(f"session {sid} was lost: {row['lost_reason']}")
            e = self._entry(sid, user.id)
            async with e.lock:
                row = self.db.session(sid)  # it may have changed while we waited
                if row["gateway"] not in (None, self.gateway_id):
                    # Held elsewhere: settled if that gateway is dead, else it is alive and
                    # the request should have gone there (it just moved).
                    self.reap()
                    row = self.db.session(sid)
                if row["state"] == "deleted":
                    raise ProblemError(404, f"no session {sid!r}")
                if row["state"] == "lost":
                    self.live.pop(sid, None)
                    raise session_lost(f"session {sid} was lost: {row['lost_reason']}")
                if e.worker is None:
                    if not self.db.claim_session(sid, self.gateway_id):
                        self.live.pop(sid, None)
                        raise session_moved(sid)
                    await self._resume(e, self.db.session(sid))
                e.inflight += 1
        else:
            # No await between the check and this increment: culling (which takes e.lock
            # and then looks at inflight) cannot slip in between.
            e.inflight += 1
        try:
            if changes and not e.dirty:
                # Before the change reaches the engine: a gateway killed after it must not
                # let the session resume from an older save unawares.
                if not self.db.update_session(sid, holder=self.gateway_id, dirty=1):
                    self._drop(e, "the session was taken over by another gateway")
                    raise session_moved(sid)
                e.dirty, e.dirty_since = True, time.monotonic()
            e.last_activity = time.time()
            yield e
        finally:
            e.inflight -= 1
            e.last_activity = time.time()
            if self._checkpoint_due(e, time.monotonic()) and not e.inflight:
                self._checkpoint_soon(e)

    async def call(self, user: User, sid: str, op: dict, payload=None):
        async with self.use(user, sid, changes=changes_fields(op)) as e:
            return await self.call_live(e, op, payload)

    async def call_live(self, e: Live, op: dict, payload=None):
        try:
            return await e.worker.call(op, payload, timeout=self.settings.kernel_time_limit_s)
        except WorkerGone as g:
            self._lose(e, g.reason)
            if g.timeout:
                raise ProblemError(410, f"session {e.sid} was lost: {g.reason}",
                                   difftape_error="KernelTimeoutError",
                                   title="Kernel time limit exceeded") from None
            raise session_lost(f"session {e.sid} was lost: {g.reason}") from None

    def _lose(self, e: Live, reason: str) -> None:
        if self.live.get(e.sid) is e:
            self.live.pop(e.sid)
            self._retire(e)
            self.metrics.workers_lost.inc()
        if e.worker is not None:
            e.worker.kill()
        row = self.db.session(e.sid)
        if row is None or row["state"] == "deleted":
            return
        log.warning("session %s lost: %s", e.sid, reason)
        if self.db.update_session(e.sid, holder=self.gateway_id, state="lost",
                                  lost_reason=reason, worker=None, gateway=None,
                                  field_bytes=0, dirty=0):
            self.db.drop_fields(e.sid)

    def _drop(self, e: Live, reason: str) -> None:
        """Forget a session this gateway no longer holds (another took it over): stop its
        worker, save nothing (the database no longer takes this gateway's word for it)."""
        log.warning("session %s dropped: %s", e.sid, reason)
        if self.live.get(e.sid) is e:
            self.live.pop(e.sid)
            self._retire(e)
        if e.worker is not None:
            e.worker.kill()
            e.worker = None

    def drop_all(self, reason: str) -> None:
        """This gateway lost its lease (declared dead): every session goes (see _drop)."""
        for e in list(self.live.values()):
            self._drop(e, reason)

    # ------------------------------------------------------------------ quotas
    def check_batch_size(self, n: int) -> None:
        limit = self.settings.max_batch_ops
        if n > limit:
            raise quota("batch_ops", f"{n} ops in one batch or job; at most {limit} (send "
                                     "them in several)")

    def _over_quota(self, used: int, extra: int) -> ProblemError:
        return quota("field_bytes", f"field memory quota exceeded: {used} bytes in use + "
                                    f"{extra} requested > {self.settings.quota_field_bytes} "
                                    "bytes")

    def check_field_quota(self, user: User, extra: int) -> None:
        used = self.db.field_bytes_of(user.id) + self.db.reserved_bytes_of(user.id)
        if used + extra > self.settings.quota_field_bytes:
            raise self._over_quota(used, extra)

    @contextmanager
    def reserve_fields(self, user: User, extra: int):
        """Check the quota and hold ``extra`` bytes while the worker allocates them (in the
        database, so that concurrent requests on any gateways cannot together overrun it);
        the caller accounts for what was made before the reservation ends."""
        if not extra:
            yield
            return
        rid, used = self.db.reserve_bytes(user.id, self.gateway_id, extra,
                                          self.settings.quota_field_bytes)
        if rid is None:
            raise self._over_quota(used, extra)
        try:
            yield
        finally:
            self.db.release_bytes(rid)

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
        """Start a worker for a session this gateway has just claimed: its last save (if
        any) and its kernels. A session brought back from a save older than its last change
        (its gateway died) answers this request with a 410 saying so, once."""
        async with self._room:
            await self._make_room()
            worker = await self.pool.get()
            e.worker = worker  # counted by the next _make_room, even before it is loaded
        try:
            timeout = self.settings.kernel_time_limit_s
            saved = None
            if row["saved_path"]:
                res, _ = await worker.call({"op": "load", "path": row["saved_path"]},
                                           timeout=timeout)
                saved = res.get("fields")
            for k in self.db.kernels_of(e.sid):
                await worker.call({"op": "register", "ir": json.loads(k["ir"])},
                                  timeout=timeout)
        except (ProblemError, WorkerGone) as err:
            worker.kill()
            e.worker = None
            self.live.pop(e.sid, None)
            if self.stopping:
                # The server began to stop meanwhile: the saved session stays as it was
                # (culled, its save untouched) and resumes after the restart.
                self.db.update_session(e.sid, holder=self.gateway_id, gateway=None)
                raise server_stopping() from None
            reason = getattr(err, "detail", None) or getattr(err, "reason", str(err))
            self.db.update_session(e.sid, holder=self.gateway_id, state="lost", gateway=None,
                                   lost_reason=f"resume failed: {reason}")
            raise session_lost(f"session {e.sid} could not be resumed: {reason}") from None
        # The engine's fields are the truth now (a save older than the records restores
        # fewer fields, or other ones).
        if row["saved_path"] is None:
            self.db.set_fields(e.sid, {})
        elif saved is not None:
            self.db.set_fields(e.sid, {
                int(f["id"]): FieldRecord(field_nbytes(f["dtype"], f["shape"],
                                                       f["element_shape"]),
                                          list(f["shape"]) + list(f["element_shape"]),
                                          list(f["roles"]))
                for f in saved})
        e.worker, e.saved_path, e.dirty = worker, row["saved_path"], False
        # The save stays until a newer one replaces it: the fields equal it now (not dirty).
        self.db.update_session(e.sid, holder=self.gateway_id, state="active",
                               worker=worker.address, dirty=0, rolled_back=0)
        log.info("session %s resumed on %s", e.sid, worker.address)
        if row["rolled_back"]:
            when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(row["saved_at"] or 0))
            raise session_lost(
                f"session {e.sid} was restored from its fields saved at {when}: the gateway "
                "running it stopped (killed or crashed) after later changes, which are lost. "
                "The session works again from that save (this request did not run)")

    async def resume(self, user: User, sid: str) -> None:
        async with self.use(user, sid, changes=False):
            pass

    def _checkpoint_due(self, e: Live, now: float) -> bool:
        every = self.settings.checkpoint_s
        return bool(every) and e.dirty and now - e.dirty_since >= every

    def _checkpoint_soon(self, e: Live) -> None:
        if e.checkpointing or self.stopping:
            return
        e.checkpointing = True

        async def run() -> None:
            try:
                await self._checkpoint(e)
            except Exception:  # noqa: BLE001 - logged; the next one may succeed
                log.exception("checkpoint of session %s failed", e.sid)
            finally:
                e.checkpointing = False

        task = asyncio.ensure_future(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _save(self, e: Live) -> str:
        """Save the session's fields to a new file (never over the last save, which stays
        the recovery point until the database names the new one)."""
        path = str(self.settings.saved_dir / f"{e.sid}-{secrets.token_hex(4)}.npz")
        await self.call_live(e, {"op": "save", "path": path})
        return path

    def _saved(self, e: Live, path: str, **cols) -> bool:
        """Record ``path`` as the session's save (only while this gateway holds it) and
        remove the save it replaces; False (the new file removed) if it lost the session."""
        if not self.db.update_session(e.sid, holder=self.gateway_id, saved_path=path,
                                      saved_at=time.time(), dirty=0, **cols):
            if path != e.saved_path:
                Path(path).unlink(missing_ok=True)
            return False
        if e.saved_path and e.saved_path != path:
            Path(e.saved_path).unlink(missing_ok=True)
        e.saved_path, e.dirty = path, False
        return True

    async def _checkpoint(self, e: Live) -> None:
        """Save a running session's changed fields; it goes on running."""
        async with e.lock:
            if (e.inflight or e.worker is None or e.worker.gone is not None or not e.dirty
                    or self.live.get(e.sid) is not e):
                return
            try:
                path = await self._save(e)
            except ProblemError as p:
                log.error("could not save session %s: %s", e.sid, p.detail)
                return
            if not self._saved(e, path):
                self._drop(e, "the session was taken over by another gateway")

    async def cull_idle(self, now: float | None = None) -> list[str]:
        """Save and stop sessions idle for longer than the timeout, save changed fields that
        are due; notice dead workers."""
        now = now or time.time()
        mono = time.monotonic()
        culled = []
        for e in list(self.live.values()):
            if e.worker is not None and e.worker.gone is None and not e.worker.proc.is_alive():
                if not e.worker.lock.locked():
                    self._lose(e, "the session's worker process died")
                continue
            if e.worker is None or e.inflight or e.worker.lock.locked():
                continue
            if now - e.last_activity < self.settings.idle_session_timeout_s:
                if self._checkpoint_due(e, mono):
                    await self._checkpoint(e)
                continue
            async with e.lock:
                if e.inflight or e.worker is None:
                    continue
                await self._save_and_stop(e)
                culled.append(e.sid)
        for e in self.live.values():
            self.db.update_session(e.sid, holder=self.gateway_id,
                                   last_activity=e.last_activity)
        return culled

    async def _save_and_stop(self, e: Live) -> None:
        """Save the session (unless its last save is current), stop its worker and release
        it: any gateway resumes it on its next request."""
        path = e.saved_path
        if e.dirty:
            try:
                path = await self._save(e)
            except ProblemError as p:
                log.error("could not save session %s: %s", e.sid, p.detail)
                return
        release = {"state": "culled", "worker": None, "gateway": None,
                   "last_activity": e.last_activity}
        if path is None:  # never changed: it resumes as it began
            kept = self.db.update_session(e.sid, holder=self.gateway_id, dirty=0, **release)
        else:
            kept = self._saved(e, path, **release)
        self._retire(e)
        worker, e.worker = e.worker, None
        await self._stop(worker)
        if kept:
            log.info("session %s saved and stopped after %.0f s idle (%s)", e.sid,
                     time.time() - e.last_activity, path or "nothing to save")

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
        """Save every session so that a restarted server (or another gateway) can resume
        them."""
        async def save(e: Live) -> None:
            async with e.lock:
                if e.worker is not None:
                    await self._save_and_stop(e)

        # Concurrently: each session has its own worker, and a container's stop grace period
        # (often 30 s) must cover them all.
        await asyncio.gather(*(save(e) for e in list(self.live.values())
                               if e.worker is not None and e.worker.gone is None),
                             return_exceptions=True)
        self.live.clear()
