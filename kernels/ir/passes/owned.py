"""Owned-element atomics become plain read-modify-writes.

In a parallel task, when every access to a buffer uses the same index expression and that
expression contains the task's own loop index as one of its components, distinct iterations
touch distinct elements: no other thread can race on them. Atomics there (``x.grad[i] += g``
in adjoint kernels, ``x[i] += 1`` in primal ones) are then a plain load, add and store, which
LLVM can vectorize; a float atomic add on x86 is a compare-exchange loop that cannot be.
"""

from __future__ import annotations

from ..nodes import Block, KernelIR, Stmt, Task, walk
from .reduce import _slot


def _index(s: Stmt) -> tuple[Stmt, ...]:
    return s.args[:-1] if s.op in ("store", "atomic") else s.args


def _owned_slots(t: Task) -> set[int]:
    seen: dict[int, tuple[Stmt, ...] | None] = {}
    for s in walk(t.body):
        key = _slot(s)
        if key is None or key[0] != "buf":
            continue
        idx = _index(s)
        prev = seen.get(key[1], idx)
        seen[key[1]] = idx if prev is not None and _same(prev, idx) else None
    out = set()
    for slot, idx in seen.items():
        if idx and any(a.op == "loop_index" and a.attr == t.loop_id for a in idx):
            out.add(slot)
    return out


def _same(a: tuple[Stmt, ...], b: tuple[Stmt, ...]) -> bool:
    return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))


def _equal(x: Stmt, y: Stmt) -> bool:
    if x is y:
        return True
    return (x.op == y.op and x.attr == y.attr and x.info.pure and not x.blocks
            and x.op not in ("load", "local_load", "temp_load")
            and len(x.args) == len(y.args)
            and all(_equal(a, b) for a, b in zip(x.args, y.args, strict=True)))


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
