"""Bounds checks: an ``assert`` before every buffer access (``debug=True`` and remote kernels).

A failing check stops the kernel and raises ``IndexOutOfRangeError`` (a
``KernelAssertionError`` and an ``IndexError``) with the index, the buffer, its shape and the
source line, instead of reading or writing outside the array.
"""

from __future__ import annotations

from ...types import i32
from ..nodes import Block, KernelIR, Stmt

#: How every bounds-check message starts (the index follows; Taichi's messages start with
#: "Out of bound access" too): the runtime raises IndexOutOfRangeError for a message whose
#: template starts with this text and the index (ir/assertfmt.py), KernelAssertionError for
#: other failed asserts.
OUT_OF_RANGE = "Out of bound access: index "


def _checks_for(s: Stmt, ir: KernelIR) -> list[Stmt]:
    slot = s.attr if s.op == "load" else s.attr if s.op == "store" else s.attr[0]
    buf = ir.buffers[slot]
    naxes = buf.ndim - buf.element_ndim
    out: list[Stmt] = []
    for axis in range(naxes):
        idx = s.args[axis]
        extent = buf.shape[axis]
        if extent is None:
            ext = Stmt("buf_shape", i32, (), (slot, axis), loc=s.loc)
        else:
            ext = Stmt("const", i32, (), int(extent), loc=s.loc)
        zero = Stmt("const", i32, (), 0, loc=s.loc)
        lo = Stmt("ge", i32, (idx, zero), loc=s.loc)
        hi = Stmt("lt", i32, (idx, ext), loc=s.loc)
        ok = Stmt("logical_and", i32, (lo, hi), loc=s.loc)
        shape = tuple("?" if e is None else e for e in buf.shape[:naxes])
        where = s.loc.where(ir.name) if s.loc else ""
        shown = idx  # the index as the user wrote it: a field's offset added back
        off = buf.offset[axis] if buf.offset else 0
        extra: list[Stmt] = []
        if off:
            c = Stmt("const", i32, (), off, loc=s.loc)
            shown = Stmt("add", i32, (idx, c), loc=s.loc)
            extra = [c, shown]
            where = f" and offset {buf.offset}{where}"
        msg = (OUT_OF_RANGE, "", f" out of range for axis {axis} of '{buf.name}' with shape "
               f"{shape}{where}")
        out += [ext, zero, lo, hi, ok, *extra,
                Stmt("assert", None, (ok, shown), msg, loc=s.loc)]
    return out


def _insert(block: Block, ir: KernelIR) -> Block:
    out: Block = []
    for s in block:
        if s.blocks:
            s.blocks = tuple(_insert(b, ir) for b in s.blocks)
        if s.op in ("load", "store", "atomic"):
            out.extend(_checks_for(s, ir))
        out.append(s)
    return out


def insert_bounds_checks(ir: KernelIR) -> KernelIR:
    if ir.debug:
        ir.body = _insert(ir.body, ir)
    return ir
