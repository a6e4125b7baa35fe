"""Subnormal floats in kernels: flushed to zero, as Taichi's CPU backend does.

Taichi 1.7.4 sets the CPU's flush-to-zero mode (MXCSR.FTZ, not DAZ) for every program, with no
option to turn it off: an arithmetic result below the smallest normal number becomes a zero of
its sign, as do subnormal literals in kernels; a subnormal value that is only copied stays.
"""

import numpy as np
import pytest

TINY = {"f32": np.array([1], np.uint32).view(np.float32),  # the smallest subnormals, by bits
        "f64": np.array([1], np.uint64).view(np.float64)}


def test_subnormal_literals_and_products_are_zero(ti):
    """Taichi's own test (test_fp_flush_to_zero.py), f32 and f64 in one."""
    a = ti.field(ti.f32, shape=2)
    b = ti.field(ti.f64, shape=2)

    @ti.kernel
    def run():
        a[0] = 1e-45
        a[1] = 1e-10 * 1e-35
        b[0] = 1e-323
        x = 1e-300
        y = 1e-23
        b[1] = x * y

    run()
    assert a.to_numpy().tolist() == [0.0, 0.0]
    assert b.to_numpy().tolist() == [0.0, 0.0]


@pytest.mark.parametrize("name", ("f32", "f64"))
def test_runtime_results_flush_copies_keep(ti, name):
    dt = getattr(ti, name)
    c = ti.field(dt, shape=5)
    tiny = TINY[name]
    c.from_numpy(np.concatenate([tiny, np.zeros(4, tiny.dtype)]))

    @ti.kernel
    def run(one: dt, small: dt):
        c[1] = c[0]              # a copy: no arithmetic, the value stays
        c[2] = c[0] * one        # a subnormal result: zero
        c[3] = c[0] + c[0]
        c[4] = -small * small    # underflow from normal operands: a zero of its sign

    small = 1e-20 if name == "f32" else 1e-160
    run(1.0, small)
    got = c.to_numpy()
    assert got[1] == tiny[0]
    assert got[2:].tolist() == [0.0, 0.0, 0.0]
    assert np.signbit(got[4])


@pytest.mark.parametrize("name", ("f32", "f64"))
def test_bit_cast_of_a_constant_keeps_a_subnormal(ti, name):
    """ti.bit_cast of an integer constant moves its bits: a subnormal stays, through locals and
    vectors, as when the integer is a runtime value (it was folded into a float constant that
    the flush-to-zero mode zeroed; found by the areas fuzzer)."""
    dt, it = getattr(ti, name), ti.i32 if name == "f32" else ti.i64
    c = ti.field(dt, shape=5)
    back = ti.field(it, shape=2)

    @ti.kernel
    def run(k: it):
        x = ti.bit_cast(it(5), dt)
        c[0] = x
        c[1] = ti.bit_cast(it(7), dt)
        v = ti.Vector([ti.bit_cast(it(9), dt), 1.0])
        c[2] = v[0]
        c[3] = ti.bit_cast(k, dt)
        c[4] = x + x  # arithmetic on it: flushed
        back[0] = ti.bit_cast(x, it)
        back[1] = ti.bit_cast(ti.bit_cast(k, dt), it)

    run(3)
    bits = c.to_numpy().view(np.int32 if name == "f32" else np.int64)
    assert bits.tolist() == [5, 7, 9, 3, 0]
    assert back.to_numpy().tolist() == [5, 3]


def test_returned_products_flush(ti):
    @ti.kernel
    def mul(x: ti.f32, y: ti.f32) -> ti.f32:
        return x * y

    assert mul(1e-20, 1e-20) == 0.0
    assert mul(1e-19, 1e-19) == 0.0  # 1e-38 is below f32's smallest normal number
    assert mul(2e-19, 1e-19) == pytest.approx(2e-38, rel=1e-6)  # normal: kept


@pytest.mark.difftape_only
def test_python_arithmetic_is_not_flushed_after_a_launch(ti):
    """The mode is the kernel's own: set on entry and restored on exit, so NumPy and Python
    arithmetic on the calling thread keep their subnormals (Taichi sets it for the whole
    process)."""
    @ti.kernel
    def mul(x: ti.f32, y: ti.f32) -> ti.f32:
        return x * y

    assert mul(1e-20, 1e-20) == 0.0
    assert np.float32(1e-40) * np.float32(1.0) != 0.0
    assert np.float64(1e-320) * np.float64(1.0) != 0.0
