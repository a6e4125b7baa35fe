"""The derivative rule of every primitive, through ``kernel(); kernel.grad()``.

Each test runs ``y[i] = f(x[i])`` (or ``f(x[i], z[i])``) over sample points of the function's
domain, seeds ``y.grad`` with random weights ``w`` and checks ``x.grad == w * f'(x)`` against the
analytic derivative evaluated in float64 at the (possibly f32-rounded) inputs. Vector and matrix
operations are checked against float64 central finite differences of the NumPy equivalent.
"""

import numpy as np
import pytest

from .helpers import FD_RTOL, close, fd_grad, weights

# Taichi warns (SyntaxWarning) whenever a kernel calls a plain Python callable such as the
# lambdas of the tables below; that is intended here.
pytestmark = pytest.mark.filterwarnings("ignore::SyntaxWarning")

N = 8


def _points(lo, hi, n=N):
    """n points spread over [lo, hi], nudged off the grid so that none is an integer or zero."""
    return np.linspace(lo, hi, n) + 0.0123


def _sec2(x):
    return 1.0 / np.cos(x) ** 2


# name: (op factory taking the module, derivative in float64, sample points)
UNARY = {
    "neg": (lambda ti: lambda v: -v, lambda x: -np.ones_like(x), _points(-3, 3)),
    "square_mul": (lambda ti: lambda v: v * v, lambda x: 2 * x, _points(-3, 3)),
    "sin": (lambda ti: ti.sin, np.cos, _points(-4, 4)),
    "cos": (lambda ti: ti.cos, lambda x: -np.sin(x), _points(-4, 4)),
    "asin": (lambda ti: ti.asin, lambda x: 1 / np.sqrt(1 - x * x), _points(-0.95, 0.93)),
    "acos": (lambda ti: ti.acos, lambda x: -1 / np.sqrt(1 - x * x), _points(-0.95, 0.93)),
    "tanh": (lambda ti: ti.tanh, lambda x: 1 - np.tanh(x) ** 2, _points(-3, 3)),
    "exp": (lambda ti: ti.exp, np.exp, _points(-5, 5)),
    "log": (lambda ti: ti.log, lambda x: 1 / x, _points(0.05, 20)),
    "sqrt": (lambda ti: ti.sqrt, lambda x: 0.5 / np.sqrt(x), _points(0.05, 20)),
    "rsqrt": (lambda ti: ti.rsqrt, lambda x: -0.5 * x**-1.5, _points(0.05, 20)),
    "abs": (lambda ti: ti.abs, np.sign, _points(-3, 3)),
    "abs_builtin": (lambda ti: abs, np.sign, _points(-3, 3)),
    "pow_int2": (lambda ti: lambda v: v**2, lambda x: 2 * x, _points(-3, 3)),
    "pow_int3": (lambda ti: lambda v: v**3, lambda x: 3 * x**2, _points(-3, 3)),
    "pow_int_neg1": (lambda ti: lambda v: v**-1, lambda x: -(x**-2.0), _points(-3, 3)),
    "pow_float": (lambda ti: lambda v: v**2.5, lambda x: 2.5 * x**1.5, _points(0.1, 4)),
    "pow_float_half": (lambda ti: lambda v: v**0.5, lambda x: 0.5 * x**-0.5, _points(0.1, 4)),
    "ti_pow_int": (lambda ti: lambda v: ti.pow(v, 3), lambda x: 3 * x**2, _points(-3, 3)),
    "ti_pow_float": (lambda ti: lambda v: ti.pow(v, 1.5), lambda x: 1.5 * x**0.5, _points(0.1, 4)),
    "const_base_pow": (lambda ti: lambda v: 2.0**v, lambda x: np.log(2.0) * 2.0**x,
                       _points(-3, 3)),
    "floor": (lambda ti: ti.floor, np.zeros_like, _points(-2.7, 2.3)),
    "ceil": (lambda ti: ti.ceil, np.zeros_like, _points(-2.7, 2.3)),
    "chain": (lambda ti: lambda v: ti.sin(v) * ti.exp(-v * v),
              lambda x: (np.cos(x) - 2 * x * np.sin(x)) * np.exp(-x * x), _points(-2, 2)),
    "reuse": (lambda ti: lambda v: (v + 1) * (v - 2) / (v * v + 1),
              lambda x: ((2 * x - 1) * (x * x + 1) - (x + 1) * (x - 2) * 2 * x) / (x * x + 1) ** 2,
              _points(-3, 3)),
}

# Taichi 1.7.4 cannot differentiate these (its auto_diff pass raises "Not supported" for tan and
# round, and it has no ti.atan), so they are difftape-only; the truth is the analytic derivative
# all the same.
UNARY_DIFFTAPE_ONLY = {
    "tan": (lambda ti: ti.tan, _sec2, _points(-1.4, 1.35)),
    "atan": (lambda ti: ti.atan, lambda x: 1 / (1 + x * x), _points(-4, 4)),
    "round": (lambda ti: ti.round, np.zeros_like, _points(-2.7, 2.3)),
}

# rsqrt may be an approximation in f32
_SCALE = {"rsqrt": 100}


def _unary_grad(ti, op, xs, w):
    n = len(xs)
    x = ti.field(float, n, needs_grad=True)
    y = ti.field(float, n, needs_grad=True)

    @ti.kernel
    def run():
        for i in x:
            y[i] = op(x[i])

    x.from_numpy(xs)
    y.grad.from_numpy(w)
    run()
    run.grad()
    return x.to_numpy().astype(np.float64), x.grad.to_numpy()


def _check_unary(ti, npfp, rtol, name, table):
    make_op, derivative, xs = table[name]
    w = weights(len(xs))
    x_used, got = _unary_grad(ti, make_op(ti), xs.astype(npfp), w.astype(npfp))
    want = w.astype(npfp).astype(np.float64) * derivative(x_used)
    close(got, want, rtol=8 * _SCALE.get(name, 1) * rtol, err_msg=f"d/dx {name}")


@pytest.mark.parametrize("name", list(UNARY))
def test_unary_rule(ti, fp, npfp, rtol, name):
    _check_unary(ti, npfp, rtol, name, UNARY)


@pytest.mark.difftape_only
@pytest.mark.parametrize("name", list(UNARY_DIFFTAPE_ONLY))
def test_unary_rule_difftape_only(ti, fp, npfp, rtol, name):
    _check_unary(ti, npfp, rtol, name, UNARY_DIFFTAPE_ONLY)


def _atan2_points():
    angles = np.linspace(-np.pi + 0.1, np.pi - 0.1, N)
    radii = np.linspace(0.5, 2.5, N)
    return radii * np.sin(angles), radii * np.cos(angles)


def _x_over_z_floor(x, z):
    return -np.floor(x / z)


# name: (op factory, d/dx, d/dz, x points, z points)
BINARY = {
    "add": (lambda ti: lambda a, b: a + b, lambda x, z: np.ones_like(x),
            lambda x, z: np.ones_like(z), _points(-3, 3), _points(-2, 2)[::-1]),
    "sub": (lambda ti: lambda a, b: a - b, lambda x, z: np.ones_like(x),
            lambda x, z: -np.ones_like(z), _points(-3, 3), _points(-2, 2)[::-1]),
    "mul": (lambda ti: lambda a, b: a * b, lambda x, z: z, lambda x, z: x,
            _points(-3, 3), _points(-2, 2)[::-1]),
    "div": (lambda ti: lambda a, b: a / b, lambda x, z: 1 / z, lambda x, z: -x / z**2,
            _points(-3, 3), np.array([0.5, -0.7, 1.3, -2.0, 2.9, -0.9, 1.1, -3.0])),
    "pow_var": (lambda ti: lambda a, b: a**b, lambda x, z: z * x ** (z - 1),
                lambda x, z: np.log(x) * x**z, _points(0.2, 3), _points(-2, 2.5)),
    "ti_pow_var": (lambda ti: ti.pow, lambda x, z: z * x ** (z - 1),
                   lambda x, z: np.log(x) * x**z, _points(0.2, 3), _points(-2, 2.5)[::-1]),
    "atan2": (lambda ti: ti.atan2, lambda x, z: z / (x * x + z * z),
              lambda x, z: -x / (x * x + z * z), *_atan2_points()),
    "min": (lambda ti: ti.min, lambda x, z: (x < z).astype(float),
            lambda x, z: (z < x).astype(float), _points(-3, 3), _points(-3, 3)[::-1] + 0.05),
    "max": (lambda ti: ti.max, lambda x, z: (x > z).astype(float),
            lambda x, z: (z > x).astype(float), _points(-3, 3), _points(-3, 3)[::-1] + 0.05),
    "mod": (lambda ti: lambda a, b: a % b, lambda x, z: np.ones_like(x), _x_over_z_floor,
            _points(0.1, 5), _points(0.7, 1.9)),
    "mixed": (lambda ti: lambda a, b: ti.sin(a * b) + a / (1 + b * b),
              lambda x, z: z * np.cos(x * z) + 1 / (1 + z * z),
              lambda x, z: x * np.cos(x * z) - 2 * x * z / (1 + z * z) ** 2,
              _points(-2, 2), _points(-1.5, 1.5)[::-1]),
}


@pytest.mark.parametrize("name", list(BINARY))
def test_binary_rule(ti, fp, npfp, rtol, name):
    make_op, d_dx, d_dz, xs, zs = BINARY[name]
    op = make_op(ti)
    n = len(xs)
    x = ti.field(float, n, needs_grad=True)
    z = ti.field(float, n, needs_grad=True)
    y = ti.field(float, n, needs_grad=True)

    @ti.kernel
    def run():
        for i in y:
            y[i] = op(x[i], z[i])

    w = weights(n, seed=1).astype(npfp)
    x.from_numpy(xs.astype(npfp))
    z.from_numpy(zs.astype(npfp))
    y.grad.from_numpy(w)
    run()
    run.grad()
    xv, zv, w64 = (a.astype(np.float64) for a in (x.to_numpy(), z.to_numpy(), w))
    close(x.grad.to_numpy(), w64 * d_dx(xv, zv), rtol=8 * rtol, err_msg=f"d/dx {name}")
    close(z.grad.to_numpy(), w64 * d_dz(xv, zv), rtol=8 * rtol, err_msg=f"d/dz {name}")


def test_select_routes_gradient_to_the_chosen_operand(ti, fp, npfp, rtol):
    n = N
    x = ti.field(float, n, needs_grad=True)
    z = ti.field(float, n, needs_grad=True)
    y = ti.field(float, n, needs_grad=True)

    @ti.kernel
    def run():
        for i in y:
            y[i] = ti.select(x[i] > 0, x[i] * x[i], 3 * z[i]) + ti.select(z[i] < x[i], z[i], 0.0)

    xs, zs = _points(-3, 3), _points(-3, 3)[::-1] * 0.7
    w = weights(n, seed=2).astype(npfp)
    x.from_numpy(xs.astype(npfp))
    z.from_numpy(zs.astype(npfp))
    y.grad.from_numpy(w)
    run()
    run.grad()
    xv, zv, w64 = (a.astype(np.float64) for a in (x.to_numpy(), z.to_numpy(), w))
    want_x = w64 * np.where(xv > 0, 2 * xv, 0.0)
    want_z = w64 * (np.where(xv > 0, 0.0, 3.0) + np.where(zv < xv, 1.0, 0.0))
    close(x.grad.to_numpy(), want_x, rtol=8 * rtol)
    close(z.grad.to_numpy(), want_z, rtol=8 * rtol)


def test_value_that_reaches_no_output_gives_no_gradient(ti, fp, npfp, rtol):
    """A value computed from an input but never used on the way to an output has a zero
    adjoint, and nothing of it reaches the input's gradient: not even where its own partial is
    infinite (sqrt and log at 0), which a zero adjoint multiplied in would turn into NaN."""
    x = ti.field(float, 4, needs_grad=True)
    y = ti.field(float, 4, needs_grad=True)

    @ti.func
    def roots(v):
        return ti.sqrt(v), ti.log(v)

    @ti.kernel
    def run():
        for i in x:
            t = ti.sqrt(x[i])  # noqa: F841 (never used)
            _, lg = roots(x[i])  # neither is used
            y[i] = x[i] * 2.0

    x.from_numpy(np.array([0.0, 1.0, 4.0, 0.0], dtype=npfp))
    w = weights(4, seed=3).astype(npfp)
    y.grad.from_numpy(w)
    run.grad()
    np.testing.assert_array_equal(x.grad.to_numpy(), 2.0 * w)


def test_int_cast_has_no_gradient(ti, fp, npfp, rtol):
    n = N
    x = ti.field(float, n, needs_grad=True)
    y = ti.field(float, n, needs_grad=True)

    @ti.kernel
    def run():
        for i in x:
            k = ti.cast(x[i], ti.i32)  # truncation: a constant as far as gradients go
            y[i] = ti.cast(k, float) * x[i] + ti.cast(ti.cast(x[i] * 4, ti.i64), float)

    xs = _points(-3, 3)
    w = weights(n, seed=3).astype(npfp)
    x.from_numpy(xs.astype(npfp))
    y.grad.from_numpy(w)
    run()
    run.grad()
    xv = x.to_numpy().astype(np.float64)
    close(y.to_numpy(), np.trunc(xv) * xv + np.trunc(4 * xv), rtol=8 * rtol)
    close(x.grad.to_numpy(), w.astype(np.float64) * np.trunc(xv), rtol=8 * rtol)


@pytest.mark.parametrize("src, dst", [("f32", "f64"), ("f64", "f32")])
def test_float_casts_pass_gradient(ti, src, dst):
    src_t, dst_t = getattr(ti, src), getattr(ti, dst)
    n = N
    x = ti.field(src_t, n, needs_grad=True)
    y = ti.field(dst_t, n, needs_grad=True)

    @ti.kernel
    def run():
        for i in x:
            v = ti.cast(x[i], dst_t)
            y[i] = v * v * v + ti.cast(ti.sin(x[i]), dst_t)

    xs = _points(-2, 2)
    w = weights(n, seed=4)
    x.from_numpy(xs.astype(np.float32 if src == "f32" else np.float64))
    y.grad.from_numpy(w.astype(np.float32 if dst == "f32" else np.float64))
    run()
    run.grad()
    xv = x.to_numpy().astype(np.float64)
    wv = w.astype(np.float32 if dst == "f32" else np.float64).astype(np.float64)
    assert x.grad.to_numpy().dtype == (np.float32 if src == "f32" else np.float64)
    close(x.grad.to_numpy(), wv * (3 * xv**2 + np.cos(xv)), rtol=1e-5)


def test_casts_within_default_precision_chain(ti, fp, npfp, rtol):
    """``ti.cast`` to the same float type and back through the other precision keeps the rule."""
    n = N
    x = ti.field(float, n, needs_grad=True)
    y = ti.field(float, n, needs_grad=True)

    @ti.kernel
    def run():
        for i in x:
            y[i] = ti.cast(ti.cast(x[i], ti.f64) * 2.0, float) * ti.cast(x[i], float)

    xs = _points(-2, 2)
    x.from_numpy(xs.astype(npfp))
    y.grad.fill(1)
    run()
    run.grad()
    xv = x.to_numpy().astype(np.float64)
    close(x.grad.to_numpy(), 4 * xv, rtol=8 * rtol)


@pytest.mark.difftape_only
def test_stop_grad_value(ti, fp, npfp, rtol):
    # difftape's ti.stop_grad also takes a value; Taichi's takes only a field (see below), so
    # there is no Taichi counterpart for this form.
    n = N
    x = ti.field(float, n, needs_grad=True)
    z = ti.field(float, n, needs_grad=True)
    y = ti.field(float, n, needs_grad=True)

    @ti.kernel
    def run():
        for i in x:
            y[i] = ti.stop_grad(x[i] * z[i]) * x[i] + ti.stop_grad(3.0) * z[i]

    xs, zs = _points(-2, 2), _points(-1, 1)[::-1]
    w = weights(n, seed=5).astype(npfp)
    x.from_numpy(xs.astype(npfp))
    z.from_numpy(zs.astype(npfp))
    y.grad.from_numpy(w)
    run()
    run.grad()
    xv, zv, w64 = (a.astype(np.float64) for a in (x.to_numpy(), z.to_numpy(), w))
    close(y.to_numpy(), xv * zv * xv + 3 * zv, rtol=8 * rtol)
    close(x.grad.to_numpy(), w64 * xv * zv, rtol=8 * rtol)
    close(z.grad.to_numpy(), w64 * 3, rtol=8 * rtol)


def test_stop_grad_of_a_field_covers_its_block(ti, fp, npfp, rtol):
    # Taichi's ti.stop_grad(x): no derivative through any load of x in the enclosing block
    # and the blocks nested in it, before or after the call; other blocks are unaffected.
    x = ti.field(float, 3, needs_grad=True)
    y = ti.field(float, 3, needs_grad=True)
    v = ti.Vector.field(2, float, 3, needs_grad=True)
    loss = ti.field(float, (), needs_grad=True)

    @ti.func
    def stopper():
        ti.stop_grad(x)

    @ti.kernel
    def after_the_load():
        for i in x:
            loss[None] += x[i] * y[i]
            ti.stop_grad(x)

    @ti.kernel
    def at_top_level():
        ti.stop_grad(x)
        for i in x:
            loss[None] += x[i] * y[i]

    @ti.kernel
    def inside_a_branch():
        for i in x:
            if i > 0:
                ti.stop_grad(x)
                loss[None] += x[i] * 10
            loss[None] += x[i] * y[i]

    @ti.kernel
    def in_a_func_and_a_later_loop():
        for i in x:
            loss[None] += x[i] * 100
        for i in x:
            stopper()
            loss[None] += x[i] * y[i]

    @ti.kernel
    def vector_field():
        for i in v:
            ti.stop_grad(v)
            loss[None] += v[i][0] * 2 + v[i][1] * 3 + y[i]

    xs, ys = np.array([1.0, 2.0, 3.0]), np.array([0.5, -1.0, 2.0])
    x.from_numpy(xs.astype(npfp))
    y.from_numpy(ys.astype(npfp))
    v.fill(1.0)
    cases = [(after_the_load, 0 * xs), (at_top_level, 0 * xs),
             (inside_a_branch, ys), (in_a_func_and_a_later_loop, 100 + 0 * xs)]
    for kernel, want_x in cases:
        for f in (x.grad, y.grad, v.grad):
            f.fill(0)
        with ti.ad.Tape(loss):
            kernel()
        np.testing.assert_allclose(x.grad.to_numpy(), want_x, rtol=rtol)
        np.testing.assert_allclose(y.grad.to_numpy(), xs, rtol=rtol)
    with ti.ad.Tape(loss):
        vector_field()
    np.testing.assert_array_equal(v.grad.to_numpy(), np.zeros((3, 2)))
    np.testing.assert_allclose(y.grad.to_numpy(), np.ones(3), rtol=rtol)


def test_stop_grad_of_a_field_in_forward_mode(ti, fp, npfp, rtol):
    x = ti.field(float, 3, needs_dual=True)
    y = ti.field(float, 3, needs_dual=True)
    loss = ti.field(float, (), needs_dual=True)

    @ti.kernel
    def run():
        for i in x:
            loss[None] += x[i] * y[i]
            ti.stop_grad(x)

    x.from_numpy(np.array([1.0, 2.0, 3.0], npfp))
    y.from_numpy(np.array([0.5, -1.0, 2.0], npfp))
    with ti.ad.FwdMode(loss=loss, param=x, seed=[1.0, 1.0, 1.0]):
        run()
    assert loss.dual[None] == 0.0
    loss[None] = 0
    with ti.ad.FwdMode(loss=loss, param=y, seed=[1.0, 1.0, 1.0]):
        run()
    np.testing.assert_allclose(loss.dual[None], 6.0, rtol=rtol)


@pytest.mark.difftape_only
def test_stop_grad_of_a_struct_field_or_a_view_is_refused(ti):
    # (Taichi stops only a struct field's first member, and a view's one entry.)
    s = ti.Struct.field({"a": ti.f32, "b": ti.f32}, shape=3, needs_grad=True)
    m = ti.Matrix.field(2, 2, ti.f32, shape=3, needs_grad=True)
    view = m.get_scalar_field(0, 1)

    @ti.kernel
    def struct_field():
        ti.stop_grad(s)

    @ti.kernel
    def scalar_view():
        ti.stop_grad(view)

    with pytest.raises(ti.CompileError, match=r"stop its member fields instead"):
        struct_field()
    with pytest.raises(ti.CompileError, match=r"view made by get_scalar_field"):
        scalar_view()


# ------------------------------------------------------------------ vector and matrix operations


def _field(ti, elem_shape, n):
    if elem_shape == ():
        return ti.field(float, n, needs_grad=True)
    if len(elem_shape) == 1:
        return ti.Vector.field(elem_shape[0], float, n, needs_grad=True)
    return ti.Matrix.field(elem_shape[0], elem_shape[1], float, n, needs_grad=True)


def _matrix_ops(ti):
    """Taichi-scope versions of the operations of MATRIX, each taking two arguments (unary ones
    ignore the second). They are ti.funcs because Matrix methods on field elements only exist
    inside Taichi scope."""

    @ti.func
    def norm(a, b):
        return a.norm()

    @ti.func
    def norm_eps(a, b):
        return a.norm(1e-3)

    @ti.func
    def norm_sqr(a, b):
        return a.norm_sqr()

    @ti.func
    def normalized(a, b):
        return a.normalized()

    @ti.func
    def sum_(a, b):
        return a.sum()

    @ti.func
    def trace(a, b):
        return a.trace()

    @ti.func
    def dot(a, b):
        return a.dot(b)

    @ti.func
    def cross(a, b):
        return a.cross(b)

    @ti.func
    def outer(a, b):
        return a.outer_product(b)

    @ti.func
    def elementwise(a, b):
        return a * b + a / (2 + b)

    @ti.func
    def matmul(a, b):
        return a @ b

    @ti.func
    def transpose(a, b):
        return a.transpose()

    @ti.func
    def transpose_matvec(a, b):
        return a.transpose() @ b

    @ti.func
    def scale(a, b):
        return b * a + b

    @ti.func
    def det(a, b):
        return a.determinant()

    @ti.func
    def inverse(a, b):
        return a.inverse()

    @ti.func
    def quadratic_form(a, b):
        return b.dot(a @ b)

    return {
        "norm": norm, "norm_eps": norm_eps, "norm_sqr": norm_sqr, "normalized": normalized,
        "sum": sum_, "trace": trace, "dot": dot, "cross3": cross, "cross2": cross,
        "outer": outer, "elementwise": elementwise, "matvec": matmul, "matmul": matmul,
        "transpose": transpose, "transpose_matvec": transpose_matvec, "scale": scale,
        "det2": det, "det3": det, "inverse2": inverse, "inverse3": inverse,
        "quadratic_form": quadratic_form,
    }


def _norm(v):
    return np.sqrt(np.sum(v * v))


# name: (input specs [(element shape, diagonal boost)], output element shape, NumPy equivalent)
MATRIX = {
    "norm": ([((3,), 0)], (), _norm),
    "norm_eps": ([((2,), 0)], (), lambda v: np.sqrt(v @ v + 1e-3)),
    "norm_sqr": ([((3,), 0)], (), lambda v: v @ v),
    "normalized": ([((3,), 0)], (3,), lambda v: v / _norm(v)),
    "sum": ([((2, 3), 0)], (), np.sum),
    "trace": ([((3, 3), 0)], (), np.trace),
    "dot": ([((3,), 0), ((3,), 0)], (), np.dot),
    "cross3": ([((3,), 0), ((3,), 0)], (3,), np.cross),
    "cross2": ([((2,), 0), ((2,), 0)], (), lambda a, b: a[0] * b[1] - a[1] * b[0]),
    "outer": ([((3,), 0), ((2,), 0)], (3, 2), np.outer),
    "elementwise": ([((3,), 0), ((3,), 0)], (3,), lambda a, b: a * b + a / (2 + b)),
    "matvec": ([((3, 3), 0), ((3,), 0)], (3,), lambda a, b: a @ b),
    "matmul": ([((2, 3), 0), ((3, 2), 0)], (2, 2), lambda a, b: a @ b),
    "transpose": ([((2, 3), 0)], (3, 2), np.transpose),
    "transpose_matvec": ([((3, 3), 0), ((3,), 0)], (3,), lambda a, b: a.T @ b),
    "scale": ([((3,), 0), ((), 0)], (3,), lambda a, b: b * a + b),
    "det2": ([((2, 2), 2.0)], (), np.linalg.det),
    "det3": ([((3, 3), 2.0)], (), np.linalg.det),
    "inverse2": ([((2, 2), 2.0)], (2, 2), np.linalg.inv),
    "inverse3": ([((3, 3), 2.0)], (3, 3), np.linalg.inv),
    "quadratic_form": ([((3, 3), 0), ((3,), 0)], (), lambda a, b: b @ a @ b),
}


def _random_input(rng, n, shape, diagonal):
    if shape == ():
        return rng.uniform(0.5, 2.0, size=n)
    a = rng.uniform(-1, 1, size=(n, *shape))
    if diagonal:  # keeps determinants away from zero for det / inverse
        a += diagonal * np.eye(shape[0])
    return a


@pytest.mark.parametrize("name", list(MATRIX))
def test_matrix_rule(ti, fp, npfp, rtol, name):
    specs, out_shape, np_op = MATRIX[name]
    ti_op = _matrix_ops(ti)[name]
    n = 4
    rng = np.random.default_rng(sum(map(ord, name)))
    inputs = [_random_input(rng, n, shape, diag).astype(npfp) for shape, diag in specs]
    fields = [_field(ti, shape, n) for shape, _ in specs]
    out = _field(ti, out_shape, n)
    a = fields[0]
    b = fields[-1]

    @ti.kernel
    def run():
        for i in range(n):
            out[i] = ti_op(a[i], b[i])

    for f, value in zip(fields, inputs, strict=True):
        f.from_numpy(value)
    w = weights((n, *out_shape), seed=7).astype(npfp)
    out.grad.from_numpy(w)
    run()
    run.grad()

    used = [f.to_numpy().astype(np.float64) for f in fields]
    w64 = w.astype(np.float64)
    want_out = np.stack([np_op(*(u[i] for u in used)) for i in range(n)])
    close(out.to_numpy(), want_out, rtol=64 * rtol, err_msg=f"{name} forward")
    for k, f in enumerate(fields):
        want = np.stack([
            fd_grad(lambda *args, i=i: np.sum(w64[i] * np_op(*args)), *(u[i] for u in used))[k]
            for i in range(n)
        ])
        close(f.grad.to_numpy(), want, rtol=max(64 * rtol, FD_RTOL), err_msg=f"{name} arg {k}")
