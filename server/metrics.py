"""Prometheus metrics. A registry per app (tests build several apps in one process).

Compile-cache figures live in the workers; the gateway asks each idle worker for its
``stats`` at scrape time and keeps the last figures of stopped workers, so the counters stay
monotonic across culling, crashes and deletions.

Every user's token may read /metrics, so it shows figures over the whole server only: no
session ids, user names or kernel names (one user must not learn another's sessions).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .worker import CODE_LOADS, WorkerStats


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.latency = Histogram(
            "difftape_http_request_duration_seconds", "HTTP request latency",
            ["method", "route", "status"], registry=self.registry,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5,
                     10, 30, 60))
        self.launches = Counter("difftape_kernel_launches", "kernel launches run",
                                ["variant"], registry=self.registry)
        # Label lookups cost more than the increment: the batch path counts through these.
        self.launch_counters = {v: self.launches.labels(v) for v in
                                ("primal", "grad", "fwd", "grad_fwd", "fwd_const")}
        self.bytes_moved = Counter("difftape_bytes_moved", "field bytes moved over HTTP",
                                   ["direction"], registry=self.registry)
        self.jobs = Counter("difftape_jobs_finished", "jobs finished", ["state"],
                            registry=self.registry)
        self.workers_lost = Counter("difftape_workers_lost", "worker processes that died or "
                                    "were killed", registry=self.registry)
        self.checkpoints = Counter("difftape_session_checkpoints", "sessions' fields saved "
                                   "so that they survive their engine "
                                   "(DIFFTAPE_CHECKPOINT_S)", registry=self.registry)
        self.scratch_asks = Counter("difftape_scratch_asks", "engines' asks for more of "
                                    "their user's memory quota for scratch memory (stack "
                                    "pools, print buffers...), by outcome", ["outcome"],
                                    registry=self.registry)
        self.scratch_grants = self.scratch_asks.labels("granted")
        self.scratch_refusals = self.scratch_asks.labels("refused")
        self.queue_depth = Gauge("difftape_job_queue_depth", "jobs waiting to run",
                                 ["device"], registry=self.registry)
        self.retired = WorkerStats()
        self.sessions = None  # set by the app: SessionManager
        self.registry.register(_WorkerCollector(self))

    def retire(self, stats: WorkerStats) -> None:
        r = self.retired
        r.launches += stats.launches
        r.cache_hits += stats.cache_hits
        r.cache_misses += stats.cache_misses
        r.compile_s += stats.compile_s
        for k in CODE_LOADS:
            r.code_loads[k] = r.code_loads.get(k, 0) + stats.code_loads.get(k, 0)

    def totals(self) -> Totals:
        """Counters summed over live workers' last stats plus retired ones."""
        r = self.retired
        t = Totals(r.launches, r.cache_hits, r.cache_misses, r.compile_s,
                   code_loads={k: r.code_loads.get(k, 0) for k in CODE_LOADS})
        live = list(self.sessions.live.values()) if self.sessions is not None else []
        for e in live:
            if e.worker is None:
                continue
            s = e.worker.stats
            t.launches += s.launches
            t.cache_hits += s.cache_hits
            t.cache_misses += s.cache_misses
            t.compile_s += s.compile_s
            t.field_bytes += s.field_bytes
            t.scratch_bytes += s.scratch_bytes
            t.scratch_granted += s.scratch_granted
            t.running += 1
            for k in CODE_LOADS:
                t.code_loads[k] += s.code_loads.get(k, 0)
            if s.device is not None:
                t.device_bytes += int(s.device.get("program_bytes", 0))
                t.device = s.device  # the device's own figures: the latest report
        return t


@dataclass
class Totals:
    """The workers' counters over the whole server: live workers' last stats plus retired
    ones (what /metrics and the status page show)."""

    launches: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    compile_s: float = 0.0
    field_bytes: int = 0
    scratch_bytes: int = 0  # scratch memory the running engines hold
    scratch_granted: int = 0  # ... and the users' quotas reserve for them
    running: int = 0  # sessions with a running worker
    # CUDA: module loads by kind (worker.CODE_LOADS), device memory the running sessions
    # hold (fields and scratch), and the device as a running worker last reported it
    code_loads: dict[str, int] = field(default_factory=dict)
    device_bytes: int = 0
    device: dict | None = None


class _WorkerCollector:
    """Counters summed over live workers' last stats plus retired ones."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics

    def describe(self):
        return []

    def collect(self):
        t = self.m.totals()
        yield CounterMetricFamily("difftape_compile_cache_hits", "compiled-code cache hits",
                                  value=t.cache_hits)
        yield CounterMetricFamily("difftape_compile_cache_misses", "kernels compiled by LLVM",
                                  value=t.cache_misses)
        yield CounterMetricFamily("difftape_compile_seconds", "time spent compiling kernels",
                                  value=t.compile_s)
        yield GaugeMetricFamily("difftape_field_bytes", "field memory of the running sessions "
                                "(all users together)", value=t.field_bytes)
        yield GaugeMetricFamily("difftape_scratch_bytes", "scratch memory the running sessions' "
                                "engines hold (stack pools, print buffers, launch contexts...)",
                                value=t.scratch_bytes)
        yield GaugeMetricFamily("difftape_scratch_reserved_bytes", "scratch memory the users' "
                                "memory quotas reserve for the running sessions",
                                value=t.scratch_granted)
        yield GaugeMetricFamily("difftape_sessions_running", "sessions with a running worker",
                                value=t.running)
        loads = CounterMetricFamily("difftape_cuda_module_loads", "CUDA modules loaded: "
                                    "cubin_cached (no LLVM, ptxas or JIT), cubin_assembled "
                                    "(ptxas ran), ptx_jit (the driver's JIT: no usable ptxas, "
                                    "see the workers' log)", labels=["how"])
        for k in CODE_LOADS:
            loads.add_metric([k], t.code_loads.get(k, 0))
        yield loads
        d = t.device
        if d is None:
            return
        labels = [str(d.get("ordinal", 0)), str(d.get("name", ""))]
        for name, doc, key in (
                ("difftape_device_memory_used_bytes", "device memory in use (every process)",
                 "memory_used"),
                ("difftape_device_memory_total_bytes", "device memory", "memory_total"),
                ("difftape_device_utilization_percent", "device utilisation (NVML)",
                 "utilization")):
            if d.get(key) is None:
                continue
            g = GaugeMetricFamily(name, doc, labels=["device", "name"])
            g.add_metric(labels, d[key])
            yield g
        yield GaugeMetricFamily("difftape_device_session_bytes", "device memory the running "
                                "sessions hold (fields and scratch)", value=t.device_bytes)
