"""The compile context the frontend emits IR into.

While a kernel is being compiled, exactly one :class:`Builder` is current (per thread). The
value classes (``Expr``, refs, ``Matrix``) and the math functions emit through it, which is why
``ti.sin(x)`` or ``v.norm()`` need no builder argument: the same Python code computes numbers in
Python scope and emits IR inside a kernel.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

from ..errors import CompileError
from ..ir.nodes import Block, Buffer, Loc, Param, Stmt
from ..types import DType

_state = threading.local()


def current() -> Builder | None:
    """The builder of the kernel being compiled on this thread, or None in Python scope."""
    return getattr(_state, "builder", None)


def require() -> Builder:
    b = current()
    if b is None:
        raise CompileError("this operation is only valid inside a difftape kernel or func")
    return b


class Builder:
    """Accumulates the IR of one kernel: parameters, buffers and nested blocks."""

    def __init__(self, kernel_name: str, file: str, *,
                 default_fp: DType, default_ip: DType, debug: bool) -> None:
        self.kernel_name = kernel_name
        self.file = file
        self.default_fp = default_fp
        self.default_ip = default_ip
        self.debug = debug
        self.params: list[Param] = []
        self.buffers: list[Buffer] = []
        self._buffer_slots: dict[tuple, int] = {}
        self.returns: list[DType] = []
        self.body: Block = []
        self._blocks: list[Block] = [self.body]
        self.loc: Loc | None = None
        self.loop_ids = itertools.count()
        self.loop_stack: list[tuple[str, int | None]] = []  # ("range"|"while", loop id)
        self.pending_loop_config: dict | None = None  # set by ti.loop_config for the next loop
        self.func_stack: list[Any] = []  # the funcs being inlined, outermost first
        self.read_only: dict[int, str] = {}  # ti.cache_read_only fields: id -> label
        # Unnamed fields reached in this kernel through a parameter or local variable: field
        # id -> that name, for this kernel's messages only (the same field is another
        # kernel's `src` or `vf`); see Field._label.
        self.field_names: dict[int, str] = {}
        self.return_type: DType | list[DType] | None = None
        self.return_annotation: Any = None  # the kernel's `->` annotation (a struct type...)
        self.kernel_allocas: set[Stmt] = set()
        # Building the IR that reverse mode differentiates: writes do not activate sparse
        # cells (the adjoint only reads activity) and deactivation/append are refused.
        self.adjoint = False
        # Struct-fors over sparse SNodes: their activity loads (frontend/sparse.py).
        self.struct_fors: list[dict] = []
        # ti.stop_grad(field): (block, buffer slot) pairs, applied by finish_stop_grads.
        self.stop_grads: list[tuple[Block, int]] = []
        # Python lists bound to kernel variables, by id: (the list, the block it was made in).
        # An entry that is a compile-time object may be replaced there only (the frontend).
        self.list_homes: dict[int, tuple[list, Block]] = {}

    # -- emission ------------------------------------------------------------------------------
    def emit(self, op: str, dtype: DType | None, args: tuple = (), attr: Any = None,
             blocks: tuple = ()) -> Stmt:
        s = Stmt(op, dtype, args, attr, blocks, self.loc)
        self._blocks[-1].append(s)
        if op == "alloca" and len(self._blocks) == 1:
            self.kernel_allocas.add(s)
        return s

    def is_reduction_target(self, alloca: Stmt) -> bool:
        """Is an update of this local a reduction: a kernel-level variable updated from inside
        a parallel loop (Taichi makes ``s += v`` there atomic)?"""
        return alloca in self.kernel_allocas and any(k == "parallel" for k, _ in self.loop_stack)

    @contextmanager
    def block(self, blk: Block | None = None):
        """Emit into ``blk`` (a fresh block by default) for the duration of the ``with``;
        yields the block. A block not yet placed in the IR can be reopened to append to it."""
        blk = [] if blk is None else blk
        self._blocks.append(blk)
        try:
            yield blk
        finally:
            self.pop_block()

    def push_block(self) -> Block:
        """Start emitting into a fresh block (until :meth:`pop_block`); returns it. For blocks
        whose end is not lexically known where they start (the frontend's return guards)."""
        blk: Block = []
        self._blocks.append(blk)
        return blk

    def pop_block(self) -> Block:
        return self._blocks.pop()

    def stop_gradient(self, slot: int) -> None:
        """``ti.stop_grad(field)``: as in Taichi, no derivative flows through any load of the
        buffer in the current block and the blocks nested in it, in either mode, including
        loads before the call. Recorded here, applied once the kernel is built."""
        self.stop_grads.append((self._blocks[-1], slot))

    def finish_stop_grads(self) -> None:
        """Put a ``stop_grad`` after every float load that a ``ti.stop_grad(field)`` covers,
        and make the load's uses use it (both autodiff modes give it zero derivative)."""
        if not self.stop_grads:
            return
        swap: dict[Stmt, Stmt] = {}

        def cover(blk: Block, slots: set[int]) -> None:
            k = 0
            while k < len(blk):
                s = blk[k]
                for inner in s.blocks:
                    cover(inner, slots)
                if s.op == "load" and s.attr in slots and s.dtype.is_float and s not in swap:
                    swap[s] = Stmt("stop_grad", s.dtype, (s,), None, (), s.loc)
                    blk.insert(k + 1, swap[s])
                    k += 1
                k += 1

        by_block: dict[int, tuple[Block, set[int]]] = {}
        for blk, slot in self.stop_grads:
            by_block.setdefault(id(blk), (blk, set()))[1].add(slot)
        for blk, slots in by_block.values():
            cover(blk, slots)
        stops = set(swap.values())

        def rewrite(blk: Block) -> None:
            for s in blk:
                if s not in stops and any(a in swap for a in s.args):
                    s.args = tuple(swap.get(a, a) for a in s.args)
                for inner in s.blocks:
                    rewrite(inner)

        rewrite(self.body)

    def insertion_point(self) -> tuple[Block, int]:
        """Where the next statement would go; statements are only ever appended to blocks, so
        :meth:`insert` can later put statements exactly there."""
        return self._blocks[-1], len(self._blocks[-1])

    def insert(self, point: tuple[Block, int], stmts: list[Stmt]) -> None:
        """Insert statements at an earlier :meth:`insertion_point` (e.g. a local that must
        dominate uses found later). Later points of the same block move accordingly."""
        blk, k = point
        blk[k:k] = stmts
        if blk is self.body:
            self.kernel_allocas.update(s for s in stmts if s.op == "alloca")

    def splice(self, blk: Block) -> None:
        """Append the statements of a detached block (built with :meth:`block`) to the current
        block, as if they had been emitted here."""
        if len(self._blocks) == 1:
            self.kernel_allocas.update(s for s in blk if s.op == "alloca")
        self._blocks[-1].extend(blk)

    @property
    def at_top_level(self) -> bool:
        return len(self._blocks) == 1

    @property
    def current_block(self) -> Block:
        """The block statements are emitted into now."""
        return self._blocks[-1]

    # -- tables --------------------------------------------------------------------------------
    def buffer_slot(self, buf: Buffer) -> int:
        slot = self._buffer_slots.get(buf.key)
        if slot is None:
            slot = len(self.buffers)
            self.buffers.append(buf)
            self._buffer_slots[buf.key] = slot
        return slot

    def add_param(self, name: str, dtype: DType) -> int:
        self.params.append(Param(name, dtype))
        return len(self.params) - 1

    # -- errors --------------------------------------------------------------------------------
    def error(self, message: str, cls: type[CompileError] = CompileError) -> CompileError:
        if self.loc is None:
            return cls(message, kernel=self.kernel_name, file=self.file)
        return cls(message, kernel=self.kernel_name, file=self.loc.file, line=self.loc.line,
                   source_line=self.loc.text or None)


def python_scope(method: Callable) -> Callable:
    """Mark a method Python-scope only (``to_numpy``, ``from_numpy``, ...). Called from a
    kernel, it would run once while the kernel compiles instead of at every launch, so there
    it raises a CompileError naming the kernel and the line."""
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        b = current()
        if b is not None:
            owner = type(args[0]).__name__ if args else ""
            hint = getattr(args[0], "_python_scope_hint", "call it before or after the kernel")
            raise b.error(f"{owner}.{method.__name__}() runs in Python scope only: inside a "
                          f"kernel it would run once, at compile time, not at each launch; "
                          f"{hint}")
        return method(*args, **kwargs)

    return wrapper


@contextmanager
def activate(builder: Builder):
    prev = current()
    _state.builder = builder
    try:
        yield builder
    finally:
        _state.builder = prev
