"""Process-wide runtime state: the configuration from ``ti.init`` and what lives under it.

There is one current :class:`Program`. ``ti.reset()`` drops it (fields, compiled kernels,
thread pool); the next ``ti.init`` or first use makes a new one. Kernels key their compiled
instances by the program's generation so nothing compiled under an old program is reused.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import types as T
from ..codegen import get_target
from ..errors import (
    ArchUnavailableError,
    DifftapeError,
    OptionError,
    UnknownOptionError,
    trim_traceback,
)
from ..types import DType
from . import cache, log
from . import cuda as cuda_runtime  # (pycuda is imported only when a program asks for CUDA)
from .grid import Launcher
from .printsink import PrintSink
from .simgrid import SimulatedLauncher, parse_grid
from .stackbudget import StackBudget
from .storage import Allocator, HostAllocator, Storage


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

#: What the ``TI_ARCH`` environment variable may say: Taichi's own arch names (``taichi.init``
#: accepts exactly these there). The GPU ones fall back to the CPU here, with a warning.
TI_ARCH_NAMES: dict[str, Arch] = {
    "x64": cpu, "arm64": cpu, **{n: Arch(n) for n in (
        "cuda", "metal", "opengl", "vulkan", "dx11", "dx12", "gles", "amdgpu", "opencl",
        "js")}}
#: ... and ``DIFFTAPE_ARCH``: the names of difftape's ``ti.<arch>`` constants.
DIFFTAPE_ARCH_NAMES: dict[str, Arch] = {
    "cpu": cpu, "x64": cpu, "arm64": cpu, "cuda": cuda, "gpu": gpu, "vulkan": vulkan,
    "metal": metal, "opengl": opengl, "remote": remote}


def arch_from_environment() -> tuple[Arch, str] | None:
    """The arch the environment imposes on ``ti.init``, and which variable said so.

    Taichi programs choose their backend with ``TI_ARCH``, which overrides the ``arch``
    given to ``ti.init`` (so a program runs elsewhere without an edit); difftape reads it
    the same way, and ``DIFFTAPE_ARCH`` (which also takes ``remote``) before it. Empty
    means unset; an unknown name is refused rather than ignored."""
    for var, names in (("DIFFTAPE_ARCH", DIFFTAPE_ARCH_NAMES), ("TI_ARCH", TI_ARCH_NAMES)):
        value = os.environ.get(var, "").strip()
        if not value:
            continue
        if value not in names:
            hint = (" (difftape's remote backend is DIFFTAPE_ARCH=remote)"
                    if var == "TI_ARCH" and value == "remote" else "")
            raise OptionError(f"{var}={value!r} is not an arch name; use one of "
                              f"{', '.join(names)}{hint}, or unset it")
        return names[value], f"{var}={value}"
    return None


#: ``DIFFTAPE_SIMULATE_GPU``: ``1`` runs the kernels of every local program (not given
#: ``simulate_grid``) on the simulated GPU grid (:data:`DEFAULT_SIMULATED_GRID`),
#: ``blocks,threads`` on that grid; ``0``/empty: off. Remote programs are compiled by the
#: server and are not affected.
SIMULATE_GPU_VAR = "DIFFTAPE_SIMULATE_GPU"
DEFAULT_SIMULATED_GRID = (4, 32)


def grid_from_environment() -> tuple[int, int] | None:
    """The simulated grid ``DIFFTAPE_SIMULATE_GPU`` asks for (None: off). Anything else than
    ``0``/``1``/``blocks,threads`` is refused rather than ignored."""
    value = os.environ.get(SIMULATE_GPU_VAR, "").strip()
    if value in ("", "0"):
        return None
    if value == "1":
        return DEFAULT_SIMULATED_GRID
    try:
        return parse_grid(value)
    except OptionError:
        raise OptionError(f"{SIMULATE_GPU_VAR}={value!r}: expected 1, 0 or 'blocks,threads' "
                          "(e.g. 4,32)") from None


@dataclass
class Config:
    arch: Arch = cpu
    default_fp: DType = T.f32
    default_ip: DType = T.i32
    debug: bool = False
    check_out_of_bound: bool = False  # bounds checks alone (debug=True implies them)
    random_seed: int = 0
    cpu_max_num_threads: int = 0
    offline_cache: bool = True
    offline_cache_file_path: str | None = None
    print_ir: bool = False
    kernel_profiler: bool = False
    deterministic: bool = False  # fixed schedules, see ir/passes/determinism.py
    fast_math: bool = True  # False: no FMA contraction, scalar libm (ir/nodes.py KernelIR)
    # (blocks, threads): kernels compile for the simulated GPU grid (runtime/simgrid.py)
    simulate_grid: tuple[int, int] | None = None
    # False: an arch that cannot run here (no CUDA device) is an error, not the CPU
    enable_fallback: bool = True
    log_level: str = log.DEFAULT  # Taichi's level names (runtime/log.py)
    # True: difftape's errors keep the compiler's frames in their traceback (user_error)
    print_full_traceback: bool = False


@dataclass(frozen=True)
class Option:
    """How ``ti.init`` treats one keyword.

    ``convert``: the option sets the :class:`Config` field of that name, converted by this.
    ``no_effect``: accepted, with a warning (once per process) giving this reason: what the
    option asks of Taichi has no counterpart here, and leaving it out changes no result.
    ``only``/``refusal``: only the value ``only`` (what difftape always does) is accepted;
    any other raises :class:`~difftape.errors.OptionError` with ``refusal``.
    """

    convert: Callable[[Any], Any] | None = None
    no_effect: str = ""
    only: Any = None
    refusal: str = ""


def _opt_str(v):
    return None if v is None else str(v)


_GPU_ONLY = ("it configures Taichi's GPU backends; difftape sizes its CUDA grid, device memory "
             "and stacks itself")
_PASSES = "it toggles one of Taichi's compiler passes; difftape's pipeline is fixed"
_MESH = "it configures ti.Mesh, which difftape does not have"
_DUMP = "it prints Taichi compiler internals that difftape does not have (use print_ir=True)"

# Every ti.init keyword difftape accepts (besides arch, default_fp and default_ip), in one
# place: an option difftape acts on is one line here plus its Config field.
OPTIONS: dict[str, Option] = {
    # acted on
    "debug": Option(bool),
    "check_out_of_bound": Option(bool),
    "random_seed": Option(int),
    "cpu_max_num_threads": Option(int),
    "offline_cache": Option(bool),
    "offline_cache_file_path": Option(_opt_str),
    "print_ir": Option(bool),
    "kernel_profiler": Option(bool),
    "deterministic": Option(bool),
    "fast_math": Option(bool),
    "simulate_grid": Option(parse_grid),
    "enable_fallback": Option(bool),
    "log_level": Option(log.level_name),
    "print_full_traceback": Option(bool),
    # arch=ti.remote: where the program runs (difftape.client)
    **{k: Option() for k in ("server", "token", "session", "transport", "timeout")},
    # what difftape always does; the other value is refused
    "short_circuit_operators": Option(no_effect=(
        "difftape evaluates the right operand of a scalar `and`/`or` only when the left one "
        "does not decide the result (Python's rule) whatever this says; vector operands are "
        "evaluated whole")),
    # accepted, no effect (warned once)
    "advanced_optimization": Option(no_effect=_PASSES),
    "opt_level": Option(no_effect=_PASSES),
    "cfg_optimization": Option(no_effect=_PASSES),
    "flatten_if": Option(no_effect=_PASSES),
    "lower_access": Option(no_effect=_PASSES),
    "simplify_before_lower_access": Option(no_effect=_PASSES),
    "simplify_after_lower_access": Option(no_effect=_PASSES),
    "demote_dense_struct_fors": Option(no_effect=_PASSES),
    "move_loop_invariant_outside_if": Option(no_effect=_PASSES),
    "cache_loop_invariant_global_vars": Option(no_effect=_PASSES),
    "detect_read_only": Option(no_effect=_PASSES),
    "make_block_local": Option(no_effect=_PASSES),
    "make_thread_local": Option(no_effect=_PASSES),
    "make_cpu_multithreading_loop": Option(no_effect=_PASSES),
    "real_matrix_scalarize": Option(no_effect=_PASSES),
    "force_scalarize_matrix": Option(no_effect=_PASSES),
    "quant_opt_atomic_demotion": Option(no_effect=_PASSES),
    "quant_opt_store_fusion": Option(no_effect=_PASSES),
    "half2_vectorization": Option(no_effect=_PASSES),
    "num_compile_threads": Option(no_effect="difftape compiles on the calling thread"),
    "default_cpu_block_dim": Option(no_effect="difftape sizes parallel chunks itself"),
    "cpu_block_dim_adaptive": Option(no_effect="difftape sizes parallel chunks itself"),
    "dynamic_index": Option(no_effect="indexing vectors and matrices by runtime values is "
                                      "always supported"),
    "ad_stack_size": Option(no_effect="difftape's autodiff stacks grow as needed"),
    "unrolling_limit": Option(no_effect="difftape unrolls ti.static loops without a limit"),
    "offline_cache_max_size_of_files": Option(no_effect="difftape's cache is not trimmed"),
    "offline_cache_cleaning_policy": Option(no_effect="difftape's cache is not trimmed"),
    "offline_cache_cleaning_factor": Option(no_effect="difftape's cache is not trimmed"),
    "use_llvm": Option(no_effect="difftape always compiles through LLVM"),
    "verbose": Option(no_effect="difftape does not log"),
    "verbose_kernel_launches": Option(no_effect="difftape does not log"),
    "gdb_trigger": Option(no_effect="difftape does not start debuggers"),
    "timeline": Option(no_effect="difftape has no timeline; use kernel_profiler=True"),
    "require_version": Option(no_effect="it names a Taichi version"),
    **{k: Option(no_effect=_DUMP) for k in (
        "print_preprocessed_ir", "print_accessor_ir", "print_ir_dbg_info", "print_kernel_asm",
        "print_kernel_llvm_ir", "print_kernel_llvm_ir_optimized", "print_struct_llvm_ir",
        "print_kernel_amdgcn")},
    **{k: Option(no_effect=_GPU_ONLY) for k in (
        "device_memory_GB", "device_memory_fraction", "default_gpu_block_dim", "gpu_max_reg",
        "saturating_grid_dim", "max_block_dim", "cuda_stack_limit", "vk_api_version",
        "allow_nv_shader_extension")},
    **{k: Option(no_effect=_MESH) for k in (
        "auto_mesh_local_default_occupacy", "experimental_auto_mesh_local",
        "make_mesh_block_local", "mesh_localize_all_attr_mappings",
        "mesh_localize_from_end_mapping", "mesh_localize_to_end_mapping",
        "optimize_mesh_reordered_mapping", "demote_no_access_mesh_fors")},
}

_warned: set[str] = set()


@dataclass(frozen=True)
class SpecialConfig:
    """What ``ti.init(_test_mode=True, ...)`` returns: the settings Taichi keeps apart from its
    compile configuration (its ``_SpecialConfig``), as this call's arguments and the
    ``TI_<NAME>`` environment variables give them. Taichi's own tests read them back this way;
    only ``log_level`` acts in difftape (see :data:`OPTIONS` for the others)."""

    log_level: str = log.DEFAULT
    gdb_trigger: bool = False
    short_circuit_operators: bool = True
    print_full_traceback: bool = False
    unrolling_limit: int = 32


def _special_config(options: dict) -> SpecialConfig:
    """The :class:`SpecialConfig` of ``ti.init``'s (checked) options: a value given there,
    else the environment's ``TI_<NAME>`` (flags ``0``/``1``), else Taichi's default."""
    values: dict = {}
    for name, f in SpecialConfig.__dataclass_fields__.items():
        if name in options:
            values[name] = options[name]
            continue
        var = "TI_" + name.upper()
        raw = os.environ.get(var, "").strip()
        if not raw:
            continue
        try:
            values[name] = (bool(int(raw)) if f.type == "bool" else int(raw) if f.type == "int"
                            else log.level_name(raw))
        except (ValueError, OptionError) as e:
            raise OptionError(f"{var}={raw!r}: {e}") from None
    return SpecialConfig(**values)


def options_from_environment(given: dict) -> dict:
    """The options Taichi programs set through the environment: ``TI_<OPTION>`` (e.g.
    ``TI_DEBUG=1``, ``TI_LOG_LEVEL=warn``) for each option difftape acts on that ``ti.init``
    was not given (an argument wins, as in Taichi), and ``TI_DEFAULT_FP``/``TI_DEFAULT_IP``
    (``32`` or ``64``). Flags are ``0``/``1``; a value that does not parse is refused."""
    out: dict = {}
    fields = Config.__dataclass_fields__
    for name, opt in OPTIONS.items():
        var = "TI_" + name.upper()
        value = os.environ.get(var, "").strip()
        if not value or name in given or opt.convert is None:
            continue
        try:
            out[name] = bool(int(value)) if fields[name].type == "bool" else opt.convert(value)
        except (ValueError, OptionError) as e:
            raise OptionError(f"{var}={value!r}: {e}") from None
    for name, wide in (("default_fp", T.f64), ("default_ip", T.i64)):
        var = "TI_" + name.upper()
        value = os.environ.get(var, "").strip()
        if value and given.get(name) is None:
            if value not in ("32", "64"):
                raise OptionError(f"{var}={value!r}: should be 32 or 64")
            out[name] = wide if value == "64" else (T.f32 if name == "default_fp" else T.i32)
    return out


_generations = itertools.count(1)


class Program:
    def seed_random(self, seed: int) -> None:
        """One 64-bit random state per worker thread (and the caller), or per thread of the
        grid (the simulated grid's, a GPU's), from ``seed`` (``ti.init(random_seed=)``; the
        service's ``seed`` op for remote programs). The states are storage of the program's
        allocator (device memory on a grid), written in place: compiled launches hold its
        address."""
        states = self.rng.size
        seeds = np.random.SeedSequence(int(seed)).generate_state(states * 2)
        state = seeds.view(np.uint64)
        state[state == 0] = 0x9E3779B97F4A7C15
        self.rng.write()[:] = state

    def __init__(self, config: Config) -> None:
        self.config = config
        self.generation = next(_generations)
        self.fields: dict[int, object] = {}
        # Fields declared without a shape, and the .grad/.dual of those made with
        # needs_grad/needs_dual, not placed yet: while any is left a kernel launch refuses, as
        # Taichi's materialization does (frontend/field.py refuse_unplaced). Empty in a
        # program whose fields are all placed: one truth test per launch.
        self.unplaced: list = []
        self.snode_children: list = []  # ti.root's children (SNode trees of this program)
        # Where kernels run and field and ndarray storage lives (runtime/storage.py): the
        # CPU's own launch over host memory, or a grid (runtime/grid.py) over device memory
        # reached only through explicit copies: the simulated grid's, or a CUDA device's.
        self.launcher: Launcher | None = None
        if config.simulate_grid:
            self.launcher = SimulatedLauncher(config.simulate_grid)
        elif config.arch == cuda:
            self.launcher = cuda_runtime.CudaLauncher(
                cache_directory=cache.cache_dir(config.offline_cache_file_path)
                if config.offline_cache else None)
        self.allocator: Allocator = HostAllocator() if self.launcher is None \
            else self.launcher.allocator
        nthreads = config.cpu_max_num_threads or os.cpu_count() or 1
        self.num_threads = max(1, nthreads)
        states = self.num_threads  # one per worker thread, or per grid thread
        if self.launcher is not None:
            states = max(states, self.launcher.grid[0] * self.launcher.grid[1])
        self.rng: Storage = self.allocator.storage((states,), np.uint64)
        self.seed_random(config.random_seed)
        self._pool = None
        self.tape = None  # the ti.ad.Tape recording kernel launches, if any
        self.remote = None  # arch=ti.remote: the difftape.client runtime running it on a server
        self._print_sink: PrintSink | None = None
        # Where the CPU threads' reverse-mode stacks are counted, set (before any kernel
        # compiles) by a program that runs under a memory quota (the service's engine):
        # runtime/stackbudget.py. None: not counted.
        self.stack_budget: StackBudget | None = None
        self.fwd = None  # the ti.ad.FwdMode (or forward-mode helper) in effect, if any
        # Inside ``ti.graph.capture()``: the recorder (difftape.graph) that launches, fills and
        # copies go to instead of running; host reads refuse while it is set.
        self.capture = None
        # > 0 inside a @ti.ad.no_grad function under forward mode: kernels there give the
        # fields they write zero tangents (variant "fwd_const")
        self.no_tangents = 0
        # Bumped whenever a field gains .grad/.dual storage: derivative variants of kernels
        # compiled before then would not read or write it.
        self.storage_epoch = 0
        # ti.init(kernel_profiler=True): (kernel name, start in s, duration in ms) per launch
        self.profile: list[tuple[str, float, float]] = []
        # Seconds spent compiling kernels (frontend to loaded code), as Taichi reports it.
        self.compile_seconds = 0.0
        # Set by a bridge that runs passes of this program later, on another thread (JAX's
        # FFI calls run when XLA executes the computation, after the JAX call returned:
        # interop/jax.py): called before each operation of the program from Python (a
        # launch, a host read or write of storage, a Tape, a graph replay) to wait until the
        # passes dispatched so far have run, so that they happen in the order written.
        # None in a program without such a bridge: one test per operation.
        self.await_passes: Callable[[], None] | None = None

    @property
    def print_sink(self) -> PrintSink | None:
        """Where kernels' print() lines go when not to the process's stdout
        (``runtime/printsink.py``): set by a program that collects them for its caller (the
        service's engine). A grid's launcher writes its kernels' lines there too."""
        return self._print_sink

    @print_sink.setter
    def print_sink(self, sink: PrintSink | None) -> None:
        self._print_sink = sink
        if self.launcher is not None:
            self.launcher.print_sink = sink

    def invalidate_kernels(self) -> None:
        """Make every kernel compile again at its next call (it holds the storage addresses of
        the fields it uses, some of which were just freed: ``SNodeTree.destroy()``)."""
        self.generation = next(_generations)

    @property
    def pool(self):
        if self._pool is None:
            # Function-level: the thread pool's module loads with the first ti.init, not on import.
            from .parallel import ThreadPool

            self._pool = ThreadPool(self.num_threads)
        return self._pool

    def wait_for_passes(self) -> None:
        """Wait for the passes a bridge dispatched and has not run yet (``await_passes``)
        before an operation of the program."""
        if self.await_passes is not None:
            self.await_passes()

    def zero(self, storage: Storage) -> None:
        """Zero a field's or ndarray's storage; in host memory large ones on all cores
        (clearing gradients between iterations is memory-bound, and one core cannot saturate
        memory bandwidth); in device memory with a device memset."""
        if self.await_passes is not None:
            self.await_passes()
        if self.capture is not None:  # inside ti.graph.capture(): recorded, not run
            self.capture.zero(storage)
            return
        if not storage.host:
            storage.zero()
            return
        arr = storage.array
        if arr.nbytes < (1 << 20) or self.num_threads == 1:
            arr.fill(0)
            return
        # Chunks of 256 KiB or more, several per thread: a worker that another process holds
        # up then delays only a small piece (see runtime/parallel.py).
        chunk = max(1 << 18, -(-arr.nbytes // (self.num_threads * 8)))
        self.pool.run_chunks(None, arr.ctypes.data, 0, arr.nbytes, chunk,
                             address=get_target().zero_task())

    def close(self) -> None:
        if self.remote is not None:  # arch=ti.remote: end the server session
            self.remote.close()
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self.launcher is not None:
            self.launcher.close()  # its allocator's memory, then the device
        else:
            self.allocator.close()


_current: Program | None = None

#: Backends that run the program somewhere else, by arch: ``attach(prog, **options)``. The
#: package registers ``remote`` (difftape.client) through :func:`register_backend`, so the core
#: never imports the client.
_backends: dict[Arch, Callable[..., object]] = {}


def register_backend(arch: Arch, attach: Callable[..., object]) -> None:
    """Registration point for a backend that runs programs elsewhere: ``ti.init(arch=arch,
    **options)`` makes a fresh :class:`Program` and calls ``attach(prog, **options)``, which
    installs its runtime as ``prog.remote``."""
    _backends[arch] = attach


def get() -> Program:
    """The current program, created with default settings on first use (as Taichi does)."""
    global _current
    if _current is None:
        _current = Program(Config(simulate_grid=grid_from_environment()))
    return _current


def user_error(exc: BaseException) -> None:
    """Ready ``exc``, a difftape error leaving a public entry point, for the user: its
    traceback cut to the user's code (errors.trim_traceback), unless the program was started
    with ``ti.init(print_full_traceback=True)`` (or ``TI_PRINT_FULL_TRACEBACK=1``), Taichi's
    switch for debugging the compiler itself. The caller re-raises it with a bare ``raise``."""
    if _current is None or not _current.config.print_full_traceback:
        trim_traceback(exc)


def entry_point(fn: Callable) -> Callable:
    """Decorate a public function that runs kernels or compiles them (a Tape's exit,
    ``ti.ad.jacobian``, ...): the difftape errors leaving it show the user's frames only
    (:func:`user_error`). Hot paths (a kernel's call) catch inline instead: no wrapper call."""
    @functools.wraps(fn)
    def entry(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except DifftapeError as e:
            user_error(e)
            raise

    return entry


def init(arch: Arch | None = None, default_fp=None, default_ip=None, _test_mode: bool = False,
         **options) -> SpecialConfig | None:
    """``ti.init``: start a fresh program with this configuration (fields and kernels of the
    previous one are dropped). The keywords are Taichi's; :data:`OPTIONS` says what each does
    here. Unknown keywords raise ``KeyError`` (:class:`~difftape.errors.UnknownOptionError`).

    ``_test_mode=True`` is Taichi's way of checking the arguments alone: they are checked as
    always, the previous program is dropped, but no program starts and nothing is applied (not
    even the logging level); the :class:`SpecialConfig` they give is returned."""
    global _current
    unknown = [k for k in options if k not in OPTIONS]
    if "default_up" in options:
        raise UnknownOptionError("'default_up' is always the unsigned type of 'default_ip'; "
                                 "set 'default_ip' instead")
    if unknown:
        raise UnknownOptionError(f"Unrecognized keyword argument(s) for ti.init: "
                                 f"{', '.join(unknown)}")
    env = options_from_environment({**options, "default_fp": default_fp,
                                    "default_ip": default_ip})
    default_fp = env.pop("default_fp", default_fp)
    default_ip = env.pop("default_ip", default_ip)
    options = {**env, **options}
    arch = arch or cpu
    forced = arch_from_environment()
    if forced is not None:
        arch, source = forced
    remote_opts = {}
    settings = {}
    for name, value in options.items():
        opt = OPTIONS[name]
        if opt.refusal:
            if value != opt.only:
                raise OptionError(f"ti.init({name}={value!r}): {opt.refusal}")
        elif opt.no_effect:
            if name not in _warned:
                _warned.add(name)
                warnings.warn(f"difftape: ti.init({name}=...) has no effect: {opt.no_effect}",
                              stacklevel=2)
        elif opt.convert is None:
            remote_opts[name] = value
        else:
            settings[name] = opt.convert(value)
    where = f"arch={arch}" if forced is None else source
    if "simulate_grid" not in settings and arch != remote:
        # (a remote program's kernels are compiled by the server: the variable is about
        # this process's own launches)
        settings["simulate_grid"] = grid_from_environment()
    if arch == remote and settings.get("simulate_grid"):
        raise OptionError(f"ti.init(simulate_grid=...) is not available under {where}: "
                          "kernels run on the server; run locally (arch=ti.cpu) to simulate "
                          f"a GPU grid (unset {SIMULATE_GPU_VAR})")
    if arch == remote and settings.get("kernel_profiler"):
        raise OptionError(f"ti.init(kernel_profiler=True) is not available under {where}: "
                          "kernels run on the server")
    if arch == remote and settings.get("deterministic"):  # the server compiles its own way
        raise OptionError(f"ti.init(deterministic=True) is not supported under {where}: the "
                          "server schedules kernels its own way; run locally (arch=ti.cpu) for "
                          "bitwise-reproducible results")
    if remote_opts and arch != remote:
        if forced is None:
            raise OptionError(f"ti.init({', '.join(remote_opts)}=...) applies to arch=ti.remote "
                              f"only, not arch={arch}")
        # The environment moved a remote program back to this machine: what only says where
        # the server is has nothing to act on, and the user asked for exactly that.
        warnings.warn(f"difftape: {source} runs this program here; ti.init's "
                      f"{', '.join(k + '=' for k in remote_opts)} are not used", stacklevel=2)
        remote_opts = {}
    if _test_mode:
        reset()
        return _special_config({**options, **settings})
    reset()
    if arch in (cuda, gpu):  # also TI_ARCH=cuda
        reason = _no_gpu_reason()
        if reason is None:  # a CUDA device: the program runs on it (runtime/cuda.py)
            if settings.get("simulate_grid"):
                raise OptionError(f"{where} found a CUDA device, and simulate_grid (or "
                                  f"{SIMULATE_GPU_VAR}) asks to run the CUDA target's code "
                                  "on the CPU instead: use one or the other")
            arch = cuda
        elif not settings.get("enable_fallback", True):
            raise ArchUnavailableError(f"ti.init({where}, enable_fallback=False): no CUDA "
                                       f"device can be used here: {reason}; allow the CPU "
                                       "instead with enable_fallback=True (the default)")
        else:
            # As Taichi does when it finds no device: the CPU, with a warning that says why.
            warnings.warn(f"difftape: {where} cannot run on a GPU here: {reason}; "
                          "falling back to the CPU", stacklevel=2)
            arch = cpu
    elif arch not in (cpu, remote):
        if not settings.get("enable_fallback", True):
            raise ArchUnavailableError(f"ti.init({where}, enable_fallback=False): difftape "
                                       f"has no {arch} backend (it runs on the CPU and on "
                                       "CUDA devices)")
        warnings.warn(f"difftape: {where} has no backend here yet; falling back to the CPU",
                      stacklevel=2)
        arch = cpu
    cfg = Config(arch=arch, **settings)
    log.set_logging_level(cfg.log_level)  # every ti.init sets it, as in Taichi
    if default_fp is not None:
        cfg.default_fp = default_fp if isinstance(default_fp, DType) else (
            T.f64 if default_fp is float else T.from_numpy(default_fp))
    if default_ip is not None:
        cfg.default_ip = default_ip if isinstance(default_ip, DType) else (
            T.i32 if default_ip is int else T.from_numpy(default_ip))
    if arch == remote:  # the program runs on a difftape server (difftape.client)
        attach = _backends[remote]

        prog = Program(cfg)
        attach(prog, **remote_opts)
        _current = prog
        return None
    _current = Program(cfg)
    if _current.launcher is not None and arch == cuda:
        log.logger.info("difftape: %s runs on %s", where, _current.launcher.name)
    # Load LLVM and set up the CPU target now rather than inside the first kernel call, so
    # a kernel's first call costs only its own compile (or cache load).
    get_target().warm_up()
    _ = _current.pool  # start the worker threads now, not in the first parallel launch
    return None


def _no_gpu_reason() -> str | None:
    """Why ``arch=ti.cuda``/``ti.gpu`` cannot run on a GPU here (runtime/cuda.py: no pycuda,
    no driver, no device), or None when it can."""
    return cuda_runtime.why_unavailable()


def sync() -> None:
    """``ti.sync()`` for the current local program: on a grid (CUDA, the simulated grid)
    until every launch so far has ended, raising a failed one's error; nothing on the CPU,
    whose launches are synchronous."""
    if _current is not None and _current.launcher is not None:
        _current.launcher.synchronize()


@atexit.register
def _at_exit() -> None:
    """The process ends: launches still queued on a grid are waited for, and a failure
    among them is reported (Python prints an exception raised here) rather than lost."""
    sync()


def reset() -> None:
    """``ti.reset``: drop the current program."""
    global _current
    prog, _current = _current, None
    if prog is not None:
        prog.close()  # (raises a failure of a launch still queued, once all is released)
