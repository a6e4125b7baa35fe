"""Scalar math builtins, powers, rounding, min/max/clamp, compared with NumPy."""

import numpy as np
import pytest

UNARY = {
    # ti.<name>: (NumPy reference, input range)
    "sin": (np.sin, (-4.0, 4.0)),
    "cos": (np.cos, (-4.0, 4.0)),
    "tan": (np.tan, (-1.4, 1.4)),
    "asin": (np.arcsin, (-0.99, 0.99)),
    "acos": (np.arccos, (-0.99, 0.99)),
    "tanh": (np.tanh, (-5.0, 5.0)),
    "exp": (np.exp, (-10.0, 10.0)),
    "log": (np.log, (1e-3, 1e3)),
    "sqrt": (np.sqrt, (0.0, 100.0)),
    "rsqrt": (lambda x: 1.0 / np.sqrt(x), (1e-2, 100.0)),
    "abs": (np.abs, (-3.0, 3.0)),
}


def test_unary_math_functions(ti, fp, npfp, rtol):
    names = tuple(UNARY)
    ops = tuple(getattr(ti, name) for name in names)
    n = 257
    x = ti.field(float, shape=(len(names), n))
    y = ti.field(float, shape=(len(names), n))

    @ti.kernel
    def run():
        for k, op in ti.static(enumerate(ops)):
            for i in range(n):
                y[k, i] = op(x[k, i])

    xs = np.stack([np.linspace(lo, hi, n) for _, (lo, hi) in UNARY.values()]).astype(npfp)
    x.from_numpy(xs)
    run()
    got = y.to_numpy()
    for k, (name, (reference, _)) in enumerate(UNARY.items()):
        # rsqrt may be an approximation; everything else should be within a few ulp
        scale = 100 if name == "rsqrt" else 4
        want = reference(xs[k].astype(np.float64))
        np.testing.assert_allclose(
            got[k], want, rtol=scale * rtol, atol=scale * rtol, err_msg=f"ti.{name}"
        )


def test_atan2_covers_all_quadrants(ti, fp, rtol):
    n = 64
    y = ti.field(float, shape=n)
    x = ti.field(float, shape=n)
    out = ti.field(float, shape=n)

    @ti.kernel
    def run():
        for i in out:
            out[i] = ti.atan2(y[i], x[i])

    angles = np.linspace(-np.pi + 0.01, np.pi - 0.01, n)
    radii = np.linspace(0.5, 3.0, n)
    y_np, x_np = radii * np.sin(angles), radii * np.cos(angles)
    y.from_numpy(y_np)
    x.from_numpy(x_np)
    run()
    np.testing.assert_allclose(out.to_numpy(), np.arctan2(y_np, x_np), rtol=4 * rtol, atol=rtol)


def test_float_powers(ti, fp, rtol):
    @ti.kernel
    def run(a: float, n: ti.i32, e: float) -> ti.types.vector(5, float):
        return ti.Vector([a**n, a**e, ti.pow(a, n), a**-2, a**3])

    cases = [(2.0, 10, 0.5), (1.5, -3, 2.5), (-2.0, 3, 2.0), (-2.0, 2, 0.5), (3.0, -1, -0.5)]
    for a, n, e in cases:
        # a negative base with a fractional exponent gives NaN, as in C and NumPy
        with np.errstate(invalid="ignore"):
            want = [a**n, np.power(a, e), a**n, a**-2, a**3]
        np.testing.assert_allclose(run(a, n, e), want, rtol=4 * rtol)
    assert np.isnan(run(-2.0, 2, 0.5)[1])


def test_integer_powers_stay_integer(ti):
    @ti.kernel
    def run(a: ti.i32, n: ti.i32) -> ti.types.vector(3, ti.i32):
        return ti.Vector([a**n, a**2, ti.pow(a, n)])

    for a, n in [(3, 4), (-2, 3), (7, 0), (2, 30), (-1, 7)]:
        np.testing.assert_array_equal(run(a, n), [a**n, a**2, a**n])

    @ti.kernel
    def int_base_float_exponent(a: ti.i32) -> float:
        return a**-1.0

    assert int_base_float_exponent(4) == 0.25


def test_an_integer_exponent_keeps_the_bases_type(ti):
    # Taichi: "if the exponent is an integral value, the result type takes the type of the
    # base" -- an i8 power wraps at 8 bits, an i32 one at 32 (difftape promoted: 243, 4.9e9)
    @ti.kernel
    def run(n: ti.i32, m: ti.i64) -> ti.types.vector(3, ti.i64):
        return ti.Vector([ti.cast(ti.cast(3, ti.i8) ** n, ti.i64), ti.cast(70000 ** m, ti.i64),
                          ti.cast(ti.cast(200, ti.u8) ** n, ti.i64)])

    assert list(run(5, 2)) == [np.int8(-13), np.int32(605032704), (200**5) % 256]
    assert list(run(0, 1)) == [1, 70000, 1]


def test_negative_runtime_exponent_of_an_integer_raises_in_debug_mode(ti):
    # an integer has no negative integer powers: Taichi raises in debug mode (outside it the
    # value is undefined); difftape returned 1 silently in both
    ti.init(arch=ti.cpu, debug=True)

    @ti.kernel
    def run(a: ti.i32, n: ti.i32) -> ti.i32:
        return a**n

    @ti.kernel
    def run64(a: ti.i64, n: ti.i64) -> ti.i64:
        return ti.pow(a, n)

    assert run(3, 4) == 81 and run(-2, 0) == 1 and run64(-3, 3) == -27
    error = getattr(ti, "KernelAssertionError", None) or ti.TaichiAssertionError
    for call, args in ((run, (2, -1)), (run, (1, -3)), (run64, (5, -2))):
        with pytest.raises(error, match="(?i)negative exponent"):
            call(*args)


def test_floor_ceil_round(ti, fp):
    xs = [-2.5, -1.5, -0.5, -0.49, 0.0, 0.49, 0.5, 1.5, 2.5, 2.51, 3.7, -3.7]

    @ti.kernel
    def run(a: float) -> ti.types.vector(3, float):
        return ti.Vector([ti.floor(a), ti.ceil(a), ti.round(a)])

    @ti.kernel
    def run_int(a: float) -> ti.types.vector(3, ti.i32):
        return ti.Vector([ti.floor(a, ti.i32), ti.ceil(a, ti.i32), ti.round(a, ti.i32)])

    for a in xs:
        # ti.round rounds half away from zero (C round()), unlike Python's round-half-to-even
        half_away = np.sign(a) * np.floor(abs(a) + 0.5)
        want = [np.floor(a), np.ceil(a), half_away]
        np.testing.assert_array_equal(run(a), want)
        np.testing.assert_array_equal(run_int(a), want)


def test_round_does_not_add_one_half(ti):
    @ti.kernel
    def run(a: ti.f32) -> ti.f32:
        return ti.round(a)

    # the largest f32 below 0.5: floor(a + 0.5) would give 1 here
    assert run(float(np.nextafter(np.float32(0.5), np.float32(0)))) == 0.0


def test_min_max_with_two_and_more_arguments(ti, fp, rtol):
    @ti.kernel
    def run(a: float, b: float, c: float) -> ti.types.vector(6, float):
        return ti.Vector(
            [ti.min(a, b), ti.max(a, b), ti.min(a, b, c), ti.max(a, b, c), min(a, c), max(b, c)]
        )

    for a, b, c in [(1.0, 2.0, 3.0), (-1.5, -2.5, 0.25), (5.0, 5.0, -5.0), (0.0, -0.0, 1e-3)]:
        want = [min(a, b), max(a, b), min(a, b, c), max(a, b, c), min(a, c), max(b, c)]
        np.testing.assert_allclose(run(a, b, c), want, rtol=rtol)


def test_min_max_integers_and_mixed_types(ti, fp):
    @ti.kernel
    def ints(a: ti.i32, b: ti.i32) -> ti.types.vector(3, ti.i32):
        return ti.Vector([ti.max(a, b), ti.min(a, b, 0), max(a, b, 100)])

    @ti.kernel
    def mixed(a: ti.i32, b: float) -> float:
        return ti.max(a, b)  # promoted to float

    @ti.kernel
    def builtin_abs(a: ti.i32, b: float) -> float:
        return abs(a) * 10 + abs(b)

    np.testing.assert_array_equal(ints(3, -4), [3, -4, 100])
    np.testing.assert_array_equal(ints(-7, 200), [200, -7, 200])
    assert mixed(3, 2.5) == 3.0
    assert mixed(2, 2.5) == 2.5
    assert builtin_abs(-3, -0.5) == 30.5


def test_clamp(ti, fp, rtol):
    x = ti.field(float, shape=41)
    y = ti.field(float, shape=41)

    @ti.kernel
    def run():
        for i in x:
            y[i] = ti.math.clamp(x[i], -0.5, 0.75)

    xs = np.linspace(-2, 2, 41)
    x.from_numpy(xs)
    run()
    np.testing.assert_allclose(y.to_numpy(), np.clip(xs, -0.5, 0.75), rtol=rtol)

    @ti.kernel
    def clamp_int(a: ti.i32) -> ti.i32:
        return ti.math.clamp(a, 0, 10)

    assert [clamp_int(v) for v in (-3, 0, 4, 10, 12)] == [0, 0, 4, 10, 10]


def test_math_on_vectors_is_elementwise(ti, fp, rtol):
    v = ti.Vector.field(4, float, shape=())
    out = ti.Vector.field(4, float, shape=6)

    @ti.kernel
    def run():
        a = v[None]
        out[0] = ti.sin(a)
        out[1] = ti.exp(a) * 2
        out[2] = ti.sqrt(abs(a))
        out[3] = ti.floor(a * 3)
        out[4] = ti.max(a, 0.1)
        out[5] = a**2

    a = np.array([-1.2, -0.1, 0.4, 2.3])
    v.from_numpy(a)
    run()
    want = [np.sin(a), np.exp(a) * 2, np.sqrt(np.abs(a)), np.floor(a * 3), np.maximum(a, 0.1), a**2]
    np.testing.assert_allclose(out.to_numpy(), want, rtol=4 * rtol)


def test_complex_helpers_match_numpy(ti):
    # Taichi's ti.math complex numbers as 2-vectors (mandelbrot_zoom.py iterates
    # z = cmul(z, z) + c); the truth is NumPy's complex arithmetic.

    vals = [complex(1.5, -0.5), complex(-2.0, 0.75), complex(0.25, 3.0)]
    names = ["cmul", "cdiv", "cconj", "cinv", "cexp", "clog", "csqrt", "cpow"]
    out = ti.Vector.field(2, ti.f64, shape=(len(names), len(vals)))

    @ti.kernel
    def run(a: ti.types.vector(2, ti.f64), b: ti.types.vector(2, ti.f64), j: ti.i32):
        out[0, j] = ti.math.cmul(a, b)
        out[1, j] = ti.math.cdiv(a, b)
        out[2, j] = ti.math.cconj(a)
        out[3, j] = ti.math.cinv(a)
        out[4, j] = ti.math.cexp(a)
        out[5, j] = ti.math.clog(a)
        out[6, j] = ti.math.csqrt(a)
        out[7, j] = ti.math.cpow(a, 2.5)

    for j, a in enumerate(vals):
        b = vals[(j + 1) % len(vals)]
        run(ti.Vector([a.real, a.imag]), ti.Vector([b.real, b.imag]), j)
    got = out.to_numpy()
    for j, a in enumerate(vals):
        b = vals[(j + 1) % len(vals)]
        want = [a * b, a / b, a.conjugate(), 1 / a, np.exp(a), np.log(a), np.sqrt(a), a ** 2.5]
        for k, w in enumerate(want):
            np.testing.assert_allclose(got[k, j], [w.real, w.imag], rtol=1e-5, atol=1e-6,
                                       err_msg=names[k])


def test_transcendentals_on_f16_compute_in_f32_and_round_once(ti):
    # libm has no half functions: as Taichi, the argument is widened to f32, the f32 function
    # runs, and the result is rounded to f16 once (a refusal before)
    xs = np.array([0.1, -0.75, 1.5, 2.875, -3.0, 0.0], np.float16)
    names = ("sin", "cos", "tanh", "exp", "log", "sqrt", "atan2", "pow")
    h = ti.field(ti.f16, shape=len(xs))
    out = ti.field(ti.f16, shape=(len(names), len(xs)))

    @ti.kernel
    def k():
        for i in h:
            a = h[i]
            out[0, i] = ti.sin(a)
            out[1, i] = ti.cos(a)
            out[2, i] = ti.tanh(a)
            out[3, i] = ti.exp(a)
            out[4, i] = ti.log(ti.abs(a) + ti.f16(1.0))
            out[5, i] = ti.sqrt(ti.abs(a))
            out[6, i] = ti.atan2(a, ti.f16(0.5))
            out[7, i] = ti.pow(ti.abs(a), ti.f16(1.5))

    h.from_numpy(xs)
    k()
    x = xs.astype(np.float32)
    want = np.array([np.sin(x), np.cos(x), np.tanh(x), np.exp(x),
                     np.log((np.abs(xs) + np.float16(1)).astype(np.float32)),  # an f16 add
                     np.sqrt(np.abs(x)), np.arctan2(x, np.float32(0.5)),
                     np.power(np.abs(x), np.float32(1.5))]).astype(np.float16)
    got = out.to_numpy()
    assert got.dtype == np.float16
    # one rounding of an f32 result: equal, or one f16 ulp apart where f32 libm and NumPy
    # differ in the last f32 bit right at an f16 rounding boundary
    ulp = np.spacing(np.abs(want)).astype(np.float32)
    bad = np.abs(got.astype(np.float32) - want.astype(np.float32)) > ulp
    assert not bad.any(), (np.nonzero(bad), got[bad], want[bad])
