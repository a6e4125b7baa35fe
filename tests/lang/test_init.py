"""ti.init options (default_fp, default_ip, random_seed elsewhere), ti.reset and ti.sync."""

import numpy as np


def test_default_fp_f64_makes_float_fields_and_literals_f64(ti):
    ti.init(arch=ti.cpu, default_fp=ti.f64)
    x = ti.field(float, shape=2)
    assert x.dtype == ti.f64
    assert x.to_numpy().dtype == np.float64

    @ti.kernel
    def run():
        x[0] = 1.0 + 1e-10  # needs f64 to survive
        x[1] = ti.sqrt(2.0)

    run()
    assert x[0] == 1.0 + 1e-10
    assert x[1] == np.sqrt(2.0)


def test_default_fp_f32_is_the_default(ti):
    ti.init(arch=ti.cpu)
    x = ti.field(float, shape=())
    assert x.dtype == ti.f32

    @ti.kernel
    def run():
        x[None] = 1.0 + 1e-10

    run()
    assert x[None] == 1.0
    assert x.to_numpy().dtype == np.float32


def test_default_ip_i64(ti):
    ti.init(arch=ti.cpu, default_ip=ti.i64)
    x = ti.field(int, shape=())
    assert x.dtype == ti.i64

    @ti.kernel
    def run(a: int) -> int:
        b = a * 4  # int locals and args are 64-bit: no wrap-around at 2**31
        x[None] = b + 1
        return b

    assert run(2**31) == 2**33
    assert x[None] == 2**33 + 1


def test_default_ip_is_i32(ti):
    ti.init(arch=ti.cpu)
    x = ti.field(int, shape=())
    assert x.dtype == ti.i32


def test_reset_then_init_gives_a_fresh_program(ti):
    x = ti.field(ti.i32, shape=3)
    x.fill(5)

    @ti.kernel
    def total() -> ti.i32:
        s = 0
        for i in range(3):
            s += x[i]
        return s

    assert total() == 15
    ti.reset()
    ti.init(arch=ti.cpu, default_fp=ti.f64)
    y = ti.field(float, shape=3)
    assert y.dtype == ti.f64
    np.testing.assert_array_equal(y.to_numpy(), np.zeros(3))  # fresh memory, zeroed

    @ti.kernel
    def fill():
        for i in y:
            y[i] = i + 0.5

    fill()
    np.testing.assert_array_equal(y.to_numpy(), [0.5, 1.5, 2.5])


def test_init_twice_without_reset(ti):
    ti.init(arch=ti.cpu)
    ti.init(arch=ti.cpu, default_fp=ti.f64)
    x = ti.field(float, shape=())
    assert x.dtype == ti.f64


def test_sync_waits_for_kernels(ti):
    x = ti.field(ti.i32, shape=1000)

    @ti.kernel
    def fill():
        for i in x:
            x[i] = i

    fill()
    ti.sync()
    assert int(x.to_numpy().sum()) == 999 * 1000 // 2
