"""The XLA FFI handler through which JAX runs difftape programs on XLA's own buffers.

``jax.ffi.ffi_call("difftape", ...)`` inside a JAX computation (``interop/jax.py``) becomes a
custom call that XLA executes by calling :data:`handler` with a call frame
(``jax.ffi.include_dir()``/``xla/ffi/api/c_api.h``, API version 0.1): the argument and
result buffers (data pointer, element type, dimensions), the attributes (``target``: which
registered function, ``stage``: which of its passes) and, on the CUDA platform, the stream
XLA runs the computation on (``XLA_FFI_Stream_Get``). The pass reads the arguments and
writes the results where they are: no copies between XLA and us.

Why a ctypes callback (and not a compiled trampoline): the pass is a Python function (it
launches kernels through the difftape launcher and, remotely, talks to a server), so the
handler must re-enter Python in any case; ctypes does exactly that (it takes the GIL) and
adds nothing a trampoline would save. XLA calls the handler on the thread that executes the
computation (JAX releases the GIL while it waits); calls are serialised by :data:`_lock`
(re-entrant: a JAX computation run eagerly inside a handled pass, ``interop.jax.call``,
may call back on the same thread).

A call whose ``target`` attribute is :data:`MARK` runs no pass: it is the side-effecting
mark (``has_side_effect``) that makes JAX record the computation, so that
``jax.effects_barrier`` waits for it (``interop/jax.py``).

Errors: an exception in a pass is returned to XLA as an FFI error (``UNKNOWN``) whose text is
the difftape error's; JAX raises it as ``JaxRuntimeError``.

Nothing here imports jax.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..errors import DifftapeError

__all__ = ["Buffer", "Frame", "handler", "register_target", "running", "in_pass", "TARGET",
           "MARK"]

#: the FFI target name registered with XLA (one handler for every difftape function)
TARGET = "difftape_program"

#: the ``target`` of a call that runs no pass (a mark: see the module doc)
MARK = -1

API_MAJOR, API_MINOR = 0, 1  # the call frame ABI this module reads (c_api.h)
_EXTENSION_METADATA = 1
_ATTR_SCALAR = 3
_BUFFER = 1
_ERROR_UNKNOWN = 2

#: XLA_FFI_DataType -> NumPy dtype (the types difftape storage can hold)
DTYPES: dict[int, np.dtype] = {
    1: np.dtype(np.bool_), 2: np.dtype(np.int8), 3: np.dtype(np.int16),
    4: np.dtype(np.int32), 5: np.dtype(np.int64), 6: np.dtype(np.uint8),
    7: np.dtype(np.uint16), 8: np.dtype(np.uint32), 9: np.dtype(np.uint64),
    10: np.dtype(np.float16), 11: np.dtype(np.float32), 12: np.dtype(np.float64),
}
CODES: dict[np.dtype, int] = {d: c for c, d in DTYPES.items()}


# ------------------------------------------------------------------------ the C structures
class ExtensionBase(ctypes.Structure):
    pass


ExtensionBase._fields_ = [("struct_size", ctypes.c_size_t), ("type", ctypes.c_int),
                          ("next", ctypes.POINTER(ExtensionBase))]


class ApiVersion(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("major_version", ctypes.c_int), ("minor_version", ctypes.c_int)]


class Metadata(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("api_version", ApiVersion),
                ("traits", ctypes.c_uint32)]


class MetadataExtension(ctypes.Structure):
    _fields_ = [("extension_base", ExtensionBase), ("metadata", ctypes.POINTER(Metadata))]


class List(ctypes.Structure):
    """XLA_FFI_Args and XLA_FFI_Rets (one layout)."""

    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("size", ctypes.c_int64), ("types", ctypes.POINTER(ctypes.c_int)),
                ("items", ctypes.POINTER(ctypes.c_void_p))]


class ByteSpan(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class Attrs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("size", ctypes.c_int64), ("types", ctypes.POINTER(ctypes.c_int)),
                ("names", ctypes.POINTER(ctypes.POINTER(ByteSpan))),
                ("attrs", ctypes.POINTER(ctypes.c_void_p))]


class Scalar(ctypes.Structure):
    _fields_ = [("dtype", ctypes.c_int), ("value", ctypes.c_void_p)]


class CBuffer(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("dtype", ctypes.c_int), ("data", ctypes.c_void_p), ("rank", ctypes.c_int64),
                ("dims", ctypes.POINTER(ctypes.c_int64))]


class ErrorCreateArgs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("message", ctypes.c_char_p), ("errc", ctypes.c_int)]


class StreamGetArgs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("ctx", ctypes.c_void_p), ("stream", ctypes.c_void_p)]


ERROR_CREATE = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(ErrorCreateArgs))
STREAM_GET = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(StreamGetArgs))


class Api(ctypes.Structure):
    """The head of XLA_FFI_Api, up to the calls used here."""

    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("api_version", ApiVersion), ("internal_api", ctypes.c_void_p),
                ("error_create", ERROR_CREATE), ("error_get_message", ctypes.c_void_p),
                ("error_destroy", ctypes.c_void_p), ("handler_register", ctypes.c_void_p),
                ("stream_get", STREAM_GET)]


class CallFrame(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t),
                ("extension_start", ctypes.POINTER(ExtensionBase)),
                ("api", ctypes.POINTER(Api)), ("ctx", ctypes.c_void_p), ("stage", ctypes.c_int),
                ("args", List), ("rets", List), ("attrs", Attrs)]


HANDLER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(CallFrame))


# ------------------------------------------------------------------------ reading a frame
@dataclass(frozen=True)
class Buffer:
    """One argument or result buffer of a call: XLA's memory (host memory on the CPU
    platform, device memory on CUDA)."""

    address: int
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def host_array(self, writeable: bool) -> np.ndarray:
        """The buffer as a NumPy array over its memory (no copy; CPU platform only);
        read-only unless ``writeable`` (XLA's arguments are immutable: JAX arrays, which
        other arrays may share)."""
        if self.nbytes == 0:
            return np.empty(self.shape, self.dtype)
        raw = (ctypes.c_char * self.nbytes).from_address(self.address)
        out = np.frombuffer(raw, self.dtype).reshape(self.shape)
        out.flags.writeable = writeable
        return out


@dataclass(frozen=True)
class Frame:
    """What a pass needs from a call frame: the platform (``"cpu"`` or ``"cuda"``), the
    buffers, the integer attributes, and XLA's stream (CUDA; None on the CPU)."""

    platform: str
    args: list[Buffer]
    rets: list[Buffer]
    attrs: dict[str, int]
    stream: int | None


def _buffers(items: List, what: str) -> list[Buffer]:
    out = []
    for k in range(items.size):
        if items.types[k] != _BUFFER:
            raise DifftapeError(f"XLA FFI: {what} {k} is not a buffer (type {items.types[k]})")
        b = ctypes.cast(items.items[k], ctypes.POINTER(CBuffer)).contents
        dtype = DTYPES.get(b.dtype)
        if dtype is None:
            raise DifftapeError(f"XLA FFI: {what} {k} has XLA element type {b.dtype}, which "
                                "difftape storage cannot hold")
        out.append(Buffer(int(b.data or 0), tuple(int(b.dims[i]) for i in range(b.rank)),
                          dtype))
    return out


def _attrs(attrs: Attrs) -> dict[str, int]:
    out: dict[str, int] = {}
    for k in range(attrs.size):
        span = attrs.names[k].contents
        name = ctypes.string_at(span.ptr, span.len).decode()
        if attrs.types[k] != _ATTR_SCALAR:
            raise DifftapeError(f"XLA FFI: attribute {name!r} is not a scalar")
        scalar = ctypes.cast(attrs.attrs[k], ctypes.POINTER(Scalar)).contents
        dtype = DTYPES.get(scalar.dtype)
        if dtype is None or dtype.kind not in "iu":
            raise DifftapeError(f"XLA FFI: attribute {name!r} is not an integer")
        out[name] = int(np.frombuffer(ctypes.string_at(scalar.value, dtype.itemsize),
                                      dtype)[0])
    return out


def read_frame(frame: CallFrame, platform: str, attrs: dict[str, int] | None = None
               ) -> Frame:
    """The buffers, attributes (``attrs`` when read already) and (CUDA) stream of a call
    frame."""
    stream = None
    if platform == "cuda":
        args = StreamGetArgs(ctypes.sizeof(StreamGetArgs), None, frame.ctx, None)
        error = frame.api.contents.stream_get(ctypes.byref(args))
        if error:
            raise DifftapeError("XLA FFI: XLA_FFI_Stream_Get failed (no CUDA stream)")
        stream = int(args.stream or 0) or 1  # (0: the legacy default stream, handle 1)
    return Frame(platform, _buffers(frame.args, "argument"), _buffers(frame.rets, "result"),
                 _attrs(frame.attrs) if attrs is None else attrs, stream)


# ------------------------------------------------------------------------ dispatch
_targets: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()
_ids = iter(range(1, 1 << 62))
_lock = threading.RLock()
_local = threading.local()  # depth: the passes running on this thread


@contextlib.contextmanager
def running():
    """The block runs a pass (on XLA's thread: the FFI handler, or a host callback)."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def in_pass() -> bool:
    """Is this thread running a pass (its own launches need not wait for passes)?"""
    return getattr(_local, "depth", 0) > 0


def register_target(owner: object) -> int:
    """An id for ``owner`` (an object with ``execute(frame: Frame)``), passed as the
    ``target`` attribute; kept while ``owner`` lives."""
    with _lock:
        key = next(_ids)
        _targets[key] = owner
        return key


def execute(frame: Frame) -> None:
    """Run the pass a frame names (its ``target``'s ``execute``)."""
    owner = _targets.get(frame.attrs.get("target", 0))
    if owner is None:
        raise DifftapeError("XLA FFI: this difftape function no longer exists (the JAX "
                            "computation outlived the interop.jax.function it calls)")
    owner.execute(frame)


def _error(frame: CallFrame, message: str) -> int:
    text = message.encode(errors="replace")
    args = ErrorCreateArgs(ctypes.sizeof(ErrorCreateArgs), None, text, _ERROR_UNKNOWN)
    return frame.api.contents.error_create(ctypes.byref(args)) or 0


def _handle(pointer: ctypes._Pointer, platform: str) -> int:
    frame = pointer.contents
    ext = frame.extension_start
    while ext:  # XLA asks for the handler's metadata (the API version it was written for)
        if ext.contents.type == _EXTENSION_METADATA:
            meta = ctypes.cast(ext, ctypes.POINTER(MetadataExtension)).contents.metadata
            meta.contents.api_version.major_version = API_MAJOR
            meta.contents.api_version.minor_version = API_MINOR
            meta.contents.traits = 0  # (a pass is not safe to capture in a command buffer)
            return 0
        ext = ext.contents.next
    try:
        attrs = _attrs(frame.attrs)
        if attrs.get("target") == MARK:
            return 0
        with _lock, running():
            execute(read_frame(frame, platform, attrs))
    except BaseException as e:  # noqa: BLE001 - handed to XLA, which raises it in JAX
        name = type(e).__name__
        return _error(frame, f"difftape ({name}): {e}")
    return 0


def _make(platform: str) -> Callable:
    @HANDLER
    def handle(pointer):
        return _handle(pointer, platform) or None
    return handle


#: the handlers (kept alive here: XLA holds their addresses)
handler = {"cpu": _make("cpu"), "cuda": _make("cuda")}
