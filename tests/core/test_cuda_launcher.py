"""ti.init(arch=ti.cuda) and the CUDA launcher (runtime/cuda.py's CudaLauncher) without a GPU.

A stand-in for pycuda.driver plays the device: its "device memory" is host memory, and the
module it loads is the simulated grid's object code (the CUDA target's lowering compiled for
the host), so a "cuLaunchKernel" (``prepared_call``) runs the grid thread by thread. What is
checked is everything of a CUDA program but the GPU itself: ti.init picks CUDA when a device is
found, the context is made current and released, the device heap is sized before any launch,
the grid comes from the multiprocessor count, every task is launched with the launch context's
device address and then synchronised, fields, the launch context and the random states live
in the device allocator's memory, and the results (fields, a reduction's return value, Tape and
FwdMode gradients, a bounds error) are the CPU's. tests/gpu runs the same on a real device.
"""

import ctypes

import numpy as np
import pytest

import difftape as ti
from difftape.codegen import cuda as cuda_codegen
from difftape.codegen import simgrid as simgrid_codegen
from difftape.runtime import cuda as cuda_runtime
from difftape.runtime import program
from difftape.runtime.simgrid import GRID_FN
from difftape.runtime.storage import SimulatedStream

pytestmark = pytest.mark.difftape_only

SMS = 2  # multiprocessors of the stand-in device: a grid of SMS * 4 blocks of 128 threads


class FakeDriver:
    """The part of pycuda.driver CudaLauncher and DeviceAllocator call, recording it."""

    class device_attribute:  # noqa: N801 - pycuda's name
        MULTIPROCESSOR_COUNT = "MULTIPROCESSOR_COUNT"

    class limit:  # noqa: N801 - pycuda's name
        MALLOC_HEAP_SIZE = "MALLOC_HEAP_SIZE"

    def __init__(self, devices=1):
        self.blocks: dict[int, np.ndarray] = {}
        self.launches: list[tuple] = []
        self.limits: dict[str, int] = {}
        self.current: list[object] = []  # the context stack
        self.streams: list[object] = []
        self.pinned: set[int] = set()  # host addresses of page-locked arrays
        self.syncs = 0
        self.fail_next_sync = None
        self.detached = 0
        outer = self

        class Stream(SimulatedStream):
            """A stream whose operations run only when the host synchronises (as the
            simulated grid's), so a missing sync shows."""

            def __init__(self, flags=0):
                super().__init__()
                outer.streams.append(self)

            def synchronize(self):
                outer.syncs += 1
                if outer.fail_next_sync:
                    e, outer.fail_next_sync = outer.fail_next_sync, None
                    raise e
                super().synchronize()

        class Event:
            def record(self, stream=None):
                self.mark = stream.record()
                return self

            def query(self):
                return self.mark.query()

            def synchronize(self):
                self.mark.synchronize()
                return self

        self.Stream, self.Event = Stream, Event

        class Context:
            def push(self):
                outer.current.append(self)

            def detach(self):
                outer.detached += 1

            @staticmethod
            def pop():
                outer.current.pop()

            @staticmethod
            def set_limit(which, value):
                assert outer.current, "no current context"
                outer.limits[which] = value

            @staticmethod
            def synchronize():
                raise AssertionError("the launcher synchronises its stream, not the context")

        class Device:
            def __init__(self, ordinal):
                self.ordinal = ordinal

            @staticmethod
            def count():
                return devices

            def name(self):
                return "Stand-in GPU"

            def compute_capability(self):
                return (9, 0)

            def total_memory(self):
                return 8 << 30

            def get_attribute(self, attr):
                assert attr == FakeDriver.device_attribute.MULTIPROCESSOR_COUNT
                return SMS

            def retain_primary_context(self):
                return Context()

        self.Context, self.Device = Context, Device

    @classmethod
    def without_devices(cls):
        return cls(devices=0)

    # ------------------------------------------------------------------ memory
    def mem_alloc(self, n):
        outer = self
        block = np.full(n, 0xAB, np.uint8)  # not zeroed: the allocator must
        self.blocks[block.ctypes.data] = block

        class Handle(int):
            def free(self):
                del outer.blocks[int(self)]

        return Handle(block.ctypes.data)

    def memset_d8_async(self, address, value, n, stream):
        stream.enqueue(lambda: ctypes.memset(address, value, n))

    def pagelocked_empty(self, shape, dtype):
        a = np.empty(shape, dtype)
        self.pinned.add(a.ctypes.data)
        return a

    def memcpy_htod_async(self, address, host, stream):
        if host.ctypes.data in self.pinned:  # copied when the stream runs it: keep it intact
            src, n = host.ctypes.data, host.nbytes
            stream.enqueue(lambda: ctypes.memmove(address, src, n))
        else:  # pageable: staged by the driver before the call returns
            data = host.tobytes()
            stream.enqueue(lambda: ctypes.memmove(address, data, len(data)))

    def memcpy_dtoh(self, host, address):
        ctypes.memmove(host.ctypes.data, address, host.nbytes)

    def memcpy_dtod_async(self, dst, src, n, stream):
        stream.enqueue(lambda: ctypes.memmove(dst, src, n))

    def in_device_memory(self, address):
        return any(a <= address < a + b.nbytes for a, b in self.blocks.items())

    # ------------------------------------------------------------------ modules
    def module_from_buffer(self, image):
        outer = self
        assert image.endswith(b"\0")  # cuModuleLoadData takes a NUL-terminated image
        obj = image  # (object code: a NUL after its end changes nothing)

        class Function:
            def __init__(self, name):
                self.name = name
                self.engine, addresses = simgrid_codegen.get_target().load(obj, [name])
                self.fn = GRID_FN(addresses[name])
                self.arg_types = None

            def prepare(self, arg_types):
                self.arg_types = list(arg_types)

            def prepared_async_call(self, grid, block, stream, *args):
                assert self.arg_types == [np.uintp] and len(args) == 1
                assert stream is outer.streams[-1]  # the current program's stream
                outer.launches.append((self.name, grid, block, args[0]))
                stream.enqueue(lambda: self.fn(args[0], grid[0], block[0], 0))

        class Module:
            def get_function(self, name):
                return Function(name)

        return Module()


@pytest.fixture
def fake(monkeypatch):
    """ti.init(arch=ti.cuda) finds the stand-in device; its code is the simulated grid's."""
    drv = FakeDriver()
    for var in ("TI_ARCH", "DIFFTAPE_ARCH", "DIFFTAPE_SIMULATE_GPU", cuda_runtime.DEVICE_VAR):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(cuda_runtime, "load_driver", lambda: drv)
    monkeypatch.setattr(cuda_codegen, "get_target", lambda arch: simgrid_codegen.get_target())
    yield drv
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
    assert len(fake.current) == 1
    assert prog.rng.size >= launcher.grid[0] * launcher.grid[1]
    assert fake.in_device_memory(prog.rng.address)
    ti.reset()
    assert fake.current == [] and fake.detached == 1 and fake.blocks == {}  # all freed

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
    assert fake.current == [] and fake.blocks == {}
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
