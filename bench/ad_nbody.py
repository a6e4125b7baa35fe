"""Autodiff gravity (the guide's case study), 2-D, N=1024: one ``substep()``.

``substep()`` is ``with ti.ad.Tape(U): compute_U()`` followed by ``advance()``: the tape
clears ``x.grad`` and ``U``, runs the all-pairs energy ``U[None] += -1 / r.norm(1e-3)`` over
``ti.ndrange(N, N)``, then its adjoint, which scatters the force of every pair into
``x.grad`` with atomics; ``advance()`` then integrates ``v -= dt * x.grad``, ``x += dt * v``.
Measures reverse-mode code for a compute-bound 2-D loop with a contended 0-D accumulation.
"""

import argparse
import sys
from typing import Any

import common
import numpy as np

NAME = "ad_nbody"
N = 1024
EPS = 1e-3
DT = 1e-5


def _data() -> np.ndarray:
    return np.random.default_rng(2).random((N, 2), dtype=np.float32)


def reference_grad(pos: np.ndarray) -> np.ndarray:
    """dU/dx_k = 2 * sum_j (x_k - x_j) / (|x_k - x_j|^2 + eps)^1.5, in float64."""
    p = pos.astype(np.float64)
    r = p[:, None, :] - p[None, :, :]
    s = np.sum(r * r, axis=-1) + EPS
    return 2.0 * np.sum(r / (s * np.sqrt(s))[:, :, None], axis=1)


def _accuracy(grad: np.ndarray, exact: np.ndarray, value: float) -> tuple[float, str]:
    rel = float(np.linalg.norm(grad.astype(np.float64) - exact) / np.linalg.norm(exact))
    return rel, f"first substep: U={value:.7g}, x.grad rel err (2-norm) vs analytic f64 {rel:.1e}"


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Check the first substep's x.grad (untimed), then time further substeps."""
    if args.backend == "numpy":
        raise common.Unsupported("no numpy version: there is no autodiff to measure")
    ti = common.load_backend(args.backend)
    common.init(ti)
    ps = _data()
    exact = reference_grad(ps)

    x = ti.Vector.field(2, dtype=ti.f32, shape=N, needs_grad=True)  # positions
    v = ti.Vector.field(2, dtype=ti.f32, shape=N)  # velocities
    U = ti.field(dtype=ti.f32, shape=(), needs_grad=True)  # potential energy

    @ti.kernel
    def compute_U():
        for i, j in ti.ndrange(N, N):
            r = x[i] - x[j]
            U[None] += -1 / r.norm(1e-3)

    @ti.kernel
    def advance():
        for i in x:
            v[i] += DT * -x.grad[i]
        for i in x:
            x[i] += DT * v[i]

    def substep() -> None:
        with ti.ad.Tape(loss=U):
            compute_U()
        advance()

    x.from_numpy(ps)
    with ti.ad.Tape(loss=U):  # the first substep, split so x.grad can be checked
        compute_U()
    value = float(U[None])
    rel, notes = _accuracy(x.grad.to_numpy(), exact, value)
    advance()
    t = common.time_it(substep, repeat=args.repeat, warmup=args.warmup, sync=ti.sync)
    return common.result(
        NAME,
        args.backend,
        seconds=t.median,
        notes=notes,
        timing=t.as_dict(),
        rel_err=rel,
        value=value,
        n=N,
    )


if __name__ == "__main__":
    ns = common.parser(__doc__.splitlines()[0], repeat=10).parse_args()
    sys.exit(common.main(NAME, run, ns))
