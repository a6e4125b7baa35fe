"""Owned-element atomics become plain read-modify-writes.

In a parallel task, when every access to a buffer has the task's own loop index as the same
component of its index (``x.grad[f, p, c]`` with ``p`` the loop index, whatever ``f`` and ``c``
are), distinct iterations touch distinct elements: no other thread can race on them. Atomics
there (``x.grad[i] += g`` in adjoint kernels, ``x[i] += 1`` in primal ones) are then a plain
load, add and store, which LLVM can vectorize; a float atomic add on x86 is a compare-exchange
loop that cannot be.
"""

from __future__ import annotations

from ..nodes import Block, KernelIR, Stmt, Task, walk
from .reduce import _slot


def _index(s: Stmt) -> tuple[Stmt, ...]:
    return s.args[:-1] if s.op in ("store", "atomic") else s.args


def _owned_slots(t: Task) -> set[int]:
    """Buffers whose every access has the task's loop index at one fixed index position:
    distinct iterations then touch distinct elements."""
    positions: dict[int, set[int]] = {}
    for s in walk(t.body):
        key = _slot(s)
        if key is None or key[0] != "buf":
            continue
        here = {k for k, a in enumerate(_index(s))
                if a.op == "loop_index" and a.attr == t.loop_id}
        prev = positions.get(key[1])
        positions[key[1]] = here if prev is None else prev & here
    return {slot for slot, pos in positions.items() if pos}


def _rewrite(block: Block, owned: set[int], mapping: dict[Stmt, Stmt]) -> Block:
    out: Block = []
    for s in block:
        if s.args:
            s.args = tuple(mapping.get(a, a) for a in s.args)
        if s.blocks:
            s.blocks = tuple(_rewrite(b, owned, mapping) for b in s.blocks)
        if s.op == "atomic" and s.attr[0] in owned:
            slot, kind = s.attr
            idx, v = s.args[:-1], s.args[-1]
            old = Stmt("load", s.dtype, idx, slot, loc=s.loc)
            new = Stmt(kind, s.dtype, (old, v), loc=s.loc)
            out += [old, new, Stmt("store", None, idx + (new,), slot, loc=s.loc)]
            mapping[s] = old
            continue
        out.append(s)
    return out


def demote_owned_atomics(ir: KernelIR) -> KernelIR:
    for t in ir.tasks or []:
        if t.kind == "range":
            owned = _owned_slots(t)
            if owned:
                t.body = _rewrite(t.body, owned, {})
    return ir
