"""The derivative table: one rule per primitive, shared by reverse and forward mode.

A rule gives the *local partial derivatives* of a statement with respect to each operand,
as IR computed from the (recomputed) operand values ``xs`` and result ``y``. Reverse mode
multiplies the result's adjoint by each partial and adds it to the operand's adjoint; forward
mode sums partial x tangent over the operands. Having one table is what keeps the two modes in
agreement: a rule is written once.

A partial is one of:

* ``None``: the operand carries no derivative (an index, a condition, a rounding op);
* ``ONE`` / ``MINUS_ONE``: exactly +-1, applied without a multiplication;
* ``Where(cond, when)``: 1 where ``cond`` is ``when``, else 0, applied as a ``select`` so that
  an infinite or NaN derivative on the branch not taken cannot leak through ``0 * inf``;
* a statement holding the partial's value (same dtype as the result);
* ``Scaled(value, factor)``: ``factor * value`` with a power-of-two factor kept apart, so
  forward mode can cancel it against a tangent's own factor (see :class:`Scaled`).

Integer-valued statements never carry derivatives; that is decided by the activity analysis,
not here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..ir.nodes import Block, Stmt
from ..types import DType, i32


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
        return self.emit("const", t, (), float(value) if t.is_float else int(value))

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


@dataclass(frozen=True)
class Where:
    cond: Stmt
    when: bool = True


@dataclass(frozen=True)
class Scaled:
    """A partial ``factor * value``, ``factor`` a power of two (up to sign). Forward mode
    carries power-of-two factors beside tangents instead of multiplying them in: the 2 of
    d(x*x) = 2 x dx then cancels the 1/2 of d(sqrt s) = ds / (2 sqrt s), exactly (scaling by
    a power of two is exact), and a norm's tangent costs three fewer operations. Reverse mode
    multiplies the factor in (:func:`scale`)."""

    value: Stmt
    factor: float


ONE = "one"
MINUS_ONE = "minus_one"

Partial = Stmt | Where | Scaled | str | None
Rule = Callable[..., list[Partial]]


def _one_minus_sq(e: Emitter, v: Stmt) -> Stmt:
    return e.bin("sub", e.const(1, v.dtype), e.bin("mul", v, v))


def _recip(e: Emitter, v: Stmt) -> Stmt:
    return e.bin("div", e.const(1, v.dtype), v)


def _pow(e: Emitter, y: Stmt, a: Stmt, b: Stmt) -> list[Partial]:
    t = y.dtype
    da = e.bin("mul", b, e.bin("pow", a, e.bin("sub", b, e.const(1, t))))
    # d/db a^b = a^b log a, defined for a > 0; elsewhere (integer exponents of negative bases,
    # 0^b) the exponent has no derivative and we give 0 rather than NaN.
    pos = e.cmp("gt", a, e.const(0, t))
    safe_a = e.select(pos, a, e.const(1, t))
    db = e.select(pos, e.bin("mul", y, e.un("log", safe_a)), e.const(0, t))
    return [da, db]


def _atan2(e: Emitter, y: Stmt, a: Stmt, b: Stmt) -> list[Partial]:
    r2 = e.bin("add", e.bin("mul", a, a), e.bin("mul", b, b))
    return [e.bin("div", b, r2), e.un("neg", e.bin("div", a, r2))]


def _abs(e: Emitter, y: Stmt, a: Stmt) -> list[Partial]:
    t = y.dtype
    zero = e.const(0, t)
    sign = e.select(e.cmp("gt", a, zero), e.const(1, t),
                    e.select(e.cmp("lt", a, zero), e.const(-1, t), zero))
    return [sign]


def _mod(e: Emitter, y: Stmt, a: Stmt, b: Stmt) -> list[Partial]:
    # a mod b = a - b * floor(a / b)
    return [ONE, e.un("neg", e.un("floor", e.bin("div", a, b)))]


#: op name -> rule(emitter, result, *operands) -> partials (one per operand)
RULES: dict[str, Rule] = {
    "neg": lambda e, y, a: [MINUS_ONE],
    "add": lambda e, y, a, b: [ONE, ONE],
    "sub": lambda e, y, a, b: [ONE, MINUS_ONE],
    "mul": lambda e, y, a, b: [b, a],
    # Partials through one reciprocal: 1/b is shared (LLVM merges equal divisions) with the
    # quotient's other uses, e.g. sqrt's partial 0.5/y when b = sqrt(...), as in norms.
    "div": lambda e, y, a, b: [_recip(e, b), e.un("neg", e.bin("mul", y, _recip(e, b)))],
    "pow": _pow,
    "atan2": _atan2,
    "min": lambda e, y, a, b: [Where(e.cmp("le", a, b)), Where(e.cmp("le", a, b), False)],
    "max": lambda e, y, a, b: [Where(e.cmp("ge", a, b)), Where(e.cmp("ge", a, b), False)],
    "mod": _mod,
    "floordiv": lambda e, y, a, b: [None, None],
    "sin": lambda e, y, a: [e.un("cos", a)],
    "cos": lambda e, y, a: [e.un("neg", e.un("sin", a))],
    "tan": lambda e, y, a: [e.bin("add", e.const(1, y.dtype), e.bin("mul", y, y))],
    "asin": lambda e, y, a: [e.un("rsqrt", _one_minus_sq(e, a))],
    "acos": lambda e, y, a: [e.un("neg", e.un("rsqrt", _one_minus_sq(e, a)))],
    "atan": lambda e, y, a: [_recip(e, e.bin("add", e.const(1, y.dtype), e.bin("mul", a, a)))],
    "tanh": lambda e, y, a: [_one_minus_sq(e, y)],
    "exp": lambda e, y, a: [y],
    "log": lambda e, y, a: [_recip(e, a)],
    "sqrt": lambda e, y, a: [Scaled(_recip(e, y), 0.5)],
    "rsqrt": lambda e, y, a: [Scaled(e.bin("mul", y, e.bin("mul", y, y)), -0.5)],
    "abs": _abs,
    "floor": lambda e, y, a: [None],
    "ceil": lambda e, y, a: [None],
    "round": lambda e, y, a: [None],
    "cast": lambda e, y, a: [ONE],
    "select": lambda e, y, c, a, b: [None, Where(c), Where(c, False)],
    "stop_grad": lambda e, y, a: [None],
}


def partials(e: Emitter, s: Stmt, y: Stmt, xs: tuple[Stmt, ...]) -> list[Partial]:
    """The partials of statement ``s`` (recomputed as ``y`` from operands ``xs``)."""
    rule = RULES.get(s.op)
    if rule is None:
        raise KeyError(s.op)
    return rule(e, y, *xs)


#: Ops whose value (or whose partial) can be infinite or NaN for finite operands.
RISKY = frozenset({"div", "sqrt", "rsqrt", "log", "pow", "asin", "acos", "tan", "exp", "atan2",
                   "mod", "floordiv"})


def scale(e: Emitter, p: Partial, g: Stmt, guard: bool = True) -> Stmt | None:
    """``p * g``: the contribution of a seed ``g`` through partial ``p`` (None if zero).
    ``guard``: the partial may be infinite or NaN (see :data:`RISKY`), so a zero seed must give
    exactly zero rather than ``0 * inf``."""
    if p is None:
        return None
    if p == ONE:
        return g
    if p == MINUS_ONE:
        return e.un("neg", g)
    if isinstance(p, Scaled):
        p = e.bin("mul", e.const(p.factor, p.value.dtype), p.value)
    if isinstance(p, Where):
        zero = e.const(0, g.dtype)
        return e.select(p.cond, g, zero) if p.when else e.select(p.cond, zero, g)
    # A zero seed gives a zero contribution even where the partial is infinite or NaN: the
    # branch a select did not take is computed too, and 0 * inf must not poison the gradient.
    if not guard:
        return e.bin("mul", g, e.cast(p, g.dtype))
    zero = e.const(0, g.dtype)
    return e.select(e.cmp("eq", g, zero), zero, e.bin("mul", g, e.cast(p, g.dtype)))
