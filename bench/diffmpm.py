"""Differentiable 2-D MLS-MPM (DiffTaichi diffmpm style): one optimisation iteration.

A 60x60 block of elastic particles (fixed-corotated, via ``ti.polar_decompose``) on a
128x128 grid is thrown at the floor with an initial velocity ``init_v`` and simulated for 64
steps. Every per-step quantity is indexed by the step, ``x[s, p]``, ``v[s, p]``, ``C[s, p]``,
``F[s, p]`` and also the grid, ``grid_v_in[s, i, j]`` etc., so a single ``ti.ad.Tape`` over
the whole rollout is correct without checkpointing or custom gradients. The loss is the mean
x-position at the last step; the gradient wanted is dL/d(init_v).

Reported figures: the median time of one iteration (zero the grid, tape the 64-step forward,
back-propagate through it, and a gradient-descent update of ``init_v`` from Python), and the
time of the first iteration in a fresh process with an empty offline-cache directory, which
includes compiling every forward and adjoint kernel. The notes give the loss, the gradient
and a central finite-difference check of it (f32, same backend, untimed; informative only).
"""

import argparse
import shutil
import sys
import tempfile
import time
from types import ModuleType, SimpleNamespace
from typing import Any

import common
import numpy as np

NAME = "diffmpm"

STEPS = 64  # x[0] .. x[STEPS - 1]: STEPS - 1 time steps
SIDE = 60
N_PARTICLES = SIDE * SIDE
N_GRID = 128
DX = 1.0 / N_GRID
INV_DX = float(N_GRID)
DT = 1e-3
P_VOL = 1.0
P_MASS = 1.0
E = 10.0  # diffmpm's units: mu = lambda = E
MU = E
LA = E
GRAVITY = 3.8
BOUND = 3  # grid nodes within 3 cells of a wall are boundary nodes
COEFF = 0.5  # Coulomb friction coefficient of the floor
X0 = 0.3  # lower-left corner of the block
Y0 = 0.04
SPACING = 0.5 * DX  # 2x2 particles per cell
INIT_V = (0.5, -1.0)  # initial velocity of the whole block; the optimised parameter
LR = 0.1  # gradient-descent step on init_v
FD_H = 1e-2  # central finite-difference step on each component of init_v


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure on a backend initialised with a fresh, empty offline-cache directory."""
    if args.backend == "numpy":
        raise common.Unsupported("no numpy version: there is no autodiff to measure")
    cache_dir = tempfile.mkdtemp(prefix="bench-diffmpm-cache-")
    try:
        ti = common.load_backend(args.backend)
        kwargs = common.offline_cache_kwargs(args.backend, cache_dir)
        if args.deterministic:
            if args.backend != "difftape":
                raise common.Unsupported("deterministic=True is a difftape option")
            kwargs["deterministic"] = True
        common.init(ti, **kwargs)
        try:
            return measure(ti, args)
        finally:
            # Taichi writes its offline cache when the program finalises (here, or else at
            # interpreter teardown, after any atexit handler), so finalise before removing.
            ti.reset()
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)


def build(ti: ModuleType) -> SimpleNamespace:
    """The program on an initialised backend: its fields and kernels, ``forward()`` (set
    ``init_v``'s velocity, the 63 steps, the loss; ``bench/graph.py`` captures it),
    ``iteration()`` (one optimisation iteration), ``loss_at(v0)`` (a forward rollout only) and
    ``start()`` (the initial particle state and ``init_v``, outside any clock)."""

    def vec(shape):
        return ti.Vector.field(2, dtype=ti.f32, shape=shape, needs_grad=True)

    def mat(shape):
        return ti.Matrix.field(2, 2, dtype=ti.f32, shape=shape, needs_grad=True)

    x = vec((STEPS, N_PARTICLES))  # position
    v = vec((STEPS, N_PARTICLES))  # velocity
    C = mat((STEPS, N_PARTICLES))  # APIC affine velocity
    F = mat((STEPS, N_PARTICLES))  # deformation gradient
    grid_v_in = vec((STEPS, N_GRID, N_GRID))  # momentum, then velocity after grid_op
    grid_m_in = ti.field(dtype=ti.f32, shape=(STEPS, N_GRID, N_GRID), needs_grad=True)
    grid_v_out = vec((STEPS, N_GRID, N_GRID))
    init_v = ti.Vector.field(2, dtype=ti.f32, shape=(), needs_grad=True)
    loss = ti.field(dtype=ti.f32, shape=(), needs_grad=True)

    @ti.kernel
    def set_initial():
        for p in range(N_PARTICLES):
            a = p // SIDE
            b = p % SIDE
            x[0, p] = ti.Vector([X0 + (a + 0.5) * SPACING, Y0 + (b + 0.5) * SPACING])
            C[0, p] = ti.Matrix.zero(ti.f32, 2, 2)
            F[0, p] = ti.Matrix.identity(ti.f32, 2)

    @ti.kernel
    def clear_grid():
        for s, i, j in grid_m_in:
            grid_v_in[s, i, j] = ti.Vector([0.0, 0.0])
            grid_m_in[s, i, j] = 0.0

    @ti.kernel
    def set_v():
        for p in range(N_PARTICLES):
            v[0, p] = init_v[None]

    @ti.kernel
    def p2g(f: ti.i32):
        for p in range(N_PARTICLES):
            base = ti.cast(x[f, p] * INV_DX - 0.5, ti.i32)
            fx = x[f, p] * INV_DX - ti.cast(base, ti.f32)
            w = [0.5 * (1.5 - fx) ** 2, 0.75 - (fx - 1.0) ** 2, 0.5 * (fx - 0.5) ** 2]
            new_F = (ti.Matrix.identity(ti.f32, 2) + DT * C[f, p]) @ F[f, p]
            F[f + 1, p] = new_F
            J = new_F.determinant()
            r, _ = ti.polar_decompose(new_F)
            cauchy = 2.0 * MU * (new_F - r) @ new_F.transpose() + ti.Matrix.diag(
                2, LA * (J - 1.0) * J
            )
            stress = -(DT * P_VOL * 4.0 * INV_DX * INV_DX) * cauchy
            affine = stress + P_MASS * C[f, p]
            for i in ti.static(range(3)):
                for j in ti.static(range(3)):
                    dpos = (ti.Vector([float(i), float(j)]) - fx) * DX
                    weight = w[i][0] * w[j][1]
                    gi = base[0] + i
                    gj = base[1] + j
                    grid_v_in[f, gi, gj] += weight * (P_MASS * v[f, p] + affine @ dpos)
                    grid_m_in[f, gi, gj] += weight * P_MASS

    @ti.kernel
    def grid_op(f: ti.i32):
        for i, j in ti.ndrange(N_GRID, N_GRID):
            inv_m = 1.0 / (grid_m_in[f, i, j] + 1e-10)
            v_out = inv_m * grid_v_in[f, i, j]
            v_out[1] -= DT * GRAVITY
            if i < BOUND and v_out[0] < 0:
                v_out = ti.Vector([0.0, 0.0])
            if i > N_GRID - BOUND and v_out[0] > 0:
                v_out = ti.Vector([0.0, 0.0])
            if j < BOUND and v_out[1] < 0:
                # Floor: drop the normal velocity, Coulomb friction on the tangential part.
                lin = v_out[1]
                lit = ti.abs(v_out[0]) + 1e-10
                if lit + COEFF * lin <= 0:
                    v_out = ti.Vector([0.0, 0.0])
                else:
                    v_out = ti.Vector([(1.0 + COEFF * lin / lit) * v_out[0], 0.0])
            if j > N_GRID - BOUND and v_out[1] > 0:
                v_out = ti.Vector([0.0, 0.0])
            grid_v_out[f, i, j] = v_out

    @ti.kernel
    def g2p(f: ti.i32):
        for p in range(N_PARTICLES):
            base = ti.cast(x[f, p] * INV_DX - 0.5, ti.i32)
            fx = x[f, p] * INV_DX - ti.cast(base, ti.f32)
            w = [0.5 * (1.5 - fx) ** 2, 0.75 - (fx - 1.0) ** 2, 0.5 * (fx - 0.5) ** 2]
            new_v = ti.Vector([0.0, 0.0])
            new_C = ti.Matrix([[0.0, 0.0], [0.0, 0.0]])
            for i in ti.static(range(3)):
                for j in ti.static(range(3)):
                    dpos = ti.Vector([float(i), float(j)]) - fx
                    g_v = grid_v_out[f, base[0] + i, base[1] + j]
                    weight = w[i][0] * w[j][1]
                    new_v += weight * g_v
                    new_C += 4.0 * INV_DX * weight * g_v.outer_product(dpos)
            v[f + 1, p] = new_v
            x[f + 1, p] = x[f, p] + DT * new_v
            C[f + 1, p] = new_C

    @ti.kernel
    def compute_loss():
        for p in range(N_PARTICLES):
            loss[None] += x[STEPS - 1, p][0] / N_PARTICLES

    def forward() -> None:
        set_v()
        for s in range(STEPS - 1):
            p2g(s)
            grid_op(s)
            g2p(s)
        compute_loss()

    def iteration() -> None:
        clear_grid()
        with ti.ad.Tape(loss=loss):
            forward()
        g = init_v.grad.to_numpy()
        init_v.from_numpy(init_v.to_numpy() - LR * g)

    @ti.kernel
    def descend(lr: ti.f32):
        init_v[None] -= lr * init_v.grad[None]

    def device_iteration() -> None:
        """``iteration`` with the descent step in a kernel: no host read, so a graph can
        capture it (bench/graph.py, bench/service_graph.py)."""
        clear_grid()
        with ti.ad.Tape(loss=loss):
            forward()
        descend(LR)

    def loss_at(v0: np.ndarray) -> float:
        """Forward rollout only (no tape) from initial velocity ``v0``."""
        init_v.from_numpy(v0.astype(np.float32))
        clear_grid()
        loss[None] = 0.0
        forward()
        return float(loss[None])

    def start() -> None:
        set_initial()
        init_v.from_numpy(np.array(INIT_V, dtype=np.float32))
        ti.sync()

    return SimpleNamespace(x=x, v=v, C=C, F=F, grid_v_in=grid_v_in, grid_m_in=grid_m_in,
                           grid_v_out=grid_v_out, init_v=init_v, loss=loss,
                           set_initial=set_initial, clear_grid=clear_grid, set_v=set_v,
                           p2g=p2g, grid_op=grid_op, g2p=g2p, compute_loss=compute_loss,
                           forward=forward, iteration=iteration,
                           device_iteration=device_iteration, loss_at=loss_at, start=start)


def measure(ti: ModuleType, args: argparse.Namespace) -> dict[str, Any]:
    """Time the cold first iteration, check the gradient by finite differences, then time more."""
    sim = build(ti)
    iteration, loss_at, x, init_v, loss = sim.iteration, sim.loss_at, sim.x, sim.init_v, sim.loss
    v_start = np.array(INIT_V, dtype=np.float32)
    sim.start()

    # (b) The first iteration: a fresh process and an empty cache directory, so every
    # kernel and its adjoint is compiled inside this measurement.
    t0 = time.perf_counter()
    iteration()
    ti.sync()
    first_s = time.perf_counter() - t0

    # Checks, all untimed. The tape left the loss and dL/d(init_v) of the start point.
    value = float(loss[None])
    grad = init_v.grad.to_numpy().astype(np.float64)
    xs_last = x.to_numpy()[STEPS - 1]
    finite = bool(np.isfinite(xs_last).all()) and bool(np.isfinite(grad).all())
    v_after = init_v.to_numpy()
    fd = np.zeros(2)
    for k in range(2):
        e = np.zeros(2, dtype=np.float32)
        e[k] = FD_H
        fd[k] = (loss_at(v_start + e) - loss_at(v_start - e)) / (2 * FD_H)
    fd_rel = float(np.linalg.norm(fd - grad) / max(np.linalg.norm(grad), 1e-30))
    init_v.from_numpy(v_after)

    # (a) Steady-state iterations.
    t = common.time_it(iteration, repeat=args.repeat, warmup=args.warmup, sync=ti.sync)

    floor = BOUND * DX
    notes = (
        f"loss={value:.6f}, dL/d(init_v)=({grad[0]:.5f}, {grad[1]:.5f}), "
        f"FD h={FD_H:g} f32: ({fd[0]:.5f}, {fd[1]:.5f}), rel diff {fd_rel:.1e}; "
        f"final y in [{xs_last[:, 1].min():.4f}, {xs_last[:, 1].max():.4f}] "
        f"(floor {floor:.4f}); " + ("finite" if finite else "NaN/inf (WRONG)")
    )
    rows = [
        {"label": f"{NAME}: iteration", "value": t.median * 1e3, "unit": "ms"},
        {"label": f"{NAME}: first iteration, cold cache", "value": first_s, "unit": "s"},
    ]
    return common.result(
        NAME,
        args.backend,
        seconds=t.median,
        rows=rows,
        notes=notes,
        timing=t.as_dict(),
        iteration_s=t.median,
        first_iteration_s=first_s,
        loss=value,
        grad=grad.tolist(),
        grad_fd=fd.tolist(),
        grad_fd_rel_diff=fd_rel,
        finite=finite,
        steps=STEPS,
        n_particles=N_PARTICLES,
        n_grid=N_GRID,
    )


if __name__ == "__main__":
    p = common.parser(__doc__.splitlines()[0], repeat=5)
    p.add_argument("--deterministic", action="store_true",
                   help="difftape only: ti.init(deterministic=True), bitwise-reproducible")
    ns = p.parse_args()
    sys.exit(common.main(NAME, run, ns))
