"""The CUDA runtime, a thin layer over pycuda: the device, its memory, loading our PTX.

What is here (and what is not yet):

- :func:`load_driver` imports ``pycuda.driver`` and starts the driver; every way that can fail
  (pycuda not installed, ``libcuda.so`` missing, ``cuInit`` failing, no device) becomes one
  :class:`CudaUnavailable` whose message says why and what to do. :func:`why_unavailable`
  is the same as a string, for ``ti.init``'s fallback warning.
- :func:`select_device`: the device (``DIFFTAPE_CUDA_DEVICE``, default 0), its name, memory
  and compute capability read from the device, and the PTX architecture for it (``sm_XY``,
  what ``codegen/cuda.py`` compiles for).
- :class:`DeviceAllocator`: device memory for field and ndarray storage with its bookkeeping
  (bytes in use, peak, live allocations), zeroed on allocation, host <-> device copies,
  memset, and device-to-device copies (the overflow rerun's snapshots). It holds no policy:
  ``runtime/storage.py``'s ``DeviceMemoryAllocator`` (``cuda_allocator``) makes field and
  ndarray storage from it and keeps the host mirrors coherent at its sync points, as it does
  for the simulated device memory CI runs on.
- :func:`load_module`: our PTX loaded with ``cuModuleLoadData`` (pycuda's
  ``module_from_buffer``), the entry points by name.

Not yet: launching compiled kernels from ``ti.init(arch=ti.cuda)`` (the launch context in
device memory, the simulated grid's rerun protocol with device snapshots; field storage
already comes from the program's allocator, so device-resident fields are those of
``runtime/storage.py``'s ``cuda_allocator``). Until then ``ti.init(arch=ti.cuda)`` runs on
the CPU and says so (program.py).
tests/gpu drives what is here on a real device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import DifftapeError, OptionError

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
    ``memset_d8``, ``memcpy_htod``, ``memcpy_dtoh`` and ``memcpy_dtod``), with bookkeeping.
    Allocations are zeroed, as host field storage is (``np.zeros``)."""

    drv: Any
    bytes_in_use: int = 0
    peak: int = 0
    _live: dict[int, tuple[Any, int]] = field(default_factory=dict)  # address -> (handle, n)

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
        self.drv.memset_d8(address, 0, n)
        self._live[address] = (handle, n)
        self.bytes_in_use += n
        self.peak = max(self.peak, self.bytes_in_use)
        return address

    def free(self, address: int) -> None:
        handle, n = self._live.pop(address)  # KeyError: not ours, or freed twice
        handle.free()
        self.bytes_in_use -= n

    def size(self, address: int) -> int:
        return self._live[address][1]

    @property
    def live(self) -> int:
        """How many allocations are held."""
        return len(self._live)

    def upload(self, address: int, host: np.ndarray) -> None:
        """Copy a C-contiguous host array into the block at ``address``."""
        self._check_fits(address, host)
        self.drv.memcpy_htod(address, host)

    def download(self, host: np.ndarray, address: int) -> None:
        """Copy the block at ``address`` into a C-contiguous host array (synchronous)."""
        self._check_fits(address, host)
        self.drv.memcpy_dtoh(host, address)

    def memset(self, address: int, value: int, nbytes: int) -> None:
        """Set ``nbytes`` bytes at ``address`` to ``value`` (clearing a gradient)."""
        if nbytes > self.size(address):
            raise ValueError(f"memset of {nbytes} bytes exceeds a block")
        self.drv.memset_d8(address, value, nbytes)

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """Device to device (a snapshot of what an overflowing task writes)."""
        if nbytes > min(self.size(dst), self.size(src)):
            raise ValueError(f"copy of {nbytes} bytes exceeds a block")
        self.drv.memcpy_dtod(dst, src, nbytes)

    def _check_fits(self, address: int, host: np.ndarray) -> None:
        if not host.flags.c_contiguous:
            raise ValueError("host array must be C-contiguous")
        if host.nbytes > self.size(address):
            raise ValueError(f"{host.nbytes} bytes do not fit a block of "
                             f"{self.size(address)}")

    def close(self) -> None:
        """Free everything still held."""
        for address in list(self._live):
            self.free(address)


def load_module(drv: Any, ptx: bytes, names: list[str]) -> tuple[Any, dict[str, Any]]:
    """Our PTX loaded into the current context (``cuModuleLoadData``): (the module, which
    keeps the code alive, and entry name -> function). The driver JIT-compiles the PTX for
    the device; a refusal names the kernel entry points it was loading."""
    try:
        module = drv.module_from_buffer(ptx if ptx.endswith(b"\0") else ptx + b"\0")
    except Exception as e:  # pycuda.driver.CompileError / LogicError
        raise DifftapeError(f"the CUDA driver refused the PTX of {', '.join(names)}: {e}") from e
    return module, {n: module.get_function(n) for n in names}
