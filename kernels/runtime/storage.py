"""Where field and ndarray storage lives: the program's allocator and the storage interface.

Every field (and each ``.grad``/``.dual``/read-mark companion) and every ``ti.ndarray`` owns
one :class:`Storage`, made by the program's allocator (``Program.allocator``). Kernels address
it by :attr:`Storage.address`; Python-scope code (element access, ``fill``, ``to_numpy``/
``from_numpy``, the Tape, interop, the server's engine) never touches the memory behind that
address directly: it goes through the storage's explicit sync points.

- :meth:`Storage.read`: the current values as a host array, downloaded first if a launch
  changed them. Only read it (under device memory it is a read-only view).
- :meth:`Storage.write`: the current values as a host array the caller is about to modify;
  the storage is marked dirty and uploaded at the next sync point (:meth:`Allocator.sync`,
  called before every launch and device-side operation). It downloads first even for a
  caller that replaces every element: an assignment that fails half-way must not upload a
  stale mirror.
- :meth:`Storage.device_written`: a launch (or a device-side operation) changed the device
  copy; the host copy is stale until the next ``read``/``write``.
- :meth:`Storage.zero`, :meth:`Storage.copy_from`: device-side clears and copies.

Device memory is ordered by one **stream** per program: uploads, clears, device-to-device
copies and launches are enqueued on it and the host does not wait for them. A download is a
sync point: :meth:`DeviceStorage.read` (and a ``write`` of storage a launch changed) first
calls the allocator's :attr:`DeviceMemoryAllocator.wait` (the grid launcher's
``synchronize``: the stream drained, a failed launch's error raised), then copies. Memory freed
while the stream has work queued is released only once it has drained (a pending launch may
still address it).

Three allocators:

- :class:`HostAllocator` (``ti.cpu``): the storage *is* one C-contiguous NumPy array
  (:attr:`HostStorage.array`), and ``address`` is its data pointer: the sync points cost
  nothing and kernels, Python scope, DLPack exports and ``ti.graph`` share the same memory.
- :class:`DeviceMemoryAllocator` over a device's memory: blocks of device memory plus host
  mirrors kept coherent at the sync points. ``runtime/cuda.py``'s ``DeviceAllocator`` is such
  a memory (its ``cuda_allocator``), for the CUDA launcher.
- :class:`SimulatedDeviceAllocator` (``simulate_grid`` / ``DIFFTAPE_SIMULATE_GPU=1``): the
  same, over :class:`SimulatedDeviceMemory`, blocks of separate host memory that kernels on
  the simulated grid address, with a deterministic deferred stream (:class:`SimulatedStream`):
  what is enqueued runs only when the host synchronises, so a download that skipped the sync
  point reads stale memory, as a race would on a GPU, but every time. Host mirrors are
  *poisoned* whenever they are stale (NaN in float storage, ``0xA5`` bytes in integer
  storage) and handed out read-only for reading, so Python-scope code that skips a sync
  point computes a wrong answer (or fails) in CI instead of silently working on the CPU and
  failing on a GPU.
"""

from __future__ import annotations

import ctypes
import itertools
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import DifftapeError

#: the byte a stale host mirror of integer storage is filled with (simulated device memory)
POISON_BYTE = 0xA5


class Storage:
    """The interface of one field's or ndarray's memory (see the module doc). ``shape`` is
    ``shape + element_shape``; ``dtype`` a NumPy dtype."""

    __slots__ = ("shape", "dtype", "__weakref__")
    #: whether host code may address the memory itself (host storage: ``array`` exists)
    host = False

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype) -> None:
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def address(self) -> int:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def read(self) -> np.ndarray:  # pragma: no cover
        raise NotImplementedError

    def write(self) -> np.ndarray:  # pragma: no cover
        raise NotImplementedError

    def device_written(self) -> None:
        """A launch or device-side operation changed the memory (nothing to do on the host)."""

    def zero(self) -> None:  # pragma: no cover
        raise NotImplementedError

    def copy_from(self, other: Storage, casting: str = "unsafe") -> None:
        """``self[...] = other[...]`` (same shape; the dtype converted as NumPy's ``copyto``
        does with ``casting``)."""
        np.copyto(self.write(), other.read(), casting=casting)


class HostStorage(Storage):
    """Storage in host memory: one C-contiguous NumPy array (``array``), shared by kernels
    and Python scope, so every sync point is free."""

    __slots__ = ("array", "_address")
    host = True

    def __init__(self, array: np.ndarray) -> None:
        super().__init__(array.shape, array.dtype)
        self.array = array
        self._address = array.ctypes.data

    @property
    def address(self) -> int:
        return self._address

    def read(self) -> np.ndarray:
        return self.array

    def write(self) -> np.ndarray:
        return self.array

    def zero(self) -> None:
        self.array.fill(0)

    def copy_from(self, other: Storage, casting: str = "unsafe") -> None:
        np.copyto(self.array, other.read(), casting=casting)


class Allocator:
    """Makes the storage of one program's fields and ndarrays."""

    #: host allocators give :class:`HostStorage` (kernels address host memory)
    host = False

    def storage(self, shape: tuple[int, ...], dtype: np.dtype) -> Storage:  # pragma: no cover
        """New zeroed storage of ``shape`` (``shape + element_shape``) and ``dtype``."""
        raise NotImplementedError

    def sync(self) -> None:
        """Upload every host write not yet uploaded (before launches and device operations)."""

    def close(self) -> None:
        """Release everything (the program ends)."""


class HostAllocator(Allocator):
    """Host memory: NumPy arrays, as the CPU target has always used."""

    host = True

    def storage(self, shape: tuple[int, ...], dtype: np.dtype) -> HostStorage:
        return HostStorage(np.zeros(shape, dtype=dtype))

    @staticmethod
    def wrap(array: np.ndarray) -> HostStorage:
        """Storage over an existing C-contiguous array (``ti.from_dlpack``, interop), shared,
        not copied."""
        return HostStorage(array)


class SimulatedEvent:
    """A point in a :class:`SimulatedStream` (pycuda's ``Event`` interface): done once the
    stream has run everything enqueued before it."""

    __slots__ = ("_stream", "_mark")

    def __init__(self, stream: SimulatedStream, mark: int) -> None:
        self._stream, self._mark = stream, mark

    def query(self) -> bool:
        return self._stream.done >= self._mark

    def synchronize(self) -> None:
        self._stream.run_until(self._mark)


class SimulatedStream:
    """A deterministic deferred stream: operations (closures) are queued in order and run only
    when the host synchronises with the stream (:meth:`synchronize`) or with an event recorded
    on it (:meth:`SimulatedEvent.synchronize`), never in between. So on the simulated grid an
    asynchronous launch has not run when the host call returns, and a host read that does not
    synchronise first sees the memory as it was: a missing sync point fails in CI."""

    #: every live stream by :attr:`handle` (what a ``CUstream`` is to the driver API)
    by_handle: weakref.WeakValueDictionary[int, SimulatedStream] = weakref.WeakValueDictionary()
    _handles = itertools.count(0x1000)  # (0, 1 and 2 are CUDA's default streams)
    _legacy: SimulatedStream | None = None

    def __init__(self) -> None:
        self._queue: deque[Callable[[], None]] = deque()
        self.done = 0  # operations run so far
        self.enqueued = 0  # operations enqueued so far
        self.handle = next(SimulatedStream._handles)
        SimulatedStream.by_handle[self.handle] = self

    @classmethod
    def resolve(cls, handle: int) -> SimulatedStream:
        """The stream with driver handle ``handle``; 1 and 2 (``CU_STREAM_LEGACY``,
        ``CU_STREAM_PER_THREAD``: the default stream, as DLPack names it) are one default
        stream of the simulated device, made on first use."""
        if handle in (1, 2):
            if cls._legacy is None:
                cls._legacy = cls()
            return cls._legacy
        stream = cls.by_handle.get(handle)
        if stream is None:
            raise DifftapeError(f"stream handle {handle:#x} is not a stream of the simulated "
                                "device")
        return stream

    def enqueue(self, op: Callable[[], None]) -> None:
        self._queue.append(op)
        self.enqueued += 1

    def record(self) -> SimulatedEvent:
        return SimulatedEvent(self, self.enqueued)

    def wait_for_event(self, event: SimulatedEvent) -> None:
        """What is enqueued from now on runs after ``event`` (``cuStreamWaitEvent``): when
        this stream gets here, it first runs the event's stream up to the event."""
        self.enqueue(event.synchronize)

    def is_done(self) -> bool:
        return self.done == self.enqueued

    def run_until(self, mark: int) -> None:
        """Run the queued operations up to the ``mark``-th enqueued one. An operation that
        raises is dropped with those before it; the rest stay queued."""
        while self.done < mark:
            op = self._queue.popleft()
            self.done += 1
            op()

    def synchronize(self) -> None:
        self.run_until(self.enqueued)

    def discard(self) -> None:
        """Drop what is queued (the program ends)."""
        self._queue.clear()
        self.done = self.enqueued


class SharedMemory:
    """What a device memory (:class:`SimulatedDeviceMemory`, ``runtime/cuda.py``'s
    ``DeviceAllocator``) does for memory it shares with other libraries
    (``runtime/devicearrays.py``): the program's stream ordered with another stream, borrowed
    ranges of device memory it did not allocate (a CUDA tensor passed to a kernel), and blocks
    pinned by an export (a tensor viewing a field) so that closing the program leaves them to
    their consumer. ``api`` is the driver's raw interface (``SimulatedDriverApi``, or
    ``runtime/cuda.py``'s ``CudaDriverApi``: ``wait_stream``, ``address_range``,
    ``pointer_ordinal``), ``ordinal`` the device's number."""

    ordinal = 0
    api: Any

    def _init_shared(self) -> None:
        self._borrowed: dict[int, list[int]] = {}  # address -> sizes borrowed there
        self._pinned: dict[int, int] = {}  # address -> exports alive
        self._closed = False

    @property
    def stream_handle(self) -> int:
        """The program's stream as the driver names it (a ``CUstream``)."""
        return self.stream.handle

    def wait_for_stream(self, handle: int) -> None:
        """What the program enqueues from now on runs after what stream ``handle`` has
        enqueued so far (an event recorded there, which ours waits for: no host wait)."""
        if handle != self.stream.handle:
            self.api.wait_stream(self.stream.handle, handle)

    def signal_stream(self, handle: int) -> None:
        """What stream ``handle`` enqueues from now on runs after what the program has
        enqueued so far."""
        if handle != self.stream.handle:
            self.api.wait_stream(handle, self.stream.handle)

    def borrow(self, address: int, nbytes: int) -> None:
        """Let kernels and copies address ``nbytes`` at ``address``, memory another library
        allocated on this device; DifftapeError when it is not device memory of this device
        in one allocation (never dereferenced otherwise)."""
        found = self.api.address_range(address)
        if found is None or address + nbytes > found[0] + found[1]:
            why = "lies in no allocation of it" if found is None else \
                "lies in an allocation of it but runs past its end"
            raise DifftapeError(f"{nbytes} bytes at {address:#x} are not {self.what} memory "
                                f"(the pointer {why})")
        ordinal = self.api.pointer_ordinal(address)
        if ordinal != self.ordinal:
            raise DifftapeError(f"the memory at {address:#x} is on CUDA device {ordinal}; the "
                                f"program runs on device {self.ordinal}")
        self._borrowed.setdefault(address, []).append(nbytes)

    def unborrow(self, address: int, nbytes: int) -> None:
        sizes = self._borrowed.get(address)
        if sizes:
            sizes.remove(nbytes)
            if not sizes:
                del self._borrowed[address]

    def borrowed_size(self, address: int) -> int:
        sizes = self._borrowed.get(address)
        if not sizes:
            raise KeyError(address)
        return max(sizes)

    def pin(self, address: int) -> None:
        """An export views the block at ``address``: :meth:`close` leaves it allocated."""
        self._pinned[address] = self._pinned.get(address, 0) + 1

    def unpin(self, address: int) -> None:
        """An export ended; after :meth:`close`, the last one frees the block."""
        n = self._pinned.get(address, 0) - 1
        if n > 0:
            self._pinned[address] = n
            return
        self._pinned.pop(address, None)
        if self._closed:
            self._free_after_close(address)

    def _free_after_close(self, address: int) -> None:  # pragma: no cover - subclasses
        raise NotImplementedError


class SimulatedDriverApi:
    """The raw driver calls of :class:`SharedMemory` on the simulated device (and on the
    pycuda stand-in of the tests): streams by handle (:meth:`SimulatedStream.resolve`),
    events that are points in them, and ``blocks`` (address -> host buffer) as the device's
    allocations."""

    def __init__(self, blocks: dict[int, np.ndarray], ordinal: Callable[[int], int]) -> None:
        self.blocks = blocks
        self._ordinal = ordinal

    def wait_stream(self, waiting: int, on: int) -> None:
        """``cuEventRecord(e, on); cuStreamWaitEvent(waiting, e)``."""
        SimulatedStream.resolve(waiting).wait_for_event(SimulatedStream.resolve(on).record())

    def address_range(self, address: int) -> tuple[int, int] | None:
        """``cuMemGetAddressRange``: (base, size) of the allocation holding ``address``."""
        for base, block in self.blocks.items():
            if base <= address < base + block.nbytes:
                return base, block.nbytes
        return None

    def pointer_ordinal(self, address: int) -> int:
        """``cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL)``."""
        return self._ordinal(address)


class SimulatedDeviceMemory(SharedMemory):
    """Device memory for the simulated grid: each block is separate host memory (its own
    NumPy buffer) that only the simulated kernels address; the host reaches it through
    ``upload``/``download``/``copy``/``memset`` only, ordered by :attr:`stream` (a
    :class:`SimulatedStream`) as CUDA's are by the program's stream: ``upload`` (of a copy of
    the host data taken now), ``copy`` and ``memset`` are enqueued; ``download`` copies what
    is in the block now, so the caller synchronises first. The interface is that of
    ``runtime/cuda.py``'s ``DeviceAllocator``."""

    what = "simulated device"

    def __init__(self) -> None:
        self._blocks: dict[int, np.ndarray] = {}
        self._freed: list[int] = []  # released while the stream had work queued
        self.stream = SimulatedStream()
        self.bytes_in_use = 0
        self.peak = 0
        self.api = SimulatedDriverApi(self._blocks, lambda address: self.ordinal)
        self._init_shared()

    def alloc(self, nbytes: int) -> int:
        block = np.zeros(max(1, int(nbytes)), np.uint8)
        address = block.ctypes.data
        self._blocks[address] = block
        self.bytes_in_use += block.nbytes
        self.peak = max(self.peak, self.bytes_in_use)
        return address

    def free(self, address: int) -> None:
        if address not in self._blocks:
            raise KeyError(address)
        if self.stream.is_done():
            self.bytes_in_use -= self._blocks.pop(address).nbytes
        else:  # a queued launch or copy may still address it
            self._freed.append(address)

    def size(self, address: int) -> int:
        block = self._blocks.get(address)
        return block.nbytes if block is not None else self.borrowed_size(address)

    @property
    def live(self) -> int:
        return len(self._blocks) - len(self._freed)

    def host_array(self, n: int, dtype: np.dtype) -> np.ndarray:
        """Host memory for asynchronous uploads (page-locked on CUDA)."""
        return np.zeros(n, dtype)

    def upload(self, address: int, host: np.ndarray) -> None:
        self._check(address, host)
        data = host.tobytes()  # (what the host holds now: it may change before the copy runs)
        self.stream.enqueue(lambda: ctypes.memmove(address, data, len(data)))

    def download(self, host: np.ndarray, address: int) -> None:
        self._check(address, host)
        ctypes.memmove(host.ctypes.data, address, host.nbytes)

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        if nbytes > min(self.size(dst), self.size(src)):
            raise ValueError(f"copy of {nbytes} bytes exceeds a block")
        self.stream.enqueue(lambda: ctypes.memmove(dst, src, nbytes))

    def memset(self, address: int, value: int, nbytes: int) -> None:
        if nbytes > self.size(address):
            raise ValueError(f"memset of {nbytes} bytes exceeds a block")
        self.stream.enqueue(lambda: ctypes.memset(address, value, nbytes))

    def record(self) -> SimulatedEvent:
        """An event after everything enqueued so far."""
        return self.stream.record()

    def synchronize(self) -> None:
        """Until everything enqueued has run; then memory freed meanwhile is released."""
        try:
            self.stream.synchronize()
        finally:
            if self._freed and self.stream.is_done():
                freed, self._freed = self._freed, []
                for address in freed:
                    self.bytes_in_use -= self._blocks.pop(address).nbytes

    def _check(self, address: int, host: np.ndarray) -> None:
        if not host.flags.c_contiguous:
            raise ValueError("host array must be C-contiguous")
        if host.nbytes > self.size(address):
            raise ValueError(f"{host.nbytes} bytes do not fit a block of {self.size(address)}")

    def close(self) -> None:
        """Release everything but the blocks an export still views (freed by its end)."""
        self.stream.discard()
        kept = {a: self._blocks[a] for a in self._pinned if a in self._blocks}
        self._blocks.clear()
        self._blocks.update(kept)
        self._freed.clear()
        self._borrowed.clear()
        self.bytes_in_use = sum(b.nbytes for b in kept.values())
        self._closed = True

    def _free_after_close(self, address: int) -> None:
        block = self._blocks.pop(address, None)
        if block is not None:
            self.bytes_in_use -= block.nbytes


class DeviceStorage(Storage):
    """A block of device memory and its host mirror. ``_stale``: the device copy is newer
    (a launch wrote it); ``_dirty``: the mirror is newer (Python scope wrote it; uploaded at
    the next :meth:`DeviceMemoryAllocator.sync`). Never both: sync runs before every launch."""

    __slots__ = ("_owner", "_address", "_mirror", "_readonly", "_stale", "_dirty",
                 "_shared", "_finalizer")

    def __init__(self, owner: DeviceMemoryAllocator, shape: tuple[int, ...],
                 dtype: np.dtype) -> None:
        super().__init__(shape, dtype)
        self._owner = owner
        self._address = owner.memory.alloc(self.nbytes)  # zeroed
        self._mirror = np.zeros(self.shape, self.dtype)
        self._readonly = self._mirror.view()
        self._readonly.flags.writeable = False
        self._stale = False
        self._dirty = False
        self._shared = False
        self._finalizer = weakref.finalize(self, owner._release, self._address)

    @property
    def address(self) -> int:
        return self._address

    def _download(self) -> None:
        if self._stale:
            self._owner.wait()  # the sync point: the launches that wrote it have ended
            self._owner.memory.download(self._mirror, self._address)
            self._stale = False

    def read(self) -> np.ndarray:
        if self._stale:
            self._download()
        elif self._shared:
            self._refresh()
        return self._readonly

    def write(self) -> np.ndarray:
        if self._stale:
            self._download()
        elif self._shared and not self._dirty:
            self._refresh()
        if not self._dirty:
            self._dirty = True
            self._owner._dirty.append(self)
        return self._mirror

    def share(self) -> None:
        """Another library views the memory (an export) and may write it at any time: from
        now on every host read downloads (after uploading pending host writes)."""
        self._shared = True

    def _refresh(self) -> None:
        self._owner.sync()
        self._stale = True
        self._download()

    def upload(self) -> None:
        if self._dirty:
            self._owner.memory.upload(self._address, self._mirror)
            self._dirty = False

    def device_written(self) -> None:
        self._stale = True
        if self._owner.poison:
            _poison(self._mirror)

    def zero(self) -> None:
        self._owner.sync()
        self._owner.memory.memset(self._address, 0, self.nbytes)
        self.device_written()

    def copy_from(self, other: Storage, casting: str = "unsafe") -> None:
        if not isinstance(other, DeviceStorage) or other._owner is not self._owner or \
                other.dtype != self.dtype or other.shape != self.shape:
            super().copy_from(other, casting)
            return
        self._owner.sync()
        self._owner.memory.copy(self._address, other._address, self.nbytes)
        self.device_written()


class BorrowedStorage(DeviceStorage):
    """Device memory another library allocated (a CUDA tensor passed to a kernel, or viewed
    by ``ti.from_dlpack``), borrowed from the program's memory (``SharedMemory.borrow``)
    while this object lives; then ``release()`` (a DLPack deleter) runs. Host reads always
    download (the owner may write it at any time); host writes are uploaded at the next sync
    point, like a field's. ``readonly``: the owner forbids writes (a JAX array, a read-only
    DLPack export): kernels that write it are refused."""

    __slots__ = ("readonly", "caller")

    def __init__(self, owner: DeviceMemoryAllocator, shape: tuple[int, ...], dtype: np.dtype,
                 address: int, release: Callable[[], None] | None = None,
                 readonly: bool = False) -> None:
        Storage.__init__(self, shape, dtype)
        #: (the exporting object, the caller's stream when it was borrowed or None): what
        #: launches replayed over it later are ordered with (``devicearrays.replayed``)
        self.caller: tuple[object, int | None] = (None, None)
        owner.memory.borrow(address, self.nbytes)  # (refuses memory it does not know)
        self._owner, self._address, self.readonly = owner, address, readonly
        self._mirror = self._readonly = None  # type: ignore[assignment]
        self._stale = self._dirty = False
        self._shared = True
        self._finalizer = weakref.finalize(self, _give_back, owner, address, self.nbytes,
                                           release)

    def read(self) -> np.ndarray:
        self._owner.sync()  # (this storage's own host writes too)
        self._owner.wait()
        out = np.empty(self.shape, self.dtype)
        self._owner.memory.download(out, self._address)
        out.flags.writeable = False
        return out

    def write(self) -> np.ndarray:
        if self.readonly:
            raise DifftapeError("the array is read-only (its owner forbids writes)")
        if not self._dirty:
            self._owner.wait()
            self._mirror = np.empty(self.shape, self.dtype)
            self._owner.memory.download(self._mirror, self._address)
            self._dirty = True
            self._owner._dirty.append(self)
        return self._mirror

    def device_written(self) -> None:
        """(No mirror is kept: every read downloads.)"""


def _give_back(owner: DeviceMemoryAllocator, address: int, nbytes: int,
               release: Callable[[], None] | None) -> None:
    """A borrowed range's end: unborrowed, then the owner's deleter."""
    if not owner._closed:
        owner.memory.unborrow(address, nbytes)
    if release is not None:
        release()


def _poison(mirror: np.ndarray) -> None:
    """Make a stale host mirror obviously wrong: NaN floats, 0xA5 bytes otherwise."""
    if mirror.dtype.kind == "f":
        mirror.fill(np.nan)
    else:
        mirror.reshape(-1).view(np.uint8).fill(POISON_BYTE)


class DeviceMemoryAllocator(Allocator):
    """Storage in a device's memory (``memory``: ``alloc``, ``free``, ``upload``,
    ``download``, ``copy``, ``memset``, as ``runtime/cuda.py``'s ``DeviceAllocator``), with
    host mirrors synchronised at the sync points. ``poison``: fill stale mirrors with
    garbage (the simulated device, where a missed sync must show)."""

    def __init__(self, memory: Any, poison: bool = False) -> None:
        self.memory = memory
        self.poison = poison
        self._dirty: list[DeviceStorage] = []
        self._closed = False
        #: the sync point before a download: the stream drained (the grid launcher replaces
        #: it with its ``synchronize``, which also raises a failed launch's error)
        self.wait: Callable[[], None] = memory.synchronize
        #: what must outlive the stream's work enqueued so far: (event, objects)
        self.held: deque[tuple[Any, object]] = deque()

    def storage(self, shape: tuple[int, ...], dtype: np.dtype) -> DeviceStorage:
        return DeviceStorage(self, shape, dtype)

    def hold(self, objects: object) -> None:
        """Keep ``objects`` alive until the stream has run what is enqueued so far (a foreign
        array a pending launch addresses); what earlier calls held is let go once done."""
        held = self.held
        while held and held[0][0].query():
            held.popleft()
        held.append((self.memory.record(), objects))

    def sync(self) -> None:
        if self._dirty:
            dirty, self._dirty = self._dirty, []
            for s in dirty:
                s.upload()

    def _release(self, address: int) -> None:
        if not self._closed:
            self.memory.free(address)

    def close(self) -> None:
        self._dirty = []
        self._closed = True
        self.memory.close()
        self.held.clear()


class SimulatedDeviceAllocator(DeviceMemoryAllocator):
    """Device memory for the simulated grid: :class:`SimulatedDeviceMemory`, with poisoned
    stale mirrors (see the module doc)."""

    def __init__(self) -> None:
        super().__init__(SimulatedDeviceMemory(), poison=True)


def shared_array(storage: Storage, what: str) -> np.ndarray:
    """The host array behind ``storage`` for code that shares its memory rather than copying
    it (DLPack exports, zero-copy interop, ``ti.graph``'s native replay); refused for device
    storage, which has no host memory to share."""
    if storage.host:
        return storage.array
    raise DifftapeError(f"{what}: the storage is in device memory (simulate_grid / "
                        "DIFFTAPE_SIMULATE_GPU, or a GPU), which host code cannot share; copy "
                        "it with to_numpy()/from_numpy()")
