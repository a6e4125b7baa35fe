"""Graphs: the DiffTaichi-style MPM optimisation iteration eager vs captured and replayed.

The iteration is bench/diffmpm.py's (zero the grid, a ``ti.ad.Tape`` over the 64-step
rollout, back-propagation) with the gradient step as a kernel (``init_v -= lr * grad``), so
the whole iteration is device work: ~380 launches. difftape runs it eagerly and as a graph
(``ti.graph.capture()``, then ``g.replay()``); Taichi 1.7.4 runs it eagerly (its
``ti.graph`` cannot hold a Tape). Each is timed twice: on the machine as it is, and with a
process spinning on core 1 (``taskset -c 1``), which is what a shared lab machine looks like.
The Taichi backend reports its eager time under the "replayed" labels too, so the runner's
ratio column reads replayed / Taichi.

Replay overhead per captured launch: a graph of ``--launches`` launches of a one-statement
serial kernel, replayed; difftape's graph against Taichi's ``GraphBuilder`` graph of the same
launches (``run``). The notes give the load average at start and the eager launch cost.

``--arch cuda`` runs the same on a CUDA device (``ti.init(arch=ti.cuda,
enable_fallback=False)``): difftape's replay is then CUDA graphs (runtime/gridgraph.py, one
executable per run of asynchronous launches, instantiated once; the notes give how many and
how many launches stay host steps), Taichi's eager iteration runs on its CUDA backend. Not run
on a device yet: no GPU was lent to the session that wrote it.
"""

import argparse
import os
import shutil
import subprocess
import sys
import time
from typing import Any

import common
import diffmpm

NAME = "graph"


class Spinner:
    """A busy loop pinned to core 1 (``taskset -c 1``) while the block runs."""

    def __enter__(self) -> "Spinner":
        cmd = [sys.executable, "-c", "while True: pass"]
        if shutil.which("taskset"):
            cmd = ["taskset", "-c", "1", *cmd]
        self.proc = subprocess.Popen(cmd)
        time.sleep(0.5)
        return self

    def __exit__(self, *exc) -> None:
        self.proc.kill()
        self.proc.wait()


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.backend == "numpy":
        raise common.Unsupported("no numpy version: there is no kernel launch to measure")
    load = os.getloadavg()
    ti = common.load_backend(args.backend)
    if args.arch == "cuda":
        ti.init(arch=ti.cuda, **({"enable_fallback": False} if args.backend == "difftape"
                                 else {}))
    else:
        common.init(ti)
    m = diffmpm.build(ti)
    iteration = m.device_iteration
    m.start()
    iteration()  # compiles every kernel and adjoint
    ti.sync()
    rows, extra = [], {}
    runs = {"eager": iteration}
    graph = None
    if args.backend == "difftape":
        with ti.graph.capture() as graph:
            iteration()
        runs["replayed"] = graph.replay
        extra["graph_launches"] = graph.launches
        graph.replay()  # (instantiated at the first replay, on a grid)
        ti.sync()
    timings = {}
    for where, spin in (("quiet", False), ("core 1 busy", True)):
        ctx = Spinner() if spin else _Nothing()
        with ctx:
            for label, fn in runs.items():
                t = common.time_it(fn, repeat=args.repeat, warmup=args.warmup, sync=ti.sync)
                timings[(label, where)] = t.median
    for where in ("quiet", "core 1 busy"):
        for label in ("eager", "replayed"):
            value = timings.get((label, where), timings[("eager", where)])
            rows.append({"label": f"{NAME}: MPM iteration, {label} ({where})",
                         "value": value * 1e3, "unit": "ms"})
    per_launch, eager_launch = launch_overhead(ti, args.launches, args.repeat)
    rows.append({"label": f"{NAME}: replay overhead per captured launch", "value": per_launch,
                 "unit": "us"})
    if args.arch != "cpu":
        for row in rows:
            row["label"] += f" [{args.arch}]"
    notes = (f"load average at start {load[0]:.2f}; eager launch {eager_launch:.2f} us; "
             f"{args.launches} launches per overhead graph")
    if args.backend == "difftape":
        notes += (f"; {graph.launches} launches per iteration; replayed/eager "
                  f"{timings[('replayed', 'quiet')] / timings[('eager', 'quiet')]:.2f} quiet, "
                  f"{timings[('replayed', 'core 1 busy')] / timings[('eager', 'core 1 busy')]:.2f}"
                  " core 1 busy")
        gg = graph._grid_graph
        if gg is not None:
            hosts = sum(isinstance(p, tuple) for p in gg.parts)
            notes += (f"; {gg.instantiations} graph executables for {len(gg.parts) - hosts} "
                      f"device segments, {gg.updates} updates, {hosts} host-step launches")
    else:
        notes += "; Taichi: the replayed rows are its eager iteration (ti.graph holds no Tape)"
    return common.result(NAME, args.backend, rows=rows, notes=notes, load_average=load,
                         timings={f"{a} ({b})": v for (a, b), v in timings.items()},
                         per_launch_us=per_launch, eager_launch_us=eager_launch, **extra)


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None


def launch_overhead(ti, launches: int, repeat: int) -> tuple[float, float]:
    """Microseconds per launch of a one-statement kernel: replayed from a graph of
    ``launches`` launches (difftape: capture; Taichi: GraphBuilder), and launched eagerly."""
    s = ti.field(ti.f32, shape=())

    @ti.kernel
    def tiny(a: ti.f32):
        s[None] += a

    def eager() -> None:
        for _ in range(launches):
            tiny(1.0)

    t_eager = common.time_it(eager, repeat=repeat, warmup=1, sync=ti.sync)
    if hasattr(ti.graph, "capture"):  # difftape
        with ti.graph.capture() as g:
            for _ in range(launches):
                tiny(1.0)
        replay = g.replay
    else:  # Taichi's graph: the kernel's argument as a graph argument
        builder = ti.graph.GraphBuilder()
        a = ti.graph.Arg(ti.graph.ArgKind.SCALAR, "a", ti.f32)
        for _ in range(launches):
            builder.dispatch(tiny, a)
        tg = builder.compile()

        def replay() -> None:
            tg.run({"a": 1.0})
    s[None] = 0.0
    t = common.time_it(replay, repeat=repeat, warmup=1, sync=ti.sync)
    total = float(s[None])
    want = float(launches * (repeat + 1))
    if total != want:
        raise RuntimeError(f"the overhead graph computed {total}, expected {want}")
    return t.median / launches * 1e6, t_eager.median / launches * 1e6


if __name__ == "__main__":
    p = common.parser(__doc__.splitlines()[0], repeat=7, warmup=2)
    p.add_argument("--launches", type=int, default=10_000, help="launches in the overhead graph")
    p.add_argument("--arch", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: on a CUDA device (difftape replays CUDA graphs)")
    sys.exit(common.main(NAME, run, p.parse_args()))
