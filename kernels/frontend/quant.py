"""Quantized types (``ti.types.quant.int/fixed/float``), ``ti.BitpackedFields`` and the words
of ``SNode.quant_array``.

A quantized field computes at an ordinary type (its *compute* type: i32 for quant ints, f32
for fixed and floating point) and is stored in a few bits of a physical word that it shares
with the other fields of its ``BitpackedFields`` (floats may share one exponent:
``place(..., shared_exponent=True)``), or, in a ``quant_array``, with its neighbouring elements
(:mod:`difftape.quant_types` gives the encodings). In kernels its buffer carries a
:class:`~difftape.quant_types.QuantPlace`: loads decode, stores encode into the word, atomics
are compare-and-swap loops on it (``codegen/quant.py``). A vector/matrix field of quantized
types is a matrix of scalar quantized fields (``frontend/field.py``'s ``QuantMatrixField``).

Python scope reads and writes a field's values through :class:`QuantStorage`, the field's
:class:`~difftape.runtime.storage.Storage`: a decoded copy of the values, made by a small
kernel that loads every element; writes go to that copy and are encoded, element by element,
by a kernel that stores the changed ones, at the next access to a field of the same word or
launch of a kernel that uses one. So Python scope rounds, wraps and flushes exactly as kernels
do: there is one implementation of the encodings.

Not supported, refused by name: derivatives (``.grad``/``.dual``) of quantized fields, and
``BitpackedFields`` under ``arch=ti.remote``.
"""

from __future__ import annotations

import itertools
import numbers
from types import SimpleNamespace

import numpy as np

from .. import types as T
from ..errors import CompileError, DifftapeError
from ..quant_types import QuantPlace, QuantType, quant_fixed, quant_float, quant_int
from ..runtime import program
from ..runtime.storage import Storage
from .ops import resolve_dtype


class QuantizedTypesUnsupported(DifftapeError, NotImplementedError):
    """A quantized-type feature difftape does not implement was asked for."""


class QuantTypeError(DifftapeError, RuntimeError):
    """Quantized types combined in a way Taichi refuses (a matrix of several compute types)."""


def refuse(what: str) -> QuantizedTypesUnsupported:
    """The error for one unsupported quantized-type feature."""
    return QuantizedTypesUnsupported(
        f"{what} is not supported by difftape (quantized fields are computed with, not "
        "differentiated); use an ordinary type (ti.i8..i64, ti.u8..u64, ti.f16/f32/f64) for "
        "what needs it")


def _compute(compute, default: str) -> T.DType:
    if compute is None:
        return resolve_dtype(int if default == "ip" else float)
    return resolve_dtype(compute)


def _int(bits, signed=True, compute=None) -> QuantType:
    """``ti.types.quant.int(bits, signed=True, compute=None)``: a ``bits``-bit integer (wraps
    around at ``bits`` bits), computed as ``compute`` (default: the default int type, its
    unsigned version for unsigned types, as in Taichi)."""
    bits = _bits(bits, 64, "int")
    ct = _compute(compute, "ip")
    if not ct.is_int:
        raise DifftapeError(f"ti.types.quant.int: the compute type must be an integer type, got "
                            f"{ct}")
    if not signed and compute is None:
        ct = T.by_name(f"u{ct.bits}")
    return quant_int(bits, bool(signed), ct)


def _fixed(bits, signed=True, max_value=1.0, compute=None, scale=None) -> QuantType:
    """``ti.types.quant.fixed(bits, signed=True, max_value=1.0, compute=None, scale=None)``:
    ``bits``-bit fixed point, the value ``digits * scale`` (``scale`` defaults to
    ``max_value / 2**(bits - 1)`` signed, ``max_value / 2**bits`` unsigned)."""
    bits = _bits(bits, 32, "fixed")
    ct = _compute(compute, "fp")
    if not ct.is_float:
        raise DifftapeError(f"ti.types.quant.fixed: the compute type must be a float type, got "
                            f"{ct}")
    if scale is None:
        scale = max_value / 2 ** (bits - 1) if signed else max_value / 2 ** bits
    if not scale > 0:
        raise DifftapeError(f"ti.types.quant.fixed: the scale must be positive, got {scale}")
    return quant_fixed(bits, bool(signed), float(scale), ct)


def _float(exp, frac, signed=True, compute=None) -> QuantType:
    """``ti.types.quant.float(exp, frac, signed=True, compute=None)``: ``exp`` exponent bits
    (at most 8) and ``frac`` digit bits (the sign bit among them when signed; at most 23
    fraction bits), computed as f32."""
    exp = _bits(exp, 8, "float exponent")
    frac = _bits(frac, 24, "float fraction")
    ct = _compute(compute, "fp")
    if ct != T.f32:
        raise DifftapeError(f"ti.types.quant.float computes in f32 only (as in Taichi), got "
                            f"compute={ct}")
    if frac - bool(signed) > 23:
        raise DifftapeError(f"ti.types.quant.float(frac={frac}, signed={signed}): at most 23 "
                            "fraction bits (f32's) besides the sign bit")
    return quant_float(exp, frac, bool(signed), ct)


def _bits(bits, most: int, what: str) -> int:
    if not isinstance(bits, numbers.Integral) or not 1 <= bits <= most:
        raise DifftapeError(f"ti.types.quant.{what}: bits must be an integer in 1..{most}, "
                            f"got {bits!r}")
    return int(bits)


#: ``ti.types.quant``
quant = SimpleNamespace(int=_int, fixed=_fixed, float=_float)


_words = itertools.count(1)


class BitpackedFields:
    """``ti.BitpackedFields(max_num_bits)``: quantized fields packed into one physical word of
    ``max_num_bits`` bits (8, 16, 32 or 64) per element; ``place(x, y, ...)`` adds fields, and
    placing the BitpackedFields in an SNode gives them its shape."""

    def __init__(self, max_num_bits: int) -> None:
        if max_num_bits not in (8, 16, 32, 64):
            raise DifftapeError(f"ti.BitpackedFields(max_num_bits={max_num_bits!r}): the "
                                "physical word has 8, 16, 32 or 64 bits")
        self.max_num_bits = int(max_num_bits)
        self.members: list = []  # (field, QuantPlace)
        self.used = 0
        self.physical: Storage | None = None
        self.pending: list[QuantStorage] = []
        self.storages: list[QuantStorage] = []
        self.snode = None
        self.word = next(_words)

    def place(self, *fields, shared_exponent: bool = False) -> None:
        """Add quantized fields to the word, in order, each at the bits after the last (a
        vector/matrix field adds its entries). ``shared_exponent=True``: the quant floats
        among them share one exponent (Taichi's layout: the exponent where the first float
        comes, then each field's digits)."""
        if self.physical is not None:
            raise DifftapeError("BitpackedFields.place(): it is already placed in an SNode; "
                                "place every field before placing the BitpackedFields")
        members = []
        for f in fields:
            # (a field of a quantized type: field.py imports this module, not the reverse)
            if getattr(f, "quant", None) is None or not hasattr(f, "_place_quant"):
                raise DifftapeError(f"BitpackedFields.place() takes fields of quantized types "
                                    f"(ti.types.quant.*), got {f!r:.60}")
            members += f._quant_members()
        for f in members:
            if f._shape is not None or f._quant_place is not None or \
                    any(f is g for g, _ in self.members) or members.count(f) > 1:
                raise DifftapeError(f"{f._label()} is already placed")
        floats = [f for f in members if f.quant.kind == "float"]
        if shared_exponent:
            if not floats:
                raise DifftapeError("BitpackedFields.place(..., shared_exponent=True): the "
                                    "fields sharing an exponent must be of quant float types "
                                    "(ti.types.quant.float)")
            if any(f.quant.exp != floats[0].quant.exp for f in floats):
                raise DifftapeError("QuantFloatTypes with shared exponents must have exactly "
                                    "the same exponent type: "
                                    f"{', '.join(f'{f._label()} ({f.quant!r})' for f in floats)}")
            if len(members) <= 1:
                raise CompileError("At least 2 fields need to be placed when "
                                   "shared_exponent=True")
        shared = shared_exponent and len(floats) > 1
        used = self.used
        offsets = []  # (field, digits offset, exponent offset)
        exp_at = -1
        for f in members:
            q = f.quant
            if q.kind == "float" and (exp_at < 0 or not shared):
                exp_at = used
                used += q.exp
            offsets.append((f, used, exp_at if q.kind == "float" else -1))
            used += q.bits
        if used > self.max_num_bits:
            raise DifftapeError(f"BitpackedFields(max_num_bits={self.max_num_bits}): "
                                f"{', '.join(f._label() for f in members)} "
                                f"({used - self.used} bits) do not fit beside {self.used} bits "
                                "already placed; use a larger max_num_bits or another "
                                "BitpackedFields")
        users = tuple((f.quant, off) for f, off, _ in offsets if f.quant.kind == "float") \
            if shared else ()
        for f, off, exp_off in offsets:
            self.members.append((f, QuantPlace(f.quant, self.max_num_bits, off, exp_off,
                                               users if f.quant.kind == "float" else (),
                                               self.word)))
        self.used = used

    def _place_in(self, snode, shape: tuple[int, ...], offset: tuple[int, ...],
                  words: tuple[int, ...] | None = None) -> None:
        """``snode.place(self)``: the physical words (``words``: their shape, where it is not
        the fields' own, in a quant_array), and each field's storage over them."""
        if self.physical is not None:
            raise DifftapeError("this BitpackedFields is already placed")
        if not self.members:
            raise DifftapeError("BitpackedFields placed in an SNode holds no field: call "
                                "place(x, ...) on it first")
        prog = program.get()
        if prog.remote is not None:  # the remote protocol has no quantized words
            raise QuantizedTypesUnsupported(
                "quantized fields (ti.BitpackedFields, SNode.quant_array) are not supported "
                "under arch=ti.remote (the service stores fields of ordinary types only); use "
                "an ordinary type (ti.i8..i64, ti.u8..u64, ti.f16/f32/f64) or run on ti.cpu")
        self.physical = prog.allocator.storage(shape if words is None else words,
                                               np.dtype(f"u{self.max_num_bits // 8}"))
        self.snode = snode
        for f, place in self.members:
            f._place_quant(snode, shape, offset, place, QuantStorage(self, f))

    # ------------------------------------------------------------------ Python scope
    def flush(self) -> None:
        """Encode the values Python scope wrote (by the writing kernel)."""
        while self.pending:
            s = self.pending.pop(0)
            s._flush()

    def invalidate(self) -> None:
        """The words changed (a launch wrote them): the decoded copies are stale."""
        for s in self.storages:
            s._cache = None


class QuantStorage(Storage):
    """A quantized field's storage (see the module doc): kernels address the physical words
    (``address``); Python scope reads and writes decoded values."""

    __slots__ = ("group", "field", "_cache", "_snap", "home")
    host = False

    def __init__(self, group: BitpackedFields, field) -> None:
        super().__init__(field._shape if field._shape is not None else (),
                         field.dtype.np)
        self.group = group
        self.field = field
        self._cache: np.ndarray | None = None
        self._snap: np.ndarray | None = None
        #: where the decoded values live, when a vector/matrix field's storage holds them
        #: (an entry of its array, see QuantMatrixStorage); None: an array of its own
        self.home: np.ndarray | None = None
        group.storages.append(self)

    @property
    def address(self) -> int:
        return self.group.physical.address

    @property
    def nbytes(self) -> int:
        return self.group.physical.nbytes

    def _values(self) -> np.ndarray:
        if self._cache is None:
            out = np.zeros(self.shape or (1,), self.dtype)
            _kernels()[0](self.field, out)
            if self.home is not None:
                self.home[...] = out.reshape(self.shape)
                self._cache = self.home
            else:
                self._cache = out.reshape(self.shape)
        return self._cache

    def read(self) -> np.ndarray:
        self.group.flush()
        v = self._values().view()
        v.flags.writeable = False
        return v

    def write(self) -> np.ndarray:
        self.group.flush()
        return self._begin_write()

    def _begin_write(self) -> np.ndarray:
        """The decoded values, to be written; encoded at the group's next flush."""
        values = self._values()
        self._snap = values.copy()
        if self not in self.group.pending:
            self.group.pending.append(self)
        return values

    def _flush(self) -> None:
        values, snap = self._cache, self._snap
        self._snap = None
        if values is None or snap is None:
            return
        changed = values != snap
        if values.dtype.kind == "f":
            changed &= ~(np.isnan(values) & np.isnan(snap))
        if changed.any():
            _kernels()[1](self.field, np.ascontiguousarray(values).reshape(self.shape or (1,)),
                          changed.astype(np.int32).reshape(self.shape or (1,)))

    def device_written(self) -> None:
        self.group.physical.device_written()
        self.group.invalidate()

    def zero(self) -> None:
        self.write()[...] = 0

    def copy_from(self, other: Storage, casting: str = "unsafe") -> None:
        np.copyto(self.write(), other.read(), casting=casting)


class QuantMatrixStorage(Storage):
    """A vector/matrix field of quantized types, for Python scope: its entries are scalar
    quantized fields (each in the word of its own ``BitpackedFields``), whose decoded values
    live in one array here (each entry's storage keeps its values in its slice of it), so
    ``m[i] = [...]`` writes them all and each is encoded at the next access of its word.
    Kernels never address it: they access the entries' fields."""

    __slots__ = ("entries", "_array")
    host = False

    def __init__(self, shape: tuple[int, ...], element_shape: tuple[int, ...], dtype,
                 entries: list[QuantStorage]) -> None:
        super().__init__(shape + element_shape, dtype)
        self.entries = entries
        self._array = np.zeros(self.shape, self.dtype)
        flat = self._array.reshape(shape + (-1,))
        for k, s in enumerate(entries):
            s.home = flat[..., k]
            s._cache = None

    @property
    def address(self) -> int:
        raise DifftapeError("a vector/matrix field of quantized types has no memory of its own "
                            "(each entry is in its BitpackedFields' words)")

    def _load(self) -> None:
        for s in self.entries:
            s.group.flush()
        for s in self.entries:
            s._values()

    def read(self) -> np.ndarray:
        self._load()
        v = self._array.view()
        v.flags.writeable = False
        return v

    def write(self) -> np.ndarray:
        self._load()
        for s in self.entries:
            s._begin_write()
        return self._array

    def zero(self) -> None:
        self.write()[...] = 0

    def copy_from(self, other: Storage, casting: str = "unsafe") -> None:
        np.copyto(self.write(), other.read(), casting=casting)


_KERNELS: tuple | None = None


def use_kernels(read, write) -> None:
    """Give :class:`QuantStorage` its reading and writing kernels (``frontend/quant_kernels.py``;
    the API registers them: defining kernels needs the whole frontend, which imports this)."""
    global _KERNELS
    _KERNELS = (read, write)


def _kernels() -> tuple:
    if _KERNELS is None:  # pragma: no cover - the API registers them at import
        raise DifftapeError("quantized fields need the difftape API imported")
    return _KERNELS
