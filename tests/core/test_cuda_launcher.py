"""ti.init(arch=ti.cuda) and the CUDA launcher (runtime/cuda.py's CudaLauncher) without a GPU.

A stand-in for pycuda.driver plays the device: its "device memory" is host memory, and the
module it loads is the simulated grid's object code (the CUDA target's lowering compiled for
the host), so a "cuLaunchKernel" (``prepared_async_call``) runs the grid thread by thread. What is
checked is everything of a CUDA program but the GPU itself: ti.init picks CUDA when a device is
found, the context is made current and released, the device heap is sized before any launch,
the grid comes from the multiprocessor count, every task is launched with the launch context's
device address and then synchronised, fields, the launch context and the random states live
in the device allocator's memory, and the results (fields, a reduction's return value, Tape and
FwdMode gradients, a bounds error) are the CPU's. tests/gpu runs the same on a real device.
"""

import gc

import numpy as np
import pytest
from cuda_standin import SMS, FakeDriver, use

import difftape as ti
from difftape.runtime import cuda as cuda_runtime
from difftape.runtime import program

pytestmark = pytest.mark.difftape_only

@pytest.fixture
def fake(monkeypatch):
    """ti.init(arch=ti.cuda) finds the stand-in device; its code is the simulated grid's."""
    yield use(monkeypatch, FakeDriver())
    ti.reset()


def _on(arch, **options):
    ti.init(arch=arch, **options)
    return program.get()


def _program(n):
    x = ti.field(ti.f64, shape=n, needs_grad=True, needs_dual=True)
    y = ti.field(ti.f64, shape=n, needs_grad=True, needs_dual=True)
    loss = ti.field(ti.f64, shape=(), needs_grad=True, needs_dual=True)

    @ti.kernel
    def square():
        for i in x:
            y[i] = ti.sin(x[i]) * x[i]

    @ti.kernel
    def total():
        for i in y:
            loss[None] += y[i] * y[i]

    @ti.kernel
    def sum_of(k: ti.i32) -> ti.f64:
        s = 0.0
        for i in range(k):
            s += x[i]
        return s

    return x, y, loss, square, total, sum_of


def _results(arch, **options):
    n = 300
    _on(arch, **options)
    x, y, loss, square, total, sum_of = _program(n)
    xs = np.linspace(-2.0, 2.0, n)
    x.from_numpy(xs)
    with ti.ad.Tape(loss=loss):
        square()
        total()
    with ti.ad.FwdMode(loss=loss, param=x, seed=[1.0] * n):
        square()
        total()
    out = (y.to_numpy(), x.grad.to_numpy(), loss.dual[None], sum_of(n), loss[None])
    ti.reset()
    return out


def test_init_cuda_runs_on_the_device_as_on_the_cpu(fake):
    prog = _on(ti.cuda)
    launcher = prog.launcher
    assert isinstance(launcher, cuda_runtime.CudaLauncher) and prog.config.arch == ti.cuda
    assert launcher.grid == (SMS * cuda_runtime.BLOCKS_PER_SM, cuda_runtime.THREADS_PER_BLOCK)
    assert fake.limits == {"MALLOC_HEAP_SIZE": (8 << 30) // cuda_runtime.HEAP_FRACTION}
    assert len(fake.contexts) == 1
    assert prog.rng.size >= launcher.grid[0] * launcher.grid[1]
    assert fake.in_device_memory(prog.rng.address)
    ti.reset()
    assert fake.contexts == [] and fake.detached == 1 and fake.blocks == {}  # all freed

    got = _results(ti.cuda)
    launches = fake.launches
    want = _results(ti.cpu)
    blocks, threads = SMS * cuda_runtime.BLOCKS_PER_SM, cuda_runtime.THREADS_PER_BLOCK
    assert launches and all(g == (blocks, 1) and b == (threads, 1, 1) for _, g, b, _ in launches)
    np.testing.assert_array_equal(got[0], want[0])  # elementwise: bit for bit
    np.testing.assert_allclose(got[1], want[1], rtol=1e-13)  # the gradient
    for g, w in zip(got[2:], want[2:], strict=True):  # reductions: summed in another order
        assert g == pytest.approx(w, rel=1e-12)
    xs = np.linspace(-2.0, 2.0, 300)
    np.testing.assert_allclose(got[1], 2 * np.sin(xs) * xs * (np.cos(xs) * xs + np.sin(xs)),
                               rtol=1e-12)


def test_the_launch_context_lives_in_device_memory(fake):
    _on(ti.cuda)
    x = ti.field(ti.i32, shape=8)

    @ti.kernel
    def fill(v: ti.i32) -> ti.i32:
        for i in x:
            x[i] = v + i
        return v * 2

    assert fill(5) == 10
    inst = fill._fast
    ctx = inst.grid.ring[0].block  # (it returns a value: synchronous, one context suffices)
    assert fake.in_device_memory(ctx.address) and fake.in_device_memory(x._storage.address)
    assert {a for _, _, _, a in fake.launches} == {ctx.address}
    np.testing.assert_array_equal(x.to_numpy(), 5 + np.arange(8))
    assert fill(7) == 14  # the argument reaches the device on each launch
    np.testing.assert_array_equal(x.to_numpy(), 7 + np.arange(8))


def test_launches_are_enqueued_on_the_stream_and_reads_wait_for_them(fake):
    """A launch with nothing to read back returns before it runs: it, the upload of its
    launch context (page-locked, from a ring of contexts) and the uploads of host writes are
    enqueued on the program's stream in order; a read waits for the stream once."""
    _on(ti.cuda)
    x = ti.field(ti.i64, shape=16)
    scale = ti.field(ti.i64, shape=())

    @ti.kernel
    def add(v: ti.i64):
        for i in x:
            x[i] += v * scale[None] + i

    scale[None] = 1
    add(0)
    ti.sync()
    syncs, stream = fake.syncs, fake.streams[-1]
    for v in range(1, 101):
        add(v)  # each launch packs its own argument while the earlier ones are pending
    scale[None] = 1000  # no sync point (no launch wrote it): uploaded after those launches
    add(1)
    assert fake.syncs == syncs and not stream.is_done() and len(fake.launches) == 102
    ring = add._fast.grid.ring
    assert 1 < len(ring) <= 64 and all(fake.in_device_memory(c.block.address) for c in ring)
    assert all(c.host.ctypes.data in fake.pinned for c in ring)
    got = x.to_numpy()
    assert fake.syncs == syncs + 1 and stream.is_done()
    np.testing.assert_array_equal(got, np.arange(16) * 102 + sum(range(101)) + 1000)


def test_a_bounds_error_on_the_device_raises_as_on_the_cpu(fake):
    assert isinstance(_on(ti.cuda, debug=True).launcher, cuda_runtime.CudaLauncher)
    x = ti.field(ti.f32, shape=4)

    @ti.kernel
    def k(j: ti.i32):
        for _ in range(1):
            x[j] = 1.0

    with pytest.raises(ti.IndexOutOfRangeError, match=r"index 9 .*out of range"):
        k(9)
    k(2)  # the error word was cleared: the next launch runs
    np.testing.assert_array_equal(x.to_numpy(), [0, 0, 1, 0])


def test_a_failed_launch_names_the_kernel_and_the_device(fake):
    _on(ti.cuda)
    x = ti.field(ti.f32, shape=4)

    @ti.kernel
    def k():
        for i in x:
            x[i] = 1.0

    k()
    ti.sync()
    k()  # asynchronous: the fault shows when the host waits for the stream
    fake.fail_next_sync = RuntimeError("cuStreamSynchronize failed: an illegal memory access")
    with pytest.raises(ti.DifftapeError, match=r"kernel 'k' failed on CUDA device 0 "
                                               r"\(Stand-in GPU\): .*illegal memory access"):
        ti.sync()
    del k  # the second launch is still queued: its code must outlive the kernel
    gc.collect()


def test_simulate_grid_with_a_device_is_refused(fake):
    with pytest.raises(ti.OptionError, match="found a CUDA device.*simulate_grid"):
        ti.init(arch=ti.cuda, simulate_grid=(2, 4))


def test_the_server_engine_runs_on_the_device_and_readiness_follows_the_same_check(fake,
                                                                                   monkeypatch):
    """``difftape serve --arch cuda``: each session's engine is a CUDA program; /readyz's
    device check is ti.init's (ok with a device, the reason without one)."""
    from difftape.server.engine import Engine
    from difftape.server.routers.health import device_check

    engine = Engine(arch="cuda", offline_cache=False)
    try:
        assert isinstance(engine.prog.launcher, cuda_runtime.CudaLauncher)
        assert fake.in_device_memory(engine.prog.rng.address)
    finally:
        engine.close()
    assert fake.contexts == [] and fake.blocks == {}
    device_check.cache_clear()
    try:
        assert device_check("cuda") == "ok" and device_check("cpu") == "ok"
        device_check.cache_clear()
        monkeypatch.setattr(cuda_runtime, "load_driver", lambda: FakeDriver.without_devices())
        assert device_check("cuda") == "arch 'cuda' cannot run here: the CUDA driver found no " \
                                       "device"
        with pytest.raises(cuda_runtime.CudaUnavailable, match="found no device"):
            Engine(arch="cuda", offline_cache=False)  # no fallback to the CPU
    finally:
        device_check.cache_clear()


def test_enable_fallback_false_refuses_without_a_device_and_runs_with_one(fake, monkeypatch):
    prog = _on(ti.cuda, enable_fallback=False)
    assert isinstance(prog.launcher, cuda_runtime.CudaLauncher)
    ti.reset()
    monkeypatch.setattr(cuda_runtime, "load_driver", lambda: FakeDriver.without_devices())
    for arch in (ti.cuda, ti.gpu):
        with pytest.raises(ti.ArchUnavailableError,
                           match=r"enable_fallback=False\): no CUDA device can be used here: "
                                 r"the CUDA driver found no device"):
            ti.init(arch=arch, enable_fallback=False)
        assert program._current is None  # no program: nothing ran on the CPU
    with pytest.raises(ti.ArchUnavailableError, match="has no vulkan backend"):
        ti.init(arch=ti.vulkan, enable_fallback=False)
    with pytest.warns(UserWarning, match="falling back to the CPU"):
        prog = _on(ti.cuda, enable_fallback=True)
    assert prog.launcher is None and prog.config.arch == ti.cpu


@pytest.mark.parametrize("fast_math", [True, False])
def test_fast_math_false_is_honoured_on_the_device(monkeypatch, fast_math):
    """ti.init(arch=ti.cuda, fast_math=False): no fused multiply-adds in the device code
    either (the NVPTX backend fuses only what the IR marks ``contract``)."""
    drv = use(monkeypatch, FakeDriver(), code="cuda")
    monkeypatch.setenv("DIFFTAPE_PTXAS", "")  # the PTX itself reaches the driver
    try:
        _on(ti.cuda, fast_math=fast_math, offline_cache=False)
        x = ti.field(ti.f32, shape=8)

        @ti.kernel
        def axpb(a: ti.f32, b: ti.f32):
            for i in x:
                x[i] = x[i] * a + b

        axpb(2.0, 1.0)
        (ptx,) = drv.loaded
        assert (b"fma.rn.f32" in ptx) == fast_math
        assert fast_math or b"mul.rn.f32" in ptx
    finally:
        ti.reset()


def test_a_server_engine_works_on_the_device_from_any_thread(fake):
    """CUDA's current context is per thread: an engine made on one thread and driven from
    others (a Ray actor's, a pool's) pushes its program's context around each op."""
    from concurrent.futures import ThreadPoolExecutor

    from difftape.server.engine import Engine

    engine = Engine(arch="cuda", offline_cache=False)
    try:
        data = np.arange(6, dtype=np.float32)

        def ops():
            engine.execute({"op": "create_field", "id": 1, "dtype": "f32", "shape": [6],
                            "needs_grad": True})
            engine.execute({"op": "write", "id": 1}, data.tobytes())
            engine.execute({"op": "fill", "id": 1, "role": "grad", "value": 2.5})
            _, out = engine.execute({"op": "read", "id": 1})
            _, grad = engine.execute({"op": "read", "id": 1, "role": "grad"})
            stats, _ = engine.execute({"op": "stats"})
            return (np.frombuffer(bytes(out), np.float32), np.frombuffer(bytes(grad), np.float32),
                    stats, fake.stack())

        with ThreadPoolExecutor(1) as pool:
            out, grad, stats, stack = pool.submit(ops).result()
        np.testing.assert_array_equal(out, data)
        np.testing.assert_array_equal(grad, 2.5)
        assert stack == []  # popped again on the worker thread
        device = stats["device"]
        held = engine.prog.allocator.memory.bytes_in_use
        assert device["program_bytes"] == held >= 2 * data.nbytes  # fields and scratch
        assert device["name"] == "Stand-in GPU" and device["memory_total"] == 8 << 30
        assert device["memory_used"] == sum(b.nbytes for b in fake.blocks.values())
        assert device["utilization"] is None  # no NVML here
        assert stats["code_loads"] == {"cubin_cached": 0, "cubin_assembled": 0, "ptx_jit": 0}
    finally:
        engine.close()
    assert fake.blocks == {}


def test_metrics_show_the_device_and_how_modules_were_loaded():
    """/metrics' figures of a CUDA server: module loads by kind (retired workers' included,
    so the counters stay monotonic) and the device as a running worker reported it."""
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from difftape.server.metrics import Metrics
    from difftape.server.worker import WorkerStats

    m = Metrics()
    m.retire(WorkerStats.from_reply({"code_loads": {"cubin_assembled": 3, "ptx_jit": 1}}))
    live = WorkerStats.from_reply({
        "code_loads": {"cubin_cached": 5},
        "device": {"name": "Stand-in GPU", "ordinal": 0, "memory_used": 1000,
                   "memory_total": 8000, "program_bytes": 640, "utilization": 37}})
    m.sessions = SimpleNamespace(live={"s": SimpleNamespace(worker=SimpleNamespace(stats=live))})
    text = generate_latest(m.registry).decode()
    for line in ('difftape_cuda_module_loads_total{how="cubin_cached"} 5.0',
                 'difftape_cuda_module_loads_total{how="cubin_assembled"} 3.0',
                 'difftape_cuda_module_loads_total{how="ptx_jit"} 1.0',
                 'difftape_device_memory_used_bytes{device="0",name="Stand-in GPU"} 1000.0',
                 'difftape_device_memory_total_bytes{device="0",name="Stand-in GPU"} 8000.0',
                 'difftape_device_utilization_percent{device="0",name="Stand-in GPU"} 37.0',
                 'difftape_device_session_bytes 640.0'):
        assert line in text, line
