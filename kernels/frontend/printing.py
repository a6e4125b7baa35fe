"""``print()`` inside kernels, with ``str.format`` and f-strings of kernel values.

A print becomes one ``print`` statement of the IR (a runtime call to C's ``printf`` at every
launch, see :mod:`..ir.printf`; under ``arch=ti.remote`` the server's engine collects the
lines and the client prints them, ``runtime/printsink.py``), formatted as Taichi formats
it: ``sep``/``end`` as in Python, floats ``%f`` (f64 with 12 decimals), vectors and
matrices as ``[1.000000, 2.000000]`` and ``[[..], [..]]``, lists and tuples bracketed,
Python numbers given directly to ``print`` as kernel constants (``1.5`` prints
``1.500000``). In ``"...".format(...)`` and f-strings,
compile-time values are formatted by Python, kernel values with their spec turned into a
printf conversion (``{:.2f}``, ``{:e}``, ``{:08d}``; a spec of another kind than the value,
``{:d}`` of a float, is a KernelTypeError).

The same pieces make the messages of ``assert`` (:func:`assert_message`): an f-string, a
``str.format`` or ``"..." % args`` of kernel values becomes a template whose values the failing
thread reports and the host formats (``ir/assertfmt.py``), as Taichi formats them.
"""

from __future__ import annotations

import numbers
import re
import string

import numpy as np

from ..errors import KernelSyntaxError, KernelTypeError
from ..ir import assertfmt
from ..ir.printf import FormatError, conversion
from . import builder as _b
from . import ops
from .matrix import Matrix
from .struct import Struct
from .values import Value


class Formatted:
    """A string with kernel values in it (``"{}".format(x)`` / ``f"{x}"`` of a runtime
    ``x``): literal text and (value, user spec) pairs, printed by ``print``."""

    def __init__(self, parts: list) -> None:
        self.parts = parts

    def __str__(self) -> str:
        raise _b.require().error("a string holding kernel values can only be printed "
                                 "(print(...)); kernels have no strings")


def _is_runtime(x) -> bool:
    if isinstance(x, Value | Formatted):
        return True
    if isinstance(x, Matrix):
        return any(isinstance(e, Value) for e in x.entries)
    if isinstance(x, list | tuple):
        return any(_is_runtime(e) for e in x)
    return False


def format_string(template: str, args: tuple, kwargs: dict) -> str | Formatted:
    """``template.format(*args, **kwargs)`` as Taichi reads it in kernels: ``{}`` fields
    count from 0 independently of numbered ones (``"{1} {}"`` takes arguments 1 and 0), every
    argument must be used (else KernelSyntaxError), kernel values and numbers with a spec are
    printed by the kernel (``{:.2f}``), other values formatted by Python."""
    parts: list = []
    auto, used_pos, used_kw = 0, set(), set()
    for text, field, spec, conv in string.Formatter().parse(template):
        parts.append(text)
        if field is None:
            continue
        name, rest = _split_field(field)
        if name == "":
            name, auto = auto, auto + 1
        if isinstance(name, int):
            used_pos.add(name)
            if name >= len(args):
                continue  # reported below with the expected count
            value = args[name]
        else:
            if name not in kwargs:
                raise ops._err(f"Keyword '{name}' not found.", KernelSyntaxError)
            used_kw.add(name)
            value = kwargs[name]
        for attr in rest:
            value = getattr(value, attr)
        parts.append(_field(value, spec, conv))
    expected = max(used_pos) + 1 if used_pos else 0
    if expected != len(args):
        raise ops._err(f"Expected {expected} positional argument(s), but received "
                       f"{len(args)} instead.", KernelSyntaxError)
    for k in kwargs:
        if k not in used_kw:
            raise ops._err(f"Keyword '{k}' not used.", KernelSyntaxError)
    return _result(parts)


def _split_field(field: str) -> tuple[int | str, list[str]]:
    """``"0.x"`` -> (0, ["x"]); ``"k"`` -> ("k", []); ``""`` -> ("", [])."""
    if "[" in field:
        raise ops._err("indexing inside a format field ({0[1]}) is not supported in kernels; "
                       "index the argument instead", KernelSyntaxError)
    name, *rest = field.split(".")
    return (int(name) if name.isdigit() else name), rest


def joined(values: list) -> str | Formatted:
    """An f-string: ``values`` are literal strings and (value, spec, conversion) triples."""
    return _result([v if isinstance(v, str) else _field(*v) for v in values])


def _result(parts: list) -> str | Formatted:
    if any(isinstance(p, tuple) for p in parts):
        return Formatted(parts)
    return "".join(parts)


def _field(value, spec: str, conv: str | None):
    """One replacement field: a (value, spec) pair for the kernel to print (a kernel value,
    its conversion ignored as Taichi does: ``f"{x=}"`` prints ``x=`` and the value; a number
    with a spec, which Taichi prints as a kernel constant), else Python's text."""
    if "{" in spec:
        raise ops._err("nested replacement fields in a format spec are not supported in "
                       "kernels")
    if _is_runtime(value) or (spec and isinstance(value, numbers.Number | np.generic)):
        return (value, spec or None)
    if conv:
        value = {"r": repr, "s": str, "a": ascii}[conv](value)
    return format(value, spec)


def _pieces(x, spec: str | None, out: list) -> None:
    """Append the text and (scalar value, spec) items that print ``x``."""
    if isinstance(x, str):
        out.append(x)
    elif isinstance(x, Formatted):
        for p in x.parts:
            if isinstance(p, tuple):
                _pieces(p[0], p[1], out)
            else:
                out.append(p)
    elif isinstance(x, Value) or (isinstance(x, numbers.Number | np.generic)):
        out.append((ops.to_expr(x), spec))
    elif isinstance(x, Matrix):
        items = x.entries if x.ndim == 1 else [x._row(i) for i in range(x.n)]
        _bracketed(items, spec, out)
    elif isinstance(x, list | tuple):
        _bracketed(x, spec, out)
    elif isinstance(x, Struct):
        raise ops._err("print() of a struct in a kernel is not supported; print its members")
    else:
        raise ops._err(f"print() in a kernel prints numbers, kernel values, vectors and "
                       f"strings, not a {type(x).__name__}; in Python scope, print "
                       "x.to_numpy() or elements")


def _bracketed(items, spec: str | None, out: list) -> None:
    out.append("[")
    for k, e in enumerate(items):
        if k:
            out.append(", ")
        _pieces(e, spec, out)
    out.append("]")


def emit_print(bld: _b.Builder, args: list, sep: str = " ", end: str = "\n") -> None:
    """``print(*args, sep=sep, end=end)`` in a kernel: one ``print`` statement."""
    if not isinstance(sep, str) or not isinstance(end, str):
        raise bld.error("print(): sep and end must be strings")
    items: list = []
    for k, a in enumerate(args):
        if k:
            items.append(sep)
        _pieces(a, None, items)
    items.append(end)
    attr: list[str] = [""]
    values = []
    for it in items:
        if isinstance(it, str):
            attr[-1] += it
            continue
        e, spec = it
        try:
            attr.append(conversion(spec, e.dtype))
        except FormatError as err:
            raise bld.error(str(err), KernelTypeError) from None
        attr.append("")
        values.append(e.stmt)
    bld.emit("print", None, tuple(values), tuple(attr))


#: One ``%`` conversion of Python's printf-style formatting (``%%`` included).
_PERCENT = re.compile(r"%(?:\((?P<key>[^)]*)\))?(?P<flags>[-+ #0]*)(?P<width>\*|\d+)?"
                      r"(?:\.(?P<prec>\*|\d+))?[hlL]?(?P<conv>.?)", re.S)
_BARE = {"d": "i", "i": "i", "u": "i", "f": "f", "F": "f"}


def percent_items(fmt: str, args) -> list:
    """``fmt % args`` (an assert's message) as text and (kernel value, spec) items, Python's
    rules: a tuple gives one argument per conversion, anything else is one argument. A
    number is a kernel constant (as in Taichi: ``%f`` of ``0.5`` shows ``0.5``); other
    compile-time values are formatted by Python."""
    args = list(args) if isinstance(args, tuple) else [args]
    out: list = []
    pos = used = 0
    for m in _PERCENT.finditer(fmt):
        out.append(fmt[pos:m.start()])
        pos = m.end()
        conv = m.group("conv")
        if conv == "%" and m.group(0) == "%%":
            out.append("%")
            continue
        if m.group("key") is not None:
            raise ops._err("%(name) mapping keys are not supported in kernel assert messages; "
                           "use an f-string", KernelSyntaxError)
        if "*" in (m.group("width") or "") + (m.group("prec") or ""):
            raise ops._err("'*' widths and precisions are not supported in kernel assert "
                           "messages", KernelSyntaxError)
        if not conv or conv not in "diouxXeEfFgGsra":
            raise ops._err(f"unsupported format character {conv!r} in an assert message "
                           f"(kernels show numbers: %d, %f, %e, %x, ...)", KernelTypeError)
        if used == len(args):
            raise ops._err("not enough arguments for format string", KernelTypeError)
        arg, used = args[used], used + 1
        spec = m.group(0)
        if isinstance(arg, numbers.Number | np.generic) and not isinstance(arg, bool):
            arg = ops.to_expr(arg)
        if not _is_runtime(arg):
            try:
                out.append(spec % (arg,))
            except (TypeError, ValueError) as e:
                raise ops._err(f"assert message: {e}", KernelTypeError) from None
        elif conv in "sra" and spec == "%" + conv:
            out += _template_items(arg)
        elif not isinstance(arg, Value):
            raise ops._err(f"'{spec}' of a {type(arg).__name__} in an assert message: show a "
                           "vector with '%s' or an f-string", KernelTypeError)
        else:
            # A bare %d of an integer or %f of a float: Taichi's text of the value.
            e = ops.to_expr(arg)
            bare = spec == "%" + conv and _BARE.get(conv) == ("f" if e.dtype.is_float else "i")
            out.append((e, "" if bare else "%" + re.sub("[hlL]", "", spec[1:])))
    out.append(fmt[pos:])
    if used != len(args):
        raise ops._err("not all arguments converted during string formatting", KernelTypeError)
    return out


def _template_items(x) -> list:
    """What shows ``x`` (as print shows it), its values' specs in ``ir/assertfmt.py``'s terms:
    a user's format spec (an f-string's ``{x:.3f}``) applied by Python's ``format``."""
    items: list = []
    _pieces(x, None, items)
    return [it if isinstance(it, str) else (it[0], ":" + it[1] if it[1] else "")
            for it in items]


def assert_message(msg) -> tuple[tuple[str, ...], list]:
    """The template and the kernel values of an assert's message ``msg``: a string, an
    f-string or ``str.format`` of kernel values (a ``Formatted``), items made by
    :func:`percent_items`, or a kernel value itself. Stripped, as Taichi strips it."""
    if isinstance(msg, list):
        items = msg
    elif isinstance(msg, str | Formatted) or _is_runtime(msg):
        items = _template_items(msg)
    else:
        items = [str(msg)]
    texts, specs, values = [""], [], []
    for it in items:
        if isinstance(it, str):
            texts[-1] += it
            continue
        e, spec = it
        why = assertfmt.check(spec, e.dtype)
        if why:
            raise ops._err(f"assert message: {why}", KernelTypeError)
        specs.append(spec)
        values.append(e)
        texts.append("")
    if len(values) > assertfmt.MAX_VALUES:
        raise ops._err(f"an assert message shows at most {assertfmt.MAX_VALUES} values (as in "
                       f"Taichi), this one {len(values)}", KernelSyntaxError)
    texts[0] = texts[0].lstrip()
    texts[-1] = texts[-1].rstrip()
    template = [texts[0]]
    for spec, text in zip(specs, texts[1:], strict=True):
        template += [spec, text]
    return tuple(template), values
