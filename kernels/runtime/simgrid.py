"""Launching a kernel over a simulated GPU grid: the runtime protocol of a GPU launch, on the CPU.

The code is the CUDA target's lowering compiled for the host (``codegen/simgrid.py``): task
``k`` has a driver ``void(ptr ctx, i64 blocks, i64 threads, i64 reverse)`` that runs the task
for each thread of a ``blocks x threads`` grid, one after another. Everything else a GPU
launcher must do lives here, target-independent, so the pycuda launcher has only to move
memory and call ``cuLaunchKernel`` where this calls the driver:

- **Launch context.** The same :class:`~difftape.codegen.layout.CtxLayout` and argument
  packing as the CPU path (``CompiledKernel.launch`` writes arguments, then calls each task);
  the grid adds the pool slots below.
- **Reverse-mode stacks.** One pool of ``cap`` 64-bit slots per thread (``stack_pool``,
  ``stack_cap``), kept by the kernel between launches. A thread that pushes past ``cap``
  sets the ``overflow`` slot (and stores nothing out of its slice); the launcher then reruns
  the task with the pool doubled. The rerun is safe because a task that can overflow (it
  pushes onto a stack or takes private copies from the heap) is launched from a snapshot:
  before it runs, the launcher saves the buffers it writes (stores and atomics: e.g. the
  ``.grad`` it accumulates into), the launch context (temps, returns, error word) and the
  random states, and restores them all before a rerun. So no side effect of the overflowed
  attempt survives: a gradient is never accumulated twice, atomics into fields and ndarrays
  are added once, random numbers repeat, and the error word and return values are the
  rerun's. On a GPU the snapshot is a device-to-device copy of those buffers, made only for
  such tasks.
- **Printing.** Output cannot be taken back, so a task that may overflow and prints runs with
  the launch context's ``quiet`` flag set (its ``print`` statements do nothing) until an
  attempt fits, and then once more, from the snapshot and with the pool that fitted, to print
  (the same inputs and random states give the same stack depths). Such a task costs one more
  run per launch; one that does not print, or cannot overflow, runs as before.
- **Errors.** The error word is decoded after each task by ``runtime/launch.py`` into the
  exception the CPU path raises (index, field and line).
- **Random numbers.** Thread ``g`` uses state ``g``: the program holds (at least) one state
  per grid thread (``Program.seed_random``).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import numpy as np

from ..errors import DifftapeError, OptionError
from ..ir.nodes import KernelIR, task_blocks, walk

GRID_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                           ctypes.c_int64)
#: slots per thread a kernel's stack pool starts with (doubled on each overflow)
FIRST_STACK_SLOTS = 64
#: the largest pool, in bytes, a rerun may ask for before the launch is refused
MAX_POOL_BYTES = 1 << 32


def parse_grid(value) -> tuple[int, int] | None:
    """``simulate_grid``: ``(blocks, threads)`` (or ``"blocks,threads"``); None, False or 0:
    off (the CPU's own launch)."""
    if value is None or value is False or (isinstance(value, int | str) and value in (0, "0")):
        return None
    if isinstance(value, str):
        value = value.replace("x", ",").split(",")
    try:
        blocks, threads = (int(v) for v in value)
    except (TypeError, ValueError):
        raise OptionError(f"simulate_grid={value!r}: expected (blocks, threads), two positive "
                          "integers") from None
    if blocks < 1 or threads < 1:
        raise OptionError(f"simulate_grid={value!r}: blocks and threads must be positive")
    return blocks, threads


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
    tid)``, arguments ignored) that launches it over the grid with the protocol above."""

    def __init__(self, ir: KernelIR, layout, ctx_i64: np.ndarray, entries: list[int],
                 grid: tuple[int, int], rng_states: np.ndarray, reverse: bool = False) -> None:
        self.ir, self.layout, self.ctx = ir, layout, ctx_i64
        self.blocks, self.threads = grid
        self.reverse = int(reverse)
        n = self.blocks * self.threads
        if len(rng_states) < n:
            raise DifftapeError(f"the simulated grid has {n} threads but only "
                                f"{len(rng_states)} random states")
        self.rng = rng_states
        self.entries = [GRID_FN(a) for a in entries]
        self.cap = FIRST_STACK_SLOTS
        self.pool: np.ndarray | None = None
        self.reruns = 0  # overflowed attempts (for tests and diagnostics)
        self.tasks: list[Callable[[int, int, int, int], None]] = [
            self._task_caller(k) for k in range(len(ir.tasks))]

    def _task_caller(self, k: int) -> Callable[[int, int, int, int], None]:
        entry = self.entries[k]
        if not may_overflow(self.ir, k):
            def run(ctx: int, _b: int = 0, _e: int = 0, _t: int = 0) -> None:
                entry(ctx, self.blocks, self.threads, self.reverse)
            return run
        slots = written_slots(self.ir, k)
        loud_once = prints(self.ir, k)

        def run_from_snapshot(ctx: int, _b: int = 0, _e: int = 0, _t: int = 0) -> None:
            saved = self._snapshot(slots)
            quiet = loud_once
            while True:
                self._set_pool(quiet)
                entry(ctx, self.blocks, self.threads, self.reverse)
                if not self.ctx[self.layout.overflow]:
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
        if self.pool is None or len(self.pool) < self.cap * n:
            self.pool = np.zeros(self.cap * n, np.int64)
        lay = self.layout
        self.ctx[lay.stack_pool] = self.pool.ctypes.data
        self.ctx[lay.stack_cap] = self.cap
        self.ctx[lay.overflow] = 0
        self.ctx[lay.quiet] = int(quiet)

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
        """(address, size in bytes) of buffer ``slot`` in this launch."""
        lay, buf = self.layout, self.ir.buffers[slot]
        n = buf.dtype.bits // 8
        for axis, extent in enumerate(buf.shape):
            n *= extent if extent is not None else int(self.ctx[lay.buffer_extent[(slot, axis)]])
        return int(self.ctx[lay.buffer_ptr[slot]]), n

    def _snapshot(self, slots: list[int]) -> tuple:
        buffers = []
        for slot in slots:
            addr, n = self._buffer_bytes(slot)
            copy = np.empty(n, np.uint8)
            ctypes.memmove(copy.ctypes.data, addr, n)
            buffers.append((addr, copy))
        return buffers, self.ctx.copy(), self.rng.copy()

    def _restore(self, saved: tuple) -> None:
        buffers, ctx, rng = saved
        for addr, copy in buffers:
            ctypes.memmove(addr, copy.ctypes.data, len(copy))
        self.ctx[:] = ctx
        self.rng[:] = rng
