"""Launching a kernel over a GPU grid: the protocol, for every grid target.

The code is the CUDA target's lowering (``codegen/cuda.py``): task ``k`` is one entry that
runs on a ``blocks x threads`` grid. A :class:`Launcher` supplies what is target-specific:
its device memory (the program's allocator), loading compiled code and running one task over
the grid. There are two: ``runtime/simgrid.py``'s :class:`SimulatedLauncher` (the lowering
compiled for the host, every thread of the grid run one after another on the CPU) and
``runtime/cuda.py``'s ``CudaLauncher`` (PTX loaded with pycuda, ``cuLaunchKernel``). All the
rest lives here, written once, so that CI exercises on the simulated grid exactly what a GPU
runs:

- **Asynchronous launches.** A launch that needs nothing back (no return value, no
  ``print``, no task that may overflow its stacks, and under ``debug=True`` no check that can
  fail) is enqueued on the program's stream (the allocator's memory orders uploads, clears,
  copies and launches) and Python returns at once. The host waits only at the sync points of
  :class:`LaunchQueue`: ``ti.sync()``, a download of device storage (``to_numpy``, ``x[i]``,
  a staged NumPy argument copied back), a synchronous launch, and the program's end (reset,
  exit). Memory freed meanwhile is released once the stream has drained.
- **Launch contexts in device memory.** ``CompiledKernel`` packs the arguments into the
  host's launch context (:attr:`GridKernel.host`) after :meth:`GridKernel.begin`; the first
  task uploads it, stream-ordered, into one of the kernel's contexts in device memory. A
  context is not rewritten while a launch that uses it is pending: each kernel keeps a
  *ring* of contexts (device memory and a page-locked host buffer each, with the event after
  the launch that used it last), grown while all are in flight up to :data:`MAX_CONTEXTS`,
  after which a launch waits for the oldest. A ring rather than one context re-uploaded per
  launch: the tasks of a launch share its context (temps between tasks, the error word), and
  an asynchronous upload from page-locked memory reads the host buffer when the stream gets
  to it, so that buffer must stay intact until then too. A synchronous launch reads its
  context back after each task: error word, overflow flag and return values are the device's
  (``runtime/launch.py`` decodes the error word).
- **Errors of asynchronous launches.** A failed bounds check or assert also claims the
  program's status block (first failure wins) with its kernel's tag, code and values; every
  task launched after it returns at once, so nothing queued after a failure runs on. The next
  sync point reads the block and raises the error the CPU would have raised at the launch
  (``KernelAssertionError``/``IndexOutOfRangeError`` naming the kernel, the index, the field
  and the line). (Taichi checks its error code only under ``debug=True``, and then after
  every launch, synchronising; with ``check_out_of_bound=True`` alone it never reports. We
  do the same under ``debug=True`` and report at the next sync point otherwise. CUDA itself
  reports a kernel's fault at the next synchronising call, as a sticky context error.)
- **Reverse-mode stacks.** One pool of ``cap`` 64-bit slots per thread (``stack_pool``,
  ``stack_cap``), a block of device memory kept by the program between launches (shared by
  its kernels, grown on demand; a task that may overflow is synchronous, so one at a time
  uses it). A thread that
  pushes past ``cap`` sets the ``overflow`` slot (and stores nothing out of its slice); the
  launcher then reruns the task with the pool doubled. The rerun is safe because a task that
  can overflow (it pushes onto a stack or takes private copies from the device heap) is
  launched from a snapshot: before it runs, the buffers it writes (stores and atomics: e.g.
  the ``.grad`` it accumulates into) and the random states are copied device to device into
  snapshot blocks the program keeps (grown on demand), and copied back before a rerun; the
  launch context is restored from the host's packed copy. So no side
  effect of the overflowed attempt survives: a gradient is never accumulated twice, atomics
  into fields and ndarrays are added once, random numbers repeat, and the error word and
  return values are the rerun's.
- **Printing.** ``print`` appends binary records to the program's print buffer in device
  memory (``runtime/printsink.py``'s :class:`~.printsink.PrintRecords`, made with the first
  kernel that prints); the host takes them at each sync point, formats them with C's
  snprintf (the CPU's text, byte for byte) and writes the lines where the program's go: to
  ``sys.stdout`` locally, or into the program's :class:`~.printsink.PrintSink` where one is
  set (the service's engine sends them with the response). A launch that prints is
  synchronous, so its lines are written before the launch returns, in order with the
  program's own prints as on the CPU (records taken only at sync points would also keep
  the order of asynchronous launches, but not their order relative to Python's output).
  Output cannot be taken back, so an attempt that overflowed its stacks has its records
  discarded before the rerun: a line is printed once, with the values of the attempt that
  fitted.
- **Random numbers.** Thread ``g`` uses state ``g`` of the program's random-state storage
  (device memory too), which holds at least one state per grid thread
  (``Program.seed_random``).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from ..codegen.layout import PRINT_SINK_HEADER
from ..errors import DifftapeError
from ..ir.assertfmt import MAX_VALUES, Message
from ..ir.nodes import KernelIR, task_blocks, walk
from ..ir.printf import print_formats
from .launch import raise_error_word
from .printsink import RECORD_BYTES, PrintRecords, PrintSink
from .storage import DeviceMemoryAllocator, Storage

#: slots per thread a kernel's stack pool starts with (doubled on each overflow)
FIRST_STACK_SLOTS = 64
#: the largest pool, in bytes, a rerun may ask for before the launch is refused
MAX_POOL_BYTES = 1 << 32


class Launcher:
    """What a grid target supplies (see the module doc); one per program."""

    #: what the launches run on, in words (errors name it)
    name = "grid"
    #: (blocks, threads) of every launch
    grid: tuple[int, int]
    #: the program's allocator: field, ndarray, launch-context and scratch memory; its
    #: ``memory`` orders copies and launches on the program's stream
    allocator: DeviceMemoryAllocator
    #: the code generator (``codegen``'s CUDA target, or the simulated grid's)
    target: Any
    #: where the lines the kernels print go (``Program.print_sink``): None, ``sys.stdout``
    print_sink: PrintSink | None = None
    _queue: LaunchQueue | None = None

    def load(self, obj: bytes, names: list[str]) -> tuple[object, dict[str, Any]]:
        """Compiled code loaded: (what keeps it alive, entry name -> what :meth:`launch`
        takes)."""
        raise NotImplementedError

    def launch(self, entry: Any, ctx: int) -> None:
        """Enqueue one task over the grid on the program's stream, with the launch context
        at device address ``ctx``; it returns before the task runs."""
        raise NotImplementedError

    def wait_stream(self, kernels: list[str]) -> None:
        """Until everything enqueued has run (``kernels``: the names of the kernels launched
        since the last sync point, for the message of a launch that faulted)."""
        self.allocator.memory.synchronize()

    def instantiate(self, nodes: list[tuple]) -> GraphExec:
        """A graph executable of ``nodes``, run in order by each :meth:`GraphExec.launch`
        (``runtime/gridgraph.py`` makes them from a captured ``ti.graph``): ``("kernel",
        entry, ctx)`` runs a task over the grid with the launch context at device address
        ``ctx`` (what :meth:`launch` takes), ``("copy", dst, src, nbytes)`` copies device
        memory, ``("memset", dst, nbytes)`` zeroes it."""
        raise NotImplementedError

    @property
    def queue(self) -> LaunchQueue:
        """The program's sync points (made with the first kernel)."""
        if self._queue is None:
            self._queue = LaunchQueue(self)
        return self._queue

    def synchronize(self) -> None:
        """``ti.sync()``: until every launch so far has ended; a failed one raises."""
        if self._queue is not None:
            self._queue.synchronize()
        else:
            self.allocator.memory.synchronize()

    def close(self) -> None:
        """Release the device (after the allocator's memory): the launches still queued are
        waited for first, and a failure among them is raised once everything is released."""
        try:
            self.synchronize()
        finally:
            self.allocator.close()


class GraphExec:
    """An instantiated graph of a :class:`Launcher` (:meth:`Launcher.instantiate`): its
    ``nodes`` as they were instantiated or last updated. Launching enqueues the whole graph
    on the program's stream at once; :meth:`update` changes the nodes' parameters (addresses
    and sizes of copies and memsets) in the executable itself, for a graph of the same shape:
    what CUDA's ``cuGraphExecUpdate`` does, without instantiating again."""

    nodes: list[tuple]
    #: times this executable was instantiated (1, or more where an update had to)
    instantiated = 1

    def launch(self) -> None:
        """Enqueue the graph on the program's stream (it returns before the graph runs)."""
        raise NotImplementedError

    def update(self, nodes: list[tuple]) -> None:
        """The executable runs ``nodes`` from its next launch on (same kinds in the same
        order, same kernels; other addresses and sizes)."""
        raise NotImplementedError

    @staticmethod
    def check_shape(old: list[tuple], new: list[tuple]) -> None:
        """Refuse an update that changes the graph's shape (node kinds, order, kernels)."""
        if len(old) != len(new) or any(
                a[0] != b[0] or (a[0] == "kernel" and a[1:] != b[1:])
                for a, b in zip(old, new, strict=True)):
            raise DifftapeError("a graph executable can only be updated with nodes of the "
                                "same kinds and kernels in the same order")
class Scratch:
    """The device memory a grid program holds beyond its fields and ndarrays (launch
    contexts, the stack pool, snapshot blocks, the print buffer, the status block), in bytes
    by kind; and :attr:`admit`, which a program under a memory quota sets (the service's
    engine): ``admit(kind, nbytes, what)`` is called before such a block is allocated and
    raises to refuse it (``what`` says in words what needs it), so the quota holds for
    scratch as for fields."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}
        self.admit: Callable[[str, int, str], None] | None = None

    def total(self) -> int:
        return sum(self.bytes.values())

    def block(self, allocator: DeviceMemoryAllocator, kind: str, nbytes: int,
              what: str) -> DeviceBlock:
        """A new block of ``nbytes`` counted under ``kind`` (admitted first)."""
        if self.admit is not None:
            self.admit(kind, int(nbytes), what)
        return DeviceBlock(allocator, nbytes, self, kind)

    def _count(self, kind: str, nbytes: int) -> None:
        n = self.bytes.get(kind, 0) + nbytes
        if n:
            self.bytes[kind] = n
        else:
            self.bytes.pop(kind, None)


def _free_block(allocator: DeviceMemoryAllocator, address: int, scratch: Scratch | None,
                kind: str, nbytes: int) -> None:
    allocator._release(address)
    if scratch is not None:
        scratch._count(kind, -nbytes)


class DeviceBlock:
    """A block of device memory with no host mirror (a stack pool, a snapshot), freed when
    dropped or when the allocator closes, whichever comes first; counted in ``scratch``
    under ``kind`` while it lives (:meth:`Scratch.block` makes them)."""

    __slots__ = ("address", "nbytes", "_finalizer", "__weakref__")

    def __init__(self, allocator: DeviceMemoryAllocator, nbytes: int,
                 scratch: Scratch | None = None, kind: str = "") -> None:
        self.nbytes = int(nbytes)
        self.address = allocator.memory.alloc(self.nbytes)
        if scratch is not None:
            scratch._count(kind, self.nbytes)
        self._finalizer = weakref.finalize(self, _free_block, allocator, self.address, scratch,
                                           kind, self.nbytes)


#: words of the status block: the failed kernel's tag, the error code and the values its
#: message shows (at most ``assertfmt.MAX_VALUES``)
STATUS_WORDS = 2 + MAX_VALUES


class LaunchQueue:
    """The program's launches since the host last synchronised, and its sync points.

    Launches are enqueued on the program's stream and the host does not wait for them; it
    waits in :meth:`synchronize` only, which ``ti.sync()``, every download of device storage
    (the allocator's ``wait``), a synchronous launch (return values, ``print``, a task that
    may overflow, ``debug=True``) and the program's end call. A failed check of an
    asynchronous launch claims the **status block** (device memory; ``codegen/cuda.py``)
    with its kernel's tag, code and values, and every task launched after it returns at once;
    :meth:`synchronize` reads the block (when a launch since the last sync point can fail),
    clears it and raises the error the CPU would have raised at the launch (naming the
    kernel, the index, the field and the line). The stack pool and the snapshot blocks of the
    overflow rerun are kept here, shared by the program's kernels and grown on demand (they
    are used only inside a synchronous launch)."""

    def __init__(self, launcher: Launcher) -> None:
        self.launcher = launcher
        self.allocator = launcher.allocator
        self.memory = launcher.allocator.memory
        #: the device memory the program holds beyond its storage (see :class:`Scratch`)
        self.scratch = Scratch()
        self.status = self.scratch.block(self.allocator, "status block", STATUS_WORDS * 8,
                                         "the status block")  # zeroed
        self._status = np.zeros(STATUS_WORDS, np.int64)
        self._tags = 0
        #: the kernels launched since the last sync point, by tag (held until it)
        self.launched: dict[int, GridKernel] = {}
        self.check = False  # whether one of them can fail (it has checks)
        self.pool: DeviceBlock | None = None
        self.snapshots: list[DeviceBlock] = []
        self.allocator.wait = self.synchronize
        #: the print buffer (made with the first kernel that prints), the print lines of
        #: each printing kernel's tag, and whether one was launched since the last sync point
        self.records: PrintRecords | None = None
        self._record_block: DeviceBlock | None = None
        self.print_lines: dict[int, list[tuple[bytes, tuple[str, ...]]]] = {}
        self.printed = False

    def tag(self) -> int:
        """A new kernel's tag (what its failed launches write into the status block)."""
        self._tags += 1
        return self._tags

    def synchronize(self, take_prints: bool = True) -> None:
        """The sync point: wait for the stream; write the lines printed meanwhile (unless
        ``take_prints`` is false: an attempt that may be rerun); raise a failed asynchronous
        launch's error. (A failed synchronous launch's error is its caller's to raise, from
        its own launch context: the block is only cleared here.)"""
        launched, self.launched = self.launched, {}
        self.launcher.wait_stream([k.ir.name for k in launched.values()])
        self.allocator.held.clear()  # (foreign arrays the launches used: done with)
        if self.printed and take_prints:
            self.take_prints()
        if not self.check:
            return
        self.check = False
        self.memory.download(self._status, self.status.address)
        tag, code = int(self._status[0]), int(self._status[1])
        if not tag:
            return
        self.clear_status()
        kernel = launched.get(tag)
        if kernel is not None and kernel.asynchronous:
            raise_error_word(kernel.messages, code, self._status[2:].tolist(), kernel.ir.name)

    def print_buffer(self, kernel: GridKernel, ir: KernelIR) -> int:
        """The print buffer's device address, for a kernel that prints (its lines noted
        under its tag until it is dropped)."""
        if self.records is None:
            self._record_block = self.scratch.block(
                self.allocator, "print buffer", PRINT_SINK_HEADER + RECORD_BYTES,
                f"the print buffer (kernel '{ir.name}' prints)")
            self.records = PrintRecords(self.memory, self._record_block.address, RECORD_BYTES)
        self.print_lines[kernel.tag] = [(fmt.encode(), kinds)
                                        for fmt, kinds in print_formats(ir)]
        weakref.finalize(kernel, self.print_lines.pop, kernel.tag, None)
        return self._record_block.address

    def take_prints(self) -> None:
        """Write the lines printed since the last sync point (the stream has drained) where
        the program's go: its print sink, else ``sys.stdout`` (with a line saying how many
        were dropped, if the buffer filled)."""
        self.printed = False
        sink = self.launcher.print_sink
        if sink is not None:
            sink.append(*self.records.take(self.print_lines, sink.room()))
            return
        lines, dropped = self.records.take(self.print_lines)
        text = b"".join(lines).decode("utf-8", "replace")
        if dropped:
            if text and not text.endswith("\n"):
                text += "\n"
            text += (f"[difftape: {dropped} more lines printed by kernels were dropped: the "
                     f"grid's print buffer holds {self.records.capacity} bytes of lines per "
                     "launch]\n")
        if text:
            sys.stdout.write(text)
            sys.stdout.flush()

    def discard_prints(self) -> None:
        """Forget what was printed since the last sync point (an attempt that overflowed)."""
        self.printed = False
        self.records.discard()

    def clear_status(self) -> None:
        """Unclaim the status block (stream-ordered: before the next launch)."""
        self.memory.memset(self.status.address, 0, self.status.nbytes)

    def stack_pool(self, nbytes: int, kernel: str) -> DeviceBlock:
        """A block of at least ``nbytes`` for the stacks (the one held if large enough)."""
        if self.pool is None or self.pool.nbytes < nbytes:
            self.pool = None  # (freed before the larger one is taken)
            self.pool = self.scratch.block(self.allocator, "stack pool", nbytes,
                                           f"the reverse-mode stack pool of kernel '{kernel}'")
        return self.pool

    def snapshot_block(self, i: int, nbytes: int, kernel: str) -> DeviceBlock:
        """Snapshot block ``i`` with room for ``nbytes`` (kept between launches)."""
        what = f"a snapshot of what kernel '{kernel}' writes (for its overflow rerun)"
        while len(self.snapshots) <= i:
            self.snapshots.append(self.scratch.block(self.allocator, "snapshot blocks",
                                                     nbytes, what))
        if self.snapshots[i].nbytes < nbytes:
            self.snapshots[i] = None  # type: ignore[call-overload]
            self.snapshots[i] = self.scratch.block(self.allocator, "snapshot blocks", nbytes,
                                                   what)
        return self.snapshots[i]


#: launch contexts a kernel may have in flight before a launch waits for its oldest one
MAX_CONTEXTS = 64


class ContextSlot:
    """One of a kernel's launch contexts: device memory, the host buffer it is uploaded from
    (page-locked on CUDA) and the event after the launch that uses it (None: free)."""

    __slots__ = ("block", "host", "event")

    def __init__(self, allocator: DeviceMemoryAllocator, words: int, scratch: Scratch,
                 kernel: str) -> None:
        self.block = scratch.block(allocator, "launch contexts", words * 8,
                                   f"a launch context of kernel '{kernel}'")
        self.host = allocator.memory.host_array(words, np.int64)
        self.event: Any = None


def written_slots(ir: KernelIR, k: int) -> list[int]:
    """The buffer slots task ``k`` stores into or updates atomically (not private copies)."""
    out = set()
    for block in task_blocks(ir.tasks[k]):
        for s in walk(block):
            if s.op == "store":
                out.add(s.attr)
            elif s.op == "atomic":
                out.add(s.attr[0])
    return sorted(slot for slot in out if ir.buffers[slot].key[0] != "private")


def prints(ir: KernelIR, k: int) -> bool:
    """Does task ``k`` print?"""
    return any(s.op == "print" for block in task_blocks(ir.tasks[k]) for s in walk(block))


def may_overflow(ir: KernelIR, k: int) -> bool:
    """Can task ``k`` set the overflow flag: does it push onto a stack or take private
    copies (both come from memory sized before the launch)?"""
    task = ir.tasks[k]
    for block in task_blocks(task):
        for s in walk(block):
            if s.op == "stack_push":
                return True
            if s.op in ("load", "store", "atomic"):
                slot = s.attr if s.op in ("load", "store") else s.attr[0]
                if ir.buffers[slot].key[0] == "private":
                    return True
    return False


class GridKernel:
    """The tasks of one compiled kernel, each callable as a CPU task (``(ctx, begin, end,
    tid)``, arguments ignored) that launches it over the grid with the protocol above.
    ``entries``: the launcher's loaded entry of each task; ``rng``: the program's random
    states (device storage, one per grid thread at least); ``messages``: the kernel's error
    messages (``assert_messages``); ``sync_errors``: a launch that can fail is synchronous
    (``debug=True``, as Taichi checks after every launch in debug mode); ``code``: what
    keeps the entries' code loaded."""

    def __init__(self, ir: KernelIR, layout, entries: list[Any], launcher: Launcher,
                 rng: Storage, messages: list[Message] | None = None,
                 sync_errors: bool = False, code: object = None) -> None:
        self.ir, self.layout, self.launcher = ir, layout, launcher
        # What keeps the entries' code alive (the loaded module): held with this object by
        # the launch queue until the next sync point, so a kernel dropped while its launch is
        # pending is not unloaded under it.
        self.code = code
        self.allocator = launcher.allocator
        self.memory = self.allocator.memory
        self.queue = launcher.queue
        self.blocks, self.threads = launcher.grid
        n = self.blocks * self.threads
        if rng.size < n:
            raise DifftapeError(f"the grid has {n} threads but only {rng.size} random states")
        self.rng = rng
        self.messages = messages or []
        self.can_fail = bool(self.messages)
        overflows = any(may_overflow(ir, k) for k in range(len(ir.tasks)))
        #: enqueued without waiting: nothing to read back (see the module doc)
        self.asynchronous = not (ir.returns or overflows or (sync_errors and self.can_fail)
                                 or any(prints(ir, k) for k in range(len(ir.tasks))))
        # The host's launch context, which CompiledKernel packs after begin() and reads after
        # a synchronous task; each launch uploads it into a context of the ring.
        self.host = np.zeros(max(1, layout.size), np.int64)
        self.host[layout.rng] = rng.address
        self.host[layout.status] = self.queue.status.address
        self.tag = self.queue.tag()
        self.host[layout.tag] = self.tag
        self.prints = any(prints(ir, k) for k in range(len(ir.tasks)))
        if self.prints:  # its records carry the tag (codegen/cuda.py's print_call)
            self.host[layout.print_sink] = self.queue.print_buffer(self, ir)
        self.ring = [ContextSlot(self.allocator, self.host.size, self.queue.scratch, ir.name)]
        self._next = 0
        self.slot = self.ring[0]  # the current launch's context
        self._host_newer = True  # the host context is to be uploaded before the next task
        self.entries = entries
        self.last = len(ir.tasks) - 1
        self.cap = FIRST_STACK_SLOTS
        self.reruns = 0  # overflowed attempts (for tests and diagnostics)
        self.tasks: list[Callable[[int, int, int, int], None]] = [
            self._task_caller(k) for k in range(len(ir.tasks))]

    def begin(self) -> None:
        """Before the arguments are packed into :attr:`host`: this launch's context is the
        next of the ring whose last launch has ended; while all are in flight the ring grows,
        up to :data:`MAX_CONTEXTS`, and then the launch waits for the oldest."""
        slot = self.ring[self._next]
        if slot.event is not None:
            if not slot.event.query():
                if len(self.ring) < MAX_CONTEXTS:
                    slot = ContextSlot(self.allocator, self.host.size, self.queue.scratch,
                                       self.ir.name)
                    self.ring.insert(self._next, slot)
                else:
                    slot.event.synchronize()
            slot.event = None
        self._next = (self._next + 1) % len(self.ring)
        self.slot = slot
        self._host_newer = True

    def _enqueue(self, k: int) -> None:
        """Task ``k`` launched (host writes and the packed context uploaded first,
        stream-ordered) without waiting for it."""
        self.allocator.sync()
        slot = self.slot
        if self._host_newer:
            np.copyto(slot.host, self.host)
            self.memory.upload(slot.block.address, slot.host)
            self._host_newer = False
        queue = self.queue
        try:
            self.launcher.launch(self.entries[k], slot.block.address)
        finally:
            self.rng.device_written()  # the threads advance their states
        queue.launched[self.tag] = self
        if self.can_fail:
            queue.check = True
        if self.prints:
            queue.printed = True
        if k == self.last and self.asynchronous:
            slot.event = self.memory.record()

    def _run(self, k: int, take_prints: bool = True) -> np.ndarray:
        """Task ``k`` over the grid once, waited for (a sync point, which writes its printed
        lines unless ``take_prints`` is false); the launch context as the device left it
        (errors, overflow flag, returns), in :attr:`host`."""
        self._enqueue(k)
        self.queue.synchronize(take_prints)  # raises a failed earlier launch's error
        self.memory.download(self.host, self.slot.block.address)
        if self.host[self.layout.err_code]:  # ours: the caller raises it
            self.queue.clear_status()
        return self.host

    def _task_caller(self, k: int) -> Callable[[int, int, int, int], None]:
        if self.asynchronous:
            def enqueue(_c: int = 0, _b: int = 0, _e: int = 0, _t: int = 0) -> None:
                self._enqueue(k)
            return enqueue
        if not may_overflow(self.ir, k):
            def run(_c: int = 0, _b: int = 0, _e: int = 0, _t: int = 0) -> None:
                self._run(k)
            return run
        slots = written_slots(self.ir, k)
        printing = prints(self.ir, k)
        overflow = self.layout.overflow
        queue = self.queue

        def run_from_snapshot(_c: int = 0, _b: int = 0, _e: int = 0, _t: int = 0) -> None:
            self.allocator.sync()  # host writes, before the snapshot
            saved = self._snapshot(slots)
            packed = self.host.copy()  # the launch context as packed (and as uploaded)
            while True:
                self._set_pool()
                if not self._run(k, take_prints=not printing)[overflow]:
                    if printing:
                        queue.take_prints()
                    return
                self.reruns += 1
                if printing:  # the overflowed attempt's lines are never shown
                    queue.discard_prints()
                self._grow()
                self._restore(saved)
                self.host[:] = packed
        return run_from_snapshot

    # ------------------------------------------------------------------ the stack pool
    def _set_pool(self) -> None:
        pool = self.queue.stack_pool(self.cap * self.blocks * self.threads * 8, self.ir.name)
        lay, ctx = self.layout, self.host
        ctx[lay.stack_pool] = pool.address
        ctx[lay.stack_cap] = self.cap
        ctx[lay.overflow] = 0
        self._host_newer = True

    def _grow(self) -> None:
        cap = self.cap * 2
        if cap * self.blocks * self.threads * 8 > MAX_POOL_BYTES:
            raise DifftapeError(
                f"kernel '{self.ir.name}': the reverse-mode stacks need more than "
                f"{self.cap} slots per thread ({self.blocks * self.threads} threads), over "
                f"{MAX_POOL_BYTES >> 30} GiB in all (or the device heap for private copies "
                "ran out): launch a smaller grid or loop fewer times per index")
        self.cap = cap

    # ------------------------------------------------------------------ snapshots
    def _buffer_bytes(self, slot: int) -> tuple[int, int]:
        """(device address, size in bytes) of buffer ``slot`` in this launch (from the
        packed host context, which the device's equals)."""
        lay, buf, host = self.layout, self.ir.buffers[slot], self.host
        n = buf.dtype.bits // 8
        for axis, extent in enumerate(buf.shape):
            n *= extent if extent is not None else int(host[lay.buffer_extent[(slot, axis)]])
        return int(host[lay.buffer_ptr[slot]]), n

    def _snapshot(self, slots: list[int]) -> list[tuple[int, int, DeviceBlock]]:
        """Device-to-device copies (stream-ordered, into the program's snapshot blocks) of
        what the task writes and of the random states: (where from, bytes, the copy). The
        launch context is restored from the host's packed copy instead."""
        saved = []
        for i, (address, n) in enumerate([self._buffer_bytes(s) for s in slots] +
                                          [(self.rng.address, self.rng.nbytes)]):
            copy = self.queue.snapshot_block(i, n, self.ir.name)
            self.memory.copy(copy.address, address, n)
            saved.append((address, n, copy))
        return saved

    def _restore(self, saved: list[tuple[int, int, DeviceBlock]]) -> None:
        for address, n, copy in saved:
            self.memory.copy(address, copy.address, n)
        self.queue.clear_status()  # an overflowed attempt's (spurious) error is forgotten
        self.rng.device_written()
