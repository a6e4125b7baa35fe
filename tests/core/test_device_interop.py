"""CUDA arrays of other libraries in and out of grid programs (runtime/devicearrays.py),
without a GPU.

A fake "CUDA tensor" plays PyTorch/CuPy: its memory is device memory of the pycuda stand-in
(``ti.init(arch=ti.cuda)``) or of the simulated grid (``simulate_grid``), which are host
memory the simulation allocated, so the test can look at it directly; it exports DLPack (device
type CUDA, versioned or not, as the producer side of the protocol: the consumer's stream waits
for the tensor's own) or ``__cuda_array_interface__`` v3 (with its ``stream``). Its stream is
a deferred stream of the simulation: what is queued there runs only when something waits for
it, so a missing stream dependency leaves a producer's write unseen by our kernel, or our
write unseen by a consumer, and the test fails.
"""

import ctypes

import numpy as np
import pytest
from cuda_standin import FakeDriver, use

import difftape as ti
from difftape.errors import ArgumentError
from difftape.runtime import dlpack, program
from difftape.runtime.storage import SimulatedStream

pytestmark = pytest.mark.difftape_only


@pytest.fixture(params=["cuda-standin", "simulated-grid"])
def device(request, monkeypatch):
    """A grid program: CUDA on the pycuda stand-in, or the simulated grid."""
    if request.param == "cuda-standin":
        drv = use(monkeypatch, FakeDriver(devices=2))
        ti.init(arch=ti.cuda)
    else:
        drv = None
        ti.init(arch=ti.cpu, simulate_grid=(2, 32))
    yield drv
    ti.reset()


def _alloc(drv, nbytes: int) -> int:
    """Device memory "another library" allocated (not through difftape's allocator)."""
    if drv is not None:
        return int(drv.mem_alloc(nbytes))
    return program.get().allocator.memory.alloc(nbytes)  # (a block of the simulated device)


def _stream(drv):
    """A stream of another library (not pycuda's): a deferred stream of the simulation,
    which the stand-in's driver calls find by its handle."""
    return SimulatedStream()


class FakeCudaTensor:
    """A CUDA tensor of another library over device memory of the simulation."""

    def __init__(self, drv, shape, dtype=np.float32, ordinal=0, dlpack_ordinal=None,
                 versioned=True, readonly=False, address=None, strides=None):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        n = int(np.prod(self.shape)) * self.dtype.itemsize
        self.address = _alloc(drv, n) if address is None else address
        buf = (ctypes.c_uint8 * n).from_address(self.address)
        self.view = np.ctypeslib.as_array(buf).view(self.dtype).reshape(self.shape)
        self.stream = _stream(drv)  # the caller's (its library's current) stream
        self.ordinal = ordinal if dlpack_ordinal is None else dlpack_ordinal
        self.versioned, self.readonly, self.strides = versioned, readonly, strides
        self.deleted = 0
        self.exports = 0

    def __dlpack_device__(self):
        return (dlpack.CUDA, self.ordinal)

    def __dlpack__(self, stream=None, max_version=None):
        # The producer's part of the protocol: the consumer's stream waits for ours.
        if stream is not None and stream != -1:
            SimulatedStream.resolve(stream).wait_for_event(self.stream.record())
        self.exports += 1

        def deleted():
            self.deleted += 1
        capsule = dlpack.make_capsule(self.address, self.shape, self.dtype,
                                      (dlpack.CUDA, self.ordinal), self,
                                      self.versioned and max_version is not None,
                                      readonly=self.readonly, on_delete=deleted)
        if self.strides is not None:  # (rewrite the strides the capsule carries)
            name = b"dltensor_versioned" if self.versioned else b"dltensor"
            managed = dlpack._get_pointer(capsule, name)
            cls = dlpack.DLManagedTensorVersioned if self.versioned else dlpack.DLManagedTensor
            t = cls.from_address(managed).dl_tensor
            for k, s in enumerate(self.strides):
                t.strides[k] = s
        return capsule

    def queue(self, op):
        """An operation of the owning library, queued on its stream."""
        self.stream.enqueue(op)


class FakeInterfaceArray:
    """A CuPy-like array exporting ``__cuda_array_interface__`` v3 only."""

    def __init__(self, tensor: FakeCudaTensor, stream=True, typestr=None, version=3):
        self.t = tensor
        self.typestr = typestr or tensor.dtype.str
        self.stream = tensor.stream.handle if stream else None
        self.version = version

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.t.shape, "typestr": self.typestr,
                "data": (self.t.address, self.t.readonly), "version": self.version,
                "strides": None, "stream": self.stream}


@ti.kernel
def affine(a: ti.types.ndarray(), s: ti.f32):
    for i in a:
        a[i] = a[i] * s + 1.0


@ti.kernel
def total(a: ti.types.ndarray()) -> ti.f32:
    t = 0.0
    for i in a:
        t += a[i]
    return t


def test_a_dlpack_cuda_tensor_is_passed_in_place(device):
    t = FakeCudaTensor(device, (64,))
    t.view[:] = np.arange(64)
    seen = []
    prog = program.get()
    original = prog.allocator.memory.borrow

    def borrow(address, nbytes):  # the pointer the kernel gets is the tensor's own
        seen.append((address, nbytes))
        return original(address, nbytes)
    prog.allocator.memory.borrow = borrow
    affine(t, 2.0)
    assert seen == [(t.address, 64 * 4)]
    ti.sync()
    np.testing.assert_array_equal(t.view, np.arange(64) * 2.0 + 1.0)  # written in place
    t.view[:] = 1.0  # a write on the other side is seen by the next launch
    assert total(t) == 64.0
    assert t.deleted == t.exports == 2  # each capsule consumed and its deleter called once


def test_the_unversioned_capsule_and_vector_elements(device):
    t = FakeCudaTensor(device, (8, 3), versioned=False)
    t.view[:] = 1.0

    @ti.kernel
    def norm2(a: ti.types.ndarray(dtype=ti.math.vec3), out: ti.types.ndarray()):
        for i in a:
            out[i] = a[i].dot(a[i])

    out = FakeCudaTensor(device, (8,))
    norm2(t, out)
    ti.sync()
    np.testing.assert_array_equal(out.view, np.full(8, 3.0))


def test_a_producer_op_on_the_callers_stream_is_seen_and_our_write_by_a_consumer(device):
    t = FakeCudaTensor(device, (16,))
    t.view[:] = 0.0
    t.queue(lambda: t.view.fill(5.0))  # the producer's op, pending on its stream
    seen = []
    with ti.caller_stream(t.stream.handle):
        affine(t, 3.0)
    t.queue(lambda: seen.append(t.view.copy()))  # a consumer op queued after
    assert seen == []  # nothing waited on the host: both are still queued
    t.stream.synchronize()
    np.testing.assert_array_equal(seen[0], np.full(16, 16.0))


def test_the_cuda_array_interface_stream_orders_both_ways(device):
    t = FakeCudaTensor(device, (16,))
    t.view[:] = 0.0
    a = FakeInterfaceArray(t)
    t.queue(lambda: t.view.fill(2.0))
    affine(a, 10.0)
    seen = []
    t.queue(lambda: seen.append(t.view.copy()))
    assert seen == []
    t.stream.synchronize()
    np.testing.assert_array_equal(seen[0], np.full(16, 21.0))
    ti.sync()


def test_without_a_known_caller_stream_the_launch_has_ended_on_return(device):
    t = FakeCudaTensor(device, (16,))
    t.view[:] = 1.0
    affine(FakeInterfaceArray(t, stream=False), 2.0)  # (interface v3 with stream None)
    np.testing.assert_array_equal(t.view, np.full(16, 3.0))


def test_wrong_device_dtype_layout_and_foreign_pointers_are_refused(device):
    t = FakeCudaTensor(device, (16,), dlpack_ordinal=1)
    with pytest.raises(ArgumentError, match="on CUDA device 1; this program runs on device 0"):
        affine(t, 1.0)
    c = FakeCudaTensor(device, (16,), dtype=np.complex64)
    with pytest.raises(ArgumentError, match="complex64.*has no difftape dtype"):
        affine(c, 1.0)
    assert c.deleted == 1  # (refused after consuming: the deleter still runs)

    @ti.kernel
    def f64_only(a: ti.types.ndarray(dtype=ti.f64)):
        for i in a:
            a[i] = 1.0

    with pytest.raises(ArgumentError, match="must be an array of f64"):
        f64_only(FakeCudaTensor(device, (4,)))
    s = FakeCudaTensor(device, (4, 4), strides=(1, 4))  # a transposed view
    with pytest.raises(ArgumentError, match="strided .*contiguous"):
        affine(s, 1.0)
    host = np.zeros(16, np.float32)  # host memory claiming to be device memory
    with pytest.raises(ArgumentError, match="are not .* memory"):
        affine(FakeCudaTensor(device, (16,), address=host.ctypes.data), 1.0)
    big = FakeCudaTensor(device, (4,))  # a tensor claiming more than its allocation
    big.shape = (1 << 20,)
    with pytest.raises(ArgumentError, match="runs past its end"):
        affine(big, 1.0)
    with pytest.raises(ArgumentError, match="typestr"):
        affine(FakeInterfaceArray(FakeCudaTensor(device, (4,)), typestr="<c8"), 1.0)
    assert not host.any()


def test_memory_of_another_device_is_refused_by_the_driver(monkeypatch):
    device = use(monkeypatch, FakeDriver(devices=2))  # (the simulated grid has one device)
    ti.init(arch=ti.cuda)
    other = device.Device(1).retain_primary_context()
    other.push()
    address = int(device.mem_alloc(64))
    device.Context.pop()
    t = FakeCudaTensor(device, (16,), address=address)
    with pytest.raises(ArgumentError, match="is on CUDA device 1; the program runs on device 0"):
        affine(FakeInterfaceArray(t), 1.0)
    ti.reset()


def test_a_read_only_tensor_is_read_and_not_written(device):
    t = FakeCudaTensor(device, (8,), readonly=True)
    t.view[:] = 2.0
    assert total(t) == 16.0
    with pytest.raises(ArgumentError, match="read-only"):
        affine(t, 1.0)
    np.testing.assert_array_equal(t.view, np.full(8, 2.0))


def test_a_cuda_tensor_on_a_cpu_program_is_refused():
    ti.init(arch=ti.cpu)
    t = np.zeros(4, np.float32)

    class OnDevice:
        def __dlpack_device__(self):
            return (dlpack.CUDA, 0)

        def __dlpack__(self, **kw):
            raise AssertionError("never exported: a CPU program does not read device memory")

    with pytest.raises(ArgumentError, match="CUDA device.*move it there first"):
        affine(OnDevice(), 1.0)
    assert not t.any()
    ti.reset()


def test_a_host_array_on_a_grid_program_is_copied_in_and_back(device):
    a = np.arange(8, dtype=np.float32)
    affine(a, 2.0)
    np.testing.assert_array_equal(a, np.arange(8) * 2.0 + 1.0)


class _Exported:
    """Something that only forwards DLPack (another library holding our export)."""

    def __init__(self, source):
        self.source = source

    def __dlpack_device__(self):
        return self.source.__dlpack_device__()

    def __dlpack__(self, **kw):
        return self.source.__dlpack__(**kw)


def test_fields_and_ndarrays_export_cuda_memory_that_round_trips(device):
    x = ti.field(ti.f32, shape=16)
    x.fill(1.0)
    nd = ti.ndarray(ti.f32, shape=16)
    nd.fill(2.0)
    assert x.__dlpack_device__() == nd.__dlpack_device__() == (dlpack.CUDA, 0)
    affine(_Exported(x), 3.0)  # our export through our own import: the field's memory
    np.testing.assert_array_equal(x.to_numpy(), np.full(16, 4.0))
    view = ti.from_dlpack(_Exported(nd))  # a ti.ndarray over the ndarray's device memory
    assert view.storage.address == nd.storage.address
    affine(view, 5.0)
    np.testing.assert_array_equal(nd.to_numpy(), np.full(16, 11.0))
    view[3] = 0.0  # a host write through the view reaches the ndarray
    assert nd[3] == 0.0


def test_an_export_orders_the_consumers_stream_and_sees_its_writes(device):
    x = ti.field(ti.f32, shape=16)
    x.fill(1.0)

    @ti.kernel
    def bump():
        for i in x:
            x[i] += 1.0

    bump()  # asynchronous: still queued on our stream
    consumer = _stream(device)
    capsule = x.__dlpack__(stream=consumer.handle, max_version=(1, 0))
    view = dlpack.consume(capsule)
    assert view.address == x.storage.address and view.device == (dlpack.CUDA, 0)
    mem = np.ctypeslib.as_array((ctypes.c_float * 16).from_address(view.address))
    seen = []
    consumer.enqueue(lambda: seen.append(mem.copy()))  # the consumer reads after our bump
    consumer.enqueue(lambda: mem.fill(7.0))  # and writes
    consumer.synchronize()
    np.testing.assert_array_equal(seen[0], np.full(16, 2.0))
    np.testing.assert_array_equal(x.to_numpy(), np.full(16, 7.0))  # its write is seen
    before = dlpack.exported()
    view.release()
    assert dlpack.exported() == before - 1


def test_an_export_outlives_the_program_until_its_consumer_lets_go(device):
    x = ti.field(ti.f32, shape=8)
    x.fill(4.0)
    view = dlpack.consume(x.__dlpack__(stream=-1))
    memory = program.get().allocator.memory
    ti.sync()
    ti.reset()
    mem = np.ctypeslib.as_array((ctypes.c_float * 8).from_address(view.address))
    np.testing.assert_array_equal(mem, np.full(8, 4.0))  # still allocated, still the data
    if device is not None:
        assert view.address in device.blocks
    view.release()
    if device is not None:
        assert view.address not in device.blocks
    assert memory.bytes_in_use == 0
    ti.init(arch=ti.cuda) if device is not None else ti.init(arch=ti.cpu,
                                                              simulate_grid=(2, 32))


def test_from_torch_style_copies_of_cuda_arrays_stay_on_the_device(device):
    x = ti.field(ti.f32, shape=8)
    t = FakeCudaTensor(device, (8,))
    t.view[:] = np.arange(8)
    with ti.caller_stream(t.stream):
        x.from_jax(t)  # (the device path of from_torch/from_jax: a device-to-device copy)
    np.testing.assert_array_equal(x.to_numpy(), np.arange(8))


def test_a_tapes_reverse_launches_are_ordered_with_the_callers_stream(device):
    x = ti.field(ti.f32, 16, needs_grad=True)
    loss = ti.field(ti.f32, (), needs_grad=True)

    @ti.kernel
    def weigh(a: ti.types.ndarray()):
        for i in x:
            loss[None] += a[i] * x[i]

    t = FakeCudaTensor(device, (16,))
    t.view[:] = 3.0
    with ti.ad.Tape(loss):
        weigh(FakeInterfaceArray(t))  # (its stream: __cuda_array_interface__ v3's)
    # The reverse launch reads the tensor; the caller's next step, queued on its stream
    # after the backward pass, overwrites it: it must wait for our reverse launch.
    t.queue(lambda: t.view.fill(0.0))
    t.stream.synchronize()
    np.testing.assert_array_equal(x.grad.to_numpy(), np.full(16, 3.0))
    # ...and the backward pass runs after the caller's work queued before it (here a write
    # between the forward and the backward pass, which the Tape's rule forbids: it shows
    # that the reverse launch waited for it)
    with ti.ad.Tape(loss):
        weigh(FakeInterfaceArray(t))
        t.queue(lambda: t.view.fill(5.0))
    np.testing.assert_array_equal(x.grad.to_numpy(), np.full(16, 5.0))
