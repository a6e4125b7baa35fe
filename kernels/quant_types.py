"""Quantized types: values stored in a few bits of a physical word, computed at an ordinary type.

A :class:`QuantType` (``ti.types.quant.int/fixed/float``) says how a value is encoded into bits
and what type kernels compute with (its ``compute`` type: an integer type for quant ints, f32
for fixed and floating point). A :class:`QuantPlace` says where one field's bits live in the
physical word of its ``ti.BitpackedFields``: the IR's :class:`~difftape.ir.nodes.Buffer` of a
quantized field carries it, and the code generator decodes loads and encodes stores with it
(``codegen/quant.py``, the one implementation of the encodings: Python-scope access runs small
kernels, so it goes through the same code).

The encodings are Taichi's:

- ``int(bits, signed, compute)``: two's complement in ``bits`` bits; a store keeps the low bits
  of the value (it wraps around), a load sign- or zero-extends to ``compute``.
- ``fixed(bits, signed, max_value | scale, compute)``: an integer ``d`` of ``bits`` bits, the
  value ``d * scale``; a store rounds ``v / scale`` half away from zero and keeps the low bits.
- ``float(exp, frac, signed)``: ``exp`` unsigned exponent bits and ``frac`` digit bits (the
  sign bit among them when signed); a store rounds the f32 value to ``frac - signed`` fraction
  bits (to nearest, halves up; a carry moves into the exponent), rebiases the exponent and
  flushes to zero below the smallest exponent.

This module is on the ground floor: it imports only :mod:`.types`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .types import DType, f32


@dataclass(frozen=True)
class QuantType:
    """One quantized type. ``bits``: the digit bits (all of an int's or fixed's; a float's
    fraction bits, its sign bit included when signed); ``exp``: a float's exponent bits."""

    kind: str  # "int" | "fixed" | "float"
    bits: int
    signed: bool
    compute: DType
    scale: float = 1.0  # fixed: the value of one unit of the digits
    exp: int = 0  # float: exponent bits

    @property
    def total_bits(self) -> int:
        """The bits it takes in the physical word (a float's exponent included)."""
        return self.bits + self.exp

    @property
    def digit_bits(self) -> int:
        """A float's fraction bits (its digits without the sign bit)."""
        return self.bits - int(self.signed)

    @property
    def exponent_offset(self) -> int:
        """What is subtracted from an f32's biased exponent to store it in ``exp`` bits."""
        return 127 - (1 << (self.exp - 1)) + 1

    def __repr__(self) -> str:
        s = "" if self.signed else "u"
        if self.kind == "int":
            return f"q{s}i{self.bits}"
        if self.kind == "fixed":
            return f"q{s}fx{self.bits}(scale={self.scale:g})"
        return f"q{s}f(exp={self.exp}, frac={self.bits})"


def quant_int(bits: int, signed: bool, compute: DType) -> QuantType:
    return QuantType("int", bits, signed, compute)


def quant_fixed(bits: int, signed: bool, scale: float, compute: DType = f32) -> QuantType:
    return QuantType("fixed", bits, signed, compute, scale=float(scale))


def quant_float(exp: int, frac: int, signed: bool, compute: DType = f32) -> QuantType:
    return QuantType("float", frac, signed, compute, exp=exp)


@dataclass(frozen=True)
class QuantPlace:
    """Where one quantized field's bits are in its physical words of ``word_bits`` bits: the
    digits at bit ``offset``, a float's exponent at bit ``exp_offset`` (Taichi's layout: a
    float's exponent comes first, its digits right after it).

    ``shared``: a float whose exponent other floats share (``place(..., shared_exponent=True)``):
    every user of the exponent as ``(type, digits offset)``, in placing order, this one
    included. ``word``: which physical words (one id per ``BitpackedFields`` or quant_array):
    stores of fields of the same word may be fused. ``packed``: in a ``quant_array``, the
    number of elements along each field axis that share one word (empty for one element per
    word); element ``i``'s digits are at ``offset + bits * (its index in the word)``."""

    qtype: QuantType
    word_bits: int
    offset: int
    exp_offset: int = -1
    shared: tuple[tuple[QuantType, int], ...] = ()
    word: int = 0
    packed: tuple[int, ...] = ()
