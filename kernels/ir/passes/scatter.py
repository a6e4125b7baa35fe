"""Scatter privatization: atomic adds into a small buffer accumulate in a per-chunk copy.

An adjoint kernel scatters: ``x.grad[j] += g`` for every pair ``(i, j)`` of an N-body energy,
every grid node of a transfer. All threads sweep the same targets at the same time, and a float
atomic add on x86 is a compare-exchange loop, so they fight over cache lines: measured on two
cores, the N-body adjoint ran slower with two threads than with one, and its
forward-over-reverse variant (twice the scatters) 2.4x slower. When every access a range task
makes to a buffer is an atomic add/sub whose old value is unused, and the buffer is small
(``MAX_ELEMENTS``), each chunk of the loop instead adds into a zeroed private copy with plain
loads and stores (the lowering allocates it per chunk), and the chunk's epilogue adds the
copy's nonzero elements into the buffer atomically: one atomic per touched element per chunk
instead of one per update. Floating-point sums are then grouped by chunk, as with the
per-chunk accumulators of ``reduce.py``.
"""

from __future__ import annotations

from math import prod

from ...types import i32
from ..nodes import Block, Buffer, KernelIR, Stmt, Task, walk
from .reduce import _slot, rounds_every_add

#: Largest buffer (in elements) copied per chunk: zeroing and draining it must stay small next
#: to the chunk's work.
MAX_ELEMENTS = 1 << 14


def _candidates(t: Task, ir: KernelIR) -> set[int]:
    used = {a for s in walk(t.body) for a in s.args}
    ok: dict[int, bool] = {}
    for s in walk(t.body):
        key = _slot(s)
        if key is None or key[0] != "buf":
            continue
        slot = key[1]
        good = (s.op == "atomic" and s.attr[1] in ("add", "sub") and s not in used
                and not rounds_every_add(s.dtype, ir.buffers[slot]))
        ok[slot] = ok.get(slot, True) and good
    out = set()
    for slot, good in ok.items():
        buf = ir.buffers[slot]
        if good and buf.key[0] == "field" and None not in buf.shape and \
                prod(buf.shape) <= MAX_ELEMENTS:
            out.add(slot)
    return out


def _drain(private: int, target: int, buf: Buffer, loop_id: int, loc) -> list[Stmt]:
    """Epilogue: for each element k of the private copy, if nonzero, atomically add it."""
    total = prod(buf.shape)
    c = lambda v: Stmt("const", i32, (), v, loc=loc)  # noqa: E731
    begin, end = c(0), c(total)
    body: Block = []
    k = Stmt("loop_index", i32, (), loop_id, loc=loc)
    body.append(k)
    idx: list[Stmt] = []
    rest = k
    for extent in reversed(buf.shape[1:]):
        e = c(extent)
        r = Stmt("mod", i32, (rest, e), loc=loc)
        q = Stmt("floordiv", i32, (rest, e), loc=loc)
        body += [e, r, q]
        idx.insert(0, r)
        rest = q
    idx.insert(0, rest)
    v = Stmt("load", buf.dtype, tuple(idx), private, loc=loc)
    zero = Stmt("const", buf.dtype, (), 0.0 if buf.dtype.is_float else 0, loc=loc)
    nz = Stmt("ne", i32, (v, zero), loc=loc)
    add = Stmt("atomic", buf.dtype, tuple(idx) + (v,), (target, "add"), loc=loc)
    body += [v, zero, nz, Stmt("if", None, (nz,), None, ([add], []), loc=loc)]
    return [begin, end, Stmt("range_for", None, (begin, end), (loop_id, "inner"), (body,),
                             loc=loc)]


def _rewrite(block: Block, private: dict[int, int], mapping: dict) -> Block:
    out: Block = []
    for s in block:
        if s.blocks:
            s.blocks = tuple(_rewrite(b, private, mapping) for b in s.blocks)
        if s.op == "atomic" and s.attr[0] in private:
            slot, kind = s.attr
            p = private[slot]
            idx, v = s.args[:-1], s.args[-1]
            old = Stmt("load", s.dtype, idx, p, loc=s.loc)
            new = Stmt(kind, s.dtype, (old, v), loc=s.loc)
            out += [old, new, Stmt("store", None, idx + (new,), p, loc=s.loc)]
            continue
        out.append(s)
    return out


def privatize_scatters(ir: KernelIR) -> KernelIR:
    ids = [s.attr[0] for t in ir.tasks or [] for b in (t.bounds, t.prologue, t.body, t.epilogue)
           for s in walk(b) if s.op == "range_for"]
    ids += [t.loop_id for t in ir.tasks or [] if t.loop_id is not None]
    next_loop = max(ids, default=0)
    for t in ir.tasks or []:
        if t.kind != "range":
            continue
        slots = _candidates(t, ir)
        if not slots:
            continue
        private: dict[int, int] = {}
        for slot in sorted(slots):
            buf = ir.buffers[slot]
            kind, ident, role = buf.key
            ir.buffers.append(Buffer(("private", ident, role), buf.dtype, buf.shape,
                                     f"{buf.name} (per-chunk copy)", buf.element_ndim,
                                     buf.offset))
            private[slot] = len(ir.buffers) - 1
        t.body = _rewrite(t.body, private, {})
        loc = next((s.loc for s in walk(t.body) if s.loc), None)
        for slot, p in private.items():
            next_loop += 1
            t.epilogue += _drain(p, slot, ir.buffers[slot], next_loop, loc)
    return ir
