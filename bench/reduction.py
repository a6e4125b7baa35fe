"""Global reduction: ``L[None] += 0.5 * (x[i] - y[i]) ** 2`` over 2**24 f32.

Measures how a backend lowers a parallel accumulation into one scalar (atomics versus
thread-local partial sums), and how accurate the f32 result is against an exact sum.
"""

import argparse
import math
import sys
from typing import Any

import common
import numpy as np

NAME = "reduction"
N = 2**24


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return rng.random(N, dtype=np.float32), rng.random(N, dtype=np.float32)


def exact_sum(xs: np.ndarray, ys: np.ndarray) -> float:
    """Correctly rounded sum of the f32 terms, each computed in f32 exactly as the kernel does."""
    d = xs - ys
    terms = np.float32(0.5) * (d * d)
    assert terms.dtype == np.float32
    return math.fsum(terms.tolist())


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Time one launch (accumulator reset outside the clock), then check L against fsum."""
    # Import and init first so a backend that cannot start fails before the slow set-up.
    ti = None if args.backend == "numpy" else common.load_backend(args.backend)
    if ti is not None:
        common.init(ti)
    xs, ys = _data()
    judge = dict(exact=exact_sum(xs, ys), label="L", reference="fsum", n=N)
    if ti is None:
        box = [0.0]

        def step_np() -> None:
            d = xs - ys
            box[0] = float(np.sum(np.float32(0.5) * (d * d), dtype=np.float32))

        return common.scalar_result(NAME, args.backend, args, step_np, lambda: box[0],
                                    sync=lambda: None, **judge)

    x = ti.field(ti.f32, shape=N)
    y = ti.field(ti.f32, shape=N)
    L = ti.field(ti.f32, shape=())

    @ti.kernel
    def loss():
        for i in x:
            L[None] += 0.5 * (x[i] - y[i]) ** 2

    def reset() -> None:
        L[None] = 0.0

    x.from_numpy(xs)
    y.from_numpy(ys)
    return common.scalar_result(NAME, args.backend, args, loss, lambda: L[None],
                                sync=ti.sync, setup=reset, **judge)


if __name__ == "__main__":
    ns = common.parser(__doc__.splitlines()[0], repeat=10).parse_args()
    sys.exit(common.main(NAME, run, ns))
