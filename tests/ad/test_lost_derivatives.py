"""Derivatives that would be lost through an intermediate without derivative storage.

A value computed from a differentiated input and written to a float field without ``.dual``
(forward mode) or ``.grad`` (reverse mode) loses its derivative there. When a later kernel
reads that field into the differentiated output, the result would silently miss that path
(Taichi 1.7.4 gives dz/dx = 0 here): difftape refuses, naming the field and the fix. Writing
a diagnostic value that never flows into the loss keeps working.
"""

import numpy as np
import pytest

N = 5


def _chain(ti, y_dual=False, y_grad=False, one_kernel=False):
    x = ti.field(ti.f64, N, needs_dual=True, needs_grad=True, name="x")
    y = ti.field(ti.f64, N, needs_dual=y_dual, needs_grad=y_grad, name="y")
    z = ti.field(ti.f64, (), needs_dual=True, needs_grad=True, name="z")

    @ti.kernel
    def square():
        for i in x:
            y[i] = x[i] * x[i]

    @ti.kernel
    def total():
        for i in y:
            z[None] += ti.sin(y[i])

    @ti.kernel
    def both():
        for i in x:
            y[i] = x[i] * x[i]
        for i in y:
            z[None] += ti.sin(y[i])

    def run():
        if one_kernel:
            both()
        else:
            square()
            total()

    xs = np.linspace(0.2, 1.1, N)
    x.from_numpy(xs)
    return x, y, z, run, xs


def _dz_dx(xs):
    return np.cos(xs**2) * 2 * xs  # z = sum(sin(x_i^2))


def test_forward_mode_through_an_intermediate_with_dual_storage(ti):
    x, y, z, run, xs = _chain(ti, y_dual=True)
    seed = np.arange(1.0, N + 1)
    with ti.ad.FwdMode(loss=z, param=x, seed=list(seed)):
        run()
    assert z.dual[None] == pytest.approx(float(_dz_dx(xs) @ seed), rel=1e-12)


@pytest.mark.difftape_only  # Taichi gives dz/dx = 0 without a word
@pytest.mark.parametrize("one_kernel", [False, True])
def test_forward_mode_refuses_an_intermediate_without_dual_storage(ti, one_kernel):
    x, y, z, run, xs = _chain(ti, one_kernel=one_kernel)
    with pytest.raises(ti.GradientRuleError, match=r"'y'.*needs_dual=True"):
        with ti.ad.FwdMode(loss=z, param=x, seed=[1.0] * N):
            run()


def test_reverse_mode_through_an_intermediate_with_grad_storage(ti):
    x, y, z, run, xs = _chain(ti, y_grad=True)
    with ti.ad.Tape(loss=z):
        run()
    np.testing.assert_allclose(x.grad.to_numpy(), _dz_dx(xs), rtol=1e-12)


@pytest.mark.difftape_only  # Taichi gives x.grad = 0 without a word
@pytest.mark.parametrize("one_kernel", [False, True])
def test_reverse_mode_refuses_an_intermediate_without_grad_storage(ti, one_kernel):
    x, y, z, run, xs = _chain(ti, one_kernel=one_kernel)
    with pytest.raises(ti.GradientRuleError, match=r"'y'.*needs_grad=True"):
        with ti.ad.Tape(loss=z):
            run()


def test_a_diagnostic_value_that_does_not_reach_the_loss_is_fine(ti):
    """A value computed from x, written to a field without .grad/.dual and read only into
    other such fields (a log, a maximum), does not stop either mode."""
    x = ti.field(ti.f64, N, needs_dual=True, needs_grad=True)
    z = ti.field(ti.f64, (), needs_dual=True, needs_grad=True)
    diag = ti.field(ti.f64, N)
    peak = ti.field(ti.f64, ())

    @ti.kernel
    def compute():
        for i in x:
            z[None] += x[i] ** 3
            diag[i] = x[i] * 2.0

    @ti.kernel
    def summarize():
        for i in diag:
            ti.atomic_max(peak[None], diag[i])

    xs = np.linspace(0.2, 1.1, N)
    x.from_numpy(xs)
    seed = np.arange(N) / 4 - 0.5  # exact in f32 (Taichi rounds seeds to f32)
    with ti.ad.FwdMode(loss=z, param=x, seed=list(seed)):
        compute()
        summarize()
    assert z.dual[None] == pytest.approx(float(3 * xs**2 @ seed), rel=1e-12)
    assert peak[None] == pytest.approx(2 * xs.max())
    with ti.ad.Tape(loss=z):
        compute()
        summarize()
    np.testing.assert_allclose(x.grad.to_numpy(), 3 * xs**2, rtol=1e-12)


@pytest.mark.difftape_only
def test_an_intermediate_recomputed_without_derivative_is_fine(ti):
    """The taint is on the values written, not on the field: a field only ever written with
    values that carry no derivative (constants, no_grad kernels) may be read into the loss."""
    x = ti.field(ti.f64, N, needs_dual=True, needs_grad=True)
    w = ti.field(ti.f64, N)
    z = ti.field(ti.f64, (), needs_dual=True, needs_grad=True)

    @ti.kernel
    def weights():
        for i in w:
            w[i] = i + 1.0

    @ti.ad.no_grad
    @ti.kernel
    def weights_from_x():
        for i in w:
            w[i] = x[i] + 1.0

    @ti.kernel
    def total():
        for i in x:
            z[None] += w[i] * x[i]

    xs = np.linspace(0.2, 1.1, N)
    x.from_numpy(xs)
    seed = np.ones(N)
    with ti.ad.FwdMode(loss=z, param=x, seed=list(seed)):
        weights()
        total()
    assert z.dual[None] == pytest.approx(float(np.arange(1.0, N + 1) @ seed), rel=1e-12)
    with ti.ad.FwdMode(loss=z, param=x, seed=list(seed)):
        weights_from_x()
        total()
    assert z.dual[None] == pytest.approx(float((xs + 1) @ seed), rel=1e-12)
    with ti.ad.Tape(loss=z):
        weights_from_x()
        total()
    np.testing.assert_allclose(x.grad.to_numpy(), xs + 1, rtol=1e-12)
