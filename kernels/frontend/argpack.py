"""``ti.types.argpack``: a kernel parameter that bundles named arguments.

An argument pack holds scalars, vectors/matrices, structs, ndarrays and other packs. It exists
at the kernel boundary only: a kernel flattens each pack parameter into one parameter per
member (``pack.a``, ``pack.c.b`` for a nested pack), of the member's own annotation, so every
member is passed, checked and specialized exactly as that kind of argument is; in the kernel
body the parameter's name is bound to an :class:`ArgPackView` whose attributes are those
members. A pack is no value a kernel can build or return, nor a struct member, as in Taichi.
"""

from __future__ import annotations

from typing import Any

from ..errors import ArgumentError
from . import ops
from .annotations import NdarrayType
from .matrix import MatrixType
from .struct import StructType


class ArgPackType:
    """``ti.types.argpack(a=ti.i32, v=ti.math.vec3, arr=ti.types.ndarray(...), ...)``."""

    #: Read by ``ti.types.struct``, which refuses a pack as a member.
    kernel_parameter_only = True

    def __init__(self, **members) -> None:
        self.members: dict[str, Any] = {}
        for k, dt in members.items():
            if not isinstance(dt, ArgPackType | StructType | MatrixType | NdarrayType):
                dt = ops.resolve_dtype(dt)  # a bad member type fails here, not at first use
            self.members[k] = dt

    def __call__(self, *args, **kwargs) -> ArgPack:
        """A pack of these members (by position or name; every member must be given)."""
        if len(args) > len(self.members):
            raise ArgumentError(f"{self!r} has {len(self.members)} members, got {len(args)} "
                                "values")
        values = dict(zip(self.members, args, strict=False))
        for k, v in kwargs.items():
            if k not in self.members or k in values:
                why = "unknown" if k not in self.members else "repeated"
                raise ArgumentError(f"{self!r}: {why} member '{k}'")
            values[k] = v
        missing = [k for k in self.members if k not in values]
        if missing:
            raise ArgumentError(f"{self!r}: no value for member(s) {', '.join(missing)}")
        entries = {}
        for k, dt in self.members.items():
            v = values[k]
            if isinstance(dt, StructType):
                v = dt.cast(v)
            elif isinstance(dt, MatrixType):
                v = dt(v)
            entries[k] = v
        return ArgPack(self, entries)

    def leaves(self, prefix: str) -> list[tuple[str, Any]]:
        """(parameter name, annotation) of every member, nested packs flattened, in order."""
        out: list[tuple[str, Any]] = []
        for k, dt in self.members.items():
            if isinstance(dt, ArgPackType):
                out.extend(dt.leaves(f"{prefix}.{k}"))
            else:
                out.append((f"{prefix}.{k}", dt))
        return out

    def __repr__(self) -> str:
        return "<ti.ArgPackType " + ", ".join(f"{k}={dt!r}" for k, dt in self.members.items()) \
            + ">"


class ArgPack:
    """A value of an :class:`ArgPackType`, passed to a kernel (Python scope)."""

    def __init__(self, ptype: ArgPackType, entries: dict[str, Any]) -> None:
        self.type = ptype
        self._entries = entries

    def __getattr__(self, name: str):
        entries = self.__dict__.get("_entries", {})
        if name in entries:
            return entries[name]
        raise AttributeError(f"this argument pack has no member '{name}'")

    def flat(self, ptype: ArgPackType, what: str) -> list:
        """The member values in the order of ``ptype.leaves``; ``self`` must be of ``ptype``."""
        if self.type is not ptype and list(self.type.members) != list(ptype.members):
            raise ArgumentError(f"{what} must be a {ptype!r}, got a {self.type!r}")
        out: list = []
        for k, dt in ptype.members.items():
            v = self._entries[k]
            if isinstance(dt, ArgPackType):
                if not isinstance(v, ArgPack):
                    raise ArgumentError(f"{what}: member '{k}' must be a {dt!r}, got a "
                                        f"{type(v).__name__}")
                out.extend(v.flat(dt, f"{what}.{k}"))
            else:
                out.append(v)
        return out

    def __repr__(self) -> str:
        return "ArgPack(" + ", ".join(f"{k}={v!r}" for k, v in self._entries.items()) + ")"


class ArgPackView:
    """A pack parameter inside a kernel: its members (kernel values) as attributes."""

    def __init__(self, members: dict[str, Any]) -> None:
        self.__dict__.update(members)


def bind_view(ptype: ArgPackType, prefix: str, bound: dict[str, Any]) -> ArgPackView:
    """The kernel-side pack for parameter ``prefix``, from its flattened members as bound
    (``bound["pack.a"]``...)."""
    return ArgPackView({k: bind_view(dt, f"{prefix}.{k}", bound) if isinstance(dt, ArgPackType)
                        else bound[f"{prefix}.{k}"] for k, dt in ptype.members.items()})
