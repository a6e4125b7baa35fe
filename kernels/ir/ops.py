"""Every IR op, declared once.

One :class:`OpInfo` per op says everything the compiler needs to know about it, so adding an op
means adding one entry here (and, for a user-facing op, exporting its frontend function):

* *shape*: operand and block counts, whether it is pure (removable when unused);
* *type rule* (``types``): what operand and result types the verifier accepts and how the
  frontend types the op (see :data:`TYPE_RULES`);
* *evaluator* (``evaluate``): the op's value on Python numbers, with the semantics of the
  compiled code (IEEE specials, a zero integer divisor giving 0, saturating float-to-int casts).
  Constant folding and the reference interpreter both apply it through :func:`evaluate`, which
  rounds and wraps the result to its type in one place;
* *derivative* (``derivative``): the local partial derivatives as IR, shared by forward and
  reverse mode (``autodiff/``), or :data:`NO_DERIVATIVE` for an op whose derivative is zero
  (comparisons, rounding, ``stop_grad``), or :data:`STRUCTURAL` for memory, local and control
  ops, which the autodiff transforms handle themselves (loads, stores, atomics, locals, loops);
* *lowering key* (``lower``): per type kind (``"f"``, ``"i"``, ``"u"``), how the shared LLVM
  lowering emits it: ``inst:X`` (an instruction ``X ty a, b``), ``fcmp:X``/``icmp:X``,
  ``intrinsic:X`` (``llvm.X.<type>``), ``libm:X`` (the target's math call), ``method:X``
  (``Lowering.lower_X``) or ``stmt`` (``Lowering.op_<name>``, the structural ops).

``tests/core/test_op_table.py`` walks this table: it fails on an op missing a part, checks each
derivative against finite differences of the evaluator in f64 in both modes, and each evaluator
against the compiled lowering.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from ..types import DType
    from .nodes import Stmt

# ---------------------------------------------------------------------------------------------
# Derivatives

#: The op's derivative is zero everywhere it is defined (the op is not differentiable, or
#: piecewise constant): values computed by it carry no derivative.
NO_DERIVATIVE = "no derivative"
#: Not a value op of the arithmetic: the autodiff transforms differentiate it themselves.
STRUCTURAL = "structural"

ONE = "one"
MINUS_ONE = "minus_one"


@dataclass(frozen=True)
class Where:
    """A partial that is 1 where ``cond`` is ``when``, else 0: applied as a ``select``, so an
    infinite or NaN derivative on the branch not taken cannot leak through ``0 * inf``."""

    cond: Stmt
    when: bool = True


@dataclass(frozen=True)
class Scaled:
    """A partial ``factor * value``, ``factor`` a power of two (up to sign). Forward mode
    carries power-of-two factors beside tangents instead of multiplying them in: the 2 of
    d(x*x) = 2 x dx then cancels the 1/2 of d(sqrt s) = ds / (2 sqrt s), exactly (scaling by
    a power of two is exact), and a norm's tangent costs three fewer operations. Reverse mode
    multiplies the factor in."""

    value: Stmt
    factor: float


#: A partial: ``None`` (this operand carries no derivative, e.g. a condition), ``ONE``,
#: ``MINUS_ONE``, a :class:`Where`, a :class:`Scaled` or a statement holding its value.
Partial = Any
#: ``rule(emitter, result, *operands) -> [partial per operand]``; the emitter appends IR
#: (``autodiff.rules.Emitter``: ``const``, ``un``, ``bin``, ``cmp``, ``select``).
Rule = Callable[..., list]


def _one_minus_sq(e, v):
    return e.bin("sub", e.const(1, v.dtype), e.bin("mul", v, v))


def _recip(e, v):
    return e.bin("div", e.const(1, v.dtype), v)


def _d_pow(e, y, a, b):
    t = y.dtype
    da = e.bin("mul", b, e.bin("pow", a, e.bin("sub", b, e.const(1, t))))
    # d/db a^b = a^b log a, defined for a > 0; elsewhere (integer exponents of negative bases,
    # 0^b) the exponent has no derivative and we give 0 rather than NaN.
    pos = e.cmp("gt", a, e.const(0, t))
    safe_a = e.select(pos, a, e.const(1, t))
    db = e.select(pos, e.bin("mul", y, e.un("log", safe_a)), e.const(0, t))
    return [da, db]


def _d_atan2(e, y, a, b):
    r2 = e.bin("add", e.bin("mul", a, a), e.bin("mul", b, b))
    return [e.bin("div", b, r2), e.un("neg", e.bin("div", a, r2))]


def _d_abs(e, y, a):
    t = y.dtype
    zero = e.const(0, t)
    sign = e.select(e.cmp("gt", a, zero), e.const(1, t),
                    e.select(e.cmp("lt", a, zero), e.const(-1, t), zero))
    return [sign]


def _d_mod(e, y, a, b):
    # a mod b = a - b * floor(a / b)
    return [ONE, e.un("neg", e.un("floor", e.bin("div", a, b)))]


# ---------------------------------------------------------------------------------------------
# Evaluators: Python values in, the compiled code's result (before rounding to the type) out.
# ``src`` is the first operand's type, ``dst`` the result's.


def _np(fn):
    """A float function evaluated by NumPy in the operand type (each step rounded as the
    compiled code rounds it), IEEE specials instead of exceptions."""

    def ev(xs, src, dst):
        with np.errstate(all="ignore"):
            return float(fn(*(src.np.type(x) for x in xs)))

    return ev


def _fdiv(a: float, b: float, t: DType):
    with np.errstate(all="ignore"):
        return t.np.type(a) / t.np.type(b)


def _int_div(a: int, b: int) -> int:
    """Truncating, a zero divisor giving 0 (the lowering never traps)."""
    if b == 0:
        return 0
    q = abs(a) // abs(b)
    return q if (a < 0) == (b < 0) else -q


def _div(xs, src, dst):
    a, b = xs
    return float(_fdiv(a, b, src)) if src.is_float else _int_div(a, b)


def _floordiv(xs, src, dst):
    a, b = xs
    if src.is_float:
        return float(np.floor(_fdiv(a, b, src)))
    return 0 if b == 0 else a // b


def _rem(xs, src, dst):
    """C's remainder (the dividend's sign): ``fmod`` on floats (exact), ``%`` truncating on
    integers with a zero divisor giving 0 (the lowering never traps)."""
    a, b = xs
    if src.is_float:
        t = src.np.type
        with np.errstate(all="ignore"):
            return float(np.fmod(t(a), t(b)))
    return a - b * _int_div(a, b) if b != 0 else 0


def _d_rem(e, y, a, b):
    # a rem b = a - b * trunc(a / b); trunc is piecewise constant
    q = e.bin("div", a, b)
    trunc = e.select(e.cmp("lt", q, e.const(0, q.dtype)), e.un("ceil", q), e.un("floor", q))
    return [ONE, e.un("neg", trunc)]


def _bit_cast(xs, src, dst):
    """The same bits read as another type of the same width."""
    (v,) = xs
    return np.array(src.wrap(v), dtype=src.np).view(dst.np).item()


def _clz(xs, src, dst):
    """Leading zero bits of the value's two's-complement pattern (``llvm.ctlz``, defined at
    0 as the width)."""
    (v,) = xs
    return src.bits - (v & ((1 << src.bits) - 1)).bit_length()


def _mod(xs, src, dst):
    a, b = xs
    if src.is_float:  # a - floor(a / b) * b, rounded step by step as compiled
        t = src.np.type
        with np.errstate(all="ignore"):
            return float(t(a) - np.floor(_fdiv(a, b, src)) * t(b))
    return 0 if b == 0 else a % b


def _pow(xs, src, dst):
    a, b = xs
    if src.is_float:  # C99's pow (NumPy differs on specials such as pow(-inf, 0.5))
        odd = math.isfinite(b) and b == math.floor(b) and math.fmod(b, 2.0) != 0
        try:
            return math.pow(a, b)
        except ValueError:  # a pole (0 to a negative power) or a negative base's root
            return (math.copysign(math.inf, a) if odd else math.inf) if a == 0 else math.nan
        except OverflowError:
            return -math.inf if a < 0 and odd else math.inf
    return 1 if b <= 0 else pow(a, b, 1 << src.bits)  # repeated squaring, wrapping


def _nan_aware(pick):
    """llvm.minnum/maxnum: a NaN operand loses to the other."""

    def ev(xs, src, dst):
        a, b = xs
        if src.is_float:
            if math.isnan(a):
                return b
            if math.isnan(b):
                return a
        return pick(a, b)

    return ev


def _shift(fn):
    def ev(xs, src, dst):
        a, b = xs
        # LLVM gives poison for a shift by the width or more; 0 here (never folded).
        return fn(a, b) if 0 <= b < src.bits else 0

    return ev


def _round_half_away(x: float) -> float:
    """llvm.round: halves away from zero (exact: ``|x| - floor(|x|)`` has no rounding)."""
    if not math.isfinite(x):
        return x
    r = math.floor(abs(x))
    if abs(x) - r >= 0.5:
        r += 1
    return math.copysign(float(r), x)


def _cast(xs, src, dst):
    (v,) = xs
    if dst.bits == 1:  # u1: "is nonzero", as Taichi converts to its boolean type
        return 1 if v else 0
    if dst.is_int and src.is_float:  # saturating, as llvm.fpto[su]i.sat
        if math.isnan(v):
            return 0
        lo = -(1 << (dst.bits - 1)) if dst.is_signed else 0
        hi = (1 << (dst.bits - 1 if dst.is_signed else dst.bits)) - 1
        return lo if v <= lo else hi if v >= hi else math.trunc(v)
    return float(v) if dst.is_float else v


def _overflows(exact):
    """The evaluator of ``<op>_overflows``: 1 where the exact integer result of the op does not
    fit the operands' type (the op's own result wraps around), else 0."""

    def ev(xs, src, dst):
        v = exact(*xs)
        return 1 if v is None else int(src.wrap(v) != v)

    return ev


def _shl_exact(a: int, b: int) -> int | None:
    """``a << b`` as an exact number, None where it fits no type: a shift by the width or
    more, or by a negative amount (poison in LLVM), keeps nothing of a nonzero ``a``."""
    return a << b if 0 <= b < 64 else 0 if a == 0 else None


def _py(fn):
    """An evaluator that is the Python function itself (exact on ints; IEEE on floats where
    Python does not raise)."""
    return lambda xs, src, dst: fn(*xs)


def _cmp(fn):
    return lambda xs, src, dst: int(fn(*xs))


# ---------------------------------------------------------------------------------------------
# The table

#: Type rules of the value ops, checked by the verifier and applied by the frontend:
TYPE_RULES = {
    "same": "one operand; the result has its type",
    "float": "one float operand, same result type (the frontend casts ints to default_fp)",
    "real": "one float operand, same result type (the frontend refuses ints, as Taichi does)",
    "int": "one integer operand, same result type",
    "cond": "one integer condition; the result is i32",
    "arith": "two operands and the result of one type",
    "fdiv": "as arith (the frontend divides ints in default_fp)",
    "farith": "as arith, floats only (the frontend casts ints to default_fp)",
    "bits": "as arith, integers only",
    "shift": "as bits (the frontend gives the left operand's type)",
    "cmp": "two operands of one type; the result is i32",
    "logical": "two integer conditions; the result is i32",
    "select": "an integer condition and two operands of the result's type",
    "cast": "one operand of any type, converted to the result's",
    "bit_cast": "one operand; the result is another type of the same width (same bits)",
    "overflow": "two integer operands of one type; the result is i32 (1: the op overflows)",
}

_ANY = ("f", "i", "u")
_STMT = dict.fromkeys(_ANY, "stmt")


@dataclass(frozen=True)
class OpInfo:
    kind: str  # const | arg | unary | binary | cmp | ternary | mem | local | control | stack
    nargs: int | None  # None: variable
    pure: bool  # no side effects, may be removed when unused and re-computed freely
    nblocks: int = 0
    types: str | None = None  # a TYPE_RULES key (value ops); None: checked by the verifier
    evaluate: Callable | None = None  # (values, src, dst) -> value; None: structural
    py: Callable | None = None  # the function on Python numbers (frontend, Python scope)
    # A rule, NO_DERIVATIVE or STRUCTURAL. None: not declared, which the autodiff transforms
    # refuse wherever a derivative would have to flow through the op (never a silent zero).
    derivative: Rule | str | None = None
    lower: dict[str, str] = field(default_factory=dict)
    risky: bool = False  # value or partial may be infinite/NaN for finite operands
    fold: bool = False  # constant folding applies the evaluator (exact on the target)
    # The float result is an operand moved bit for bit (or with its sign bit changed), not
    # computed: a subnormal passes through kernels' flush-to-zero mode (DType.flush).
    moves: bool = False


def _structural(kind: str, nargs: int | None, pure: bool, nblocks: int = 0) -> OpInfo:
    """Memory, local, control and stack ops: the transforms differentiate them, the reference
    interpreter and the lowering (``op_<name>``) handle each by name."""
    return OpInfo(kind, nargs, pure, nblocks, derivative=STRUCTURAL,
                  lower=dict.fromkeys(_ANY, "stmt"))


def _unary_float(fn, derivative, lower, risky=False, py=None, types="float") -> OpInfo:
    return OpInfo("unary", 1, True, types=types, evaluate=_np(fn), py=py,
                  derivative=derivative, lower={"f": lower}, risky=risky)


def _arith(fn, derivative, lower, *, ev=None, types="arith", fold=True, risky=False,
           py=None, moves=False) -> OpInfo:
    return OpInfo("binary", 2, True, types=types, evaluate=ev or _py(fn), py=py or fn,
                  derivative=derivative, lower=lower, fold=fold, risky=risky, moves=moves)


def _bits(fn, lower, fold=True, ev=None, types="bits") -> OpInfo:
    return OpInfo("binary", 2, True, types=types, evaluate=ev or _py(fn), py=fn,
                  derivative=NO_DERIVATIVE, lower={"i": lower, "u": lower}, fold=fold)


def _overflow_check(exact, lower: str) -> OpInfo:
    """``<op>_overflows``: does integer ``<op>`` of the operands overflow their type? The
    checks ``passes/overflow.py`` inserts under ``debug=True``; never emitted by the
    frontend."""
    return OpInfo("binary", 2, True, types="overflow", evaluate=_overflows(exact),
                  derivative=NO_DERIVATIVE, lower={"i": lower, "u": lower}, fold=True)


def _compare(fn, f, i, u) -> OpInfo:
    return OpInfo("cmp", 2, True, types="cmp", evaluate=_cmp(fn), py=lambda a, b: int(fn(a, b)),
                  derivative=NO_DERIVATIVE,
                  lower={"f": f"fcmp:{f}", "i": f"icmp:{i}", "u": f"icmp:{u}"}, fold=True)


def _same_insts(f: str, i: str) -> dict[str, str]:
    return {"f": f, "i": i, "u": i}


OPS: dict[str, OpInfo] = {
    # -- leaves
    "const": OpInfo("const", 0, True, derivative=NO_DERIVATIVE, lower=_STMT),
    "arg": OpInfo("arg", 0, True, derivative=NO_DERIVATIVE, lower=_STMT),  # attr: argument index
    # attr: (buffer slot, axis) runtime extent (ndarray)
    "buf_shape": OpInfo("arg", 0, True, derivative=NO_DERIVATIVE, lower=_STMT),
    # attr: loop id; the index of an enclosing range_for
    "loop_index": OpInfo("arg", 0, True, derivative=NO_DERIVATIVE, lower=_STMT),
    "random": OpInfo("random", 0, False, derivative=NO_DERIVATIVE, lower=_STMT),
    # -- conversions and selection
    "cast": OpInfo("unary", 1, True, types="cast", evaluate=_cast,
                   derivative=lambda e, y, a: [ONE], lower=_STMT, fold=True),
    "select": OpInfo("ternary", 3, True, types="select",
                     evaluate=lambda xs, src, dst: xs[1] if xs[0] else xs[2],
                     derivative=lambda e, y, c, a, b: [None, Where(c), Where(c, False)],
                     lower=_STMT, moves=True),
    # The bits reinterpreted (Taichi's bit_cast): no derivative, as integers carry none.
    "bit_cast": OpInfo("unary", 1, True, types="bit_cast", evaluate=_bit_cast,
                       derivative=NO_DERIVATIVE, lower=_STMT, fold=True, moves=True),
    "stop_grad": OpInfo("unary", 1, True, types="same", evaluate=lambda xs, src, dst: xs[0],
                        derivative=NO_DERIVATIVE, lower=_STMT, moves=True),
    # -- unary arithmetic
    "neg": OpInfo("unary", 1, True, types="same", evaluate=_py(operator.neg), py=operator.neg,
                  derivative=lambda e, y, a: [MINUS_ONE],
                  lower={"f": "method:fneg", "i": "method:ineg", "u": "method:ineg"},
                  fold=True, moves=True),
    "abs": OpInfo("unary", 1, True, types="same", evaluate=_py(abs), py=abs, derivative=_d_abs,
                  lower={"f": "intrinsic:fabs", "i": "method:iabs", "u": "method:identity"},
                  moves=True),
    # Trigonometric functions and rounding refuse integers (types="real"), as in Taichi.
    "sin": _unary_float(np.sin, lambda e, y, a: [e.un("cos", a)], "libm:sin", py=math.sin,
                        types="real"),
    "cos": _unary_float(np.cos, lambda e, y, a: [e.un("neg", e.un("sin", a))], "libm:cos",
                        py=math.cos, types="real"),
    "tan": _unary_float(np.tan, lambda e, y, a: [e.bin("add", e.const(1, y.dtype),
                                                        e.bin("mul", y, y))],
                        "libm:tan", risky=True, py=math.tan, types="real"),
    "asin": _unary_float(np.arcsin, lambda e, y, a: [e.un("rsqrt", _one_minus_sq(e, a))],
                         "libm:asin", risky=True, py=math.asin, types="real"),
    "acos": _unary_float(np.arccos,
                         lambda e, y, a: [e.un("neg", e.un("rsqrt", _one_minus_sq(e, a)))],
                         "libm:acos", risky=True, py=math.acos, types="real"),
    "atan": _unary_float(np.arctan, lambda e, y, a: [_recip(e, e.bin(
        "add", e.const(1, y.dtype), e.bin("mul", a, a)))], "libm:atan", py=math.atan, types="real"),
    "tanh": _unary_float(np.tanh, lambda e, y, a: [_one_minus_sq(e, y)], "libm:tanh",
                         py=math.tanh, types="real"),
    "exp": _unary_float(np.exp, lambda e, y, a: [y], "libm:exp", risky=True, py=math.exp),
    "log": _unary_float(np.log, lambda e, y, a: [_recip(e, a)], "libm:log", risky=True,
                        py=math.log),
    "sqrt": _unary_float(np.sqrt, lambda e, y, a: [Scaled(_recip(e, y), 0.5)],
                         "intrinsic:sqrt", risky=True, py=math.sqrt),
    "rsqrt": _unary_float(lambda x: x.dtype.type(1) / np.sqrt(x),
                          lambda e, y, a: [Scaled(e.bin("mul", y, e.bin("mul", y, y)), -0.5)],
                          "method:rsqrt", risky=True, py=lambda x: 1.0 / math.sqrt(x)),
    # Rounding: piecewise constant, a zero derivative (as Taichi gives floor).
    "floor": OpInfo("unary", 1, True, types="real", evaluate=_np(np.floor), py=math.floor,
                    derivative=NO_DERIVATIVE, lower={"f": "intrinsic:floor"}),
    "ceil": OpInfo("unary", 1, True, types="real", evaluate=_np(np.ceil), py=math.ceil,
                   derivative=NO_DERIVATIVE, lower={"f": "intrinsic:ceil"}),
    "round": OpInfo("unary", 1, True, types="real",
                    evaluate=lambda xs, src, dst: _round_half_away(xs[0]),
                    py=_round_half_away, derivative=NO_DERIVATIVE,
                    lower={"f": "intrinsic:round"}),
    "logical_not": OpInfo("unary", 1, True, types="cond",
                          evaluate=lambda xs, src, dst: int(not xs[0]),
                          py=lambda x: int(not x), derivative=NO_DERIVATIVE,
                          lower={"i": "method:logical_not", "u": "method:logical_not"},
                          fold=True),
    "bit_not": OpInfo("unary", 1, True, types="int", evaluate=_py(operator.invert),
                      py=operator.invert, derivative=NO_DERIVATIVE,
                      lower={"i": "method:bit_not", "u": "method:bit_not"}, fold=True),
    "clz": OpInfo("unary", 1, True, types="int", evaluate=_clz, derivative=NO_DERIVATIVE,
                  lower={"i": "method:clz", "u": "method:clz"}, fold=True),
    # -- binary arithmetic
    "add": _arith(operator.add, lambda e, y, a, b: [ONE, ONE],
                  _same_insts("inst:fadd", "inst:add")),
    "sub": _arith(operator.sub, lambda e, y, a, b: [ONE, MINUS_ONE],
                  _same_insts("inst:fsub", "inst:sub")),
    "mul": _arith(operator.mul, lambda e, y, a, b: [b, a], _same_insts("inst:fmul", "inst:mul")),
    # Partials through one reciprocal: 1/b is shared (LLVM merges equal divisions) with the
    # quotient's other uses, e.g. sqrt's partial 0.5/y when b = sqrt(...), as in norms.
    "div": _arith(operator.truediv,
                  lambda e, y, a, b: [_recip(e, b), e.un("neg", e.bin("mul", y, _recip(e, b)))],
                  {"f": "method:fdiv", "i": "method:int_div", "u": "method:int_div"},
                  ev=_div, types="fdiv", fold=False, risky=True),
    "floordiv": _arith(operator.floordiv, NO_DERIVATIVE,
                       {"f": "method:float_floordiv", "i": "method:int_div",
                        "u": "method:int_div"}, ev=_floordiv, fold=False, risky=True),
    "mod": _arith(operator.mod, _d_mod, {"f": "method:float_mod", "i": "method:int_div",
                                         "u": "method:int_div"},
                  ev=_mod, fold=False, risky=True),
    # C's remainder (ti.raw_mod): the sign of the dividend.
    "rem": _arith(math.fmod, _d_rem, {"f": "inst:frem", "i": "method:int_div",
                                      "u": "method:int_div"},
                  ev=_rem, fold=False, risky=True),
    "pow": _arith(operator.pow, _d_pow, {"f": "libm:pow", "i": "method:int_pow",
                                         "u": "method:int_pow"},
                  ev=_pow, fold=False, risky=True),
    "min": _arith(min, lambda e, y, a, b: [Where(e.cmp("le", a, b)), Where(e.cmp("le", a, b),
                                                                           False)],
                  {"f": "intrinsic:minnum", "i": "intrinsic:smin", "u": "intrinsic:umin"},
                  ev=_nan_aware(min), moves=True),
    "max": _arith(max, lambda e, y, a, b: [Where(e.cmp("ge", a, b)), Where(e.cmp("ge", a, b),
                                                                           False)],
                  {"f": "intrinsic:maxnum", "i": "intrinsic:smax", "u": "intrinsic:umax"},
                  ev=_nan_aware(max), moves=True),
    "atan2": _arith(math.atan2, lambda e, y, a, b: _d_atan2(e, y, a, b), {"f": "libm:atan2"},
                    ev=_np(np.arctan2), types="farith", fold=False, risky=True),
    "bit_and": _bits(operator.and_, "inst:and"),
    "bit_or": _bits(operator.or_, "inst:or"),
    "bit_xor": _bits(operator.xor, "inst:xor"),
    "shl": _bits(operator.lshift, "inst:shl", fold=False, ev=_shift(operator.lshift),
                 types="shift"),
    "shr": OpInfo("binary", 2, True, types="shift", evaluate=_shift(operator.rshift),
                  py=operator.rshift, derivative=NO_DERIVATIVE,
                  lower={"i": "inst:ashr", "u": "inst:lshr"}),
    "logical_and": OpInfo("binary", 2, True, types="logical",
                          evaluate=lambda xs, src, dst: int(bool(xs[0]) and bool(xs[1])),
                          py=lambda a, b: int(bool(a) and bool(b)), derivative=NO_DERIVATIVE,
                          lower={"i": "method:logical", "u": "method:logical"}, fold=True),
    "logical_or": OpInfo("binary", 2, True, types="logical",
                         evaluate=lambda xs, src, dst: int(bool(xs[0]) or bool(xs[1])),
                         py=lambda a, b: int(bool(a) or bool(b)), derivative=NO_DERIVATIVE,
                         lower={"i": "method:logical", "u": "method:logical"}, fold=True),
    # -- overflow checks of integer arithmetic (debug=True): 1 if the exact result does not fit
    "add_overflows": _overflow_check(operator.add, "method:overflows"),
    "sub_overflows": _overflow_check(operator.sub, "method:overflows"),
    "mul_overflows": _overflow_check(operator.mul, "method:overflows"),
    "shl_overflows": _overflow_check(_shl_exact, "method:shl_overflows"),
    # -- comparisons (ordered on floats except ``ne``, as IEEE and Python)
    "lt": _compare(operator.lt, "olt", "slt", "ult"),
    "le": _compare(operator.le, "ole", "sle", "ule"),
    "gt": _compare(operator.gt, "ogt", "sgt", "ugt"),
    "ge": _compare(operator.ge, "oge", "sge", "uge"),
    "eq": _compare(operator.eq, "oeq", "eq", "eq"),
    "ne": _compare(operator.ne, "une", "ne", "ne"),
    # -- memory (buffers): differentiated by the transforms
    "load": _structural("mem", None, True),  # args: indices; attr: buffer slot
    "store": _structural("mem", None, False),  # args: indices..., value; attr: buffer slot
    "atomic": _structural("mem", None, False),  # args: indices..., value; attr: (slot, kind)
    # -- locals
    "alloca": _structural("local", 0, False),
    "local_load": _structural("local", 1, True),
    "local_store": _structural("local", 2, False),
    # A reduction into a kernel-level variable from a parallel loop (``s += v``): args alloca,
    # value; attr: atomic kind; returns the old value.
    "local_atomic": _structural("local", 2, False),
    "temp_load": _structural("local", 0, True),  # attr: temp slot (kernel-level locals, offloaded)
    "temp_store": _structural("local", 1, False),
    "temp_atomic": _structural("local", 1, False),  # attr: (temp slot, atomic kind)
    # -- control
    "if": _structural("control", 1, False, 2),
    "range_for": _structural("control", 2, False, 1),  # args: begin, end; attr: (loop id, flags)
    "while": _structural("control", 0, False, 1),
    "break": _structural("control", 0, False),
    "continue": _structural("control", 0, False),
    "assert": _structural("control", None, False),  # args: cond, *values; attr: message
    "return": _structural("control", 1, False),  # attr: return slot
    # Output: args: the values printed; attr: (text0, conversion0, ..., textN), see ir.printf.
    "print": _structural("control", None, False),
    # The reverse-mode stack: one LIFO of 8-byte slots per task invocation, grown on demand.
    # The adjoint of a loop pushes the loop-carried locals at each iteration and pops them
    # when it walks the iterations backwards.
    "stack_push": _structural("stack", 1, False),
    "stack_pop": _structural("stack", 0, False),
}

#: The kinds of ``atomic``/``local_atomic``/``temp_atomic``: each names the binary op that
#: combines the old value with the operand. The lowering emits ``atomicrmw`` where LLVM has
#: one and a compare-and-swap loop for ``mul``. None carries a derivative rule of its own:
#: the transforms differentiate ``add``/``sub`` and refuse the others into storage with
#: derivatives. ``passes/determinism.py`` classifies each kind.
ATOMIC_KINDS = ("add", "sub", "mul", "min", "max", "bit_and", "bit_or", "bit_xor")


def has_derivative(op: str) -> bool:
    """Does ``op`` have a derivative rule (partials as IR)?"""
    return callable(OPS[op].derivative)


def evaluate(op: str, values: tuple, src: DType, dst: DType):
    """The value of ``op`` on ``values`` (operands of type ``src``) as type ``dst`` holds it:
    the one definition constant folding and the reference interpreter share. A float result that
    is computed (not moved, ``OpInfo.moves``) is flushed to zero where subnormal, as kernels
    compute it."""
    info = OPS[op]
    v = dst.wrap(info.evaluate(values, src, dst))
    return v if info.moves or not dst.is_float else dst.flush(v)


def type_kind(t: DType) -> str:
    """The key of ``OpInfo.lower`` for values of type ``t``: ``"f"``, ``"i"`` or ``"u"``."""
    return t.kind
