"""Integer overflow reports (``ti.init(debug=True)``, as Taichi's ``debug`` mode makes them).

After every integer ``add``, ``sub``, ``mul`` and ``shl`` written in the program (statements
with a source location), an ``<op>_overflows`` check (LLVM's ``*.with.overflow`` intrinsics)
guards a ``print`` of what overflowed: the operation, kernel, file and line, the operands and
the type, then the source line. As in Taichi the report is printed (by the kernel, every time
it happens) and the kernel goes on with the wrapped-around value, the result integer arithmetic
has without ``debug``; atomics are not checked (nor are they in Taichi).

The pass keys on its own flag, ``KernelIR.overflow_checks`` (``ti.init(debug=True)``), not on
``ir.debug``: a server compiles every kernel with ``ir.debug`` set for bounds checks, and adds
the reports only where the client's program asked (the flag travels with the IR); their lines
reach the client as every kernel's printed output does (``runtime/printsink.py``).
"""

from __future__ import annotations

from ...types import i32
from ..nodes import Block, KernelIR, Stmt
from ..printf import conversion

#: The checked ops: (how the report names the operation, the operator shown).
CHECKED = {"add": ("Addition", "+"), "sub": ("Subtraction", "-"),
           "mul": ("Multiplication", "*"), "shl": ("Shift left", "<<")}


def _report(s: Stmt, ir: KernelIR) -> list[Stmt]:
    """``if <op>_overflows(a, b): print(...)`` for statement ``s``."""
    word, sym = CHECKED[s.op]
    t = s.dtype
    file, line, text = s.loc
    spec = conversion(None, t)
    head = f"{word} overflow detected in kernel '{ir.name}' ({file}:{line}): "
    tail = f" does not fit in {t}\n" + (f"    {text}\n" if text else "")
    show = Stmt("print", None, s.args, (head, spec, f" {sym} ", spec, tail), loc=s.loc)
    flag = Stmt(f"{s.op}_overflows", i32, s.args, loc=s.loc)
    return [flag, Stmt("if", None, (flag,), None, ([show], []), loc=s.loc)]


def _insert(block: Block, ir: KernelIR) -> Block:
    out: Block = []
    for s in block:
        if s.blocks:
            s.blocks = tuple(_insert(b, ir) for b in s.blocks)
        out.append(s)
        if s.op in CHECKED and s.loc is not None and s.dtype.is_int and s.dtype.bits > 1:
            out.extend(_report(s, ir))
    return out


def insert_overflow_checks(ir: KernelIR) -> KernelIR:
    if ir.overflow_checks:
        ir.body = _insert(ir.body, ir)
    return ir
