"""DLPack capsules read and made with ctypes: device memory exchanged without NumPy.

NumPy's ``from_dlpack``/``__dlpack__`` cover host memory only, so the CUDA paths of interop
(``runtime/devicearrays.py``) handle the capsules themselves, following the DLPack C ABI
(``dlpack.h``, unversioned ``DLManagedTensor`` and 1.x's ``DLManagedTensorVersioned``) and the
Python protocol (capsule names ``"dltensor"``/``"dltensor_versioned"``; a consumer renames the
capsule ``"used_dltensor"``/``"used_dltensor_versioned"`` and then owns the tensor, calling
its ``deleter`` exactly once when done; a capsule nobody consumed calls the deleter when it is
collected).

- :func:`consume`: a producer's capsule read into a :class:`DLTensorView` (address, device,
  dtype, shape, strides, read-only flag) that owns the managed tensor until
  :meth:`DLTensorView.release`.
- :func:`make_capsule`: a capsule over device memory difftape owns (a field's or ndarray's
  storage), keeping ``owner`` alive until the consumer's deleter runs.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np

from ..errors import DifftapeError

#: DLPack device types (``DLDeviceType``)
CPU, CUDA, CUDA_HOST, CUDA_MANAGED = 1, 2, 3, 13
DEVICE_NAMES = {1: "CPU", 2: "CUDA", 3: "CUDA host", 4: "OpenCL", 7: "Vulkan", 8: "Metal",
                10: "ROCm", 13: "CUDA managed", 14: "oneAPI"}
#: DLPack 1.x flags (``DLManagedTensorVersioned.flags``)
FLAG_READ_ONLY = 1
#: the DLPack version made and read (``DLPACK_MAJOR_VERSION``)
VERSION = (1, 0)

_INT, _UINT, _FLOAT, _COMPLEX, _BOOL = 0, 1, 2, 5, 6


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", DLPackVersion), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p), ("flags", ctypes.c_uint64),
                ("dl_tensor", DLTensor)]


# The capsule API, on the capsule as an object and (in the destructor) as a raw pointer.
_api = ctypes.pythonapi
_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_IsValid", _api))
_get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", _api))
_set_name = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_SetName", _api))
_raw_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_IsValid", _api))
_raw_get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", _api))
_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_new_capsule = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p,
                                 _DESTRUCTOR)(("PyCapsule_New", _api))

# Capsule names: module constants (the capsule keeps a pointer to the bytes).
_NAME, _USED = b"dltensor", b"used_dltensor"
_NAME_V, _USED_V = b"dltensor_versioned", b"used_dltensor_versioned"


def dtype_of(t: DLDataType) -> np.dtype:
    """The NumPy dtype of a DLPack element type; DifftapeError for one NumPy has no match for
    (vectors of lanes, bfloat16, complex)."""
    if t.lanes == 1:
        if t.code == _FLOAT and t.bits in (16, 32, 64):
            return np.dtype(f"float{t.bits}")
        if t.code == _INT and t.bits in (8, 16, 32, 64):
            return np.dtype(f"int{t.bits}")
        if t.code == _UINT and t.bits in (8, 16, 32, 64):
            return np.dtype(f"uint{t.bits}")
        if t.code == _BOOL and t.bits == 8:
            return np.dtype(np.bool_)
    raise DifftapeError(f"DLPack element type {type_name(t)} has no difftape dtype")


def type_name(t: DLDataType) -> str:
    """A DLPack element type in words: ``float32``, ``complex64``, ``bfloat16``, ``int8x4``."""
    names = {0: "int", 1: "uint", 2: "float", 4: "bfloat", 5: "complex", 6: "bool"}
    lanes = f"x{t.lanes}" if t.lanes != 1 else ""
    return f"{names.get(t.code, f'code {t.code} ')}{t.bits}{lanes}"


def dl_dtype(dtype: np.dtype) -> DLDataType:
    """The DLPack element type of a NumPy dtype."""
    dtype = np.dtype(dtype)
    code = {"f": _FLOAT, "i": _INT, "u": _UINT, "b": _BOOL, "c": _COMPLEX}[dtype.kind]
    return DLDataType(code, dtype.itemsize * 8, 1)


class DLTensorView:
    """A consumed DLPack tensor: its memory described, and the managed tensor owned until
    :meth:`release` (which calls the producer's deleter, once)."""

    __slots__ = ("address", "device", "dtype", "shape", "strides", "readonly", "_managed",
                 "_deleter", "_lock", "type_name")

    def __init__(self, managed: int, versioned: bool) -> None:
        if versioned:
            m = DLManagedTensorVersioned.from_address(managed)
            if m.version.major != VERSION[0]:
                raise DifftapeError(f"DLPack {m.version.major}.{m.version.minor} tensors are "
                                    f"not understood (difftape reads DLPack {VERSION[0]}.x)")
            self.readonly = bool(m.flags & FLAG_READ_ONLY)
        else:
            m = DLManagedTensor.from_address(managed)
            self.readonly = False
        self._managed, self._deleter, self._lock = managed, m.deleter, threading.Lock()
        t = m.dl_tensor
        self.device = (int(t.device.device_type), int(t.device.device_id))
        self.shape = tuple(int(t.shape[k]) for k in range(t.ndim))
        self.strides = None if not t.strides else tuple(int(t.strides[k]) for k in range(t.ndim))
        self.address = int(t.data or 0) + int(t.byte_offset)
        self.dtype: np.dtype | None
        try:
            self.dtype = dtype_of(t.dtype)
        except DifftapeError:
            self.dtype = None  # (the caller refuses it, naming the argument)
        self.type_name = type_name(t.dtype)

    @property
    def contiguous(self) -> bool:
        """Compact row-major (C order): what the generated code indexes. Axes of extent 1
        may have any stride."""
        if self.strides is None:
            return True
        expected = 1
        for n, s in zip(reversed(self.shape), reversed(self.strides), strict=True):
            if n != 1 and s != expected:
                return False
            expected *= n
        return True

    def release(self) -> None:
        """The producer's deleter (once; also on another thread)."""
        with self._lock:
            managed, self._managed = self._managed, 0
        if managed and self._deleter:
            DELETER(self._deleter)(managed)


def consume(capsule: Any) -> DLTensorView:
    """Take ownership of the tensor in a DLPack capsule (versioned or not): the capsule is
    renamed as used, so it no longer deletes the tensor; the returned view does, on
    :meth:`DLTensorView.release`."""
    for name, used, versioned in ((_NAME_V, _USED_V, True), (_NAME, _USED, False)):
        if _is_valid(capsule, name):
            managed = _get_pointer(capsule, name)
            view = DLTensorView(managed, versioned)  # (raises before taking ownership)
            _set_name(capsule, used)
            return view
    raise DifftapeError(f"not a DLPack capsule (or one already consumed): {capsule!r:.80}")


# ---------------------------------------------------------------------------------- export
#: managed tensors made here and not deleted yet: address -> (struct, shape, strides, owner,
#: on_delete)
_exported: dict[int, tuple] = {}
_exported_lock = threading.Lock()


def _delete(managed: int) -> None:
    with _exported_lock:
        entry = _exported.pop(managed, None)
    if entry is not None and entry[4] is not None:
        entry[4]()


_deleter = DELETER(_delete)
_deleter_address = ctypes.cast(_deleter, ctypes.c_void_p).value


def _destroy(capsule: int) -> None:
    """The capsule's destructor: a capsule nobody consumed deletes its tensor."""
    try:
        for name in (_NAME_V, _NAME):
            if _raw_is_valid(capsule, name):
                _delete(_raw_get_pointer(capsule, name))
                return
    except Exception:  # noqa: BLE001 - never raise out of a destructor
        pass


_destructor = _DESTRUCTOR(_destroy)


def make_capsule(address: int, shape: tuple[int, ...], dtype: np.dtype,
                 device: tuple[int, int], owner: object, versioned: bool,
                 readonly: bool = False, on_delete=None) -> Any:
    """A DLPack capsule over ``address`` (C-ordered ``shape`` of ``dtype`` on ``device``),
    unversioned or (``versioned``) DLPack 1.0. ``owner`` is kept alive and ``on_delete()``
    called when the consumer deletes the tensor (or the capsule is collected unconsumed)."""
    ndim = len(shape)
    c_shape = (ctypes.c_int64 * max(1, ndim))(*shape)
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    c_strides = (ctypes.c_int64 * max(1, ndim))(*reversed(strides))
    tensor = DLTensor(address, DLDevice(*device), ndim, dl_dtype(dtype),
                      ctypes.cast(c_shape, ctypes.POINTER(ctypes.c_int64)),
                      ctypes.cast(c_strides, ctypes.POINTER(ctypes.c_int64)), 0)
    if versioned:
        managed = DLManagedTensorVersioned(DLPackVersion(*VERSION), None, _deleter_address,
                                           FLAG_READ_ONLY if readonly else 0, tensor)
        name = _NAME_V
    else:
        managed = DLManagedTensor(tensor, None, _deleter_address)
        name = _NAME
    key = ctypes.addressof(managed)
    with _exported_lock:
        _exported[key] = (managed, c_shape, c_strides, owner, on_delete)
    return _new_capsule(key, name, _destructor)


def exported() -> int:
    """How many tensors made here are not deleted yet (for tests)."""
    return len(_exported)
