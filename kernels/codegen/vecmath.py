"""Sine and cosine of one value together, as LLVM IR: one argument reduction for both.

Why: a derivative of ``sin`` needs ``cos`` of the same value (and the reverse), so forward and
reverse mode of any kernel with trigonometry compute both. As two libmvec calls that is two
argument reductions and two calls per vector; here ``sin`` and ``cos`` of a value lower to one
call of ``dt_sincosf`` (f64: ``dt_sincos``; LLVM merges the two calls: the function is pure),
which the loop vectorizer widens to ``dt_sincosf_v<W>`` returning both vectors; after
vectorization it is inlined into the loop. A lone ``sin`` or ``cos`` stays on libmvec, which is
faster for one (so a forward-mode kernel's ``sin(x)`` may differ in the last bit from its
primal kernel's: both are within the accuracy bounds, neither is bit-for-bit libm).

Method (standard, written from the math): ``n = round(x * 2/pi)``; ``r = x - n*pi/2`` in three
FMA steps with pi/2 split into three parts of the working precision (the first step is exact:
both terms are multiples of the ulp of pi/2 once |x| >= 1); polynomials of sin and cos on
|r| <= pi/4 (f32: minimax, fitted by :func:`fit`, approximation error below 0.06 ulp; f64:
Taylor to r^17 and r^16, truncation below 0.02 ulp); the quadrant ``n mod 4`` picks and
negates. Every f32 up to its limit (8192) is within 1.53 ulp of the float64 truth (checked
exhaustively by ``pytest -m bench tests/core/test_vecmath.py``; libmvec's bound is 4 ulp);
f64 is checked on random and near-multiple-of-pi/2 arguments against long double. Lanes
beyond the limit are recomputed with libm behind a branch taken only when such a lane
exists. The scalar ``dt_sincos[f]`` (loop remainders, code the vectorizer leaves scalar) runs
the vector code on one lane, so an element's result does not depend on where in a loop it
falls.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from decimal import Decimal, getcontext
from math import factorial

# pi to 50 decimals: enough for three f64 parts of pi/2 (about 160 bits).
_PI = "3.14159265358979323846264338327950288419716939937510"


@dataclass(frozen=True)
class _Type:
    ty: str  # LLVM scalar type
    ity: str  # integer of the same width
    bits: int
    mantissa: int  # stored fraction bits
    limit: float  # |x| beyond which a lane is recomputed by libm
    sin: tuple[float, ...]  # sin r = r + r z (sin[0] + sin[1] z + ...), z = r^2
    cos: tuple[float, ...]  # cos r = 1 + z (cos[0] + cos[1] z + ...)

    def round(self, v: float | Decimal) -> float:
        if self.bits == 64:
            return float(v)
        return struct.unpack("f", struct.pack("f", float(v)))[0]

    def lit(self, v: float | Decimal) -> str:
        """An LLVM literal: hex of the double (which must be exactly of this type)."""
        return f"0x{struct.unpack('<Q', struct.pack('<d', self.round(v)))[0]:016X}"

    def pio2_parts(self) -> tuple[float, float, float]:
        getcontext().prec = 80
        rest = Decimal(_PI) / 2
        parts = []
        for _ in range(3):
            p = self.round(rest)
            parts.append(p)
            rest -= Decimal(p)
        return parts[0], parts[1], parts[2]


#: f32: weighted-minimax fits from :func:`fit` (``python -m difftape.codegen.vecmath``),
#: relative error 2^-28 (sin) and 2^-34 (cos) before rounding the coefficients to f32.
F32 = _Type("float", "i32", 32, 23, 8192.0,
            sin=(-0.16666654573413042, 0.008332158420891099, -0.00019514958603705519),
            cos=(-0.49999999693236324, 0.041666620216513885, -0.0013886677192034881,
                 2.4383147015576145e-05))
#: f64: Taylor coefficients (truncation below 0.02 ulp on |r| <= pi/4).
F64 = _Type("double", "i64", 64, 52, 65536.0,
            sin=tuple((-1) ** k / factorial(2 * k + 1) for k in range(1, 9)),
            cos=tuple((-1) ** k / factorial(2 * k) for k in range(1, 9)))
TYPES = {32: F32, 64: F64}


def names(lanes: int, bits: int = 32) -> tuple[str, str]:
    """(scalar, vector) function names."""
    base = "dt_sincosf" if bits == 32 else "dt_sincos"
    return base, f"{base}_v{lanes}"


def _horner(fma, coeffs: tuple[float, ...], z: str, sp, name: str) -> list[str]:
    """Lines computing coeffs[0] + coeffs[1] z + ... into %{name}0."""
    k = len(coeffs) - 1
    lines = [fma(z, sp(coeffs[k]), sp(coeffs[k - 1]), f"%{name}{k - 1}")]
    for j in range(k - 2, -1, -1):
        lines.append(fma(z, f"%{name}{j + 1}", sp(coeffs[j]), f"%{name}{j}"))
    return lines


@functools.cache
def definitions(lanes: int, sin_fn: str, cos_fn: str, vector_attrs: str, scalar_attrs: str,
                bits: int = 32) -> tuple[str, list[str]]:
    """IR of the scalar and the ``lanes``-wide function, and the intrinsics they declare.
    ``sin_fn``/``cos_fn`` are the exact libm functions (declared by the caller) for the rare
    large lanes; the attribute references must make both functions pure, the scalar one
    ``noinline`` (inlined, its vector code would stop the loop vectorizer)."""
    T = TYPES[bits]
    scalar, vector = names(lanes, bits)
    t, it = T.ty, T.ity
    v = f"<{lanes} x {t}>"
    vi = f"<{lanes} x {it}>"
    vb = f"<{lanes} x i1>"
    ret = f"{{ {v}, {v} }}"
    sfx = f"v{lanes}f{bits}"

    def sp(x: float) -> str:
        return f"splat ({t} {T.lit(x)})"

    def fma(a: str, b: str, c: str, out: str) -> str:
        return f"  {out} = call {v} @llvm.fma.{sfx}({v} {a}, {v} {b}, {v} {c})"

    p1, p2, p3 = T.pio2_parts()
    # Round-to-nearest by the 1.5 * 2^mantissa shifter: the low bits of the sum are n's (two's
    # complement) bits, with no float -> int conversion (and no poison for NaN lanes).
    shifter = 1.5 * 2.0 ** T.mantissa
    sign = bits - 2  # (n & 2) << sign lands on the sign bit
    body = [
        f"define internal {ret} @{vector}({v} %x) {vector_attrs} {{",
        "entry:",
        f"  %t = fmul {v} %x, {sp(0.6366197723675814)}",
        f"  %ts = fadd {v} %t, {sp(shifter)}",
        f"  %n = fsub {v} %ts, {sp(shifter)}",
        f"  %nn = fneg {v} %n",
        fma("%nn", sp(p1), "%x", "%r1"),
        fma("%nn", sp(p2), "%r1", "%r2"),
        fma("%nn", sp(p3), "%r2", "%r3"),
        f"  %z = fmul {v} %r3, %r3",
        *_horner(fma, T.sin, "%z", sp, "s"),
        f"  %rz = fmul {v} %r3, %z",
        fma("%rz", "%s0", "%r3", "%s"),
        *_horner(fma, T.cos, "%z", sp, "c"),
        fma("%z", "%c0", sp(1.0), "%c"),
        f"  %q = bitcast {v} %ts to {vi}",
        f"  %odd = and {vi} %q, splat ({it} 1)",
        f"  %swap = icmp ne {vi} %odd, zeroinitializer",
        f"  %sv = select {vb} %swap, {v} %c, {v} %s",
        f"  %cv = select {vb} %swap, {v} %s, {v} %c",
        # Signs by integer xor: bit 1 of n (sin) and of n + 1 (cos) moved to the sign bit.
        f"  %q2 = and {vi} %q, splat ({it} 2)",
        f"  %sbit = shl {vi} %q2, splat ({it} {sign})",
        f"  %q1 = add {vi} %q, splat ({it} 1)",
        f"  %q12 = and {vi} %q1, splat ({it} 2)",
        f"  %cbit = shl {vi} %q12, splat ({it} {sign})",
        f"  %svi = bitcast {v} %sv to {vi}",
        f"  %cvi = bitcast {v} %cv to {vi}",
        f"  %S0i = xor {vi} %svi, %sbit",
        f"  %Ci = xor {vi} %cvi, %cbit",
        f"  %S0 = bitcast {vi} %S0i to {v}",
        f"  %C = bitcast {vi} %Ci to {v}",
        # sin(+-0) = +-0 (the reduction's zero terms may flip the sign of a zero)
        f"  %xz = fcmp oeq {v} %x, zeroinitializer",
        f"  %S = select {vb} %xz, {v} %x, {v} %S0",
        f"  %ax = call {v} @llvm.fabs.{sfx}({v} %x)",
        f"  %big = fcmp ogt {v} %ax, {sp(T.limit)}",
        f"  %any = call i1 @llvm.vector.reduce.or.v{lanes}i1({vb} %big)",
        "  br i1 %any, label %slow, label %done",
        "slow:",
        f"  %fixed = call {ret} @{vector}_exact({v} %x, {v} %S, {v} %C, {vb} %big)",
        f"  %Sf = extractvalue {ret} %fixed, 0",
        f"  %Cf = extractvalue {ret} %fixed, 1",
        "  br label %done",
        "done:",
        f"  %So = phi {v} [%S, %entry], [%Sf, %slow]",
        f"  %Co = phi {v} [%C, %entry], [%Cf, %slow]",
        f"  %o1 = insertvalue {ret} poison, {v} %So, 0",
        f"  %o2 = insertvalue {ret} %o1, {v} %Co, 1",
        f"  ret {ret} %o2",
        "}",
        # The rare lanes, out of line: a call inside the vector loop only on this cold path.
        f"define internal {ret} @{vector}_exact({v} %x, {v} %S, {v} %C, {vb} %big) "
        f"{scalar_attrs} {{",
        "entry:",
        "  br label %lane",
        "lane:",
        "  %k = phi i32 [0, %entry], [%k1, %next]",
        f"  %Sk = phi {v} [%S, %entry], [%S2, %next]",
        f"  %Ck = phi {v} [%C, %entry], [%C2, %next]",
        f"  %bk = extractelement {vb} %big, i32 %k",
        "  br i1 %bk, label %exact, label %next",
        "exact:",
        f"  %xk = extractelement {v} %x, i32 %k",
        f"  %sx = call {t} @{sin_fn}({t} %xk)",
        f"  %cx = call {t} @{cos_fn}({t} %xk)",
        f"  %Se = insertelement {v} %Sk, {t} %sx, i32 %k",
        f"  %Ce = insertelement {v} %Ck, {t} %cx, i32 %k",
        "  br label %next",
        "next:",
        f"  %S2 = phi {v} [%Sk, %lane], [%Se, %exact]",
        f"  %C2 = phi {v} [%Ck, %lane], [%Ce, %exact]",
        "  %k1 = add i32 %k, 1",
        f"  %more = icmp ult i32 %k1, {lanes}",
        "  br i1 %more, label %lane, label %out",
        "out:",
        f"  %o1 = insertvalue {ret} poison, {v} %S2, 0",
        f"  %o2 = insertvalue {ret} %o1, {v} %C2, 1",
        f"  ret {ret} %o2",
        "}",
        # One lane of the vector code: an element's result does not depend on its position.
        f"define internal {{ {t}, {t} }} @{scalar}({t} %x) {scalar_attrs} {{",
        f"  %xv = insertelement {v} zeroinitializer, {t} %x, i32 0",
        f"  %r = call {ret} @{vector}({v} %xv)",
        f"  %s = extractvalue {ret} %r, 0",
        f"  %c = extractvalue {ret} %r, 1",
        f"  %s0 = extractelement {v} %s, i32 0",
        f"  %c0 = extractelement {v} %c, i32 0",
        f"  %o1 = insertvalue {{ {t}, {t} }} poison, {t} %s0, 0",
        f"  %o2 = insertvalue {{ {t}, {t} }} %o1, {t} %c0, 1",
        f"  ret {{ {t}, {t} }} %o2",
        "}",
    ]
    decls = [f"declare {v} @llvm.fma.{sfx}({v}, {v}, {v})",
             f"declare {v} @llvm.fabs.{sfx}({v})",
             f"declare i1 @llvm.vector.reduce.or.v{lanes}i1({vb})"]
    return "\n".join(body), decls


def fit(deg_sin: int = 3, deg_cos: int = 4) -> tuple[list[float], list[float]]:
    """The polynomial coefficients above, by weighted minimax (Lawson's iteratively
    reweighted least squares) in relative error on [0, pi/4 (1 + 5e-4)]: the margin covers
    the reduced argument's rounding past pi/4."""
    import numpy as np

    r = (np.cos(np.linspace(0, np.pi, 4000)) * 0.5 + 0.5) * (np.pi / 4 * 1.0005)
    r = r[r > 1e-4]
    z = r * r

    def lawson(target, weight, deg: int) -> list[float]:
        a = np.vstack([z ** k for k in range(deg)]).T
        w = np.ones_like(z)
        for _ in range(30):
            sw = np.sqrt(w) * weight
            c, *_ = np.linalg.lstsq(a * sw[:, None], target * sw, rcond=None)
            err = np.abs((a @ c - target) * weight)
            w = w * err / np.sum(w * err)
        return [float(x) for x in c]

    sin_part = lawson((np.sin(r) / r - 1) / z, r ** 3 / np.sin(r), deg_sin)
    cos_part = lawson((np.cos(r) - 1) / z, z / np.cos(r), deg_cos)
    return sin_part, cos_part


if __name__ == "__main__":
    print(fit())
