"""The language's operations, one definition for Python scope and kernel scope.

Each function accepts Python numbers, kernel values (``Value``) and matrices. Numbers give
numbers (so ``ti.sqrt(2.0)`` works anywhere and compile-time arithmetic folds in the frontend);
kernel values emit typed IR with Taichi's promotion rules; matrices apply elementwise.
"""

from __future__ import annotations

import builtins
import numbers
import sys
from collections.abc import Callable

import numpy as np

from .. import types as T
from ..errors import CompileError, DifftapeError, KernelSyntaxError, KernelTypeError
from ..ir.nodes import Loc
from ..ir.ops import OPS
from ..runtime import program
from ..types import DType
from . import builder as _b
from . import values as _values
from .values import Expr, Ref, Value

# ----------------------------------------------------------------------------------- helpers


#: ``Matrix`` (frontend/matrix.py, which builds on this module), registered by matrix.py when it
#: loads (:func:`register_matrix`): elementwise ops take matrices without an upward import.
_matrix_class = None


def register_matrix(cls: type) -> None:
    """Registration point for the matrix class (called once by matrix.py)."""
    global _matrix_class
    _matrix_class = cls


def _is_matrix(x) -> bool:
    return isinstance(x, _matrix_class)


def _is_number(x) -> bool:
    """A compile-time number: Python and NumPy scalars, and 0-d NumPy arrays (``np.array(5)``
    used as a loop bound or a constant)."""
    if isinstance(x, np.ndarray):
        return x.ndim == 0 and x.dtype.kind in "biuf"
    return isinstance(x, numbers.Number | np.generic)


def const(value, dtype: DType) -> Expr:
    """A constant of the given type, holding the value that type can hold: an f32 literal is
    rounded to f32 here, so that promoting it (``x64 * 0.1`` under ``default_fp=ti.f32``) or
    casting it gives the f32 value, as in Taichi, not the Python float it was written as."""
    if dtype.bits == 1:  # u1: a number converts by "is nonzero", as in Taichi
        value = 1 if value else 0
    value = dtype.flush(dtype.wrap(float(value))) if dtype.is_float else dtype.wrap(value)
    return Expr(_b.require().emit("const", dtype, (), value))


def literal_dtype(value) -> DType:
    """The type a Python literal takes in a kernel: Taichi's default_fp / default_ip."""
    b = _b.require()
    if isinstance(value, np.generic | np.ndarray):
        return T.from_numpy(value.dtype)
    if isinstance(value, bool):
        return T.i32
    if isinstance(value, numbers.Integral):
        return b.default_ip
    return b.default_fp


def _int_fits(value: int, dtype: DType) -> bool:
    if dtype.is_float:
        return True
    if dtype.is_signed:
        return -(1 << (dtype.bits - 1)) <= value < 1 << (dtype.bits - 1)
    return 0 <= value < 1 << dtype.bits


def literal(value, dtype: DType | None = None, typed: bool = False) -> Expr:
    """A Python number entering a kernel, as a value of ``dtype`` if given. As in Taichi, an
    integer literal is a ``default_ip`` value (then converted like any value, so 300 stored
    into a u8 wraps as a C cast would); one that fits neither ``default_ip`` nor the type it
    is given here is an error instead of silently wrapping (Taichi raises too). A float
    literal is a ``default_fp`` value wherever it goes (stored into an f64, cast to one): its
    value is rounded to default_fp first, as Taichi's is, unless ``typed`` (``ti.f64(0.1)``
    names the literal's type)."""
    inferred = literal_dtype(value)
    target = dtype or inferred
    if (not typed and target.is_float and target != inferred and inferred.is_float
            and not isinstance(value, np.generic)):
        value = inferred.wrap(value)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool | np.generic):
        v = int(value)
        if not _int_fits(v, target) and not _int_fits(v, inferred):
            raise _b.require().error(
                f"integer literal {v} exceeded the range of default_ip ({inferred})"
                + (f" and of {target}, the type it is given here" if target != inferred
                   else "")
                + f"; give it a wide enough type, e.g. ti.i64({v}) or ti.u64({v}), or set "
                "default_ip in ti.init()", KernelTypeError)
    return const(value, target)


def to_expr(x, dtype: DType | None = None) -> Expr:
    """A kernel value from a number or value, cast to ``dtype`` when given."""
    if isinstance(x, Value):
        e = x.expr()
    elif _is_number(x):
        return literal(x, dtype)
    elif _is_matrix(x):
        raise _b.require().error(
            f"expected a scalar but got a {x.n}x{x.m} matrix/vector" if x.ndim == 2 else
            f"expected a scalar but got a vector of {x.n} entries")
    else:
        raise _b.require().error(f"expected a number or kernel value, got {type(x).__name__}")
    if dtype is not None and e.dtype != dtype:
        e = _cast_expr(e, dtype)
    return e


def _cast_expr(e: Expr, dtype: DType) -> Expr:
    if e.dtype == dtype:
        return e
    if e.stmt.op == "const":
        return const(e.stmt.attr, dtype)
    return Expr(_b.require().emit("cast", dtype, (e.stmt,)))


def _elementwise(fn, *xs):
    Matrix = _matrix_class
    shape = next(x for x in xs if _is_matrix(x))
    for x in xs:
        if _is_matrix(x) and (x.n, x.m) != (shape.n, shape.m):
            raise _err(f"Cannot broadcast tensor to tensor: the shapes differ ({x.n}x{x.m} "
                       f"vs {shape.n}x{shape.m})")
    entries = [fn(*[x.entries[k] if _is_matrix(x) else x for x in xs])
               for k in range(len(shape.entries))]
    return Matrix._from_entries(entries, shape.n, shape.m, shape.ndim)


def _err(msg: str, cls: type[CompileError] = KernelTypeError):
    """A type error (``cls``) naming the kernel line; the plain builtin in Python scope."""
    b = _b.current()
    if b is not None:
        return b.error(msg, cls)
    return (IndexError if issubclass(cls, IndexError) else TypeError)(msg)


# ----------------------------------------------------------------------------------- casts


def cast(x, dtype, typed: bool = False):
    """``ti.cast(x, dtype)``: float to int truncates toward zero, as in C and Taichi.
    ``typed``: ``x`` is the literal of a primitive type's call (``ti.f64(0.1)``), not a
    default_fp value (see :func:`literal`)."""
    dtype = resolve_dtype(dtype)
    if _is_matrix(x):
        return _elementwise(lambda e: cast(e, dtype, typed), x)
    if _is_number(x):
        if _b.current() is not None:
            if dtype.bits == 1:  # u1: "is nonzero"
                return const(x, dtype)
            if dtype.is_int and not isinstance(x, numbers.Integral):
                x = int(x)  # a float literal truncates toward zero
            return literal(x, dtype, typed)
        return dtype.np.type(int(x) if dtype.is_int else x)
    return to_expr(x, dtype)


def construct(dtype: DType, *args, **kwargs):
    """``ti.u8(x)`` etc.: a cast of exactly one value, except that an integer literal must
    fit the type it names (``ti.u8(300)`` is an error, as in Taichi, rather than 44)."""
    if len(args) != 1 or kwargs:
        given = ", ".join([*map(repr, args), *(f"{k}=..." for k in kwargs)])
        msg = (f"A primitive type can only decorate a single expression: {dtype}(x) takes one "
               f"value, got {dtype}({given})")
        b = _b.current()
        raise b.error(msg, KernelSyntaxError) if b is not None else TypeError(msg)
    x = args[0]
    b = _b.current()
    if b is not None:
        x = _check_annotated_literal(b, dtype, x)
    if (isinstance(x, numbers.Integral) and not isinstance(x, bool | np.generic)
            and b is not None and not _int_fits(int(x), dtype)):
        raise b.error(f"integer literal {int(x)} exceeded the range of specified "
                      f"dtype {dtype}, the type it is given here", KernelTypeError)
    return cast(x, dtype, typed=True)


def _check_annotated_literal(b: _b.Builder, dtype: DType, x):
    """``ti.f32(x)`` in a kernel, as Taichi reads it: a kernel value is cast, but a Python
    number is a *literal annotated* with the type, which must be of its kind (``ti.i32(0.5)``
    would truncate without a word; ``ti.cast`` says so). Vectors/matrices/structs are
    refused (``ti.cast`` converts them entrywise), and a 0-d NumPy array is its number."""
    if isinstance(x, np.ndarray):
        if x.ndim:
            raise b.error("Only 0-dimensional numpy array can be used to initialize a scalar "
                          f"expression; got shape {x.shape}", KernelTypeError)
        x = x[()]
    if isinstance(x, Value):
        return x
    if not _is_number(x):  # a vector/matrix, struct, list ...
        raise b.error("A primitive type cannot decorate an expression with a compound type: "
                      f"{dtype}(x) takes a scalar, got a {type(x).__name__}; convert a "
                      f"vector/matrix entrywise with ti.cast(x, ti.{dtype})", KernelSyntaxError)
    if isinstance(x, bool | np.bool_):
        return x
    if isinstance(x, numbers.Integral) and dtype.is_float:
        raise b.error("Integer literals must be annotated with a integer type. For type "
                      f"casting, use `ti.cast`: write {float(x)!r} for a {dtype} literal, or "
                      f"ti.cast(x, ti.{dtype})", KernelTypeError)
    if not isinstance(x, numbers.Integral) and not dtype.is_float:
        raise b.error("Floating-point literals must be annotated with a floating-point type. "
                      f"For type casting, use `ti.cast`: ti.cast({x!r}, ti.{dtype}) truncates "
                      "toward zero", KernelTypeError)
    return x


def resolve_dtype(dtype) -> DType:
    """Accept difftape dtypes, Python ``int``/``float`` and NumPy dtypes."""
    if isinstance(dtype, DType):
        return dtype
    b = _b.current()
    if dtype is float:
        return b.default_fp if b else _default("fp")
    if dtype is int:
        return b.default_ip if b else _default("ip")
    try:
        return T.from_numpy(np.dtype(dtype))
    except TypeError:
        raise _err(f"not a scalar dtype: {dtype!r}") from None


def _default(which: str) -> DType:
    cfg = program.get().config
    return cfg.default_fp if which == "fp" else cfg.default_ip


# ----------------------------------------------------------------------------------- binary



def to_condition(x) -> Expr:
    """A kernel value used as a truth value (``if``, ``while``, ``not``, ``and``/``or``,
    ``ti.select``, ``assert``): an i32, so a float condition means ``x != 0``."""
    e = to_expr(x)
    if e.dtype.is_float:
        e = Expr(_b.require().emit("ne", T.i32, (e.stmt, const(0.0, e.dtype).stmt)))
    return e


def runtime_check(cond, message: str, loc: Loc | None = None) -> None:
    """Check ``cond`` at run time whatever ``ti.init(debug=...)`` says: where it is false the
    launch ends with a ``KernelAssertionError`` carrying ``message``, the kernel and the line
    ``loc`` (default: the line being compiled; a library func passes its caller's line).

    For library routines whose result would otherwise be silently wrong (``ti.solve`` of a
    singular matrix, ``ti.sym_eig`` of a non-symmetric one); a user's ``assert`` is only
    compiled with ``debug=True``, as in Taichi. A compile-time ``False`` is a compile error.
    """
    bld = _b.require()
    if _is_number(cond):
        if not cond:
            raise bld.error(message)
        return
    loc = loc or bld.loc
    where = loc.where(bld.kernel_name) if loc else f"\n  in kernel '{bld.kernel_name}'"
    bld.emit("assert", None, (to_condition(cond).stmt,), (message + where,))


#: How the user writes a binary op, for messages.
_SYMBOL = {"bit_and": "&", "bit_or": "|", "bit_xor": "^", "shl": "<<", "shr": ">>"}


def binary(op: str, a, b):
    """Apply a binary op with Taichi's typing. Numbers fold at compile time."""
    if _is_matrix(a) or _is_matrix(b):
        return _elementwise(lambda x, y: binary(op, x, y), a, b)
    if _is_number(a) and _is_number(b):
        return OPS[op].py(a, b)
    if not (isinstance(a, Value) or _is_number(a)) or not (isinstance(b, Value) or _is_number(b)):
        raise _err(f"unsupported operand types for {op}: {type(a).__name__} and "
                   f"{type(b).__name__}")
    bld = _b.require()
    if op in ("logical_and", "logical_or"):
        ea, eb = to_condition(a), to_condition(b)
        return Expr(bld.emit(op, T.i32, (ea.stmt, eb.stmt)))
    ea, eb = _typed_pair(a, b)
    t = T.promote(ea.dtype, eb.dtype)
    rule = OPS[op].types  # the op table's type rule
    if rule == "fdiv":  # as Taichi: each integer operand of `/` is default_fp, then promotion
        t = T.promote(*(e.dtype if e.dtype.is_float else bld.default_fp for e in (ea, eb)))
    elif rule == "farith" and t.is_int:
        t = bld.default_fp
    elif rule in ("bits", "shift") and t.is_float:
        raise bld.error(f"unsupported operand type(s) for '{_SYMBOL.get(op, op)}': "
                        f"{ea.dtype} and {eb.dtype} (bitwise operations need integers)",
                        KernelTypeError)
    if rule == "shift":
        t = ea.dtype
    ea, eb = _cast_expr(ea, t), _cast_expr(eb, t)
    out_t = T.i32 if rule in ("cmp", "logical") else t
    return Expr(bld.emit(op, out_t, (ea.stmt, eb.stmt)))


def _typed_pair(a, b) -> tuple[Expr, Expr]:
    """Literals take their type from Taichi's defaults; then ordinary promotion applies."""
    ea = a.expr() if isinstance(a, Value) else None
    eb = b.expr() if isinstance(b, Value) else None
    if ea is None:
        ea = literal(a, _wide_literal_type(a, eb))
    if eb is None:
        eb = literal(b, _wide_literal_type(b, ea))
    return ea, eb


def _wide_literal_type(value, other: Expr | None) -> DType | None:
    """An integer literal too wide for ``default_ip`` next to a value of a type it fits (an
    i64, a float) takes that type, which the result is promoted to anyway: ``n64 * 9000000000``
    is exact (Taichi refuses it). Otherwise the literal takes ``default_ip``."""
    if (other is not None and isinstance(value, numbers.Integral)
            and not isinstance(value, bool | np.generic)
            and not _int_fits(int(value), literal_dtype(value))
            and _int_fits(int(value), other.dtype)):
        return other.dtype
    return None


def raw_div(a, b):
    """``ti.raw_div(a, b)``: C's division: truncating on two integers (a zero divisor gives
    0 instead of trapping), true division otherwise. In Python scope, as Taichi, two integers
    give Python's floor division."""
    if _is_matrix(a) or _is_matrix(b):
        return _elementwise(raw_div, a, b)
    if _is_number(a) and _is_number(b):
        ints = isinstance(a, numbers.Integral) and isinstance(b, numbers.Integral)
        return a // b if ints else a / b
    bld = _b.require()
    ea, eb = _typed_pair(a, b)
    t = T.promote(ea.dtype, eb.dtype)  # plain promotion (`/` makes integers default_fp)
    return Expr(bld.emit("div", t, (_cast_expr(ea, t).stmt, _cast_expr(eb, t).stmt)))


def raw_mod(a, b):
    """``ti.raw_mod(a, b)``: C's remainder, with the sign of the dividend (``ti.raw_mod(-4,
    3)`` is -1 where ``%`` gives 2); ``fmod`` on floats (Taichi 1.7.4 fails to compile that);
    a zero integer divisor gives 0. In Python scope, Taichi's ``a - b * int(a / b)``."""
    if _is_matrix(a) or _is_matrix(b):
        return _elementwise(raw_mod, a, b)
    if _is_number(a) and _is_number(b):
        return a - b * int(float(a) / b)
    return binary("rem", a, b)


def bit_cast(x, dtype):
    """``ti.bit_cast(x, dtype)``: the bits of scalar ``x`` read as ``dtype``, which must have
    the same width (C++'s ``reinterpret_cast``, e.g. f32 <-> i32)."""
    dtype = resolve_dtype(dtype)
    if _is_matrix(x):
        raise _err("ti.bit_cast takes a scalar, not a vector or matrix")
    if _is_number(x):
        src = T.from_numpy(np.asarray(x).dtype) if isinstance(x, np.generic) else (
            _default("fp") if isinstance(x, float) else _default("ip"))
        if _b.current() is None:
            return dtype.np.type(np.array(x, dtype=src.np).view(dtype.np).item())
    e = to_expr(x)
    if e.dtype.bits != dtype.bits:
        raise _b.require().error(f"ti.bit_cast: {e.dtype} has {e.dtype.bits} bits and {dtype} "
                                 f"{dtype.bits}; bit_cast needs types of the same width "
                                 "(use ti.cast to convert values)")
    return Expr(_b.require().emit("bit_cast", dtype, (e.stmt,)))


def bit_shr(x1, x2):
    """``ti.bit_shr(x1, x2)``: ``x1`` shifted right by ``x2`` bits, filling with zeros (a
    logical shift, also for signed types, whose bits are shifted as unsigned ones); the
    result has ``x1``'s type. ``>>`` is the arithmetic shift. Elementwise on vectors. Kernels
    only, as in Taichi: a Python int has no width to shift within."""
    if _is_matrix(x1) or _is_matrix(x2):
        return _elementwise(bit_shr, x1, x2)
    bld = _b.current()
    if bld is None:
        raise DifftapeError("ti.bit_shr() runs in kernels only (as in Taichi): a Python int has "
                            "no width to shift zeros into; use x >> n, or (x % 2**32) >> n")
    a, b = to_expr(x1), to_expr(x2)
    if not (a.dtype.is_int and b.dtype.is_int):
        raise bld.error(f"ti.bit_shr takes integers, got {a.dtype} and {b.dtype}",
                        KernelTypeError)
    if not a.dtype.is_signed:
        return binary("shr", a, b)
    bits = T.ALL[f"u{a.dtype.bits}"]
    return bit_cast(binary("shr", bit_cast(a, bits), b), a.dtype)


def clz(x):
    """``ti.math.clz(x)``: the number of leading zero bits of integer ``x`` in its type (32
    for a zero i32). In Python scope, as Taichi, for a 32-bit value."""
    if _is_matrix(x):
        return _elementwise(clz, x)
    if _is_number(x):
        return next((32 - i for i in range(32) if 2**i > x), 0)
    e = to_expr(x)
    if not e.dtype.is_int:
        raise _b.require().error(f"ti.math.clz needs an integer, got {e.dtype}")
    return Expr(_b.require().emit("clz", e.dtype, (e.stmt,)))


def zero(x):
    """``ti.zero(x)``: zeros of the type and shape of ``x`` (``x * 0``, as Taichi)."""
    return binary("mul", x, 0)


def one(x):
    """``ti.one(x)``: ones of the type and shape of ``x`` (``zero(x) + 1``, as Taichi)."""
    return binary("add", zero(x), 1)


def pow(a, b):  # noqa: A001 - mirrors ti.pow
    """``a ** b``. Small constant integer exponents become multiplications, which is both
    faster and exact, and differentiates cleanly at x = 0."""
    if _is_matrix(a) or _is_matrix(b):
        return _elementwise(pow, a, b)
    if _is_number(a) and _is_number(b):
        return a**b
    if isinstance(b, numbers.Integral) and not isinstance(b, bool) and builtins.abs(b) <= 16:
        ea = to_expr(a)
        if b == 0:
            return const(1, ea.dtype)
        result = _pow_by_squaring(ea, builtins.abs(b))
        if b < 0:
            if ea.dtype.is_int:
                raise _b.require().error(
                    "negative integer power of an integer; cast the base to float first")
            return binary("div", 1.0, result)
        return result
    bld = _b.require()
    ea, eb = _typed_pair(a, b)
    base_t = ea.dtype
    t = T.promote(ea.dtype, eb.dtype)
    ea, eb = _cast_expr(ea, t), _cast_expr(eb, t)
    if bld.debug and t.is_int and t.is_signed:
        # An integer has no negative powers; outside debug mode the result is 1 (Taichi
        # documents 1; its value there is undefined), in debug mode a refusal, as in Taichi.
        runtime_check(binary("ge", eb, 0), "negative exponent in pow(int, int): an integer "
                      "has no negative powers; cast the base to a float type first")
    r = Expr(bld.emit("pow", t, (ea.stmt, eb.stmt)))
    if t.is_int and base_t != t:
        # As Taichi, an integer exponent leaves the base's type: computed in the wider type
        # and truncated, which wraps exactly as repeated multiplication in the base's type.
        r = _cast_expr(r, base_t)
    return r


def _pow_by_squaring(x: Expr, n: int) -> Expr:
    result = None
    base = x
    while n:
        if n & 1:
            result = base if result is None else binary("mul", result, base)
        n >>= 1
        if n:
            base = binary("mul", base, base)
    return result


# ----------------------------------------------------------------------------------- unary

def unary(op: str, x):
    if _is_matrix(x):
        return _elementwise(lambda e: unary(op, e), x)
    if _is_number(x):
        return OPS[op].py(x)
    if isinstance(x, np.ndarray):
        raise _err(f"{op} of a NumPy array: use NumPy in Python scope")
    bld = _b.require()
    e = to_expr(x)
    rule = OPS[op].types  # the op table's type rule
    if rule == "float" and e.dtype.is_int:
        e = _cast_expr(e, bld.default_fp)
    if rule == "real" and e.dtype.is_int:
        # As Taichi: rounding an integer is a no-op and a trigonometric function of one is
        # most likely a missing cast, so both are refused rather than guessed at.
        raise bld.error(f"'{op}' takes real inputs only, however '{e.dtype}' is provided; "
                        f"convert it first, e.g. ti.{op}(ti.cast(x, ti.f32))", KernelTypeError)
    if op == "logical_not":
        return Expr(bld.emit("logical_not", T.i32, (to_condition(e).stmt,)))
    if op == "bit_not" and e.dtype.is_float:
        raise bld.error(f"bitwise not (~) takes integral inputs only, got {e.dtype}",
                        KernelTypeError)
    return Expr(bld.emit(op, e.dtype, (e.stmt,)))


def _unary_fn(op: str):
    def fn(x):
        return unary(op, x)

    fn.__name__ = op
    fn.__doc__ = f"Elementwise ``{op}``; numbers in Python scope, IR inside kernels."
    return fn


def _rounding_fn(op: str):
    def fn(x, dtype=None):
        r = unary(op, x)
        return r if dtype is None else cast(r, dtype)

    fn.__name__ = op
    fn.__doc__ = f"``ti.{op}(x, dtype=None)``; with a dtype the result is cast to it."
    return fn


sin = _unary_fn("sin")
cos = _unary_fn("cos")
tan = _unary_fn("tan")
asin = _unary_fn("asin")
acos = _unary_fn("acos")
atan = _unary_fn("atan")
tanh = _unary_fn("tanh")
exp = _unary_fn("exp")
log = _unary_fn("log")
sqrt = _unary_fn("sqrt")
rsqrt = _unary_fn("rsqrt")
floor = _rounding_fn("floor")
ceil = _rounding_fn("ceil")
round = _rounding_fn("round")  # noqa: A001
abs = _unary_fn("abs")  # noqa: A001


def atan2(y, x):
    return binary("atan2", y, x)


def min(*xs):  # noqa: A001
    if len(xs) == 1:
        xs = tuple(xs[0])
    out = xs[0]
    for x in xs[1:]:
        out = binary("min", out, x)
    return out


def max(*xs):  # noqa: A001
    if len(xs) == 1:
        xs = tuple(xs[0])
    out = xs[0]
    for x in xs[1:]:
        out = binary("max", out, x)
    return out


def clamp(x, lo, hi):
    return min(max(x, lo), hi)


def select(cond, a, b):
    """``ti.select(cond, a, b)``: both sides are evaluated; no branch."""
    if _is_matrix(cond) or _is_matrix(a) or _is_matrix(b):
        return _elementwise(select, cond, a, b)
    if _is_number(cond):
        return a if cond else b
    bld = _b.require()
    c = to_condition(cond)
    ea, eb = _typed_pair(a, b)
    t = T.promote(ea.dtype, eb.dtype)
    return Expr(bld.emit("select", t, (c.stmt, _cast_expr(ea, t).stmt, _cast_expr(eb, t).stmt)))


def logical_and(a, b):
    return binary("logical_and", a, b)


def logical_or(a, b):
    return binary("logical_or", a, b)


def logical_not(a):
    return unary("logical_not", a)


def stop_grad(x):
    """The value of ``x`` with no gradient flowing through it. Given a field (as in Taichi):
    no derivative flows through its loads in the enclosing block and the blocks nested in
    it, before and after the call (see :meth:`Builder.stop_gradient`)."""
    stop_field = getattr(x, "_stop_gradient", None)
    if stop_field is not None:
        stop_field(_b.require())
        return None
    if _is_matrix(x):
        return _elementwise(stop_grad, x)
    if _is_number(x):
        return x
    e = to_expr(x)
    return Expr(_b.require().emit("stop_grad", e.dtype, (e.stmt,)))


def random(dtype=float):
    """``ti.random(dtype=float)``: uniform in [0, 1) for floats; for integers, uniform over
    all values of the type (all 64 bits for i64/u64, as in Taichi)."""
    bld = _b.current()
    dtype = resolve_dtype(dtype)
    if bld is None:
        import random as _pyrandom

        return _pyrandom.random() if dtype.is_float else \
            dtype.wrap(_pyrandom.getrandbits(dtype.bits))
    return Expr(bld.emit("random", dtype))


def randn(dt=None):
    """``ti.randn(dt=None)``: a standard normal sample (mean 0, variance 1) of float type
    ``dt`` (default_fp), by the Box-Muller transform as Taichi computes it:
    ``sqrt(-2 log(1 - u1)) cos(2 pi u2)`` with ``u1``, ``u2`` uniform in [0, 1) (so the
    logarithm's argument is never 0)."""
    dtype = resolve_dtype(dt if dt is not None else float)
    if not dtype.is_float:
        raise _err(f"ti.randn: dt must be a float type, got {dtype}")
    if _b.current() is None:
        import random as _pyrandom

        return _pyrandom.gauss(0.0, 1.0)
    u1 = binary("sub", const(1.0, dtype), random(dtype))
    u2 = random(dtype)
    r = unary("sqrt", binary("mul", const(-2.0, dtype), unary("log", u1)))
    return binary("mul", r, unary("cos", binary("mul", const(2 * np.pi, dtype), u2)))


# ----------------------------------------------------------------------------------- atomics


def atomic(kind: str, ref, value):
    """Atomic read-modify-write on a place; returns the old value."""
    if _is_matrix(ref):
        return _elementwise(lambda r, v: atomic(kind, r, v), ref, value)
    if not isinstance(ref, Ref):
        # A syntax error with Taichi's words, as Taichi raises it
        raise _err(f"cannot use a non-writable target as the first operand of 'atomic_{kind}': "
                   f"ti.atomic_{kind} needs a field element or a local variable as its target",
                   KernelSyntaxError)
    if OPS[kind].types == "bits":
        t = T.promote(ref.dtype, to_expr(value).dtype)
        if t.is_float:
            raise _b.require().error(f"bitwise operation '{kind}' needs integer operands, "
                                     f"got {t}", KernelTypeError)
    return ref.atomic(kind, value)


def atomic_add(ref, value):
    return atomic("add", ref, value)


def atomic_sub(ref, value):
    return atomic("sub", ref, value)


def atomic_mul(ref, value):
    """``ti.atomic_mul(x, y)``: ``x *= y`` atomically; returns the old value of ``x``."""
    return atomic("mul", ref, value)


def atomic_min(ref, value):
    return atomic("min", ref, value)


def atomic_max(ref, value):
    return atomic("max", ref, value)


def atomic_and(ref, value):
    return atomic("bit_and", ref, value)


def atomic_or(ref, value):
    return atomic("bit_or", ref, value)


def atomic_xor(ref, value):
    return atomic("bit_xor", ref, value)


# Moved from builder.py (Builder.loop_nest): it emits constants and values, which are built here.
def loop_nest(bld: _b.Builder, extents: tuple[int, ...], body: Callable[[list], None],
              starts: tuple[int, ...] | None = None) -> None:
    """Emit loops over ``extents`` (constant sizes, from ``starts``, zeros by default)
    around ``body(indices)``: the outermost parallel at the kernel's top level, serial
    elsewhere. For operations that loop over a whole field from one call (``x.fill(v)`` in a
    kernel: the field's indices run from its offset)."""
    def nest(level: int, indices: list) -> None:
        if level == len(extents):
            body(indices)
            return
        start = starts[level] if starts else 0
        begin, end = const(start, T.i32), const(start + extents[level], T.i32)
        loop_id = next(bld.loop_ids)
        kind = "parallel" if level == 0 and bld.at_top_level else "range"
        with bld.block() as blk:
            bld.loop_stack.append((kind, loop_id))
            index = Expr(bld.emit("loop_index", T.i32, (), loop_id))
            nest(level + 1, indices + [index])
            bld.loop_stack.pop()
        bld.emit("range_for", None, (begin.stmt, end.stmt),
                  (loop_id, "parallel" if kind == "parallel" else "inner"), (blk,))

    nest(0, [])


# ``ti.types.is_signed/is_integral/is_real`` (moved from ``types.py``: they accept Python's
# ``int``/``float``, which only the frontend resolves; the package provides them to ``ti.types``).
def is_signed(dt) -> bool:
    """``ti.types.is_signed``: true for signed integer (and float) types."""
    return _cook(dt).is_signed


def is_integral(dt) -> bool:
    """``ti.types.is_integral``: true for integer types, signed or not."""
    return _cook(dt).is_int


def is_real(dt) -> bool:
    """``ti.types.is_real``: true for floating-point types."""
    return _cook(dt).is_float


def _cook(dt) -> DType:
    return resolve_dtype(dt)


T.set_caster(construct)
_values.bind_ops(sys.modules[__name__])
