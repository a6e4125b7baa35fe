"""Process-wide runtime state: the configuration from ``ti.init`` and what lives under it.

There is one current :class:`Program`. ``ti.reset()`` drops it (fields, compiled kernels,
thread pool); the next ``ti.init`` or first use makes a new one. Kernels key their compiled
instances by the program's generation so nothing compiled under an old program is reused.
"""

from __future__ import annotations

import itertools
import os
import warnings
from dataclasses import dataclass, field

import numpy as np

from .. import types as T
from ..types import DType


@dataclass(frozen=True)
class Arch:
    name: str

    def __repr__(self) -> str:
        return self.name


cpu = x64 = arm64 = Arch("cpu")
cuda = Arch("cuda")
gpu = Arch("gpu")
vulkan = Arch("vulkan")
metal = Arch("metal")
opengl = Arch("opengl")
remote = Arch("remote")


@dataclass
class Config:
    arch: Arch = cpu
    default_fp: DType = T.f32
    default_ip: DType = T.i32
    debug: bool = False
    random_seed: int = 0
    cpu_max_num_threads: int = 0
    offline_cache: bool = True
    offline_cache_file_path: str | None = None
    print_ir: bool = False
    deterministic: bool = False  # fixed schedules, see ir/passes/determinism.py
    extra: dict = field(default_factory=dict)


_generations = itertools.count(1)


class Program:
    def seed_random(self, seed: int) -> None:
        """One 64-bit random state per worker thread (and the caller), from ``seed``
        (``ti.init(random_seed=)``; the service's ``seed`` op for remote programs)."""
        seeds = np.random.SeedSequence(int(seed)).generate_state(self.num_threads * 2)
        state = seeds.view(np.uint64).copy()
        state[state == 0] = 0x9E3779B97F4A7C15
        if getattr(self, "rng_state", None) is not None and len(self.rng_state) == len(state):
            self.rng_state[:] = state  # in place: compiled launches hold its address
        else:
            self.rng_state = state

    def __init__(self, config: Config) -> None:
        self.config = config
        self.generation = next(_generations)
        self.fields: dict[int, object] = {}
        self.unplaced: list = []
        nthreads = config.cpu_max_num_threads or os.cpu_count() or 1
        self.num_threads = max(1, nthreads)
        self.seed_random(config.random_seed)
        self._pool = None
        self.tape = None  # the ti.ad.Tape recording kernel launches, if any
        self.remote = None  # arch=ti.remote: the difftape.client runtime running it on a server
        self.fwd = None  # the ti.ad.FwdMode (or forward-mode helper) in effect, if any
        # > 0 inside a @ti.ad.no_grad function under forward mode: kernels there give the
        # fields they write zero tangents (variant "fwd_const")
        self.no_tangents = 0
        # Bumped whenever a field gains .grad/.dual storage: derivative variants of kernels
        # compiled before then would not read or write it.
        self.storage_epoch = 0

    @property
    def pool(self):
        if self._pool is None:
            from .parallel import ThreadPool

            self._pool = ThreadPool(self.num_threads)
        return self._pool

    def zero(self, arr) -> None:
        """Zero a contiguous array; large ones on all cores (clearing gradients between
        iterations is memory-bound, and one core cannot saturate memory bandwidth)."""
        if arr.nbytes < (1 << 20) or self.num_threads == 1:
            arr.fill(0)
            return
        import ctypes

        from ..codegen.cpu import get_target

        fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                              ctypes.c_int32)(get_target().zero_task())
        self.pool.run(fn, arr.ctypes.data, 0, arr.nbytes, chunks_per_thread=1)

    def close(self) -> None:
        if self.remote is not None:  # arch=ti.remote: end the server session
            self.remote.close()
        if self._pool is not None:
            self._pool.close()
            self._pool = None


_current: Program | None = None


def get() -> Program:
    """The current program, created with default settings on first use (as Taichi does)."""
    global _current
    if _current is None:
        _current = Program(Config())
    return _current


def init(arch: Arch | None = None, *, default_fp=None, default_ip=None, debug: bool = False,
         random_seed: int = 0, cpu_max_num_threads: int = 0, offline_cache: bool = True,
         offline_cache_file_path: str | None = None, deterministic: bool = False,
         **kwargs) -> None:
    """``ti.init``: start a fresh program with this configuration (fields and kernels of the
    previous one are dropped)."""
    global _current
    from .. import types as _t

    reset()
    arch = arch or cpu
    if arch in (cuda, gpu, vulkan, metal, opengl):
        warnings.warn(f"difftape: arch={arch} has no backend here yet; falling back to the CPU",
                      stacklevel=2)
        arch = cpu
    # arch=ti.remote: server=, token= (or session=) say where the program runs.
    remote_opts = {k: kwargs.pop(k) for k in ("server", "token", "session", "transport",
                                              "timeout") if k in kwargs}
    cfg = Config(arch=arch, debug=bool(debug), random_seed=int(random_seed),
                 cpu_max_num_threads=int(cpu_max_num_threads),
                 offline_cache=bool(offline_cache),
                 offline_cache_file_path=offline_cache_file_path,
                 print_ir=bool(kwargs.pop("print_ir", False)),
                 deterministic=bool(deterministic), extra=kwargs)
    if default_fp is not None:
        cfg.default_fp = default_fp if isinstance(default_fp, DType) else (
            _t.f64 if default_fp is float else _t.from_numpy(default_fp))
    if default_ip is not None:
        cfg.default_ip = default_ip if isinstance(default_ip, DType) else (
            _t.i32 if default_ip is int else _t.from_numpy(default_ip))
    if _current is not None:
        _current.close()  # its worker threads would otherwise idle on forever
    if arch == remote:  # the program runs on a difftape server (difftape.client)
        from ..client.runtime import attach

        if cfg.deterministic:  # the server compiles with its own options
            from ..errors import DifftapeError

            raise DifftapeError("ti.init(arch=ti.remote, deterministic=True) is not supported: "
                                "the server schedules kernels its own way; run locally "
                                "(arch=ti.cpu) for bitwise-reproducible results")

        prog = Program(cfg)
        attach(prog, **remote_opts)
        _current = prog
        return
    _current = Program(cfg)
    # Load LLVM and set up the CPU target now rather than inside the first kernel call, so
    # a kernel's first call costs only its own compile (or cache load).
    from ..codegen.cpu import get_target

    get_target().warm_up()
    _ = _current.pool  # start the worker threads now, not in the first parallel launch


def reset() -> None:
    """``ti.reset``: drop the current program."""
    global _current
    if _current is not None:
        _current.close()
    _current = None
