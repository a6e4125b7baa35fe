"""Reduction privatization: ``L[None] += expr`` in a parallel loop accumulates per chunk.

Thousands of threads hitting one address with atomics serialize on it (measured 50-100x slower
than per-thread accumulation on two cores). When every access a range task makes to a buffer
is an atomic add/sub at constant indices whose old value is unused, the adds go to a private
accumulator set up in the chunk prologue and land with one atomic in the epilogue. The
accumulator adds are marked reassociable so LLVM vectorizes them; f32 sums accumulate in f64,
which keeps a 2^24-term sum within 1e-7 of exact instead of ~1e-2 with naive f32. f16 sums
are left alone: every add rounds to f16, as the program says and Taichi computes.
"""

from __future__ import annotations

from collections import defaultdict

from ...types import f32, f64
from ..nodes import Block, Buffer, KernelIR, Stmt, Task, walk


def _slot(s: Stmt) -> tuple | None:
    """What ``s`` accesses: ("buf", slot) or ("temp", slot) (a kernel-level variable)."""
    if s.op in ("load", "store"):
        return ("buf", s.attr)
    if s.op == "atomic":
        return ("buf", s.attr[0])
    if s.op in ("temp_load", "temp_store"):
        return ("temp", s.attr)
    if s.op == "temp_atomic":
        return ("temp", s.attr[0])
    return None


def rounds_every_add(dtype, buf: Buffer | None = None) -> bool:
    """Must sums of this type (into ``buf``) stay one atomic per add? f16's do: each add rounds
    to f16 (as in Taichi), and a sum of per-chunk partial sums differs from that by far more
    than f16's precision (1119 where the program's f16 adds give 1029). So do adds into a
    quantized field: each rounds (or wraps) to what its bits hold."""
    return (dtype.is_float and dtype.bits < 32) or (buf is not None and buf.quant is not None)


def _kind(s: Stmt) -> str | None:
    return s.attr[1] if s.op in ("atomic", "temp_atomic") else None


def _candidates(t: Task, ir: KernelIR) -> dict[tuple, list[Stmt]]:
    used = set()
    for s in walk(t.body):
        used.update(s.args)
    groups: dict[tuple, list[Stmt]] = defaultdict(list)
    disqualified: set[tuple] = set()
    for s in walk(t.body):
        slot = _slot(s)
        if slot is None:
            continue
        idx = s.args[:-1] if s.op in ("store", "atomic") else s.args
        if s.op.startswith("temp"):
            idx = ()
        ok = (_kind(s) in ("add", "sub") and s not in used
              and all(a.op == "const" for a in idx)
              and not rounds_every_add(s.dtype, ir.buffers[slot[1]] if slot[0] == "buf" else None))
        if not ok:
            disqualified.add(slot)
            continue
        groups[(slot, tuple(a.attr for a in idx))].append(s)
    return {k: v for k, v in groups.items() if k[0] not in disqualified}


def _privatize(t: Task, key: tuple, atomics: list[Stmt]) -> None:
    dtype = atomics[0].dtype
    acc_t = f64 if dtype == f32 else dtype
    loc = atomics[0].loc
    acc = Stmt("alloca", acc_t, loc=loc)
    zero = Stmt("const", acc_t, (), 0.0 if acc_t.is_float else 0, loc=loc)
    t.prologue += [acc, zero, Stmt("local_store", None, (acc, zero), loc=loc)]
    targets = {id(s) for s in atomics}

    def rewrite(block: Block) -> Block:
        out: Block = []
        for s in block:
            if s.blocks:
                s.blocks = tuple(rewrite(b) for b in s.blocks)
            if id(s) not in targets:
                out.append(s)
                continue
            value = s.args[-1]
            if value.dtype != acc_t:
                value = Stmt("cast", acc_t, (value,), loc=s.loc)
                out.append(value)
            old = Stmt("local_load", acc_t, (acc,), loc=s.loc)
            new = Stmt(_kind(s), acc_t, (old, value), "reassoc", loc=s.loc)
            out += [old, new, Stmt("local_store", None, (acc, new), loc=s.loc)]
        return out

    t.body = rewrite(t.body)
    total = Stmt("local_load", acc_t, (acc,), loc=loc)
    t.epilogue.append(total)
    if acc_t != dtype:
        total = Stmt("cast", dtype, (total,), loc=loc)
        t.epilogue.append(total)
    (space, slot), _ = key
    if space == "temp":
        t.epilogue.append(Stmt("temp_atomic", dtype, (total,), (slot, "add"), loc=loc))
        return
    idx = [Stmt("const", a.dtype, (), a.attr, loc=loc) for a in atomics[0].args[:-1]]
    t.epilogue += idx
    t.epilogue.append(Stmt("atomic", dtype, tuple(idx) + (total,), (slot, "add"), loc=loc))


def privatize_reductions(ir: KernelIR) -> KernelIR:
    for t in ir.tasks or []:
        if t.kind != "range":
            continue
        for key, atomics in _candidates(t, ir).items():
            _privatize(t, key, atomics)
    return ir
