"""Sessions: which engine runs a user's fields and kernels, and their life cycle.

active -> (idle for the timeout) -> culled (fields saved to the saved-sessions dir, engine
stopped) -> (any request, or POST .../resume) -> active again. An engine is a local worker
process or, with ``--cluster``, a Ray actor (``worker.EngineWorker``); one that is lost (killed,
its node lost, a kernel past the time limit) costs only its session, which is culled from its
last save: 410 SessionLostError once (to the request in flight, or else the next one), then
it resumes from that save; a session that changed and was never saved is lost.

Several gateways may share one database (README "Scale out"): a session's engine runs in the
gateway that holds it (``sessions.gateway``), requests reaching another gateway are forwarded
there (``forward.py``), and a culled session is claimed by whichever gateway gets its next
request. Changed fields are saved (checkpointed) once they are ``checkpoint_s`` old, at an
idle moment; the database learns that a session changed *before* the change is sent to its
engine (``dirty``), so when its gateway dies the session resumes elsewhere from its last save
and, if it had changed since, its next request is told so (410) instead of computing on
older fields unawares. A Ray actor outlives its gateway and every gateway reaches it by name:
its requests are not forwarded, the gateway that gets one takes the session over (its
``epoch`` goes up; ``raycluster.py`` says how the actor keeps the former holder out).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import secrets
import tempfile
import time
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from difftape import types as T

from .db import Database, FieldRecord, User
from .problems import ProblemError, quota, server_stopping, session_lost, session_moved
from .settings import Settings
from .worker import EngineWorker, WorkerGone, WorkerMoved, WorkerPool, reachable_by_name

log = logging.getLogger("difftape.server")

#: Bytes per element of each dtype the wire names (models.DTypeName), from difftape's types
#: (u1, a boolean, is one byte as NumPy stores it).
ITEMSIZE = {name: t.np.itemsize for name, t in T.ALL.items()}


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
    """A session whose engine runs (or is being started) in this gateway, or, for a Ray
    actor, that this gateway holds and calls."""

    sid: str
    owner: int
    worker: EngineWorker | None = None
    inflight: int = 0
    last_activity: float = field(default_factory=time.time)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # state transitions
    # Changed since its last save (the database says so too); since when (monotonic).
    dirty: bool = False
    dirty_since: float = 0.0
    saved_path: str | None = None  # its last save, replaced by the next one
    checkpointing: bool = False
    resources: dict[str, float] | None = None  # what its engine reserves (a cluster's)


def _write_atomic(path: str, data) -> None:
    """Write a save to ``path`` through a temporary file: whole or absent."""
    folder = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".save-", suffix=".npz")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _read(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


class SessionManager:
    def __init__(self, settings: Settings, db: Database, pool: WorkerPool | Any,
                 metrics) -> None:
        """``pool`` is a ``WorkerPool`` (local processes) or a ``RayWorkerPool``: both hand
        out ``EngineWorker`` handles; the Ray one also ``attach``es to running actors."""
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
    @property
    def by_name(self) -> bool:
        """Whether this gateway's engines are reached by name (Ray actors)."""
        return hasattr(self.pool, "attach")

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
        self._check_lease()
        resources = self.check_resources(resources)
        sid = "s_" + secrets.token_hex(12)
        # The row first: it holds the user's quota slot (against every gateway's creations)
        # while the worker starts.
        n = self.db.insert_session(sid, user.id, self.settings.arch, self.gateway_id,
                                   self.settings.quota_sessions,
                                   json.dumps(resources) if resources else None)
        if n is not None:
            raise quota("sessions", f"session quota reached: {n} of "
                                    f"{self.settings.quota_sessions} sessions in use")
        try:
            async with self._room:
                await self._make_room()
                worker = await self.pool.get(resources)
                e = self._entry(sid, user.id)
                e.worker, e.resources = self._bind(e, worker), resources
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
        self.db.update_session(sid, state="deleted", field_bytes=0, scratch_bytes=0,
                               worker=None, gateway=None, dirty=0)
        self.db.drop_fields(sid)
        e = self.live.pop(sid, None)
        self._retire(e)
        if e is not None and e.worker is not None:
            if e.worker.lock.locked():
                e.worker.kill()  # busy (a long kernel, a job): no need to wait for it
            else:
                await self._stop(e.worker)
        elif self.by_name and reachable_by_name(row["worker"]):
            # A Ray actor another gateway held (requests for it are not forwarded).
            with contextlib.suppress(WorkerGone):
                (await self.pool.attach(row["worker"], None)).kill()
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
        """Settle what dead gateways held (see ``Database.reap_gateways``); a gateway whose
        engines are Ray actors also takes the sessions whose actors no live gateway holds
        (theirs died: the actors did not) and attaches to them, so that they are culled
        when idle as its own are."""
        problem = {"type": "about:blank", "title": "Session lost", "status": 410,
                   "detail": "the gateway running the job stopped before it finished",
                   "difftape_error": "SessionLostError", "kernel": None}
        lease = self.settings.gateway_lease_s
        adopted = self.db.adopt_sessions(self.gateway_id, lease) if self.by_name else []
        settled = self.db.reap_gateways(lease, json.dumps(problem), orphans=orphans)
        for sid in adopted:
            self._background(self._adopt(sid))
        return settled

    def _background(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _adopt(self, sid: str) -> None:
        """Attach to the actor of a session taken from a dead gateway (see ``reap``)."""
        row = self.db.session(sid)
        if row is None or row["gateway"] != self.gateway_id or row["state"] != "active":
            return
        e = self._entry(sid, row["owner"])
        async with e.lock:
            if e.worker is None:
                try:
                    await self._take_over(e, row, told=False)
                except ProblemError as p:
                    log.info("session %s of a stopped gateway not taken over: %s", sid,
                             p.detail)

    async def reap_engines(self) -> None:
        """Stop the Ray actors that gateways no longer alive started and no session names
        (their spares): detached actors outlive their gateway. Nothing for local workers
        (the registry reaps those of this data dir)."""
        if not self.by_name:
            return
        live = self.db.live_gateways(self.settings.gateway_lease_s)
        names = {a.rpartition("/")[2] for a in self.db.engines_by_name()}
        await asyncio.get_running_loop().run_in_executor(
            None, self.pool.reap, self.gateway_id, live, names)

    @asynccontextmanager
    async def use(self, user: User, sid: str, *, changes: bool = True):
        """The session's engine, resumed if culled (or if the gateway that ran it died), or
        taken over from another gateway if it is a Ray actor; counts as activity.
        ``changes``: the caller may change fields (the database is told before the first
        such op after a save)."""
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
                if (row["gateway"] not in (None, self.gateway_id)
                        and not reachable_by_name(row["worker"])):
                    # Held elsewhere: settled if that gateway is dead, else it is alive and
                    # the request should have gone there (it just moved).
                    self.reap()
                    row = self.db.session(sid)
                if row["state"] == "deleted":
                    self.live.pop(sid, None)
                    raise ProblemError(404, f"no session {sid!r}")
                if row["state"] == "lost":
                    self.live.pop(sid, None)
                    raise session_lost(f"session {sid} was lost: {row['lost_reason']}")
                if e.worker is None:
                    if row["state"] == "active" and reachable_by_name(row["worker"]):
                        await self._take_over(e, row)
                    elif not self.db.claim_session(sid, self.gateway_id):
                        self.live.pop(sid, None)
                        raise session_moved(sid)
                    else:
                        await self._resume(e, self.db.session(sid))
                e.inflight += 1
        else:
            # No await between the check and this increment: culling (which takes e.lock
            # and then looks at inflight) cannot slip in between.
            e.inflight += 1
        try:
            if changes and not e.dirty:
                await self._mark_dirty(e)
            e.last_activity = time.time()
            yield e
        finally:
            e.inflight -= 1
            e.last_activity = time.time()
            if self._checkpoint_due(e, time.monotonic()) and not e.inflight:
                self._checkpoint_soon(e)

    async def _mark_dirty(self, e: Live) -> None:
        """Tell the database that the session changes, before the change reaches its engine:
        a gateway killed after it, or an engine lost, must not let the session resume from
        an older save unawares."""
        if not self.db.update_session(e.sid, holder=self.gateway_id, dirty=1):
            if e.worker is None or not reachable_by_name(e.worker.address):
                self._drop(e, "the session was taken over by another gateway")
                raise session_moved(e.sid)
            await self._retake(e)  # a Ray actor: take it back
            if not e.dirty and not self.db.update_session(e.sid, holder=self.gateway_id,
                                                          dirty=1):
                raise session_moved(e.sid)
        e.dirty, e.dirty_since = True, time.monotonic()

    async def _take_over(self, e: Live, row, *, told: bool = True) -> None:
        """Hold an active session whose engine any gateway reaches by name (a Ray actor),
        from whichever gateway held it: no save, no load, the same actor. Its epoch goes up
        in the database and goes with this gateway's calls, so the actor refuses the former
        holder's from then on (``raycluster.py``)."""
        if not self.by_name:
            raise ProblemError(503, f"session {e.sid} runs on a Ray cluster and this gateway "
                                    "has none: run every gateway of a database with the same "
                                    "--cluster", headers={"Retry-After": "5"})
        if not self.db.take_session(e.sid, self.gateway_id, row["worker"]):
            self.live.pop(e.sid, None)
            raise session_moved(e.sid)  # culled or resumed elsewhere meanwhile: a retry works
        row = self.db.session(e.sid)
        e.resources = self._resources(row)
        try:
            worker = await self.pool.attach(row["worker"], e.resources)
        except WorkerGone as g:
            raise self._gone(e, g, told=told) from None
        e.worker = self._bind(e, worker)
        self._held(e, row)
        log.info("session %s taken over (epoch %d, %s)", e.sid, row["epoch"], worker.address)

    def _held(self, e: Live, row) -> None:
        """What this gateway knows of a session it has just taken, from its row."""
        e.worker.epoch = int(row["epoch"])
        e.saved_path = row["saved_path"]
        e.dirty = bool(row["dirty"])
        e.dirty_since = time.monotonic() if e.dirty else 0.0

    async def _retake(self, e: Live) -> None:
        """Another gateway took this gateway's Ray session over since (its calls are refused,
        nothing ran): take it back, with the row as it is now."""
        worker = e.worker
        if (worker is None or not self.db.take_session(e.sid, self.gateway_id,
                                                        worker.address)):
            self._drop(e, "the session is no longer on that engine")
            raise session_moved(e.sid)
        self._held(e, self.db.session(e.sid))

    def _resources(self, row) -> dict[str, float] | None:
        return json.loads(row["resources"]) if row["resources"] else None

    async def call(self, user: User, sid: str, op: dict, payload=None):
        async with self.use(user, sid, changes=changes_fields(op)) as e:
            return await self.call_live(e, op, payload)

    async def call_live(self, e: Live, op: dict, payload=None):
        timeout = self.settings.kernel_time_limit_s
        try:
            try:
                return await e.worker.call(op, payload, timeout=timeout)
            except WorkerMoved:
                # Nothing ran: take the session back (the database first), then run it.
                await self._retake(e)
                if changes_fields(op) and not e.dirty:
                    await self._mark_dirty(e)
                try:
                    return await e.worker.call(op, payload, timeout=timeout)
                except WorkerMoved:
                    self._drop(e, "the session moves between gateways")
                    raise session_moved(e.sid) from None
        except WorkerGone as g:
            raise self._gone(e, g) from None

    def _gone(self, e: Live, g: WorkerGone, *, told: bool = True) -> ProblemError:
        """The 410 for a request whose session's engine was lost (``_lose`` says what
        becomes of the session). ``told``: the 410 reaches the session's client (not so for
        the gateway's own saves and checks: the next request is told then)."""
        note = self._lose(e, g.reason, told=told)
        if g.timeout:
            return ProblemError(410, f"session {e.sid} was lost: {g.reason}{note}",
                                difftape_error="KernelTimeoutError",
                                title="Kernel time limit exceeded")
        return session_lost(f"session {e.sid} was lost: {g.reason}{note}")

    def _lose(self, e: Live, reason: str, *, told: bool) -> str:
        """The session's engine is gone (with whatever changed since its last save). The
        session is culled from that save, and resumes from it with its next request (on
        any gateway and node); changes since are undone, and unless ``told`` (the request
        that met the loss gets a 410 saying so) the next request is told once. Changed and
        never saved: lost. What the 410 adds about that."""
        if self.live.get(e.sid) is e:
            self.live.pop(e.sid)
            self._retire(e)
            self.metrics.workers_lost.inc()
        if e.worker is not None:
            e.worker.kill()
            e.worker = None
        row = self.db.session(e.sid)
        if row is None or row["state"] == "deleted":
            return ""
        if row["dirty"] and not row["saved_path"]:
            log.warning("session %s lost: %s", e.sid, reason)
            if self.db.update_session(e.sid, holder=self.gateway_id, state="lost",
                                      lost_reason=reason, worker=None, gateway=None,
                                      field_bytes=0, scratch_bytes=0, dirty=0):
                self.db.drop_fields(e.sid)
            return ""
        if row["saved_path"]:
            age = time.time() - (row["saved_at"] or time.time())
            note = (f"; it resumes on its next request from its fields as saved {age:.1f} s "
                    "ago (every change since then is undone)")
        else:
            note = "; it resumes on its next request (it had no fields yet)"
        log.warning("session %s lost its engine: %s%s", e.sid, reason, note)
        self.db.update_session(e.sid, holder=self.gateway_id, state="culled", worker=None,
                               gateway=None, dirty=0, scratch_bytes=0, lost_reason=reason,
                               rolled_back=int(bool(row["dirty"]) and not told))
        return note

    def _drop(self, e: Live, reason: str) -> None:
        """Forget a session this gateway no longer holds (another took it over): stop its
        worker process, save nothing (the database no longer takes this gateway's word for
        it). A Ray actor is left running: the gateway that holds the session calls it."""
        log.warning("session %s dropped: %s", e.sid, reason)
        if self.live.get(e.sid) is e:
            self.live.pop(e.sid)
            self._retire(e)
        if e.worker is not None:
            if not reachable_by_name(e.worker.address):
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
        return quota("field_bytes", f"memory quota exceeded: {used} bytes in use (the fields "
                                    f"and scratch memory of your sessions) + {extra} "
                                    f"requested > {self.settings.quota_field_bytes} bytes")

    def _bind(self, e: Live, worker):
        """The session's engine, its asks for memory answered for ``e``."""
        worker.on_ask = lambda ask: self.grant_scratch(e, ask)
        return worker

    def grant_scratch(self, e: Live, ask: dict) -> dict:
        """Answer an engine's ask for scratch memory (``Engine._grant``: ``scratch`` bytes
        it must hold in all, ``want`` it would rather have, ``what`` needs them): the new
        reservation in the database, counted in the owner's quota with every live
        session's fields and scratch, or a refusal saying what holds the memory and how to
        free it. Asked only when an engine needs more than it was granted, never per
        launch. (``bytes``: what ``what`` itself needs, for the message.)"""
        need, want, what = ask.get("scratch"), ask.get("want"), ask.get("what")
        nbytes = ask.get("bytes", need)
        if not isinstance(need, int) or not isinstance(want, int) or need < 0:
            return {"refuse": "memory quota: a malformed ask for memory"}
        limit = self.settings.quota_field_bytes
        if self.live.get(e.sid) is not e or e.worker is None:
            return {"refuse": f"memory quota: session {e.sid} no longer runs here"}
        grant, rows, reserved = self.db.grow_scratch(e.sid, e.owner, need, max(want, need),
                                                     limit)
        if grant is not None:
            self.metrics.scratch_grants.inc()
            return {"grant": grant}
        self.metrics.scratch_refusals.inc()
        mine = next((r for r in rows if r["id"] == e.sid), None)
        others = [r for r in rows if r["id"] != e.sid and r["field_bytes"] + r["scratch_bytes"]]
        held = "; ".join(f"session {r['id']}: {r['field_bytes']} bytes of fields, "
                         f"{r['scratch_bytes']} of scratch" for r in others)
        own = (f"{mine['field_bytes']} bytes of fields and {mine['scratch_bytes']} of scratch"
               if mine is not None else "nothing")
        return {"refuse": (
            f"memory quota exceeded: {what or 'the session'} needs {nbytes} bytes of scratch "
            f"memory in session {e.sid}, which holds {own}; your memory quota is {limit} "
            f"bytes for all your sessions together, and your other sessions hold "
            f"{held or 'nothing'}" + (f", with {reserved} bytes of fields being created"
                                      if reserved else "") +
            ". Delete sessions you no longer need (a session's scratch memory is freed when "
            "it is deleted or, idle, saved and stopped), or free fields")}

    def check_field_quota(self, user: User, extra: int) -> None:
        used = self.db.held_bytes_of(user.id) + self.db.reserved_bytes_of(user.id)
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
        """Start an engine for a session this gateway has just claimed: its last save (if
        any) and its kernels. A session brought back from a save older than its last change
        (its engine or its gateway was lost and no request was told) answers this request
        with a 410 saying so, once."""
        e.resources = self._resources(row)
        async with self._room:
            await self._make_room()
            worker = self._bind(e, await self.pool.get(e.resources))
            e.worker = worker  # counted by the next _make_room, even before it is loaded
        # A new engine holds no scratch yet (a culled session's was freed as it stopped).
        self.db.update_session(e.sid, holder=self.gateway_id, scratch_bytes=0)
        worker.epoch = int(row["epoch"])
        try:
            timeout = self.settings.kernel_time_limit_s
            saved = None
            if row["saved_path"]:
                data = await asyncio.get_running_loop().run_in_executor(
                    None, _read, row["saved_path"])
                res, _ = await worker.call({"op": "load"}, data, timeout=timeout)
                saved = res.get("fields")
            for k in self.db.kernels_of(e.sid):
                try:
                    await worker.call({"op": "register", "ir": json.loads(k["ir"])},
                                      timeout=timeout)
                except ProblemError as p:
                    if p.status >= 500:
                        raise
                    # Registered after the save, on fields the save lacks: it goes (its
                    # client was told that the session went back to that save).
                    log.info("session %s: kernel %s dropped: %s", e.sid, k["kernel_id"],
                             p.detail)
                    self.db.drop_kernel(e.sid, k["kernel_id"])
        except (ProblemError, WorkerGone, OSError) as err:
            worker.kill()
            e.worker = None
            self.live.pop(e.sid, None)
            if self.stopping:
                # The server began to stop meanwhile: the saved session stays as it was
                # (culled, its save untouched) and resumes after the restart.
                self.db.update_session(e.sid, holder=self.gateway_id, gateway=None,
                                       scratch_bytes=0)
                raise server_stopping() from None
            reason = getattr(err, "detail", None) or getattr(err, "reason", str(err))
            self.db.update_session(e.sid, holder=self.gateway_id, state="lost", gateway=None,
                                   scratch_bytes=0, lost_reason=f"resume failed: {reason}")
            raise session_lost(f"session {e.sid} could not be resumed: {reason}") from None
        # The engine's fields are the truth now (a save older than the records restores
        # fewer fields, or other ones).
        self.db.set_fields(e.sid, {
            int(f["id"]): FieldRecord(
                field_nbytes(f["dtype"], f["shape"], f["element_shape"]),
                list(f["shape"]) + list(f["element_shape"]),
                ["data" if r == "primal" else r for r in f["roles"]])
            for f in saved or ()})
        e.worker, e.saved_path, e.dirty = worker, row["saved_path"], False
        # The save stays until a newer one replaces it: the fields equal it now (not dirty).
        self.db.update_session(e.sid, holder=self.gateway_id, state="active",
                               worker=worker.address, dirty=0, rolled_back=0,
                               lost_reason=None)
        log.info("session %s resumed on %s", e.sid, worker.address)
        if row["rolled_back"]:
            when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(row["saved_at"] or 0))
            why = row["lost_reason"] or "the gateway running it stopped (killed or crashed)"
            raise session_lost(
                f"session {e.sid} was restored from its fields saved at {when}: {why}, after "
                "later changes, which are lost. The session works again from that save "
                "(this request did not run)")

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

        self._background(run())

    async def _save(self, e: Live) -> str:
        """Save the session's fields and kernels to a new file (never over the last save,
        which stays the recovery point until the database names the new one). The engine
        answers the ``.npz`` (a Ray actor's node need not share this disk) and the gateway
        writes it to the saved-sessions dir, which every gateway reaches. A ProblemError if
        it could not: the engine is lost (410, ``_lose``), or another gateway holds the
        session now (503)."""
        try:
            _, data = await e.worker.call({"op": "save"},
                                          timeout=self.settings.kernel_time_limit_s)
        except WorkerGone as g:
            raise self._gone(e, g, told=False) from None
        except WorkerMoved:
            self._drop(e, "another gateway took the session over")
            raise session_moved(e.sid) from None
        path = str(self.settings.saved_dir / f"{e.sid}-{secrets.token_hex(4)}.npz")
        await asyncio.get_running_loop().run_in_executor(None, _write_atomic, path, data)
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
                return
            self.metrics.checkpoints.inc()

    async def cull_idle(self, now: float | None = None) -> list[str]:
        """Save and stop sessions idle for longer than the timeout, save changed fields that
        are due; notice dead workers."""
        now = now or time.time()
        mono = time.monotonic()
        culled = []
        for e in list(self.live.values()):
            if e.worker is not None and e.worker.gone is None and not e.worker.alive():
                if not e.worker.lock.locked():
                    self._lose(e, "the session's worker process died", told=False)
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
        release = {"state": "culled", "worker": None, "gateway": None, "scratch_bytes": 0,
                   "last_activity": e.last_activity}
        if path is None:  # never changed: it resumes as it began
            kept = self.db.update_session(e.sid, holder=self.gateway_id, dirty=0, **release)
        else:
            kept = self._saved(e, path, **release)
        self._retire(e)
        worker, e.worker = e.worker, None
        if kept or not reachable_by_name(worker.address):
            await self._stop(worker)
        else:  # another gateway took it over meanwhile and calls that actor
            self.live.pop(e.sid, None)
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
