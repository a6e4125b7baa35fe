"""The MPM optimisation iteration on a quiet machine and beside a busy process on the second core.

On a shared machine every core is contended. This runs ``diffmpm``'s optimisation iteration
(zero the grid, tape the 64-step rollout forward and backward, update ``init_v``) in rounds:
``--repeat`` iterations with the machine as it is, then ``--repeat`` with a process spinning
in a Python loop pinned to the second CPU (``taskset -c 1``, done with
``os.sched_setaffinity``), then the spinner is stopped and the next round begins. Quiet and
busy samples alternate in the same process, so a drift in the machine's own load falls on
both. Reported: the median iteration of each kind and the slowdown (busy / quiet); the
runner's ratio column compares them with the peer's, taken in the same run. Notes: the
1-minute load average at start and end (the spinner adds 1), the loss after the last
iteration (both backends run the same sequence of iterations), and, for difftape, how long
the caller of a parallel launch waited for chunks that other threads held.

No ``from __future__ import annotations`` (see launch.py).
"""

import argparse
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import common
import diffmpm

NAME = "busy"
SPIN = "while True: pass"


def second_cpu() -> int | None:
    """The CPU the spinner is pinned to: the second this process may run on (None: only one)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return cpus[1] if len(cpus) > 1 else None


def start_spinner(cpu: int | None) -> subprocess.Popen:
    """A Python process spinning forever, pinned to ``cpu`` when given."""
    code = SPIN if cpu is None else f"import os\nos.sched_setaffinity(0, {{{cpu}}})\n{SPIN}"
    return subprocess.Popen([sys.executable, "-c", code])


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.backend == "numpy":
        raise common.Unsupported("no numpy version: there is no autodiff to measure")
    ti = common.load_backend(args.backend)
    common.init(ti)
    try:
        return measure(ti, args)
    finally:
        ti.reset()


def measure(ti, args: argparse.Namespace) -> dict[str, Any]:
    sim = diffmpm.build(ti)
    sim.start()
    for _ in range(args.warmup):  # compiles every kernel and its adjoint
        sim.iteration()
        ti.sync()
    pool = _difftape_pool(ti)
    before = pool.stats() if pool is not None else None

    def samples(out: list[float]) -> None:
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            sim.iteration()
            ti.sync()
            out.append(time.perf_counter() - t0)

    cpu = second_cpu()
    quiet: list[float] = []
    busy: list[float] = []
    load_start = os.getloadavg()[0]
    for _ in range(args.rounds):
        samples(quiet)
        spinner = start_spinner(cpu)
        try:
            time.sleep(0.2)  # the spinner is running before the clock starts
            samples(busy)
        finally:
            spinner.kill()
            spinner.wait()
    load_end = os.getloadavg()[0]
    q, b = statistics.median(quiet), statistics.median(busy)
    notes = (f"{args.rounds} rounds of {args.repeat}+{args.repeat} iterations; spinner on "
             f"CPU {cpu if cpu is not None else 'any (one CPU)'}; load avg {load_start:.2f} "
             f"at start, {load_end:.2f} at end; loss={float(sim.loss[None]):.6f}")
    extra: dict[str, Any] = {}
    if pool is not None:
        after = pool.stats()
        launches = after["launches"] - before["launches"]
        sleeps = after["caller_sleeps"] - before["caller_sleeps"]
        wait = after["caller_wait_s"] - before["caller_wait_s"]
        iterations = len(quiet) + len(busy)
        notes += (f"; {launches // iterations} parallel launches per iteration, their caller "
                  f"waited {wait / iterations * 1e3:.1f} ms per iteration for chunks other "
                  f"threads held (asleep {sleeps // iterations} times)")
        extra["pool"] = {"launches": launches, "caller_sleeps": sleeps, "caller_wait_s": wait}
    rows = [
        {"label": f"{NAME}: MPM iteration, quiet", "value": q * 1e3, "unit": "ms"},
        {"label": f"{NAME}: MPM iteration, second core busy", "value": b * 1e3, "unit": "ms"},
        {"label": f"{NAME}: slowdown (busy / quiet)", "value": b / q, "unit": "x"},
    ]
    return common.result(NAME, args.backend, seconds=q, rows=rows, notes=notes,
                         quiet_s=quiet, busy_s=busy, load_start=load_start,
                         load_end=load_end, spinner_cpu=cpu, **extra)


def _difftape_pool(ti):
    """difftape's thread pool, for its counters (None on other backends)."""
    if not hasattr(ti, "DifftapeError"):
        return None
    from difftape.runtime import program

    prog = program.get()
    return prog.pool if prog.num_threads > 1 else None


if __name__ == "__main__":
    p = common.parser(__doc__.splitlines()[0], repeat=5, warmup=2)
    p.add_argument("--rounds", type=int, default=3, help="quiet/busy rounds")
    sys.exit(common.main(NAME, run, p.parse_args()))
