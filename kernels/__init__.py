"""difftape: a differentiable kernel language for Python, compiled through LLVM.

``import difftape as ti`` and write Taichi-style programs: fields, ``@ti.kernel``, ``@ti.func``.
"""

from __future__ import annotations

import importlib as _importlib

from . import (
    math,  # noqa: E402
    types,  # noqa: E402
)
from ._version import __version__  # noqa: E402
from .errors import (  # noqa: E402
    ArchUnavailableError,
    ArgumentError,
    CallSignatureError,
    CompileError,
    DifftapeError,
    GradientRuleError,
    GraphCaptureError,
    GraphError,
    ImageError,
    IndexOutOfRangeError,
    IRValidationError,
    KernelAssertionError,
    KernelIndexError,
    KernelNameError,
    KernelRuntimeError,
    KernelSyntaxError,
    KernelTypeError,
    MediaError,
    OptionError,
    OutOfMemoryError,
    ShapeError,
    SolverError,
    TaichiAssertionError,
    TaichiCompilationError,
    TaichiIndexError,
    TaichiNameError,
    TaichiRuntimeError,
    TaichiRuntimeTypeError,
    TaichiSyntaxError,
    TaichiTypeError,
    UnknownOptionError,
)
from .frontend import argpack as _argpack_mod  # noqa: E402
from .frontend import matrix as _matrix_mod  # noqa: E402
from .frontend import ops as _ops_mod  # noqa: E402
from .frontend import quant as _quant_mod  # noqa: E402
from .frontend import struct as _struct_mod  # noqa: E402
from .frontend.annotations import NdarrayType as _NdarrayType  # noqa: E402
from .frontend.annotations import ref, template  # noqa: E402
from .frontend.annotations import sparse_matrix_builder as _sparse_matrix_builder  # noqa: E402
from .frontend.decorators import data_oriented, func, kernel, pyfunc, real_func  # noqa: E402
from .frontend.field import (  # noqa: E402
    Field,
    FieldsBuilder,
    Layout,
    MatrixField,
    ScalarField,
    assume_in_range,
    axes,
    block_local,
    cache_read_only,
    i,
    ij,
    ijk,
    ijkl,
    ijl,
    ik,
    ikl,
    il,
    j,
    jk,
    jkl,
    jl,
    k,
    kl,
    l,  # noqa: E741
    loop_unique,
    root,
)
from .frontend.field import make_field as field  # noqa: E402
from .frontend.matrix import Matrix, Vector  # noqa: E402
from .frontend.ndarray import (  # noqa: E402
    MatrixNdarray,
    Ndarray,
    ScalarNdarray,
    VectorNdarray,
    from_dlpack,  # noqa: E402
    ndarray,
)
from .frontend.ops import (  # noqa: E402
    abs,
    acos,
    asin,
    atan,
    atan2,
    atomic_add,
    atomic_and,
    atomic_max,
    atomic_min,
    atomic_mul,
    atomic_or,
    atomic_sub,
    atomic_xor,
    bit_cast,
    bit_shr,
    cast,
    ceil,
    cos,
    exp,
    floor,
    log,
    logical_and,
    logical_not,
    logical_or,
    max,
    min,
    one,
    pow,
    randn,
    random,
    raw_div,
    raw_mod,
    round,
    rsqrt,
    select,
    sin,
    sqrt,
    stop_grad,
    tan,
    tanh,
    zero,
)
from .frontend.quant import BitpackedFields  # noqa: E402
from .frontend.quant_kernels import quant_read as _quant_read  # noqa: E402
from .frontend.quant_kernels import quant_write as _quant_write  # noqa: E402

_quant_mod.use_kernels(_quant_read, _quant_write)
from .frontend.sparse import (  # noqa: E402
    activate,
    append,
    deactivate,
    deactivate_all_snodes,
    is_active,
    length,
    no_activate,
    rescale_index,
)
from .frontend.struct import Struct, StructField, dataclass  # noqa: E402
from .frontend.transformer import (  # noqa: E402
    Grouped,
    NdRange,
    loop_config,
    static,
    static_assert,
    static_print,
)
from .runtime import program as _program_mod  # noqa: E402
from .runtime.devicearrays import caller_stream  # noqa: E402
from .runtime.log import (  # noqa: E402
    CRITICAL,
    DEBUG,
    ERROR,
    INFO,
    TRACE,
    WARN,
    is_logging_effective,
    set_logging_level,
)
from .runtime.program import (  # noqa: E402
    arm64,
    cpu,
    cuda,
    gpu,
    init,
    metal,
    opengl,
    remote,
    reset,
    vulkan,
    x64,
)
from .types import (  # noqa: E402
    f16,
    f32,
    f64,
    float16,
    float32,
    float64,
    i8,
    i16,
    i32,
    i64,
    int8,
    int16,
    int32,
    int64,
    u1,
    u8,
    u16,
    u32,
    u64,
    uint8,
    uint16,
    uint32,
    uint64,
)


def ndrange(*dims) -> NdRange:
    """``ti.ndrange``: a multi-dimensional range (extents or (begin, end) pairs)."""
    return NdRange(*dims)


def grouped(x) -> Grouped:
    """``ti.grouped``: iterate with one vector index ``I``."""
    return Grouped(x)


def sync() -> None:
    """``ti.sync``: until every kernel launched so far has ended. On a grid (``arch=ti.cuda``,
    the simulated grid) launches are asynchronous: this waits for them and raises the error
    of one that failed (a bounds check or assert); on the CPU kernels run synchronously, so
    there is nothing to wait for; under ``arch=ti.remote`` it sends the queued launches and
    waits for them."""
    prog = _program_mod._current
    if prog is not None and prog.remote is not None:
        prog.remote.flush()
    _program_mod.sync()


def _linalg():
    """``difftape.linalg``, imported on first use (ti.svd, ti.linalg.X), not at ``import
    difftape`` (import time). Through importlib: ``from . import linalg`` would consult this
    module's ``__getattr__`` and recurse."""
    return _importlib.import_module(f"{__name__}.linalg")


def __getattr__(name: str):
    """``ti.linalg``, loaded on first use (see :func:`_linalg`)."""
    if name == "linalg":
        return _linalg()
    raise AttributeError(f"module 'difftape' has no attribute {name!r}")


def remote_stats() -> dict[str, int]:
    """What the current program has cost on the wire since ``ti.init``: under
    ``arch=ti.remote`` the server round trips (HTTP requests), the engine ops they carried
    and the body bytes sent and received; all zero for a local program. Take the difference
    of two calls to see what a part of a program costs."""
    prog = _program_mod._current
    if prog is not None and prog.remote is not None:
        return prog.remote.stats()
    return {"round_trips": 0, "ops": 0, "bytes_sent": 0, "bytes_received": 0}


def svd(A, dt=None):
    """``ti.svd(A)`` -> (U, S, V) with A = U @ S @ V.T (2x2 or 3x3), inside kernels."""
    return _linalg().svd(A, _ops_mod.resolve_dtype(dt if dt is not None else float))


def polar_decompose(A, dt=None):
    """``ti.polar_decompose(A)`` -> (U, P) with A = U @ P (2x2 or 3x3), inside kernels."""
    return _linalg().polar_decompose(A, _ops_mod.resolve_dtype(dt if dt is not None else float))


def solve(A, b, dt=None):
    """``ti.solve(A, b)`` -> x with A @ x == b (2x2 or 3x3, partial pivoting), inside kernels;
    a singular A is a run-time error."""
    return _linalg().solve(A, b, dt)


def sym_eig(A, dt=None):
    """``ti.sym_eig(A)`` -> (eigenvalues, eigenvectors as columns) of a symmetric 2x2 or 3x3
    matrix, inside kernels."""
    return _linalg().sym_eig(A, dt)


def eig(A, dt=None):
    """``ti.eig(A)`` -> (eigenvalues as (re, im) rows, eigenvectors as columns of
    (re0, im0, re1, im1)) of a real 2x2 matrix, inside kernels."""
    return _linalg().eig(A, dt)


# ``ti.types`` offers the frontend's type constructors beside the scalar types; ``types`` is
# the ground floor, so the API puts them there (types.provide) rather than types importing up.
types.provide(
    argpack=_argpack_mod.ArgPackType,
    quant=_quant_mod.quant,
    vector=_matrix_mod.vector,
    matrix=_matrix_mod.matrix,
    struct=_struct_mod.struct,
    ndarray=_NdarrayType,
    template=template,
    sparse_matrix_builder=_sparse_matrix_builder,
    is_signed=_ops_mod.is_signed,
    is_integral=_ops_mod.is_integral,
    is_real=_ops_mod.is_real,
)



def _attach_remote(prog, **options):
    """``ti.init(arch=ti.remote)``: the program runs on a difftape server (difftape.client)."""
    # Function-level: the client needs httpx (the optional `client` extra); only remote loads it.
    from .client.runtime import attach

    return attach(prog, **options)


_program_mod.register_backend(remote, _attach_remote)

from . import ad, algorithms, experimental, graph, profiler, tools  # noqa: E402
from .ad import FwdMode, Tape  # noqa: E402
from .ui.gui import GUI, hex_to_rgb, rgb_to_hex  # noqa: E402

__all__ = [n for n in dir() if not n.startswith("_")]
