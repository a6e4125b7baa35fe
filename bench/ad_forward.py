"""Forward mode and second order against the primal, in the same process.

In-run ratios (the issue's bars): a forward-mode pass (value and tangent in one kernel)
over the primal kernel, on the elementwise map ``y[i] = sin(x[i]) * x[i]`` (2**24 f32; also
with 16 sines per element, where arithmetic rather than memory traffic dominates) and the
N-body energy (N=1024, all pairs, ``U += -1 / r.norm(1e-3)``); and a Hessian-vector product of
the N-body energy (``ti.ad.hvp``: forward pass + forward-over-reverse adjoint) over a primal +
reverse pass (``ti.ad.Tape``). The map is memory-bound, and its forward pass moves twice the
bytes (x, x.dual in; y, y.dual out), so it is also compared with a kernel that only moves four
such arrays (``map_forward_over_4_array_floor``). With Taichi as the peer only the primal and
Tape rows run there
(its FwdMode seeds from a Python list and takes only scalar fields as ``param``; it has no
Hessian-vector products), so the peer column shows where difftape's primal stands.
"""

import argparse
import sys
from typing import Any

import common
import numpy as np

NAME = "ad_forward"
N_MAP = 2**24
N_BODY = 1024


def _forward_mode():
    """difftape's forward-mode context (FwdMode without copying a seed inside the clock)."""
    from difftape.ad.functional import forward_mode

    return forward_mode()


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.backend == "numpy":
        raise common.Unsupported("no numpy version: there is no autodiff to measure")
    ti = common.load_backend(args.backend)
    common.init(ti)
    timing = dict(repeat=args.repeat, warmup=args.warmup, sync=ti.sync)
    rows = []
    extra: dict[str, Any] = {}

    # --- elementwise map
    x = ti.field(ti.f32, shape=N_MAP, needs_dual=True)
    y = ti.field(ti.f32, shape=N_MAP, needs_dual=True)

    @ti.kernel
    def step():
        for i in x:
            y[i] = ti.sin(x[i]) * x[i]

    xs = np.random.default_rng(0).uniform(-4.0, 4.0, N_MAP).astype(np.float32)
    x.from_numpy(xs)
    x.dual.fill(1.0)

    def step_fwd() -> None:
        with _forward_mode():
            step()

    # The forward pass moves twice the bytes (x, x.dual in; y, y.dual out): a kernel that only
    # moves those four arrays is the floor it can be compared with.
    x2 = ti.field(ti.f32, shape=N_MAP)
    y2 = ti.field(ti.f32, shape=N_MAP)
    # Written once, as x is: a page never written reads as the operating system's shared zero
    # page, which stays in cache, and the floor would move three arrays, not four.
    x2.from_numpy(xs)
    y2.from_numpy(xs)

    @ti.kernel
    def move4():
        for i in x:
            y[i] = x[i] * 2.0
            y2[i] = x2[i] * 2.0

    t_p = common.time_it(step, **timing).median
    if ti.__name__ == "difftape":
        t_m = common.time_it(move4, **timing).median
        extra["map_forward_over_4_array_floor"] = None  # filled below
        rows.append({"label": "map: 2 in / 2 out arrays, no math", "value": t_m * 1e3,
                     "unit": "ms"})
        t_f = common.time_it(step_fwd, **timing).median
        extra["map_forward_over_4_array_floor"] = t_f / t_m
        err = float(np.max(np.abs(y.dual.to_numpy().astype(np.float64)
                                  - (np.cos(xs.astype(np.float64)) * xs + np.sin(xs)))))
        extra["map_forward_over_primal"] = t_f / t_p
        extra["map_tangent_max_abs_err"] = err
        rows.append({"label": "map forward pass", "value": t_f * 1e3, "unit": "ms"})
    rows.insert(0, {"label": "map primal", "value": t_p * 1e3, "unit": "ms"})

    # The same map with 16 sines per element: arithmetic, not memory traffic, dominates.
    @ti.kernel
    def step16():
        for i in x:
            acc = 0.0
            for r in ti.static(range(16)):
                acc += ti.sin(x[i] + r * 1e-3) * x[i]
            y[i] = acc

    def step16_fwd() -> None:
        with _forward_mode():
            step16()

    t_p16 = common.time_it(step16, **timing).median
    rows.append({"label": "map, 16 sines per element: primal", "value": t_p16 * 1e3,
                 "unit": "ms"})
    if ti.__name__ == "difftape":
        t_f16 = common.time_it(step16_fwd, **timing).median
        rows.append({"label": "map, 16 sines per element: forward pass", "value": t_f16 * 1e3,
                     "unit": "ms"})
        extra["map16_forward_over_primal"] = t_f16 / t_p16

    # --- N-body energy, in a program of its own (a Tape or hvp clears every field's
    # derivatives, and the map's 2**24-element arrays would dominate that)
    common.init(ti)
    X = ti.Vector.field(2, dtype=ti.f32, shape=N_BODY, needs_grad=True, needs_dual=True)
    U = ti.field(dtype=ti.f32, shape=(), needs_grad=True, needs_dual=True)

    @ti.kernel
    def energy():
        for i, j in ti.ndrange(N_BODY, N_BODY):
            r = X[i] - X[j]
            U[None] += -1 / r.norm(1e-3)

    X.from_numpy(np.random.default_rng(2).random((N_BODY, 2), dtype=np.float32))
    v = np.random.default_rng(3).uniform(-1, 1, (N_BODY, 2))

    def reset() -> None:
        U[None] = 0.0

    def energy_tape() -> None:
        with ti.ad.Tape(loss=U):
            energy()

    t_e = common.time_it(energy, setup=reset, **timing).median
    t_r = common.time_it(energy_tape, **timing).median
    rows += [{"label": "nbody primal", "value": t_e * 1e3, "unit": "ms"},
             {"label": "nbody primal + reverse (Tape)", "value": t_r * 1e3, "unit": "ms"}]
    if ti.__name__ == "difftape":
        X.dual.from_numpy(v.astype(np.float32))

        def energy_fwd() -> None:
            with _forward_mode():
                energy()

        def hvp() -> None:
            ti.ad.hvp(energy, U, X, v)

        t_ef = common.time_it(energy_fwd, setup=reset, **timing).median
        t_h = common.time_it(hvp, **timing).median
        rows += [{"label": "nbody forward pass", "value": t_ef * 1e3, "unit": "ms"},
                 {"label": "nbody Hessian-vector product", "value": t_h * 1e3, "unit": "ms"}]
        extra["nbody_forward_over_primal"] = t_ef / t_e
        extra["hvp_over_primal_plus_reverse"] = t_h / t_r
    notes = ", ".join(f"{k} {v:.3g}" for k, v in extra.items())
    return common.result(NAME, args.backend, rows=rows, notes=notes, **extra)


if __name__ == "__main__":
    ns = common.parser(__doc__.splitlines()[0], repeat=10).parse_args()
    sys.exit(common.main(NAME, run, ns))
