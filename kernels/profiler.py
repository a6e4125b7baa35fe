"""``ti.profiler``: per-kernel launch times, recorded under ``ti.init(kernel_profiler=True)``.

Every launch of a compiled kernel (its primal, ``.grad`` and forward-mode variants, named
``k``, ``k_grad``, ``k_fwd``) is timed on the host around the whole launch, all of its
parallel tasks included, since kernels run synchronously. Times are in milliseconds as in
Taichi; ``ti.init`` starts with no records.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from .runtime import program

__all__ = ["KernelProfilerQueryResult", "clear_kernel_profiler_info",
           "get_kernel_profiler_total_time", "print_kernel_profiler_info",
           "query_kernel_profiler_info"]


@dataclass
class KernelProfilerQueryResult:
    """Launch statistics of one kernel: ``counter`` launches, ``min``/``max``/``avg`` in ms."""

    counter: int = 0
    min: float = 0.0
    max: float = 0.0
    avg: float = 0.0


def _records() -> list[tuple[str, float, float]] | None:
    """(kernel name, start time in s, duration in ms) of every launch; None (with Taichi's
    warning) when the profiler is off."""
    prog = program.get()
    if not prog.config.kernel_profiler:
        warnings.warn("difftape: use ti.init(kernel_profiler=True) to turn on the kernel "
                      "profiler", stacklevel=3)
        return None
    return prog.profile


def _statistics(records) -> dict[str, KernelProfilerQueryResult]:
    stats: dict[str, KernelProfilerQueryResult] = {}
    totals: dict[str, float] = {}
    for name, _, ms in records:
        s = stats.get(name)
        if s is None:
            s = stats[name] = KernelProfilerQueryResult(0, ms, ms, 0.0)
            totals[name] = 0.0
        s.counter += 1
        s.min, s.max = min(s.min, ms), max(s.max, ms)
        totals[name] += ms
    for name, s in stats.items():
        s.avg = totals[name] / s.counter
    return dict(sorted(stats.items(), key=lambda kv: -kv[1].avg * kv[1].counter))


def query_kernel_profiler_info(name: str) -> KernelProfilerQueryResult | None:
    """Launch count and min/avg/max time (ms) of the kernel called ``name`` (all zero if it
    never ran)."""
    records = _records()
    if records is None:
        return None
    return _statistics(r for r in records if r[0] == name).get(name,
                                                                 KernelProfilerQueryResult())


def get_kernel_profiler_total_time() -> float:
    """Seconds spent in all recorded launches."""
    records = _records()
    return 0.0 if records is None else sum(r[2] for r in records) / 1000.0


def clear_kernel_profiler_info() -> None:
    """Drop the records so far."""
    records = _records()
    if records is not None:
        records.clear()


def print_kernel_profiler_info(mode: str = "count") -> None:
    """Print a table per kernel (``mode="count"``) or one line per launch (``"trace"``)."""
    if mode not in ("count", "trace"):
        raise ValueError("mode must be 'count' or 'trace'")
    records = _records()
    if records is None:
        return
    if mode == "trace":
        header = "[  start.time | kernel.time ] Kernel name"
        lines = []
        t0 = records[0][1] if records else 0.0
        for name, start, ms in records:
            lines.append(f"[{(start - t0) * 1000:9.3f} ms |{ms:9.3f} ms ] {name}")
        footer = f"Number of records: {len(records)}"
    else:
        header = "[      %     total   count |      min       avg       max   ] Kernel name"
        total_ms = sum(r[2] for r in records)
        lines = []
        for name, s in _statistics(records).items():
            share = s.avg * s.counter / total_ms * 100.0 if total_ms else 0.0
            lines.append(f"[{share:6.2f}% {s.avg * s.counter / 1000:7.3f} s {s.counter:6d}x |"
                         f"{s.min:9.3f} {s.avg:9.3f} {s.max:9.3f} ms] {name}")
        footer = (f"[100.00%] Total execution time: {total_ms / 1000:7.3f} s   "
                  f"number of results: {len(lines)}")
    title = f"Kernel Profiler({mode}) @ CPU"
    width = max(len(header), len(title))
    print("\n".join(["=" * width, title, "=" * width, header, "-" * width, *lines,
                     "-" * width, footer, "=" * width]))
