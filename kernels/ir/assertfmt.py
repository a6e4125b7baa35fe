"""Messages of failed checks: text with run-time values, formatted on the host.

An ``assert`` statement's operands are its condition and the values its message shows; its
attribute is the message template ``(text0, spec1, text1, ..., specN, textN)``: literal text
around one spec per value. When the condition is false, the generated code writes the values
into the launch context's error report (the first failing thread only: the report is claimed
by compare-and-swap, ``codegen/llvm_lowering.py``) as 64-bit words, floats as f64 bits and
integers extended to i64, as every context slot holds them; the host decodes the words with
the values' types and formats them with :func:`render`.

A spec is one of

- ``""``: the value as Taichi writes it (``assert c, "x = %d, y = %f" % (x, y)`` and
  f-string fields without a spec): an integer in decimal, a float in the shortest form that
  reads back to the same value of its type, fixed-point from 1e-4 to 1e16 and without a
  trailing ``.0`` (``0.5``, ``1``, ``123456790``, ``1e+20``: what Taichi's ``fmt`` ``{}``
  writes), at every width (Taichi reads every value as 32 bits);
- ``"%..."``: a printf-style conversion applied with Python's ``%``
  (``"%.2f"``, ``"%5d"``, ``"%x"``);
- ``":..."``: a Python format spec applied with ``format`` (an f-string's ``{x:.3f}``).

The template is data, never evaluated: :func:`check` holds every spec to a strict grammar with
widths and precisions of at most two digits, of the value's kind (an integer conversion of a
float is refused, as ``print`` refuses it), and a spec is only ever applied to a Python int or
float made from the report's words. The service formats the IR it received with it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..types import DType
from .nodes import KernelIR, task_blocks, walk

#: The most values one message shows (Taichi's limit too); the error report has a slot each.
MAX_VALUES = 32

_PRINTF = re.compile(r"%[-+ #0]*(?:\d{1,2})?(?:\.\d{1,2})?([diouxXeEfFgG])")
_PYSPEC = re.compile(r":(?:[^{}%]?[<>=^])?[-+ ]?#?0?(?:\d{1,2})?[,_]?(?:\.\d{1,2})?"
                     r"([bdoxXeEfFgG%]?)")
_INT_LETTERS = set("diouxXb")

_NP_FLOAT = {16: np.float16, 32: np.float32, 64: np.float64}


def check(spec: object, t: DType) -> str | None:
    """Why ``spec`` cannot show a ``t`` (None if it can): the verifier's and the service's
    rule, and the frontend's before it emits a template."""
    if not isinstance(spec, str):
        return f"format {spec!r} is not a string"
    if spec == "":
        return None
    m = (_PRINTF if spec.startswith("%") else _PYSPEC).fullmatch(spec)
    if m is None:
        return (f"format {spec!r} is not a supported conversion (flags, a width and a "
                "precision of at most 2 digits each, a number's conversion letter)")
    letter = m.group(1)
    if letter in _INT_LETTERS and t.is_float:
        return f"format {spec!r} shows an integer, the value is {t}"
    if spec.startswith(":") and "." in spec and not t.is_float and letter in ("", "d"):
        return f"format {spec!r} has a precision, the value is {t}"
    return None


def check_template(template: object, types: Sequence[DType]) -> str | None:
    """Why ``template`` is not a message template for values of ``types`` (None if it is)."""
    if not isinstance(template, tuple) or len(template) != 2 * len(types) + 1 or not all(
            isinstance(x, str) for x in template[::2]):
        return (f"an assert message is (text, spec, ..., text) around its {len(types)} "
                f"values, got {template!r:.80}")
    if len(types) > MAX_VALUES:
        return f"an assert message shows at most {MAX_VALUES} values, this one {len(types)}"
    for k, t in enumerate(types):
        why = check(template[2 * k + 1], t)
        if why:
            return why
    return None


def decode(words: Sequence[int], types: Sequence[DType]) -> list[int | float]:
    """The values of ``types`` that the error report's 64-bit ``words`` hold."""
    out: list[int | float] = []
    for w, t in zip(words, types, strict=False):
        w = int(w) & 0xFFFF_FFFF_FFFF_FFFF
        if t.is_float:
            v = float(np.array([w], np.uint64).view(np.float64)[0])
            out.append(float(_NP_FLOAT[t.bits](v)))
        elif t.is_signed:
            out.append(w - (1 << 64) if w >> 63 else w)
        else:
            out.append(w & ((1 << t.bits) - 1))
    return out


def shortest(v: float, t: DType) -> str:
    """A float as Taichi's messages write it (see the module's ``""`` spec)."""
    text = repr(float(np.format_float_scientific(_NP_FLOAT[t.bits](v), unique=True)))
    return text[:-2] if text.endswith(".0") else text


def _one(spec: str, v: int | float, t: DType) -> str:
    if spec == "":
        return shortest(v, t) if t.is_float else str(int(v))
    if spec.startswith("%"):
        return spec % v
    if t.is_float and not spec.endswith(tuple("eEfFgG%")):
        v = float(shortest(v, t))  # no conversion letter: Python's repr of the value shown
    return format(v, spec[1:])


def render(template: Sequence[str], types: Sequence[DType],
           values: Sequence[int | float]) -> str:
    """The message ``template`` shows for ``values`` (of ``types``)."""
    out = [template[0]]
    for k, (t, v) in enumerate(zip(types, values, strict=False)):
        out += [_one(template[2 * k + 1], v, t), template[2 * k + 2]]
    return "".join(out)


@dataclass(frozen=True)
class Message:
    """One distinct message of a kernel's checks: its template and its values' types."""

    template: tuple[str, ...]
    types: tuple[DType, ...]

    def text(self, words: Sequence[int]) -> str:
        """The message for the error report's value words."""
        return render(self.template, self.types, decode(words, self.types))


def assert_messages(ir: KernelIR) -> list[Message]:
    """The distinct messages of a kernel's checks; message k has error code k + 1 (the same
    template showing values of other types is another message)."""
    out: dict[Message, None] = {}
    for t in ir.tasks or []:
        for blk in task_blocks(t):
            for s in walk(blk):
                if s.op == "assert":
                    out.setdefault(Message(s.attr, tuple(a.dtype for a in s.args[1:])))
    return list(out)


def plain(message: str) -> tuple[str]:
    """The template of a message without values."""
    return (message,)
