"""Taichi's C-flavoured scalar operations: ``ti.raw_div``/``ti.raw_mod`` (C's truncating
division and remainder), ``ti.bit_cast``, ``ti.math.clz`` and ``ti.zero``/``ti.one``, checked
against NumPy (C semantics: ``np.fmod``, truncation) and, with the peer, against Taichi."""

import numpy as np
import pytest

PAIRS = [(-7, 2), (7, -2), (-7, -2), (7, 2), (0, 3), (-9, 3), (2**31 - 1, 10), (-2**31, 7)]


def test_raw_div_and_raw_mod_of_integers_truncate(ti):
    n = len(PAIRS)
    a = ti.field(ti.i32, n)
    b = ti.field(ti.i32, n)
    q = ti.field(ti.i32, n)
    r = ti.field(ti.i32, n)

    @ti.kernel
    def run():
        for i in a:
            q[i] = ti.raw_div(a[i], b[i])
            r[i] = ti.raw_mod(a[i], b[i])

    av = np.array([p[0] for p in PAIRS], np.int32)
    bv = np.array([p[1] for p in PAIRS], np.int32)
    a.from_numpy(av)
    b.from_numpy(bv)
    run()
    want_q = np.trunc(av.astype(np.float64) / bv).astype(np.int64)
    np.testing.assert_array_equal(q.to_numpy(), want_q)
    np.testing.assert_array_equal(r.to_numpy(), np.fmod(av, bv))  # the dividend's sign
    assert (r.to_numpy() == av - bv * q.to_numpy()).all()


def test_raw_div_of_a_float_is_true_division(ti):
    @ti.kernel
    def run(a: ti.i32, b: ti.f32) -> ti.f32:
        return ti.raw_div(a, b)

    assert run(5, 4.0) == 1.25
    assert run(-7, 2.0) == -3.5


def test_raw_div_and_raw_mod_in_python_scope_as_taichi(ti):
    # Taichi's Python-scope forms: floor division for two ints, a - b * int(a / b)
    assert ti.raw_div(-7, 2) == -4 and ti.raw_div(-7.0, 2) == -3.5
    assert ti.raw_mod(-7, 2) == -1 and ti.raw_mod(-7.5, 2.0) == -1.5


@pytest.mark.difftape_only  # Taichi 1.7.4 fails to compile raw_mod of floats (srem on floats)
def test_raw_mod_of_floats_is_fmod_with_its_derivative(ti):
    xs = np.array([-7.5, 7.5, 5.3, -0.25, 1e10 + 0.5, 3.0])
    ys = np.array([2.0, -2.0, 0.1, 0.1, 0.3, 1.5])
    x = ti.field(ti.f64, len(xs), needs_grad=True)
    y = ti.field(ti.f64, len(xs), needs_grad=True)
    out = ti.field(ti.f64, len(xs))
    loss = ti.field(ti.f64, (), needs_grad=True)

    @ti.kernel
    def run():
        for i in x:
            r = ti.raw_mod(x[i], y[i])
            out[i] = r
            loss[None] += r

    x.from_numpy(xs)
    y.from_numpy(ys)
    with ti.ad.Tape(loss):
        run()
    np.testing.assert_array_equal(out.to_numpy(), np.fmod(xs, ys))  # exact, as C's fmod
    np.testing.assert_array_equal(x.grad.to_numpy(), np.ones(len(xs)))
    np.testing.assert_array_equal(y.grad.to_numpy(), -np.trunc(xs / ys))


def test_bit_cast(ti):
    f = ti.field(ti.f32, 4)
    i = ti.field(ti.i32, 4)
    back = ti.field(ti.f32, 4)
    d = ti.field(ti.f64, ())
    u = ti.field(ti.u64, ())

    @ti.kernel
    def run():
        for k in f:
            i[k] = ti.bit_cast(f[k], ti.i32)
            back[k] = ti.bit_cast(i[k], ti.f32)
        u[None] = ti.bit_cast(d[None], ti.u64)

    fs = np.array([3.14, -0.0, 1.0, -2.5e-38], np.float32)
    f.from_numpy(fs)
    d[None] = -1.5
    run()
    np.testing.assert_array_equal(i.to_numpy(), fs.view(np.int32))
    np.testing.assert_array_equal(back.to_numpy().view(np.int32), fs.view(np.int32))
    assert u[None] == int(np.array(-1.5).view(np.uint64))


@pytest.mark.difftape_only
def test_bit_cast_needs_equal_widths(ti):
    @ti.kernel
    def run(x: ti.f32) -> ti.i64:
        return ti.bit_cast(x, ti.i64)

    with pytest.raises(ti.CompileError, match="same width"):
        run(1.0)


def test_clz(ti):
    vals = [0, 1, 2, 3, 255, 256, 2**30, 2**31 - 1, -1, -2**31]
    x = ti.field(ti.i32, len(vals))
    out = ti.field(ti.i32, len(vals))
    w = ti.field(ti.i64, ())
    wout = ti.field(ti.i32, ())

    @ti.kernel
    def run():
        for k in x:
            out[k] = ti.math.clz(x[k])
        wout[None] = ti.math.clz(w[None])

    x.from_numpy(np.array(vals, np.int32))
    w[None] = 5
    run()
    want = [32 - (v & 0xFFFFFFFF).bit_length() for v in vals]
    np.testing.assert_array_equal(out.to_numpy(), want)
    assert wout[None] == 61  # in the operand's own width


def test_zero_and_one(ti):
    out_i = ti.field(ti.i32, 2)
    out_f = ti.field(ti.f32, 2)
    vec = ti.Vector.field(3, ti.f32, ())

    @ti.kernel
    def run(a: ti.i32, b: ti.f32):
        out_i[0] = ti.zero(a)
        out_i[1] = ti.one(a)
        out_f[0] = ti.zero(b)
        out_f[1] = ti.one(b)
        v = ti.Vector([a, b, 2.5])
        vec[None] = ti.one(v) * 2 + ti.zero(v)

    run(7, -3.5)
    np.testing.assert_array_equal(out_i.to_numpy(), [0, 1])
    np.testing.assert_array_equal(out_f.to_numpy(), [0.0, 1.0])
    np.testing.assert_array_equal(vec.to_numpy(), [2.0, 2.0, 2.0])
