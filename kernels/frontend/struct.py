"""Structs: named members (scalars, vectors/matrices, structs), unrolled like matrices.

A :class:`Struct` is an ordered dict of members. As with :class:`~.matrix.Matrix`, nothing of
it reaches the IR: inside a kernel its members are kernel values or places (locals, field
elements), so a struct local is a set of scalar locals, a struct field is one field per member
(:class:`StructField`), and a struct argument or return of a kernel is its scalars. Member
access is attribute access (``s.a``), also when a member is called ``keys`` or ``items``:
each set of member names has a class whose properties are the members.

:class:`StructType` (``ti.types.struct(...)``, ``@ti.dataclass``) constructs and casts
structs, makes struct fields and serves as an annotation.
"""

from __future__ import annotations

import numbers
import sys
from types import MethodType
from typing import Any

import numpy as np

from ..errors import KernelSyntaxError
from . import builder as _b
from . import field as _field
from . import ops
from .field import Field, assign, axes, make_field, root
from .matrix import Matrix, MatrixType, _coerce
from .values import Ref, Value

_CLASSES: dict[tuple[str, ...], type] = {}


def _struct_class(keys: tuple[str, ...]) -> type:
    """The Struct subclass whose properties are these member names (made once per set)."""
    cls = _CLASSES.get(keys)
    if cls is None:
        props = {k: property(lambda s, k=k: s._get(k), lambda s, v, k=k: s._set(k, v))
                 for k in keys}
        cls = _CLASSES[keys] = type("Struct", (Struct,), props)
    return cls


class _HostSlot:
    """A scalar member of a struct field element in Python scope: reads and writes go to the
    field (``x[i].a = 1`` writes ``x.a[i]``)."""

    __slots__ = ("field", "key")

    def __init__(self, field, key) -> None:
        self.field, self.key = field, key

    def get(self):
        return self.field[self.key]

    def set(self, value) -> None:
        self.field[self.key] = value


class Struct:
    """``ti.Struct``: ``ti.Struct(a=1, v=[1, 2])`` or ``ti.Struct({"a": 1, ...})``. Lists
    become vectors/matrices and dicts nested structs. Inside a kernel, members are loaded
    (a struct built from a field element is a copy of its values)."""

    def __init__(self, *args, **kwargs) -> None:
        if len(args) == 1 and not kwargs and isinstance(args[0], dict):
            entries = dict(args[0])
        elif not args:
            entries = dict(kwargs)
        else:
            raise ops._err("ti.Struct takes a dict or keyword arguments", KernelSyntaxError)
        methods = entries.pop("__struct_methods", {})
        entries.pop("__matrix_ndim", None)
        in_kernel = _b.current() is not None
        for k, v in entries.items():
            if isinstance(v, list | tuple):
                v = Matrix(list(v))
            elif isinstance(v, dict):
                v = Struct(v)
            entries[k] = load_places(v) if in_kernel else v
        self.__class__ = _struct_class(tuple(entries))
        self._setup(entries, methods, None)

    @classmethod
    def _make(cls, entries: dict, methods: dict | None = None,
              stype: StructType | None = None) -> Struct:
        obj = object.__new__(_struct_class(tuple(entries)))
        obj._setup(entries, methods or {}, stype)
        return obj

    def _setup(self, entries: dict, methods: dict, stype: StructType | None) -> None:
        object.__setattr__(self, "_entries", entries)
        object.__setattr__(self, "_methods", methods)
        object.__setattr__(self, "_type", stype)
        for name, fn in methods.items():
            object.__setattr__(self, name, MethodType(fn, self))

    def _with(self, entries: dict) -> Struct:
        """A struct of the same type and methods with other members."""
        return Struct._make(entries, self._methods, self._type)

    # ------------------------------------------------------------------ members
    def _get(self, key: str):
        v = self._entries[key]
        return v.get() if isinstance(v, _HostSlot) else v

    def _set(self, key: str, value) -> None:
        entry = self._entries[key]
        bld = _b.current()
        if bld is not None:
            if not is_place(entry):
                raise bld.error(f"member '{key}' of this struct is a value, not a variable: "
                                "assign the struct to a name first")
            assign(entry, _coerce_member(entry, value))
            return
        if isinstance(entry, _HostSlot):
            entry.set(value)
        elif isinstance(entry, Struct):
            entry._set_entries(value)
        elif isinstance(entry, Matrix):
            _set_matrix(entry, value)
        elif isinstance(value, numbers.Number | np.generic):
            self._entries[key] = value
        else:
            raise TypeError(f"struct member '{key}' holds a number; cannot assign a "
                            f"{type(value).__name__} to it")

    def _set_entries(self, value) -> None:
        """Python scope: set every member from a struct or dict with the same members."""
        if isinstance(value, dict):
            value = Struct(value)
        if not isinstance(value, Struct) or list(value._entries) != list(self._entries):
            raise TypeError(f"cannot assign {value!r} to a struct with members "
                            f"{list(self._entries)}")
        for k in self._entries:
            self._set(k, value._get(k))

    def __getitem__(self, key: str):
        return self._get(key)

    def __setitem__(self, key: str, value) -> None:
        self._set(key, value)

    @property
    def keys(self) -> list[str]:
        return list(self._entries)

    @property
    def items(self):
        return {k: self._get(k) for k in self._entries}.items()

    @property
    def entries(self) -> dict:
        return {k: self._get(k) for k in self._entries}

    @property
    def methods(self) -> dict:
        return self._methods

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self):
        return iter([self._get(k) for k in self._entries])

    def to_dict(self, include_methods: bool = False, include_ndim: bool = False) -> dict:
        out: dict[str, Any] = {}
        for k in self._entries:
            v = self._get(k)
            out[k] = v.to_dict(include_methods, include_ndim) if isinstance(v, Struct) else \
                v.to_list() if isinstance(v, Matrix) else v
        if include_methods:
            out["__struct_methods"] = self._methods
        if include_ndim:
            out["__matrix_ndim"] = {k: v.ndim for k, v in self._entries.items()
                                    if isinstance(v, Matrix)}
        return out

    def __repr__(self) -> str:
        return str(self.to_dict())

    __str__ = __repr__

    def _leaves(self) -> list:
        """Every scalar of the struct, members in order (vectors entry by entry)."""
        out: list = []
        for k in self._entries:
            v = self._get(k)
            if isinstance(v, Struct):
                out.extend(v._leaves())
            elif isinstance(v, Matrix):
                out.extend(v.entries)
            else:
                out.append(v)
        return out

    @classmethod
    def field(cls, members: dict, methods: dict | None = None, shape=None,
              name: str = "<Struct>", offset=None, needs_grad: bool = False,
              needs_dual: bool = False, layout=None,
              stype: StructType | None = None) -> StructField:
        """``ti.Struct.field({"a": ti.f32, "v": vec3}, shape=n)``: one field per member
        (nested structs: struct fields), placed together when ``shape`` is given, from
        ``offset`` if given (see ``Field.offset``). ``layout`` is Taichi's memory layout
        (:class:`~difftape.frontend.field.Layout`), which changes no value."""
        _field.check_layout(layout)
        if offset is not None and shape is None:
            raise KernelSyntaxError("shape cannot be None when offset is set: give the struct "
                                    "field a shape, or place it with "
                                    "ti.root.dense(...).place(x, offset=...)")
        fields: dict[str, Any] = {}
        for k, dt in members.items():
            if isinstance(dt, StructType):
                fields[k] = dt.field(name=f"{name}.{k}", needs_grad=needs_grad,
                                     needs_dual=needs_dual)
            else:
                fields[k] = make_field(dt, None, needs_grad=needs_grad, needs_dual=needs_dual,
                                       name=f"{name}.{k}")
        sf = StructField(fields, methods or {}, name, stype)
        if shape is not None:  # placed here with the .grad/.dual asked for
            shape = (shape,) if isinstance(shape, numbers.Integral) else tuple(shape)
            companions = [c for c, need in ((sf.grad, needs_grad), (sf.dual, needs_dual))
                          if need]
            root.dense(axes(*range(len(shape))), shape).place(sf, *companions, offset=offset)
        return sf


def _set_matrix(target: Matrix, value) -> None:
    """Python scope: write a vector/matrix member (through to the field for an element)."""
    entries = value.entries if isinstance(value, Matrix) else \
        np.asarray(value).ravel().tolist() if not isinstance(value, numbers.Number) else \
        [value] * len(target.entries)
    if len(entries) != len(target.entries):
        raise TypeError(f"cannot assign {len(entries)} values to a {target._shape_text()}")
    for k, e in enumerate(entries):
        target._assign_entry(k, e)


def _coerce_member(entry, value):
    if isinstance(entry, Matrix) and isinstance(value, list | tuple):
        return _coerce(value)
    if isinstance(entry, Struct) and isinstance(value, dict):
        return Struct(value)
    return value


def load_places(x):
    """``x`` with its places loaded (members of structs too)."""
    if isinstance(x, Ref):
        return x.expr()
    if isinstance(x, Matrix):
        return x._values() if any(isinstance(e, Ref) for e in x.entries) else x
    if isinstance(x, Struct):
        return x._with({k: load_places(x._get(k)) for k in x._entries})
    return x


def is_place(x) -> bool:
    if isinstance(x, Ref):
        return True
    if isinstance(x, Matrix):
        return all(isinstance(e, Ref) for e in x.entries)
    if isinstance(x, Struct):
        return all(is_place(v) for v in x._entries.values())
    return False


def has_runtime_values(x) -> bool:
    """Does a struct hold kernel values (not only compile-time numbers)?"""
    return any(isinstance(e, Value) for e in x._leaves())


# --------------------------------------------------------------------------- struct types


class StructType:
    """``ti.types.struct(a=ti.f32, v=vec3, ...)``: constructs structs (members by position
    or name, missing ones 0, each cast to its type), makes struct fields, annotates func and
    kernel parameters and returns."""

    def __init__(self, **kwargs) -> None:
        self.members: dict[str, Any] = {}
        self.methods: dict = {}
        for k, dt in kwargs.items():
            if k == "__struct_methods":
                self.methods = dt
            elif isinstance(dt, StructType | MatrixType):
                self.members[k] = dt
            elif getattr(dt, "kernel_parameter_only", False):  # ti.types.argpack
                raise ValueError(f"Invalid data type {dt!r}: an argument pack is a kernel "
                                 "parameter only, not a struct member")
            else:
                ops.resolve_dtype(dt)  # a bad member type fails here, not at first use
                self.members[k] = dt

    def __call__(self, *args, **kwargs) -> Struct:
        if len(args) > len(self.members):
            raise ops._err(f"{self!r} has {len(self.members)} members, got {len(args)} values")
        entries = {}
        for index, (name, dt) in enumerate(self.members.items()):
            data = args[index] if index < len(args) else kwargs.get(name, 0)
            if isinstance(dt, StructType | MatrixType) and not isinstance(data, dict | Struct):
                data = dt(data)
            entries[name] = data
        return self.cast(Struct._make(entries))

    def cast(self, value) -> Struct:
        """``value`` (a struct or dict with these members) converted member by member."""
        if isinstance(value, dict):
            value = Struct(value)
        if not isinstance(value, Struct) or list(value._entries) != list(self.members):
            got = list(value._entries) if isinstance(value, Struct) else type(value).__name__
            raise ops._err(f"{self!r} needs a struct with members {list(self.members)}, got "
                           f"{got}")
        entries = {}
        in_kernel = _b.current() is not None
        for k, dt in self.members.items():
            v = value._get(k)
            if isinstance(dt, MatrixType):
                v = load_places(v) if isinstance(v, Matrix) else v
                if isinstance(v, Matrix):
                    if len(v.entries) != dt.n * (dt.m if dt.ndim == 2 else 1):
                        raise ops._err(f"member '{k}' should be a {dt!r}, got a "
                                       f"{v._shape_text()}")
                    v = Matrix._from_entries(v.entries, dt.n, dt.m if dt.ndim == 2 else 1,
                                             dt.ndim)
                entries[k] = dt(v)
            elif isinstance(dt, StructType):
                entries[k] = dt.cast(v)
            elif in_kernel:
                if isinstance(v, Matrix | Struct):
                    raise ops._err(f"member '{k}' is a scalar ({dt!r}), got a "
                                   f"{type(v).__name__}")
                entries[k] = ops.cast(load_places(v), ops.resolve_dtype(dt))
            else:
                t = ops.resolve_dtype(dt)
                entries[k] = int(v) if t.is_int else float(v)
        return Struct._make(entries, self.methods, self)

    def filled_with_scalar(self, value) -> Struct:
        return self(*[value] * len(self.members))

    def field(self, shape=None, needs_grad: bool = False, needs_dual: bool = False,
              name: str = "<Struct>", **kw) -> StructField:
        return Struct.field(self.members, self.methods, shape=shape, name=name,
                            needs_grad=needs_grad, needs_dual=needs_dual, stype=self, **kw)

    def leaves(self, prefix: str = "") -> list[tuple[str, Any]]:
        """(path, dtype) of every scalar, in member order: ``a``, ``v[0]``, ``s.b``..."""
        out: list[tuple[str, Any]] = []
        for k, dt in self.members.items():
            path = f"{prefix}.{k}" if prefix else k
            if isinstance(dt, StructType):
                out.extend(dt.leaves(path))
            elif isinstance(dt, MatrixType):
                size = dt.n * (dt.m if dt.ndim == 2 else 1)
                out.extend((f"{path}[{i}]", dt.scalar_dtype) for i in range(size))
            else:
                out.append((path, ops.resolve_dtype(dt)))
        return out

    def from_leaves(self, values: list) -> Struct:
        """The struct whose scalars (in :meth:`leaves` order) are ``values``."""
        it = iter(values)

        def build(st: StructType) -> Struct:
            entries = {}
            for k, dt in st.members.items():
                if isinstance(dt, StructType):
                    entries[k] = build(dt)
                elif isinstance(dt, MatrixType):
                    m = dt.m if dt.ndim == 2 else 1
                    entries[k] = Matrix._from_entries([next(it) for _ in range(dt.n * m)],
                                                      dt.n, m, dt.ndim)
                else:
                    entries[k] = next(it)
            return Struct._make(entries, st.methods, st)

        return build(self)

    def __repr__(self) -> str:
        items = ", ".join(f"{k}={v!r}" for k, v in self.members.items())
        return f"<ti.StructType {items}, struct_methods={self.methods}>"


def struct(**kwargs) -> StructType:
    """``ti.types.struct(a=ti.f32, v=ti.math.vec3)``."""
    return StructType(**kwargs)


def dataclass(cls) -> StructType:
    """``@ti.dataclass``: a class's annotated members and its methods (``@ti.func`` ones
    callable in kernels, plain ones in Python scope) as a struct type."""
    annotations = dict(getattr(cls, "__annotations__", {}))
    module = sys.modules.get(cls.__module__)
    for k, v in annotations.items():
        if hasattr(cls, k):
            raise KernelSyntaxError("Default value in @dataclass is not supported.")
        if isinstance(v, str):  # `from __future__ import annotations`
            annotations[k] = eval(v, vars(module) if module else {}, dict(vars(cls)))  # noqa: S307
    methods = {a: getattr(cls, a) for a in dir(cls)
               if callable(getattr(cls, a)) and not a.startswith("__")}
    return StructType(**annotations, __struct_methods=methods)


# --------------------------------------------------------------------------- struct fields


_LIST_METHODS = ("append", "length", "deactivate")


class StructField:
    """A field of structs: one field per member (``x.a`` is the member field), so
    ``x[i].a`` and ``x.a[i]`` are the same element. ``to_numpy``/``from_numpy`` take dicts
    of arrays; ``.grad``/``.dual`` are struct fields of the members' ``.grad``/``.dual``."""

    def __init__(self, fields: dict, methods: dict, name: str = "<Struct>",
                 stype: StructType | None = None) -> None:
        self.field_dict = fields
        self.struct_methods = methods
        self.name = name
        self.struct_type = stype  # its elements' type, when made by a ti.types.struct
        for k, f in fields.items():
            # a member shadows the list methods (as Taichi's instance attributes do), not the
            # properties
            if k in _LIST_METHODS or k not in type(self).__dict__ and not hasattr(StructField, k):
                setattr(self, k, f)

    @property
    def keys(self) -> list[str]:
        return list(self.field_dict)

    @property
    def _members(self) -> list:
        return list(self.field_dict.values())

    def get_member_field(self, key: str):
        return self.field_dict[key]

    def _stop_gradient(self, bld) -> None:
        # Taichi 1.7.4 stops only the first member here (the struct field's snode is its
        # first member's): refused rather than copied or guessed.
        raise bld.error("ti.stop_grad() of a struct field is not supported (Taichi stops "
                        "only its first member): stop its member fields instead, e.g. "
                        f"ti.stop_grad(s.{self.keys[0]}) for a struct field s")

    def leaf_fields(self) -> list:
        """The plain fields behind this struct field (nested structs flattened)."""
        out = []
        for f in self.field_dict.values():
            out.extend(f.leaf_fields() if isinstance(f, StructField) else [f])
        return out

    @property
    def shape(self) -> tuple[int, ...]:
        return self._members[0].shape

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def offset(self) -> tuple[int, ...]:
        """Its members' ``offset`` (they are placed together)."""
        return self._members[0].offset

    def _companion(self, role: str) -> StructField | None:
        comps = {k: getattr(f, role) for k, f in self.field_dict.items()}
        if any(c is None for c in comps.values()):
            return None
        return StructField(comps, self.struct_methods, f"{self.name}.{role}", self.struct_type)

    @property
    def grad(self) -> StructField | None:
        return self._companion("grad")

    @property
    def dual(self) -> StructField | None:
        return self._companion("dual")

    def __getitem__(self, key) -> Struct:
        if _b.current() is not None:
            if self.leaf_fields()[0]._dynamic() is not None:  # x[i] of a list: one index short
                row = _field.dynamic_row(self, key)
                if row is not None:
                    return row
            entries = {k: f[key] for k, f in self.field_dict.items()}
        else:
            entries = {k: _HostSlot(f, key) if isinstance(f, Field) and not f.element_shape
                       else f[key] for k, f in self.field_dict.items()}
        return Struct._make(entries, self.struct_methods, self.struct_type)

    def __setitem__(self, key, value) -> None:
        element = self[key]
        bld = _b.current()
        if bld is None:
            element._set_entries(value)
            return
        assign(element, Struct(value) if isinstance(value, dict) else value)

    @_b.python_scope
    def to_numpy(self) -> dict:
        return {k: f.to_numpy() for k, f in self.field_dict.items()}

    @_b.python_scope
    def from_numpy(self, arrays: dict) -> None:
        for k, f in self.field_dict.items():
            f.from_numpy(arrays[k])

    @_b.python_scope
    def copy_from(self, other: StructField) -> None:
        if not isinstance(other, StructField) or other.keys != self.keys:
            raise TypeError("copy_from needs a struct field with the same members")
        for k, f in self.field_dict.items():
            f.copy_from(other.field_dict[k])

    # ``x.append(s)``, ``x.length()``, ``x.deactivate()`` of a struct field placed in a 1-D
    # dynamic SNode: a list of structs
    def append(self, value):
        return _field.dynamic_op(self, "append", (), value)

    def length(self):
        return _field.dynamic_op(self, "length", ())

    def deactivate(self):
        return _field.dynamic_op(self, "deactivate", ())

    def fill(self, value) -> None:
        """Every member of every element set to ``value`` (in a kernel: loops run at each
        launch)."""
        for f in self.field_dict.values():
            f.fill(value)

    def __repr__(self) -> str:
        members = ", ".join(f"{k}: {_member_text(f)}" for k, f in self.field_dict.items())
        shape = next(iter(self.field_dict.values())).shape if self.field_dict else ()
        name = "" if self.name.startswith("<") else f" {self.name}"
        return f"<ti.Struct.field{name}: {{{members}}}, shape {shape}>"

    __hash__ = object.__hash__


def _member_text(f) -> str:
    """A struct field's member in its repr: its dtype, element shape or members."""
    if isinstance(f, StructField):
        return "{" + ", ".join(f"{k}: {_member_text(g)}" for k, g in f.field_dict.items()) + "}"
    if f.element_shape:
        return f"{f.dtype}{list(f.element_shape)}"
    return str(f.dtype)


_field.bind(Struct=Struct, StructField=StructField)
