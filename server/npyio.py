"""Arrays on the wire: ``.npy`` or raw octet-stream bodies, parsed without pickle.

The ``.npy`` header is parsed by numpy's header reader (a literal, not pickle), object and
structured dtypes are refused, and the body must hold exactly the bytes the header promises:
a truncated or padded body is a 400, never a partial write. Any header the reader cannot
make sense of is a 400 too, whatever the reader raised.

Uploads are read as a stream (``read_body``): the header first, checked against the field
the array is for, so that a body that cannot fit is refused before the rest of it is read,
and the data straight into one buffer of the size the header promises.
"""

from __future__ import annotations

import io
import math
import struct
from collections.abc import AsyncIterator

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


_MAX_HEADER = 10000


def parse_npy_header(prefix: bytes) -> tuple[list[int], bool, np.dtype, int] | None:
    """(shape, fortran order, dtype, data offset) from the start of a ``.npy`` body, or
    None when ``prefix`` does not hold the whole header yet."""
    if len(prefix) < 8:
        if not npf.MAGIC_PREFIX.startswith(prefix[:6]):
            raise _bad("not a valid .npy body: no .npy magic string")
        return None
    if prefix[:6] != npf.MAGIC_PREFIX:
        raise _bad("not a valid .npy body: no .npy magic string")
    version = (prefix[6], prefix[7])
    if version == (1, 0):
        size_len, fmt = 2, "<H"
    elif version in ((2, 0), (3, 0)):
        size_len, fmt = 4, "<I"
    else:
        raise _bad(f"not a valid .npy body: unsupported .npy version {version}")
    if len(prefix) < 8 + size_len:
        return None
    (hlen,) = struct.unpack(fmt, prefix[8:8 + size_len])
    if hlen > _MAX_HEADER:
        raise _bad(f"not a valid .npy body: header of {hlen} bytes (at most {_MAX_HEADER})")
    end = 8 + size_len + hlen
    if len(prefix) < end:
        return None
    f = io.BytesIO(bytes(prefix[:end]))
    try:
        npf.read_magic(f)
        read = npf.read_array_header_1_0 if version == (1, 0) else npf.read_array_header_2_0
        shape, fortran, dt = read(f, max_header_size=_MAX_HEADER)
    except Exception as e:  # noqa: BLE001 - numpy's literal parser raises many kinds
        # (ValueError, SyntaxError, tokenize.TokenError, RecursionError, MemoryError...):
        # all of them mean a malformed body.
        raise _bad(f"not a valid .npy body: {type(e).__name__}: {str(e)[:200]}") from None
    check_dtype(dt)
    if len(shape) > _MAX_NDIM:
        raise _bad("too many dimensions")
    return list(shape), bool(fortran), dt, end


def _size_error(got: int, expected: int, what: str, *, more: bool = False) -> ProblemError:
    if more:
        return _bad(f"{what} holds more than the {expected} data bytes it needs (padded)")
    return _bad(f"{what} holds {got} data bytes but needs {expected}"
                + (" (truncated)" if got < expected else ""))


def read_npy(body: bytes) -> tuple[memoryview, str, list[int]]:
    """(raw C-order bytes, numpy dtype name, shape) of a ``.npy`` body."""
    parsed = parse_npy_header(body)
    if parsed is None:
        raise _bad("not a valid .npy body: truncated header")
    shape, fortran, dt, start = parsed
    expected = math.prod(shape) * dt.itemsize
    got = len(body) - start
    if got != expected:
        raise _size_error(got, expected, f".npy body ({dt}, shape {tuple(shape)})")
    data, name = _native(memoryview(body)[start:], dt, tuple(shape), fortran)
    return data, name, list(shape)


def shape_mismatch(what: str, field_shape: list[int], shape: list[int]) -> ProblemError:
    """The engine's ShapeError, raised by the gateway before the body is read."""
    return ProblemError(422, f"write: {what} has shape {tuple(field_shape)}, the data has "
                             f"shape {tuple(shape)}", difftape_error="ShapeError",
                        title="ShapeError")


async def _read_exact(chunks: AsyncIterator[bytes], first: bytes, n: int, what: str,
                      length_left: int | None) -> bytearray:
    """Exactly ``n`` bytes: ``first`` and then the stream, straight into one buffer."""
    if length_left is not None and length_left != n:
        raise _size_error(length_left, n, what)  # Content-Length says so: nothing read
    buf = bytearray(n)
    if len(first) > n:
        raise _size_error(len(first), n, what, more=True)
    buf[:len(first)] = first
    pos = len(first)
    async for chunk in chunks:
        if not chunk:
            continue
        if pos + len(chunk) > n:
            raise _size_error(pos + len(chunk), n, what, more=True)
        buf[pos:pos + len(chunk)] = chunk
        pos += len(chunk)
    if pos != n:
        raise _size_error(pos, n, what)
    return buf


async def read_body(chunks: AsyncIterator[bytes], ctype: str, x_dtype: str | None,
                    x_shape: str | None, *, field_shape: list[int] | None,
                    field_label: str,
                    limit: int, length: int | None = None
                    ) -> tuple[memoryview, str, list[int]]:
    """(raw C-order bytes, numpy dtype name, shape) of an upload, read from ``chunks``.

    ``field_shape`` (when known) is the shape the array must have: a body with another one
    is refused (422 ShapeError, naming ``field_label``) from its header, before its data is
    read. ``length`` is the
    Content-Length, if any; ``limit`` bounds what a header may promise."""
    if ctype == RAW:
        if x_dtype is None or x_shape is None:
            raise _bad("raw bodies need X-Dtype and X-Shape headers")
        dt = parse_dtype(x_dtype)
        shape = list(parse_shape(x_shape))
        start = 0
        head = b""
        fortran = False
        what = f"raw body ({dt.name}{shape})"
    else:
        it = chunks.__aiter__()
        head = b""
        while (parsed := parse_npy_header(head)) is None:
            try:
                chunk = await it.__anext__()
            except StopAsyncIteration:
                raise _bad("not a valid .npy body: truncated header") from None
            head += chunk
        shape, fortran, dt, start = parsed
        head = head[start:]
        chunks = it
        what = f".npy body ({dt}, shape {tuple(shape)})"
    if field_shape is not None and shape != list(field_shape):
        raise shape_mismatch(field_label, field_shape, shape)
    expected = math.prod(shape) * dt.itemsize
    if start + expected > limit:
        raise ProblemError(413, f"the array needs {start + expected} bytes, more than the "
                                f"limit of {limit} bytes")
    buf = await _read_exact(chunks, head, expected, what,
                            None if length is None else length - start)
    data, name = _native(memoryview(buf), dt, tuple(shape), fortran)
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
