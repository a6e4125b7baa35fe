"""``ti.ndarray``: an array passed to kernels as an argument (not captured like a field).

Kernels with ``ti.types.ndarray()`` parameters also accept NumPy arrays directly; both are
passed by pointer, never copied, so a kernel's writes are visible in the caller's array.
"""

from __future__ import annotations

import numbers

import numpy as np

from ..errors import ShapeError
from ..frontend.builder import python_scope


class Ndarray:
    """A NumPy-backed array with an element shape (scalar, vector or matrix elements)."""

    def __init__(self, dtype, shape, element_shape=(), needs_grad: bool = False,
                 _arr: np.ndarray | None = None) -> None:
        from ..frontend.matrix import MatrixType
        from ..frontend.ops import resolve_dtype

        if isinstance(dtype, MatrixType):
            element_shape = dtype.element_shape
            dtype = dtype.scalar_dtype
        self.dtype = resolve_dtype(dtype)
        shape = (int(shape),) if isinstance(shape, numbers.Integral) else tuple(shape)
        self.shape = shape
        self.element_shape = tuple(element_shape)
        self.arr = _arr if _arr is not None else np.zeros(shape + self.element_shape,
                                                          dtype=self.dtype.np)
        self.grad = Ndarray(self.dtype, shape, self.element_shape) if needs_grad else None

    @python_scope
    def __getitem__(self, key):
        from .field import _to_python

        return _to_python(self.arr[key], self.element_shape)

    @python_scope
    def __setitem__(self, key, value) -> None:
        self.arr[key] = value

    @python_scope
    def to_numpy(self) -> np.ndarray:
        return self.arr.copy()

    @python_scope
    def from_numpy(self, arr) -> None:
        arr = np.asarray(arr)
        if arr.shape != self.arr.shape:
            raise ShapeError(f"from_numpy: ndarray has shape {self.arr.shape}, array has "
                             f"{arr.shape}")
        np.copyto(self.arr, arr, casting="unsafe")

    @python_scope
    def fill(self, value) -> None:
        self.arr[...] = value

    def __repr__(self) -> str:
        return f"<difftape Ndarray {self.dtype} shape={self.shape} element={self.element_shape}>"


def ndarray(dtype, shape, needs_grad: bool = False) -> Ndarray:
    """``ti.ndarray(dtype, shape)``."""
    return Ndarray(dtype, shape, needs_grad=needs_grad)
