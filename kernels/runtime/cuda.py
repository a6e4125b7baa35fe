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
- :class:`Assembler`: the compiled-code cache's device half. The PTX (cached like CPU
  objects, ``runtime/cache.py``, the compute capability being part of the CUDA target's
  fingerprint) is assembled offline by ``ptxas`` into a cubin for the device's architecture,
  cached on disk under a key of the PTX, the architecture, ptxas's version and the driver's
  version; a warm process or a restarted server loads the cubin and runs neither LLVM nor
  ptxas nor the driver's JIT. Where ptxas is absent, does not know the device's architecture,
  or comes from a newer CUDA major version than the driver (which cannot load its cubins),
  the PTX is loaded through the driver's JIT instead: a documented path, said once in the
  log when the program starts and counted (:class:`CodeLoads`, the server's /metrics).
- :func:`load_module`: a cubin or our PTX loaded with ``cuModuleLoadData`` (pycuda's
  ``module_from_buffer``), the entry points by name.
- :class:`CudaLauncher`: ``ti.init(arch=ti.cuda)``'s :class:`~.grid.Launcher`. It holds the
  device's primary context, loads each kernel's PTX and runs a task with ``cuLaunchKernel``
  (pycuda's ``prepared_async_call``) on the program's stream over a fixed grid, and
  synchronises with the stream (``cuStreamSynchronize``) only when ``runtime/grid.py`` asks
  for it at a sync point. Everything else of a launch (asynchrony and its sync points, the
  launch contexts in device memory, the error word and returns, the stack pool and the
  overflow rerun from device snapshots, random states) is ``runtime/grid.py``'s, the same code
  the simulated grid runs in CI.

- :class:`CudaGraphExec`: a captured ``ti.graph``'s device segment (``runtime/gridgraph.py``)
  as a CUDA graph: the segment's launches, copies and memsets enqueued on a capture stream
  between ``cuStreamBeginCapture`` and ``cuStreamEndCapture``, instantiated once
  (``cuGraphInstantiateWithFlags``), launched with ``cuGraphLaunch`` on the program's stream;
  new copy/memset addresses are applied by capturing again and ``cuGraphExecUpdate`` on the
  instantiated graph (its kernel nodes never change: they read their launch contexts from
  device memory, which the host updates with one copy before the launch). pycuda has no
  graph API; these seven calls are bound with ctypes on ``libcuda`` (:class:`CudaDriverApi`,
  which already binds what pycuda lacks), not through NVIDIA's ``cuda-bindings``: that would
  be a second driver binding with its own handle types to convert pycuda's streams and
  functions into, versioned against the toolkit, for seven calls whose C signatures have been
  stable since CUDA 11.4 (``cuGraphExecUpdate`` changed in 12.0: both are handled).

tests/gpu drives what is here on a real device.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import hashlib
import os
import re
import subprocess
import tempfile
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ArchUnavailableError, DifftapeError, OptionError
from . import cache
from .grid import GraphExec, Launcher
from .log import logger
from .storage import DeviceMemoryAllocator, SharedMemory

#: the environment variable that picks the device by ordinal
DEVICE_VAR = "DIFFTAPE_CUDA_DEVICE"
_INSTALL_HINT = "pip install 'difftape[cuda]' (pycuda, and nvidia-cuda-nvcc for libdevice)"


class CudaUnavailable(ArchUnavailableError):
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


#: ``CUevent_flags``: no timing (the cheapest event, for ordering only)
_CU_EVENT_DISABLE_TIMING = 2
#: ``CUpointer_attribute``: the device a pointer's memory is on
_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
#: ``CUstreamCaptureMode``: capture only what the capturing thread enqueues
_CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1
#: ``CUresult`` of a ``cuGraphExecUpdate`` that the graph's changes do not allow
CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE = 910


class _UpdateResultInfo(ctypes.Structure):
    """``CUgraphExecUpdateResultInfo`` (CUDA 12's ``cuGraphExecUpdate``)."""

    _fields_ = [("result", ctypes.c_int), ("errorNode", ctypes.c_void_p),
                ("errorFromNode", ctypes.c_void_p)]


class CudaDriverApi:
    """The CUDA driver calls pycuda does not offer for handles it did not make (another
    library's stream, a pointer into memory another library allocated), through ctypes on
    ``libcuda``, the library pycuda itself links: what ``runtime/storage.py``'s
    ``SharedMemory`` needs. Called with the program's context current."""

    def __init__(self, lib: Any = None) -> None:
        if lib is None:
            name = ctypes.util.find_library("cuda") or "libcuda.so.1"
            lib = ctypes.CDLL(name)
        self.lib = lib
        self._event = ctypes.c_void_p()  # one event, re-recorded: a wait takes its state then

    def _call(self, what: str, rc: int) -> None:
        if rc:
            raise DifftapeError(f"{what} failed (CUDA error {rc})")

    def wait_stream(self, waiting: int, on: int) -> None:
        """Stream ``waiting`` runs what it is given from now on after what stream ``on`` has
        been given so far: ``cuEventRecord`` on ``on``, ``cuStreamWaitEvent`` on ``waiting``
        (no host wait)."""
        lib = self.lib
        if not self._event.value:
            self._call("cuEventCreate", lib.cuEventCreate(ctypes.byref(self._event),
                                                          _CU_EVENT_DISABLE_TIMING))
        self._call("cuEventRecord", lib.cuEventRecord(self._event, ctypes.c_void_p(on)))
        self._call("cuStreamWaitEvent", lib.cuStreamWaitEvent(ctypes.c_void_p(waiting),
                                                              self._event, 0))

    def address_range(self, address: int) -> tuple[int, int] | None:
        """(base, size) of the device allocation holding ``address``, or None when it lies
        in none (``cuMemGetAddressRange``)."""
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        rc = self.lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size),
                                              ctypes.c_uint64(address))
        return None if rc else (base.value, size.value)

    def pointer_ordinal(self, address: int) -> int:
        """The device the memory at ``address`` is on (-1: not device memory)."""
        ordinal = ctypes.c_int()
        rc = self.lib.cuPointerGetAttribute(ctypes.byref(ordinal),
                                            _CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                            ctypes.c_uint64(address))
        return -1 if rc else ordinal.value

    # ------------------------------------------------------------------ CUDA graphs
    def begin_capture(self, stream: int) -> None:
        """``cuStreamBeginCapture``: what this thread enqueues on ``stream`` from now on is
        recorded into a graph, not run."""
        self._call("cuStreamBeginCapture", self.lib.cuStreamBeginCapture_v2(
            ctypes.c_void_p(stream), _CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))

    def end_capture(self, stream: int) -> int:
        """``cuStreamEndCapture``: the graph recorded since :meth:`begin_capture`."""
        graph = ctypes.c_void_p()
        self._call("cuStreamEndCapture", self.lib.cuStreamEndCapture(ctypes.c_void_p(stream),
                                                                     ctypes.byref(graph)))
        return graph.value

    def instantiate(self, graph: int) -> int:
        """``cuGraphInstantiateWithFlags``: an executable graph of ``graph``."""
        exe = ctypes.c_void_p()
        self._call("cuGraphInstantiateWithFlags", self.lib.cuGraphInstantiateWithFlags(
            ctypes.byref(exe), ctypes.c_void_p(graph), ctypes.c_ulonglong(0)))
        return exe.value

    def exec_update(self, exe: int, graph: int) -> bool:
        """``cuGraphExecUpdate``: ``exe`` takes ``graph``'s node parameters (same topology);
        False where CUDA finds the change not allowed in place."""
        lib = self.lib
        try:
            update = lib.cuGraphExecUpdate_v2  # CUDA 12: (exec, graph, result info)
        except AttributeError:
            update = None
        if update is not None:
            rc = update(ctypes.c_void_p(exe), ctypes.c_void_p(graph),
                        ctypes.byref(_UpdateResultInfo()))
        else:  # CUDA 11: (exec, graph, error node, result)
            rc = lib.cuGraphExecUpdate(ctypes.c_void_p(exe), ctypes.c_void_p(graph),
                                       ctypes.byref(ctypes.c_void_p()),
                                       ctypes.byref(ctypes.c_int()))
        if rc == CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE:
            return False
        self._call("cuGraphExecUpdate", rc)
        return True

    def launch_graph(self, exe: int, stream: int) -> None:
        """``cuGraphLaunch``: the whole graph enqueued on ``stream``."""
        self._call("cuGraphLaunch", self.lib.cuGraphLaunch(ctypes.c_void_p(exe),
                                                           ctypes.c_void_p(stream)))

    def destroy_graph(self, graph: int) -> None:
        self._call("cuGraphDestroy", self.lib.cuGraphDestroy(ctypes.c_void_p(graph)))

    def destroy_exec(self, exe: int) -> None:
        self._call("cuGraphExecDestroy", self.lib.cuGraphExecDestroy(ctypes.c_void_p(exe)))


def load_driver_api() -> CudaDriverApi:
    """The raw driver calls (:class:`CudaDriverApi`), loaded when first needed (the first
    foreign array or export of a program)."""
    return CudaDriverApi()


@dataclass
class DeviceAllocator(SharedMemory):
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
    ordinal: int = 0  # the device's
    _api: Any = None
    what = "CUDA device"

    def __post_init__(self) -> None:
        if self.stream is None:
            self.stream = self.drv.Stream()
        self._init_shared()

    @property
    def api(self) -> Any:
        """The raw driver calls of shared memory (:func:`load_driver_api`, on first use)."""
        if self._api is None:
            self._api = load_driver_api()
        return self._api

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
        entry = self._live.get(address)
        return entry[1] if entry is not None else self.borrowed_size(address)

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
        """Free everything still held (after the stream has drained, if it can) but the
        blocks an export still views (freed when it ends: :meth:`unpin`)."""
        try:
            self.stream.synchronize()
        except Exception:  # noqa: BLE001 - a lost context: free what can be freed
            pass
        self._freed = []
        self._borrowed.clear()
        self._closed = True
        for address in list(self._live):
            if address not in self._pinned:
                self._free(address)

    def _free_after_close(self, address: int) -> None:
        if address in self._live:
            self._free(address)


def load_module(drv: Any, image: bytes, names: list[str]) -> tuple[Any, dict[str, Any]]:
    """A cubin, or our PTX, loaded into the current context (``cuModuleLoadData``): (the
    module, which keeps the code alive, and entry name -> function). PTX is JIT-compiled by
    the driver for the device (the driver wants it NUL-terminated); a refusal names the
    kernel entry points it was loading."""
    if not is_cubin(image) and not image.endswith(b"\0"):
        image += b"\0"
    try:
        module = drv.module_from_buffer(image)
    except Exception as e:  # pycuda.driver.CompileError / LogicError
        what = "cubin" if is_cubin(image) else "PTX"
        raise DifftapeError(f"the CUDA driver refused the {what} of {', '.join(names)}: "
                            f"{e}") from e
    return module, {n: module.get_function(n) for n in names}


#: ELF's machine number for CUDA (``e_machine``): what ptxas writes in a cubin
EM_CUDA = 190


def is_cubin(image: bytes) -> bool:
    """Is ``image`` a cubin (a CUDA ELF object) rather than PTX text?"""
    return image[:4] == b"\x7fELF" and int.from_bytes(image[18:20], "little") == EM_CUDA


@dataclass
class CodeLoads:
    """How a program's CUDA modules were loaded: counters for the log and the server's
    /metrics (``difftape_cuda_module_loads{how=...}``)."""

    cubin_cached: int = 0  # a cubin from the cache: no ptxas, no JIT
    cubin_assembled: int = 0  # ptxas ran (then the cubin was cached)
    ptx_jit: int = 0  # the PTX through the driver's JIT (why: ``Assembler.jit_reason``)

    def as_dict(self) -> dict[str, int]:
        return {"cubin_cached": self.cubin_cached, "cubin_assembled": self.cubin_assembled,
                "ptx_jit": self.ptx_jit}


def _version_text(version: int | tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


def driver_cuda_version(drv: Any) -> tuple[int, int]:
    """The CUDA version the driver supports (``cuDriverGetVersion``: 12040 is 12.4)."""
    v = int(drv.get_driver_version())
    return v // 1000, v % 1000 // 10


@functools.cache
def ptxas_release(ptxas: str) -> tuple[tuple[int, int], str, frozenset[str]]:
    """ptxas's CUDA release ``(major, minor)``, its full version line, and the ``sm_*``
    architectures it assembles for (from its help; empty when the help does not list them).
    Asked once per process."""
    out = subprocess.run([ptxas, "--version"], capture_output=True, text=True,
                         timeout=60).stdout
    m = re.search(r"release (\d+)\.(\d+), (V[\w.]+)", out)
    if m is None:
        raise DifftapeError(f"{ptxas} --version did not name a CUDA release: {out.strip()!r}")
    help_text = subprocess.run([ptxas, "--help"], capture_output=True, text=True,
                               timeout=60).stdout
    arches = frozenset(re.findall(r"'(sm_\d+[af]?)'", help_text))
    return (int(m[1]), int(m[2])), f"ptxas {m[1]}.{m[2]} {m[3]}", arches


class Assembler:
    """PTX to a cubin for one device with ``ptxas``, through the compile cache (see the
    module doc). ``jit_reason`` is None when cubins are made, else why the PTX goes through
    the driver's JIT instead."""

    def __init__(self, arch: str, driver: tuple[int, int], directory: Path | None,
                 loads: CodeLoads) -> None:
        # Function-level: codegen.cuda loads LLVM's NVPTX backend (llvmlite).
        from ..codegen.cuda import find_ptxas

        self.arch, self.driver, self.directory, self.loads = arch, driver, directory, loads
        self.ptxas = find_ptxas()
        self.version = ""
        self.jit_reason: str | None = None
        if self.ptxas is None:
            self.jit_reason = ("no ptxas found (pip install 'difftape[cuda]' for the "
                               "nvidia-cuda-nvcc wheel's, or a CUDA toolkit; DIFFTAPE_PTXAS "
                               "names one)")
            return
        release, self.version, arches = ptxas_release(self.ptxas)
        if arches and arch not in arches:
            self.jit_reason = (f"{self.ptxas} ({self.version}) is older than this device "
                               f"needs: it cannot assemble for {arch}")
        elif release[0] > driver[0]:
            self.jit_reason = (f"{self.ptxas} ({self.version}) is newer than the driver "
                               f"(CUDA {_version_text(driver)}), which cannot load its cubins")

    def key(self, ptx: bytes) -> str:
        """The cubin's cache key: the PTX (itself keyed like a CPU object, compute capability
        included), the architecture, ptxas's version and the driver's."""
        h = hashlib.sha256(f"cubin\0{self.arch}\0{self.version}\0"
                           f"{_version_text(self.driver)}\0".encode())
        h.update(ptx)
        return h.hexdigest()

    def cubin(self, ptx: bytes, names: list[str]) -> bytes | None:
        """The cubin of ``ptx`` (cached, else assembled and cached), or None where it goes
        through the JIT (``jit_reason``, or ptxas refused it: said in the log)."""
        if self.jit_reason is not None:
            return None
        key = self.key(ptx)
        cubin = cache.load(key, self.directory, suffix="cubin")
        if cubin is not None:
            self.loads.cubin_cached += 1
            return cubin
        with tempfile.TemporaryDirectory(prefix="difftape-ptxas-") as tmp:
            src, out = Path(tmp, "module.ptx"), Path(tmp, "module.cubin")
            src.write_bytes(ptx.rstrip(b"\0"))
            r = subprocess.run([self.ptxas, f"--gpu-name={self.arch}", str(src), "-o", str(out)],
                               capture_output=True, text=True)
            if r.returncode != 0:
                logger.warning("difftape: ptxas refused the PTX of %s (%s); loading it through "
                               "the CUDA driver's JIT", ", ".join(names),
                               (r.stderr or r.stdout).strip()[:500])
                return None
            cubin = out.read_bytes()
        self.loads.cubin_assembled += 1
        cache.store(key, cubin, self.directory, suffix="cubin")
        return cubin


def cuda_allocator(drv: Any, ordinal: int = 0) -> DeviceMemoryAllocator:
    """Storage in CUDA device memory through :class:`DeviceAllocator` (``drv``:
    ``pycuda.driver``) on device ``ordinal``."""
    return DeviceMemoryAllocator(DeviceAllocator(drv, ordinal=ordinal))


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
    program's kernels must be launched from the thread that made it, or inside
    :meth:`bound` (the server's engines: each op runs there, on whichever thread)."""

    def __init__(self, drv: Any = None, ordinal: int | None = None,
                 cache_directory: Path | None = None) -> None:
        # Function-level: codegen.cuda loads LLVM's NVPTX backend (llvmlite).
        from ..codegen.cuda import get_target

        self.drv = drv = drv or load_driver()
        self.device = select_device(drv, ordinal)
        dev = drv.Device(self.device.ordinal)
        self.context = dev.retain_primary_context()
        self.context.push()
        self._owner = threading.get_ident()  # the context stays current on this thread
        self._bound = threading.local()
        try:
            sms = int(dev.get_attribute(drv.device_attribute.MULTIPROCESSOR_COUNT))
            self.grid = (max(1, sms) * BLOCKS_PER_SM, THREADS_PER_BLOCK)
            try:
                drv.Context.set_limit(drv.limit.MALLOC_HEAP_SIZE,
                                      self.device.total_memory // HEAP_FRACTION)
            except Exception:  # noqa: BLE001 - a kernel already used the heap: keep its size
                pass
            self.allocator = cuda_allocator(drv, self.device.ordinal)
            self.memory = self.allocator.memory
            self.target = get_target(self.device.arch)
        except BaseException:
            drv.Context.pop()
            raise
        self.name = f"CUDA device {self.device.ordinal} ({self.device.name})"
        self.loads = CodeLoads()
        self.assembler = Assembler(self.device.arch, driver_cuda_version(drv), cache_directory,
                                   self.loads)
        if self.assembler.jit_reason is None:
            where = cache_directory or "memory only (offline_cache=False)"
            logger.info("difftape: %s: kernels assembled by %s for %s; cubins cached in %s",
                        self.name, self.assembler.version, self.device.arch, where)
        else:
            logger.warning("difftape: %s: PTX loaded through the CUDA driver's JIT: %s; each "
                           "new process compiles every kernel again", self.name,
                           self.assembler.jit_reason)

    @contextlib.contextmanager
    def bound(self) -> Iterator[None]:
        """The program's context current on the calling thread for the block (CUDA's current
        context is per thread): pushed and popped on any thread but the one that made the
        program, where it always is (so this costs nothing there). Nests."""
        if threading.get_ident() == self._owner or getattr(self._bound, "depth", 0):
            yield
            return
        self.context.push()
        self._bound.depth = 1
        try:
            yield
        finally:
            self._bound.depth = 0
            self.drv.Context.pop()

    def status(self) -> dict[str, Any]:
        """The device in figures for the server's /metrics and /readyz: name, memory used
        and total (the driver's ``mem_get_info``: every process on the device), the memory
        this program holds, and utilisation (percent, from NVML where ``nvidia-ml-py`` is
        importable, else None)."""
        with self.bound():
            free, total = self.drv.mem_get_info()
        return {"name": self.device.name, "ordinal": self.device.ordinal,
                "memory_used": int(total - free), "memory_total": int(total),
                "program_bytes": int(self.allocator.memory.bytes_in_use),
                "utilization": nvml_utilization(self.device.ordinal)}

    def load(self, obj: bytes, names: list[str]) -> tuple[object, dict[str, Any]]:
        """``obj`` is the PTX: its cubin where ptxas makes one (see :class:`Assembler`),
        else the PTX through the driver's JIT."""
        cubin = self.assembler.cubin(obj, names)
        loaded = None
        if cubin is not None:
            try:
                loaded = load_module(self.drv, cubin, names)
            except DifftapeError as e:
                logger.warning("difftape: %s; loading its PTX through the CUDA driver's JIT", e)
        if loaded is None:
            loaded = load_module(self.drv, obj, names)
            self.loads.ptx_jit += 1
        module, functions = loaded
        for f in functions.values():
            f.prepare([np.uintp])  # one parameter: the launch context's device address
        return module, functions

    def launch(self, entry: Any, ctx: int, stream: Any = None) -> None:
        """``entry`` over the grid on the program's stream (or ``stream``: a capture)."""
        blocks, threads = self.grid
        try:
            entry.prepared_async_call((blocks, 1), (threads, 1, 1),
                                      stream or self.memory.stream, ctx)
        except Exception as e:  # pycuda.driver.LaunchError / LogicError
            raise DifftapeError(f"{self.name}: cuLaunchKernel failed: {e}") from e

    def instantiate(self, nodes: list[tuple]) -> CudaGraphExec:
        """A CUDA graph of ``nodes`` (:class:`CudaGraphExec`)."""
        with self.bound():
            return CudaGraphExec(self, nodes)

    def capture_stream(self) -> Any:
        """The stream graphs are captured on (made on first use; never launched on)."""
        if getattr(self, "_capture_stream", None) is None:
            self._capture_stream = self.drv.Stream()
        return self._capture_stream

    def wait_stream(self, kernels: list[str]) -> None:
        try:
            self.memory.synchronize()
        except Exception as e:  # an asynchronous fault of a launch: the context is lost
            which = " or ".join(f"'{k}'" for k in dict.fromkeys(kernels)) or "a kernel"
            raise DifftapeError(f"kernel {which} failed on {self.name}: {e}; the device's "
                                "context cannot be used again: restart the process") from e

    def close(self) -> None:
        """Device memory first, then the context (popped from the thread that made the
        program, which must be the one closing it, or the context would stay current
        there). Graph executables still alive are destroyed after the stream drained."""
        try:
            with self.bound():
                try:
                    super().close()
                finally:
                    for finalizer in list(CudaGraphExec.alive.get(id(self), ())):
                        finalizer()
        finally:
            if threading.get_ident() == self._owner:
                self.drv.Context.pop()
            self.context.detach()


def nvml_utilization(ordinal: int) -> int | None:
    """The device's utilisation in percent over NVML's last sample period, or None where
    NVML (``nvidia-ml-py``, in the ``[cuda]`` extra) cannot be used. NVML numbers devices
    by PCI order, CUDA by speed unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``; with one visible
    device (the server's deployment) they agree."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(ordinal)
        return int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except Exception:  # noqa: BLE001 - pynvml.NVMLError: no NVML library, no permission
        return None


class CudaGraphExec(GraphExec):
    """A device segment of a captured graph as an instantiated CUDA graph (see the module
    doc). Made and used with the program's context current (``CudaLauncher.bound``)."""

    #: the finalizers of each launcher's live executables (by ``id`` of the launcher):
    #: run when the program closes, before its context goes
    alive: dict[int, set[weakref.finalize]] = {}

    def __init__(self, launcher: CudaLauncher, nodes: list[tuple]) -> None:
        self.launcher = launcher
        self.api = launcher.memory.api
        self.nodes = list(nodes)
        self.instantiated = 0
        self.handle = 0
        self._finalizer: weakref.finalize | None = None
        self._instantiate()

    def _capture(self, nodes: list[tuple]) -> int:
        """A CUDA graph (not instantiated) of ``nodes``, by stream capture."""
        launcher, drv = self.launcher, self.launcher.drv
        stream = launcher.capture_stream()
        self.api.begin_capture(stream.handle)
        try:
            for node in nodes:
                if node[0] == "kernel":
                    launcher.launch(node[1], node[2], stream)
                elif node[0] == "copy":
                    drv.memcpy_dtod_async(node[1], node[2], node[3], stream)
                else:
                    drv.memset_d8_async(node[1], 0, node[2], stream)
        finally:
            graph = self.api.end_capture(stream.handle)
        return graph

    def _instantiate(self) -> None:
        graph = self._capture(self.nodes)
        try:
            handle = self.api.instantiate(graph)
        finally:
            self.api.destroy_graph(graph)
        if self._finalizer is not None:
            self._finalizer()
        self.handle = handle
        self.instantiated += 1
        alive = CudaGraphExec.alive.setdefault(id(self.launcher), set())
        self._finalizer = weakref.finalize(self, _destroy_exec, self.launcher, handle, alive)
        self._finalizer.atexit = False  # (the process's end frees it with the context)
        alive.add(self._finalizer)

    def launch(self) -> None:
        with self.launcher.bound():
            self.api.launch_graph(self.handle, self.launcher.memory.stream.handle)

    def update(self, nodes: list[tuple]) -> None:
        """The nodes captured again into a graph whose parameters ``cuGraphExecUpdate``
        writes into the executable; where CUDA refuses the change in place, the graph is
        instantiated again (said in the log and counted in :attr:`instantiated`)."""
        self.check_shape(self.nodes, nodes)
        with self.launcher.bound():
            graph = self._capture(nodes)
            try:
                updated = self.api.exec_update(self.handle, graph)
            finally:
                self.api.destroy_graph(graph)
            self.nodes = list(nodes)
            if not updated:
                logger.warning("difftape: %s: cuGraphExecUpdate refused new copy addresses of "
                               "a graph; it is instantiated again", self.launcher.name)
                self._instantiate()


def _destroy_exec(launcher: CudaLauncher, handle: int, alive: set) -> None:
    """An executable's end (the graph dropped, or its program closing)."""
    for f in [f for f in alive if not f.alive]:  # (this one is no longer alive either)
        alive.discard(f)
    with launcher.bound():
        launcher.memory.api.destroy_exec(handle)
