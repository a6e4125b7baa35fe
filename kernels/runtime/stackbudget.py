"""A stack budget: the memory a program's CPU threads take for reverse-mode stacks, counted.

A reverse-mode kernel's stacks grow while it runs: each thread's by doubling (``realloc``,
``codegen/cpu.py``), as deep as the loop it differentiates, and are freed when its chunk
ends. A program that runs kernels for someone else under a memory quota (the service's
engine) cannot let them take what the quota does not allow, nor check before each push. So
it sets ``Program.stack_budget``; every kernel it compiles then gets the budget's address in
its launch context (``CtxLayout.stack_budget``), and each growth of a stack adds its bytes to
the budget's count (one atomic add) before it allocates them. Only a growth that takes the
count past the budget's limit calls back into Python (:meth:`StackBudget._asked`), where the
owner's ``ask`` says whether the quota allows it and sets the next limit; a refusal makes the
thread's task leave as a failed check does, and the launch raises the owner's refusal
(``runtime/launch.py``). A program's steady launches, whose stacks stay within the limit, never
call back. Without a budget (slot 0) stacks are not counted.

The budget's words (``codegen/layout.py``): the bytes held now, the limit, the address of the
function asked. The callback runs on the thread that grows its stack (a pool thread, or the
launching one), with the kernel's floating-point mode (subnormal results flushed to zero,
``codegen/cpu.py``): an ``ask`` computes with integers only.

Not counted here: a chunk's private copies of privatized scatter targets (``calloc``'d per
chunk; bounded, at most ``ir/passes/scatter.py``'s ``MAX_ELEMENTS`` elements each).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable

from ..codegen.layout import (
    STACK_BUDGET_ASK,
    STACK_BUDGET_LIMIT,
    STACK_BUDGET_USED,
    STACK_BUDGET_WORDS,
)

#: ``i32 ask(ptr ctx, i64 bytes)``: called by a thread whose stack growth of ``bytes`` took the
#: count past the limit (those bytes already counted); nonzero when they are granted.
_ASK = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64)


class StackBudget:
    """The count of a program's reverse-mode stack memory, its limit, and the owner's
    ``ask(kernel, nbytes) -> limit`` for more: called with the kernel's name and the bytes of
    the growth (counted in :attr:`held` already), it returns the new limit (at least
    :attr:`held`) or raises why not (the error the launch then raises)."""

    def __init__(self, ask: Callable[[str, int], int]) -> None:
        self._ask = ask
        self._words = (ctypes.c_int64 * STACK_BUDGET_WORDS)()
        self._callback = _ASK(self._asked)  # kept alive with the budget
        self._words[STACK_BUDGET_ASK] = ctypes.cast(self._callback, ctypes.c_void_p).value
        self._lock = threading.Lock()  # one ask at a time: threads growing together wait
        self._kernels: dict[int, str] = {}  # launch context address -> kernel name
        # launch context address -> the error of the last ask refused while it ran: kept
        # per context, so that one whose report lost to a failed check (the first error
        # of a launch wins) is never raised for another kernel
        self._refusals: dict[int, BaseException] = {}

    @property
    def address(self) -> int:
        return ctypes.addressof(self._words)

    @property
    def held(self) -> int:
        """Bytes of stack the program's threads hold now (0 between launches)."""
        return self._words[STACK_BUDGET_USED]

    def invalidate(self) -> None:
        """Forget the limit: what it was computed from changed (the owner's other memory),
        so the next growth asks again."""
        self._words[STACK_BUDGET_LIMIT] = 0

    def attach(self, ctx_address: int, kernel: str) -> None:
        """A launch context of ``kernel`` (a compiled kernel's, a graph's copy of it) points
        at this budget: ``kernel`` names it in an ask and a refusal."""
        self._kernels[ctx_address] = kernel
        self._refusals.pop(ctx_address, None)

    def take_refusal(self, ctx_address: int, kernel: str) -> BaseException:
        """The error of the ask refused during the launch of ``kernel`` from the launch
        context at ``ctx_address`` (whose report is ``STACK_REFUSED``)."""
        with self._lock:
            err = self._refusals.pop(ctx_address, None)
        if err is None:  # a thread reported it without an ask refused: a bug of ours
            err = RuntimeError(f"kernel '{kernel}': its reverse-mode stacks were refused memory "
                               "but no refusal was recorded")
        if getattr(err, "kernel", None) is None:
            err.kernel = kernel
        return err

    def _asked(self, ctx: int | None, nbytes: int) -> int:
        """The native callback: never raises (it returns into generated code), so an error
        is kept for :meth:`take_refusal` and answered 0."""
        try:
            with self._lock:
                if self._words[STACK_BUDGET_USED] <= self._words[STACK_BUDGET_LIMIT]:
                    return 1  # another thread's ask, while this one waited, covered it
                kernel = self._kernels.get(ctx or 0, "?")
                self._words[STACK_BUDGET_LIMIT] = self._ask(kernel, int(nbytes))
                return 1
        except BaseException as e:  # noqa: BLE001 - raised by the launch instead
            with self._lock:
                self._refusals[ctx or 0] = e
            return 0
