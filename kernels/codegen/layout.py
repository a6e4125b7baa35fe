"""The launch context: one array of 64-bit slots shared by the launcher and the generated code.

Buffers' base pointers, ndarray extents, scalar arguments, temps (kernel-level variables shared
between tasks), return values, the error report (the failed check's message number and the
values its message shows, one slot each: as many as the kernel's longest message needs, at
least one), the random-state pointer, the commit ticket
of ordered (deterministic) tasks and, for targets whose reverse-mode stacks come from a
preallocated pool (CUDA), the pool's address, each thread's capacity and the overflow flag,
on the CPU the stack budget (where the program counts the memory its threads' stacks take,
``runtime/stackbudget.py``; 0: not counted),
the print sink (where ``print`` writes when the program collects its kernels' output, and on
grid targets always: ``runtime/printsink.py``), and for grid
targets, whose launches are asynchronous, the address of the program's status block and the
kernel's tag (a failed launch stops the launches queued after it and says which kernel failed)
each have a slot. Floats travel as f64 bit patterns and integers as i64, so the Python side
writes every scalar with one NumPy store and the layout does not depend on argument types.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..ir.assertfmt import assert_messages
from ..ir.nodes import KernelIR

#: A print sink (``runtime/printsink.py``) begins with three i64 words, cursor (bytes
#: reserved), capacity (bytes it holds after the header) and lines dropped; then its lines:
#: the CPU's text (each line NUL-terminated), or the grid targets' records (a key word, the
#: kernel's tag << 32 | the line's number, then one word per operand).
PRINT_SINK_HEADER = 24

#: A stack budget (``runtime/stackbudget.py``) is three i64 words: the bytes the reverse-mode
#: stacks of the program's threads hold now (atomically updated), the bytes they may hold
#: without asking, and the address of the function asked for more,
#: ``i32 ask(ptr ctx, i64 bytes)`` (nonzero: granted).
STACK_BUDGET_USED, STACK_BUDGET_LIMIT, STACK_BUDGET_ASK = 0, 1, 2
STACK_BUDGET_WORDS = 3

#: The error code (``CtxLayout.err_code``) of a launch whose stacks were refused memory by
#: the stack budget: not a message number (those are positive); the launcher raises the
#: budget's refusal (``runtime/launch.py``).
STACK_REFUSED = -1


@dataclass
class CtxLayout:
    buffer_ptr: list[int] = field(default_factory=list)
    buffer_extent: dict[tuple[int, int], int] = field(default_factory=dict)
    params: list[int] = field(default_factory=list)
    temps: int = 0
    returns: list[int] = field(default_factory=list)
    err_code: int = 0
    err_value: int = 0  # the first of err_values slots: the failed check's message's values
    err_values: int = 1
    rng: int = 0
    commit: int = 0  # an "ordered" task's next chunk to commit (its begin index)
    stack_pool: int = 0  # pooled stacks: the pool's address
    stack_cap: int = 0  # pooled stacks: slots per thread
    overflow: int = 0  # set when a pooled stack or the device heap ran out: rerun larger
    stack_budget: int = 0  # the CPU: the program's stack budget's address, or 0
    status: int = 0  # grid targets: the program's status block's address (runtime/grid.py)
    tag: int = 0  # grid targets: the kernel's tag, written there by a launch that fails
    print_sink: int = 0  # the print sink (runtime/printsink.py); on the CPU 0: C's stdout
    size: int = 0


def ctx_layout(ir: KernelIR) -> CtxLayout:
    lay = CtxLayout()
    n = 0
    for _ in ir.buffers:
        lay.buffer_ptr.append(n)
        n += 1
    for slot, buf in enumerate(ir.buffers):
        for axis, extent in enumerate(buf.shape):
            if extent is None:
                lay.buffer_extent[(slot, axis)] = n
                n += 1
    for _ in ir.params:
        lay.params.append(n)
        n += 1
    lay.temps = n
    n += ir.num_temps
    for _ in ir.returns:
        lay.returns.append(n)
        n += 1
    lay.err_code, lay.rng, lay.commit = n, n + 1, n + 2
    lay.stack_pool, lay.stack_cap, lay.overflow = n + 3, n + 4, n + 5
    lay.status, lay.tag = n + 6, n + 7
    lay.print_sink, lay.stack_budget = n + 8, n + 9
    lay.err_value = n + 10
    lay.err_values = max([1] + [len(m.types) for m in assert_messages(ir)])
    lay.size = lay.err_value + lay.err_values
    return lay
