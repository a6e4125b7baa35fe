"""Launching a kernel over a GPU grid: the protocol, for every grid target.

The code is the CUDA target's lowering (``codegen/cuda.py``): task ``k`` is one entry that
runs on a ``blocks x threads`` grid. A :class:`Launcher` supplies what is target-specific:
its device memory (the program's allocator), loading compiled code and running one task over
the grid. There are two: ``runtime/simgrid.py``'s :class:`SimulatedLauncher` (the lowering
compiled for the host, every thread of the grid run one after another on the CPU) and
``runtime/cuda.py``'s ``CudaLauncher`` (PTX loaded with pycuda, ``cuLaunchKernel``). All the
rest lives here, written once, so that CI exercises on the simulated grid exactly what a GPU
runs:

- **Launch context in device memory.** :class:`GridKernel` keeps the launch context as
  storage from the program's allocator (``runtime/storage.py``). ``CompiledKernel`` packs the
  arguments into its host mirror between the sync points (:meth:`GridKernel.begin`, then the
  first task uploads it); after each task the context is read back through the storage
  (``device_written`` + ``read``): the error word, the overflow flag and the return values
  the host then decodes (``runtime/launch.py``) are the device's.
- **Reverse-mode stacks.** One pool of ``cap`` 64-bit slots per thread (``stack_pool``,
  ``stack_cap``), a block of device memory kept by the kernel between launches. A thread that
  pushes past ``cap`` sets the ``overflow`` slot (and stores nothing out of its slice); the
  launcher then reruns the task with the pool doubled. The rerun is safe because a task that
  can overflow (it pushes onto a stack or takes private copies from the device heap) is
  launched from a snapshot: before it runs, the buffers it writes (stores and atomics: e.g.
  the ``.grad`` it accumulates into), the launch context (temps, returns, error word) and the
  random states are copied device to device, and copied back before a rerun. So no side
  effect of the overflowed attempt survives: a gradient is never accumulated twice, atomics
  into fields and ndarrays are added once, random numbers repeat, and the error word and
  return values are the rerun's.
- **Printing.** Output cannot be taken back, so a task that may overflow and prints runs with
  the launch context's ``quiet`` flag set (its ``print`` statements do nothing) until an
  attempt fits, and then once more, from the snapshot and with the pool that fitted, to print
  (the same inputs and random states give the same stack depths). Such a task costs one more
  run per launch; one that does not print, or cannot overflow, runs as before.
- **Random numbers.** Thread ``g`` uses state ``g`` of the program's random-state storage
  (device memory too), which holds at least one state per grid thread
  (``Program.seed_random``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import DifftapeError
from ..ir.nodes import KernelIR, task_blocks, walk
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
    #: the program's allocator: field, ndarray, launch-context and scratch memory
    allocator: DeviceMemoryAllocator
    #: the code generator (``codegen``'s CUDA target, or the simulated grid's)
    target: Any

    def load(self, obj: bytes, names: list[str]) -> tuple[object, dict[str, Any]]:
        """Compiled code loaded: (what keeps it alive, entry name -> what :meth:`launch`
        takes)."""
        raise NotImplementedError

    def launch(self, entry: Any, ctx: int) -> None:
        """Run one task over the grid with the launch context at device address ``ctx``
        (it may return before the task ends: :meth:`wait`)."""
        raise NotImplementedError

    def wait(self, kernel: str) -> None:
        """Until the launches so far have ended; a failed launch raises naming ``kernel``."""

    def close(self) -> None:
        """Release the device (after the allocator's memory)."""
        self.allocator.close()


class DeviceBlock:
    """A block of device memory with no host mirror (a stack pool, a snapshot), freed when
    dropped or when the allocator closes, whichever comes first."""

    __slots__ = ("address", "nbytes", "_finalizer", "__weakref__")

    def __init__(self, allocator: DeviceMemoryAllocator, nbytes: int) -> None:
        self.nbytes = int(nbytes)
        self.address = allocator.memory.alloc(self.nbytes)
        self._finalizer = weakref.finalize(self, allocator._release, self.address)


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
    states (device storage, one per grid thread at least)."""

    def __init__(self, ir: KernelIR, layout, entries: list[Any], launcher: Launcher,
                 rng: Storage) -> None:
        self.ir, self.layout, self.launcher = ir, layout, launcher
        self.allocator = launcher.allocator
        self.blocks, self.threads = launcher.grid
        n = self.blocks * self.threads
        if rng.size < n:
            raise DifftapeError(f"the grid has {n} threads but only {rng.size} random states")
        self.rng = rng
        # The launch context: device storage; ``host`` is its mirror, which CompiledKernel
        # packs after begin() and reads after each task (both sync points are here).
        self.ctx = self.allocator.storage((max(1, layout.size),), np.int64)
        self.host = self.ctx.write()
        self.host[layout.rng] = rng.address
        self.entries = entries
        self.cap = FIRST_STACK_SLOTS
        self.pool: DeviceBlock | None = None
        self.reruns = 0  # overflowed attempts (for tests and diagnostics)
        self.tasks: list[Callable[[int, int, int, int], None]] = [
            self._task_caller(k) for k in range(len(ir.tasks))]

    def begin(self) -> None:
        """Before the arguments are packed into :attr:`host` (after the allocator's sync):
        the mirror is current and will be uploaded by the first task."""
        self.ctx.write()

    def _run(self, k: int) -> np.ndarray:
        """Task ``k`` over the grid once (host writes uploaded first); the launch context
        as the device left it (errors, overflow flag, returns)."""
        self.allocator.sync()
        try:
            self.launcher.launch(self.entries[k], self.ctx.address)
            self.launcher.wait(self.ir.name)
        finally:
            self.ctx.device_written()
            self.rng.device_written()  # the threads advanced their states
        return self.ctx.read()

    def _task_caller(self, k: int) -> Callable[[int, int, int, int], None]:
        if not may_overflow(self.ir, k):
            def run(_c: int = 0, _b: int = 0, _e: int = 0, _t: int = 0) -> None:
                self._run(k)
            return run
        slots = written_slots(self.ir, k)
        loud_once = prints(self.ir, k)
        overflow = self.layout.overflow

        def run_from_snapshot(_c: int = 0, _b: int = 0, _e: int = 0, _t: int = 0) -> None:
            self.allocator.sync()  # the packed context and host writes, before the snapshot
            saved = self._snapshot(slots)
            quiet = loud_once
            while True:
                self._set_pool(quiet)
                if not self._run(k)[overflow]:
                    if not quiet:
                        return
                    quiet = False  # it fits: once more from the snapshot, printing
                else:  # (a printing attempt overflows only if depths are racy: quiet again)
                    self.reruns += 1
                    self._grow()
                    quiet = loud_once
                self._restore(saved)
        return run_from_snapshot

    # ------------------------------------------------------------------ the stack pool
    def _set_pool(self, quiet: bool = False) -> None:
        n = self.blocks * self.threads
        if self.pool is None or self.pool.nbytes < self.cap * n * 8:
            self.pool = None  # (freed before the larger one is taken)
            self.pool = DeviceBlock(self.allocator, self.cap * n * 8)
        lay, ctx = self.layout, self.ctx.write()
        ctx[lay.stack_pool] = self.pool.address
        ctx[lay.stack_cap] = self.cap
        ctx[lay.overflow] = 0
        ctx[lay.quiet] = int(quiet)

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
        packed context's mirror: uploaded, so equal to the device's)."""
        lay, buf, host = self.layout, self.ir.buffers[slot], self.ctx.read()
        n = buf.dtype.bits // 8
        for axis, extent in enumerate(buf.shape):
            n *= extent if extent is not None else int(host[lay.buffer_extent[(slot, axis)]])
        return int(host[lay.buffer_ptr[slot]]), n

    def _snapshot(self, slots: list[int]) -> list[tuple[int, DeviceBlock]]:
        """Device-to-device copies of what the task writes, the context and the random
        states: (where it came from, the copy)."""
        memory = self.allocator.memory
        saved = []
        for address, n in [self._buffer_bytes(s) for s in slots] + [
                (self.ctx.address, self.ctx.nbytes), (self.rng.address, self.rng.nbytes)]:
            copy = DeviceBlock(self.allocator, n)
            memory.copy(copy.address, address, n)
            saved.append((address, copy))
        return saved

    def _restore(self, saved: list[tuple[int, DeviceBlock]]) -> None:
        memory = self.allocator.memory
        for address, copy in saved:
            memory.copy(address, copy.address, copy.nbytes)
        self.ctx.device_written()
        self.rng.device_written()
