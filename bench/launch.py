"""Launch overhead: a tiny kernel with one scalar argument, launched many times.

Measures the fixed per-call cost of the Python-to-kernel path (argument marshalling, cache
lookup, runtime entry), which dominates for small problems and tight Python loops.

``--simulate-grid B,T`` (difftape) launches on the simulated GPU grid instead of the CPU:
the grid launch protocol's host cost (launch contexts, the stream, sync points) with the
kernel run on the CPU; ``--arch cuda`` on a GPU. Launches are asynchronous there, so the
timed loop waits once, at the end (``ti.sync``), as a GPU program's loop would.

No ``from __future__ import annotations`` in this file (or any benchmark): it turns kernel
annotations such as ``a: ti.f32`` into strings, which Taichi 1.7.4 rejects.
"""

import argparse
import sys
from typing import Any

import common

NAME = "launch"


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Average microseconds per launch over ``--launches`` back-to-back calls."""
    if args.backend == "numpy":
        raise common.Unsupported("no numpy version: there is no kernel launch to measure")
    ti = common.load_backend(args.backend)
    options = {}
    if args.simulate_grid:
        if args.backend != "difftape":
            raise common.Unsupported("--simulate-grid is difftape's")
        options["simulate_grid"] = args.simulate_grid
    if args.arch == "cuda":
        ti.init(arch=ti.cuda, **options)
    else:
        common.init(ti, **options)
    s = ti.field(ti.f32, shape=())

    @ti.kernel
    def tiny(a: ti.f32):
        s[None] = a

    launches = args.launches

    def batch() -> None:
        for k in range(launches):
            tiny(k * 0.5)

    t = common.time_it(batch, repeat=args.repeat, warmup=args.warmup, sync=ti.sync)
    us = t.median / launches * 1e6
    last = float(s[None])
    expected = (launches - 1) * 0.5
    where = args.arch + (f", simulated grid {args.simulate_grid}" if args.simulate_grid else "")
    notes = f"{launches} launches per sample on {where}" + (
        "" if last == expected else f"; WRONG s={last}")
    return common.result(
        NAME,
        args.backend,
        us=us,
        launches_per_s=1e6 / us,
        notes=notes,
        timing=t.as_dict(),
        launches=launches,
        us_min=t.min / launches * 1e6,
    )


if __name__ == "__main__":
    p = common.parser(__doc__.splitlines()[0], repeat=5, warmup=1)
    p.add_argument("--launches", type=int, default=10_000, help="launches per timed sample")
    p.add_argument("--arch", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--simulate-grid", default="", help="difftape: launch on the simulated "
                   "GPU grid of B,T (blocks, threads)")
    sys.exit(common.main(NAME, run, p.parse_args()))
