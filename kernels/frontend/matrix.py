"""Vectors and matrices, unrolled to scalars at compile time.

A :class:`Matrix` is a small row-major list of entries. In Python scope the entries are
numbers; inside a kernel they are kernel values (or places, for a local matrix variable or a
field element), and every method is plain Python over the entries, so the IR it produces is a
fixed set of scalar statements that LLVM sees through and autodiff differentiates entry by entry.
"""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Callable

import numpy as np

from .. import types as T
from ..errors import KernelIndexError, KernelRuntimeError, KernelSyntaxError, KernelTypeError
from ..ir.passes.bounds import OUT_OF_RANGE
from . import builder as _b
from . import ops
from .values import LocalRef, Ref, Value

#: Field and ndarray constructors (field.py, ndarray.py, which build on matrices) for
#: ``ti.Vector.field`` & co.: those modules register them when they load (:func:`register_storage`).
_storage: dict[str, Callable] = {}


def register_storage(**constructors: Callable) -> None:
    """Registration point for field.py (``make_field``) and ndarray.py (its classes)."""
    _storage.update(constructors)


class Matrix:
    """``ti.Matrix``: an n x m matrix (``ndim == 2``) or, via :class:`Vector`, an n-vector."""

    ndim = 2

    def __init__(self, arr, dt=None) -> None:
        if isinstance(arr, Matrix):
            rows = arr.to_list()
        elif isinstance(arr, np.ndarray):
            rows = arr.tolist()
        else:
            rows = list(arr)
        if rows and isinstance(rows[0], list | tuple | np.ndarray | Matrix):
            rows = [list(r.to_list() if isinstance(r, Matrix) else r) for r in rows]
            n, m = len(rows), len(rows[0])
            if any(len(r) != m for r in rows):
                raise ops._err("ti.Matrix rows must all have the same length")
            entries = [e for r in rows for e in r]
            self._init(entries, n, m, 2, dt)
        else:
            # A flat list: a column vector (Taichi treats ti.Matrix([1, 2]) as a vector).
            self._init(rows, len(rows), 1, 1, dt)

    def _init(self, entries, n, m, ndim, dt=None) -> None:
        if dt is not None:
            entries = [ops.cast(e, dt) for e in entries]
        elif _b.current() is not None:
            entries = _promoted([e.expr() if isinstance(e, Ref) else e for e in entries])
        self.entries = list(entries)
        self.n, self.m, self.ndim = n, m, ndim

    @classmethod
    def _from_entries(cls, entries, n: int, m: int, ndim: int) -> Matrix:
        obj = object.__new__(Vector if ndim == 1 else Matrix)
        obj.entries, obj.n, obj.m, obj.ndim = list(entries), n, m, ndim
        return obj

    # ------------------------------------------------------------------ shape and access
    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        if self.ndim == 1:
            return iter(self.entries)
        return iter(self._row(i) for i in range(self.n))

    def _row(self, i: int) -> Vector:
        return Matrix._from_entries(self.entries[i * self.m:(i + 1) * self.m], self.m, 1, 1)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.n,) if self.ndim == 1 else (self.n, self.m)

    def _checked(self, k, extent: int, axis: str):
        """One index of one axis, checked: a constant out of range is an error at compile time
        (negative constants too inside kernels, as in Taichi; Python scope wraps them like a
        list), a runtime one is checked when the kernel runs with ``debug=True``."""
        bld = _b.current()
        if _static(k):
            k = int(k)
            if 0 <= k < extent:
                return k
            if bld is None and -extent <= k < 0:
                return k + extent
            if bld is not None and -extent <= k < 0:
                raise ops._err(f"negative index {k}{axis} of a {self._shape_text()}: kernels do "
                               f"not wrap negative indices (neither does Taichi); write "
                               f"{k + extent}", KernelIndexError)
            raise ops._err(f"index {k}{axis} out of range for a {self._shape_text()}",
                           KernelIndexError)
        if isinstance(k, Value) and k.dtype.is_float:
            raise ops._err(f"a {self._shape_text()} index must be an integer, got {k.dtype}",
                           KernelTypeError)
        if bld is not None and bld.debug and isinstance(k, Value):
            e = k.expr()
            ok = ops.logical_and(ops.binary("ge", e, 0), ops.binary("lt", e, extent))
            where = bld.loc.where(bld.kernel_name) if bld.loc else ""
            bld.emit("assert", None, (ok.stmt, e.stmt),
                     (OUT_OF_RANGE, "", f"{axis} out of range for a {self._shape_text()}{where}"))
        return k

    def _flat_index(self, index) -> int | Value:
        if not isinstance(index, tuple):
            index = (index,)
        if any(isinstance(k, Matrix) for k in index):
            # A vector among the indices stands for its entries, as for fields (Taichi
            # flattens them): m[I] with I from ti.grouped(ti.ndrange(2, 3)) is m[I[0], I[1]].
            index = tuple(e.expr() if isinstance(e, Ref) else e for k in index
                          for e in (k.entries if isinstance(k, Matrix) else (k,)))
        if self.ndim == 1:
            if len(index) != 1:
                raise ops._err(f"Expected 1 indices, got {len(index)}: a vector takes one "
                               "index", KernelIndexError)
            return self._checked(index[0], self.n, "")
        if len(index) != 2:
            # As Taichi: one index of a matrix is refused rather than read as a row (a matrix
            # entry is m[i, j]); a row is the slice m[i, :].
            raise ops._err(f"Expected 2 indices, got {len(index)}: a matrix takes two "
                           "indices, m[i, j] (row i is m[i, :])", KernelIndexError)
        i = self._checked(index[0], self.n, " (row)")
        j = self._checked(index[1], self.m, " (column)")
        if _static(i) and _static(j):
            return i * self.m + j
        return ops.binary("add", ops.binary("mul", i, self.m), j)

    def _sliced(self, index) -> tuple[list, tuple[int, ...]] | None:
        """For an index with slices (``v[1::2]``, ``m[:, j]``, ``m[1:, :2]``): the (flat)
        entry index of each element of the result, row-major, and the result's shape (one
        axis per slice: a vector for one, a matrix for two); None without slices. Slice
        bounds are compile-time (the transformer refuses runtime ones); the other index may be
        a runtime value."""
        keys = index if isinstance(index, tuple) else (index,)
        if not any(isinstance(k, slice) for k in keys):
            return None
        if len(keys) != self.ndim:
            raise ops._err(f"Expected {self.ndim} indices, got {len(keys)}: slicing a "
                           f"{self._shape_text()} takes one index or slice per axis",
                           KernelIndexError)
        extents = (self.n,) if self.ndim == 1 else (self.n, self.m)
        axes = [list(range(e))[k] if isinstance(k, slice) else [k]
                for k, e in zip(keys, extents, strict=True)]
        shape = tuple(len(a) for a, k in zip(axes, keys, strict=True) if isinstance(k, slice))
        if 0 in shape:
            raise ops._err(f"the slice {keys} of a {self._shape_text()} is empty",
                           KernelIndexError)
        return list(itertools.product(*axes)), shape

    def _slice_result(self, values: list, shape: tuple[int, ...]):
        if len(shape) == 1:
            return Matrix._from_entries(values, shape[0], 1, 1)
        return Matrix._from_entries(values, shape[0], shape[1], 2)

    def __getitem__(self, index):
        sliced = self._sliced(index)
        if sliced is not None:
            picks, shape = sliced
            return self._slice_result([self[p if self.ndim == 2 else p[0]] for p in picks],
                                      shape)
        k = self._flat_index(index)
        if _static(k):
            return self.entries[k]
        return _dynamic_pick(self.entries, k)

    def __setitem__(self, index, value) -> None:
        sliced = self._sliced(index)
        if sliced is not None:
            picks, shape = sliced
            values = value.entries if isinstance(value, Matrix) else \
                [value] * len(picks) if not isinstance(value, list | tuple) else \
                list(itertools.chain.from_iterable(
                    v if isinstance(v, list | tuple) else [v] for v in value))
            if len(values) != len(picks):
                raise ops._err(f"cannot assign {len(values)} values to a slice of "
                               f"{'x'.join(map(str, shape))} entries")
            for p, v in zip(picks, values, strict=True):
                self[p if self.ndim == 2 else p[0]] = v
            return
        k = self._flat_index(index)
        if _static(k):
            self._assign_entry(int(k), value)
            return
        bld = _b.current()
        if bld is not None and all(isinstance(e, LocalRef) for e in self.entries) and \
                bld.is_reduction_target(self.entries[0].alloca):
            # A kernel-level vector written from a parallel loop (`ret[i] = i` for i in
            # range(n)): each iteration stores only the entry it indexes; the guarded rewrite
            # of every entry below would race with the other iterations' writes.
            for slot, e in enumerate(self.entries):
                with bld.block() as store:
                    e.store(value)
                bld.emit("if", None, (ops.binary("eq", k, slot).stmt,), None, (store, []))
            return
        for slot in range(len(self.entries)):  # dynamic index: guarded write to every entry
            self._assign_entry(slot, ops.select(ops.binary("eq", k, slot), value,
                                                self.entries[slot]))

    def _assign_entry(self, k: int, value) -> None:
        e = self.entries[k]
        if isinstance(e, Ref):
            e.store(value)
        elif _b.current() is not None:
            raise ops._err("this matrix is a value, not a variable: assign it to a name first")
        else:
            self.entries[k] = value

    def _shape_text(self) -> str:
        return f"{self.n}-vector" if self.ndim == 1 else f"{self.n}x{self.m} matrix"

    # Component access and swizzles: .x .y .z .w (also .rgba, .stpq), and any 2 to 4 of them
    # (.xy, .zxy, .brg), readable and, on variables, assignable (properties made below).
    def _swizzle_indices(self, name: str) -> list[int]:
        alphabet = next(a for a in SWIZZLE_ALPHABETS if name[0] in a)
        idx = [alphabet.index(c) for c in name]
        if (self.ndim != 1 and self.m != 1) or max(idx) >= len(self.entries):
            have = tuple(alphabet[:self.n]) if self.ndim == 1 or self.m == 1 else ()
            msg = f"vec{self.n} only has attributes={have}, got={tuple(name)}" if have else \
                f"a {self._shape_text()} has no attribute '{name}': component access is for " \
                "vectors"
            bld = _b.current()  # a syntax error in Python scope too, as in Taichi
            raise bld.error(msg, KernelSyntaxError) if bld else KernelSyntaxError(msg)
        return idx

    def _swizzle(self, name: str):
        idx = self._swizzle_indices(name)
        if len(idx) == 1:
            return self.entries[idx[0]]
        # The entries themselves (places stay places), so `v.xy += 1` writes v.
        return Matrix._from_entries([self.entries[k] for k in idx], len(idx), 1, 1)

    def _set_swizzle(self, name: str, value) -> None:
        idx = self._swizzle_indices(name)
        if len(idx) == 1:
            self._assign_entry(idx[0], value)
            return
        if isinstance(value, list | tuple):
            value = Vector(list(value))
        values = value.entries if isinstance(value, Matrix) else [value] * len(idx)
        if len(values) != len(idx):
            msg = f"value len does not match the swizzle pattern={name}"
            bld = _b.current()
            raise bld.error(msg) if bld else KernelRuntimeError(msg)
        for k, v in zip(idx, values, strict=True):
            self._assign_entry(k, v)

    def to_list(self) -> list:
        if self.ndim == 1:
            return list(self.entries)
        return [self.entries[i * self.m:(i + 1) * self.m] for i in range(self.n)]

    def to_numpy(self, dtype=None) -> np.ndarray:
        if any(isinstance(e, Value) for e in self.entries):
            raise ops._err("to_numpy() of a vector/matrix of kernel values: NumPy arrays exist "
                           "in Python scope only")
        arr = np.array(self.to_list())
        return arr.astype(dtype) if dtype is not None else arr

    def __array__(self, dtype=None, copy=None):
        return self.to_numpy(dtype)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.to_list()})"

    def __str__(self) -> str:
        """NumPy's text of the values (``print(x[i])``, f-strings), as Taichi prints a
        Python-scope vector or matrix; the repr, which names the type, for kernel values."""
        if any(isinstance(e, Value) for e in self.entries):
            return repr(self)
        return str(self.to_numpy())

    def _values(self) -> Matrix:
        """A copy whose entries are values (places loaded)."""
        return Matrix._from_entries([e.expr() if isinstance(e, Ref) else e for e in self.entries],
                                    self.n, self.m, self.ndim)

    # ------------------------------------------------------------------ arithmetic
    def __add__(self, o):
        return ops.binary("add", self, _coerce(o))

    def __radd__(self, o):
        return ops.binary("add", _coerce(o), self)

    def __sub__(self, o):
        return ops.binary("sub", self, _coerce(o))

    def __rsub__(self, o):
        return ops.binary("sub", _coerce(o), self)

    def __mul__(self, o):
        return ops.binary("mul", self, _coerce(o))

    def __rmul__(self, o):
        return ops.binary("mul", _coerce(o), self)

    def __truediv__(self, o):
        return ops.binary("div", self, _coerce(o))

    def __rtruediv__(self, o):
        return ops.binary("div", _coerce(o), self)

    def __floordiv__(self, o):
        return ops.binary("floordiv", self, _coerce(o))

    def __mod__(self, o):
        return ops.binary("mod", self, _coerce(o))

    def __pow__(self, o):
        return ops.pow(self, _coerce(o))

    def __rfloordiv__(self, o):
        return ops.binary("floordiv", _coerce(o), self)

    def __rmod__(self, o):
        return ops.binary("mod", _coerce(o), self)

    def __rpow__(self, o):
        return ops.pow(_coerce(o), self)

    # Bitwise operators, elementwise on integer entries (floats are refused by ops.binary).
    def __and__(self, o):
        return ops.binary("bit_and", self, _coerce(o))

    def __rand__(self, o):
        return ops.binary("bit_and", _coerce(o), self)

    def __or__(self, o):
        return ops.binary("bit_or", self, _coerce(o))

    def __ror__(self, o):
        return ops.binary("bit_or", _coerce(o), self)

    def __xor__(self, o):
        return ops.binary("bit_xor", self, _coerce(o))

    def __rxor__(self, o):
        return ops.binary("bit_xor", _coerce(o), self)

    def __lshift__(self, o):
        return ops.binary("shl", self, _coerce(o))

    def __rlshift__(self, o):
        return ops.binary("shl", _coerce(o), self)

    def __rshift__(self, o):
        return ops.binary("shr", self, _coerce(o))

    def __rrshift__(self, o):
        return ops.binary("shr", _coerce(o), self)

    def __invert__(self):
        return ops.unary("bit_not", self)

    # NumPy scalars and arrays on the left (np.float64(2) + v) defer to our reflected
    # operators instead of turning the vector into an array, while NumPy's functions of a
    # Python-scope vector (np.ceil(v), np.sqrt(v)) take it as the array it converts to
    # (__array__), both as in Taichi (GeoTaichi: np.ceil(points / grid_size)).
    __array_priority__ = 1000

    def __neg__(self):
        return ops.unary("neg", self)

    def __pos__(self):
        return self

    def __abs__(self):
        return ops.unary("abs", self)

    def __lt__(self, o):
        return ops.binary("lt", self, _coerce(o))

    def __le__(self, o):
        return ops.binary("le", self, _coerce(o))

    def __gt__(self, o):
        return ops.binary("gt", self, _coerce(o))

    def __ge__(self, o):
        return ops.binary("ge", self, _coerce(o))

    def __eq__(self, o):  # type: ignore[override]
        return ops.binary("eq", self, _coerce(o))

    def __ne__(self, o):  # type: ignore[override]
        return ops.binary("ne", self, _coerce(o))

    __hash__ = object.__hash__

    def __matmul__(self, o):
        o = _coerce(o)
        if not isinstance(o, Matrix):
            raise ops._err("@ needs a matrix or vector on both sides")
        a_rows, a_cols = (self.n, self.m) if self.ndim == 2 else (1, self.n)
        if o.ndim == 1:
            b_rows, b_cols = o.n, 1
        else:
            b_rows, b_cols = o.n, o.m
        if self.ndim == 1 and o.ndim == 2:
            a_rows, a_cols = 1, self.n
        if a_cols != b_rows:
            raise ops._err(f"@ shape mismatch: {self._shape_text()} @ {o._shape_text()}")
        out = []
        for i in range(a_rows):
            for j in range(b_cols):
                acc = None
                for k in range(a_cols):
                    term = ops.binary("mul", self.entries[i * a_cols + k],
                                      o.entries[k * b_cols + j])
                    acc = term if acc is None else ops.binary("add", acc, term)
                out.append(acc)
        if o.ndim == 1 or (self.ndim == 1):
            return Matrix._from_entries(out, len(out), 1, 1)
        return Matrix._from_entries(out, a_rows, b_cols, 2)

    # ------------------------------------------------------------------ linear algebra
    def transpose(self) -> Matrix:
        if self.ndim == 1:
            # As Taichi: a vector is not a column matrix, so it has no transpose (a 1xn row
            # here would make `a @ b.transpose()` a shape error rather than the outer product).
            raise ops._err("`transpose()` cannot apply to a vector. If you want something like "
                           "`a @ b.transpose()`, write `a.outer_product(b)` instead.")
        return Matrix._from_entries([self.entries[i * self.m + j] for j in range(self.m)
                                     for i in range(self.n)], self.m, self.n, 2)

    @property
    def T(self) -> Matrix:  # noqa: N802
        return self.transpose()

    def sum(self):
        acc = self.entries[0]
        for e in self.entries[1:]:
            acc = ops.binary("add", acc, e)
        return acc

    def max(self):
        return ops.max(*self.entries)

    def min(self):
        return ops.min(*self.entries)

    def any(self):
        acc = ops.binary("ne", self.entries[0], 0)
        for e in self.entries[1:]:
            acc = ops.binary("logical_or", acc, ops.binary("ne", e, 0))
        return acc

    def all(self):
        acc = ops.binary("ne", self.entries[0], 0)
        for e in self.entries[1:]:
            acc = ops.binary("logical_and", acc, ops.binary("ne", e, 0))
        return acc

    def dot(self, o):
        o = _coerce(o)
        if len(self.entries) != len(o.entries):
            raise ops._err("dot of vectors of different lengths")
        return ops.binary("mul", self, o).sum()

    def cross(self, o):
        o = _coerce(o)
        a, b = self.entries, o.entries
        if len(a) == 2 and len(b) == 2:
            return ops.binary("sub", ops.binary("mul", a[0], b[1]), ops.binary("mul", a[1], b[0]))
        if len(a) != 3 or len(b) != 3:
            raise ops._err("cross product needs two 2-vectors or two 3-vectors")

        def c(i, j):
            return ops.binary("sub", ops.binary("mul", a[i], b[j]), ops.binary("mul", a[j], b[i]))

        return Vector([c(1, 2), c(2, 0), c(0, 1)])

    def outer_product(self, o):
        o = _coerce(o)
        return Matrix._from_entries([ops.binary("mul", a, b) for a in self.entries
                                     for b in o.entries], len(self.entries), len(o.entries), 2)

    def norm_sqr(self):
        return self.dot(self)

    # The formulas below are Taichi's (python/taichi/lang/matrix_ops.py), operation for
    # operation: programs ported from Taichi must get the same values, rounding included.
    def norm(self, eps=0):
        """``sqrt(norm_sqr() + eps)``."""
        return ops.sqrt(self._plus_eps(self.norm_sqr(), eps))

    def norm_inv(self, eps=0):
        """``rsqrt(norm_sqr() + eps)``."""
        return ops.rsqrt(self._plus_eps(self.norm_sqr(), eps))

    def normalized(self, eps=0):
        """``self * (1 / (norm() + eps))``: eps guards the length, not the squared length."""
        inv_len = ops.binary("div", 1, self._plus_eps(self.norm(), eps))
        return ops.binary("mul", inv_len, self)

    @staticmethod
    def _plus_eps(x, eps):
        return x if _static(eps) and eps == 0 else ops.binary("add", x, eps)

    def trace(self):
        if self.ndim != 2 or self.n != self.m:
            shape = (self.n,) if self.ndim == 1 else (self.n, self.m)
            raise ops._err(f"trace() expected a square matrix, got shape {shape}")
        return Matrix._from_entries([self.entries[i * self.m + i] for i in range(self.n)],
                                    self.n, 1, 1).sum()

    def _square(self, what: str) -> int:
        if self.ndim != 2 or self.n != self.m:
            raise ops._err(f"{what} needs a square matrix, got a {self._shape_text()}")
        if self.n > 4:
            raise ops._err(f"{what} is supported up to 4x4, got a {self._shape_text()}")
        return self.n

    def _cyclic(self, n: int):
        """Entry (r mod n, c mod n): Taichi writes its 3x3 and 4x4 cofactors with it."""
        e = self.entries
        return lambda r, c: e[(r % n) * n + c % n]

    def determinant(self):
        n = self._square("determinant")
        e, E = self.entries, self._cyclic(n)  # noqa: N806
        mul, sub, add = (lambda a, b, op=op: ops.binary(op, a, b) for op in ("mul", "sub", "add"))
        if n == 1:
            return e[0]
        if n == 2:
            return sub(mul(e[0], e[3]), mul(e[1], e[2]))
        if n == 3:  # expansion along the first column
            return add(sub(mul(E(0, 0), sub(mul(E(1, 1), E(2, 2)), mul(E(2, 1), E(1, 2)))),
                           mul(E(1, 0), sub(mul(E(0, 1), E(2, 2)), mul(E(2, 1), E(0, 2))))),
                       mul(E(2, 0), sub(mul(E(0, 1), E(1, 2)), mul(E(1, 1), E(0, 2)))))
        det = None
        for i in range(4):
            term = mul(E(i, 0), self._cofactor4(E, i, 0))
            det = term if det is None else (add if i % 2 == 0 else sub)(det, term)
        return det

    @staticmethod
    def _cofactor4(E, i: int, j: int):  # noqa: N803
        """The 3x3 minor of a 4x4 matrix left by row i and column j (unsigned), in Taichi's
        cyclic form."""
        def m(a, b):
            return ops.binary("mul", a, b)

        def s(a, b):
            return ops.binary("sub", a, b)

        return ops.binary("add", s(
            m(E(i + 1, j + 1), s(m(E(i + 2, j + 2), E(i + 3, j + 3)),
                                 m(E(i + 3, j + 2), E(i + 2, j + 3)))),
            m(E(i + 2, j + 1), s(m(E(i + 1, j + 2), E(i + 3, j + 3)),
                                 m(E(i + 3, j + 2), E(i + 1, j + 3))))),
            m(E(i + 3, j + 1), s(m(E(i + 1, j + 2), E(i + 2, j + 3)),
                                 m(E(i + 2, j + 2), E(i + 1, j + 3)))))

    def inverse(self):
        """Adjugate times ``1.0 / determinant()`` (1x1 to 4x4)."""
        n = self._square("inverse")
        e, E = self.entries, self._cyclic(n)  # noqa: N806
        if n == 1:
            return Matrix._from_entries([ops.binary("div", 1.0, e[0])], 1, 1, 2)
        inv_det = ops.binary("div", 1.0, self.determinant())
        if n == 2:
            adj = [e[3], ops.unary("neg", e[1]), ops.unary("neg", e[2]), e[0]]
        elif n == 3:
            adj = [ops.binary("sub", ops.binary("mul", E(i + 1, j + 1), E(i + 2, j + 2)),
                              ops.binary("mul", E(i + 2, j + 1), E(i + 1, j + 2)))
                   for j in range(3) for i in range(3)]
        else:
            adj = []
            for j in range(4):
                for i in range(4):
                    c = self._cofactor4(E, i, j)
                    adj.append(ops.unary("neg", c) if (i + j) % 2 else c)
        return Matrix._from_entries([ops.binary("mul", inv_det, a) for a in adj], n, n, 2)

    def cast(self, dtype):
        return ops.cast(self, dtype)

    def fill(self, value):
        for k in range(len(self.entries)):
            self._assign_entry(k, value)

    # ------------------------------------------------------------------ constructors
    @staticmethod
    def identity(dt, n: int) -> Matrix:
        return Matrix._from_entries([ops.cast(1 if i == j else 0, dt) for i in range(n)
                                     for j in range(n)], n, n, 2)

    @staticmethod
    def zero(dt, n: int, m: int | None = None) -> Matrix:
        if m is None:
            return Matrix._from_entries([ops.cast(0, dt)] * n, n, 1, 1)
        return Matrix._from_entries([ops.cast(0, dt)] * (n * m), n, m, 2)

    @staticmethod
    def one(dt, n: int, m: int | None = None) -> Matrix:
        if m is None:
            return Matrix._from_entries([ops.cast(1, dt)] * n, n, 1, 1)
        return Matrix._from_entries([ops.cast(1, dt)] * (n * m), n, m, 2)

    @staticmethod
    def diag(dim: int, val) -> Matrix:
        return Matrix._from_entries([val if i == j else 0 for i in range(dim)
                                     for j in range(dim)], dim, dim, 2)

    @staticmethod
    def rows(rows) -> Matrix:
        return Matrix([list(r) for r in rows])

    @staticmethod
    def cols(cols) -> Matrix:
        return Matrix([list(c) for c in cols]).transpose()

    @classmethod
    def field(cls, n: int, m: int, dtype, shape=None, order=None, name: str = "", offset=None,
              needs_grad: bool = False, needs_dual: bool = False, layout=None, ndim=None):
        make_field = _storage["make_field"]

        return make_field(dtype, shape, order, name, offset, needs_grad, needs_dual,
                          element_shape=(n,) if ndim == 1 else (n, m), layout=layout)

    @classmethod
    def ndarray(cls, n: int, m: int, dtype, shape, needs_grad: bool = False):
        MatrixNdarray = _storage["MatrixNdarray"]

        return MatrixNdarray(n, m, dtype, shape, needs_grad)


class Vector(Matrix):
    """``ti.Vector``: an n-vector."""

    ndim = 1

    def __init__(self, arr, dt=None) -> None:
        if isinstance(arr, numbers.Number | Value):
            arr = [arr]
        entries = arr.entries if isinstance(arr, Matrix) else list(
            arr.tolist() if isinstance(arr, np.ndarray) else arr)
        self._init(entries, len(entries), 1, 1, dt)

    @classmethod
    def field(cls, n: int, dtype, shape=None, order=None,  # type: ignore[override]
              name: str = "", offset=None, needs_grad: bool = False, needs_dual: bool = False,
              layout=None):
        make_field = _storage["make_field"]

        return make_field(dtype, shape, order, name, offset, needs_grad, needs_dual,
                          element_shape=(n,), layout=layout)

    @classmethod
    def ndarray(cls, n: int, dtype, shape, needs_grad: bool = False):  # type: ignore[override]
        VectorNdarray = _storage["VectorNdarray"]

        return VectorNdarray(n, dtype, shape, needs_grad)

    @staticmethod
    def zero(dt, n: int) -> Vector:  # type: ignore[override]
        return Matrix._from_entries([ops.cast(0, dt)] * n, n, 1, 1)

    @staticmethod
    def one(dt, n: int) -> Vector:  # type: ignore[override]
        return Matrix._from_entries([ops.cast(1, dt)] * n, n, 1, 1)

    @staticmethod
    def unit(n: int, i: int, dt=None) -> Vector:
        dt = dt or int  # as in Taichi: an integer vector unless asked
        return Matrix._from_entries([ops.cast(1 if k == i else 0, dt) for k in range(n)],
                                    n, 1, 1)


SWIZZLE_ALPHABETS = ("xyzw", "rgba", "stpq")


def _make_swizzles() -> None:
    """Properties for every component name and swizzle of 1 to 4 letters of one alphabet
    (made once; attribute access stays a plain property lookup)."""
    for alphabet in SWIZZLE_ALPHABETS:
        for size in range(1, 5):
            for letters in itertools.product(alphabet, repeat=size):
                name = "".join(letters)
                setattr(Matrix, name, property(lambda s, n=name: s._swizzle(n),
                                               lambda s, v, n=name: s._set_swizzle(n, v)))


_make_swizzles()

UNSIGNED_DEFAULT = "unsigned default_ip"  # the element type of ti.math.uvec2..4


class MatrixType:
    """A vector/matrix type such as ``ti.math.vec3`` or ``ti.types.matrix(2, 2, ti.f32)``:
    callable to construct values, usable as a field or ndarray dtype and as an annotation."""

    def __init__(self, n: int, m: int, ndim: int, dtype) -> None:
        self.n, self.m, self.ndim, self._dtype = n, m, ndim, dtype

    @property
    def element_shape(self) -> tuple[int, ...]:
        return (self.n,) if self.ndim == 1 else (self.n, self.m)

    @property
    def scalar_dtype(self):
        """The element type; ``float``/``int`` (ti.math.vec3, ivec3) follow ti.init's
        default_fp/default_ip at the time of use, as in Taichi."""
        if self._dtype is UNSIGNED_DEFAULT:  # ti.math.uvec3: the unsigned twin of default_ip
            return T.ALL[f"u{ops.resolve_dtype(int).bits}"]
        return ops.resolve_dtype(self._dtype if self._dtype is not None else float)

    dtype = scalar_dtype

    def __call__(self, *args):
        dt = self.scalar_dtype
        flat: list = []
        for a in args:
            if isinstance(a, Matrix):
                flat.extend(a.entries)
            elif isinstance(a, list | tuple | np.ndarray):
                flat.extend(np.asarray(a).ravel().tolist() if isinstance(a, np.ndarray)
                            else _flatten(a))
            else:
                flat.append(a)
        size = self.n * (self.m if self.ndim == 2 else 1)
        if len(flat) == 1:
            flat = flat * size
        if len(flat) != size:
            raise ops._err(f"{self!r} takes {size} values, got {len(flat)}")
        flat = [ops.cast(e, dt) for e in flat]
        return Matrix._from_entries(flat, self.n, self.m if self.ndim == 2 else 1, self.ndim)

    def field(self, shape=None, order=None, name: str = "", offset=None,
              needs_grad: bool = False, needs_dual: bool = False, layout=None):
        make_field = _storage["make_field"]

        return make_field(self.scalar_dtype, shape, order, name, offset, needs_grad, needs_dual,
                          element_shape=self.element_shape, layout=layout)

    def __repr__(self) -> str:
        dtype = self._dtype.__name__ if isinstance(self._dtype, type) else self._dtype
        if self.ndim == 1:
            return f"vector({self.n}, {dtype})"
        return f"matrix({self.n}, {self.m}, {dtype})"


def _flatten(xs) -> list:
    out: list = []
    for x in xs:
        if isinstance(x, list | tuple):
            out.extend(_flatten(x))
        elif isinstance(x, Matrix):
            out.extend(x.entries)
        else:
            out.append(x)
    return out


def _static(x) -> bool:
    return isinstance(x, numbers.Integral | np.integer)


def _coerce(o):
    """A list/tuple (nested: rows) or a 1-D/2-D NumPy array as a vector/matrix operand (as
    Taichi takes them); anything else unchanged."""
    if isinstance(o, np.ndarray) and o.ndim in (1, 2) and o.size:
        o = o.tolist()
    if isinstance(o, list | tuple):
        return Matrix(o) if o and isinstance(o[0], list | tuple) else Vector(list(o))
    return o


def _promoted(entries: list) -> list:
    """A matrix literal in a kernel has one type, as in Taichi: the promotion of its entries'
    types (numbers count as default_ip / default_fp). Entries of other types are cast to it, so
    that a runtime index (a select chain, which would promote pairwise: i32 and u32 to u32) and
    a store into an entry (``w = ti.Vector([1, 2.5]); w[0] = 2.7``) see that type. Numbers stay
    compile-time numbers where every entry is one (ints become floats in a float literal)."""
    if not entries or not all(isinstance(e, Value) or ops._is_number(e) for e in entries):
        return entries
    types = [e.dtype if isinstance(e, Value) else ops.literal_dtype(e) for e in entries]
    if all(t == types[0] for t in types):
        return entries
    common = types[0]
    for t in types[1:]:
        common = T.promote(common, t)
    if not any(isinstance(e, Value) for e in entries):
        return [float(e) if common.is_float and isinstance(e, numbers.Integral) else e
                for e in entries]
    return [e if t == common else ops.cast(e, common) for e, t in zip(entries, types,
                                                                      strict=True)]


def _dynamic_pick(options: list, index):
    """``options[index]`` for a runtime index: a chain of selects (no memory, differentiable)."""
    result = options[-1]
    for k in range(len(options) - 2, -1, -1):
        result = ops.select(ops.binary("eq", index, k), options[k], result)
    return result


def vector(n: int | None = None, dtype=None) -> MatrixType:
    """``ti.types.vector(n, dtype)``; ``n=None`` only in ndarray annotations (any length)."""
    return MatrixType(n, 1, 1, dtype)


def matrix(n: int | None = None, m: int | None = None, dtype=None) -> MatrixType:
    """``ti.types.matrix(n, m, dtype)``; ``None`` sizes only in ndarray annotations."""
    return MatrixType(n, m, 2, dtype)


__all__ = ["Matrix", "Vector", "MatrixType", "vector", "matrix", "T"]


ops.register_matrix(Matrix)
