"""Loads, stores and atomics of quantized fields, as LLVM IR: the one implementation of the
encodings of :mod:`difftape.quant_types` (Python-scope reads and writes run kernels, so they
come here too).

A quantized field's storage holds physical words shared with the other fields of its
``ti.BitpackedFields`` (or, in a ``quant_array``, with its neighbouring elements). A load reads
the word and decodes the field's bits to its compute type. A store encodes the value into the
word without touching the other bits: a compare-and-swap loop on the word (threads may store
other fields of the same word at the same time), a plain read-modify-write in serial code.
Stores of several fields of one word that the lowering fuses (Taichi's bit-struct store
fusion, see ``Lowering._fused_quant_stores``) are one such update. An atomic is the same loop
with the old value decoded and combined with the operand before it is encoded, so
``x[None] += 4`` on a 13-bit integer wraps around at 13 bits, as in Taichi.

Shared exponents: a store of a field that shares its exponent re-encodes every field of the
exponent (those not stored keep their value, decoded from the word in the same update): the
exponent is the largest of their f32 exponents, and each field's digits are its f32 digits
(the leading one included) shifted right by the difference, rounded. Taichi's arithmetic,
step for step, so the values read back are Taichi's bit for bit.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from ..quant_types import QuantPlace
from ..types import DType

#: a bit offset: a constant, or an SSA value of the word's type (elements of a quant_array)
Offset = int | str


def _mask(bits: int) -> int:
    return (1 << bits) - 1


def to_width(fn, v: str, src: int, dst: int, signed: bool) -> str:
    """An integer of ``src`` bits as ``dst`` bits (sign- or zero-extended, or truncated)."""
    if src == dst:
        return v
    if src > dst:
        return fn.ins(f"trunc i{src} {v} to i{dst}")
    return fn.ins(f"{'sext' if signed else 'zext'} i{src} {v} to i{dst}")


def _shl(fn, t: str, v: str, amount: Offset) -> str:
    return v if amount == 0 else fn.ins(f"shl {t} {v}, {amount}")


def _field(fn, word: str, w: int, offset: Offset, bits: int, signed: bool) -> str:
    """The ``bits`` bits at ``offset`` of a ``w``-bit word, sign- or zero-extended to ``w``."""
    t = f"i{w}"
    left = w - offset - bits if isinstance(offset, int) else \
        fn.ins(f"sub {t} {w - bits}, {offset}")
    v = _shl(fn, t, word, left)
    right = w - bits
    if right:
        v = fn.ins(f"{'ashr' if signed else 'lshr'} {t} {v}, {right}")
    return v


def _insert(fn, word: str, w: int, offset: Offset, bits: int, value: str) -> str:
    """``word`` with its ``bits`` bits at ``offset`` replaced by the low bits of ``value``
    (both ``w`` bits wide)."""
    t = f"i{w}"
    m = _mask(bits)
    v = _shl(fn, t, fn.ins(f"and {t} {value}, {_signed_const(m, w)}"), offset)
    if isinstance(offset, int):
        keep = _signed_const(_mask(w) & ~(m << offset), w)
    else:
        keep = fn.ins(f"xor {t} {fn.ins(f'shl {t} {_signed_const(m, w)}, {offset}')}, -1")
    kept = fn.ins(f"and {t} {word}, {keep}")
    return fn.ins(f"or {t} {kept}, {v}")


def _signed_const(value: int, w: int) -> int:
    """An unsigned ``w``-bit constant as LLVM writes it (two's complement)."""
    return value - (1 << w) if value >= 1 << (w - 1) else value


def _call(fn, name: str, *args: str) -> str:
    return fn.ins(f"call i32 @llvm.{name}.i32({', '.join(f'i32 {a}' for a in args)})")


def decode(fn, place: QuantPlace, word: str, offset: Offset | None = None) -> str:
    """The value of the field in ``word``, as its compute type (``offset``: the digits' bit
    offset when it is not the place's, for an element of a quant_array)."""
    q, w = place.qtype, place.word_bits
    ct = q.compute
    at = place.offset if offset is None else offset
    if q.kind == "int":
        d = _field(fn, word, w, at, q.bits, q.signed)
        return to_width(fn, d, w, ct.bits, q.signed)
    if q.kind == "fixed":
        d = _field(fn, word, w, at, q.bits, q.signed)
        f = fn.ins(f"{'sitofp' if q.signed else 'uitofp'} i{w} {d} to {_fty(ct)}")
        return fn.ins(f"fmul {_fty(ct)} {f}, {_fconst(q.scale, ct)}")
    # float: f32 bits from the digits and the exponent
    d = to_width(fn, _field(fn, word, w, at, q.bits, False), w, 32, False)
    e = to_width(fn, _field(fn, word, w, place.exp_offset, q.exp, False), w, 32, False)
    off = str(q.exponent_offset)
    if q.exp < 8:  # a zero exponent stays zero (the value is zero)
        nz = fn.ins(f"icmp ne i32 {e}, 0")
        off = fn.ins(f"select i1 {nz}, i32 {q.exponent_offset}, i32 0")
    if place.shared:
        return _decode_shared(fn, place, d, e, off)
    d = fn.ins(f"shl i32 {d}, {23 - q.digit_bits}")
    frac = fn.ins(f"and i32 {d}, {_mask(23)}")
    be = fn.ins(f"add i32 {e}, {off}")
    bits = fn.ins(f"or i32 {fn.ins(f'shl i32 {be}, 23')}, {frac}")
    if q.signed:
        sign = fn.ins(f"shl i32 {fn.ins(f'and i32 {d}, {1 << 23}')}, 8")
        bits = fn.ins(f"or i32 {bits}, {sign}")
    return fn.ins(f"bitcast i32 {bits} to float")


def _decode_shared(fn, place: QuantPlace, d: str, e: str, off: str) -> str:
    """A float whose exponent is shared: its digits are not normalized (the largest field of
    the exponent has the leading one at the top, the others fewer), so the leading one is
    found (ctlz) and the exponent lowered by the shift that normalizes the digits."""
    q = place.qtype
    db = q.digit_bits
    digits, sign = d, None
    if q.signed:
        sb = fn.ins(f"and i32 {d}, {1 << db}")
        digits = fn.ins(f"xor i32 {d}, {sb}")
        sign = fn.ins(f"shl i32 {sb}, {31 - db}")
        digits = fn.ins(f"shl i32 {digits}, 1")
    nlz = fn.ins(f"call i32 @llvm.ctlz.i32(i32 {digits}, i1 false)")
    extra = fn.ins(f"sub i32 {31 - db}, {nlz}")
    off = fn.ins(f"add i32 {off}, {extra}")
    if not q.signed:
        off = fn.ins(f"add i32 {off}, 1")
    digits = fn.ins(f"shl i32 {digits}, {fn.ins(f'sub i32 {23 - db}, {extra}')}")
    frac = fn.ins(f"and i32 {digits}, {_mask(23)}")
    be = fn.ins(f"add i32 {e}, {off}")
    bits = fn.ins(f"or i32 {fn.ins(f'shl i32 {be}, 23')}, {frac}")
    zero = fn.ins(f"or i1 {fn.ins(f'icmp eq i32 {e}, 0')}, {fn.ins(f'icmp eq i32 {d}, 0')}")
    bits = fn.ins(f"select i1 {zero}, i32 0, i32 {bits}")
    if sign is not None:
        bits = fn.ins(f"or i32 {bits}, {sign}")
    return fn.ins(f"bitcast i32 {bits} to float")


def encode(fn, place: QuantPlace, word: str, value: str, offset: Offset | None = None) -> str:
    """``word`` with the field's bits set to encode ``value`` (of its compute type)."""
    return encode_many(fn, word, [(place, value)], offset)


def encode_many(fn, word: str, stores: list[tuple[QuantPlace, str]],
                offset: Offset | None = None) -> str:
    """``word`` with each ``(place, value)`` of ``stores`` (fields of the word) encoded: one
    store of them all, as Taichi's fused bit-struct store. The fields that share an exponent
    with a stored one are re-encoded with it, from their values in ``word``."""
    shared: dict[int, dict[int, str]] = {}  # exponent offset -> {digits offset: value}
    for place, value in stores:
        if place.shared:
            shared.setdefault(place.exp_offset, {})[place.offset] = value
        else:
            word = _encode_one(fn, place, word, value, offset)
    for place, _ in stores:
        if place.shared and place.exp_offset in shared:
            word = _encode_shared(fn, place, word, shared.pop(place.exp_offset))
    return word


def _encode_one(fn, place: QuantPlace, word: str, value: str, offset: Offset | None) -> str:
    q, w = place.qtype, place.word_bits
    ct = q.compute
    at = place.offset if offset is None else offset
    if q.kind == "int":
        return _insert(fn, word, w, at, q.bits, to_width(fn, value, ct.bits, w, q.signed))
    if q.kind == "fixed":
        ft = _fty(ct)
        s = fn.ins(f"fmul {ft} {value}, {_fconst(1.0 / q.scale, ct)}")
        pos = fn.ins(f"fcmp ogt {ft} {s}, {_fconst(0.0, ct)}")
        half = fn.ins(f"select i1 {pos}, {ft} {_fconst(0.5, ct)}, {ft} {_fconst(-0.5, ct)}")
        s = fn.ins(f"fadd {ft} {s}, {half}")
        # (saturating: an out-of-range value is no undefined behaviour; its low bits are kept)
        kind = "fptosi" if q.signed else "fptoui"
        d = fn.ins(f"call i32 @llvm.{kind}.sat.i32.{_suffix(ct)}({ft} {s})")
        return _insert(fn, word, w, at, q.bits, to_width(fn, d, 32, w, q.signed))
    # float
    db = q.digit_bits
    b = fn.ins(f"bitcast float {value} to i32")
    if db < 23:  # round to nearest (a carry goes into the exponent)
        b = fn.ins(f"add i32 {b}, {1 << (22 - db)}")
    e = fn.ins(f"and i32 {fn.ins(f'lshr i32 {b}, 23')}, 255")
    digits = fn.ins(f"and i32 {fn.ins(f'lshr i32 {b}, {23 - db}')}, {_mask(db)}")
    if q.signed:
        sign = fn.ins(f"lshr i32 {fn.ins(f'and i32 {b}, -2147483648')}, {31 - db}")
        digits = fn.ins(f"or i32 {digits}, {sign}")
    nz = fn.ins(f"icmp ne i32 {e}, 0")
    off = fn.ins(f"select i1 {nz}, i32 {q.exponent_offset}, i32 0")
    e = _call(fn, "smax", fn.ins(f"sub i32 {e}, {off}"), "0")  # below the smallest: zero
    ez = fn.ins(f"icmp eq i32 {e}, 0")
    digits = fn.ins(f"select i1 {ez}, i32 0, i32 {digits}")  # flush to zero
    # The exponent, then the digits (Taichi's layout); an exponent too large for its bits
    # spills into the digits, as in Taichi (the field's bits are written as one).
    both = fn.ins(f"or i32 {e}, {fn.ins(f'shl i32 {digits}, {q.exp}')}")
    both_bits = q.exp + q.bits
    return _insert(fn, word, w, place.exp_offset, both_bits, to_width(fn, both, 32, w, False))


def _encode_shared(fn, place: QuantPlace, word: str, stored: dict[int, str]) -> str:
    """``word`` with the exponent ``place`` shares and every field using it re-encoded: the
    values of ``stored`` (by digits offset), the others' decoded from ``word``."""
    w = place.word_bits
    t = f"i{w}"
    users = [QuantPlace(q, w, off, place.exp_offset, place.shared, place.word)
             for q, off in place.shared]
    floats = [stored[u.offset] if u.offset in stored else decode(fn, u, word) for u in users]
    bits = [fn.ins(f"bitcast float {f} to i32") for f in floats]
    exps = [fn.ins(f"and i32 {fn.ins(f'lshr i32 {b}, 23')}, 255") for b in bits]
    top = exps[0]
    for x in exps[1:]:
        top = _call(fn, "umax", top, x)
    q0 = place.qtype
    nz = fn.ins(f"icmp ne i32 {top}, 0")
    off = fn.ins(f"select i1 {nz}, i32 {q0.exponent_offset}, i32 0")
    e = _call(fn, "smax", fn.ins(f"sub i32 {top}, {off}"), "0")
    value = _shl(fn, t, to_width(fn, e, 32, w, False), place.exp_offset)
    mask = _mask(q0.exp) << place.exp_offset
    for u, b, x in zip(users, bits, exps, strict=True):
        q = u.qtype
        rs = 24 - q.digit_bits
        d = fn.ins(f"or i32 {fn.ins(f'and i32 {b}, {_mask(23)}')}, {1 << 23}")
        d = fn.ins(f"lshr i32 {d}, {_call(fn, 'umin', fn.ins(f'sub i32 {top}, {x}'), '31')}")
        d = fn.ins(f"add i32 {d}, {1 << (rs - 1)}")  # round to nearest
        d = fn.ins(f"lshr i32 {_call(fn, 'umin', d, str(_mask(24)))}, {rs}")  # no overflow
        if q.signed:
            sign = fn.ins(f"lshr i32 {fn.ins(f'and i32 {b}, -2147483648')}, {31 - q.digit_bits}")
            d = fn.ins(f"or i32 {d}, {sign}")
        value = fn.ins(f"or {t} {value}, {_shl(fn, t, to_width(fn, d, 32, w, False), u.offset)}")
        mask |= _mask(q.bits) << u.offset
    mask &= _mask(w)
    kept = fn.ins(f"and {t} {word}, {_signed_const(_mask(w) & ~mask, w)}")
    return fn.ins(f"or {t} {kept}, {fn.ins(f'and {t} {value}, {_signed_const(mask, w)}')}")


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
        elif p.qtype.kind == "float":
            out.add("declare i32 @llvm.ctlz.i32(i32, i1)")
            for k in ("smax", "umax", "umin"):
                out.add(f"declare i32 @llvm.{k}.i32(i32, i32)")
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


__all__ = ["Offset", "decode", "encode", "encode_many", "intrinsics", "to_width", "update"]
