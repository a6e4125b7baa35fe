"""Forward mode, second order and Jacobians through the client, bit for bit against local
runs (``check_out_of_bound=True``, as the server compiles): ``ti.ad.FwdMode``, ``ti.ad.hvp``,
``ti.ad.hessian``, ``ti.ad.jacobian`` in both modes and ``ti.ad.jvp``/``vjp`` of a Python
program run unchanged under ``arch=ti.remote``."""

import numpy as np

import difftape as ti

from .test_client_programs import run_local, same


def program():
    n = 4
    a = ti.field(ti.f64, n, needs_grad=True)
    L = ti.field(ti.f64, (), needs_grad=True)
    y = ti.field(ti.f64, n, needs_dual=True, needs_grad=True)

    @ti.kernel
    def energy():
        for i in a:
            L[None] += ti.sin(a[i]) * a[(i + 1) % n] + a[i] ** 4

    @ti.kernel
    def square():
        for i in a:
            y[i] = a[i] ** 2 + ti.exp(a[(i + 1) % n])

    def run_square():
        square()

    @ti.ad.no_grad
    @ti.kernel
    def overwrite():  # under forward mode: zero tangents for y (variant fwd_const)
        for i in a:
            y[i] = a[i] * 0.5

    a.from_numpy(np.array([0.1, -0.2, 0.3, 0.45]))
    out = {"hvp": ti.ad.hvp(energy, L, a, np.array([1.0, -2.0, 0.5, 3.0])),
           "grad": a.grad.to_numpy(),
           "hessian": ti.ad.hessian(energy, L, a),
           "jac_fwd": ti.ad.jacobian(run_square, a, y, mode="forward"),
           "jac_rev": ti.ad.jacobian(run_square, a, y, mode="reverse"),
           "jvp": ti.ad.jvp(run_square, [a], [np.arange(4.0)], [y])[0],
           "vjp": ti.ad.vjp(run_square, [a], [y], [np.ones(4)])[0]}
    with ti.ad.FwdMode(loss=y, param=a, seed=[1.0, 0.0, -1.0, 2.0]):
        square()
    out["fwdmode"] = y.dual.to_numpy()
    out["seed_cleared"] = a.dual.to_numpy()
    with ti.ad.FwdMode(loss=y, param=a, seed=[1.0, 0.0, -1.0, 2.0]):
        square()
        overwrite()
    out["no_grad_dual"] = y.dual.to_numpy()
    return out


def test_forward_mode_and_second_order_remote(remote):  # noqa: F811 - the fixture
    here = run_local(program)
    there = remote(program)
    same(here, there)
    np.testing.assert_allclose(here["jac_fwd"], here["jac_rev"], rtol=1e-14, atol=1e-15)
    assert not here["seed_cleared"].any()
    assert here["fwdmode"].any() and not here["no_grad_dual"].any()


def lost_derivative_program():
    """A chain x -> y -> z with y lacking .dual/.grad: refused in both modes, with the field
    named, and right once y has the storage."""
    n = 3
    x = ti.field(ti.f64, n, needs_dual=True, needs_grad=True, name="x")
    y = ti.field(ti.f64, n, name="y")
    z = ti.field(ti.f64, (), needs_dual=True, needs_grad=True, name="z")

    @ti.kernel
    def square():
        for i in x:
            y[i] = x[i] * x[i]

    @ti.kernel
    def total():
        for i in y:
            z[None] += y[i]

    x.from_numpy(np.array([0.5, 1.0, 2.0]))
    out = {}
    for mode in ("forward", "reverse"):
        try:
            if mode == "forward":
                with ti.ad.FwdMode(loss=z, param=x, seed=[1.0, 1.0, 1.0]):
                    square()
                    total()
            else:
                with ti.ad.Tape(loss=z):
                    square()
                    total()
            out[mode] = "not refused"
        except ti.GradientRuleError as e:
            out[mode] = str(e).split("\n")[0]
    ti.root.lazy_dual()
    ti.root.lazy_grad()
    with ti.ad.FwdMode(loss=z, param=x, seed=[1.0, 1.0, 1.0]):
        square()
        total()
    out["dual"] = z.dual[None]
    with ti.ad.Tape(loss=z):
        square()
        total()
    out["grad"] = x.grad.to_numpy()
    return out


def test_lost_derivatives_refused_remote_as_locally(remote):  # noqa: F811 - the fixture
    here = run_local(lost_derivative_program)
    assert "'y'" in here["forward"] and "needs_dual=True" in here["forward"]
    assert "'y'" in here["reverse"] and "needs_grad=True" in here["reverse"]
    assert here["dual"] == 2 * (0.5 + 1.0 + 2.0)
    np.testing.assert_array_equal(here["grad"], [1.0, 2.0, 4.0])
    same(here, remote(lost_derivative_program))
