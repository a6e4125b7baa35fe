"""CUDA arrays of other libraries in grid programs, and grid programs' storage out as CUDA
arrays: no copies, ordered by streams, not by waiting.

On a grid program (``ti.init(arch=ti.cuda)``, and the simulated grid that CI runs) storage is
device memory (``runtime/storage.py``). This module is the device half of interop
(``runtime/foreign.py`` is the host half):

**In.** A ``ti.types.ndarray()`` argument that exports DLPack with device type CUDA (PyTorch,
CuPy and JAX GPU arrays) or ``__cuda_array_interface__`` (versions 2 and 3) is passed as its
device pointer: the kernel reads and writes the caller's memory in place
(:class:`~.storage.BorrowedStorage`). Checked first, and refused with a DifftapeError naming
the argument: the device (the DLPack device id, and the pointer's own device as the driver
reports it, must be the program's), the dtype, C-contiguity (a strided device tensor is refused:
pass ``t.contiguous()``; no hidden device copy), a mask (refused), and that the pointer lies
inside one device allocation. On the simulated grid and the pycuda stand-in "device memory"
is host memory the simulation allocated, and only pointers inside it are accepted: a foreign
pointer is never dereferenced. The DLPack tensor is owned (its capsule consumed) and its
deleter called when the launches that use it have run (``DeviceMemoryAllocator.hold``).

**Out.** Fields and ndarrays of a grid program export ``__dlpack__``/``__dlpack_device__`` as
CUDA memory (:func:`export`): a capsule over their device storage, which the consumer views
in place (``torch.from_dlpack(x)``); the storage stays allocated while the consumer's tensor
lives, also past ``ti.reset()``, and host reads of it always download (the consumer may have
written it). ``to_torch(device="cuda")`` and ``to_jax()`` on a grid program copy device to
device and hand the copy over the same way: no host round trip.

**Streams.** The caller's work and ours are ordered on the device, the host waits for
neither: an event recorded on the caller's stream that ours waits for before our launches,
and one recorded on ours that the caller's waits for after them (``cuStreamWaitEvent``;
:class:`~.storage.SharedMemory`). The caller's stream is, first, the one named by
:func:`caller_stream` (``with ti.caller_stream(torch.cuda.current_stream()): ...``); else the
array's own: the ``stream`` of ``__cuda_array_interface__`` v3, and for a PyTorch tensor
PyTorch's current stream on its device. Through DLPack the producer orders our stream after
its own (we pass ours as ``__dlpack__(stream=...)``, as the protocol says); for an export the
consumer's ``stream`` is made to wait for ours (None: the legacy default stream; -1: no
ordering). Where the caller's stream cannot be known (a DLPack array of another library, an
interface without a stream), the host waits for the launch before the call returns: correct,
not asynchronous.

**Across devices.** A CUDA array passed to a CPU program is refused (``runtime/foreign.py``:
move it with ``.cpu()``, a copy of the caller's choosing); a host array (NumPy, a CPU tensor)
passed to a grid program is copied into device memory for the launch and what the kernel
wrote copied back (``frontend/kernel.py``'s ``_stage_arrays``), as Taichi does.

Nothing here imports torch or jax.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from ..errors import ArgumentError, DifftapeError
from . import dlpack, program
from .storage import BorrowedStorage, DeviceMemoryAllocator, DeviceStorage, Storage

_local = threading.local()  # .streams: the caller_stream blocks of this thread, innermost last


def stream_handle(stream: Any) -> int:
    """A stream as the driver names it: an int, or a stream object of PyTorch
    (``cuda_stream``), CuPy (``ptr``) or pycuda (``handle``). 0 (the default stream as some
    libraries report it) is the legacy default stream, 1."""
    for attr in ("cuda_stream", "ptr", "handle"):
        if hasattr(stream, attr):
            stream = getattr(stream, attr)
            break
    if isinstance(stream, bool) or not isinstance(stream, int | np.integer):
        raise DifftapeError(f"not a CUDA stream: {stream!r:.60} (give an int handle, or a "
                            "PyTorch, CuPy or pycuda stream)")
    return int(stream) or 1


@contextlib.contextmanager
def caller_stream(stream: Any) -> Iterator[None]:
    """``with ti.caller_stream(s):``: the program's device work inside the block is ordered
    with the caller's CUDA stream ``s`` (see the module doc): on entry ours waits for what
    ``s`` was given so far, and so does each launch with a CUDA array inside; at the end of
    each such launch and of the block, ``s`` waits for ours. Nobody waits on the host. Does
    nothing on a program whose storage is host memory."""
    handle = stream_handle(stream)
    allocator = program.get().allocator
    memory = getattr(allocator, "memory", None)
    shared = memory is not None and hasattr(memory, "wait_for_stream")
    stack = _local.__dict__.setdefault("streams", [])
    if shared:
        allocator.sync()
        memory.wait_for_stream(handle)
    stack.append(handle)
    try:
        yield
    finally:
        stack.pop()
        if shared:
            allocator.sync()  # (host writes inside the block: uploaded before the signal)
            memory.signal_stream(handle)


def explicit_stream() -> int | None:
    """The innermost :func:`caller_stream` of this thread, or None."""
    streams = getattr(_local, "streams", None)
    return streams[-1] if streams else None


def is_device_array(a: object) -> bool:
    """Does ``a`` export CUDA device memory (DLPack device type CUDA, or
    ``__cuda_array_interface__``)?"""
    if isinstance(a, np.ndarray | Storage):
        return False
    query = getattr(a, "__dlpack_device__", None)
    if query is not None:
        try:
            return query()[0] == dlpack.CUDA
        except Exception:  # noqa: BLE001 - a producer that cannot say: not ours to take
            return False
    return hasattr(a, "__cuda_array_interface__")


def _torch_stream(a: object, ordinal: int) -> int | None:
    """PyTorch's current stream on the tensor's device, when ``a`` is a PyTorch tensor
    (found through ``sys.modules``: this module never imports torch)."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(a, torch.Tensor):
        return None
    return stream_handle(torch.cuda.current_stream(ordinal).cuda_stream)


def borrow(a: object, allocator: DeviceMemoryAllocator, what: str, scalar: bool = False
           ) -> tuple[BorrowedStorage, int | None]:
    """``a``'s device memory as storage kernels address (see the module doc), and the
    caller's stream to order with after use (None: unknown). Our stream is ordered after the
    caller's work before this returns, where the protocol or the caller says how.
    ``scalar``: a 0-D array is accepted (device copies take it; a kernel argument needs an
    axis)."""
    memory = allocator.memory
    ordinal = memory.ordinal
    explicit = explicit_stream()
    query = getattr(a, "__dlpack_device__", None)
    if query is not None and query()[0] == dlpack.CUDA:
        device = tuple(query())
        if device[1] != ordinal:
            raise DifftapeError(f"{what} is on CUDA device {device[1]}; this program runs on "
                                f"device {ordinal} (move it with .to('cuda:{ordinal}'), or "
                                "pick the device with DIFFTAPE_CUDA_DEVICE)")
        ours = memory.stream_handle
        try:
            capsule = a.__dlpack__(stream=ours, max_version=dlpack.VERSION)
        except TypeError:  # a producer older than DLPack 1.0's keywords
            capsule = a.__dlpack__(stream=ours)
        view = dlpack.consume(capsule)
        try:
            storage = _storage(allocator, what, view.address, view.shape, view.dtype,
                               view.contiguous, view.readonly, view.release,
                               dtype_text=f"DLPack {view.type_name}", scalar=scalar)
            if view.device != device:
                raise DifftapeError(f"{what}: its DLPack tensor is on device {view.device}, "
                                    f"not {device} as __dlpack_device__ said")
        except BaseException:
            view.release()
            raise
        stream = explicit if explicit is not None else _torch_stream(a, ordinal)
        if stream is not None:
            memory.wait_for_stream(stream)
        storage.caller = (a, stream)
        return storage, stream
    cai = getattr(a, "__cuda_array_interface__", None)
    if cai is None:
        raise DifftapeError(f"{what} ({type(a).__name__}) is not a CUDA array")
    return _borrow_interface(a, cai, allocator, what, explicit, scalar)


def _borrow_interface(a: object, cai: dict, allocator: DeviceMemoryAllocator, what: str,
                      explicit: int | None, scalar: bool = False
                      ) -> tuple[BorrowedStorage, int | None]:
    """``__cuda_array_interface__`` (versions 2 and 3)."""
    version = int(cai.get("version", 0))
    if version not in (2, 3):
        raise DifftapeError(f"{what}: __cuda_array_interface__ version {version} is not "
                            "understood (difftape reads versions 2 and 3)")
    if cai.get("mask") is not None:
        raise DifftapeError(f"{what}: a masked __cuda_array_interface__ array is not "
                            "supported")
    shape = tuple(int(n) for n in cai["shape"])
    try:
        dtype = np.dtype(cai["typestr"])
    except TypeError:
        dtype = None
    if dtype is not None and not dtype.isnative:
        dtype = None
    strides = cai.get("strides")
    contiguous = True
    if strides is not None and dtype is not None:
        expected = dtype.itemsize
        for n, s in zip(reversed(shape), reversed(strides), strict=True):
            if n != 1 and s != expected:
                contiguous = False
            expected *= n
    address, readonly = cai["data"]
    storage = _storage(allocator, what, int(address), shape, dtype, contiguous,
                       bool(readonly), _keeper(a), dtype_text=f"typestr {cai['typestr']!r}",
                       scalar=scalar)
    stream = cai.get("stream") if version >= 3 else None
    if stream == 0:
        raise DifftapeError(f"{what}: __cuda_array_interface__ stream 0 is disallowed "
                            "(ambiguous); the producer must give 1 for the default stream")
    if explicit is not None:
        stream = explicit
    storage.caller = (a, None if stream is None else int(stream))
    if stream is not None:
        allocator.memory.wait_for_stream(int(stream))
    return storage, None if stream is None else int(stream)


def _keeper(a: object) -> Callable[[], object]:
    """A release that keeps ``a`` (the exporting object) alive until it is called."""
    return lambda: a


def _storage(allocator: DeviceMemoryAllocator, what: str, address: int,
             shape: tuple[int, ...], dtype: np.dtype | None, contiguous: bool,
             readonly: bool, release: Callable[[], object] | None,
             dtype_text: str, scalar: bool = False) -> BorrowedStorage:
    if dtype is None or dtype.kind not in "fiub":
        raise DifftapeError(f"{what}: its element type ({dtype_text}) has no difftape dtype")
    if not contiguous:
        raise DifftapeError(f"{what} is a strided (non-contiguous) CUDA array: kernels index "
                            "C-ordered memory; pass t.contiguous() (a copy on the device, "
                            "and copy the result back if the kernel writes it)")
    if (not shape and not scalar) or 0 in shape:
        raise DifftapeError(f"{what} has shape {shape}: an ndarray argument needs at least "
                            "one axis and no empty one")
    return BorrowedStorage(allocator, shape, dtype, address, release, readonly)


def call_with_device_arrays(call: Callable, kernel: str, names: list[str], args: tuple,
                            indices: Sequence[int], allocator: DeviceMemoryAllocator):
    """``call(*args)`` with the CUDA arrays ``args[indices]`` replaced by storage over their
    memory, ordered with their callers' streams (see the module doc)."""
    args = list(args)
    borrowed: list[BorrowedStorage] = []
    streams: dict[int, None] = {}
    unknown = False
    try:
        for k in indices:
            try:
                storage, stream = borrow(args[k], allocator, f"argument '{names[k]}'")
            except DifftapeError as e:
                raise ArgumentError(f"kernel '{kernel}': {e}", kernel=kernel) from None
            args[k] = storage
            borrowed.append(storage)
            if stream is None:
                unknown = True
            else:
                streams[stream] = None
        out = call(*args)
    finally:
        for stream in streams:
            allocator.memory.signal_stream(stream)
        if borrowed:
            allocator.hold(borrowed)
    if unknown:
        allocator.wait()  # a caller's stream we cannot order with: done before returning
    return out


@contextlib.contextmanager
def replayed(storages: Sequence[BorrowedStorage], allocator: DeviceMemoryAllocator
             ) -> Iterator[None]:
    """Launches made again over borrowed memory (a ``ti.ad.Tape``'s reverse launches over
    the CUDA arrays its forward launches took) ordered with the callers' streams as those
    launches were (:func:`call_with_device_arrays`): each caller's stream now (the innermost
    :func:`caller_stream`, else PyTorch's current stream for a PyTorch tensor, else the
    stream the forward launch was ordered with) is waited for before and made to wait after;
    where none is known the host waits for the launches before this returns. The memory is
    kept until they have run."""
    streams: dict[int, None] = {}
    unknown = False
    explicit = explicit_stream()
    memory = allocator.memory
    for s in storages:
        origin, stream = s.caller
        if explicit is not None:
            stream = explicit
        elif origin is not None and (now := _torch_stream(origin, memory.ordinal)) is not None:
            stream = now
        if stream is None:
            unknown = True
        else:
            streams[stream] = None
    for stream in streams:
        memory.wait_for_stream(stream)
    try:
        yield
    finally:
        for stream in streams:
            memory.signal_stream(stream)
        allocator.hold(list(storages))
    if unknown:
        allocator.wait()


# ---------------------------------------------------------------------------------- out
def export(storage: DeviceStorage, stream: int | None = None,
           max_version: tuple[int, int] | None = None,
           dl_device: tuple[int, int] | None = None, copy: bool | None = None) -> Any:
    """``__dlpack__`` of device storage: a capsule over its memory (a copy on the device
    with ``copy=True``), the consumer's ``stream`` ordered after our work (None: the legacy
    default stream; -1: not ordered)."""
    allocator = storage._owner
    memory = allocator.memory
    device = (dlpack.CUDA, memory.ordinal)
    if dl_device is not None and tuple(dl_device) != device:
        raise BufferError(f"the array is in CUDA memory of device {memory.ordinal}; "
                          f"dl_device={tuple(dl_device)} would need a copy to another device")
    if stream == 0:
        raise BufferError("stream=0 is ambiguous in DLPack: pass 1 for the legacy default "
                          "stream")
    if copy:
        storage = device_copy(storage)
    allocator.sync()  # host writes reach the device before the consumer's work
    storage.share()
    explicit = explicit_stream()
    handle = explicit if stream is None and explicit is not None else stream
    if handle != -1:
        memory.signal_stream(1 if handle is None else int(handle))
    address = storage.address
    memory.pin(address)
    versioned = max_version is not None and tuple(max_version)[0] >= dlpack.VERSION[0]
    return dlpack.make_capsule(address, storage.shape, storage.dtype, device, storage,
                               versioned, readonly=getattr(storage, "readonly", False),
                               on_delete=lambda: memory.unpin(address))


def device_copy(storage: DeviceStorage) -> DeviceStorage:
    """New storage of the same program holding a copy, made on the device."""
    out = storage._owner.storage(storage.shape, storage.dtype)
    out.copy_from(storage)
    return out


class DeviceExport:
    """An object exporting device storage by DLPack (``to_torch``/``to_jax`` hand a copy
    to ``torch.from_dlpack``/``jax.dlpack.from_dlpack`` through it)."""

    def __init__(self, storage: DeviceStorage) -> None:
        self.storage = storage

    def __dlpack__(self, *, stream: int | None = None,
                   max_version: tuple[int, int] | None = None,
                   dl_device: tuple[int, int] | None = None, copy: bool | None = None) -> Any:
        return export(self.storage, stream, max_version, dl_device, copy)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (dlpack.CUDA, self.storage._owner.memory.ordinal)


@contextlib.contextmanager
def borrowed(a: object, allocator: DeviceMemoryAllocator, what: str
             ) -> Iterator[BorrowedStorage]:
    """``a``'s device memory as storage for the block (``from_torch``/``from_jax`` copy from
    it on the device), ordered with the caller's stream as a kernel argument is."""
    storage, stream = borrow(a, allocator, what)
    try:
        yield storage
    finally:
        if stream is not None:
            allocator.memory.signal_stream(stream)
        allocator.hold([storage])
    if stream is None:
        allocator.wait()


def shares_device_memory(allocator: object) -> bool:
    """Is ``allocator`` a grid program's device memory that takes other libraries' CUDA
    arrays in place (the pycuda driver's, or the simulated grid's)?"""
    return not getattr(allocator, "host", True) and \
        hasattr(getattr(allocator, "memory", None), "borrow")
