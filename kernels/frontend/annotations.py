"""Kernel parameter annotations: ``ti.template()``, ``ti.types.ndarray()`` and scalar types."""

from __future__ import annotations

from dataclasses import dataclass


class Template:
    """``ti.template()``: the argument is bound at compile time (a field, a number, a func);
    each distinct value compiles its own instance."""

    def __repr__(self) -> str:
        return "template()"


def template() -> Template:
    return Template()


@dataclass
class NdarrayType:
    """``ti.types.ndarray(dtype=None, ndim=None)``: an array passed by pointer."""

    dtype: object = None
    ndim: int | None = None
    needs_grad: bool | None = None
    boundary: str = "unsafe"

    def __call__(self, *a, **kw):  # allow ti.types.ndarray used without parentheses
        return NdarrayType(*a, **kw)


def ndarray_type(dtype=None, ndim: int | None = None, needs_grad: bool | None = None,
                 boundary: str = "unsafe", **_: object) -> NdarrayType:
    return NdarrayType(dtype, ndim, needs_grad, boundary)
