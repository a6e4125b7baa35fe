"""Kernels that must not take the process down or hide behind undefined values: integer
division by zero and INT_MIN // -1 (x86 traps with SIGFPE), f16 conversions (compiler-runtime
calls the JIT must resolve), float truth values, and float -> int casts of NaN and huge values
(saturating, so a bounds check on the result cannot be optimized away). Found by fuzzing the
service's IR validator."""

import numpy as np
import pytest

pytestmark = pytest.mark.difftape_only  # what Taichi does here is undefined or a crash


def test_integer_division_never_traps(ti):
    a = ti.field(ti.i32, 5)
    b = ti.field(ti.i32, 5)
    q = ti.field(ti.i32, 5)
    r = ti.field(ti.i32, 5)
    u = ti.field(ti.u32, 5)
    uq = ti.field(ti.u32, 5)
    ur = ti.field(ti.u32, 5)

    @ti.kernel
    def k():
        for i in a:
            q[i] = a[i] // b[i]
            r[i] = a[i] % b[i]
            d = ti.cast(b[i], ti.u32)
            uq[i] = u[i] // d
            ur[i] = u[i] % d

    a.from_numpy(np.array([7, -7, -2**31, 5, -9], np.int32))
    b.from_numpy(np.array([0, 2, -1, -1, 4], np.int32))
    u.from_numpy(np.array([7, 8, 9, 10, 11], np.uint32))
    k()
    np.testing.assert_array_equal(q.to_numpy(), [0, -4, -2**31, -5, -3])  # 0 for /0; wraps
    np.testing.assert_array_equal(r.to_numpy(), [0, 1, 0, 0, 3])
    np.testing.assert_array_equal(uq.to_numpy(), [0, 4, 0, 0, 2])
    np.testing.assert_array_equal(ur.to_numpy(), [0, 0, 9, 10, 3])


def test_f16_conversions_run(ti):
    d = ti.field(ti.f64, 4)
    h = ti.field(ti.f16, 4)

    @ti.kernel
    def k():
        for i in d:
            h[i] = ti.cast(d[i], ti.f16)
            d[i] = ti.cast(h[i], ti.f64) * 2

    d.from_numpy(np.array([0.5, 1.25, 3.0, 1e5]))
    k()
    np.testing.assert_array_equal(h.to_numpy(), np.array([0.5, 1.25, 3.0, np.inf], np.float16))
    np.testing.assert_array_equal(d.to_numpy(), [1.0, 2.5, 6.0, np.inf])


def test_float_truth_values_and_saturating_casts(ti):
    x = ti.field(ti.f32, 4)
    out = ti.field(ti.i32, 4)

    @ti.kernel
    def k():
        for i in x:
            out[i] = 0
            if x[i]:
                out[i] = 1
            if x[i] == 0 or x[i] != 0 and i > 1:  # `and`/`or` and `not` refuse floats
                out[i] += 10
            out[i] += ti.select(x[i], 100, 0)
            out[i] += ti.cast(x[i] * 1e30, ti.i32) // 1000000

    x.from_numpy(np.array([0.0, 1.5, np.nan, -2.0], np.float32))
    k()
    # NaN is true (x != 0), casts to 0; 1.5e30 saturates to INT32_MAX, -2e30 to INT32_MIN
    np.testing.assert_array_equal(out.to_numpy(), [10, 101 + 2147, 111, 111 - 2148])


@pytest.mark.parametrize("src,dst", [("f32", "i32"), ("f32", "u32"), ("f64", "i32"),
                                     ("f64", "i64"), ("f64", "u64"), ("f32", "i8"),
                                     ("f32", "u16"), ("f64", "u8")])
def test_vectorized_float_to_int_casts_saturate(ti, src, dst):
    # A loop of casts only: it vectorizes, so every lane takes the vector code's path.
    vals = [0.0, -0.0, 0.5, -0.5, 1.99, -1.99, 100.7, -100.7, 127.5, 128.0, -128.5, -129.0,
            255.9, 256.0, 65535.5, 65536.0, 2.0**31 - 256, 2.0**31, -2.0**31, -2.0**31 - 1024,
            2.0**32, 2.0**63, -2.0**63, 2.0**64, 1e30, -1e30, np.inf, -np.inf, np.nan, -np.nan]
    ft = np.dtype(src.replace("f", "float"))
    it = np.dtype(("uint" + dst[1:]) if dst[0] == "u" else ("int" + dst[1:]))
    a = np.resize(np.array(vals, ft), 256)  # finite values as rounded to the source type
    x = ti.field(getattr(ti, src), shape=a.size)
    out = ti.field(getattr(ti, dst), shape=a.size)

    @ti.kernel
    def k():
        for i in x:
            out[i] = ti.cast(x[i], getattr(ti, dst))

    x.from_numpy(a)
    k()
    info = np.iinfo(it)
    want = [0 if np.isnan(v) else info.min if v <= info.min else info.max if v >= info.max
            else int(np.trunc(v)) for v in a.astype(np.float64)]
    np.testing.assert_array_equal(out.to_numpy(), np.array(want, it))
