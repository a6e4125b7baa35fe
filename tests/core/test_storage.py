"""Field and ndarray storage behind the program's allocator (difftape/runtime/storage.py).

On the CPU storage is host memory: one NumPy array that kernels address and Python scope reads
and writes in place. On the simulated grid it is simulated device memory: separate blocks that
only kernels address, with host mirrors synchronised at explicit points and poisoned (NaN)
while stale, so a path that skips a sync point computes a wrong answer here, on the CPU, as it
would on a GPU. Each test checks values against NumPy."""

import ctypes
import gc

import numpy as np
import pytest

import difftape as ti
from difftape.errors import ArgumentError, DifftapeError
from difftape.runtime import program
from difftape.runtime.storage import DeviceStorage, HostStorage

pytestmark = pytest.mark.difftape_only

GRID = (2, 4)


@pytest.fixture
def sim():
    ti.init(arch=ti.cpu, simulate_grid=GRID)
    yield program.get()
    ti.reset()


@pytest.fixture
def host():
    ti.init(arch=ti.cpu, simulate_grid=0)
    yield program.get()
    ti.reset()


def _device_bytes(storage) -> np.ndarray:
    """What the (simulated) device memory holds now, bypassing every sync point."""
    out = np.empty(storage.shape, storage.dtype)
    ctypes.memmove(out.ctypes.data, storage.address, out.nbytes)
    return out


def test_host_storage_is_the_array_kernels_address(host):
    x = ti.field(ti.f32, shape=5)
    assert isinstance(x.storage, HostStorage)
    assert x.storage.address == x.storage.array.ctypes.data

    @ti.kernel
    def k():
        for i in x:
            x[i] = i * 1.5

    k()
    np.testing.assert_array_equal(x.storage.read(), np.arange(5) * 1.5)
    assert x.storage.read() is x.storage.array  # no copy, no sync


def test_simulated_device_memory_is_separate_and_synced_explicitly(sim):
    x = ti.field(ti.f32, shape=8)
    y = ti.field(ti.f32, shape=8)
    assert isinstance(x.storage, DeviceStorage)
    assert x.storage.address != x.storage.read().ctypes.data  # not the host mirror
    x[3] = 2.0
    assert _device_bytes(x.storage)[3] == 0  # uploaded at the next sync point, not before

    @ti.kernel
    def double():
        for i in x:
            y[i] = 2 * x[i] + 1

    double()
    assert _device_bytes(x.storage)[3] == 0  # the upload is queued before the launch
    ti.sync()
    assert _device_bytes(x.storage)[3] == 2.0
    assert np.isnan(y.storage._mirror).all()  # stale host copy: poisoned
    want = np.ones(8, np.float32)
    want[3] = 5
    np.testing.assert_array_equal(y.to_numpy(), want)  # downloaded on read
    assert y[3] == 5.0
    with pytest.raises(ValueError, match="read-only"):
        y.storage.read()[0] = 1  # reads are not a way to write


def test_python_scope_writes_and_bulk_ops_reach_the_device(sim):
    x = ti.Vector.field(3, ti.f32, shape=4)
    y = ti.Vector.field(3, ti.f32, shape=4)
    s = ti.field(ti.f32, shape=())

    @ti.kernel
    def total():
        for i in x:
            s[None] += x[i].sum() + 10 * y[i].sum()

    a = np.arange(12, dtype=np.float32).reshape(4, 3)
    x.from_numpy(a)
    y.fill(1)
    total()
    assert s[None] == pytest.approx(a.sum() + 10 * 12)
    y.copy_from(x)  # device to device
    s[None] = 0
    total()
    assert s[None] == pytest.approx(11 * a.sum())
    np.testing.assert_array_equal(y.to_numpy(), a)


def test_element_write_through_after_a_launch_writes_one_entry(sim):
    x = ti.Vector.field(3, ti.i32, shape=2)

    @ti.kernel
    def set_all(v: ti.i32):
        for i in x:
            x[i] = ti.Vector([v, v, v])

    v = x[0]  # a vector that writes through to x[0]
    set_all(4)
    v[1] = 9  # x[0][1] only: the kernel's values stay in the other entries
    np.testing.assert_array_equal(x.to_numpy(), [[4, 9, 4], [4, 4, 4]])


def test_numpy_arguments_are_staged_and_copied_back(sim):
    @ti.kernel
    def scale(a: ti.types.ndarray(), b: ti.types.ndarray()):
        for i in a:
            b[i] = 3 * a[i]

    a = np.arange(6, dtype=np.float64)
    b = np.zeros(6)
    scale(a, b)
    np.testing.assert_array_equal(b, 3 * a)
    frozen = np.zeros(6)
    frozen.flags.writeable = False
    with pytest.raises(ArgumentError, match="read-only"):
        scale(a, frozen)


def test_ndarrays_live_in_device_memory(sim):
    nd = ti.Vector.ndarray(2, ti.f32, shape=3)
    assert isinstance(nd.storage, DeviceStorage)

    @ti.kernel
    def k(v: ti.types.ndarray(dtype=ti.math.vec2)):
        for i in v:
            v[i] = v[i] + ti.Vector([i, 10 * i])

    nd[2] = [1, 1]
    k(nd)
    e = nd[1]
    e[0] = -1  # write-through of one entry
    k(nd)
    np.testing.assert_array_equal(nd.to_numpy(), [[0, 0], [0, 20], [5, 41]])
    live = program.get().allocator.memory.live
    del nd, e
    gc.collect()
    assert program.get().allocator.memory.live == live - 1  # freed with its ndarray


def test_tape_gradients_on_device_storage(sim):
    x = ti.field(ti.f64, shape=6, needs_grad=True)
    loss = ti.field(ti.f64, shape=(), needs_grad=True)

    @ti.kernel
    def f():
        for i in x:
            loss[None] += x[i] ** 3

    xs = np.linspace(-1, 2, 6)
    x.from_numpy(xs)
    for _ in range(2):  # the second Tape clears the gradients on the device first
        with ti.ad.Tape(loss):
            f()
    np.testing.assert_allclose(x.grad.to_numpy(), 3 * xs**2, rtol=1e-12)
    assert loss[None] == pytest.approx((xs**3).sum())


def test_sharing_host_memory_is_refused_for_device_storage(sim):
    """Device storage is exported as CUDA memory (tests/core/test_device_interop.py), never
    as host memory; a host array is not viewed by a device program."""
    torch = pytest.importorskip("torch", reason="the [torch] extra (PyTorch) is not installed")
    x = ti.field(ti.f32, shape=4)
    assert x.__dlpack_device__() == (2, 0)  # (it used to refuse: now CUDA device memory)
    with pytest.raises(BufferError, match="CUDA memory of device 0"):
        x.__dlpack__(dl_device=(1, 0))  # a host view of it asked for
    with pytest.raises(DifftapeError, match="device memory"):
        ti.from_dlpack(torch.zeros(3))


def test_graphs_replay_on_device_storage_and_save_as_on_the_cpu(sim, tmp_path):
    """A graph on the simulated grid replays as graph executables over device memory
    (runtime/gridgraph.py; it used to be refused). GraphBuilder builds the same graphs;
    saving one is refused for what the CPU refuses (ndarray arguments), not for the grid
    (saved graphs on a grid: tests/core/test_grid_graph.py)."""
    from difftape.errors import GraphError

    @ti.kernel
    def fill(pos: ti.types.ndarray(dtype=ti.f32, ndim=1), v: ti.f32):
        for i in range(4):
            pos[i] = v + i

    builder = ti.graph.GraphBuilder()
    builder.dispatch(fill, ti.graph.Arg(ti.graph.ArgKind.NDARRAY, "pos", ti.f32, ndim=1),
                     ti.graph.Arg(ti.graph.ArgKind.SCALAR, "v", ti.f32))
    g = builder.compile()
    a = ti.ndarray(ti.f32, shape=4)
    g.run({"pos": a, "v": 2.5})
    np.testing.assert_array_equal(a.to_numpy(), [2.5, 3.5, 4.5, 5.5])
    assert g.instantiations == 1
    with pytest.raises(GraphError, match="takes ndarray arguments; saved graphs address "
                                         "fields only"):
        g.save(str(tmp_path / "g.json"))


def test_reset_releases_device_memory():
    ti.init(arch=ti.cpu, simulate_grid=GRID)
    prog = program.get()
    x = ti.field(ti.f32, shape=100)
    assert prog.allocator.memory.bytes_in_use >= 400
    ti.reset()
    assert prog.allocator.memory.live == 0
    del x  # (its storage's finalizer finds the allocator closed)


def test_destroyed_tree_frees_device_memory(sim):
    """SNodeTree.destroy() frees its fields' device memory, also after kernels used (and
    wrote) them: a compiled kernel does not keep a field's storage alive. The kernel that
    used them is refused; the program's other fields keep working."""
    mem = program.get().allocator.memory
    y = ti.field(ti.f32, shape=3)
    fb = ti.FieldsBuilder()
    x = ti.field(ti.f32, needs_grad=True)
    fb.dense(ti.i, 1000).place(x, x.grad)
    tree = fb.finalize()

    @ti.kernel
    def fill_x():
        for i in x:
            x[i] = i
            x.grad[i] = 1

    @ti.kernel
    def fill_y():
        for i in y:
            y[i] = 2 * i + 1

    fill_x()
    fill_y()
    np.testing.assert_array_equal(x.to_numpy()[:4], [0, 1, 2, 3])
    before = mem.bytes_in_use
    tree.destroy()
    gc.collect()
    assert mem.bytes_in_use == before - 2 * 1000 * 4  # x and x.grad
    with pytest.raises(DifftapeError, match="destroyed"):
        fill_x()
    fill_y()
    np.testing.assert_array_equal(y.to_numpy(), [1, 3, 5])
