"""Whole programs on a real device: ``ti.init(arch=ti.cuda)`` alone, compared with the CPU.

Fields, a reduction with a return value, a Tape gradient, FwdMode, a bounds error and random
numbers, each run on the device (runtime/cuda.py's CudaLauncher: PTX for the device's compute
capability, the launch context, stack pool, snapshots and random states in device memory) and
on the CPU. Elementwise results are equal bit for bit where the operations are exact and to
rounding where libdevice and the CPU's libm differ; reductions to rounding (another order).
Skipped, with the reason, where there is no device (conftest.py's ``cuda`` fixture).
"""

import numpy as np
import pytest

import difftape as ti
from difftape.runtime import cuda as cuda_runtime
from difftape.runtime import program

pytestmark = pytest.mark.difftape_only


@pytest.fixture
def on(cuda, monkeypatch):
    """``on(arch, **options)``: a fresh program there (the device is real: ``cuda``)."""
    for var in ("TI_ARCH", "DIFFTAPE_ARCH", "DIFFTAPE_SIMULATE_GPU"):
        monkeypatch.delenv(var, raising=False)

    def start(arch, **options):
        ti.init(arch=arch, **options)
        prog = program.get()
        if arch == ti.cuda:
            assert isinstance(prog.launcher, cuda_runtime.CudaLauncher)
        return prog

    yield start
    ti.reset()


def _on_both(on, run, **options):
    out = []
    for arch in (ti.cuda, ti.cpu):
        on(arch, **options)
        out.append(run())
        ti.reset()
    return out


def test_fields_elementwise_and_exact(on):
    def run():
        n = 100_000
        a = ti.field(ti.i32, shape=n)
        x = ti.field(ti.f32, shape=n)
        y = ti.field(ti.f64, shape=(n // 100, 100))

        @ti.kernel
        def k():
            for i in a:
                a[i] = i * 3 - 7
                x[i] = ti.f32(i) * 0.5 + 1.0
            for i, j in y:
                y[i, j] = ti.sqrt(ti.f64(i * 100 + j))

        k()
        return a.to_numpy(), x.to_numpy(), y.to_numpy()

    gpu, cpu = _on_both(on, run)
    np.testing.assert_array_equal(gpu[0], cpu[0])
    np.testing.assert_array_equal(gpu[1], cpu[1])
    np.testing.assert_array_equal(gpu[2], cpu[2])  # sqrt is correctly rounded on both


def test_reduction_and_return_value(on):
    def run():
        n = 1 << 20
        x = ti.field(ti.f32, shape=n)
        total = ti.field(ti.f64, shape=())

        @ti.kernel
        def fill():
            for i in x:
                x[i] = ti.sin(ti.f32(i) * 1e-3)

        @ti.kernel
        def reduce() -> ti.f64:
            s = ti.f64(0.0)
            for i in x:
                s += ti.f64(x[i])
                total[None] += ti.f64(x[i])
            return s

        fill()
        return reduce(), total[None], x.to_numpy()

    gpu, cpu = _on_both(on, run)
    np.testing.assert_allclose(gpu[2], cpu[2], rtol=2e-6, atol=1e-6)  # libdevice vs libm
    want = np.sum(gpu[2].astype(np.float64))
    assert gpu[0] == pytest.approx(want, rel=1e-9, abs=1e-6)
    assert gpu[1] == pytest.approx(want, rel=1e-9, abs=1e-6)


def _loss_program(n, reps):
    x = ti.field(ti.f64, shape=n, needs_grad=True, needs_dual=True)
    loss = ti.field(ti.f64, shape=(), needs_grad=True, needs_dual=True)

    @ti.kernel
    def k():
        for i in x:
            v = x[i]
            for _ in range(reps):  # loop-carried: reverse mode needs the stack pool
                v = ti.sin(v) + 0.5 * v
            loss[None] += v * v

    return x, loss, k


def test_tape_gradient_and_fwdmode(on):
    n, reps = 4096, 200  # 200 pushes per index: the first pool (64 slots) overflows

    def run():
        x, loss, k = _loss_program(n, reps)
        x.from_numpy(np.linspace(-1.0, 1.0, n))
        with ti.ad.Tape(loss=loss):
            k()
        grad = x.grad.to_numpy()
        with ti.ad.FwdMode(loss=loss, param=x, seed=[1.0] * n):
            k()
        return grad, loss.dual[None], loss[None]

    gpu, cpu = _on_both(on, run)
    np.testing.assert_allclose(gpu[0], cpu[0], rtol=1e-12, atol=1e-14)
    assert gpu[1] == pytest.approx(cpu[1], rel=1e-11)
    assert gpu[2] == pytest.approx(cpu[2], rel=1e-11)
    assert gpu[1] == pytest.approx(np.sum(cpu[0]), rel=1e-11)  # forward == reverse


def test_bounds_error_names_index_and_field(on):
    on(ti.cuda, debug=True)
    x = ti.field(ti.f32, shape=(5, 7))

    @ti.kernel
    def k(j: ti.i32):
        for i in range(1000):
            if i == 999:
                x[j, 0] = 1.0

    with pytest.raises(ti.IndexOutOfRangeError, match=r"index 12 .*out of range"):
        k(12)
    k(3)  # the error word was cleared; the device context still works
    assert x[3, 0] == 1.0


def test_random_numbers_per_thread_reproducible(on):
    def draws(seed):
        on(ti.cuda, random_seed=seed)
        x = ti.field(ti.f64, shape=1 << 18)

        @ti.kernel
        def k():
            for i in x:
                x[i] = ti.random(ti.f64)

        k()
        out = x.to_numpy()
        ti.reset()
        return out

    a, b, c = draws(1), draws(1), draws(2)
    np.testing.assert_array_equal(a, b)  # index i always runs on thread i mod grid size
    assert not np.array_equal(a, c)
    assert 0.0 <= a.min() and a.max() < 1.0
    assert abs(a.mean() - 0.5) < 0.01 and abs(a.var() - 1 / 12) < 0.01
    assert len(np.unique(a)) > 0.99 * len(a)  # threads do not repeat each other's draws
