"""2-D N-body potential energy, N=1024, over all ``ti.ndrange(N, N)`` pairs.

Measures a compute-bound 2-D parallel loop with small vectors (``ti.Vector.field``),
``norm(eps)`` and a contended scalar accumulation into a 0-D field.
"""

import argparse
import sys
from typing import Any

import common
import numpy as np

NAME = "nbody"
N = 1024
EPS = 1e-3


def _data() -> np.ndarray:
    return np.random.default_rng(2).random((N, 2), dtype=np.float32)


def reference_energy(pos: np.ndarray) -> float:
    """The same energy in float64 from the same f32 positions, for the accuracy note."""
    p = pos.astype(np.float64)
    r = p[:, None, :] - p[None, :, :]
    return float(np.sum(-1.0 / np.sqrt(np.sum(r * r, axis=-1) + EPS)))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Time one launch of the all-pairs energy kernel (U reset outside the clock)."""
    # Import and init first so a backend that cannot start fails before the slow set-up.
    ti = None if args.backend == "numpy" else common.load_backend(args.backend)
    if ti is not None:
        common.init(ti)
    ps = _data()
    judge = dict(exact=reference_energy(ps), label="U", reference="f64", n=N)
    if ti is None:
        box = [0.0]

        def energy_np() -> None:
            r = ps[:, None, :] - ps[None, :, :]
            inv = np.float32(-1.0) / np.sqrt(np.sum(r * r, axis=-1) + np.float32(EPS))
            box[0] = float(np.sum(inv, dtype=np.float32))

        return common.scalar_result(NAME, args.backend, args, energy_np, lambda: box[0],
                                    sync=lambda: None, **judge)

    x = ti.Vector.field(2, ti.f32, N)
    U = ti.field(ti.f32, ())

    @ti.kernel
    def energy():
        for i, j in ti.ndrange(N, N):
            r = x[i] - x[j]
            U[None] += -1 / r.norm(1e-3)

    def reset() -> None:
        U[None] = 0.0

    x.from_numpy(ps)
    return common.scalar_result(NAME, args.backend, args, energy, lambda: U[None],
                                sync=ti.sync, setup=reset, **judge)


if __name__ == "__main__":
    ns = common.parser(__doc__.splitlines()[0], repeat=10).parse_args()
    sys.exit(common.main(NAME, run, ns))
