"""Scalar data types and Taichi's promotion rules.

A :class:`DType` is an immutable value shared by the frontend, the IR, the code generators and
the wire format (by name), so one object describes a type everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

#: The smallest normal f32 and f64 numbers (``DType.flush``).
_TINY = {32: float(np.finfo(np.float32).tiny), 64: float(np.finfo(np.float64).tiny)}


@dataclass(frozen=True)
class DType:
    """A scalar type: ``f32``, ``f64``, ``i8``..``i64``, ``u1`` (a boolean: stored as NumPy
    ``bool``, converted by "is nonzero"), ``u8``..``u64``."""

    name: str
    kind: str  # "f" float, "i" signed int, "u" unsigned int
    bits: int

    @property
    def is_float(self) -> bool:
        return self.kind == "f"

    @property
    def is_int(self) -> bool:
        return self.kind in "iu"

    @property
    def is_signed(self) -> bool:
        return self.kind in "fi"

    @property
    def np(self) -> np.dtype:
        if self.bits == 1:
            return np.dtype(np.bool_)
        return np.dtype(f"{'f' if self.is_float else self.kind}{self.bits // 8}")

    def wrap(self, value):
        """``value`` as this type holds it: floats rounded to the type's precision, integers
        wrapped around (two's complement). The one definition of integer wrap-around, shared by
        kernel constants, constant folding and the reference interpreter."""
        if self.is_float:
            with np.errstate(over="ignore"):
                return float(self.np.type(value))
        v = int(value) & ((1 << self.bits) - 1)
        if self.is_signed and v >= 1 << (self.bits - 1):
            v -= 1 << self.bits
        return v

    def flush(self, value: float) -> float:
        """A float as kernels compute it: an f32/f64 value below the smallest normal number
        is a zero of its sign (the flush-to-zero mode kernels run in, as Taichi's CPU backend;
        f16 is converted without it, so its subnormals stay)."""
        if self.bits >= 32 and value != 0.0 and abs(value) < _TINY[self.bits]:
            return math.copysign(0.0, value)
        return value

    def __repr__(self) -> str:
        return self.name

    def to_string(self) -> str:
        """The type's name (Taichi's ``DataType.to_string()``: ``str(ti.f32)`` is the same)."""
        return self.name

    def __call__(self, *args, **kwargs):
        """``ti.f32(x)`` casts, as in Taichi (works in kernels and in Python scope). The cast
        is the frontend's, registered with :func:`set_caster`: this module is the ground floor
        and imports nothing of ours. The caster also checks that exactly one value came."""
        return _caster(self, *args, **kwargs)


f16 = DType("f16", "f", 16)
f32 = DType("f32", "f", 32)
f64 = DType("f64", "f", 64)
i8 = DType("i8", "i", 8)
i16 = DType("i16", "i", 16)
i32 = DType("i32", "i", 32)
i64 = DType("i64", "i", 64)
u1 = DType("u1", "u", 1)
u8 = DType("u8", "u", 8)
u16 = DType("u16", "u", 16)
u32 = DType("u32", "u", 32)
u64 = DType("u64", "u", 64)

ALL = {t.name: t for t in (f16, f32, f64, i8, i16, i32, i64, u1, u8, u16, u32, u64)}
float16, float32, float64 = f16, f32, f64
int8, int16, int32, int64 = i8, i16, i32, i64
uint8, uint16, uint32, uint64 = u8, u16, u32, u64

#: ``ti.types.primitive_types``: Taichi's lists of scalar types (Python's float/int/bool
#: included, as Taichi lists them; difftape has no 1-bit u1).
primitive_types = SimpleNamespace(
    real_types=[f16, f32, f64, float], integer_types=[i8, i16, i32, i64, u8, u16, u32, u64, int,
                                                      bool])
primitive_types.all_types = primitive_types.real_types + primitive_types.integer_types
primitive_types.__dict__.update(ALL)


def by_name(name: str) -> DType:
    try:
        return ALL[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(ALL)}") from None


def from_numpy(dt: np.dtype) -> DType:
    dt = np.dtype(dt)
    if dt.kind == "b":
        return u1
    if dt.kind not in "fiu":
        raise TypeError(f"difftape arrays hold numbers; got numpy dtype {dt}")
    return by_name(f"{dt.kind}{dt.itemsize * 8}")


def promote(a: DType, b: DType) -> DType:
    """Taichi's binary promotion: floats beat ints, wider beats narrower, unsigned beats signed
    at equal width (``u32 + i32`` is ``u32``, as in C)."""
    if a == b:
        return a
    if a.is_float or b.is_float:
        if a.is_float and b.is_float:
            return a if a.bits >= b.bits else b
        return a if a.is_float else b
    if a.bits != b.bits:
        return a if a.bits > b.bits else b
    return b if a.is_signed else a


def set_caster(cast: Callable[..., object]) -> None:
    """Registration point for ``ti.f32(x)``: the frontend passes its ``construct`` (the cast
    that also works inside kernels) when it loads."""
    global _caster
    _caster = cast


def _no_caster(dtype: DType, *args, **kwargs):
    raise RuntimeError(f"{dtype}(...) needs the frontend: import difftape")


_caster: Callable[..., object] = _no_caster


def provide(**names: object) -> None:
    """Registration point for the ``ti.types`` names defined above this module
    (``vector``, ``matrix``, ``struct``, ``ndarray``, ``template``, ``is_signed``, ...: the
    frontend's). The package's ``__init__`` provides them when it loads, so the namespace is
    complete for any user of ``difftape.types`` while this module imports nothing of ours."""
    globals().update(names)
