"""``ti.ndarray``: an array passed to kernels as an argument (not captured like a field).

Kernels with ``ti.types.ndarray()`` parameters also accept NumPy arrays directly; both are
passed by pointer, never copied (except Fortran-ordered NumPy arrays, see ``kernel.py``), so a
kernel's writes are visible in the caller's array.

Three classes mirror Taichi's: :class:`ScalarNdarray`, :class:`VectorNdarray` and
:class:`MatrixNdarray`, all :class:`Ndarray`; ``ti.ndarray(dtype, shape)`` picks one from the
dtype. Each owns one dense storage of shape ``shape + element_shape`` from the program's
allocator (``runtime/storage.py``), which Python scope reaches through its sync points.
"""

from __future__ import annotations

import numbers

import numpy as np

from ..errors import DifftapeError, KernelIndexError, KernelRuntimeError, ShapeError
from ..runtime import program
from ..runtime.devicearrays import borrow, is_device_array, shares_device_memory
from ..runtime.foreign import ArrayExchange, array_in, as_numpy
from ..runtime.storage import HostStorage, Storage
from ..types import from_numpy as dtype_of
from . import matrix as _matrix
from .builder import python_scope
from .field import _to_python
from .matrix import Matrix, MatrixType
from .ops import resolve_dtype


class TensorType:
    """The element type of a vector/matrix ndarray (Taichi's tensor type): its scalar type and
    its shape, as methods (``element_type()``, ``shape()``) because Taichi's are."""

    __slots__ = ("_dtype", "_shape")

    def __init__(self, dtype, shape: tuple[int, ...]) -> None:
        self._dtype, self._shape = dtype, tuple(shape)

    def element_type(self):
        return self._dtype

    def shape(self) -> list[int]:
        return list(self._shape)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TensorType) and (self._dtype, self._shape) == \
            (other._dtype, other._shape)

    def __hash__(self) -> int:
        return hash((self._dtype, self._shape))

    def __repr__(self) -> str:
        return f"[Tensor {self._shape} {self._dtype}]"


class Ndarray(ArrayExchange):
    """An array with an element shape (scalar, vector or matrix elements)."""

    # What a kernel that uses one of the Python-scope methods below should do instead.
    _python_scope_hint = ("ndarrays cannot be captured by a kernel: pass the ndarray as an "
                          "argument annotated with ti.types.ndarray()")

    def __new__(cls, *args, **kwargs):
        # arch=ti.remote: the client's subclass of ``cls`` keeps the storage on the server.
        remote = program.get().remote
        return object.__new__(remote.ndarray_class(cls) if remote is not None else cls)

    def __init__(self, dtype, shape, element_shape=(), needs_grad: bool = False,
                 _storage: Storage | None = None) -> None:
        if isinstance(dtype, MatrixType):
            element_shape = dtype.element_shape
            dtype = dtype.scalar_dtype
        self.dtype = resolve_dtype(dtype)
        self.shape = _check_shape(shape)
        self.element_shape = tuple(int(n) for n in element_shape)
        if needs_grad and not self.dtype.is_float:
            raise KernelRuntimeError(f"{self.dtype} is not supported for ndarray with "
                                     "`needs_grad=True`: only float ndarrays have gradients")
        self.grad: Ndarray | None = None
        self._allocate(_storage, needs_grad)

    def _allocate(self, storage: Storage | None, needs_grad: bool) -> None:
        """Give it storage: ``storage`` (memory it shares) or new zeroed storage from the
        program's allocator, and a ``.grad``."""
        self.storage: Storage = storage if storage is not None else \
            program.get().allocator.storage(self.shape + self.element_shape, self.dtype.np)
        if needs_grad:
            self.grad = type(self)._like(self)

    def _bind_host_array(self, arr: np.ndarray) -> bool:
        """Use ``arr`` (C-contiguous, of this ndarray's full shape and dtype) as the storage:
        shared, not copied, when storage is host memory (True; interop points an ndarray at a
        tensor's buffer this way); copied in when it is device memory (False: the caller
        copies results back with ``to_numpy``)."""
        if self.storage.host:
            self.storage = HostStorage(arr)
            return True
        np.copyto(self.storage.write(), arr)
        return False

    @property
    def element_type(self):
        """The type of one element, as Taichi's ``ndarray.element_type``: the scalar dtype,
        or for vector/matrix elements a tensor type (``.element_type()``, ``.shape()``)."""
        return TensorType(self.dtype, self.element_shape) if self.element_shape else self.dtype

    @property
    def has_grad(self) -> bool:
        """Whether it has gradient storage (made with ``needs_grad=True``), as ``Field``."""
        return self.grad is not None

    @classmethod
    def _like(cls, other: Ndarray) -> Ndarray:
        """A zero-filled ndarray of the same class, dtype and shapes (no gradient)."""
        out = object.__new__(cls)
        Ndarray.__init__(out, other.dtype, other.shape, other.element_shape)
        return out

    # ------------------------------------------------------------------ properties
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def n(self) -> int:
        if not self.element_shape:
            raise AttributeError("a scalar ndarray has no .n")
        return self.element_shape[0]

    @property
    def m(self) -> int:
        if not self.element_shape:
            raise AttributeError("a scalar ndarray has no .m")
        return self.element_shape[1] if len(self.element_shape) > 1 else 1

    # ------------------------------------------------------------------ element access
    def _norm_key(self, key) -> tuple:
        """Taichi's Python-scope keys: one index per array axis (``None``/``()`` for 0-D);
        vector keys are flattened."""
        if key is None:
            key = ()
        elif not isinstance(key, tuple | list):
            key = (key,)
        flat: list = []
        for k in key:
            flat.extend(k.entries if isinstance(k, Matrix) else [k])
        if len(flat) != len(self.shape):
            # ti.TaichiIndexError (an IndexError too), as Taichi raises here
            raise KernelIndexError(f"{len(self.shape)}d ndarray indexed with {len(flat)}d "
                                   f"indices: {tuple(flat)}")
        out = []
        for axis, k in enumerate(flat):
            if not isinstance(k, numbers.Integral | np.integer):
                raise IndexError(f"ndarray indices must be integers, got {k!r}")
            if not -self.shape[axis] <= k < self.shape[axis]:
                raise IndexError(f"index {k} is out of bounds for axis {axis} with size "
                                 f"{self.shape[axis]}")
            out.append(int(k))
        return tuple(out)

    @python_scope
    def __getitem__(self, key):
        # Vector/matrix elements write through: nd[i][j] = v changes the ndarray.
        _capture_read("reading an ndarray element")
        key = self._norm_key(key)
        return _to_python(self.storage.read()[key], self.element_shape,
                          self._entry_writer(key) if self.element_shape else None)

    def _entry_writer(self, key: tuple[int, ...]):
        """How ``nd[i][k] = v`` writes entry ``k`` of element ``key``."""
        def store(k: int, value) -> None:
            self.storage.write()[key].reshape(-1)[k] = value
        return store

    @python_scope
    def __setitem__(self, key, value) -> None:
        key = self._norm_key(key)
        capture = _capture_write()
        if capture is not None:  # inside ti.graph.capture(): recorded
            capture.write_element(self, key, value)
            return
        self.storage.write()[key] = _element_value(value, self.element_shape)

    # ------------------------------------------------------------------ bulk access
    @python_scope
    def to_numpy(self) -> np.ndarray:
        _capture_read("ndarray.to_numpy()")
        return self.storage.read().copy()

    @python_scope
    def from_numpy(self, arr) -> None:
        source = arr
        arr = array_in(arr)
        if arr.shape != self.storage.shape:
            raise ShapeError(f"from_numpy: the ndarray has shape {self.storage.shape} (shape "
                             f"{self.shape}, element {self.element_shape}), the array has "
                             f"{arr.shape}")
        capture = _capture_write()
        if capture is not None:  # inside ti.graph.capture(): recorded
            capture.copy(self, arr, source)
            return
        np.copyto(self.storage.write(), arr, casting="unsafe")

    @python_scope
    def fill(self, value) -> None:
        """Set every element to ``value``: a scalar, or one vector/matrix element."""
        capture = _capture_write()
        if capture is not None:  # inside ti.graph.capture(): recorded
            capture.fill(self, value)
            return
        self.storage.write()[...] = _element_value(value, self.element_shape)

    @python_scope
    def copy_from(self, other: Ndarray) -> None:
        if not isinstance(other, Ndarray):
            raise TypeError(f"copy_from takes an ndarray, got {type(other).__name__}")
        if other.storage.shape != self.storage.shape:
            raise ShapeError(f"copy_from: shapes differ: {self.storage.shape} vs "
                             f"{other.storage.shape}")
        capture = _capture_write()
        if capture is not None:  # inside ti.graph.capture(): recorded
            capture.copy(self, other.storage, other)
            return
        self.storage.copy_from(other.storage)

    def __deepcopy__(self, memo=None) -> Ndarray:
        out = type(self)._like(self)
        out.copy_from(self)
        return out

    def _get_element_size(self) -> int:
        """Bytes per element (all components of a vector/matrix element)."""
        return np.dtype(self.dtype.np).itemsize * int(np.prod(self.element_shape,
                                                              dtype=np.int64))

    def _get_nelement(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def __repr__(self) -> str:
        return f"<difftape {type(self).__name__} {self.dtype} shape={self.shape} " \
               f"element={self.element_shape}>"


class ScalarNdarray(Ndarray):
    """An ndarray of scalars: ``ti.ndarray(ti.f32, shape)``."""

    def __init__(self, dtype, shape, needs_grad: bool = False) -> None:
        super().__init__(dtype, shape, (), needs_grad)


class VectorNdarray(Ndarray):
    """An ndarray of n-vectors: ``ti.Vector.ndarray(n, dtype, shape)``."""

    def __init__(self, n: int, dtype, shape, needs_grad: bool = False) -> None:
        super().__init__(dtype, shape, (n,), needs_grad)


class MatrixNdarray(Ndarray):
    """An ndarray of n x m matrices: ``ti.Matrix.ndarray(n, m, dtype, shape)``."""

    def __init__(self, n: int, m: int, dtype, shape, needs_grad: bool = False) -> None:
        super().__init__(dtype, shape, (n, m), needs_grad)


def tensor_with_grad(a, ann, what: str) -> Ndarray | None:
    """A PyTorch tensor passed to ``kernel.grad`` as an ndarray argument, as an Ndarray over
    its memory whose ``.grad`` is the memory of ``a.grad``, or None when ``a`` carries no
    gradient (not a tensor, or neither ``requires_grad`` nor a ``.grad``).

    Taichi's adjoint kernels read and write a tensor's gradient in ``tensor.grad`` (zeros are
    allocated first for a tensor that requires grad and has none); PyTorch autograd functions
    written for Taichi (``out.grad = grad_output; kernel.grad(x, out); return x.grad``)
    depend on it. Without this the gradient went nowhere and ``x.grad`` stayed zero."""
    if not hasattr(a, "requires_grad") or not hasattr(a, "grad") or isinstance(a, Ndarray):
        return None
    if a.grad is None:
        if not a.requires_grad:
            return None
        a.grad = a.detach().new_zeros(a.shape)  # as Taichi: a zeroed gradient to add into
    prog = program.get()
    if prog.remote is not None or shares_device_memory(prog.allocator):
        raise DifftapeError(f"{what} is a tensor with a gradient (.grad): kernel.grad "
                            "accumulates into tensor.grad only when the program's storage is "
                            "host memory (ti.init(arch=ti.cpu)); pass a ti.ndarray(..., "
                            "needs_grad=True) instead, or copy the tensors in and out")
    primal = as_numpy(a, what)
    grad = as_numpy(a.grad, f"the gradient (.grad) of {what}")
    if grad.shape != primal.shape or grad.dtype != primal.dtype:
        raise DifftapeError(f"the gradient (.grad) of {what} has shape {grad.shape} and dtype "
                            f"{grad.dtype}, the tensor {primal.shape} and {primal.dtype}: "
                            "they must match")
    if not (primal.flags.c_contiguous and grad.flags.c_contiguous):
        raise DifftapeError(f"{what} or its gradient (.grad) is not contiguous: kernel.grad "
                            "reads and writes them in place; pass tensor.contiguous() and "
                            "a contiguous .grad")
    want = getattr(ann, "dtype", None)
    edim = want.ndim if isinstance(want, MatrixType) else 0
    if primal.ndim < edim:
        return None  # the argument checks say what is wrong with it
    split = primal.ndim - edim
    dtype = dtype_of(primal.dtype)
    out = object.__new__(Ndarray)
    Ndarray.__init__(out, dtype, primal.shape[:split], primal.shape[split:],
                     _storage=HostStorage(primal))
    out.grad = object.__new__(Ndarray)
    Ndarray.__init__(out.grad, dtype, primal.shape[:split], primal.shape[split:],
                     _storage=HostStorage(grad))
    return out


def ndarray(dtype, shape, needs_grad: bool = False) -> Ndarray:
    """``ti.ndarray(dtype, shape, needs_grad=False)``: scalar, vector or matrix elements
    according to ``dtype`` (a scalar type or ``ti.types.vector/matrix``)."""
    if isinstance(dtype, MatrixType):
        if dtype.n is None or (dtype.ndim == 2 and dtype.m is None):
            raise DifftapeError(f"ti.ndarray needs a complete element type, got {dtype!r}")
        if dtype.ndim == 1:
            return VectorNdarray(dtype.n, dtype.scalar_dtype, shape, needs_grad)
        return MatrixNdarray(dtype.n, dtype.m, dtype.scalar_dtype, shape, needs_grad)
    return ScalarNdarray(dtype, shape, needs_grad)


def _capture_read(what: str) -> None:
    """Refuse a host read of device data inside ``ti.graph.capture()`` (difftape.graph);
    wait first for passes still to run on the program (``Program.await_passes``)."""
    prog = program.get()
    prog.wait_for_passes()
    if prog.capture is not None:
        prog.capture.read(what)


def _capture_write() -> object | None:
    """The ``ti.graph.capture()`` recorder that a host write goes to, or None (it runs now,
    after the passes still to run on the program: ``Program.await_passes``)."""
    prog = program.get()
    prog.wait_for_passes()
    return prog.capture


def _check_shape(shape) -> tuple[int, ...]:
    """Taichi's rule: an int or a tuple of ints in [1, 2**31 - 1] (``()`` is a 0-D array)."""
    dims = (shape,) if isinstance(shape, numbers.Number) else shape
    try:
        dims = tuple(dims)
    except TypeError:
        dims = None
    if dims is None or not all(isinstance(s, numbers.Integral | np.integer) and
                               not isinstance(s, bool) and 0 < s <= 2**31 - 1 for s in dims):
        raise ShapeError(f"{shape!r} is not a valid shape for ndarray: give an int or a tuple "
                         "of ints between 1 and 2**31 - 1")
    return tuple(int(s) for s in dims)


def _element_value(value, element_shape: tuple) -> np.ndarray | int | float:
    """A Python-scope value for one element, checked against the element shape (a scalar is
    broadcast to all components, as in Taichi's fill)."""
    if isinstance(value, Matrix):
        value = value.to_list()
    arr = np.asarray(value)
    if arr.ndim == 0:
        return arr.item()
    if not element_shape:
        raise ShapeError(f"a scalar ndarray element cannot hold a value of shape {arr.shape}")
    if arr.size != int(np.prod(element_shape)) or \
            arr.shape not in (element_shape, (arr.size,)):
        raise ShapeError(f"value of shape {arr.shape} does not fit an element of shape "
                         f"{element_shape}")
    return arr.reshape(element_shape)


_matrix.register_storage(MatrixNdarray=MatrixNdarray, VectorNdarray=VectorNdarray)


def from_dlpack(obj, element_shape: tuple[int, ...] = ()):
    """``ti.from_dlpack(t)``: a ``ti.ndarray`` over the memory of ``t`` (a tensor, a JAX
    array, anything exporting DLPack or the array interface), without copying: writes on
    either side are seen by the other. Its trailing axes ``element_shape`` become the
    element (vector/matrix) shape. The array must be C-contiguous (``t.contiguous()``). On
    a grid program (``arch=ti.cuda``) a CUDA array is viewed in its device memory
    (``runtime/devicearrays.py``; order later launches with its owner's stream by
    ``ti.caller_stream``); a host array is refused there (it would not share)."""
    allocator = program.get().allocator
    if shares_device_memory(allocator) and is_device_array(obj):
        storage, _ = borrow(obj, allocator, "ti.from_dlpack's argument")
        return _over(storage, element_shape)
    arr = as_numpy(obj, "ti.from_dlpack's argument")
    if not allocator.host:
        raise DifftapeError("ti.from_dlpack shares the array's host memory, but this "
                            "program's storage is device memory (simulate_grid / "
                            "DIFFTAPE_SIMULATE_GPU, arch=ti.cuda): pass a CUDA array, or make "
                            "a ti.ndarray and copy the array in with from_numpy()")
    if not arr.flags.c_contiguous:
        raise DifftapeError("ti.from_dlpack: the array is not C-contiguous (a strided view); "
                            "a ti.ndarray is dense: pass t.contiguous() (a copy)")
    return _over(HostStorage(arr), element_shape)


def _over(storage: Storage, element_shape: tuple[int, ...]) -> Ndarray:
    """A ti.ndarray whose storage is ``storage`` (shared memory); its trailing axes
    ``element_shape`` are the element's."""
    esh = tuple(int(n) for n in element_shape)
    shape, ndim = storage.shape, storage.ndim
    if len(esh) > 2 or shape[ndim - len(esh):] != esh or ndim == len(esh):
        raise DifftapeError(f"ti.from_dlpack: element_shape {esh} does not match the array's "
                            f"trailing axes (shape {shape})")
    try:
        dtype = dtype_of(storage.dtype)
    except TypeError as e:
        raise DifftapeError(f"ti.from_dlpack: {e}") from None
    out = object.__new__((ScalarNdarray, VectorNdarray, MatrixNdarray)[len(esh)])
    Ndarray.__init__(out, dtype, shape[:ndim - len(esh)], esh, _storage=storage)
    return out
