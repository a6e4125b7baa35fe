"""Launch overhead: a tiny kernel with one scalar argument, launched many times.

Measures the fixed per-call cost of the Python-to-kernel path (argument marshalling, cache
lookup, runtime entry), which dominates for small problems and tight Python loops.

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
    common.init(ti)
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
    notes = f"{launches} launches per sample" + ("" if last == expected else f"; WRONG s={last}")
    return common.result(
        NAME,
        args.backend,
        us=us,
        notes=notes,
        timing=t.as_dict(),
        launches=launches,
        us_min=t.min / launches * 1e6,
    )


if __name__ == "__main__":
    p = common.parser(__doc__.splitlines()[0], repeat=5, warmup=1)
    p.add_argument("--launches", type=int, default=10_000, help="launches per timed sample")
    sys.exit(common.main(NAME, run, p.parse_args()))
