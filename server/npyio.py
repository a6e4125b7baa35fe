"""Arrays on the wire: ``.npy`` or raw octet-stream bodies, parsed without pickle.

The ``.npy`` header is parsed by numpy's header reader (a literal, not pickle), object and
structured dtypes are refused, and the body must hold exactly the bytes the header promises:
a truncated or padded body is a 400, never a partial write.
"""

from __future__ import annotations

import io
import math

import numpy as np
from numpy.lib import format as npf

from .problems import ProblemError

NPY = "application/x-npy"
RAW = "application/octet-stream"

# difftape dtype names, accepted in X-Dtype next to numpy's own names.
_DIFFTAPE_NAMES = {"f16": "float16", "f32": "float32", "f64": "float64", "i8": "int8",
                   "i16": "int16", "i32": "int32", "i64": "int64", "u8": "uint8",
                   "u16": "uint16", "u32": "uint32", "u64": "uint64"}
_MAX_NDIM = 16


def _bad(detail: str) -> ProblemError:
    return ProblemError(400, detail, title="Bad array body")


def check_dtype(dt: np.dtype) -> np.dtype:
    if dt.hasobject:
        raise _bad("object arrays are refused (they would need pickle)")
    if dt.fields is not None or dt.subdtype is not None or dt.kind not in "biuf":
        raise _bad(f"unsupported array dtype {dt}; use a numeric dtype")
    return dt


def parse_dtype(name: str) -> np.dtype:
    name = _DIFFTAPE_NAMES.get(name, name)
    try:
        dt = np.dtype(name)
    except (TypeError, ValueError):
        raise _bad(f"unknown dtype {name!r}") from None
    return check_dtype(dt)


def parse_shape(text: str) -> tuple[int, ...]:
    text = text.strip().strip("()[]")
    if not text:
        return ()
    try:
        shape = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise _bad(f"bad X-Shape {text!r}; expected e.g. '3,4'") from None
    if len(shape) > _MAX_NDIM or any(n < 0 for n in shape):
        raise _bad(f"bad X-Shape {text!r}")
    return shape


def _native(data: memoryview, dt: np.dtype, shape: tuple, fortran: bool):
    """C-order, native-endian bytes and the dtype name, copying only when needed."""
    if dt.byteorder not in ("=", "|") and dt.byteorder != np.dtype(dt.name).byteorder:
        arr = np.frombuffer(data, dtype=dt).reshape(shape, order="F" if fortran else "C")
        arr = np.ascontiguousarray(arr.astype(dt.newbyteorder("=")))
        return memoryview(arr).cast("B"), arr.dtype.name
    if fortran and len(shape) > 1:
        arr = np.ascontiguousarray(np.frombuffer(data, dtype=dt).reshape(shape, order="F"))
        return memoryview(arr).cast("B"), arr.dtype.name
    return data, dt.name


def read_npy(body: bytes) -> tuple[memoryview, str, list[int]]:
    """(raw C-order bytes, numpy dtype name, shape) of a ``.npy`` body."""
    f = io.BytesIO(body)
    try:
        version = npf.read_magic(f)
        if version == (1, 0):
            shape, fortran, dt = npf.read_array_header_1_0(f, max_header_size=10000)
        elif version in ((2, 0), (3, 0)):
            shape, fortran, dt = npf.read_array_header_2_0(f, max_header_size=10000)
        else:
            raise ValueError(f"unsupported .npy version {version}")
    except (ValueError, OSError, SyntaxError, TypeError, EOFError) as e:
        raise _bad(f"not a valid .npy body: {e}") from None
    check_dtype(dt)
    if len(shape) > _MAX_NDIM:
        raise _bad("too many dimensions")
    start = f.tell()
    expected = math.prod(shape) * dt.itemsize
    got = len(body) - start
    if got != expected:
        raise _bad(f".npy body holds {got} data bytes but its header ({dt}, shape "
                   f"{tuple(shape)}) needs {expected}" + (" (truncated)" if got < expected
                                                          else ""))
    data, name = _native(memoryview(body)[start:], dt, tuple(shape), fortran)
    return data, name, list(shape)


def read_raw(body: bytes, dtype: str | None, shape: str | None):
    if dtype is None or shape is None:
        raise _bad("raw bodies need X-Dtype and X-Shape headers")
    dt = parse_dtype(dtype)
    shp = parse_shape(shape)
    expected = math.prod(shp) * dt.itemsize
    if len(body) != expected:
        raise _bad(f"raw body holds {len(body)} bytes but {dt.name}{list(shp)} needs "
                   f"{expected}" + (" (truncated)" if len(body) < expected else ""))
    data, name = _native(memoryview(body), dt, shp, False)
    return data, name, list(shp)


def numpy_name(dtype: str) -> str:
    """numpy's name of a difftape or numpy dtype name ("f32" -> "float32")."""
    return _DIFFTAPE_NAMES.get(dtype, dtype)


def npy_header(dtype: str, shape: list[int]) -> bytes:
    """The header of a ``.npy`` file holding raw C-order bytes of this dtype and shape (sent
    in front of the data, so the data itself is never copied into a new buffer)."""
    dt = parse_dtype(dtype)
    header = io.BytesIO()
    npf.write_array_header_1_0(header, {"descr": npf.dtype_to_descr(dt), "fortran_order": False,
                                        "shape": tuple(shape)})
    return header.getvalue()


def npy_bytes(payload: bytes, dtype: str, shape: list[int]) -> bytes:
    """A ``.npy`` file around raw C-order bytes."""
    return npy_header(dtype, shape) + bytes(payload)
