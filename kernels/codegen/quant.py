"""Loads, stores and atomics of quantized fields, as LLVM IR: the one implementation of the
encodings of :mod:`difftape.quant_types` (Python-scope reads and writes run kernels, so they
come here too).

A quantized field's storage holds one physical word per element, shared with the other
fields of its ``ti.BitpackedFields``. A load reads the word and decodes the field's bits to its
compute type. A store encodes the value into the word without touching the other fields' bits:
a compare-and-swap loop on the word (threads may store other fields of the same word at the
same time), a plain read-modify-write in serial code. An atomic is the same loop with the old
value decoded and combined with the operand before it is encoded, so ``x[None] += 4`` on a
13-bit integer wraps around at 13 bits and a fixed-point add rounds at every step, as in Taichi.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from ..quant_types import QuantPlace
from ..types import DType


def _mask(bits: int) -> int:
    return (1 << bits) - 1


def _to_width(fn, v: str, src: int, dst: int, signed: bool) -> str:
    """An integer of ``src`` bits as ``dst`` bits (sign- or zero-extended, or truncated)."""
    if src == dst:
        return v
    if src > dst:
        return fn.ins(f"trunc i{src} {v} to i{dst}")
    return fn.ins(f"{'sext' if signed else 'zext'} i{src} {v} to i{dst}")


def _field(fn, word: str, w: int, offset: int, bits: int, signed: bool) -> str:
    """The ``bits`` bits at ``offset`` of a ``w``-bit word, sign- or zero-extended to ``w``."""
    t = f"i{w}"
    left = w - offset - bits
    v = fn.ins(f"shl {t} {word}, {left}") if left else word
    right = w - bits
    if right:
        v = fn.ins(f"{'ashr' if signed else 'lshr'} {t} {v}, {right}")
    return v


def _insert(fn, word: str, w: int, offset: int, bits: int, value: str) -> str:
    """``word`` with its ``bits`` bits at ``offset`` replaced by the low bits of ``value``
    (both ``w`` bits wide)."""
    t = f"i{w}"
    m = _mask(bits)
    v = fn.ins(f"and {t} {value}, {m}")
    if offset:
        v = fn.ins(f"shl {t} {v}, {offset}")
    keep = _mask(w) & ~(m << offset)
    kept = fn.ins(f"and {t} {word}, {_signed_const(keep, w)}")
    return fn.ins(f"or {t} {kept}, {v}")


def _signed_const(value: int, w: int) -> int:
    """An unsigned ``w``-bit constant as LLVM writes it (two's complement)."""
    return value - (1 << w) if value >= 1 << (w - 1) else value


def decode(fn, place: QuantPlace, word: str) -> str:
    """The value of the field in ``word``, as its compute type."""
    q, w = place.qtype, place.word_bits
    ct = q.compute
    if q.kind == "int":
        d = _field(fn, word, w, place.offset, q.bits, q.signed)
        return _to_width(fn, d, w, ct.bits, q.signed)
    if q.kind == "fixed":
        d = _field(fn, word, w, place.offset, q.bits, q.signed)
        f = fn.ins(f"{'sitofp' if q.signed else 'uitofp'} i{w} {d} to {_fty(ct)}")
        return fn.ins(f"fmul {_fty(ct)} {f}, {_fconst(q.scale, ct)}")
    # float: f32 bits from the digits and the exponent
    d = _to_width(fn, _field(fn, word, w, place.offset, q.bits, False), w, 32, False)
    e = _to_width(fn, _field(fn, word, w, place.exp_offset, q.exp, False), w, 32, False)
    d = fn.ins(f"shl i32 {d}, {23 - q.digit_bits}")
    frac = fn.ins(f"and i32 {d}, {_mask(23)}")
    off = str(q.exponent_offset)
    if q.exp < 8:  # a zero exponent stays zero (the value is zero)
        nz = fn.ins(f"icmp ne i32 {e}, 0")
        off = fn.ins(f"select i1 {nz}, i32 {q.exponent_offset}, i32 0")
    be = fn.ins(f"add i32 {e}, {off}")
    bits = fn.ins(f"or i32 {fn.ins(f'shl i32 {be}, 23')}, {frac}")
    if q.signed:
        sign = fn.ins(f"shl i32 {fn.ins(f'and i32 {d}, {1 << 23}')}, 8")
        bits = fn.ins(f"or i32 {bits}, {sign}")
    return fn.ins(f"bitcast i32 {bits} to float")


def encode(fn, place: QuantPlace, word: str, value: str) -> str:
    """``word`` with the field's bits set to encode ``value`` (of its compute type)."""
    q, w = place.qtype, place.word_bits
    ct = q.compute
    if q.kind == "int":
        return _insert(fn, word, w, place.offset, q.bits,
                       _to_width(fn, value, ct.bits, w, q.signed))
    if q.kind == "fixed":
        ft = _fty(ct)
        s = fn.ins(f"fmul {ft} {value}, {_fconst(1.0 / q.scale, ct)}")
        pos = fn.ins(f"fcmp ogt {ft} {s}, {_fconst(0.0, ct)}")
        half = fn.ins(f"select i1 {pos}, {ft} {_fconst(0.5, ct)}, {ft} {_fconst(-0.5, ct)}")
        s = fn.ins(f"fadd {ft} {s}, {half}")
        # (saturating: an out-of-range value is no undefined behaviour; its low bits are kept)
        kind = "fptosi" if q.signed else "fptoui"
        d = fn.ins(f"call i32 @llvm.{kind}.sat.i32.{_suffix(ct)}({ft} {s})")
        return _insert(fn, word, w, place.offset, q.bits, _to_width(fn, d, 32, w, q.signed))
    # float
    b = fn.ins(f"bitcast float {value} to i32")
    if q.digit_bits < 23:  # round to nearest (a carry goes into the exponent)
        b = fn.ins(f"add i32 {b}, {1 << (22 - q.digit_bits)}")
    e = fn.ins(f"and i32 {fn.ins(f'lshr i32 {b}, 23')}, 255")
    digits = fn.ins(f"and i32 {fn.ins(f'lshr i32 {b}, {23 - q.digit_bits}')}, "
                    f"{_mask(q.digit_bits)}")
    if q.signed:
        sign = fn.ins(f"lshr i32 {fn.ins(f'and i32 {b}, -2147483648')}, {31 - q.digit_bits}")
        digits = fn.ins(f"or i32 {digits}, {sign}")
    nz = fn.ins(f"icmp ne i32 {e}, 0")
    off = fn.ins(f"select i1 {nz}, i32 {q.exponent_offset}, i32 0")
    e = fn.ins(f"sub i32 {e}, {off}")
    neg = fn.ins(f"icmp slt i32 {e}, 0")
    e = fn.ins(f"select i1 {neg}, i32 0, i32 {e}")  # below the smallest exponent: zero
    ez = fn.ins(f"icmp eq i32 {e}, 0")
    digits = fn.ins(f"select i1 {ez}, i32 0, i32 {digits}")  # flush to zero
    word = _insert(fn, word, w, place.exp_offset, q.exp, _to_width(fn, e, 32, w, False))
    return _insert(fn, word, w, place.offset, q.bits, _to_width(fn, digits, 32, w, False))


def _fty(t: DType) -> str:
    return {16: "half", 32: "float", 64: "double"}[t.bits]


def _suffix(t: DType) -> str:
    return {16: "f16", 32: "f32", 64: "f64"}[t.bits]


def _fconst(value: float, t: DType) -> str:
    """A float constant of type ``t`` as LLVM writes it: the bits of the double that holds
    the value rounded to ``t`` (half constants are their own bits)."""
    if t.bits == 16:
        return f"0xH{struct.unpack('<H', struct.pack('<e', value))[0]:04X}"
    if t.bits == 32:
        value = struct.unpack("<f", struct.pack("<f", value))[0]
    return f"0x{struct.unpack('<Q', struct.pack('<d', value))[0]:016X}"


def intrinsics(places: list[QuantPlace]) -> list[str]:
    """The declarations the encodings of ``places`` call."""
    out = set()
    for p in places:
        if p.qtype.kind == "fixed":
            ct = p.qtype.compute
            for k in (("fptosi", "fptoui")):
                out.add(f"declare i32 @llvm.{k}.sat.i32.{_suffix(ct)}({_fty(ct)})")
    return sorted(out)


def update(fn, place: QuantPlace, p: str, serial: bool,
           new_word: Callable[[str], str]) -> str:
    """Replace the word at ``p`` by ``new_word(old)``: a plain read-modify-write in serial code,
    else a compare-and-swap loop (other threads may write other fields of the word). Returns
    the old word (the one the update replaced)."""
    w = place.word_bits
    t = f"i{w}"
    if serial:
        old = fn.ins(f"load {t}, ptr {p}")
        fn.void(f"store {t} {new_word(old)}, ptr {p}")
        return old
    seen = fn.alloca(t)
    fn.void(f"store {t} {fn.ins(f'load atomic {t}, ptr {p} monotonic, align {w // 8}')}, "
            f"ptr {seen}")
    loop, done = fn.label("qcas"), fn.label("qcas_done")
    fn.term(f"br label %{loop}")
    fn.start_block(loop)
    cur = fn.ins(f"load {t}, ptr {seen}")
    pair = fn.ins(f"cmpxchg ptr {p}, {t} {cur}, {t} {new_word(cur)} monotonic monotonic")
    fn.void(f"store {t} {fn.ins(f'extractvalue {{ {t}, i1 }} {pair}, 0')}, ptr {seen}")
    ok = fn.ins(f"extractvalue {{ {t}, i1 }} {pair}, 1")
    fn.term(f"br i1 {ok}, label %{done}, label %{loop}")
    fn.start_block(done)
    return cur


__all__ = ["decode", "encode", "intrinsics", "update"]
