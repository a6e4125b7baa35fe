"""Reverse-mode elementwise map: ``step.grad()`` of ``y[i] = ti.sin(x[i]) * x[i]`` over 2**24 f32.

Measures the generated adjoint kernel of a large parallel map on its own: it reads ``x`` and
``y.grad`` and accumulates ``(cos(x) * x + sin(x)) * y.grad`` into ``x.grad``. ``y.grad`` is
seeded with ones and ``x.grad`` zeroed before every repetition, outside the clock.
"""

import argparse
import sys
from typing import Any

import common
import numpy as np

NAME = "ad_elementwise"
N = 2**24


def _data() -> np.ndarray:
    return np.random.default_rng(0).uniform(-4.0, 4.0, N).astype(np.float32)


def _accuracy(x: np.ndarray, gx: np.ndarray) -> tuple[float, str]:
    """Max abs error of ``x.grad`` against d/dx (sin(x) x) = cos(x) x + sin(x) in float64."""
    x64 = x.astype(np.float64)
    ref = np.cos(x64) * x64 + np.sin(x64)
    err = float(np.max(np.abs(gx.astype(np.float64) - ref)))
    return err, f"x.grad max abs err vs analytic f64: {err:.1e}"


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Time one launch of the adjoint kernel (gradients seeded/zeroed outside the clock)."""
    if args.backend == "numpy":
        raise common.Unsupported("no numpy version: there is no autodiff to measure")
    ti = common.load_backend(args.backend)
    common.init(ti)
    xs = _data()

    x = ti.field(ti.f32, shape=N, needs_grad=True)
    y = ti.field(ti.f32, shape=N, needs_grad=True)

    @ti.kernel
    def step():
        for i in x:
            y[i] = ti.sin(x[i]) * x[i]

    def seed() -> None:
        y.grad.fill(1.0)
        x.grad.fill(0.0)

    x.from_numpy(xs)
    step()  # the forward pass once, so y holds its values as it would in real use
    t = common.time_it(step.grad, repeat=args.repeat, warmup=args.warmup, sync=ti.sync, setup=seed)
    err, notes = _accuracy(xs, x.grad.to_numpy())
    return common.result(
        NAME, args.backend, seconds=t.median, notes=notes, timing=t.as_dict(), max_abs_err=err, n=N
    )


if __name__ == "__main__":
    ns = common.parser(__doc__.splitlines()[0], repeat=10).parse_args()
    sys.exit(common.main(NAME, run, ns))
