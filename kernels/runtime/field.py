"""Fields: global arrays that kernels read and write, with optional ``.grad`` and ``.dual``.

Each field owns one C-contiguous NumPy array of shape ``shape + element_shape``. Taichi's
SNode tree is reduced to what its dense layouts mean: the shape. (AoS vs SoA placement is a
performance detail; the semantics, including Python-scope indexing, are the same.)
"""

from __future__ import annotations

import itertools
import numbers

import numpy as np

from .. import types as T
from ..errors import DifftapeError, KernelIndexError, KernelTypeError, ShapeError
from ..frontend import builder as _b
from ..ir.nodes import Buffer
from . import program

_field_ids = itertools.count(1)


class Field:
    """``ti.field`` / ``ti.Vector.field`` / ``ti.Matrix.field``."""

    def __new__(cls, *args, **kwargs):
        # arch=ti.remote: the client's subclass keeps the storage on the server.
        remote = program.get().remote
        return object.__new__(remote.field_class if remote is not None and cls is Field else cls)

    def __init__(self, dtype, shape, element_shape=(), name: str = "", role: str = "primal",
                 primal: Field | None = None) -> None:
        from ..frontend.ops import resolve_dtype

        self.dtype = resolve_dtype(dtype)
        self.element_shape = tuple(element_shape)
        self.name = name
        self.role = role
        self.primal = primal or self
        self.id = primal.id if primal is not None else next(_field_ids)
        self._grad: Field | None = None
        self._dual: Field | None = None
        self.mark: Field | None = None  # read marks of Tape(validation=True)
        self._arr: np.ndarray | None = None
        self._shape: tuple[int, ...] | None = None
        self._program = program.get()
        if shape is not None:
            self._allocate(shape)
        elif role == "primal":
            self._program.unplaced.append(self)

    # ------------------------------------------------------------------ allocation
    def _allocate(self, shape) -> None:
        if isinstance(shape, numbers.Integral):
            shape = (int(shape),)
        shape = tuple(int(s) for s in shape)
        if any(s <= 0 for s in shape):
            raise ShapeError(f"field shape must be positive, got {shape}")
        self._shape = shape
        self._arr = np.zeros(shape + self.element_shape, dtype=self.dtype.np)
        if self.role == "primal":
            self._program.fields[self.id] = self
            if self in self._program.unplaced:
                self._program.unplaced.remove(self)

    def _make_companion(self, role: str) -> Field:
        """Allocate ``self.<role>``. On a ``.grad`` field, ``dual`` makes ``x.grad.dual`` (the
        tangent of the gradient: Hessian-vector products land there)."""
        if not self.dtype.is_float:
            raise DifftapeError(f"field '{self._label()}' holds {self.dtype}; only float fields "
                                f"can have a .{role}")
        key_role = role if self.role == "primal" else f"{self.role}_{role}"
        f = Field(self.dtype, None, self.element_shape, self.primal.name, role=key_role,
                  primal=self.primal)
        if self._shape is not None:
            f._allocate(self._shape)
        setattr(self, role, f)
        self._program.storage_epoch += 1
        return f

    # A float field has a .grad and a .dual before it is placed (as in Taichi), so that
    # ``ti.root.dense(ti.i, n).place(x, x.grad)`` works for a field made without needs_grad:
    # asking for one of an unplaced field creates it, and placing it allocates it. A placed
    # field has only the companions it was made or given with (None otherwise).
    @property
    def grad(self) -> Field | None:
        if self._grad is None and self._lazy_companion():
            self._make_companion("grad")
        return self._grad

    @grad.setter
    def grad(self, f: Field | None) -> None:
        self._grad = f

    @property
    def dual(self) -> Field | None:
        if self._dual is None and self._lazy_companion():
            self._make_companion("dual")
        return self._dual

    @dual.setter
    def dual(self, f: Field | None) -> None:
        self._dual = f

    def _lazy_companion(self) -> bool:
        return self.role == "primal" and self._shape is None and self.dtype.is_float

    def companion(self, role: str) -> Field | None:
        """The storage behind a buffer role: ``primal``, ``grad``, ``dual``, ``grad_dual``
        (``x.grad.dual``) or ``mark``; None if not allocated."""
        if role == "primal":
            return self
        if role == "grad_dual":
            return self._grad.dual if self._grad is not None else None
        return getattr(self, "_" + role if role in ("grad", "dual") else role, None)

    def make_mark(self) -> Field:
        """One byte per scalar: set when a validated recording reads the element."""
        f = Field(T.i8, None, self.element_shape, self.name, role="mark", primal=self)
        f._allocate(self.shape)
        self.mark = f
        return f

    def _label(self) -> str:
        return self.name or f"field#{self.id}"

    @property
    def arr(self) -> np.ndarray:
        if self._arr is None:
            raise DifftapeError(f"{self._label()} has no shape yet: give shape= or place it "
                                "with ti.root.dense(...).place(...)")
        return self._arr

    # ------------------------------------------------------------------ properties
    @property
    def shape(self) -> tuple[int, ...]:
        if self._shape is None:
            raise DifftapeError(f"{self._label()} is not placed yet")
        return self._shape

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def n(self) -> int:
        return self.element_shape[0]

    @property
    def m(self) -> int:
        return self.element_shape[1] if len(self.element_shape) > 1 else 1

    def buffer(self) -> Buffer:
        """The IR description of this field's storage."""
        return Buffer(("field", self.id, self.role), self.dtype, self.shape + self.element_shape,
                      self._label() if self.role == "primal" else
                      f"{self.primal._label()}.{self.role.replace('_', '.')}",
                      len(self.element_shape))

    # ------------------------------------------------------------------ indexing
    def _norm_key(self, key) -> tuple:
        from ..frontend.matrix import Matrix

        if key is None or (isinstance(key, tuple) and not key):
            key = ()
        elif not isinstance(key, tuple):
            key = (key,)
        flat: list = []
        for k in key:
            if isinstance(k, Matrix):
                flat.extend(k.entries)
            elif isinstance(k, list | tuple):
                flat.extend(k)
            else:
                flat.append(k)
        if len(flat) != len(self.shape):
            raise _index_error(f"{self._label()} has {len(self.shape)} "
                               f"ind{'ex' if len(self.shape) == 1 else 'ices'} "
                               f"(shape {self.shape}) but was indexed with {len(flat)}")
        return tuple(flat)

    def __getitem__(self, key):
        key = self._norm_key(key)
        if _b.current() is not None:
            return kernel_element(self.buffer(), key)
        value = self.arr[key]
        return _to_python(value, self.element_shape, writable=True)

    def __setitem__(self, key, value) -> None:
        key = self._norm_key(key)
        if _b.current() is not None:
            from ..frontend.matrix import _coerce

            assign(kernel_element(self.buffer(), key), _coerce(value))
            return
        if not self.element_shape:
            # Integers wrap around as in Taichi (0xFFFF into an i16 is -1).
            self.arr[key] = self.dtype.wrap(value) if self.dtype.is_int and isinstance(
                value, numbers.Integral) else value
            return
        self.arr[key] = np.asarray(value, dtype=self.dtype.np).reshape(self.element_shape)

    # ------------------------------------------------------------------ bulk access
    @_b.python_scope
    def to_numpy(self, dtype=None, keep_dims: bool = False) -> np.ndarray:
        out = self.arr.copy()
        return out.astype(dtype) if dtype is not None else out

    @_b.python_scope
    def from_numpy(self, arr) -> None:
        arr = np.asarray(arr)
        expected = self.shape + self.element_shape
        if arr.shape != expected:
            raise ShapeError(f"from_numpy: {self._label()} has shape {expected} "
                             f"(field {self.shape}, element {self.element_shape}) but the array "
                             f"has shape {arr.shape}")
        np.copyto(self.arr, arr, casting="unsafe")

    def fill(self, value) -> None:
        """Set every element to ``value``. Inside a kernel this compiles to a loop over the
        field that runs at every launch (parallel at the kernel's top level), as in Taichi."""
        bld = _b.current()
        if bld is None:
            self.arr[...] = value
            return
        if bld.loop_stack:
            raise bld.error(f"{self._label()}.fill() inside a loop: it is itself a loop over "
                            "the field; call it at the kernel's top level")
        from ..frontend.matrix import Matrix, _coerce

        if isinstance(value, list | tuple):
            value = _coerce(value)
        if isinstance(value, Matrix) and value.shape != self.element_shape:
            raise bld.error(f"{self._label()}.fill(): the value is a {value._shape_text()} but "
                            f"the elements have shape {self.element_shape}")
        buf = self.buffer()
        bld.loop_nest(self.shape, lambda idx: assign(kernel_element(buf, tuple(idx)), value))

    @_b.python_scope
    def copy_from(self, other: Field) -> None:
        np.copyto(self.arr, other.arr)

    def __repr__(self) -> str:
        kind = "Field" if not self.element_shape else f"Field{list(self.element_shape)}"
        return f"<difftape {kind} {self._label()} {self.dtype} shape={self._shape}>"

    # ``ti.field`` objects are hashable by identity (used as dict keys by users and by us).
    __hash__ = object.__hash__


def _index_error(msg: str):
    b = _b.current()
    return b.error(msg, KernelIndexError) if b else IndexError(msg)


def _to_python(value, element_shape, writable: bool = False):
    """A Python-scope element: a number, or a vector/matrix that (when ``writable``) writes
    through to the field, so ``v[2][0] = 9`` works as in Taichi."""
    from ..frontend.matrix import Matrix

    if not element_shape:
        return value.item() if isinstance(value, np.generic) else value
    ndim = len(element_shape)
    n, m = element_shape[0], (element_shape[1] if ndim > 1 else 1)
    out = Matrix._from_entries(value.ravel().tolist(), n, m, ndim)
    if writable:
        out.__class__ = _element_classes()[ndim]
        out._view = value
    return out


def _element_classes():
    """Vector/Matrix subclasses whose entry writes also write the field element."""
    global _ELEMENT_CLASSES
    if _ELEMENT_CLASSES is None:
        from ..frontend.matrix import Matrix, Vector

        def _assign_entry(self, k: int, value) -> None:
            self.entries[k] = value
            self._view.reshape(-1)[k] = value

        _ELEMENT_CLASSES = {
            1: type("FieldVectorElement", (Vector,), {"_assign_entry": _assign_entry}),
            2: type("FieldMatrixElement", (Matrix,), {"_assign_entry": _assign_entry}),
        }
    return _ELEMENT_CLASSES


_ELEMENT_CLASSES = None


def kernel_element(buf: Buffer, key: tuple):
    """A field/ndarray element inside a kernel: a place (scalar) or a matrix of places."""
    from ..frontend import ops
    from ..frontend.matrix import Matrix
    from ..frontend.values import GlobalRef

    bld = _b.require()
    slot = bld.buffer_slot(buf)
    idx = []
    for k in key:
        e = ops.to_expr(k)
        if e.dtype.is_float:
            raise bld.error(f"index into '{buf.name}' must be an integer, got {e.dtype}; "
                            "use ti.cast(i, ti.i32) or int(i)", KernelTypeError)
        idx.append(ops.to_expr(e, T.i32) if e.dtype != T.i32 else e)
    esh = buf.shape[len(buf.shape) - buf.element_ndim:] if buf.element_ndim else ()
    if not esh:
        return GlobalRef(slot, tuple(idx), buf.dtype)
    comps = list(itertools.product(*[range(n) for n in esh]))
    refs = [GlobalRef(slot, tuple(idx) + tuple(ops.const(c, T.i32) for c in comp), buf.dtype)
            for comp in comps]
    if len(esh) == 1:
        return Matrix._from_entries(refs, esh[0], 1, 1)
    return Matrix._from_entries(refs, esh[0], esh[1], 2)


def assign(target, value) -> None:
    """Store ``value`` into a place, or a matrix or struct of places (inside a kernel)."""
    from ..frontend.matrix import Matrix
    from ..frontend.struct import Struct

    if isinstance(target, Struct):
        if isinstance(value, dict):
            value = Struct(value)
        names = list(target._entries)
        if not isinstance(value, Struct) or list(value._entries) != names:
            got = f"members {list(value._entries)}" if isinstance(value, Struct) else \
                f"a {type(value).__name__}"
            raise _b.require().error(f"cannot assign {got} to a struct with members {names}")
        for k in names:
            member, v = target[k], value[k]
            if isinstance(member, Matrix) and isinstance(v, list | tuple):
                from ..frontend.matrix import _coerce

                v = _coerce(v)
            assign(member, v)
        return
    if isinstance(value, Struct):
        raise _b.require().error("cannot assign a struct to a "
                                 + ("vector/matrix" if isinstance(target, Matrix) else "scalar"))
    if isinstance(target, Matrix):
        if isinstance(value, Matrix):
            if len(value.entries) != len(target.entries):
                raise _b.require().error(
                    f"cannot assign a {value._shape_text()} to a {target._shape_text()}")
            for t, v in zip(target.entries, value.entries, strict=True):
                t.store(v)
        else:
            for t in target.entries:
                t.store(value)
        return
    if isinstance(value, Matrix):
        raise _b.require().error(f"cannot assign a {value._shape_text()} to a scalar")
    target.store(value)


def make_field(dtype, shape=None, *, element_shape=(), needs_grad=False, needs_dual=False,
               name: str = "", **_ignored) -> Field:
    """``ti.field(dtype, shape=..., needs_grad=..., needs_dual=...)``."""
    from ..frontend.matrix import MatrixType

    if isinstance(dtype, MatrixType):
        element_shape = dtype.element_shape
        dtype = dtype.scalar_dtype
    f = Field(dtype, shape, element_shape, name)
    if needs_grad:
        f._make_companion("grad")
    if needs_dual:
        f._make_companion("dual")
    return f


# ---------------------------------------------------------------------------- SNode builder

class Axis:
    """One index of a field (``ti.i`` is axis 0). A field's dimensions are the axes its dense
    levels use, in axis-number order: ``dense(ti.l, 5).dense(ti.i, 2)`` makes a (2, 5) field."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return "ijkl"[self.index] if self.index < 4 else f"axis{self.index}"


def axes(*indices: int) -> tuple[Axis, ...]:
    """``ti.axes(0, 2)``: the axes with these numbers (``ti.ik``)."""
    for n in indices:
        if not isinstance(n, numbers.Integral) or n < 0:
            raise ShapeError(f"axis numbers are non-negative integers, got {n!r}")
    return tuple(Axis(int(n)) for n in indices)


# Every combination of ti.i, ti.j, ti.k, ti.l in axis order, as Taichi exports them.
i, j, k, l = axes(0), axes(1), axes(2), axes(3)  # noqa: E741
ij, ik, il, jk, jl, kl = axes(0, 1), axes(0, 2), axes(0, 3), axes(1, 2), axes(1, 3), axes(2, 3)
ijk, ijl, ikl, jkl, ijkl = axes(0, 1, 2), axes(0, 1, 3), axes(0, 2, 3), axes(1, 2, 3), \
    axes(0, 1, 2, 3)


class SNode:
    """``ti.root`` and what ``dense`` returns: a chain of dense levels that places fields."""

    def __init__(self, parent: SNode | None = None, axes=(), sizes=()) -> None:
        self.parent = parent
        self.axes = tuple(axes)
        self.sizes = tuple(sizes)

    def dense(self, axes, dimensions) -> SNode:
        axes = (axes,) if isinstance(axes, Axis) else tuple(axes)
        dims = (dimensions,) * len(axes) if isinstance(dimensions, numbers.Integral) \
            else tuple(dimensions)
        if len(dims) != len(axes):
            raise ShapeError(f"dense over {len(axes)} axes needs {len(axes)} sizes, got {dims}")
        return SNode(self, axes, dims)

    # Sparse SNodes have dense semantics for fields that are never deactivated.
    pointer = bitmasked = dynamic = dense

    @property
    def shape(self) -> tuple[int, ...]:
        extent: dict[int, int] = {}
        node: SNode | None = self
        while node is not None:
            for a, s in zip(node.axes, node.sizes, strict=True):
                extent[a.index] = extent.get(a.index, 1) * s
            node = node.parent
        # Unused axes are dropped: dense(ti.k, 4).dense(ti.l, 3) is a (4, 3) field.
        return tuple(extent[a] for a in sorted(extent))

    def place(self, *fields, offset=None) -> SNode:
        from ..frontend.struct import StructField

        shape = self.shape
        fields = [g for f in fields
                  for g in (f.leaf_fields() if isinstance(f, StructField) else [f])]
        for f in fields:
            if isinstance(f, Field):
                if f._shape is not None:
                    if f.role != "primal" and f._shape == shape:
                        continue  # place(x, x.grad): the companion follows its primal
                    raise DifftapeError(f"{f._label()} is already placed")
                f._allocate(shape)
                for role in ("grad", "dual"):
                    comp = getattr(f, "_" + role)
                    if comp is not None and comp._shape is None:
                        comp._allocate(shape)
            else:
                raise TypeError(f"place() takes fields, got {type(f).__name__}")
        return self

    def lazy_grad(self) -> None:
        """Give every float field a ``.grad`` with the primal's layout."""
        for f in list(program.get().fields.values()) + list(program.get().unplaced):
            if f._grad is None and f.dtype.is_float:
                f._make_companion("grad")

    def lazy_dual(self) -> None:
        for f in list(program.get().fields.values()) + list(program.get().unplaced):
            if f._dual is None and f.dtype.is_float:
                f._make_companion("dual")


class _Root(SNode):
    """``ti.root``; resolves to the current program's root each time."""


root = _Root()
