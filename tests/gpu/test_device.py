"""On a real device: the CUDA runtime's pieces (runtime/cuda.py) and our PTX, launched.

The kernels are difftape kernels compiled by the CUDA target (codegen/cuda.py) for the
device's own compute capability, loaded with cuModuleLoadData and launched by hand over a
launch context in device memory laid out as the CPU's (codegen/layout.py); the results are
compared with NumPy.
"""

import numpy as np
import pytest

import difftape as ti
from difftape.codegen import cuda as cuda_target
from difftape.codegen.layout import ctx_layout
from difftape.codegen.llvm_lowering import Lowering
from difftape.ir.passes import run_pipeline
from difftape.runtime import cuda as cuda_runtime
from difftape.runtime import grid, program

pytestmark = pytest.mark.difftape_only


@pytest.fixture
def prog():
    ti.init(arch=ti.cpu)
    yield program.get()
    ti.reset()


def test_device_and_its_architecture(cuda):
    drv, device = cuda
    major, minor = drv.Device(device.ordinal).compute_capability()
    assert device.arch == f"sm_{major}{minor}"
    assert device.total_memory > 0


def test_allocator_round_trip_and_bookkeeping(cuda):
    drv, _ = cuda
    mem = cuda_runtime.DeviceAllocator(drv)
    a = mem.alloc(4096)
    b = mem.alloc(4096)
    assert mem.live == 2 and mem.bytes_in_use == 8192
    out = np.ones(1024, np.float32)
    mem.download(out, a)
    np.testing.assert_array_equal(out, 0)  # zeroed, as host storage
    data = np.arange(1024, dtype=np.float32)
    mem.upload(a, data)
    mem.copy(b, a, data.nbytes)
    mem.download(out, b)
    np.testing.assert_array_equal(out, data)
    mem.close()
    assert mem.live == 0 and mem.bytes_in_use == 0 and mem.peak == 8192


def _launch(drv, device, ir, arrays, blocks=4, threads=64, cubin=False):
    """Compile ``ir`` for the device, put ``arrays`` (one per buffer slot) in device memory,
    run every task over ``blocks x threads`` and read the arrays back. ``cubin``: load the
    cubin ptxas makes of the PTX (the compile cache's path) rather than the PTX."""
    target = cuda_target.get_target(device.arch)
    layout = ctx_layout(ir)
    low = Lowering(ir, layout, target)
    ptx = target.compile(low.module())
    names = target.entry_names(low)
    if cubin:
        assembler = cuda_runtime.Assembler(device.arch, cuda_runtime.driver_cuda_version(drv),
                                           None, cuda_runtime.CodeLoads())
        if assembler.jit_reason is not None:
            pytest.skip(f"no cubin here: {assembler.jit_reason}")
        ptx = assembler.cubin(ptx, names)
        assert cuda_runtime.is_cubin(ptx)
    module, functions = cuda_runtime.load_module(drv, ptx, names)
    mem = cuda_runtime.DeviceAllocator(drv)
    ctx = np.zeros(max(1, layout.size), np.int64)
    blocks_of = []
    for slot, arr in enumerate(arrays):
        address = mem.alloc(arr.nbytes)
        mem.upload(address, np.ascontiguousarray(arr))
        ctx[layout.buffer_ptr[slot]] = address
        blocks_of.append(address)
    ctx[layout.status] = mem.alloc(8 * grid.STATUS_WORDS)  # unclaimed: the tasks run
    ctx_dev = mem.alloc(ctx.nbytes)
    mem.upload(ctx_dev, ctx)
    mem.synchronize()  # (uploads are enqueued on the allocator's stream)
    for name in names:
        functions[name](np.uintp(ctx_dev), block=(threads, 1, 1), grid=(blocks, 1))
    drv.Context.synchronize()
    mem.download(ctx, ctx_dev)
    out = [np.empty_like(a) for a in arrays]
    for o, address in zip(out, blocks_of, strict=True):
        mem.download(o, address)
    mem.close()
    del module
    return out, ctx, layout


@pytest.mark.parametrize("cubin", [False, True], ids=["ptx-jit", "cubin"])
def test_a_kernel_runs_on_the_device_as_on_the_cpu(cuda, prog, cubin):
    drv, device = cuda
    n = 10_000
    x = ti.field(ti.f32, shape=n)
    y = ti.field(ti.f32, shape=n)

    @ti.kernel
    def k():
        for i in x:
            y[i] = ti.sin(x[i]) * 2.0 + 1.0

    xs = np.linspace(-3, 3, n).astype(np.float32)
    ir = run_pipeline(k.build_ir(prog, (), "primal"))
    slots = {b.name: s for s, b in enumerate(ir.buffers)}
    arrays = [None, None]
    arrays[slots["x"]] = xs
    arrays[slots["y"]] = np.zeros(n, np.float32)
    out, ctx, layout = _launch(drv, device, ir, arrays, cubin=cubin)
    assert ctx[layout.err_code] == 0
    np.testing.assert_allclose(out[slots["y"]], np.sin(xs.astype(np.float64)) * 2 + 1,
                               rtol=2e-6, atol=2e-6)


def test_many_threads_failing_report_one_failure_whole(cuda, prog):
    """The error word on a device: threads of whole warps fail at once; the code and the
    value reported belong to one failing index (compare-and-swap, llvm_lowering)."""
    drv, device = cuda
    n, m, count = 5, 7, 1 << 14
    x = ti.field(ti.f64, shape=(n, m))

    @ti.kernel
    def k():
        for i in range(count):
            if i % 2 == 0:
                x[n + i, 0] = 1.0
            else:
                x[0, m + i] = 1.0

    ir = k.build_ir(prog, (), "primal")
    ir.debug = True
    ir = run_pipeline(ir)
    from difftape.ir.assertfmt import assert_messages

    messages = assert_messages(ir)
    for _ in range(10):
        _, ctx, layout = _launch(drv, device, ir, [np.zeros((n, m))], blocks=64, threads=128)
        code, value = int(ctx[layout.err_code]), int(ctx[layout.err_value])
        axis = 0 if "axis 0" in messages[code - 1].template[-1] else 1
        i = value - (n if axis == 0 else m)
        assert 0 <= i < count and i % 2 == axis, (axis, value)
