"""Elementwise map: ``y[i] = ti.sin(x[i]) * x[i]`` over 2**24 f32.

Measures generated-code throughput of a large parallel map where launch overhead is
negligible and the cost of ``sin`` (scalar libm call or vectorised polynomial) dominates.
"""

import argparse
import sys
from typing import Any

import common
import numpy as np

NAME = "elementwise"
N = 2**24


def _data() -> np.ndarray:
    return np.random.default_rng(0).uniform(-4.0, 4.0, N).astype(np.float32)


def _accuracy(x: np.ndarray, y: np.ndarray) -> str:
    ref = np.sin(x.astype(np.float64)) * x.astype(np.float64)
    err = float(np.max(np.abs(y.astype(np.float64) - ref)))
    return f"max abs err vs f64: {err:.1e}"


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Time one launch of the map after warm-up."""
    # Import and init first so a backend that cannot start fails before the slow set-up.
    ti = None if args.backend == "numpy" else common.load_backend(args.backend)
    if ti is not None:
        common.init(ti)
    xs = _data()
    if ti is None:
        ys = np.empty_like(xs)

        def step_np() -> None:
            np.sin(xs, out=ys)
            np.multiply(ys, xs, out=ys)

        t = common.time_it(step_np, repeat=args.repeat, warmup=args.warmup, sync=lambda: None)
        return common.result(
            NAME, args.backend, seconds=t.median, notes=_accuracy(xs, ys), timing=t.as_dict(), n=N
        )

    x = ti.field(ti.f32, shape=N)
    y = ti.field(ti.f32, shape=N)

    @ti.kernel
    def step():
        for i in x:
            y[i] = ti.sin(x[i]) * x[i]

    x.from_numpy(xs)
    t = common.time_it(step, repeat=args.repeat, warmup=args.warmup, sync=ti.sync)
    return common.result(
        NAME,
        args.backend,
        seconds=t.median,
        notes=_accuracy(xs, y.to_numpy()),
        timing=t.as_dict(),
        n=N,
    )


if __name__ == "__main__":
    ns = common.parser(__doc__.splitlines()[0], repeat=10).parse_args()
    sys.exit(common.main(NAME, run, ns))
