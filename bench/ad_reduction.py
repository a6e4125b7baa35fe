"""Reverse-mode reduction: ``ti.ad.Tape(L)`` over ``L[None] += 0.5 * (x[i] - y[i]) ** 2``.

Measures a whole tape over 2**24 f32, forward plus backward, as a training loop runs it:
clearing the gradients (``x.grad``, ``L.grad``) and ``L`` on entry, the forward reduction into a 0-D
field, and on exit the adjoint kernel, which broadcasts ``L.grad`` and writes
``x.grad[i] = x[i] - y[i]``. Only ``x`` and ``L`` have gradients; ``y`` is data.
"""

import argparse
import math
import sys
from typing import Any

import common
import numpy as np

NAME = "ad_reduction"
N = 2**24


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return rng.random(N, dtype=np.float32), rng.random(N, dtype=np.float32)


def _accuracy(
    xs: np.ndarray, ys: np.ndarray, gx: np.ndarray, value: float
) -> tuple[float, float, str]:
    """Max abs error of ``x.grad`` against x - y (f64), and relative error of L against fsum."""
    ref = xs.astype(np.float64) - ys.astype(np.float64)
    err = float(np.max(np.abs(gx.astype(np.float64) - ref)))
    d = xs - ys
    exact = math.fsum((np.float32(0.5) * (d * d)).tolist())
    rel = abs(value - exact) / abs(exact)
    notes = f"x.grad max abs err vs x-y: {err:.1e}; L={value:.7g}, rel err vs fsum {rel:.1e}"
    return err, rel, notes


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Time ``with ti.ad.Tape(L): loss()`` (forward + backward), then check x.grad and L."""
    if args.backend == "numpy":
        raise common.Unsupported("no numpy version: there is no autodiff to measure")
    ti = common.load_backend(args.backend)
    common.init(ti)
    xs, ys = _data()

    x = ti.field(ti.f32, shape=N, needs_grad=True)
    y = ti.field(ti.f32, shape=N)
    L = ti.field(ti.f32, shape=(), needs_grad=True)

    @ti.kernel
    def loss():
        for i in x:
            L[None] += 0.5 * (x[i] - y[i]) ** 2

    def taped() -> None:
        with ti.ad.Tape(L):
            loss()

    x.from_numpy(xs)
    y.from_numpy(ys)
    t = common.time_it(taped, repeat=args.repeat, warmup=args.warmup, sync=ti.sync)
    value = float(L[None])
    err, rel, notes = _accuracy(xs, ys, x.grad.to_numpy(), value)
    return common.result(
        NAME,
        args.backend,
        seconds=t.median,
        notes=notes,
        timing=t.as_dict(),
        max_abs_err=err,
        rel_err=rel,
        value=value,
        n=N,
    )


if __name__ == "__main__":
    ns = common.parser(__doc__.splitlines()[0], repeat=10).parse_args()
    sys.exit(common.main(NAME, run, ns))
