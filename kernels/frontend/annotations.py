"""Kernel parameter annotations: ``ti.template()``, ``ti.types.ndarray()`` and scalar types."""

from __future__ import annotations

import inspect
import typing

from .. import types as T
from ..errors import ArgumentError, KernelSyntaxError
from .matrix import MatrixType, matrix, vector
from .ops import resolve_dtype

BOUNDARIES = ("unsafe", "clamp")


class Template:
    """``ti.template()``: the argument is bound at compile time (a field, a number, a func);
    each distinct value compiles its own instance."""

    def __repr__(self) -> str:
        return "template()"


def template() -> Template:
    return Template()


class RefType:
    """``ti.ref(dtype)``: a func parameter bound to the caller's variable (or field element)
    itself, so that assignments to it inside the func change the caller's."""

    def __init__(self, dtype) -> None:
        self.dtype = dtype

    def __repr__(self) -> str:
        return f"ref({self.dtype})"


def ref(dtype) -> RefType:
    return RefType(dtype)


class NdarrayType:
    """``ti.types.ndarray(dtype=None, ndim=None, element_dim=None, element_shape=None,
    needs_grad=None, boundary="unsafe")``: an array passed by pointer.

    ``dtype`` is a scalar type or a ``ti.types.vector/matrix`` (whose sizes may be None: any
    size); ``element_dim``/``element_shape`` are the older spelling of a vector/matrix dtype.
    ``needs_grad``: None follows the argument (its ``.grad`` is used when it has one); False
    compiles the kernel as if it had none; True requires one. ``boundary="clamp"`` clamps every
    index into the array (reads and writes out of range go to the nearest element).
    """

    def __init__(self, dtype=None, ndim: int | None = None, element_dim: int | None = None,
                 element_shape: tuple | None = None, field_dim: int | None = None,
                 needs_grad: bool | None = None, boundary: str = "unsafe") -> None:
        if field_dim is not None:
            raise ArgumentError("ti.types.ndarray(field_dim=...) is deprecated (as in Taichi): "
                                "use ndim=")
        if element_dim is not None or element_shape is not None:
            dtype = _element_dtype(element_dim, element_shape, dtype)
        if ndim is not None and (not isinstance(ndim, int) or ndim < 0):
            raise ArgumentError(f"ti.types.ndarray(ndim=...) must be a non-negative int, got "
                                f"{ndim!r}")
        if boundary not in BOUNDARIES:
            raise ArgumentError(f"Invalid boundary argument: {boundary!r} (use 'unsafe' or "
                                "'clamp')")
        self.dtype = dtype
        self.ndim = ndim
        self.needs_grad = needs_grad
        self.boundary = boundary

    def __repr__(self) -> str:
        return (f"ndarray(dtype={self.dtype}, ndim={self.ndim}, needs_grad={self.needs_grad}, "
                f"boundary={self.boundary!r})")



def _element_matches(want: MatrixType, esh: tuple, dtype: T.DType | None) -> bool:
    """Does an element of shape ``esh`` (and scalar type ``dtype``, when given) fit ``want``?
    None sizes in ``want`` (``ti.types.vector()``) match any size."""
    sizes = (want.n,) if want.ndim == 1 else (want.n, want.m)
    if len(esh) != len(sizes) or any(s is not None and s != e for s, e in zip(sizes, esh,
                                                                               strict=True)):
        return False
    return dtype is None or want.dtype is None or resolve_dtype(want.dtype) == dtype


def _element_text(want: MatrixType) -> str:
    size = lambda k: "any" if k is None else str(k)  # noqa: E731
    dt = "" if want.dtype is None else f" of {resolve_dtype(want.dtype)}"
    if want.ndim == 1:
        return f"{size(want.n)}-vector{dt}"
    return f"{size(want.n)}x{size(want.m)} matrix{dt}"


def ndarray_mismatch(ann: NdarrayType, dtype: T.DType, ndim: int, esh: tuple) -> str | None:
    """What in an array of ``ndim`` axes of elements of shape ``esh`` and scalar type ``dtype``
    does not fit ``ann`` (None: it fits), in Taichi's words ("Invalid value for argument ...")
    first. The one check of ndarrays a func is given (kernels check theirs at launch)."""
    want = ann.dtype
    got = (f"{esh[0]}-vector elements of {dtype}" if len(esh) == 1 else
           f"{esh[0]}x{esh[1]} matrix elements of {dtype}" if esh else f"{dtype} elements")
    if isinstance(want, MatrixType):
        if not _element_matches(want, esh, dtype):
            return (f"required element type: {_element_text(want)}, but an ndarray of {got} "
                    "is provided")
    elif want is not None and (esh or resolve_dtype(want) != dtype):
        return (f"required element type: {resolve_dtype(want)}, but an ndarray of {got} is "
                "provided")
    if ann.ndim is not None and ann.ndim != ndim:
        return f"required ndim={ann.ndim}, but an ndarray with {ndim} dimension(s) is provided"
    return None


class SparseMatrixBuilderType(NdarrayType):
    """``ti.types.sparse_matrix_builder()``: a ``ti.linalg.SparseMatrixBuilder`` argument.

    It is passed like an ndarray (one compiled kernel serves every builder of the same
    dtype): the builder's triplet storage, an integer array laid out as in
    :data:`TRIPLET_HEADER`. Inside the kernel ``A[i, j] += v`` (or ``-=``) appends a triplet
    (``transformer.TripletArg``).
    """

    def __init__(self) -> None:
        super().__init__(dtype=None, ndim=1)

    def __repr__(self) -> str:
        return "sparse_matrix_builder()"


def sparse_matrix_builder() -> SparseMatrixBuilderType:
    return SparseMatrixBuilderType()


#: A builder's triplet storage: ``[count, rows, cols]`` then ``(row, col, value bits)`` per
#: triplet, in the integer type as wide as the value type (i32 for f32, i64 for f64) so that
#: one array argument carries everything; ``count`` may exceed the capacity after an overflow
#: (which the launch reports), so ``build()`` can refuse too.
TRIPLET_HEADER = 3
#: The value type of a builder whose storage has this integer type.
TRIPLET_VALUE = {"i32": "f32", "i64": "f64"}

def _element_dtype(element_dim: int | None, element_shape: tuple | None, dtype):
    """The vector/matrix dtype that ``element_dim``/``element_shape`` describe."""
    if isinstance(dtype, MatrixType):
        raise ArgumentError(f"cannot give both a vector/matrix dtype ({dtype!r}) and "
                            "element_dim/element_shape")
    if element_shape is not None:
        element_shape = tuple(element_shape)
    if element_dim is not None:
        if element_dim not in (0, 1, 2):
            raise ArgumentError("ti.types.ndarray(element_dim=...) must be 0 (scalars), "
                                "1 (vectors) or 2 (matrices)")
        if element_shape is not None and len(element_shape) != element_dim:
            raise ArgumentError(f"element_shape {element_shape} does not have element_dim="
                                f"{element_dim} entries")
    dim = element_dim if element_dim is not None else len(element_shape)
    shape = element_shape if element_shape is not None else (None,) * dim
    if dim == 0:
        return dtype
    if dim == 1:
        return vector(shape[0], dtype)
    if dim == 2:
        return matrix(shape[0], shape[1], dtype)
    raise ArgumentError("only scalars, vectors and matrices can be elements of ti.types.ndarray()")


def _resolve_annotation(ann, fn):
    if ann is inspect.Parameter.empty or ann is inspect.Signature.empty:
        return None
    if isinstance(ann, str):
        try:
            ann = eval(ann, fn.__globals__)  # noqa: S307 - the user's own annotation text
        except Exception as e:
            raise KernelSyntaxError(
                f"Invalid type annotation {ann!r} of '{fn.__name__}': it cannot be evaluated "
                f"({e}); an annotation must name a type defined before the kernel or func "
                "(ti.f32, a ti.types.vector/struct type, ti.template() ...)") from None
    if ann is None:
        return None
    if isinstance(ann, type) and issubclass(ann, NdarrayType):
        return NdarrayType()
    if typing.get_origin(ann) is tuple:  # typing.Tuple[f32, vec2] / tuple[...]: several values
        return tuple(_resolve_annotation(a, fn) for a in typing.get_args(ann))
    return ann


def signature_text(pyfunc) -> str:
    """``(a: f32, x: template()) -> f32``: a kernel's or func's parameters as written, for its
    ``repr`` (types by name, difftape's annotation objects by their own ``repr``)."""

    def text(annotation) -> str:
        if isinstance(annotation, str):  # `from __future__ import annotations`
            return annotation
        return annotation.__name__ if isinstance(annotation, type) else repr(annotation)

    try:
        sig = inspect.signature(pyfunc)
    except (TypeError, ValueError):
        return "(...)"
    params = [p.name if p.annotation is inspect.Parameter.empty
              else f"{p.name}: {text(p.annotation)}" for p in sig.parameters.values()]
    ret = ("" if sig.return_annotation is inspect.Signature.empty
           else f" -> {text(sig.return_annotation)}")
    return f"({', '.join(params)}){ret}"
