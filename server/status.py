"""What the status page (``GET /status``) shows: who holds the machine and how far their jobs are.

A snapshot is gathered per page view from what the gateway already keeps: the database's
sessions, jobs and per-user usage (every gateway of it), this gateway's live sessions (worker
process, op in flight, compile counters) and jobs (progress op by op), and the machine's
CPU and memory from ``/proc`` (Linux, where the server runs; figures it cannot read are shown
as unknown, never made up).

Who sees what: an admin (``DIFFTAPE_ADMINS``) sees every user's sessions and jobs by name;
any other user sees their own in full and the rest of the server as totals without names or
ids, the same figures ``/metrics`` gives every token. A user must not learn another's
session ids (they name the session in every URL) or what they run.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field

from difftape._version import __version__

from .jobs import TERMINAL

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


# ---------------------------------------------------------------------- the machine
def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes (empty where there is none)."""
    out: dict[str, int] = {}
    for line in (_read("/proc/meminfo") or "").splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key] = int(parts[0]) * 1024
    return out


def _cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) clock ticks of all CPUs since boot."""
    text = _read("/proc/stat")
    if not text or not text.startswith("cpu "):
        return None
    v = [int(x) for x in text.splitlines()[0].split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
    total = sum(v[:8])  # guest time is counted in user already
    return total - idle, total


def process_rss(pid: int) -> int | None:
    """A process's resident memory in bytes, None if it is gone or unreadable."""
    for line in (_read(f"/proc/{pid}/status") or "").splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return None


def process_cpu_s(pid: int) -> float | None:
    """A process's CPU time (user + system) in seconds."""
    text = _read(f"/proc/{pid}/stat")
    if not text:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


class CpuSampler:
    """CPU utilisation between page views: each figure is over the time since the previous
    sample of the same thing, once that is at least ``min_interval`` old (a faster reload
    shows the previous figure again); the machine's first is over the time since the
    gateway started, a worker's first is unknown."""

    def __init__(self, min_interval: float = 1.0) -> None:
        self.min_interval = min_interval
        self._last: dict[object, tuple[float, float, float]] = {}  # key -> (t, busy, total)
        self._value: dict[object, float] = {}
        self.machine()  # the first interval starts now

    def _rate(self, key: object, now: float, busy: float, total: float) -> float | None:
        """busy/total growth since the previous sample of ``key``."""
        prev = self._last.get(key)
        if prev is None or (now - prev[0] >= self.min_interval and total > prev[2]):
            if prev is not None:
                self._value[key] = max(0.0, (busy - prev[1]) / (total - prev[2]))
            self._last[key] = (now, busy, total)
        return self._value.get(key)

    def machine(self) -> float | None:
        """Busy fraction of all CPUs together (0..1)."""
        ticks = _cpu_ticks()
        if ticks is None:
            return None
        return self._rate("machine", time.monotonic(), *ticks)

    def process(self, pid: int) -> float | None:
        """CPUs the process kept busy (1.0: one core all the time)."""
        cpu = process_cpu_s(pid)
        if cpu is None:
            return None
        now = time.monotonic()
        return self._rate(("pid", pid), now, cpu, now)

    def forget_except(self, pids: set[int]) -> None:
        """Drop the samples of processes no longer shown (workers come and go)."""
        for key in [k for k in self._last if isinstance(k, tuple) and k[1] not in pids]:
            self._last.pop(key, None)
            self._value.pop(key, None)


# ---------------------------------------------------------------------- the snapshot
@dataclass
class SessionView:
    session_id: str
    user: str | None  # None: not shown to this viewer
    state: str
    here: bool  # its engine runs on (or is held by) this gateway
    engine: str | None  # local:PID, ray:NAME
    activity: str  # what it does now: an op, "idle", "saved (resumes on its next request)"
    field_bytes: int
    rss: int | None
    cpu: float | None
    launches: int | None
    created: float
    last_activity: float
    resources: dict | None


@dataclass
class JobView:
    job_id: str
    session_id: str
    user: str | None
    state: str
    done: int
    total: int
    created: float
    started: float | None
    finished: float | None
    here: bool

    @property
    def fraction(self) -> float:
        return self.done / self.total if self.total else 0.0

    @property
    def elapsed(self) -> float | None:
        if self.started is None:
            return None
        return (self.finished or time.time()) - self.started

    @property
    def eta(self) -> float | None:
        """Seconds left at the pace so far (ops differ in cost: an estimate)."""
        if self.state != "running" or not self.done or self.elapsed is None:
            return None
        return self.elapsed / self.done * (self.total - self.done)


@dataclass
class Usage:
    user: str
    sessions: int
    field_bytes: int
    job_seconds: float
    scratch_bytes: int = 0  # the engines' scratch memory, counted in the same quota


@dataclass
class Snapshot:
    viewer: str
    admin: bool
    now: float
    version: str
    python: str
    gateway_id: str
    uptime_s: float
    database: str
    arch: str
    cluster: str | None
    cpus: int
    loadavg: tuple[float, float, float] | None
    cpu_busy: float | None
    mem_total: int | None
    mem_available: int | None
    gateway_rss: int | None
    sessions: list[SessionView]
    jobs: list[JobView]
    usage: list[Usage]
    limits: dict[str, float]
    queued: int  # jobs waiting, all users, all gateways
    running_jobs: int
    job_concurrency: int
    cache_hits: int
    cache_misses: int
    compile_s: float
    launches: int
    others: dict[str, int] = field(default_factory=dict)  # what a user sees of the rest

    @property
    def hit_rate(self) -> float | None:
        n = self.cache_hits + self.cache_misses
        return self.cache_hits / n if n else None


def _activity(live, row) -> str:
    if row["state"] == "culled":
        return "saved (resumes on its next request)"
    if live is None:
        return "on another gateway" if row["gateway"] else "starting"
    w = live.worker
    if w is None:
        return "starting"
    if w.gone is not None:
        return "engine lost"
    if w.current:
        return f"running {w.current}"
    return "busy" if w.lock.locked() else "idle"


async def snapshot(service, user) -> Snapshot:
    """Everything the page shows to ``user`` (see the module's docstring for who sees what)."""
    settings = service.settings
    admin = user.name in settings.admins
    await service.refresh_all_stats()
    db = service.db
    owner = None if admin else user.id
    sampler: CpuSampler = service.cpu_sampler
    shown_pids: set[int] = set()

    sessions = []
    for row in db.status_sessions(owner):
        live = service.sessions.live.get(row["id"])
        worker = live.worker if live is not None else None
        pid = getattr(worker, "pid", None) if worker is not None and worker.gone is None \
            else None
        if pid is not None:
            shown_pids.add(pid)
        resources = json.loads(row["resources"]) if row["resources"] else None
        sessions.append(SessionView(
            session_id=row["id"], user=row["user_name"], state=row["state"],
            here=live is not None, engine=row["worker"], activity=_activity(live, row),
            field_bytes=int(row["field_bytes"]),
            rss=process_rss(pid) if pid is not None else None,
            cpu=sampler.process(pid) if pid is not None else None,
            launches=worker.stats.launches if worker is not None else None,
            created=row["created"], last_activity=max(
                row["last_activity"], live.last_activity if live is not None else 0.0),
            resources=resources))
    sampler.forget_except(shown_pids)

    jobs = []
    for row in db.status_jobs(owner):
        job = service.jobs.active.get((row["owner"], row["id"]))
        jobs.append(JobView(
            job_id=row["id"], session_id=row["session"], user=row["user_name"],
            state=job.state if job is not None else row["state"],
            done=job.done if job is not None else int(row["done"]), total=int(row["total"]),
            created=row["created"], started=row["started"], finished=row["finished"],
            here=job is not None or row["state"] in TERMINAL))

    usage = [Usage(r["name"], int(r["sessions"]), int(r["field_bytes"]),
                   float(r["job_seconds"]), int(r["scratch_bytes"])) for r in db.usage(owner)]
    counts = db.execute("SELECT state, COUNT(*) AS n FROM jobs WHERE state IN ('queued', "
                        "'running') GROUP BY state")
    by_state = {r["state"]: int(r["n"]) for r in counts}
    others: dict[str, int] = {}
    if not admin:
        everyone = db.status_sessions()
        rest = [r for r in everyone if r["owner"] != user.id]
        others = {"sessions": len(rest), "users": len({r["owner"] for r in rest}),
                  "field_bytes": sum(int(r["field_bytes"]) for r in rest)}

    totals = service.metrics.totals()
    mem = _meminfo()
    try:
        loadavg = os.getloadavg()
    except OSError:
        loadavg = None
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return Snapshot(
        viewer=user.name, admin=admin, now=time.time(), version=__version__,
        python=f"{platform.python_implementation()} {sys.version.split()[0]}",
        gateway_id=service.gateway_id, uptime_s=time.monotonic() - service.started,
        database=db.backend, arch=settings.arch, cluster=settings.cluster, cpus=cpus,
        loadavg=loadavg, cpu_busy=sampler.machine(), mem_total=mem.get("MemTotal"),
        mem_available=mem.get("MemAvailable"), gateway_rss=process_rss(os.getpid()),
        sessions=sessions, jobs=jobs, usage=usage,
        limits={"sessions": settings.quota_sessions,
                "field_bytes": settings.quota_field_bytes,
                "job_seconds": settings.quota_job_seconds},
        queued=by_state.get("queued", 0), running_jobs=by_state.get("running", 0),
        job_concurrency=settings.job_concurrency, cache_hits=totals.cache_hits,
        cache_misses=totals.cache_misses, compile_s=totals.compile_s,
        launches=totals.launches, others=others)
