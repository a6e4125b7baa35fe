"""Quantized types (``ti.types.quant``, ``ti.BitpackedFields``, ``SNode.quant_array``): not in
difftape, refused by name.

Taichi packs fields of a few bits (custom integers, fixed-point and low-precision floats,
shared exponents) into words, and every store rounds or wraps the value to what those bits can
hold. difftape stores each field at the width of an ordinary type, so accepting a quantized
type would silently compute at a different precision; each entry point raises instead, saying
what to use.
"""

from __future__ import annotations

from types import SimpleNamespace

from ..errors import DifftapeError


class QuantizedTypesUnsupported(DifftapeError, NotImplementedError):
    """A quantized type or bit-packed layout was asked for."""


def refuse(what: str) -> QuantizedTypesUnsupported:
    """The error for one quantized-type entry point."""
    return QuantizedTypesUnsupported(
        f"{what}: quantized types (ti.types.quant.int/fixed/float, ti.BitpackedFields, "
        "SNode.quant_array) are not supported by difftape, which stores every field at the "
        "width of an ordinary type; use ti.i8/i16/i32/i64, ti.u8..u64 or ti.f16/f32/f64 (a "
        "quantized program's results would differ at its precision)")


def _refusing(name: str):
    def entry(*args, **kwargs):
        raise refuse(f"ti.types.quant.{name}(...)")

    entry.__name__ = name
    entry.__doc__ = f"``ti.types.quant.{name}``: refused (see :mod:`{__name__}`)."
    return entry


#: ``ti.types.quant``
quant = SimpleNamespace(int=_refusing("int"), fixed=_refusing("fixed"),
                        float=_refusing("float"))


class BitpackedFields:
    """``ti.BitpackedFields(max_num_bits)``: refused (see :mod:`difftape.frontend.quant`)."""

    def __init__(self, *args, **kwargs) -> None:
        raise refuse("ti.BitpackedFields(...)")
