"""The CUDA runtime, a thin layer over pycuda: the device, its memory, loading and launching.

- :func:`load_driver` imports ``pycuda.driver`` and starts the driver; every way that can fail
  (pycuda not installed, ``libcuda.so`` missing, ``cuInit`` failing, no device) becomes one
  :class:`CudaUnavailable` whose message says why and what to do. :func:`why_unavailable`
  is the same as a string, for ``ti.init``'s fallback warning and the server's readiness.
- :func:`select_device`: the device (``DIFFTAPE_CUDA_DEVICE``, default 0), its name, memory
  and compute capability read from the device, and the PTX architecture for it (``sm_XY``,
  what ``codegen/cuda.py`` compiles for).
- :class:`DeviceAllocator`: device memory for field and ndarray storage with its bookkeeping
  (bytes in use, peak, live allocations), zeroed on allocation, host <-> device copies,
  memset, and device-to-device copies (the overflow rerun's snapshots), ordered by the
  program's stream (a ``pycuda.driver.Stream``; asynchronous where the host buffer allows),
  with events for the sync points. It holds no policy:
  ``runtime/storage.py``'s ``DeviceMemoryAllocator`` (:func:`cuda_allocator`) makes field,
  ndarray and launch-context storage from it and keeps the host mirrors coherent at its sync
  points, as it does for the simulated device memory CI runs on.
- :func:`load_module`: our PTX loaded with ``cuModuleLoadData`` (pycuda's
  ``module_from_buffer``), the entry points by name.
- :class:`CudaLauncher`: ``ti.init(arch=ti.cuda)``'s :class:`~.grid.Launcher`. It holds the
  device's primary context, loads each kernel's PTX and runs a task with ``cuLaunchKernel``
  (pycuda's ``prepared_async_call``) on the program's stream over a fixed grid, and
  synchronises with the stream (``cuStreamSynchronize``) only when ``runtime/grid.py`` asks
  for it at a sync point. Everything else of a launch (asynchrony and its sync points, the
  launch contexts in device memory, the error word and returns, the stack pool and the
  overflow rerun from device snapshots, random states) is ``runtime/grid.py``'s, the same code
  the simulated grid runs in CI.

tests/gpu drives what is here on a real device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import DifftapeError, OptionError
from .grid import Launcher
from .storage import DeviceMemoryAllocator

#: the environment variable that picks the device by ordinal
DEVICE_VAR = "DIFFTAPE_CUDA_DEVICE"
_INSTALL_HINT = "pip install 'difftape[cuda]' (pycuda, and nvidia-cuda-nvcc for libdevice)"


class CudaUnavailable(DifftapeError):
    """CUDA cannot be used in this process; the message says why."""


def load_driver() -> Any:
    """``pycuda.driver``, initialised; :class:`CudaUnavailable` naming why it cannot be."""
    try:
        import pycuda.driver as drv
    except ImportError as e:
        if isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] == "pycuda":
            raise CudaUnavailable(f"pycuda is not installed: {_INSTALL_HINT}") from e
        # pycuda's extension links libcuda.so (the NVIDIA driver): absent without a driver.
        raise CudaUnavailable(f"pycuda could not load the CUDA driver library ({e}): no "
                              "NVIDIA driver is installed here") from e
    try:
        drv.init()
    except Exception as e:  # pycuda.driver.Error and its subclasses
        raise CudaUnavailable(f"the CUDA driver did not start (cuInit: {e})") from e
    return drv


def why_unavailable() -> str | None:
    """Why CUDA cannot be used here (no pycuda, no driver, no device), or None if it can."""
    try:
        select_device(load_driver())
    except CudaUnavailable as e:
        return str(e)
    return None


@dataclass(frozen=True)
class DeviceInfo:
    ordinal: int
    name: str
    capability: tuple[int, int]
    total_memory: int  # bytes

    @property
    def arch(self) -> str:
        """The PTX target for this device: ``sm_<major><minor>``."""
        return f"sm_{self.capability[0]}{self.capability[1]}"


def select_device(drv: Any, ordinal: int | None = None) -> DeviceInfo:
    """The device to run on: ``ordinal``, else ``$DIFFTAPE_CUDA_DEVICE``, else 0."""
    count = drv.Device.count()
    if count == 0:
        raise CudaUnavailable("the CUDA driver found no device")
    if ordinal is None:
        env = os.environ.get(DEVICE_VAR, "").strip()
        try:
            ordinal = int(env) if env else 0
        except ValueError:
            raise OptionError(f"{DEVICE_VAR}={env!r}: expected a device number") from None
    if not 0 <= ordinal < count:
        raise OptionError(f"CUDA device {ordinal} does not exist: this machine has {count} "
                          f"(0 to {count - 1}; {DEVICE_VAR} picks one)")
    dev = drv.Device(ordinal)
    return DeviceInfo(ordinal, dev.name(), tuple(dev.compute_capability()), dev.total_memory())


@dataclass
class DeviceAllocator:
    """Device memory through ``drv`` (pycuda.driver, or an object with its ``mem_alloc``,
    ``memset_d8_async``, ``memcpy_htod_async``, ``memcpy_dtoh``, ``memcpy_dtod_async``,
    ``Stream``, ``Event`` and ``pagelocked_empty``), with bookkeeping, ordered by one stream
    (:attr:`stream`, the program's, which the launcher launches on). Allocations are zeroed,
    as host field storage is (``np.zeros``). Uploads, memsets and device-to-device copies are
    enqueued on the stream; a download is synchronous and its caller synchronises first
    (``runtime/storage.py``'s sync points); a block freed while the stream is busy is freed
    once it has drained (:meth:`synchronize`): a queued launch may still address it."""

    drv: Any
    bytes_in_use: int = 0
    peak: int = 0
    _live: dict[int, tuple[Any, int]] = field(default_factory=dict)  # address -> (handle, n)
    _freed: list[int] = field(default_factory=list)  # released while the stream was busy
    stream: Any = None

    def __post_init__(self) -> None:
        if self.stream is None:
            self.stream = self.drv.Stream()

    def alloc(self, nbytes: int) -> int:
        """A zeroed block of ``nbytes`` (at least 1) bytes; its device address."""
        if nbytes < 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        n = max(1, int(nbytes))
        try:
            handle = self.drv.mem_alloc(n)
        except Exception as e:  # pycuda.driver.MemoryError (cuMemAlloc)
            raise DifftapeError(f"device memory: cannot allocate {n} bytes ({e}); "
                                f"{self.bytes_in_use} bytes are in use by difftape") from e
        address = int(handle)
        self.drv.memset_d8_async(address, 0, n, self.stream)
        self._live[address] = (handle, n)
        self.bytes_in_use += n
        self.peak = max(self.peak, self.bytes_in_use)
        return address

    def free(self, address: int) -> None:
        if address not in self._live:  # not ours, or freed twice
            raise KeyError(address)
        if self.stream.is_done():
            self._free(address)
        else:
            self._freed.append(address)

    def _free(self, address: int) -> None:
        handle, n = self._live.pop(address)
        handle.free()
        self.bytes_in_use -= n

    def size(self, address: int) -> int:
        return self._live[address][1]

    @property
    def live(self) -> int:
        """How many allocations are held (those waiting for the stream to drain excluded)."""
        return len(self._live) - len(self._freed)

    def host_array(self, n: int, dtype: np.dtype) -> np.ndarray:
        """Page-locked host memory, which asynchronous uploads copy from without staging
        (its contents must then stay unchanged until the copy has run)."""
        return self.drv.pagelocked_empty(n, dtype)

    def upload(self, address: int, host: np.ndarray) -> None:
        """Copy a C-contiguous host array into the block at ``address``, stream-ordered. From
        page-locked memory the copy is asynchronous; from pageable memory (field mirrors) the
        driver stages it before returning, so the caller may change ``host`` at once."""
        self._check_fits(address, host)
        self.drv.memcpy_htod_async(address, host, self.stream)

    def download(self, host: np.ndarray, address: int) -> None:
        """Copy the block at ``address`` into a C-contiguous host array (synchronous; the
        caller has synchronised with the stream)."""
        self._check_fits(address, host)
        self.drv.memcpy_dtoh(host, address)

    def memset(self, address: int, value: int, nbytes: int) -> None:
        """Set ``nbytes`` bytes at ``address`` to ``value`` (clearing a gradient)."""
        if nbytes > self.size(address):
            raise ValueError(f"memset of {nbytes} bytes exceeds a block")
        self.drv.memset_d8_async(address, value, nbytes, self.stream)

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """Device to device (a snapshot of what an overflowing task writes)."""
        if nbytes > min(self.size(dst), self.size(src)):
            raise ValueError(f"copy of {nbytes} bytes exceeds a block")
        self.drv.memcpy_dtod_async(dst, src, nbytes, self.stream)

    def record(self) -> Any:
        """An event after everything enqueued on the stream so far."""
        return self.drv.Event().record(self.stream)

    def synchronize(self) -> None:
        """Until the stream has drained; then blocks freed meanwhile are freed."""
        self.stream.synchronize()
        if self._freed:
            freed, self._freed = self._freed, []
            for address in freed:
                self._free(address)

    def _check_fits(self, address: int, host: np.ndarray) -> None:
        if not host.flags.c_contiguous:
            raise ValueError("host array must be C-contiguous")
        if host.nbytes > self.size(address):
            raise ValueError(f"{host.nbytes} bytes do not fit a block of "
                             f"{self.size(address)}")

    def close(self) -> None:
        """Free everything still held (after the stream has drained, if it can)."""
        try:
            self.stream.synchronize()
        except Exception:  # noqa: BLE001 - a lost context: free what can be freed
            pass
        self._freed = []
        for address in list(self._live):
            self._free(address)


def load_module(drv: Any, ptx: bytes, names: list[str]) -> tuple[Any, dict[str, Any]]:
    """Our PTX loaded into the current context (``cuModuleLoadData``): (the module, which
    keeps the code alive, and entry name -> function). The driver JIT-compiles the PTX for
    the device; a refusal names the kernel entry points it was loading."""
    try:
        module = drv.module_from_buffer(ptx if ptx.endswith(b"\0") else ptx + b"\0")
    except Exception as e:  # pycuda.driver.CompileError / LogicError
        raise DifftapeError(f"the CUDA driver refused the PTX of {', '.join(names)}: {e}") from e
    return module, {n: module.get_function(n) for n in names}


def cuda_allocator(drv: Any) -> DeviceMemoryAllocator:
    """Storage in CUDA device memory through :class:`DeviceAllocator` (``drv``:
    ``pycuda.driver``)."""
    return DeviceMemoryAllocator(DeviceAllocator(drv))


#: threads per block of every launch
THREADS_PER_BLOCK = 128
#: blocks per multiprocessor: the grid-stride loop covers any range with this many threads
BLOCKS_PER_SM = 4
#: the device heap (private copies of privatized scatter targets) as a fraction of memory
HEAP_FRACTION = 8


class CudaLauncher(Launcher):
    """Launches on a CUDA device (``ti.init(arch=ti.cuda)``), for one program.

    The grid is fixed per device: :data:`BLOCKS_PER_SM` blocks of :data:`THREADS_PER_BLOCK`
    threads per multiprocessor (kernels are grid-stride loops, so any range fits; the random
    states and the stack pool are sized by it). The device heap that private copies come from
    is set to 1/:data:`HEAP_FRACTION` of the device's memory before any kernel runs (CUDA
    allows it only then). The primary context is made current on the calling thread: a
    program's kernels must be launched from the thread that made it."""

    def __init__(self, drv: Any = None, ordinal: int | None = None) -> None:
        # Function-level: codegen.cuda loads LLVM's NVPTX backend (llvmlite).
        from ..codegen.cuda import get_target

        self.drv = drv = drv or load_driver()
        self.device = select_device(drv, ordinal)
        dev = drv.Device(self.device.ordinal)
        self.context = dev.retain_primary_context()
        self.context.push()
        try:
            sms = int(dev.get_attribute(drv.device_attribute.MULTIPROCESSOR_COUNT))
            self.grid = (max(1, sms) * BLOCKS_PER_SM, THREADS_PER_BLOCK)
            try:
                drv.Context.set_limit(drv.limit.MALLOC_HEAP_SIZE,
                                      self.device.total_memory // HEAP_FRACTION)
            except Exception:  # noqa: BLE001 - a kernel already used the heap: keep its size
                pass
            self.allocator = cuda_allocator(drv)
            self.memory = self.allocator.memory
            self.target = get_target(self.device.arch)
        except BaseException:
            drv.Context.pop()
            raise
        self.name = f"CUDA device {self.device.ordinal} ({self.device.name})"

    def load(self, obj: bytes, names: list[str]) -> tuple[object, dict[str, Any]]:
        module, functions = load_module(self.drv, obj, names)
        for f in functions.values():
            f.prepare([np.uintp])  # one parameter: the launch context's device address
        return module, functions

    def launch(self, entry: Any, ctx: int) -> None:
        blocks, threads = self.grid
        try:
            entry.prepared_async_call((blocks, 1), (threads, 1, 1), self.memory.stream, ctx)
        except Exception as e:  # pycuda.driver.LaunchError / LogicError
            raise DifftapeError(f"{self.name}: cuLaunchKernel failed: {e}") from e

    def wait_stream(self, kernels: list[str]) -> None:
        try:
            self.memory.synchronize()
        except Exception as e:  # an asynchronous fault of a launch: the context is lost
            which = " or ".join(f"'{k}'" for k in dict.fromkeys(kernels)) or "a kernel"
            raise DifftapeError(f"kernel {which} failed on {self.name}: {e}; the device's "
                                "context cannot be used again: restart the process") from e

    def close(self) -> None:
        """Device memory first, then the context."""
        try:
            super().close()
        finally:
            self.drv.Context.pop()
            self.context.detach()
