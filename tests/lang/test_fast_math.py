"""``ti.init(fast_math=False)``: IEEE evaluation as written, as Taichi compiles it.

By default difftape lets LLVM fuse ``a * b + c`` into one fused multiply-add (one rounding
instead of two) and takes transcendentals from libmvec's vector versions (or its own sin/cos
pair), all within a few ulp; Taichi 1.7.4 on the CPU fuses nothing and calls the scalar libm.
With ``fast_math=False`` difftape does the same as Taichi's ``fast_math=False``: products and
sums rounded one by one, and glibc's scalar ``sin``/``exp``/... , bit for bit what Python's
``math`` module computes. (DiffTaichi's chaotic scenes are compared with Taichi this way.)
"""

import math

import numpy as np
import pytest

N = 64


def _fma_probe(ti, dtype, e):
    """``a * b + c`` where a*b = 1 - 2^-2e is not representable: rounded first it is 1 and the
    sum 0; fused, the sum is exactly -2^-2e."""
    a, b, c, out = (ti.field(dtype, N) for _ in range(4))

    @ti.kernel
    def muladd():
        for i in a:
            out[i] = a[i] * b[i] + c[i]

    a.fill(1 + 2.0**-e)
    b.fill(1 - 2.0**-e)
    c.fill(-1)
    muladd()
    return out.to_numpy()


@pytest.mark.parametrize("name, e", [("f64", 30), ("f32", 13)])
def test_no_fused_multiply_add_without_fast_math(backend, name, e):
    ti = backend
    ti.init(arch=ti.cpu, fast_math=False)
    try:
        np.testing.assert_array_equal(_fma_probe(ti, getattr(ti, name), e), 0.0)
    finally:
        ti.reset()


@pytest.mark.difftape_only  # Taichi 1.7.4's CPU backend never fuses
@pytest.mark.parametrize("name, e", [("f64", 30), ("f32", 13)])
def test_fused_multiply_add_by_default(ti, name, e):
    np.testing.assert_array_equal(_fma_probe(ti, getattr(ti, name), e), -(2.0 ** (-2 * e)))


def test_transcendentals_are_libms_without_fast_math(backend):
    ti = backend
    ti.init(arch=ti.cpu, default_fp=ti.f64, fast_math=False)
    try:
        xs = np.random.default_rng(7).uniform(-40, 40, 4096)
        x = ti.field(ti.f64, xs.size)
        names = ("sin", "cos", "exp", "log", "tanh")
        outs = {n: ti.field(ti.f64, xs.size) for n in names}
        s, c, ex, lg, th = (outs[n] for n in names)

        @ti.kernel
        def run():
            for i in x:
                s[i] = ti.sin(x[i])
                c[i] = ti.cos(x[i])  # with sin of the same value: difftape's sin/cos pair
                ex[i] = ti.exp(x[i] * 0.25)
                lg[i] = ti.log(ti.abs(x[i]) + 1.0)
                th[i] = ti.tanh(x[i] * 0.1)

        x.from_numpy(xs)
        run()
        want = {"sin": [math.sin(v) for v in xs], "cos": [math.cos(v) for v in xs],
                "exp": [math.exp(v * 0.25) for v in xs],
                "log": [math.log(abs(v) + 1.0) for v in xs],
                "tanh": [math.tanh(v * 0.1) for v in xs]}
        for n in ("sin", "cos", "exp", "log"):  # glibc's, bit for bit
            np.testing.assert_array_equal(outs[n].to_numpy(), want[n], err_msg=n)
        # Taichi computes tanh from exp; ours is libm's: both within 3 ulp of the truth
        np.testing.assert_allclose(th.to_numpy(), want["tanh"], rtol=7e-16, atol=0)
    finally:
        ti.reset()

