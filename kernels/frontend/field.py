"""Fields: global arrays that kernels read and write, with optional ``.grad`` and ``.dual``.

Each field owns one dense storage of shape ``shape + element_shape`` from the program's
allocator (``runtime/storage.py``: a NumPy array in host memory, or device memory with a host
mirror), which Python scope reaches through the storage's sync points (``read``/``write``).
Taichi's SNode tree is reduced to what its dense layouts mean: the shape. (AoS vs SoA placement
is a performance detail; the semantics, including Python-scope indexing, are the same.)
"""

from __future__ import annotations

import enum
import functools
import itertools
import math
import numbers
import operator
import warnings

import numpy as np

from .. import types as T
from ..errors import (
    DifftapeError,
    IndexOutOfRangeError,
    KernelIndexError,
    KernelRuntimeError,
    KernelSyntaxError,
    KernelTypeError,
    OutOfMemoryError,
    ShapeError,
    user_line,
)
from ..ir.nodes import Buffer, walk
from ..ir.passes.bounds import OUT_OF_RANGE
from ..quant_types import QuantPlace, QuantType
from ..runtime import program
from ..runtime.foreign import ArrayExchange, array_in
from ..runtime.storage import Storage
from . import builder as _b
from . import matrix as _matrix
from . import ops
from . import quant as _quant
from .matrix import Matrix, MatrixType, Vector, _coerce
from .ops import resolve_dtype
from .values import GlobalRef, Value

# Names of modules that build on fields: sparse.py (activity of sparse SNodes) and struct.py
# (struct values and struct fields). They register them when they load (:func:`bind`), so this
# module does not import upwards.
active_condition = active_mask = dynamic_op = dynamic_row = emit_activate = None
Struct = StructField = None


def bind(**names: object) -> None:
    """Registration point for sparse.py and struct.py (the names above)."""
    unknown = set(names) - {"active_condition", "active_mask", "dynamic_op", "dynamic_row",
                            "emit_activate", "Struct", "StructField"}
    assert not unknown, unknown
    globals().update(names)


def checked_shape(shape) -> tuple[int, ...]:
    """A field's shape as a tuple of positive ints (an int is a 1-D shape)."""
    if isinstance(shape, numbers.Integral):
        shape = (int(shape),)
    shape = tuple(int(s) for s in shape)
    if any(s <= 0 for s in shape):
        raise ShapeError(f"field shape must be positive, got {shape}")
    return shape


_field_ids = itertools.count(1)


class Field(ArrayExchange):
    """``ti.field`` / ``ti.Vector.field`` / ``ti.Matrix.field``."""

    #: a quantized field's type (``dtype`` is then its compute type) and, once placed, where
    #: its bits are (frontend/quant.py); None for every other field
    quant: QuantType | None = None
    _quant_place: QuantPlace | None = None

    def __new__(cls, *args, **kwargs):
        # arch=ti.remote: the client's subclass keeps the storage on the server.
        remote = program.get().remote
        return object.__new__(remote.field_class if remote is not None and cls is Field else cls)

    def __init__(self, dtype, shape, element_shape=(), name: str = "", role: str = "primal",
                 primal: Field | None = None) -> None:
        self.dtype = resolve_dtype(dtype)
        self.element_shape = tuple(element_shape)
        self.name = name
        self.role = role
        self.primal = primal or self
        self.id = primal.id if primal is not None else next(_field_ids)
        self._grad: Field | None = None
        self._dual: Field | None = None
        self.mark: Field | None = None  # read marks of Tape(validation=True)
        self._storage: Storage | None = None
        self._shape: tuple[int, ...] | None = None
        self._program = program.get()
        self._container: SNode | None = None  # the SNode it is placed in (primal)
        self._offset: tuple[int, ...] = ()  # offset= (primal; companions share it)
        self._placed_entries: set[tuple[int, ...]] = set()  # entries placed apart (SoA)
        if shape is not None:
            self._allocate(shape)
        elif role == "primal":
            self._declared = user_line()
            self._program.unplaced.append(self)

    # ------------------------------------------------------------------ allocation
    def _allocate(self, shape) -> None:
        self._shape = shape = checked_shape(shape)
        try:
            self._storage = self._program.allocator.storage(shape + self.element_shape,
                                                            self.dtype.np)
        except MemoryError:
            gib = math.prod(shape + self.element_shape) * self.dtype.np.itemsize / 2**30
            raise OutOfMemoryError(
                f"{self._label()}: shape {shape} of {self.dtype} needs {gib:.3g} GiB, more "
                "memory than there is. difftape stores every field densely, one under a "
                "pointer, bitmasked or dynamic SNode at its full capacity (Taichi allocates "
                "sparse blocks as they are activated): make the field or the SNode's "
                "capacity smaller") from None
        if self.role == "primal":
            self._program.fields[self.id] = self
            if self in self._program.unplaced:
                self._program.unplaced.remove(self)

    def _release(self) -> None:
        """Drop the storage (``SNodeTree.destroy()``): the field cannot be used any more."""
        self._storage = None
        self._destroyed = True
        if self.role == "primal":
            self._program.fields.pop(self.id, None)

    def _make_companion(self, role: str, allocate: bool = True, needed: bool = False
                        ) -> Field:
        """``self.<role>``, made if missing. ``allocate``: give it storage now if this field
        has its shape (``lazy_grad``, ``needs_grad`` with a shape); otherwise it gets storage
        when its primal is placed. ``needed`` (``needs_grad``/``needs_dual`` without a shape,
        as Taichi): it gets storage only when placed itself (``place(x, x.grad)``, or
        ``place(x.grad)`` in an SNode of its own), and kernels refuse to launch until then.
        On a ``.grad`` field, ``dual`` makes ``x.grad.dual`` (the tangent of the gradient:
        Hessian-vector products land there)."""
        if self.quant is not None:
            raise _quant.refuse(f"a .{role} of the quantized field '{self._label()}' "
                                "(derivatives of quantized fields)")
        if not self.dtype.is_float:
            raise KernelRuntimeError(
                f"{self.dtype} is not supported for field with `needs_grad=True` or "
                f"`needs_dual=True`: field '{self._label()}' holds {self.dtype} and only float "
                f"fields can have a .{role}")
        f = self._grad if role == "grad" else self._dual
        if f is None:
            key_role = role if self.role == "primal" else f"{self.role}_{role}"
            f = Field(self.dtype, None, self.element_shape, self.primal.name, role=key_role,
                      primal=self.primal)
            if role == "grad":
                self._grad = f
            else:
                self._dual = f
        if allocate and f._shape is None:
            if self._shape is not None:
                f._allocate_companion(self._shape)
            elif needed:
                if f not in self._program.unplaced:
                    f._declared = self._declared
                    self._program.unplaced.append(f)
            else:
                f._follows = True
        return f

    #: Where a field declared without a shape was declared (``file:line``), for the refusal
    #: of a launch while it is not placed (its ``.grad``/``.dual``: the primal's).
    _declared = "<unknown>"
    #: A companion that gets storage when its primal is placed (``lazy_grad`` before then).
    _follows = False

    def _allocate_companion(self, shape: tuple[int, ...]) -> None:
        """Give a ``.grad``/``.dual`` its storage. Derivative variants of kernels compiled
        before depend on which storage exists (autodiff/lost.py): the epoch makes them
        rebuild."""
        self._allocate(shape)
        self._program.storage_epoch += 1
        if self in self._program.unplaced:
            self._program.unplaced.remove(self)

    # As in Taichi, a float field always has a .grad and a .dual (a field object to place:
    # ``ti.root.dense(ti.i, n).place(x, x.grad)``, or ``place(x)`` and later, in another
    # SNode of the same shape, ``place(x.grad)``). Storage exists only once it is placed, or
    # the field was made with needs_grad/needs_dual, or lazy_grad()/lazy_dual() ran: ask
    # ``has_grad``/``has_dual`` (or ``companion(role)``), never ``x.grad is None``.
    @property
    def grad(self) -> Field | None:
        """``x.grad`` (None only for integer fields and for companions' own companions that
        were never made)."""
        if self._grad is None and self.role == "primal" and self.dtype.is_float and \
                self.quant is None:
            self._make_companion("grad", allocate=False)
        return self._grad

    @grad.setter
    def grad(self, f: Field | None) -> None:
        self._grad = f

    @property
    def dual(self) -> Field | None:
        """``x.dual``, the forward-mode tangent; as :attr:`grad`."""
        if self._dual is None and self.role == "primal" and self.dtype.is_float and \
                self.quant is None:
            self._make_companion("dual", allocate=False)
        return self._dual

    @dual.setter
    def dual(self, f: Field | None) -> None:
        self._dual = f

    @property
    def has_grad(self) -> bool:
        """Whether gradient storage exists (``x.grad`` was allocated)."""
        return self.companion("grad") is not None

    @property
    def has_dual(self) -> bool:
        """Whether tangent storage exists (``x.dual`` was allocated)."""
        return self.companion("dual") is not None

    def companion(self, role: str) -> Field | None:
        """The storage behind a buffer role: ``primal``, ``grad``, ``dual``, ``grad_dual``
        (``x.grad.dual``) or ``mark``; None if not allocated."""
        if role == "primal":
            return self
        if role == "grad_dual":
            g = self.companion("grad")
            return g.companion("dual") if g is not None else None
        c = self._grad if role == "grad" else self._dual if role == "dual" else \
            getattr(self, role, None)
        return c if c is not None and c._shape is not None else None

    def _no_storage(self) -> DifftapeError:
        """The refusal for using a ``.grad``/``.dual`` that was never given storage."""
        what = self.role.replace("_", ".")
        flag = "needs_dual" if self.role.endswith("dual") else "needs_grad"
        kind = "Dual" if flag == "needs_dual" else "Gradient"
        msg = (f"{kind} {self._label()} has not been placed, check whether `{flag}=True`: "
               f"{self._label()} has no storage; create '{self.primal._label()}' with "
               f"{flag}=True, or place it (ti.root.dense(...).place({self.primal._label()}."
               f"{what}))")
        bld = _b.current()
        return bld.error(msg) if bld is not None else DifftapeError(msg)

    #: Set by :meth:`_release` (its SNode tree was destroyed).
    _destroyed = False

    def _destroyed_error(self) -> DifftapeError:
        msg = (f"{self._label()} was destroyed (SNodeTree.destroy() of its FieldsBuilder's "
               "tree): it has no storage any more; make a new field")
        bld = _b.current()
        return bld.error(msg) if bld is not None else DifftapeError(msg)

    def make_mark(self) -> Field:
        """One byte per scalar: set when a validated recording reads the element."""
        f = Field(T.i8, None, self.element_shape, self.name, role="mark", primal=self)
        f._allocate(self.shape)
        self.mark = f
        return f

    @property
    def _name(self) -> str:
        """The name given at ``ti.field(..., name=)`` ("" when none), as Taichi's
        ``Field._name``."""
        return self.name

    def _label(self) -> str:
        if self.role != "primal" and self.role != "mark":
            return f"{self.primal._label()}.{self.role.replace('_', '.')}"
        if self.name:
            return self.name
        bld = _b.current()
        local = bld.field_names.get(self.id) if bld is not None else None
        return local or f"field#{self.id}"

    # ------------------------------------------------------------------ sparse SNodes
    @property
    def sparse_terms(self) -> list:
        """The sparse levels above this field (see :meth:`SNode.activity_terms`); empty for
        a field that only dense levels hold."""
        node = self.primal._container
        return node.activity_terms() if node is not None and self.role != "mark" else []

    def parent(self, n: int = 1) -> SNode | None:
        """``x.parent()``: the SNode the field is placed in (``n`` levels up)."""
        node = self.primal._container
        if node is None:
            # Made with shape=: Taichi places it in a dense SNode of that shape under
            # ti.root (0-D too); made here when first asked for.
            shape = self.primal.shape
            node = SNode(root, axes(*range(len(shape))), shape, "dense")
            node.fields.append(self.primal)
            self.primal._container = node
        return node.parent(n - 1)

    @property
    def snode(self) -> SNode:
        """The field's own (place) SNode, whose ``parent()`` holds it: one object per field,
        so that ``x.snode.parent(0) == x.snode`` as in Taichi."""
        node = self.__dict__.get("_place_snode")
        if node is None:
            node = self._place_snode = SNode(self.parent(), (), (), "place", field=self)
        return node

    def _dynamic(self) -> SNode | None:
        node = self.primal._container
        return node if node is not None and node.kind == "dynamic" else None

    #: The activity levels of a field whose SNodes live elsewhere: set by the service's
    #: engine from ``create_field``'s ``sparse`` (a client's sparse field, stored densely on
    #: the server beside its activity fields); None for every field of a local program.
    _wire_levels: list | None = None

    @property
    def activity_levels(self) -> list[tuple[Field, list[tuple[int, int]], bool]]:
        """The sparse levels above this field's cells as storage: (the level's activity
        field, the map from this field's index to the level's, dynamic?). What Python-scope
        access (activation by writes, writes of active cells only) and the reverse-mode
        transform need, locally (from the SNodes) and on the server (from the wire) alike."""
        if self.role == "mark":
            return []
        if self.primal._wire_levels is not None:
            return self.primal._wire_levels
        return [(lvl.activity, imap, lvl.kind == "dynamic") for lvl, imap in self.sparse_terms]

    def _np_active(self) -> np.ndarray | None:
        """Which elements are active (a bool array of the field's shape); None if dense."""
        levels = self.activity_levels
        return active_mask(levels, self.shape) if levels else None

    def _np_activate(self, key: tuple) -> None:
        """A Python-scope write of element ``key`` (a storage index) activates the cells
        along its path, as in Taichi."""
        for act, imap, dynamic in self.activity_levels:
            idx = tuple(int(key[q]) // d for q, d in imap)
            if dynamic:
                *par, j = idx
                arr = act.storage.write()
                arr[tuple(par)] = max(int(arr[tuple(par)]), j + 1)
            else:
                act.storage.write()[idx] = 1

    def _np_activate_all(self) -> None:
        """Every cell of every level above the field active (a list at its full length: the
        extent of its own axis, the last of the level's map)."""
        for act, imap, dynamic in self.activity_levels:
            act.storage.write()[...] = self.shape[imap[-1][0]] if dynamic else 1

    def _zero(self) -> None:
        """Zero the whole storage, active or not (``deactivate_all``); recorded inside
        ``ti.graph.capture()``. The remote field queues the engine's ``zero`` op."""
        capture = self._program.capture
        if capture is not None:
            capture.zero(self.storage)
        else:
            self.storage.zero()

    @property
    def storage(self) -> Storage:
        """The field's memory (``runtime/storage.py``): kernels address it, Python scope
        reads and writes it through its sync points."""
        if self._storage is None:
            if self._destroyed:
                raise self._destroyed_error()
            if self.role != "primal" and self.primal._shape is not None:
                raise self._no_storage()
            raise DifftapeError(f"{self._label()} has no shape yet: give shape= or place it "
                                "with ti.root.dense(...).place(...)")
        return self._storage

    # ------------------------------------------------------------------ properties
    @property
    def shape(self) -> tuple[int, ...]:
        if self._destroyed:
            raise self._destroyed_error()
        if self._shape is None:
            if self.role != "primal" and self.primal._shape is not None:
                raise self._no_storage()
            raise DifftapeError(f"{self._label()} is not placed yet")
        return self._shape

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def offset(self) -> tuple[int, ...]:
        """The index of the first element along each axis (Taichi's ``offset=``): ``x[offset]``
        is element 0 of the storage (and of ``to_numpy()``); zeros for a field made without
        one. Struct-fors over the field run over ``offset .. offset + shape``."""
        return self.primal._offset or (0,) * len(self.shape)

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
                      len(self.element_shape), self.primal._offset, self._quant_place)

    def _quant_members(self) -> list[Field]:
        """The scalar quantized fields ``BitpackedFields.place(self)`` places (a vector/matrix
        field's entries, see :class:`QuantMatrixField`)."""
        return [self]

    def _place_quant(self, snode: SNode, shape: tuple[int, ...], offset: tuple[int, ...],
                     place: QuantPlace, storage: Storage) -> None:
        """Placing the ``BitpackedFields`` this quantized field is in (frontend/quant.py):
        its shape, and its storage over the physical words."""
        self._offset = offset
        self._shape = shape
        self._quant_place = place
        storage.shape = shape
        self._storage = storage
        self._program.fields[self.id] = self
        if self in self._program.unplaced:
            self._program.unplaced.remove(self)
        self._container = snode
        snode.fields.append(self)

    # ------------------------------------------------------------------ indexing
    def _norm_key(self, key) -> tuple:
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
        if self._dynamic() is not None and _b.current() is not None:
            row = dynamic_row(self, key)
            if row is not None:
                return row
        key = self._norm_key(key)
        if _b.current() is not None:
            return self._kernel_element(key)
        self._program.wait_for_passes()
        if self._program.capture is not None:  # inside ti.graph.capture(): refused
            self._program.capture.read(f"reading {self._label()}[...]")
        key = self._host_index(key)
        out = _to_python(self.storage.read()[key], self.element_shape,
                         self._entry_writer(key) if self.element_shape else None)
        return out

    def _entry_writer(self, key: tuple[int, ...]):
        """How ``x[i][k] = v`` writes entry ``k`` of element ``key`` (at the time of the
        write, through the storage's sync point)."""
        def store(k: int, value) -> None:
            self.storage.write()[key].reshape(-1)[k] = value
            if self.sparse_terms:  # a write activates the cells along its path
                self._np_activate(key)
        return store

    def _host_index(self, key: tuple) -> tuple[int, ...]:
        """A Python-scope index (as the user wrote it, from ``offset``) as the index into
        ``arr``. Out of range is an error, as in kernels under ``debug=True`` (NumPy would
        wrap a negative index around to the other end)."""
        out = []
        for axis, (k, n, o) in enumerate(zip(key, self.shape, self.offset, strict=True)):
            try:
                r = operator.index(k) - o
            except TypeError:
                raise TypeError(f"Detected illegal element of type: {type(k).__name__}. Please "
                                "be aware that slicing a ti.field is not supported so far: "
                                f"{self._label()} is indexed with integers, got {k!r:.40} for "
                                f"axis {axis} (to_numpy() gives an array to slice)") from None
            if not 0 <= r < n:
                where = f" and offset {self.offset}" if any(self.offset) else ""
                raise IndexOutOfRangeError(
                    f"{OUT_OF_RANGE}{r + o} out of range for axis {axis} of "
                    f"'{self._label()}' "
                    f"with shape {self.shape}{where}")
            out.append(r)
        return tuple(out)

    def _kernel_element(self, key: tuple):
        """Element ``key`` inside a kernel: a place or a matrix of places."""
        return kernel_element(self.buffer(), key, self if self.sparse_terms else None)

    def _stop_gradient(self, bld) -> None:
        """``ti.stop_grad(x)`` inside a kernel (every entry of a vector/matrix field)."""
        bld.stop_gradient(bld.buffer_slot(self.buffer()))

    def get_scalar_field(self, *indices: int) -> Field:
        """``m.get_scalar_field(i, j)``: entry (i, j) of every element of a vector/matrix field
        as a scalar field that shares the storage (reads and writes through it are reads and
        writes of the matrix field, in kernels and in Python scope, derivatives included).
        One index means column 0, as in Taichi."""
        if not self.element_shape:
            raise DifftapeError(f"{self._label()} is a scalar field; get_scalar_field() picks "
                                "an entry of a vector/matrix field")
        if len(indices) not in (1, 2) or not all(isinstance(i, numbers.Integral)
                                                 for i in indices):
            raise DifftapeError(f"get_scalar_field takes one or two integer indices, got "
                                f"{indices}")
        comp = (int(indices[0]),) + ((int(indices[1]) if len(indices) == 2 else 0),)
        esh = self.element_shape if len(self.element_shape) == 2 else \
            self.element_shape + (1,)
        if not all(0 <= c < n for c, n in zip(comp, esh, strict=True)):
            raise DifftapeError(f"get_scalar_field{tuple(indices)}: {self._label()} has "
                                f"{esh[0]}x{esh[1]} entries")
        return ScalarFieldView(self, comp[:len(self.element_shape)])

    def __setitem__(self, key, value) -> None:
        key = self._norm_key(key)
        if _b.current() is not None:
            assign(self[key], _coerce(value))
            return
        key = self._host_index(key)
        self._program.wait_for_passes()
        if self._program.capture is not None:  # inside ti.graph.capture(): recorded
            self._program.capture.write_element(self, key, value)
            return
        self.storage.write()[key] = self._host_element(value)
        if self.sparse_terms:  # a write activates the cells along its path, as in Taichi
            self._np_activate(key)

    def _host_element(self, value):
        """A Python-scope write's value as the field stores it: a scalar field's integers
        wrap around as in Taichi (0xFFFF into an i16 is -1); a vector/matrix field's element
        is an array of its element shape. One conversion for the local field and the remote
        one (``difftape.client``)."""
        if not self.element_shape:
            return self.dtype.wrap(value) if self.dtype.is_int and \
                isinstance(value, numbers.Integral) else value
        return np.asarray(value, dtype=self.dtype.np).reshape(self.element_shape)

    # ``x.append(v)``, ``x.length()``, ``x.deactivate()`` of a field in a 1-D dynamic SNode
    def append(self, value):
        return dynamic_op(self, "append", (), value)

    def length(self):
        return dynamic_op(self, "length", ())

    def deactivate(self):
        return dynamic_op(self, "deactivate", ())

    # ------------------------------------------------------------------ bulk access
    @_b.python_scope
    def to_numpy(self, dtype=None, keep_dims: bool = False) -> np.ndarray:
        """The field as a NumPy array of shape ``shape + element_shape`` (see
        :meth:`_numpy_dims` for ``keep_dims``). Inactive cells of sparse SNodes read 0: their
        storage is kept zeroed."""
        self._program.wait_for_passes()
        if self._program.capture is not None:  # inside ti.graph.capture(): refused
            self._program.capture.read(f"{self._label()}.to_numpy()")
        out = self._numpy_dims(self.storage.read().copy(), keep_dims)
        return out.astype(dtype) if dtype is not None else out

    @_b.python_scope
    def from_numpy(self, arr) -> None:
        source = arr
        arr = self._numpy_in(arr)
        self._program.wait_for_passes()
        if self._program.capture is not None:  # inside ti.graph.capture(): recorded
            self._program.capture.copy(self, arr, source)
            return
        active = self._np_active()
        if active is None:
            np.copyto(self.storage.write(), arr, casting="unsafe")
        else:  # Taichi writes through a struct-for: the active cells only
            np.copyto(self.storage.write(), arr, casting="unsafe",
                      where=self._element_mask(active))

    def _numpy_dims(self, out: np.ndarray, keep_dims: bool) -> np.ndarray:
        """Taichi's ``keep_dims``: the size-1 column of an n x 1 matrix field is dropped unless
        ``keep_dims``, and ``keep_dims`` gives vector fields that column (shape + (n, 1))."""
        if len(self.element_shape) == 1 and keep_dims:
            return out.reshape(out.shape + (1,))
        if len(self.element_shape) == 2 and self.element_shape[1] == 1 and not keep_dims:
            return out.reshape(out.shape[:-1])
        return out

    def _numpy_in(self, arr) -> np.ndarray:
        """``arr`` checked (and reshaped) for ``from_numpy``: vector and n x 1 matrix fields
        take both ``shape + (n,)`` and ``shape + (n, 1)``, what ``to_numpy`` gives with and
        without ``keep_dims``. A PyTorch tensor, JAX array or other DLPack/array-interface
        object is read in place (``runtime.foreign.array_in``)."""
        arr = array_in(arr)
        expected = self.shape + self.element_shape
        column = self.shape + self.element_shape[:1]
        if arr.shape != expected and self.element_shape and \
                self.element_shape[1:] in ((), (1,)) and arr.shape in (column, column + (1,)):
            arr = arr.reshape(expected)
        if arr.shape != expected:
            raise ShapeError(f"from_numpy: {self._label()} has shape {expected} "
                             f"(field {self.shape}, element {self.element_shape}) but the array "
                             f"has shape {arr.shape}")
        return arr

    def _element_mask(self, active: np.ndarray) -> np.ndarray:
        return active.reshape(active.shape + (1,) * len(self.element_shape))

    def fill(self, value) -> None:
        """Set every element to ``value``. Inside a kernel this compiles to a loop over the
        field that runs at every launch (parallel at the kernel's top level), as in Taichi."""
        bld = _b.current()
        if bld is None:
            self._program.wait_for_passes()
            if self._program.capture is not None:  # inside ti.graph.capture(): recorded
                self._program.capture.fill(self, value)
                return
            active = self._np_active()
            if active is None:
                self.storage.write()[...] = value
            else:  # as Taichi's fill (a struct-for): the active cells only
                np.copyto(self.storage.write(), np.asarray(value, dtype=self.dtype.np),
                          where=self._element_mask(active))
            return
        if bld.loop_stack:
            raise bld.error(f"{self._label()}.fill() inside a loop: it is itself a loop over "
                            "the field; call it at the kernel's top level")
        if isinstance(value, list | tuple):
            value = _coerce(value)
        if isinstance(value, Matrix) and value.shape != self.element_shape:
            raise bld.error(f"{self._label()}.fill(): the value is a {value._shape_text()} but "
                            f"the elements have shape {self.element_shape}")
        node = self.primal._container

        def fill_one(idx) -> None:
            if not self.sparse_terms:
                assign(self._kernel_element(tuple(idx)), value)
                return
            with bld.block() as then:  # the active cells only, as in Taichi
                assign(self._kernel_element(tuple(idx)), value)
            bld.emit("if", None, (active_condition(node, idx).stmt,), None, (then, []))

        ops.loop_nest(bld, self.shape, fill_one, self.offset)

    @_b.python_scope
    def copy_from(self, other: Field) -> None:
        self._check_copy_source(other)
        self._program.wait_for_passes()
        if self._program.capture is not None:  # inside ti.graph.capture(): recorded
            self._program.capture.copy(self, other.storage, other)
            return
        # As Taichi's copy (a kernel assigning element by element): another dtype converts as
        # an assignment does, floats to integers truncating, integers wrapping.
        with np.errstate(over="ignore", invalid="ignore"):  # f64 -> f32 overflows to inf
            self.storage.copy_from(other.storage, casting="unsafe")
        if self.sparse_terms:  # Taichi copies over the whole index range: all activated
            self._np_activate_all()

    def _check_copy_source(self, other) -> None:
        """What ``copy_from`` accepts: a field of the same shape and element shape (of any
        dtype). One check for the local field and the remote one (``difftape.client``)."""
        if not isinstance(other, Field):
            raise TypeError(f"{self._label()}.copy_from() takes a field, got a "
                            f"{type(other).__name__}; use from_numpy() for an array")
        if (other.shape, other.element_shape) != (self.shape, self.element_shape):
            raise ShapeError(f"{self._label()}.copy_from(): shape {self.shape}, elements "
                             f"{self.element_shape}, do not match the source field's "
                             f"{other.shape}, {other.element_shape}")

    def __repr__(self) -> str:
        """What the field is, without its values (a notebook shows it; reading the values of a
        remote field would be a round trip): ``<ti.Vector.field(3) x: f32, shape (8,),
        needs_grad>``."""
        kind = {0: "ti.field", 1: "ti.Vector.field({})", 2: "ti.Matrix.field({}, {})"}
        parts = [str(self.dtype), f"shape {self._shape}"]
        if any(self.offset):
            parts.append(f"offset {self.offset}")
        if self.role == "primal":
            parts += [flag for flag, role in (("needs_grad", "grad"), ("needs_dual", "dual"))
                      if self.companion(role) is not None]
        if self.sparse_terms:
            parts.append("sparse")
        head = kind.get(len(self.element_shape), "ti.field").format(*self.element_shape)
        return f"<{head} {self._label()}: {', '.join(parts)}>"

    def __iter__(self):
        # Without this, Python would iterate by calling __getitem__(0), (1), ... (as Taichi,
        # a field is not a Python iterable).
        raise NotImplementedError("Struct for is only available in Taichi scope: iterate "
                                  f"over {self._label()} in a kernel, or over ti.ndrange(*x."
                                  "shape) / x.to_numpy() in Python")

    # ``ti.field`` objects are hashable by identity (used as dict keys by users and by us).
    __hash__ = object.__hash__


class ScalarFieldView(Field):
    """What ``m.get_scalar_field(i, j)`` returns: entry (i, j) of the elements of a
    vector/matrix field, sharing its storage. Python scope reads and writes a NumPy view of
    the matrix field's array; kernels address the matrix field's buffer at that entry, so
    derivatives flow into ``m.grad``/``m.dual`` like any access of ``m``. Its ``.grad`` and
    ``.dual`` are the same entry of ``m.grad``/``m.dual``. Its :attr:`storage` is a
    :class:`ComponentStorage` of the matrix field's."""

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, matrix: Field, component: tuple[int, ...]) -> None:
        if matrix._program.remote is not None:
            raise DifftapeError("get_scalar_field() is not supported under arch=ti.remote (the "
                                "service keeps the storage); index the matrix field instead")
        if matrix.sparse_terms:
            raise DifftapeError(f"get_scalar_field(): {matrix._label()} is under sparse "
                                "SNodes; views of such fields are not supported, index the "
                                "matrix field instead")
        self._matrix = matrix
        self._component = component
        self.dtype = matrix.dtype
        self.element_shape = ()
        self.name = f"{matrix._label()}{list(component)}"
        self.role = matrix.role
        self.primal = self
        self.id = matrix.id
        self.mark = None
        self._program = matrix._program
        self._container = matrix.primal._container

    def _kernel_element(self, key: tuple):
        return kernel_element(self._matrix.buffer(), key, component=self._component)

    def buffer(self) -> Buffer:
        raise DifftapeError(f"{self.name} is a view of {self._matrix._label()}: it has no "
                            "storage of its own")

    def _stop_gradient(self, bld) -> None:
        raise bld.error(f"ti.stop_grad() of {self.name}, a view made by get_scalar_field(): "
                        "not supported; wrap the loads in ti.stop_grad(...) instead, or stop "
                        f"the whole field with ti.stop_grad({self._matrix._label()})")

    def _view_of(self, f: Field | None) -> ScalarFieldView | None:
        return None if f is None else ScalarFieldView(f, self._component)

    @property
    def grad(self) -> ScalarFieldView | None:
        return self._view_of(self._matrix.grad)

    @property
    def dual(self) -> ScalarFieldView | None:
        return self._view_of(self._matrix.dual)

    def companion(self, role: str) -> Field | None:
        return self._view_of(self._matrix.companion(role))

    @property
    def _shape(self) -> tuple[int, ...] | None:
        return self._matrix._shape

    @property
    def offset(self) -> tuple[int, ...]:
        return self._matrix.offset

    @property
    def _storage(self) -> ComponentStorage | None:
        base = self._matrix._storage
        return None if base is None else ComponentStorage(base, self._component)

    def parent(self, n: int = 1) -> SNode | None:
        return self._matrix.parent(n)

    def _label(self) -> str:
        return self.name


class _FieldKind(type):
    """The metaclass of ``ti.ScalarField``/``ti.MatrixField``. difftape has one Field class
    whose ``element_shape`` says what its elements are; these names classify fields by it in
    ``isinstance`` checks, as Taichi's subclasses do."""

    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, Field) and bool(obj.element_shape) == cls._of_matrices


class ScalarField(Field, metaclass=_FieldKind):
    """``ti.ScalarField``: ``isinstance(x, ti.ScalarField)`` for fields of scalars."""

    _of_matrices = False


class MatrixField(Field, metaclass=_FieldKind):
    """``ti.MatrixField``: ``isinstance(x, ti.MatrixField)`` for vector and matrix fields."""

    _of_matrices = True


def _index_error(msg: str):
    b = _b.current()
    return b.error(msg, KernelIndexError) if b else IndexError(msg)


class ComponentStorage:
    """One entry of every element of a matrix field's storage, for Python scope (the storage
    of a ``get_scalar_field`` view): views of the matrix storage's host arrays, through its
    sync points. Kernels never address it (they address the matrix field)."""

    def __init__(self, base: Storage, component: tuple[int, ...]) -> None:
        self.base = base
        self.index = (Ellipsis,) + component
        self.shape = base.shape[:base.ndim - len(component)]
        self.dtype = base.dtype

    @property
    def host(self) -> bool:
        return self.base.host

    @property
    def array(self) -> np.ndarray:
        """A (strided) view of the host array (host storage only)."""
        return self.base.array[self.index]

    def read(self) -> np.ndarray:
        return self.base.read()[self.index]

    def write(self) -> np.ndarray:
        return self.base.write()[self.index]

    def zero(self) -> None:
        self.write()[...] = 0

    def copy_from(self, other, casting: str = "unsafe") -> None:
        np.copyto(self.write(), other.read(), casting=casting)


def _to_python(value, element_shape, store=None):
    """A Python-scope element: a number, or a vector/matrix. With ``store`` (``store(k, v)``
    writes entry ``k`` of the element back, see :meth:`Field._entry_writer`) its entry writes
    go through to the field, so ``v[2][0] = 9`` works as in Taichi."""
    if not element_shape:
        return value.item() if isinstance(value, np.generic) else value
    ndim = len(element_shape)
    n, m = element_shape[0], (element_shape[1] if ndim > 1 else 1)
    out = Matrix._from_entries(value.ravel().tolist(), n, m, ndim)
    if store is not None:
        out.__class__ = _element_classes()[ndim]
        out._store = store
    return out


def _element_classes():
    """Vector/Matrix subclasses whose entry writes also write the field element."""
    global _ELEMENT_CLASSES
    if _ELEMENT_CLASSES is None:
        def _assign_entry(self, k: int, value) -> None:
            self.entries[k] = value
            self._store(k, value)

        _ELEMENT_CLASSES = {
            1: type("FieldVectorElement", (Vector,), {"_assign_entry": _assign_entry}),
            2: type("FieldMatrixElement", (Matrix,), {"_assign_entry": _assign_entry}),
        }
    return _ELEMENT_CLASSES


_ELEMENT_CLASSES = None


def kernel_element(buf: Buffer, key: tuple, sparse: Field | None = None,
                   component: tuple[int, ...] | None = None):
    """A field/ndarray element inside a kernel: a place (scalar) or a matrix of places.
    ``key`` is the index as the user wrote it: a field's ``offset`` (``buf.offset``) is
    subtracted here, the one place where kernel accesses become storage indices.
    ``sparse``: the field, when sparse SNodes hold it: writes to the element activate it.
    ``component``: one entry of the element (a place), for a view made by get_scalar_field."""
    bld = _b.require()
    slot = bld.buffer_slot(buf)
    idx = []
    for k in key:
        if isinstance(k, slice):
            raise bld.error(f"Slicing is not supported on ti.field (nor ndarrays) in kernels: "
                            f"index '{buf.name}' with one integer per axis", KernelIndexError)
        e = ops.to_expr(k)
        if e.dtype.is_float:
            raise bld.error(f"index into '{buf.name}' must be an integer, got {e.dtype}; "
                            "use ti.cast(i, ti.i32) or int(i)", KernelTypeError)
        idx.append(ops.to_expr(e, T.i32) if e.dtype != T.i32 else e)
    if buf.offset:
        idx = [ops.binary("sub", e, ops.const(o, T.i32)) if o else e
               for e, o in zip(idx, buf.offset, strict=True)]
    esh = buf.shape[len(buf.shape) - buf.element_ndim:] if buf.element_ndim else ()
    on_write = None
    if sparse is not None and not bld.adjoint:
        # (the adjoint of a kernel only reads activity: struct-fors see what is active then)
        node = sparse.primal._container
        on_write = lambda: emit_activate(node, idx)  # noqa: E731
    if component is not None:
        return GlobalRef(slot, tuple(idx) + tuple(ops.const(c, T.i32) for c in component),
                         buf.dtype, on_write)
    if not esh:
        return GlobalRef(slot, tuple(idx), buf.dtype, on_write)
    comps = list(itertools.product(*[range(n) for n in esh]))
    refs = [GlobalRef(slot, tuple(idx) + tuple(ops.const(c, T.i32) for c in comp), buf.dtype,
                      on_write)
            for comp in comps]
    if len(esh) == 1:
        return Matrix._from_entries(refs, esh[0], 1, 1)
    return Matrix._from_entries(refs, esh[0], esh[1], 2)


def block_local(*fields) -> None:
    """``ti.block_local(x, ...)``: Taichi's hint to cache fields in GPU shared memory. On the
    CPU it changes nothing (as in Taichi), so it only checks that it is given fields, inside
    a kernel."""

    bld = _b.current()
    if bld is None:
        raise DifftapeError("ti.block_local() is a hint inside kernels")
    for f in fields:
        if not isinstance(f, Field | StructField):
            raise bld.error(f"ti.block_local() takes fields, got a {type(f).__name__}",
                            KernelTypeError)


def cache_read_only(*fields) -> None:
    """``ti.cache_read_only(x, ...)``: Taichi's promise that the kernel only reads ``x`` (a
    GPU may then read it through its read-only cache). The code difftape generates does not
    depend on it, but a kernel that broke the promise would read stale values on Taichi's
    GPUs, so it is checked: the kernel must not write such a field (see
    :func:`check_read_only`)."""
    bld = _b.current()
    if bld is None:
        raise DifftapeError("ti.cache_read_only() is a hint inside kernels")
    for f in fields:
        if not isinstance(f, Field | StructField):
            raise bld.error(f"ti.cache_read_only() takes fields, got a {type(f).__name__}",
                            KernelTypeError)
        for leaf in f.leaf_fields() if isinstance(f, StructField) else [f]:
            bld.read_only[leaf.id] = leaf._label()


def check_read_only(bld: _b.Builder) -> None:
    """Refuse a kernel that writes a field it declared ``ti.cache_read_only``."""
    if not bld.read_only:
        return
    for s in walk(bld.body):
        if s.op in ("store", "atomic"):
            key = bld.buffers[s.attr if s.op == "store" else s.attr[0]].key
            if key[0] == "field" and key[1] in bld.read_only:
                bld.loc = s.loc
                raise bld.error(f"{bld.read_only[key[1]]} is declared read-only in this kernel "
                                "(ti.cache_read_only) but this line writes it; drop the hint "
                                "or the write")


def loop_unique(val, covers=None):
    """``loop_unique(val, covers=None)`` (Taichi's ``taichi.lang.misc.loop_unique``): a
    promise that ``val`` differs between the iterations of the enclosing parallel loop, so
    that Taichi may turn atomic updates of the ``covers`` fields indexed by it into plain
    ones. difftape keeps the atomics, which give the same result when the promise holds (and
    a correct one when it does not), so the value is returned as it is; the arguments are
    checked, inside a kernel."""

    bld = _b.current()
    if bld is None:
        raise DifftapeError("loop_unique() is a hint inside kernels")
    if covers is None:
        covers = []
    for f in covers if isinstance(covers, list | tuple) else [covers]:
        if not isinstance(f, Field | StructField | SNode):
            raise bld.error(f"loop_unique(covers=...) takes fields or their SNodes (x.snode), "
                            f"got a {type(f).__name__}", KernelTypeError)
    return val


def assume_in_range(val, base, low: int, high: int):
    """``ti.assume_in_range(val, base, low, high)``: Taichi's promise that ``val`` lies in
    ``[base + low, base + high)``, which lets it stage a field in GPU shared memory for a
    block (``ti.block_local``). difftape reads the field itself, which is right whether or
    not the promise holds, so ``val`` is returned as it is; ``low``/``high`` must be Python
    integers, as Taichi requires."""
    bld = _b.current()
    if bld is None:
        raise DifftapeError("ti.assume_in_range() is a hint inside kernels")
    for name, v in (("low", low), ("high", high)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise bld.error(f"ti.assume_in_range({name}=...) must be a Python integer, got "
                            f"{type(v).__name__}", KernelTypeError)
    return val


class Layout(enum.Enum):
    """``ti.Layout``: how Taichi lays out the entries of a vector/matrix field in memory, all
    entries of an element together (``AOS``) or each entry in an array of its own (``SOA``).
    It never changes a value; here every field is one array of shape ``shape +
    element_shape``, read and written the same way under either."""

    AOS = "aos"
    SOA = "soa"


def check_layout(layout) -> None:
    """``layout=`` of ``ti.Vector.field`` and the like: None or a :class:`Layout`."""
    if layout is not None and not isinstance(layout, Layout):
        raise TypeError(f"layout= takes ti.Layout.AOS or ti.Layout.SOA, got {layout!r:.40}")


def assign(target, value) -> None:
    """Store ``value`` into a place, or a matrix or struct of places (inside a kernel)."""

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
                    f"cannot assign '{_tensor_text(value)}' to '{_tensor_text(target)}': "
                    f"a {value._shape_text()} to a {target._shape_text()}", KernelTypeError)
            for t, v in zip(target.entries, value.entries, strict=True):
                t.store(v)
        else:
            for t in target.entries:
                t.store(value)
        return
    if isinstance(value, Matrix):
        raise _b.require().error(f"cannot assign a {value._shape_text()} to a scalar")
    target.store(value)


def _tensor_text(m: Matrix) -> str:
    """A vector's or matrix's type as Taichi's messages write it: ``[Tensor (3) i32]``."""
    dts = [e.dtype if isinstance(e, Value) else ops.literal_dtype(e) for e in m.entries]
    dt = functools.reduce(T.promote, dts)
    shape = f"{m.n}" if m.ndim == 1 else f"{m.n}, {m.m}"
    return f"[Tensor ({shape}) {dt}]"


def _check_order(order: str, shape) -> None:
    """``order=`` names each of the field's axes once (``"ji"``: axis j outermost in memory);
    Taichi's words lead each refusal."""
    if shape is None:
        raise KernelSyntaxError(f"shape cannot be None when order is set (order={order!r}): "
                                "give the field a shape")
    dims = len(shape) if isinstance(shape, tuple | list) else 1
    if len(order) != dims:
        raise KernelSyntaxError(f"The dimensionality of shape and order must be the same: "
                                f"shape {shape!r} has {dims} axes, order={order!r} names "
                                f"{len(order)}")
    if len(set(order)) != len(order):
        raise KernelSyntaxError(f"The axes in order must be different: order={order!r}")
    bad = sorted(set(order) - set("ijkl"[:dims]))
    if bad:
        raise KernelSyntaxError(f"Invalid axis {bad[0]!r} in order={order!r}: a field of "
                                f"{dims} axes orders {'ijkl'[:dims]!r}")


def make_field(dtype, shape=None, order=None, name: str = "", offset=None, needs_grad=False,
               needs_dual=False, *, element_shape=(), layout=None) -> Field:
    """``ti.field(dtype, shape=..., order=..., name=..., offset=..., needs_grad=...,
    needs_dual=...)``; ``ti.Vector.field``/``ti.Matrix.field`` add ``element_shape`` and
    ``layout``. ``order`` and ``layout`` choose Taichi's memory layout only, never a result, so
    they are checked and need nothing here. ``offset`` (see :attr:`Field.offset`) needs a
    ``shape`` with as many axes, as in Taichi."""
    check_layout(layout)
    if offset is not None:
        if shape is None:
            raise KernelSyntaxError("shape cannot be None when offset is set: give the field "
                                    "a shape, or place it with ti.root.dense(...).place(x, "
                                    "offset=...)")
        dims = 1 if isinstance(shape, numbers.Integral) else len(shape)
        offset = _offset_tuple(offset)
        if len(offset) != dims:
            raise KernelSyntaxError(f"The dimensionality of shape and offset must be the same "
                                    f"({dims} != {len(offset)}): shape {shape!r}, offset "
                                    f"{offset!r}")
        # (before the field exists: a refused one must not stay behind, unplaced)
        check_offset_range(offset, (shape,) if isinstance(shape, numbers.Integral) else shape)
    if order is not None:
        _check_order(order, shape)
    if isinstance(dtype, MatrixType):
        element_shape = dtype.element_shape
        dtype = dtype.scalar_dtype
    if isinstance(dtype, QuantType) or (
            isinstance(dtype, list | tuple) and element_shape and
            any(isinstance(t, QuantType) for t in _flatten_types(dtype))):
        return _quant_field(dtype, shape, name, offset, needs_grad, needs_dual, element_shape)
    offset = offset if offset and any(offset) else None
    f = Field(dtype, None if offset else shape, element_shape, name)
    # Without a shape, Taichi leaves placing x.grad/x.dual to the program (refused at launch
    # until it does); with one (here placed below when there is an offset) they come with x.
    if needs_grad:
        f._make_companion("grad", needed=shape is None)
    if needs_dual:
        f._make_companion("dual", needed=shape is None)
    if offset:
        shape = (shape,) if isinstance(shape, numbers.Integral) else tuple(shape)
        root.dense(axes(*range(len(shape))), shape).place(f, offset=offset)
    return f


_BAR = "=" * 44 + "\n"


def refuse_unplaced(prog, kernel: str) -> None:
    """Refuse to launch ``kernel`` while ``prog.unplaced`` holds fields: declared without a
    shape and never placed, or the ``.grad``/``.dual`` of a ``needs_grad``/``needs_dual``
    field that was not placed (Taichi's checks when it materializes the fields at a launch,
    with its wording; the message names where each field was declared and how to fix it).
    Kernels call this only while the list is not empty."""
    primals = [f for f in prog.unplaced if f.role == "primal"]
    if primals:
        raise KernelRuntimeError(
            f"These field(s) are not placed:\n{_BAR}"
            + "".join(f"  {f._label()}, declared at {f._declared}\n" for f in primals)
            + f"{_BAR}Please consider specifying a shape for them. E.g.,\n\n"
            "  x = ti.field(float, shape=(2, 3))\n\n"
            f"or place them before kernel '{kernel}' is launched: "
            "ti.root.dense(ti.i, n).place(x)")
    for role in ("grad", "dual"):
        comps = [f for f in prog.unplaced if f.role == role]
        if comps:
            raise KernelRuntimeError(
                f"These field(s) requrie `needs_{role}=True`, however their {role} field(s) "
                f"are not placed:\n{_BAR}"
                + "".join(f"  {f._label()} (of {f.primal._label()}, declared at "
                          f"{f._declared})\n" for f in comps)
                + f"{_BAR}Please consider place the {role} field(s) before kernel "
                f"'{kernel}' is launched, beside the field or in an SNode of the same shape. "
                f"E.g.,\n\n  ti.root.dense(ti.i, n).place(x, x.{role})\n\n  "
                f"ti.root.dense(ti.i, n).place(x.{role})\n\n Or specify a shape for the "
                f"field(s). E.g.,\n\n  x = ti.field(float, shape=(2, 3), needs_{role}=True)")


def _quant_field(qtype, shape, name: str, offset, needs_grad: bool, needs_dual: bool,
                 element_shape: tuple[int, ...]) -> Field:
    """``ti.field(dtype=ti.types.quant...)``: a field computing at the type's compute type,
    without storage until its ``ti.BitpackedFields`` (or quant_array) is placed
    (frontend/quant.py). A vector/matrix field's entries are scalar quantized fields
    (:class:`QuantMatrixField`); ``qtype`` is then one type or a list (of lists) of types, one
    per entry, of one compute type."""
    if needs_grad or needs_dual:
        raise _quant.refuse("needs_grad/needs_dual on a quantized field (derivatives of "
                            "quantized fields)")
    if shape is not None or offset is not None:
        raise DifftapeError(f"a field of quantized type {qtype!r} gets its shape from the SNode "
                            "its ti.BitpackedFields is placed in: make it without shape= and "
                            "place it with ti.BitpackedFields(max_num_bits=...).place(x)")
    if not element_shape:
        f = Field(qtype.compute, None, (), name)
        f.quant = qtype
        return f
    n = int(np.prod(element_shape))
    types = list(_flatten_types(qtype)) if isinstance(qtype, list | tuple) else [qtype] * n
    if len(types) != n:
        raise ShapeError(f"a {'x'.join(map(str, element_shape))} field takes one type per entry "
                         f"({n}), got {len(types)}")
    if not all(isinstance(t, QuantType) for t in types):
        raise DifftapeError("the entries of a vector/matrix field are all of quantized types "
                            "(ti.types.quant.*) or none")
    if len({t.compute for t in types}) > 1:
        raise _quant.QuantTypeError("Member fields of a matrix field must have the same compute "
                                    f"type, got {', '.join(str(t.compute) for t in types)}")
    return QuantMatrixField(types, element_shape, name)


def _flatten_types(types):
    for t in types:
        if isinstance(t, list | tuple):
            yield from _flatten_types(t)
        else:
            yield t


class QuantMatrixField(Field):
    """A vector/matrix field of quantized types. Each entry is a scalar quantized field of its
    own (``get_scalar_field(i, j)`` is that field), placed in a ``ti.BitpackedFields`` by itself
    or with the others (``place(m)`` places every entry, in row-major order, as Taichi); a
    kernel's ``m[i]`` is the matrix of the entries' elements, each decoded and encoded in its
    own word. Python scope reads and writes all entries through a
    :class:`~difftape.frontend.quant.QuantMatrixStorage`. The field has a shape once every
    entry is placed, with one shape."""

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, types: list[QuantType], element_shape: tuple[int, ...],
                 name: str) -> None:
        self.dtype = resolve_dtype(types[0].compute)
        self.quant = types[0]
        self.element_shape = tuple(element_shape)
        self.name = name
        self.role = "primal"
        self.primal = self
        self.id = next(_field_ids)
        self._grad = self._dual = self.mark = None
        self._program = program.get()
        self._placed_entries = set()
        self._matrix_storage = None
        comps = list(itertools.product(*[range(k) for k in self.element_shape]))
        self.entries: dict[tuple[int, ...], Field] = {}
        for comp, t in zip(comps, types, strict=True):
            f = Field(t.compute, None, (), f"{name}{list(comp)}")
            f.quant = t
            self.entries[comp] = f

    def _quant_members(self) -> list[Field]:
        return list(self.entries.values())

    def _placed(self) -> bool:
        return all(f._shape is not None for f in self.entries.values())

    @property
    def _shape(self) -> tuple[int, ...] | None:
        if not self._placed():
            return None
        shapes = {(f._shape, f._offset) for f in self.entries.values()}
        if len(shapes) > 1:
            raise ShapeError(f"the entries of {self._label()} are placed with different shapes "
                             f"(and offsets) {sorted(shapes)}: they share one")
        return next(iter(shapes))[0]

    @property
    def _offset(self) -> tuple[int, ...]:
        return next(iter(self.entries.values()))._offset

    @property
    def _container(self):
        return next(iter(self.entries.values()))._container

    @property
    def _storage(self):
        if self._matrix_storage is None and self._shape is not None:
            self._matrix_storage = _quant.QuantMatrixStorage(
                self._shape, self.element_shape, self.dtype.np,
                [f._storage for f in self.entries.values()])
        return self._matrix_storage

    def buffer(self) -> Buffer:
        raise DifftapeError(f"{self._label()} is a vector/matrix field of quantized types: its "
                            "entries are stored apart (index it, or use get_scalar_field)")

    def _kernel_element(self, key: tuple):
        refs = [f._kernel_element(key) for f in self.entries.values()]
        esh = self.element_shape
        if len(esh) == 1:
            return Matrix._from_entries(refs, esh[0], 1, 1)
        return Matrix._from_entries(refs, esh[0], esh[1], 2)

    def get_scalar_field(self, *indices: int) -> Field:
        """Entry (i, j): the scalar quantized field that holds it."""
        if len(indices) not in (1, 2) or not all(isinstance(i, numbers.Integral)
                                                 for i in indices):
            raise DifftapeError(f"get_scalar_field takes one or two integer indices, got "
                                f"{indices}")
        comp = tuple(int(i) for i in indices)
        if len(self.element_shape) == 1 and len(comp) == 2 and comp[1] == 0:
            comp = comp[:1]
        if len(self.element_shape) == 2 and len(comp) == 1:
            comp = (comp[0], 0)
        if comp not in self.entries:
            raise DifftapeError(f"get_scalar_field{tuple(indices)}: {self._label()} has "
                                f"entries {list(self.entries)}")
        return self.entries[comp]


def check_offset_range(offset: tuple[int, ...], shape) -> None:
    """Kernels index fields with i32: the range of a field's indices along each axis (its
    offset to the offset plus its extent, the end a struct-for stops at) must be one of i32
    (Taichi 1.7.4 takes such a field and its indices wrap around). The one rule for a field
    made here, by a server's ``create_field`` and by a loaded graph."""
    for o, n in zip(offset, shape, strict=False):
        if not isinstance(n, numbers.Integral):
            continue  # a bad shape is refused where the field is allocated
        if not -2**31 <= o <= 2**31 - 1 - n:
            raise ShapeError(f"offset {offset}: the index range {o} .. {o + n} (end "
                             "excluded) does not fit in i32, which indexes fields; use a "
                             "smaller offset")


def _offset_tuple(offset) -> tuple[int, ...]:
    """``offset=`` as a tuple of ints (Taichi takes a number for one axis)."""
    if isinstance(offset, numbers.Integral):
        return (int(offset),)
    try:
        return tuple(operator.index(o) for o in offset)
    except TypeError:
        raise TypeError(f"offset= takes an integer or a tuple of integers, got "
                        f"{offset!r:.60}") from None


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


_SPARSE = ("pointer", "bitmasked", "dynamic")


class SNode:
    """``ti.root`` and what ``dense``/``pointer``/``bitmasked``/``dynamic`` return.

    Storage stays dense (each field one NumPy array); a sparse level keeps its *activity* in a
    hidden field beside the data: one byte per cell of a pointer/bitmasked level, one length
    per list of a dynamic level. The invariant that keeps reads cheap: an inactive cell's data
    is zero (cells start zeroed, deactivation zeroes them), so reads never look at activity;
    writes activate the cells along their path, and struct-fors visit only active cells.
    """

    def __init__(self, parent: SNode | None = None, axes=(), sizes=(), kind: str = "dense",
                 field: Field | None = None) -> None:
        self._parent = parent
        self.kind = kind
        self.axes = tuple(axes)
        self.sizes = tuple(sizes)
        self._children: list[SNode] = []
        self.fields: list[Field] = []  # placed directly here
        self._field = field  # a place node: its field
        self.activity: Field | None = None
        self._terms: list | None = None
        if parent is not None and kind != "place":
            parent.children.append(self)
        if kind in ("pointer", "bitmasked"):
            self.activity = Field(T.i8, self.shape, name=f"{self._describe()}.active")
        elif kind == "dynamic":
            self.activity = Field(T.i32, parent.shape, name=f"{self._describe()}.length")

    @property
    def children(self) -> list[SNode]:
        return self._children

    @property
    def _name(self) -> str:
        """A place node's field name ("" for the other nodes), as Taichi's ``SNode._name``."""
        return self._field.name if self._field is not None else ""

    def _describe(self) -> str:
        return f"{self.kind}{list(self.shape)}"

    def _child(self, kind: str, axes, dimensions) -> SNode:
        if self.kind == "dynamic":
            raise ShapeError("no SNode can be placed under a dynamic SNode: place fields in it")
        if self.kind == "quant_array":
            raise DifftapeError("no SNode can be placed under a quant_array: it holds one "
                                "field of a quantized type (place(x))")
        axes = (axes,) if isinstance(axes, Axis) else tuple(axes)
        dims = (dimensions,) * len(axes) if isinstance(dimensions, numbers.Integral) \
            else tuple(dimensions)
        if len(dims) == 1:  # one size for every axis, as an int would be (as in Taichi)
            dims *= len(axes)
        if len(dims) != len(axes):
            raise ShapeError(f"{kind} over {len(axes)} axes needs {len(axes)} sizes, got {dims}")
        return SNode(self, axes, dims, kind)

    def dense(self, axes, dimensions) -> SNode:
        return self._child("dense", axes, dimensions)

    def pointer(self, axes, dimensions) -> SNode:
        return self._child("pointer", axes, dimensions)

    def bitmasked(self, axes, dimensions) -> SNode:
        return self._child("bitmasked", axes, dimensions)

    def quant_array(self, axes, dimensions, max_num_bits: int) -> SNode:
        """Taichi's quant_array: ``dimensions`` elements along ``axes`` packed into one
        physical word of ``max_num_bits`` bits. It holds one field, of a quant int or fixed
        type (``place(x)``); a store of an element updates its bits of the word
        (compare-and-swap in parallel loops: the neighbours in the word may be stored at the
        same time)."""
        if max_num_bits not in (8, 16, 32, 64):
            raise DifftapeError(f"quant_array(max_num_bits={max_num_bits!r}): the physical "
                                "word has 8, 16, 32 or 64 bits")
        node = self._child("quant_array", axes, dimensions)
        node.max_num_bits = int(max_num_bits)
        return node

    def dynamic(self, axis, dimension, chunk_size: int | None = None) -> SNode:
        """A list along one axis, at most ``dimension`` long (``chunk_size`` is the allocation
        granularity in Taichi; storage here is dense, so it has no effect)."""
        axes = (axis,) if isinstance(axis, Axis) else tuple(axis)
        if len(axes) != 1:
            raise ShapeError("a dynamic SNode has exactly one axis")
        if any(a.index == axes[0].index for lvl in self._path() for a in lvl.axes):
            raise ShapeError(f"dynamic SNode: axis {axes[0]!r} is already used by an "
                             "ancestor; a dynamic SNode needs its own (last) axis")
        return self._child("dynamic", axes, dimension)

    def parent(self, n: int = 1) -> SNode | None:
        """The ``n``-th ancestor (``ti.root``'s is None)."""
        node: SNode | None = self
        while node is not None and n > 0:
            node = node._parent
            n -= 1
        return node

    def _path(self) -> list[SNode]:
        """The levels from below the root down to this node (place nodes excluded)."""
        out = []
        node: SNode | None = self
        while node is not None and node._parent is not None:
            if node.kind != "place":
                out.append(node)
            node = node._parent
        return out[::-1]

    def _axis_numbers(self) -> list[int]:
        return sorted({a.index for lvl in self._path() for a in lvl.axes})

    @property
    def shape(self) -> tuple[int, ...]:
        extent: dict[int, int] = {}
        for lvl in self._path():
            for a, s in zip(lvl.axes, lvl.sizes, strict=True):
                extent[a.index] = extent.get(a.index, 1) * s
        # Unused axes are dropped: dense(ti.k, 4).dense(ti.l, 3) is a (4, 3) field.
        return tuple(extent[a] for a in sorted(extent))

    def index_map(self, anc: SNode) -> list[tuple[int, int]]:
        """How an ancestor's index follows from this node's: for each of ``anc``'s index
        positions, (the position in this node's index, the divisor)."""
        path = self._path()
        below = path[path.index(anc) + 1:] if anc in path else path
        mine = self._axis_numbers()
        out = []
        for a in anc._axis_numbers():
            d = 1
            for lvl in below:
                for ax, s in zip(lvl.axes, lvl.sizes, strict=True):
                    if ax.index == a:
                        d *= s
            out.append((mine.index(a), d))
        return out

    def activity_terms(self) -> list[tuple[SNode, list[tuple[int, int]]]]:
        """The sparse levels from the root down to this node, each with the map from this
        node's index to the level's: a cell here is active iff it is active at each."""
        if self._terms is None:  # a node's ancestors never change: computed once
            self._terms = [(lvl, self.index_map(lvl)) for lvl in self._path()
                           if lvl.kind in _SPARSE]
        return self._terms

    def _subtree(self):
        yield self
        for c in self.children:
            yield from c._subtree()

    def subtree_fields(self) -> list[Field]:
        """Every storage placed at or below this node: fields and their companions."""
        out = []
        for node in self._subtree():
            for f in node.fields:
                out += [c for c in (f, f._grad, f._dual,
                                    f._grad._dual if f._grad is not None else None)
                        if c is not None and c._shape is not None and not c._destroyed]
        return out

    def place(self, *fields, offset=None) -> SNode:
        """Place fields in this SNode: their shape is its shape. ``offset``: the index of
        their first element along each axis (see :attr:`Field.offset`)."""
        if self.kind == "place":
            raise ShapeError("cannot place fields under a field's own SNode")
        shape = self.shape
        offset = _offset_tuple(offset) if offset is not None else ()
        if offset and len(offset) != len(shape):
            raise ShapeError(f"place(offset={offset}): the SNode has {len(shape)} axes (shape "
                             f"{shape}), the offset {len(offset)}")
        check_offset_range(offset, shape)
        if not any(offset):
            offset = ()
        elif self.activity_terms() or self.kind in _SPARSE:
            raise DifftapeError(f"place(offset={offset}): fields with an offset under sparse "
                                "SNodes (pointer, bitmasked, dynamic) are not supported; use "
                                "dense SNodes, or index from 0 and shift the indices")
        fields = [g for f in fields
                  for g in (f.leaf_fields() if isinstance(f, StructField) else [f])]
        if self.kind == "quant_array":
            self._place_quant_array(fields, shape, offset)
            return self
        for f in fields:
            if isinstance(f, _quant.BitpackedFields):
                f._place_in(self, shape, offset)
            elif f.quant is not None if isinstance(f, Field) else False:
                raise DifftapeError(f"{f._label()} has a quantized type ({f.quant!r}): place it "
                                    "with ti.BitpackedFields(max_num_bits=...).place(...), "
                                    "then place the BitpackedFields in the SNode")
            elif isinstance(f, ScalarFieldView):
                self._place_entry(f, shape, offset)
            elif isinstance(f, Field):
                if f._shape is not None:
                    if f.role != "primal" and f._shape == shape and \
                            f.primal._container is self:
                        continue  # place(x, x.grad) after lazy_grad(): already there
                    raise DifftapeError(f"{f._label()} is already placed")
                if f.role == "primal":
                    self._place_primal(f, shape, offset)
                elif f.primal._container is self:
                    f._allocate_companion(shape)  # place(x, x.grad): beside its primal
                else:
                    self._place_companion(f, shape, offset)
            else:
                raise TypeError(f"place() takes fields, got {type(f).__name__}")
        return self

    def _place_quant_array(self, fields: list, shape: tuple[int, ...],
                           offset: tuple[int, ...]) -> None:
        """``quant_array(...).place(x)``: Taichi's rules (one field, of a quant int or fixed
        type, its elements fitting the word); the physical words, one per cell of the levels
        above, and ``x``'s place in them (its elements along each axis ``packed``)."""
        if len(fields) != 1 or self.fields:
            raise DifftapeError("a quant_array holds exactly one field: place one field of a "
                                "quantized type in it")
        f = fields[0]
        q = getattr(f, "quant", None)
        if not isinstance(f, Field) or q is None or f.element_shape:
            raise DifftapeError(f"a quant_array holds a scalar field of a quant int or fixed "
                                f"type (ti.types.quant.int/fixed), got {f!r:.60}")
        if q.kind == "float":
            raise DifftapeError(f"{f._label()}: a quant_array holds quant int or fixed types; "
                                f"a quant float ({q!r}) is placed with ti.BitpackedFields")
        if f._shape is not None or f._quant_place is not None:
            raise DifftapeError(f"{f._label()} is already placed")
        mine = dict.fromkeys(self._axis_numbers(), 1)
        for a, n in zip(self.axes, self.sizes, strict=True):
            mine[a.index] *= n
        packed = tuple(mine[a] for a in self._axis_numbers())
        count = int(np.prod(packed))
        if count * q.bits > self.max_num_bits:
            raise DifftapeError(f"quant_array(max_num_bits={self.max_num_bits}): {count} "
                                f"elements of {q!r} ({q.bits} bits each) do not fit; use fewer "
                                "elements or a larger max_num_bits")
        group = _quant.BitpackedFields(self.max_num_bits)
        group.members.append((f, QuantPlace(q, self.max_num_bits, 0, word=group.word,
                                            packed=packed)))
        words = tuple(n // d for n, d in zip(shape, packed, strict=True))
        group._place_in(self, shape, offset, words)

    def _place_primal(self, f: Field, shape: tuple[int, ...],
                      offset: tuple[int, ...] = ()) -> None:
        f._offset = offset
        # The container first: a remote field's creation op carries the sparse levels above
        # it (client/runtime.py).
        f._container = self
        try:
            f._allocate(shape)
        except BaseException:
            f._container = None
            raise
        self.fields.append(f)
        for comp in (f._grad, f._dual):  # lazy_grad()/lazy_dual() before the placement
            if comp is not None and comp._shape is None and comp._follows:
                comp._allocate_companion(shape)

    def _place_entry(self, view: ScalarFieldView, shape: tuple[int, ...],
                     offset: tuple[int, ...] = ()) -> None:
        """``place(m.get_scalar_field(i, j))``: Taichi's structure-of-arrays layout, each entry
        of a matrix field in an SNode of its own. The layout never changes a value, and here a
        field's storage is one array: the first entry placed allocates the matrix field (its
        ``.grad`` likewise), the others must come with the same shape."""
        m = view._matrix
        if self.activity_terms():
            raise DifftapeError(f"{view._label()}: the entries of a matrix field can be placed "
                                f"apart in dense SNodes only; place {m._label()} whole")
        placed = m._placed_entries
        if view._component in placed or (m._shape is not None and not placed
                                          and m.role == "primal"):
            raise DifftapeError(f"{view._label()} is already placed")
        if m._shape is None:
            if m.role == "primal":
                self._place_primal(m, shape, offset)
            else:
                self._place_companion(m, shape, offset)
        elif m._shape != shape or m.primal._offset != offset:
            raise ShapeError(f"{view._label()} placed with shape {shape}, but {m._label()} "
                             f"has shape {m._shape} (offset {m.primal._offset or None}): the "
                             "entries of a matrix field share one shape and offset")
        placed.add(view._component)

    def _place_companion(self, f: Field, shape: tuple[int, ...],
                         offset: tuple[int, ...] = ()) -> None:
        """``place(x.grad)`` apart from ``x`` (Taichi's ``place(x)`` then, in another SNode,
        ``place(x.grad)``). Kernels index ``x.grad`` as ``x``, so the shapes must be equal;
        sparse activity is the primal's, so both must be dense."""
        p = f.primal
        if p._shape is None:
            raise DifftapeError(f"{f._label()}: place its primal field first")
        if shape != p._shape:
            raise ShapeError(f"{f._label()} placed with shape {shape}, but "
                             f"{p._label()} has shape {p._shape}: a .grad/.dual is indexed as "
                             "its field, so it must have the same shape")
        if offset and offset != p._offset:
            raise ShapeError(f"{f._label()} placed with offset {offset}, but {p._label()} has "
                             f"offset {p._offset or None}: a .grad/.dual shares its field's")
        if self.activity_terms() or p.sparse_terms:
            raise DifftapeError(f"{f._label()}: placing it apart from {p._label()} is "
                                "supported for dense SNodes only; under sparse SNodes place "
                                f"it beside its field (place({p._label()}, {f._label()}))")
        f._allocate_companion(shape)

    def deactivate_all(self) -> None:
        """Deactivate every cell of this SNode and of the sparse SNodes below it (their data
        reads 0 again). Python scope, as in Taichi. Inside ``ti.graph.capture()`` the
        clearing is recorded, a step of the graph replayed where it stands (not done once
        while capturing)."""
        if _b.current() is not None:
            raise _b.current().error("deactivate_all() runs in Python scope only; inside a "
                                     "kernel use ti.deactivate(snode, I)")
        for node in self._subtree():
            if node.kind in _SPARSE:
                for f in [node.activity] + node.subtree_fields():
                    f._zero()

    def lazy_grad(self) -> None:
        """Give every float field a ``.grad`` with the primal's layout."""
        for f in list(program.get().fields.values()) + list(program.get().unplaced):
            if not f.has_grad and f.dtype.is_float and f.role == "primal":
                f._make_companion("grad")

    def lazy_dual(self) -> None:
        for f in list(program.get().fields.values()) + list(program.get().unplaced):
            if not f.has_dual and f.dtype.is_float and f.role == "primal":
                f._make_companion("dual")

    def __repr__(self) -> str:
        return f"<difftape SNode {self.kind} shape={self.shape}>"


class _Root(SNode):
    """``ti.root``; resolves to the current program's root each time."""

    def __init__(self) -> None:
        super().__init__(None, (), (), "root")

    @property
    def children(self) -> list[SNode]:
        return program.get().snode_children

    def __repr__(self) -> str:
        return "<difftape SNode root>"


root = _Root()


class FieldsBuilder:
    """``ti.FieldsBuilder()``: an SNode tree of its own, beside ``ti.root``, built with the
    same ``dense``/``pointer``/``bitmasked``/``dynamic``/``place`` calls, then ``finalize()``d;
    the :class:`SNodeTree` that returns can ``destroy()`` the tree's fields and free their
    storage. Fields get their storage when placed (as under ``ti.root``), so they can be used
    before ``finalize()``, which Taichi does not allow; after it, the builder takes no more."""

    def __init__(self) -> None:
        self.root = SNode(None, (), (), "root")
        self.finalized = False
        self.empty = True

    def _open(self) -> SNode:
        if self.finalized:
            raise DifftapeError("FieldsBuilder finalized: it takes no more SNodes or fields; "
                                "start another ti.FieldsBuilder()")
        self.empty = False
        return self.root

    def dense(self, axes, dimensions) -> SNode:
        return self._open().dense(axes, dimensions)

    def pointer(self, axes, dimensions) -> SNode:
        return self._open().pointer(axes, dimensions)

    def bitmasked(self, axes, dimensions) -> SNode:
        return self._open().bitmasked(axes, dimensions)

    def dynamic(self, axis, dimension, chunk_size: int | None = None) -> SNode:
        return self._open().dynamic(axis, dimension, chunk_size)

    def quant_array(self, axes, dimensions, max_num_bits: int) -> SNode:
        return self._open().quant_array(axes, dimensions, max_num_bits)

    def place(self, *fields, offset=None) -> SNode:
        return self._open().place(*fields, offset=offset)

    def lazy_grad(self) -> None:
        self._open().lazy_grad()

    def lazy_dual(self) -> None:
        self._open().lazy_dual()

    def deactivate_all(self) -> None:
        """Deactivate every sparse cell of the tree (after ``finalize()``, as in Taichi)."""
        if not self.finalized:
            warnings.warn("FieldsBuilder.deactivate_all() does nothing before finalize()",
                          stacklevel=2)
            return
        self.root.deactivate_all()

    def finalize(self, raise_warning: bool = True) -> SNodeTree:
        """End the tree: the builder takes nothing more. Returns its :class:`SNodeTree`."""
        if self.finalized:
            raise DifftapeError("FieldsBuilder finalized: finalize() was already called")
        if self.empty and raise_warning:
            warnings.warn("Finalizing an empty FieldsBuilder!", stacklevel=2)
        self.finalized = True
        return SNodeTree(self.root)


class SNodeTree:
    """What :meth:`FieldsBuilder.finalize` returns; ``destroy()`` frees the tree's fields."""

    def __init__(self, root_node: SNode) -> None:
        self._root = root_node
        self._program = program.get()
        self.destroyed = False

    def destroy(self) -> None:
        """Free the storage of every field in the tree (and of their ``.grad``/``.dual``).
        Using one of those fields afterwards raises. Kernels compiled before recompile at their
        next call (they held the storage's address), as in Taichi."""
        if self.destroyed:
            raise DifftapeError("SNode tree has been destroyed")
        prog = program.get()
        if prog is not self._program:  # ti.init/ti.reset already dropped its fields
            return
        for node in self._root._subtree():
            for f in node.fields:
                for c in (f, f._grad, f._dual, f._grad._dual if f._grad is not None else None,
                          f.mark):
                    if c is not None:
                        c._release()
            if node.activity is not None:
                node.activity._release()
        prog.invalidate_kernels()
        self.destroyed = True


_matrix.register_storage(make_field=make_field)
