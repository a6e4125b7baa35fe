"""A small differentiable MPM rollout (the diffmpm benchmark's kernels: APIC transfers with
scatter atomics, polar decomposition, a grid operator with branches) differentiated three
ways: forward mode (``ti.ad.jacobian(mode="forward")``), reverse mode (a Tape) and float64
central differences. Forward mode must run every kernel reverse mode runs, and agree with it.
"""

import numpy as np
import pytest

pytestmark = pytest.mark.difftape_only

SIDE, N_GRID, STEPS = 6, 24, 8
N = SIDE * SIDE
DX = 1.0 / N_GRID
INV_DX = float(N_GRID)
DT = 2e-3
P_VOL, P_RHO = (DX * 0.5) ** 2, 1.0
P_MASS = P_VOL * P_RHO
E = 10.0
MU, LA = E, E
BOUND = 3


def _build(ti):
    f64 = ti.f64

    def vec(shape):
        return ti.Vector.field(2, f64, shape=shape, needs_grad=True, needs_dual=True)

    def mat(shape):
        return ti.Matrix.field(2, 2, f64, shape=shape, needs_grad=True, needs_dual=True)

    x, v, C, F = vec((STEPS, N)), vec((STEPS, N)), mat((STEPS, N)), mat((STEPS, N))
    gv, gv_out = vec((STEPS, N_GRID, N_GRID)), vec((STEPS, N_GRID, N_GRID))
    gm = ti.field(f64, (STEPS, N_GRID, N_GRID), needs_grad=True, needs_dual=True)
    init_v = ti.Vector.field(2, f64, shape=(), needs_grad=True, needs_dual=True)
    loss = ti.field(f64, (), needs_grad=True, needs_dual=True)

    @ti.kernel
    def setup():
        for p in range(N):
            x[0, p] = ti.Vector([0.3 + (p // SIDE + 0.5) * DX * 0.5,
                                 0.2 + (p % SIDE + 0.5) * DX * 0.5])
            F[0, p] = ti.Matrix.identity(f64, 2)
            C[0, p] = ti.Matrix.zero(f64, 2, 2)

    @ti.kernel
    def clear_grid():
        for s, i, j in gm:
            gv[s, i, j] = ti.Vector([0.0, 0.0])
            gm[s, i, j] = 0.0

    @ti.kernel
    def set_v():
        for p in range(N):
            v[0, p] = init_v[None]

    @ti.kernel
    def p2g(f: ti.i32):
        for p in range(N):
            base = ti.cast(x[f, p] * INV_DX - 0.5, ti.i32)
            fx = x[f, p] * INV_DX - ti.cast(base, f64)
            w = [0.5 * (1.5 - fx) ** 2, 0.75 - (fx - 1.0) ** 2, 0.5 * (fx - 0.5) ** 2]
            new_F = (ti.Matrix.identity(f64, 2) + DT * C[f, p]) @ F[f, p]
            F[f + 1, p] = new_F
            J = new_F.determinant()
            r, _ = ti.polar_decompose(new_F)
            cauchy = 2.0 * MU * (new_F - r) @ new_F.transpose() + \
                ti.Matrix.diag(2, LA * (J - 1.0) * J)
            affine = -(DT * P_VOL * 4 * INV_DX * INV_DX) * cauchy + P_MASS * C[f, p]
            for i in ti.static(range(3)):
                for j in ti.static(range(3)):
                    dpos = (ti.Vector([float(i), float(j)]) - fx) * DX
                    weight = w[i][0] * w[j][1]
                    gv[f, base[0] + i, base[1] + j] += weight * (P_MASS * v[f, p] + affine @ dpos)
                    gm[f, base[0] + i, base[1] + j] += weight * P_MASS

    @ti.kernel
    def grid_op(f: ti.i32):
        for i, j in ti.ndrange(N_GRID, N_GRID):
            inv_m = 1.0 / (gm[f, i, j] + 1e-10)
            v_out = inv_m * gv[f, i, j]
            v_out[1] -= DT * 9.8
            if i < BOUND and v_out[0] < 0:
                v_out = ti.Vector([0.0, 0.0])
            if j < BOUND and v_out[1] < 0:
                v_out = ti.Vector([0.0, 0.0])
            gv_out[f, i, j] = v_out

    @ti.kernel
    def g2p(f: ti.i32):
        for p in range(N):
            base = ti.cast(x[f, p] * INV_DX - 0.5, ti.i32)
            fx = x[f, p] * INV_DX - ti.cast(base, f64)
            w = [0.5 * (1.5 - fx) ** 2, 0.75 - (fx - 1.0) ** 2, 0.5 * (fx - 0.5) ** 2]
            new_v = ti.Vector([0.0, 0.0])
            new_C = ti.Matrix.zero(f64, 2, 2)
            for i in ti.static(range(3)):
                for j in ti.static(range(3)):
                    g = gv_out[f, base[0] + i, base[1] + j]
                    weight = w[i][0] * w[j][1]
                    new_v += weight * g
                    new_C += 4 * INV_DX * weight * g.outer_product(
                        ti.Vector([float(i), float(j)]) - fx)
            v[f + 1, p] = new_v
            x[f + 1, p] = x[f, p] + DT * new_v
            C[f + 1, p] = new_C

    @ti.kernel
    def compute_loss():
        for p in range(N):
            loss[None] += x[STEPS - 1, p][0] * x[STEPS - 1, p][1] / N

    def rollout():
        clear_grid()
        loss.fill(0)
        set_v()
        for s in range(STEPS - 1):
            p2g(s)
            grid_op(s)
            g2p(s)
        compute_loss()

    setup()
    return init_v, loss, rollout


def descent_step(ti):
    """The MPM Tape step followed by a gradient step on ``init_v`` and a copy of it into
    ``keep``: the optimisation step the graph tests capture on grids
    (tests/core/test_grid_graph.py, tests/gpu/test_graph_device.py). Returns ``(step,
    declare, init_v, other)``: ``declare(g)`` binds the step's inputs in a capture, ``other`` is
    a second destination for ``keep``."""
    init_v, loss, rollout = _build(ti)
    init_v.from_numpy(np.array([0.7, -0.4]))
    snapshot = ti.Vector.field(2, ti.f64, shape=())
    other = ti.Vector.field(2, ti.f64, shape=())

    @ti.kernel
    def descend(lr: ti.f64):
        init_v[None] -= lr * init_v.grad[None]

    def step(lr=0.05, keep=snapshot):
        with ti.ad.Tape(loss=loss):
            rollout()
        descend(lr)
        keep.copy_from(init_v)

    def declare(g):
        return {"lr": g.input("lr", 0.05), "keep": g.input("keep", snapshot)}

    return step, declare, init_v, other


def test_mpm_forward_reverse_and_differences_agree(ti):
    ti.init(arch=ti.cpu, default_fp=ti.f64)
    init_v, loss, rollout = _build(ti)
    v0 = np.array([0.7, -0.4])
    init_v.from_numpy(v0)
    fwd = ti.ad.jacobian(rollout, init_v, loss, mode="forward")[0]
    rev = ti.ad.jacobian(rollout, init_v, loss, mode="reverse")[0]
    fd = np.zeros(2)
    h = 1e-6
    for k in range(2):
        vals = []
        for sgn in (1, -1):
            e = np.zeros(2)
            e[k] = sgn * h
            init_v.from_numpy(v0 + e)
            rollout()
            vals.append(loss[None])
        fd[k] = (vals[0] - vals[1]) / (2 * h)
    assert np.all(np.abs(fwd) > 1e-3)  # a real dependence, not an empty derivative
    np.testing.assert_allclose(fwd, rev, rtol=1e-10)
    np.testing.assert_allclose(fwd, fd, rtol=1e-6)
