"""Formats of ``print`` in kernels: C printf conversions per value type, as Taichi prints.

A ``print`` statement's attribute is ``(text0, spec0, text1, spec1, ..., textN)``: literal
text around one printf conversion per operand. The frontend makes each conversion from the
value's type and an optional user spec (``"{:.2f}".format(x)``, ``f"{x:e}"``) with
:func:`conversion`; the verifier checks it with :func:`check`, so the lowering can hand the
whole line to C's ``printf`` in one call (one call per ``print``: lines from parallel loops do
not interleave mid-line).
"""

from __future__ import annotations

import re

from ..types import DType
from .nodes import KernelIR, task_blocks, walk

#: A printf conversion, the leading ``%`` optional: flags, width, precision, length, type.
SPEC = re.compile(r"%?([-+ #0]+)?(\d+|\*)?(\.(?:\d+|\*))?(hh|ll|[hljztL])?"
                  r"([csdioxXufFeEaAgGnp])?")
_GROUPS = {"di": "signed", "oxXu": "unsigned", "fFeEaAgG": "float"}

#: Taichi's conversion per type (f64 with 12 decimals; 8- and 16-bit integers as shorts).
DEFAULT = {"f16": "%f", "f32": "%f", "f64": "%.12f", "i8": "%hd", "i16": "%hd", "i32": "%d",
           "i64": "%lld", "u1": "%hu", "u8": "%hu", "u16": "%hu", "u32": "%u", "u64": "%llu"}


def _group(conv: str) -> str | None:
    return next((g for chars, g in _GROUPS.items() if conv in chars), None)


def _type_group(t: DType) -> str:
    return "float" if t.is_float else "signed" if t.is_signed else "unsigned"


class FormatError(ValueError):
    """A user format spec that cannot print a value of this type."""


def conversion(user: str | None, t: DType) -> str:
    """The printf conversion that prints a ``t`` as ``user`` asks (Taichi's rules): the
    user's flags, width and precision (else the type's precision); the type's length; the
    user's conversion letter if it is of the type's kind (``x`` for unsigned, ``e`` for
    floats), an error if it is of another kind."""
    default = DEFAULT[t.name]
    if not user:
        return default
    m = SPEC.fullmatch(user)
    if m is None:
        raise FormatError(f"'{user}' is not a printf-style format spec "
                          "([flags][width][.precision][conversion], e.g. '.2f', 'e', '08d')")
    flags, width, prec, _length, conv = (g or "" for g in m.groups())
    if width == "*" or prec == ".*":
        raise FormatError(f"'{user}': '*' widths and precisions are not supported")
    if conv in ("c", "s", "n", "p"):
        raise FormatError(f"conversion '{conv}' is not supported.")
    if conv and _group(conv) != _type_group(t):
        raise FormatError(f"'{user}' doesn't match '{t}'.")
    _, _, dprec, dlength, dconv = (g or "" for g in SPEC.fullmatch(default).groups())
    return f"%{flags}{width}{prec or dprec}{dlength}{conv or dconv}"


def check(spec: object, t: DType) -> str | None:
    """Why ``spec`` cannot print a ``t`` (None if it can): the verifier's rule, which the
    lowering relies on (a conversion of the wrong kind would read the wrong register)."""
    if not isinstance(spec, str):
        return f"format {spec!r} is not a string"
    m = SPEC.fullmatch(spec)
    if m is None or not spec.startswith("%") or not m.group(5):
        return f"format {spec!r} is not a printf conversion"
    flags, width, prec, length, conv = (g or "" for g in m.groups())
    if "*" in width + prec or _group(conv) != _type_group(t):
        return f"format {spec!r} cannot print a {t}"
    if length != (SPEC.fullmatch(DEFAULT[t.name]).group(4) or ""):
        return f"format {spec!r} has the wrong length for a {t}"
    return None


def python_format(spec: str, value) -> str:
    """``spec`` applied with Python's ``%`` (the reference interpreter's print)."""
    m = SPEC.fullmatch(spec)
    flags, width, prec, _length, conv = (g or "" for g in m.groups())
    if conv == "u":
        conv = "d"
    return f"%{flags}{width}{prec}{conv}" % value


def line_format(attr: tuple, types: list[DType]) -> str:
    """The C format string of a whole ``print`` line (one call per line): the literal text
    with ``%`` doubled around each operand's conversion."""
    fmt = attr[0].replace("%", "%%")
    for k in range(len(types)):
        fmt += attr[2 * k + 1] + attr[2 * k + 2].replace("%", "%%")
    return fmt


def vararg_kind(t: DType) -> str:
    """How C's varargs pass a ``t``: ``"double"`` (floats), ``"i32"`` (integers of 32 bits
    or fewer, widened as C's default promotions do) or ``"i64"``."""
    if t.is_float:
        return "double"
    return "i32" if t.bits <= 32 else "i64"


def print_formats(ir: KernelIR) -> list[tuple[str, tuple[str, ...]]]:
    """The kernel's distinct print lines as (C format string, vararg kinds), in a fixed
    order (task by task, program order): a line's number in this list is what identifies
    it where prints travel as records (the grid targets' print buffer,
    ``runtime/printsink.py``). By content, not by statement: two prints of the same text
    and types are one entry, and a statement the lowering emits twice is found either way."""
    out: dict[tuple[str, tuple[str, ...]], None] = {}
    for task in ir.tasks:
        for block in task_blocks(task):
            for s in walk(block):
                if s.op == "print":
                    types = [v.dtype for v in s.args]
                    out[(line_format(s.attr, types), tuple(map(vararg_kind, types)))] = None
    return list(out)
