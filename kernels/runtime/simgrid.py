"""The simulated grid's launcher: a GPU launch run on the CPU, thread after thread.

The code is the CUDA target's lowering compiled for the host (``codegen/simgrid.py``): task
``k`` has a driver ``void(ptr ctx, i64 blocks, i64 threads, i64 reverse)`` that runs the task
for each thread of a ``blocks x threads`` grid, one after another (``reverse``: last thread
first). :class:`SimulatedLauncher` is the :class:`~.grid.Launcher` that calls it where
``runtime/cuda.py``'s ``CudaLauncher`` calls ``cuLaunchKernel``; everything else of a launch
(asynchrony and the sync points, the launch contexts, error word and returns in device memory,
the stack pool and the overflow rerun from device snapshots, per-thread random states) is
``runtime/grid.py``'s, shared with CUDA. Its device memory is
:class:`~.storage.SimulatedDeviceAllocator`'s (poisoned host mirrors, and a deferred stream: a
launch runs only when the host synchronises), so a host access that skips a sync point fails
in CI.

Graphs (``ti.graph`` on the grid, ``runtime/gridgraph.py``) get :class:`SimulatedGraphExec`:
the nodes frozen at instantiation (or at the last update) and run, one after another, as one
operation of the deferred stream. So a replay that forgets to update the executable after an
address changed, or to upload the launch contexts the nodes read, computes a wrong answer in
CI, as it would with a CUDA graph.
"""

from __future__ import annotations

import ctypes
from typing import Any

from ..errors import OptionError
from .grid import GraphExec, Launcher
from .storage import SimulatedDeviceAllocator

GRID_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                           ctypes.c_int64)


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


class SimulatedLauncher(Launcher):
    """Launches on the simulated grid (``ti.init(simulate_grid=(blocks, threads))``)."""

    name = "the simulated grid"

    def __init__(self, grid: tuple[int, int], reverse: bool = False) -> None:
        # Function-level: codegen.simgrid loads LLVM (llvmlite), as codegen.get_target does.
        from ..codegen.simgrid import get_target

        self.grid = grid
        self.reverse = int(reverse)  # run the grid's threads last first
        self.allocator = SimulatedDeviceAllocator()
        self.memory = self.allocator.memory
        self.target = get_target()

    def load(self, obj: bytes, names: list[str]) -> tuple[object, dict[str, Any]]:
        engine, addresses = self.target.load(obj, names)
        return engine, {n: GRID_FN(a) for n, a in addresses.items()}

    def launch(self, entry: Any, ctx: int) -> None:
        """Enqueued on the simulated memory's deferred stream: the grid runs when the host
        synchronises (``runtime/storage.py``'s :class:`~.storage.SimulatedStream`)."""
        blocks, threads = self.grid
        reverse = self.reverse
        self.memory.stream.enqueue(lambda: entry(ctx, blocks, threads, reverse))

    def instantiate(self, nodes: list[tuple]) -> SimulatedGraphExec:
        return SimulatedGraphExec(self, nodes)


class SimulatedGraphExec(GraphExec):
    """A graph executable on the simulated grid (see the module doc)."""

    def __init__(self, launcher: SimulatedLauncher, nodes: list[tuple]) -> None:
        self.launcher = launcher
        self.nodes = list(nodes)

    def update(self, nodes: list[tuple]) -> None:
        self.check_shape(self.nodes, nodes)
        self.nodes = list(nodes)

    def launch(self) -> None:
        nodes = tuple(self.nodes)  # as instantiated now: a later update applies to later launches
        blocks, threads = self.launcher.grid
        reverse = self.launcher.reverse

        def run() -> None:
            for node in nodes:
                if node[0] == "kernel":
                    node[1](node[2], blocks, threads, reverse)
                elif node[0] == "copy":
                    ctypes.memmove(node[1], node[2], node[3])
                else:
                    ctypes.memset(node[1], 0, node[2])
        self.launcher.memory.stream.enqueue(run)
