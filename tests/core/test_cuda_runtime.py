"""The CUDA runtime's logic without a device (difftape/runtime/cuda.py).

What needs a GPU is in tests/gpu. Here: how each way CUDA can be missing is reported (pycuda
not installed, the driver library missing, no device), the fallback of ti.init(arch=ti.cuda)
and ti.gpu to the CPU with a warning that names the reason (Taichi 1.7.4 also falls back, with
"Arch=[cuda] is not supported, falling back to CPU"), device selection and the architecture
taken from the compute capability, and the allocator's bookkeeping against a recording stand-in
for pycuda.driver (it checks our arithmetic, not CUDA).
"""

import builtins
import sys
import warnings

import numpy as np
import pytest

import difftape as ti
from difftape.errors import OptionError
from difftape.runtime import cuda as cuda_runtime
from difftape.runtime.storage import SimulatedStream

pytestmark = pytest.mark.difftape_only


def _hide_pycuda(monkeypatch, error: ImportError):
    real = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name.split(".")[0] == "pycuda":
            raise error
        return real(name, *args, **kwargs)

    for mod in [m for m in sys.modules if m.split(".")[0] == "pycuda"]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setattr(builtins, "__import__", fake_import)


def test_pycuda_missing_says_how_to_install(monkeypatch):
    _hide_pycuda(monkeypatch, ModuleNotFoundError("No module named 'pycuda'", name="pycuda"))
    with pytest.raises(cuda_runtime.CudaUnavailable,
                       match=r"pycuda is not installed: pip install 'difftape\[cuda\]'"):
        cuda_runtime.load_driver()
    assert "pycuda is not installed" in cuda_runtime.why_unavailable()


def test_driver_library_missing_is_named(monkeypatch):
    _hide_pycuda(monkeypatch, ImportError("libcuda.so.1: cannot open shared object file",
                                          name="pycuda._driver"))
    with pytest.raises(cuda_runtime.CudaUnavailable,
                       match=r"could not load the CUDA driver library \(libcuda.so.1: .*no "
                             r"NVIDIA driver"):
        cuda_runtime.load_driver()


class _Device:
    def __init__(self, ordinal):
        self.ordinal = ordinal

    def name(self):
        return f"Fake GPU {self.ordinal}"

    def compute_capability(self):
        return (9, 0) if self.ordinal == 0 else (7, 5)

    def total_memory(self):
        return 80 << 30


class _Driver:
    """The part of pycuda.driver runtime/cuda.py calls, recording what it is asked."""

    def __init__(self, devices=2):
        self.devices = devices
        self.memory: dict[int, bytearray] = {}
        self.next = 0x10000
        self.freed: list[int] = []
        outer = self

        class Device(_Device):
            @staticmethod
            def count():
                return outer.devices

        self.Device = Device

    def mem_alloc(self, n):
        outer = self
        address = self.next
        self.next += (n + 255) // 256 * 256
        self.memory[address] = bytearray(b"\xab" * n)  # not zeroed: the allocator must

        class Handle(int):
            def free(self):
                outer.freed.append(int(self))
                del outer.memory[int(self)]

        return Handle(address)

    # A stream runs what is enqueued only when synchronised (as the simulated grid's).
    Stream = SimulatedStream

    def memset_d8_async(self, address, value, n, stream):
        def run():
            self.memory[address][:n] = bytes([value]) * n
        stream.enqueue(run)

    def memcpy_htod_async(self, address, host, stream):
        data = host.tobytes()  # pageable: staged when called

        def run():
            self.memory[address][:len(data)] = data
        stream.enqueue(run)

    def memcpy_dtoh(self, host, address):
        host.view(np.uint8).reshape(-1)[:] = np.frombuffer(
            bytes(self.memory[address][:host.nbytes]), np.uint8)

    def memcpy_dtod_async(self, dst, src, n, stream):
        def run():
            self.memory[dst][:n] = self.memory[src][:n]
        stream.enqueue(run)


def test_device_selection_and_architecture(monkeypatch):
    drv = _Driver()
    monkeypatch.delenv(cuda_runtime.DEVICE_VAR, raising=False)
    dev = cuda_runtime.select_device(drv)
    assert (dev.ordinal, dev.name, dev.arch) == (0, "Fake GPU 0", "sm_90")
    monkeypatch.setenv(cuda_runtime.DEVICE_VAR, "1")
    assert cuda_runtime.select_device(drv).arch == "sm_75"
    monkeypatch.setenv(cuda_runtime.DEVICE_VAR, "2")
    with pytest.raises(OptionError, match=r"CUDA device 2 does not exist: this machine has 2"):
        cuda_runtime.select_device(drv)
    with pytest.raises(cuda_runtime.CudaUnavailable, match="found no device"):
        cuda_runtime.select_device(_Driver(devices=0))


def test_allocator_bookkeeping_zeroes_and_checks_sizes():
    drv = _Driver()
    mem = cuda_runtime.DeviceAllocator(drv)
    a = mem.alloc(100)
    b = mem.alloc(300)
    assert (mem.live, mem.bytes_in_use, mem.peak) == (2, 400, 400)
    out = np.ones(25, np.float32)
    mem.synchronize()  # (clears, uploads and copies are enqueued on the stream)
    mem.download(out, a)
    np.testing.assert_array_equal(out, 0)  # zeroed, whatever the driver handed out
    data = np.arange(25, dtype=np.float32)
    mem.upload(b, data)
    mem.copy(a, b, data.nbytes)
    data[:] = -1  # pageable: the upload has its own copy
    mem.download(out, a)
    np.testing.assert_array_equal(out, 0)  # not run before the host synchronises
    mem.synchronize()
    mem.download(out, a)
    np.testing.assert_array_equal(out, np.arange(25))
    c = mem.alloc(8)  # freed while its clear is queued: held until the stream drains
    mem.free(c)
    assert c in drv.memory and c not in drv.freed and mem.live == 2
    mem.synchronize()
    assert c in drv.freed and mem.bytes_in_use == 400
    with pytest.raises(ValueError, match="do not fit"):
        mem.upload(a, np.zeros(26, np.float32))
    with pytest.raises(ValueError, match="exceeds a block"):
        mem.copy(a, b, 300)
    mem.free(a)
    assert (mem.live, mem.bytes_in_use, mem.peak) == (1, 300, 408)
    with pytest.raises(KeyError):
        mem.free(a)  # freed twice
    mem.close()
    assert mem.live == 0 and mem.bytes_in_use == 0 and sorted(drv.freed) == sorted([a, b, c])


def test_field_storage_in_cuda_memory_syncs_at_the_explicit_points():
    """runtime/storage.py's allocator over the CUDA DeviceAllocator: host writes reach the
    device at sync(), a device write is downloaded on the next read, clears and copies are
    device-side, and dropped storage is freed."""
    from difftape.runtime.storage import DeviceStorage

    drv = _Driver()
    alloc = cuda_runtime.cuda_allocator(drv)
    a = alloc.storage((2, 3), np.float32)
    b = alloc.storage((2, 3), np.float32)
    assert isinstance(a, DeviceStorage) and a.address in drv.memory
    a.write()[1, 2] = 5.0
    alloc.memory.synchronize()
    assert bytes(drv.memory[a.address]) == bytes(24)  # not uploaded before the sync point
    alloc.sync()
    alloc.memory.synchronize()  # (the upload is enqueued on the stream)
    assert np.frombuffer(bytes(drv.memory[a.address]), np.float32)[5] == 5.0
    drv.memory[a.address][0:4] = np.float32(7).tobytes()  # "a kernel" writes element 0
    a.device_written()
    np.testing.assert_array_equal(a.read(), [[7, 0, 0], [0, 0, 5]])
    b.copy_from(a)  # device to device
    a.zero()
    np.testing.assert_array_equal(a.read(), 0)
    np.testing.assert_array_equal(b.read(), [[7, 0, 0], [0, 0, 5]])
    with pytest.raises(ValueError, match="read-only"):
        b.read()[0, 0] = 1  # a read view is not a way to write
    address = b.address
    del b
    assert address in drv.freed and alloc.memory.live == 1
    alloc.close()
    assert alloc.memory.live == 0


@pytest.mark.parametrize("arch", ["cuda", "gpu"])
def test_init_cuda_without_a_device_warns_why_and_runs_on_the_cpu(monkeypatch, arch):
    _hide_pycuda(monkeypatch, ModuleNotFoundError("No module named 'pycuda'", name="pycuda"))
    for var in ("TI_ARCH", "DIFFTAPE_ARCH"):
        monkeypatch.delenv(var, raising=False)
    with pytest.warns(UserWarning, match=rf"arch={arch} cannot run on a GPU here: pycuda is "
                                         r"not installed: pip install .*falling back to the CPU"):
        ti.init(arch=getattr(ti, arch))
    try:
        x = ti.field(ti.f32, shape=4)

        @ti.kernel
        def k():
            for i in x:
                x[i] = i * 2.0

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            k()
        np.testing.assert_array_equal(x.to_numpy(), np.arange(4) * 2.0)
    finally:
        ti.reset()
