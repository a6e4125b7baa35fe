"""A captured ``ti.graph`` replayed on a GPU grid: graph executables, for every grid target.

``graph/core.py`` records a step as launches (each with its own packed launch context) and
device operations (copies and clears); on a CPU program ``runtime/graph.py`` runs them. On a
grid program (the simulated grid, CUDA) :class:`GridGraph` turns them into **segments**:

- a *device segment*: consecutive asynchronous launches (``runtime/grid.py``: nothing read
  back) and copies/clears, as one graph executable of the launcher
  (:meth:`~.grid.Launcher.instantiate`: a CUDA graph on CUDA, ``runtime/simgrid.py``'s
  simulated one in CI), **instantiated once**, at the first replay, and launched as a whole on
  the program's stream;
- a *host step*: a launch that ``runtime/grid.py`` runs synchronously because the host
  decides something after it: a task that may overflow its reverse-mode stacks or private
  copies (the overflow rerun from snapshots, with a larger pool: the depth is known only at
  run time), a kernel that prints (its output is ordered with Python's at the launch), and
  under ``debug=True`` a kernel with checks (raised at its launch, as Taichi does in debug
  mode). It runs as the eager launch does, from the graph's packed context. (CUDA 12.3's
  conditional nodes could keep a data-dependent rerun inside the graph, but not the pool's
  reallocation between the attempts, nor host output; so these stay host steps, and a step
  whose kernels need none of them is one CUDA graph.)

**Changed inputs without instantiating again.** The kernel nodes' one parameter is the
address of their launch context in one device block per graph (the *argument block*), fixed
for the graph's life; the contexts themselves (scalars, array addresses and extents, bounds
computed on the device from them) are the host's packed copies, which named inputs rewrite,
and every replay uploads the whole block with **one** asynchronous copy (from a ring of
page-locked buffers, so a pending upload's source is never rewritten) before the first
segment. So a new scalar or a new array of the same shape reaches every launch through
memory, and the executables' kernel nodes never change. Copies and clears do name
addresses: when an input's new storage moves one, the segment's executable is **updated**
in place (:meth:`~.grid.GraphExec.update`; ``cuGraphExecUpdate`` on CUDA), not
instantiated again. :attr:`GridGraph.instantiations` and :attr:`GridGraph.updates` count
both.

**Errors.** Every launch in a device segment checks and claims the program's status block as
an asynchronous eager launch does (first failure wins; the launches after it return at
once), and is registered with the launch queue, so the next sync point raises the CPU's error
text. A host step raises at its launch, as eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .grid import MAX_CONTEXTS, DeviceBlock, GraphExec, GridKernel, Launcher
from .launch import raise_error_word


class _Segment:
    """Consecutive device work: its kernels by tag (for the launch queue), its nodes, how to
    compute the copies' and clears' nodes from their contexts (by index: the kernel nodes
    never change), and its executable once instantiated."""

    def __init__(self) -> None:
        self.nodes: list[tuple] = []
        self.ops: list[tuple[int, Callable[[], tuple]]] = []
        self.exec: GraphExec | None = None
        self.tags: dict[int, GridKernel] = {}  # the kernels by tag, for the launch queue
        self.can_fail = False  # one of them has checks

    def moved(self) -> bool:
        """Recompute the copies' and clears' nodes; whether one differs from before."""
        nodes, changed = self.nodes, False
        for k, make in self.ops:
            node = make()
            if node != nodes[k]:
                nodes[k] = node
                changed = True
        return changed


class GridGraph:
    """The grid replay of one captured graph (see the module doc).

    ``steps``: in order, ``("launch", kernel, ctx)`` (a :class:`~.grid.GridKernel` and the
    graph's packed launch context for it) and ``("copy"|"zero", ctx, begin, end)`` (bytes
    [begin, end) of the addresses in ``ctx``). The launch contexts of device segments are
    moved into the argument block's host copy: :attr:`contexts` maps ``id`` of each such
    context given to the view that replaces it (what the graph's inputs must write into)."""

    def __init__(self, launcher: Launcher, steps: list[tuple]) -> None:
        self.launcher = launcher
        self.memory = launcher.allocator.memory
        self.updates = 0  # executables updated in place for changed addresses
        words = sum(s[1].host.size for s in steps if s[0] == "launch" and s[1].asynchronous)
        self.args = np.zeros(max(1, words), np.int64)  # the argument block's host copy
        self.block = DeviceBlock(launcher.allocator, self.args.nbytes)
        self._ring: list[list[Any]] = []  # [page-locked host buffer, event after its upload]
        self._next = 0
        self.contexts: dict[int, np.ndarray] = {}
        self.parts: list[_Segment | tuple[GridKernel, np.ndarray]] = []
        self.rng = None
        offset = 0
        segment = None
        for step in steps:
            if step[0] == "launch" and not step[1].asynchronous:
                self.parts.append((step[1], step[2]))  # a host step
                segment = None
                continue
            if segment is None:
                segment = _Segment()
                self.parts.append(segment)
            if step[0] == "launch":
                kernel, ctx = step[1], step[2]
                view = self.args[offset:offset + ctx.size]
                view[:] = ctx
                self.contexts[id(ctx)] = view
                address = self.block.address + 8 * offset
                offset += ctx.size
                segment.tags[kernel.tag] = kernel
                segment.can_fail = segment.can_fail or kernel.can_fail
                self.rng = kernel.rng
                for entry in kernel.entries:
                    segment.nodes.append(("kernel", entry, address))
                continue
            _, ctx, begin, end = step
            if step[0] == "copy":
                make = (lambda c=ctx, b=begin, e=end:  # noqa: E731
                        ("copy", int(c[0]) + b, int(c[1]) + b, e - b))
            else:
                make = (lambda c=ctx, b=begin, e=end:  # noqa: E731
                        ("memset", int(c[0]) + b, e - b))
            segment.ops.append((len(segment.nodes), make))
            segment.nodes.append(make())

    @property
    def instantiations(self) -> int:
        """Graph executables instantiated so far (once per device segment, unless CUDA
        refused an update in place: ``runtime/cuda.py``)."""
        return sum(p.exec.instantiated for p in self.parts
                   if isinstance(p, _Segment) and p.exec is not None)

    def replay(self) -> None:
        """Run the graph once on the program's stream: host writes uploaded, the argument
        block uploaded (one copy), then each segment launched (instantiated at the first
        replay, updated where addresses changed) and each host step run. Returns once
        everything is enqueued, unless a host step synchronises."""
        allocator = self.launcher.allocator
        allocator.sync()
        if self.contexts:  # (launches in device segments read the argument block)
            self._upload()
        queue = self.launcher.queue
        for part in self.parts:
            if isinstance(part, _Segment):
                moved = part.moved()
                if part.exec is None:
                    part.exec = self.launcher.instantiate(part.nodes)
                elif moved:
                    part.exec.update(part.nodes)
                    self.updates += 1
                part.exec.launch()
                if part.tags:
                    queue.launched.update(part.tags)  # (held, and found by a failure's tag)
                    if part.can_fail:
                        queue.check = True
                    self.rng.device_written()  # the threads advance their states
            else:
                run_packed(*part)

    def _upload(self) -> None:
        """The argument block's host copy uploaded, stream-ordered, from a page-locked buffer
        of the ring that no pending upload reads (the ring grows while all are pending, up
        to :data:`~.grid.MAX_CONTEXTS`, then the oldest is waited for)."""
        ring = self._ring
        slot = ring[self._next] if ring else None
        if slot is None or (slot[1] is not None and not slot[1].query()):
            if len(ring) < MAX_CONTEXTS:
                slot = [self.memory.host_array(self.args.size, np.int64), None]
                ring.insert(self._next, slot)
            else:
                slot[1].synchronize()
        self._next = (self._next + 1) % len(ring)
        np.copyto(slot[0], self.args)
        self.memory.upload(self.block.address, slot[0])
        slot[1] = self.memory.record()


def run_packed(kernel: GridKernel, ctx: np.ndarray) -> None:
    """One launch of ``kernel`` over the grid from a packed launch context ``ctx``, as the
    eager launch runs it after packing (synchronous kernels wait; a failed check raises the
    CPU's error here). The kernel's host context is its eager launches' template (the field
    addresses are packed into it once, when it is compiled), so it gets its own values back
    afterwards: a graph's context may address other fields (an input bound to another)."""
    own = kernel.host.copy()
    kernel.begin()
    np.copyto(kernel.host, ctx)
    lay = kernel.layout
    try:
        for task in kernel.tasks:
            task()
            code = int(kernel.host[lay.err_code])
            if code:
                words = kernel.host[lay.err_value:lay.err_value + lay.err_values].tolist()
                kernel.host[lay.err_code] = 0
                raise_error_word(kernel.messages, code, words, kernel.ir.name)
    finally:
        np.copyto(kernel.host, own)
