"""Run-time checking of the global data access rule, for ``ti.ad.Tape(validation=True)``.

The compile-time check in reverse.py catches a kernel that reads an element and then modifies
the *same* element expression. Whether ``f[i + 1]`` written by one iteration is ``f[j]`` read by
another, or whether a later kernel of the recording overwrites what an earlier one read, only
run time can tell. In validation mode every recorded kernel runs an instrumented variant:

* each load the adjoint depends on sets a one-byte mark for the element it read
  (``field.mark``, a companion array like ``.grad``);
* each store or atomic to a float field first checks the element's mark and, if set, stops the
  kernel with a :class:`GradientRuleError` naming the line.

Marks are cleared when a validating Tape is entered, so they cover exactly one recording.
"""

from __future__ import annotations

from ..ir.nodes import Block, Buffer, KernelIR, Stmt, walk
from ..types import i8, i32

#: Assertion messages starting with this become GradientRuleError instead of
#: KernelAssertionError when they fire.
RULE_MARKER = "[gradient rule] "

#: The refusal of Tape(validation=True) under forward mode (local and remote runtimes).
NOT_WITH_FORWARD_MODE = ("Tape(validation=True) cannot be combined with forward mode "
                         "(ti.ad.FwdMode, hvp): validate the Tape alone")


def _mark_buffer(ir: KernelIR, prog, slot: int, slots: dict[int, int | None]) -> int | None:
    if slot in slots:
        return slots[slot]
    buf = ir.buffers[slot]
    out = None
    if buf.key[0] == "field" and buf.key[2] == "primal" and buf.dtype.is_float:
        field = prog.fields[buf.key[1]]
        if field.mark is None:
            field.make_mark()
        ir.buffers.append(Buffer(("field", buf.key[1], "mark"), i8, buf.shape,
                                 buf.name + ".mark", buf.element_ndim, buf.offset))
        out = len(ir.buffers) - 1
    slots[slot] = out
    return out


def _message(ir: KernelIR, s: Stmt, name: str) -> str:
    file, line, text = s.loc if s.loc else (ir.file, 0, "")
    return (f"{RULE_MARKER}kernel '{ir.name}' ({file}:{line}: `{text}`) modifies an element of "
            f"'{name}' that this recording already read (in this kernel or an earlier one). "
            "The gradient would be computed from the new value (global data access rule #1: "
            "once read, an element must not be modified). Fix: write the new values to another "
            "field (double-buffering, or index the field by time step), or modify it outside "
            "the Tape")


def instrument(ir: KernelIR, prog, mattering: set[int]) -> KernelIR:
    """Add mark/check code to a freshly built primal kernel. ``mattering`` holds the program-
    order numbers of the loads the adjoint kernel depends on."""
    slots: dict[int, int | None] = {}
    order = {s: k for k, s in enumerate(x for x in walk(ir.body) if x.op == "load")}

    def rewrite(block: Block) -> Block:
        out: Block = []
        for s in block:
            if s.blocks:
                s.blocks = tuple(rewrite(b) for b in s.blocks)
            if s.op in ("store", "atomic"):
                slot = s.attr if s.op == "store" else s.attr[0]
                m = _mark_buffer(ir, prog, slot, slots)
                if m is not None:
                    idx = s.args[:-1]
                    seen = Stmt("load", i8, idx, m, loc=s.loc)
                    w = Stmt("cast", i32, (seen,), loc=s.loc)
                    zero = Stmt("const", i32, (), 0, loc=s.loc)
                    ok = Stmt("eq", i32, (w, zero), loc=s.loc)
                    msg = _message(ir, s, ir.buffers[slot].name)
                    out += [seen, w, zero, ok, Stmt("assert", None, (ok,), (msg,), loc=s.loc)]
            out.append(s)
            if s.op == "load" and order.get(s) in mattering:
                m = _mark_buffer(ir, prog, s.attr, slots)
                if m is not None:
                    one = Stmt("const", i8, (), 1, loc=s.loc)
                    out += [one, Stmt("store", None, s.args + (one,), m, loc=s.loc)]
        return out

    ir.body = rewrite(ir.body)
    return ir


def begin(prog) -> None:
    """A validating Tape starts: forget every mark."""
    for f in prog.fields.values():
        if f.mark is not None:
            f.mark.fill(0)
