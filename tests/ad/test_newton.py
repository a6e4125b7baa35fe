"""``ti.ad.newton``: Newton's method on exact Hessians, against analytic minima."""

import numpy as np
import pytest

import difftape as ti

pytestmark = pytest.mark.difftape_only  # Taichi has no Newton solver


def quadratic(n: int = 5):
    """E(x) = 1/2 x^T A x - b^T x with A symmetric positive definite: minimum A^-1 b."""
    rng = np.random.default_rng(3)
    m = rng.standard_normal((n, n))
    a = m @ m.T + n * np.eye(n)
    b = rng.standard_normal(n)
    x = ti.field(ti.f64, shape=n, needs_grad=True)
    loss = ti.field(ti.f64, shape=(), needs_grad=True)
    af = ti.field(ti.f64, shape=(n, n))
    bf = ti.field(ti.f64, shape=n)
    af.from_numpy(a)
    bf.from_numpy(b)

    @ti.kernel
    def energy():
        for i, j in af:
            loss[None] += 0.5 * x[i] * af[i, j] * x[j]
        for i in x:
            loss[None] -= bf[i] * x[i]

    def run():
        loss.fill(0)
        energy()

    return x, loss, run, a, b


def test_quadratic_in_one_step():
    """On a quadratic, the first Newton step lands on the minimum (the Hessian is exact)."""
    ti.init(arch=ti.cpu, default_fp=ti.f64)
    x, loss, run, a, b = quadratic()
    r = ti.ad.newton(run, loss, x, tol=1e-9)
    want = np.linalg.solve(a, b)
    np.testing.assert_allclose(x.to_numpy(), want, rtol=1e-12, atol=1e-12)
    assert r.converged and r.iterations == 1
    assert r.loss == pytest.approx(-0.5 * b @ want, rel=1e-12)
    assert r.grad_norm < 1e-9


def test_rosenbrock_with_line_search():
    """Rosenbrock's valley from (-1.2, 1): the full Newton step overshoots at first, the
    backtracking line search keeps every accepted step downhill, and it ends at (1, 1)."""
    ti.init(arch=ti.cpu, default_fp=ti.f64)
    x = ti.field(ti.f64, shape=2, needs_grad=True)
    loss = ti.field(ti.f64, shape=(), needs_grad=True)

    @ti.kernel
    def rosen():
        loss[None] = (1 - x[0]) ** 2 + 100 * (x[1] - x[0] ** 2) ** 2

    x.from_numpy(np.array([-1.2, 1.0]))
    r = ti.ad.newton(rosen, loss, x, tol=1e-10, max_iter=100)
    assert r.converged and r.iterations > 5
    np.testing.assert_allclose(x.to_numpy(), [1.0, 1.0], rtol=1e-8)


def test_not_converged_is_reported_not_hidden():
    ti.init(arch=ti.cpu, default_fp=ti.f64)
    x = ti.field(ti.f64, shape=2, needs_grad=True)
    loss = ti.field(ti.f64, shape=(), needs_grad=True)

    @ti.kernel
    def rosen():
        loss[None] = (1 - x[0]) ** 2 + 100 * (x[1] - x[0] ** 2) ** 2

    x.from_numpy(np.array([-1.2, 1.0]))
    r = ti.ad.newton(rosen, loss, x, tol=1e-10, max_iter=2)
    assert not r.converged and r.iterations == 2 and r.grad_norm > 1e-10


def test_refusals():
    """A singular Hessian (a loss flat along a direction) and bad options are errors."""
    ti.init(arch=ti.cpu, default_fp=ti.f64)
    x = ti.field(ti.f64, shape=2, needs_grad=True)
    loss = ti.field(ti.f64, shape=(), needs_grad=True)

    @ti.kernel
    def flat():
        loss[None] = (x[0] - 1.0) ** 2  # x[1] does not matter: the Hessian is singular

    with pytest.raises(ti.DifftapeError, match="Hessian is singular"):
        ti.ad.newton(flat, loss, x)
    with pytest.raises(ti.DifftapeError, match="max_iter"):
        ti.ad.newton(flat, loss, x, max_iter=-1)
    y = ti.field(ti.f64, shape=2)
    with pytest.raises(ti.DifftapeError, match="no gradient storage"):
        ti.ad.newton(flat, loss, y)
