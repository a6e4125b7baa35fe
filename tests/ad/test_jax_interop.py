"""difftape programs as JAX functions (difftape.interop.jax): custom_vjp (first and second
order, reverse) and custom_jvp (forward), checked with jax.test_util.check_grads in f64 and
against the same computation written in JAX, under jax.jit."""

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="the [jax] extra (JAX) is not installed")
jnp = pytest.importorskip("jax.numpy", reason="the [jax] extra (JAX) is not installed")
from jax.test_util import check_grads  # noqa: E402

pytestmark = pytest.mark.difftape_only

N = 5


@pytest.fixture
def ti64(backend):
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    backend.init(arch=backend.cpu, default_fp=backend.f64)
    yield backend
    backend.reset()
    jax.config.update("jax_enable_x64", previous)


def _program(ti):
    x = ti.field(ti.f64, N, needs_grad=True)
    w = ti.field(ti.f64, N, needs_grad=True)
    y = ti.field(ti.f64, N, needs_grad=True)
    s = ti.field(ti.f64, (), needs_grad=True)

    @ti.kernel
    def compute():
        for i in x:
            y[i] = ti.sin(x[i]) * w[i] * w[i] + x[(i + 1) % N] * w[i]

    @ti.kernel
    def total():
        for i in y:
            s[None] += y[i] * y[i]

    def program():
        compute()
        total()

    return program, [x, w], [y, s]


def _reference(x, w):
    y = jnp.sin(x) * w * w + jnp.roll(x, -1) * w
    return y, jnp.sum(y * y)


def _args(seed=0):
    r = np.random.default_rng(seed)
    return jnp.asarray(r.random(N)), jnp.asarray(r.random(N) + 0.5)


def test_reverse_mode_first_and_second_order(ti64):
    from difftape.interop.jax import function

    f = function(*_program(ti64))
    x, w = _args()
    for a, b in zip(f(x, w), _reference(x, w), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-13)
    check_grads(f, (x, w), order=2, modes=["rev"])


def test_matches_jax_under_jit_to_second_order(ti64):
    from difftape.interop.jax import function

    f = function(*_program(ti64))
    x, w = _args(1)
    loss = lambda a, b: f(a, b)[1]
    ref = lambda a, b: _reference(a, b)[1]
    for a, b in zip(jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w),
                    jax.grad(ref, argnums=(0, 1))(x, w), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12)
    hess = jax.jit(jax.jacrev(jax.jacrev(loss)))(x, w)
    np.testing.assert_allclose(hess, jax.hessian(ref)(x, w), rtol=1e-10, atol=1e-12)


def test_forward_mode(ti64):
    from difftape.interop.jax import function

    g = function(*_program(ti64), mode="forward")
    x, w = _args(2)
    check_grads(g, (x, w), order=1, modes=["fwd"])
    jac = jax.jit(jax.jacfwd(lambda a: g(a, w)[0]))(x)
    np.testing.assert_allclose(jac, jax.jacfwd(lambda a: _reference(a, w)[0])(x), rtol=1e-12)


def test_gradient_against_finite_differences(ti64):
    from difftape.interop.jax import function

    f = function(*_program(ti64))
    x, w = _args(3)
    gx = jax.grad(lambda a: f(a, w)[1])(x)
    h = 1e-6
    for i in range(N):
        e = jnp.zeros(N).at[i].set(h)
        fd = (f(x + e, w)[1] - f(x - e, w)[1]) / (2 * h)
        assert float(gx[i]) == pytest.approx(float(fd), rel=1e-6, abs=1e-9)


def test_wrong_dtype_and_shape_are_refused(ti64):
    from difftape.interop.jax import function

    f = function(*_program(ti64))
    x, w = _args()
    with pytest.raises(ti64.DifftapeError, match="float32"):
        f(x.astype(jnp.float32), w)
    with pytest.raises(ti64.DifftapeError, match=r"\(4,\)"):
        f(x[:4], w)
    with pytest.raises(ti64.DifftapeError, match="mode"):
        function(*_program(ti64), mode="sideways")
