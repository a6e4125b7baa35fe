"""Applying the derivative rules, shared by reverse and forward mode.

The rules themselves are declared with their ops in the op table (:mod:`..ir.ops`). A rule
gives the *local partial derivatives* of a statement with respect to each operand, as IR
computed from the (recomputed) operand values ``xs`` and result ``y``. Reverse mode multiplies
the result's adjoint by each partial and adds it to the operand's adjoint; forward mode sums
partial x tangent over the operands. Having one table is what keeps the two modes in agreement:
a rule is written once.

A partial is one of:

* ``None``: the operand carries no derivative (an index, a condition, a rounding op);
* ``ONE`` / ``MINUS_ONE``: exactly +-1, applied without a multiplication;
* ``Where(cond, when)``: 1 where ``cond`` is ``when``, else 0, applied as a ``select`` so that
  an infinite or NaN derivative on the branch not taken cannot leak through ``0 * inf``;
* a statement holding the partial's value (same dtype as the result);
* ``Scaled(value, factor)``: ``factor * value`` with a power-of-two factor kept apart, so
  forward mode can cancel it against a tangent's own factor (see :class:`Scaled`).

Integer-valued statements never carry derivatives; that is decided by the activity analysis,
not here. An op whose derivative is :data:`NO_DERIVATIVE` gives values that carry none.
"""

from __future__ import annotations

from ..errors import GradientRuleError
from ..ir.nodes import Block, Loc, Stmt
from ..ir.ops import MINUS_ONE, NO_DERIVATIVE, ONE, OPS, STRUCTURAL, Partial, Scaled, Where
from ..types import DType, i32

__all__ = ["ADD_IDENTITY", "MINUS_ONE", "NO_DERIVATIVE", "ONE", "RISKY", "STRUCTURAL", "Emitter",
           "Partial", "Scaled", "Where", "no_rule_message", "partials", "rule_error", "scale"]


def rule_error(message: str, kernel: str, loc: Loc | None,
               file: str | None = None) -> GradientRuleError:
    """The error for a gradient rule the statement at ``loc`` breaks, naming its line and
    quoting the text that travelled with the IR (``file``: the kernel's, where the
    statement has no location)."""
    if loc is None:
        return GradientRuleError(message, kernel=kernel, file=file or None)
    return GradientRuleError(message, kernel=kernel, file=loc.file, line=loc.line,
                             source_line=loc.text or None)


class Emitter:
    """Appends new statements to a block; small helpers keep the rules readable."""

    def __init__(self, block: Block, loc=None) -> None:
        self.block = block
        self.loc = loc

    def emit(self, op: str, dtype: DType | None, args: tuple = (), attr=None,
             blocks: tuple = ()) -> Stmt:
        s = Stmt(op, dtype, args, attr, blocks, self.loc)
        self.block.append(s)
        return s

    def const(self, value, t: DType) -> Stmt:
        return self.emit("const", t, (), t.wrap(float(value)) if t.is_float else int(value))

    def un(self, op: str, x: Stmt) -> Stmt:
        return self.emit(op, x.dtype, (x,))

    def bin(self, op: str, a: Stmt, b: Stmt) -> Stmt:
        return self.emit(op, a.dtype, (a, b))

    def cmp(self, op: str, a: Stmt, b: Stmt) -> Stmt:
        return self.emit(op, i32, (a, b))

    def cast(self, x: Stmt, t: DType) -> Stmt:
        return x if x.dtype == t else self.emit("cast", t, (x,))

    def select(self, c: Stmt, a: Stmt, b: Stmt) -> Stmt:
        return self.emit("select", a.dtype, (c, a, b))


def partials(e: Emitter, s: Stmt, y: Stmt, xs: tuple[Stmt, ...]) -> list[Partial]:
    """The partials of statement ``s`` (recomputed as ``y`` from operands ``xs``), from the
    op's declaration in the op table."""
    rule = OPS[s.op].derivative
    if not callable(rule):
        raise KeyError(f"op {s.op!r} has no derivative rule ({rule})")
    return rule(e, y, *xs)


def no_rule_message(op: str, mode: str) -> str:
    """The refusal of an op that has no derivative rule where a derivative flows through it."""
    return (f"{mode} mode cannot differentiate '{op}': the op has no derivative rule, and a "
            "derivative would flow through it here (from an input with "
            f"{'gradient' if mode == 'reverse' else 'dual'} storage to a differentiated "
            f"output). If no derivative should flow through it, wrap its operand in "
            "ti.stop_grad(...), or mark the kernel @ti.ad.no_grad")


#: The zero that sums start from and zero contributions are: ``a + -0.0 == a`` for every
#: ``a``, bit for bit, so LLVM deletes such adds without fast-math flags, where ``a + 0.0``
#: must stay (it turns ``-0.0`` into ``+0.0``). An adjoint kernel's sums of contributions
#: would otherwise keep long chains of additions of zero (p2g.grad of the MPM benchmark:
#: 281 of its 426 additions).
ADD_IDENTITY = -0.0

#: Ops whose value (or whose partial) can be infinite or NaN for finite operands.
RISKY = frozenset(name for name, info in OPS.items() if info.risky)


def scale(e: Emitter, p: Partial, g: Stmt, guard: bool = True,
          zero: float = 0.0) -> Stmt | None:
    """``p * g``: the contribution of a seed ``g`` through partial ``p`` (None if zero).
    ``guard``: the partial may be infinite or NaN (see :data:`RISKY`), so a zero seed must give
    exactly zero rather than ``0 * inf``. ``zero``: the value of a zero contribution; reverse
    mode, which only ever adds contributions into adjoints, passes :data:`ADD_IDENTITY`."""
    if p is None:
        return None
    if p == ONE:
        return g
    if p == MINUS_ONE:
        return e.un("neg", g)
    if isinstance(p, Scaled):
        p = e.bin("mul", e.const(p.factor, p.value.dtype), p.value)
    if isinstance(p, Where):
        z = e.const(zero, g.dtype)
        return e.select(p.cond, g, z) if p.when else e.select(p.cond, z, g)
    # A zero seed gives a zero contribution even where the partial is infinite or NaN: the
    # branch a select did not take is computed too, and 0 * inf must not poison the gradient.
    if not guard:
        return e.bin("mul", g, e.cast(p, g.dtype))
    z = e.const(zero, g.dtype)
    return e.select(e.cmp("eq", g, z), z, e.bin("mul", g, e.cast(p, g.dtype)))
