"""The CUDA target: the shared lowering retargeted to ``nvptx64-nvidia-cuda``, PTX out.

What is CUDA-only lives here, as a thin layer over the shared lowering
(:class:`.target.Target`). ``ti.init(arch=ti.cuda)`` compiles with it and loads and launches
the PTX through ``runtime/cuda.py``'s ``CudaLauncher`` (the target itself loads nothing); every
kernel is also checked to compile to PTX that ``ptxas`` accepts (``ptx_check.py``), and its
lowering, compiled for the host with the grid position as parameters (``simgrid.py``), is what
the simulated grid runs on the CPU.

- **Entry points.** Task ``k`` is one kernel ``void @<kernel>_task<k>(ptr %ctx)`` (the
  ``ptx_kernel`` calling convention). A range task computes its own [begin, end) from the
  launch context (no host round trip for the bounds) and runs a grid-stride loop: global
  thread ``g`` of ``G`` runs the prologue, indices ``begin + g, begin + g + G, ...`` and the
  epilogue, so any grid size is correct. A serial task, and a range task whose schedule is
  not ``any`` (deterministic mode's ``ordered``/``serial``), runs on global thread 0 alone, in
  index order; the other threads return at once.
- **Math** calls libdevice's ``__nv_<name>[f]``; the functions a module uses are linked into
  it from the toolkit's ``libdevice.10.bc`` (or the ``nvidia-cuda-nvcc`` wheel's),
  internalised and optimised with the kernel.
- **Atomics** are LLVM's ``atomicrmw`` (f32 and f64 ``fadd`` are native on sm_60 and later;
  LLVM expands the others into compare-and-swap loops).
- **Reverse-mode stacks** come from a preallocated pool: the launch context holds the pool's
  address and each thread's capacity in 64-bit slots (``CtxLayout.stack_pool``/
  ``stack_cap``); thread ``g`` owns slots ``[g * cap, (g + 1) * cap)``. A push beyond the
  capacity stores nothing and sets ``CtxLayout.overflow`` (pops of such slots read 0), so the
  launcher can rerun the launch with a larger pool; the results of an overflowed launch are
  never used.
- **Private copies** of privatized scatter targets come from the device heap (``malloc``,
  zeroed); an exhausted heap sets ``overflow`` and ends the thread's task.
- **Errors** (failed bounds checks and assertions) are the shared lowering's: the error code
  and value are written into the launch context (device memory), read after a synchronous
  launch. As launches are asynchronous, a failure also claims the program's status block
  (``CtxLayout.status``) with the kernel's tag, code and value, read at the host's next sync
  point; every task returns at once while the block is claimed, so the launches queued after
  a failed one do not run on.
- **Random numbers**: thread ``g`` uses state ``g`` (the launcher provides one per thread).
- ``print`` appends a binary record (the line's number and its operands) to the program's
  print buffer in device memory, which the host formats with C's snprintf at its next sync
  point (``runtime/printsink.py``): the same text as the CPU's printf, in order, and nothing
  of an attempt rerun after an overflow (its records are discarded). Not ``vprintf``, whose
  buffer is lost with the process, drops lines silently when full and interleaves with the
  host's output wherever the driver flushes it.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
from pathlib import Path

import llvmlite
import llvmlite.binding as llvm

from ..errors import CompileError
from ..ir.nodes import Block, Task
from ..types import DType
from .layout import PRINT_SINK_HEADER
from .llvm_lowering import TRANSCENDENTAL, Lowering, ll_type
from .optimize import ModuleOptions, module_options

#: the oldest architecture CUDA 13's ptxas accepts; PTX made for it runs on all later GPUs
DEFAULT_ARCH = "sm_75"
_SREG = "llvm.nvvm.read.ptx.sreg"


def _toolkit_roots() -> list[str]:
    """Where a CUDA toolkit may be, most specific first: ``$CUDA_HOME``, ``$CUDA_PATH``, the
    toolkit of a ``ptxas``/``nvcc`` on the PATH, /usr/local/cuda, the ``nvidia-cuda-nvcc``
    wheel."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    for tool in ("ptxas", "nvcc"):
        found = shutil.which(tool)
        if found:
            roots.append(str(Path(found).resolve().parents[1]))
    roots.append("/usr/local/cuda")
    try:
        import nvidia.cuda_nvcc as wheel  # the nvidia-cuda-nvcc wheel

        roots += [str(Path(p)) for p in wheel.__path__]
    except ImportError:
        pass
    return [r for r in roots if r]


def find_libdevice() -> Path | None:
    """``libdevice.10.bc``: ``$DIFFTAPE_LIBDEVICE``, else from a toolkit
    (:func:`_toolkit_roots`)."""
    env = os.environ.get("DIFFTAPE_LIBDEVICE")
    if env:
        return Path(env) if Path(env).is_file() else None
    for root in _toolkit_roots():
        for cand in sorted(Path(root).glob("nvvm/libdevice/libdevice*.bc")):
            return cand
    return None


def find_ptxas() -> str | None:
    """The ``ptxas`` assembler: ``$DIFFTAPE_PTXAS``, the PATH, else a toolkit's ``bin/``
    (:func:`_toolkit_roots`, the ``nvidia-cuda-nvcc`` wheel included). ``DIFFTAPE_PTXAS=""``
    (set and empty) means none: PTX is then loaded through the driver's JIT."""
    env = os.environ.get("DIFFTAPE_PTXAS")
    if env is not None:
        return env if env and os.access(env, os.X_OK) else None
    found = shutil.which("ptxas")
    if found:
        return found
    for root in _toolkit_roots():
        cand = Path(root) / "bin" / "ptxas"
        if os.access(cand, os.X_OK):
            return str(cand)
    return None


class CUDATarget:
    """PTX for one compute capability (``sm_XX``)."""

    name = "cuda"
    paired_atomics = False  # f32 atomic adds are native (red.global.add.f32)
    parallel_access_groups = False  # a thread runs one index: no loop to vectorize
    native_saturating_casts = True  # cvt.rzi.sat: NaN -> 0, out-of-range values clamp
    triple = "nvptx64-nvidia-cuda"
    #: the device heap (private copies of privatized scatter targets)
    malloc_symbol = "malloc"
    free_symbol = "free"

    def __init__(self, arch: str = DEFAULT_ARCH) -> None:
        if not re.fullmatch(r"sm_\d+[af]?", arch):
            raise ValueError(f"not a CUDA architecture: {arch!r} (expected e.g. 'sm_75')")
        llvm.initialize_all_targets()
        llvm.initialize_all_asmprinters()
        self.arch = arch
        self.tm = llvm.Target.from_triple(self.triple).create_target_machine(cpu=arch, opt=3)
        self.datalayout = str(self.tm.target_data)

    @functools.cached_property
    def fingerprint(self) -> str:
        return f"cuda:{self.arch}:llvmlite{llvmlite.__version__}:{find_libdevice()}"

    # ------------------------------------------------------------------ task entry points
    def task_functions(self, low: Lowering, k: int, task: Task) -> list[str]:
        """One kernel per task: a grid-stride loop, or thread 0 alone (see the module)."""
        fn = low.begin_task(self.entry_header(low, k), task)
        self._stop_after_failure(low)
        g, threads = self.global_thread(low)
        low.cuda_thread = g
        one_thread = task.kind == "serial" or task.schedule != "any"
        if one_thread:
            first = fn.ins(f"icmp eq i64 {g}, 0")
            go, idle = fn.label("thread0"), fn.label("idle")
            fn.term(f"br i1 {first}, label %{go}, label %{idle}")
            fn.start_block(idle)
            fn.term("ret void")
            fn.start_block(go)
        low.task_setup(task)
        if task.kind == "serial":
            low.block(task.body)
        else:
            def indices():
                serial, low.serial = low.serial, True
                low.block(task.bounds)  # pure: every thread computes the range itself
                low.serial = serial
                b, e = (fn.ins(f"sext {ll_type(s.dtype)} {low.values[s]} to i64")
                        for s in (task.begin, task.end))
                if one_thread:
                    return b, e, None, True
                return fn.ins(f"add i64 {b}, {g}"), e, threads, True

            low.range_body(task, indices, ordered=False)
        return [low.finish_task()]

    @staticmethod
    def _status(low: Lowering) -> str:
        """The program's status block (``CtxLayout.status``): word 0 is the tag of the kernel
        whose launch failed first since the host last looked (0: none), word 1 its error
        code, the words after it its message's values (``runtime/grid.STATUS_WORDS``)."""
        address = low.fn.ins(f"load i64, ptr {low.ctx_slot(low.layout.status)}")
        return low.fn.ins(f"inttoptr i64 {address} to ptr")

    def _stop_after_failure(self, low: Lowering) -> None:
        """Every thread returns at once when a launch before this one failed: launches are
        asynchronous, and those queued after a failed one must not run on."""
        fn = low.fn
        failed = fn.ins(f"load volatile i64, ptr {self._status(low)}")
        stop = fn.ins(f"icmp ne i64 {failed}, 0")
        halt, go = fn.label("halted"), fn.label("run")
        fn.term(f"br i1 {stop}, label %{halt}, label %{go}")
        fn.start_block(halt)
        fn.term("ret void")
        fn.start_block(go)

    def error_reported(self, low: Lowering, code: int, values: tuple) -> None:
        """Also claim the program's status block (first failure wins, by compare-and-swap)
        with this kernel's tag, and write the code and the values there: the launches queued
        after this one see it and return, and the host reads it at its next sync point."""
        fn = low.fn
        status = self._status(low)
        tag = fn.ins(f"load i64, ptr {low.ctx_slot(low.layout.tag)}")
        old = fn.ins(f"cmpxchg ptr {status}, i64 0, i64 {tag} monotonic monotonic")
        won = fn.ins(f"extractvalue {{ i64, i1 }} {old}, 1")
        write, done = fn.label("status_write"), fn.label("status_done")
        fn.term(f"br i1 {won}, label %{write}, label %{done}")
        fn.start_block(write)
        fn.void(f"store i64 {code}, ptr " + fn.ins(f"getelementptr i64, ptr {status}, i64 1"))
        for k, v in enumerate(values):
            p = fn.ins(f"getelementptr i64, ptr {status}, i64 {2 + k}")
            low.store_at(p, v.dtype, low.values[v])
        fn.term(f"br label %{done}")
        fn.start_block(done)

    def entry_header(self, low: Lowering, k: int) -> str:
        """Task ``k``'s ``define`` line: a ``ptx_kernel`` taking the launch context."""
        return f"define ptx_kernel void @{low.task_name(k)}(ptr noalias %ctx) #0"

    def global_thread(self, low: Lowering) -> tuple[str, str]:
        """(this thread's index in the grid, the number of threads in the grid) as i64,
        from PTX's special registers (the simulated grid passes them as parameters)."""
        fn = low.fn
        regs = {}
        for reg in ("tid.x", "ntid.x", "ctaid.x", "nctaid.x"):
            low.declare(f"declare i32 @{_SREG}.{reg}()")
            v = fn.ins(f"call i32 @{_SREG}.{reg}()")
            regs[reg] = fn.ins(f"zext i32 {v} to i64")
        block = fn.ins(f"mul i64 {regs['ctaid.x']}, {regs['ntid.x']}")
        g = fn.ins(f"add i64 {block}, {regs['tid.x']}")
        return g, fn.ins(f"mul i64 {regs['nctaid.x']}, {regs['ntid.x']}")

    def entry_names(self, low: Lowering) -> list[str]:
        return [low.task_name(k) for k in range(len(low.ir.tasks))]

    def rng_index(self, low: Lowering) -> str:
        return low.cuda_thread

    # ------------------------------------------------------------------ code inside a body
    def math_call(self, low: Lowering, name: str, t: DType, args: list[str],
                  paired: bool = False) -> str:
        ty = ll_type(t)
        sym = f"__nv_{name}{'f' if t.bits == 32 else ''}"
        pure = low.attribute_group("nounwind willreturn memory(none)")
        low.declare(f"declare {ty} @{sym}({', '.join([ty] * len(args))}) {pure}")
        return low.fn.ins(f"call {ty} @{sym}({', '.join(f'{ty} {a}' for a in args)})")

    def loop_hint(self, low: Lowering, body: Block, group: int | None = None) -> str:
        return ""

    def private_copy(self, low: Lowering, elements: int, elem_bytes: int) -> str:
        fn = low.fn
        nbytes = elements * elem_bytes
        low.declare(f"declare ptr @{self.malloc_symbol}(i64)")
        low.declare(f"declare void @{self.free_symbol}(ptr)")
        low.declare("declare void @llvm.memset.p0.i64(ptr, i8, i64, i1)")
        p = fn.ins(f"call ptr @{self.malloc_symbol}(i64 {nbytes})")
        null = fn.ins(f"icmp eq ptr {p}, null")
        fail, ok = fn.label("heap_full"), fn.label("heap_ok")
        fn.term(f"br i1 {null}, label %{fail}, label %{ok}")
        fn.start_block(fail)
        self._set_overflow(low)
        fn.term("ret void")  # no copy, stack or turn is held yet (copies come first)
        fn.start_block(ok)
        fn.void(f"call void @llvm.memset.p0.i64(ptr {p}, i8 0, i64 {nbytes}, i1 false)")
        return p

    def release_private(self, low: Lowering, ptr: str) -> None:
        low.fn.void(f"call void @{self.free_symbol}(ptr {ptr})")

    @staticmethod
    def _set_overflow(low: Lowering) -> None:
        low.fn.void(f"store volatile i64 1, ptr {low.ctx_slot(low.layout.overflow)}")

    def stack_init(self, low: Lowering) -> None:
        """This thread's slice of the pool: ``pool + g * cap`` slots of 8 bytes."""
        fn = low.fn
        top = fn.alloca("i64")
        fn.allocas.append(f"  store i64 0, ptr {top}")
        pool = fn.ins(f"load ptr, ptr {low.ctx_slot(low.layout.stack_pool)}")
        cap = fn.ins(f"load i64, ptr {low.ctx_slot(low.layout.stack_cap)}")
        first = fn.ins(f"mul i64 {low.cuda_thread}, {cap}")
        data = fn.ins(f"getelementptr i64, ptr {pool}, i64 {first}", "p")
        low.stack_state = (data, top, cap)

    def stack_push(self, low: Lowering, bits: str) -> None:
        fn = low.fn
        data, top, cap = low.stack_state
        n = fn.ins(f"load i64, ptr {top}")
        room = fn.ins(f"icmp ult i64 {n}, {cap}")
        put, full, done = fn.label("push"), fn.label("push_full"), fn.label("pushed")
        fn.term(f"br i1 {room}, label %{put}, label %{full}")
        fn.start_block(put)
        fn.void(f"store i64 {bits}, ptr {fn.ins(f'getelementptr i64, ptr {data}, i64 {n}')}")
        fn.term(f"br label %{done}")
        fn.start_block(full)
        self._set_overflow(low)
        fn.start_block(done)
        fn.void(f"store i64 {fn.ins(f'add i64 {n}, 1')}, ptr {top}")

    def stack_pop(self, low: Lowering) -> str:
        fn = low.fn
        data, top, cap = low.stack_state
        out = fn.alloca("i64")
        n = fn.ins(f"sub i64 {fn.ins(f'load i64, ptr {top}')}, 1")
        fn.void(f"store i64 {n}, ptr {top}")
        fn.void(f"store i64 0, ptr {out}")
        kept = fn.ins(f"icmp ult i64 {n}, {cap}")
        get, done = fn.label("pop"), fn.label("popped")
        fn.term(f"br i1 {kept}, label %{get}, label %{done}")
        fn.start_block(get)
        v = fn.ins(f"load i64, ptr {fn.ins(f'getelementptr i64, ptr {data}, i64 {n}')}")
        fn.void(f"store i64 {v}, ptr {out}")
        fn.start_block(done)
        return fn.ins(f"load i64, ptr {out}")

    def stack_release(self, low: Lowering) -> None:
        pass  # the pool belongs to the launch

    def pause(self, low: Lowering) -> None:
        low.declare("declare void @llvm.nvvm.nanosleep(i32)")
        low.fn.void("call void @llvm.nvvm.nanosleep(i32 64)")

    def print_call(self, low: Lowering, fmt: str, args: list[str], line: int) -> None:
        """Append the line as a record to the program's print buffer (the launch context's
        ``print_sink``; ``runtime/printsink.py``'s :class:`~..runtime.printsink.PrintRecords`):
        the key (the kernel's tag in the high 32 bits, ``line`` in the low ones) and one
        64-bit word per operand (a double's bits, an integer widened as C's varargs widen
        it), its place reserved by one atomic add on the buffer's cursor. A record that does
        not fit is not written and counted as dropped (as is every record after it: the
        cursor only grows). The host formats the records with C's snprintf after the launch
        (``fmt`` is not needed here), so the text is the CPU's, byte for byte."""
        fn = low.fn
        size = 8 * (1 + len(args))
        sink = fn.ins(f"load ptr, ptr {low.ctx_slot(low.layout.print_sink)}")
        cap = fn.ins(f"load i64, ptr {fn.ins(f'getelementptr i64, ptr {sink}, i64 1', 'p')}")
        off = fn.ins(f"atomicrmw add ptr {sink}, i64 {size} monotonic")
        end = fn.ins(f"add i64 {off}, {size}")
        write, drop, done = fn.label("print_write"), fn.label("print_drop"), fn.label("printed")
        fn.term(f"br i1 {fn.ins(f'icmp ule i64 {end}, {cap}')}, label %{write}, "
                f"label %{drop}")
        fn.start_block(write)
        at = fn.ins(f"add i64 {off}, {PRINT_SINK_HEADER}")
        record = fn.ins(f"getelementptr i8, ptr {sink}, i64 {at}", "p")
        tag = fn.ins(f"load i64, ptr {low.ctx_slot(low.layout.tag)}")
        key = fn.ins(f"or i64 {fn.ins(f'shl i64 {tag}, 32')}, {line}")
        fn.void(f"store i64 {key}, ptr {record}")
        for k, a in enumerate(args):
            ty, x = a.split(" ", 1)
            if ty == "double":
                x = fn.ins(f"bitcast double {x} to i64")
            elif ty != "i64":
                x = fn.ins(f"zext {ty} {x} to i64")
            fn.void(f"store i64 {x}, ptr {fn.ins(f'getelementptr i64, ptr {record}, i64 {k + 1}')}")
        fn.term(f"br label %{done}")
        fn.start_block(drop)
        dropped = fn.ins(f"getelementptr i64, ptr {sink}, i64 2", "p")
        fn.ins(f"atomicrmw add ptr {dropped}, i64 1 monotonic")
        fn.term(f"br label %{done}")
        fn.start_block(done)

    def module_trailer(self, low: Lowering) -> list[str]:
        # libdevice asks __nvvm_reflect whether to flush denormals: no (IEEE, as the CPU).
        n = low.metadata('!{{i32 4, !"nvvm-reflect-ftz", i32 0}}')
        return [f"!llvm.module.flags = !{{!{n}}}"]

    # ------------------------------------------------------------------ compile and load
    def compile(self, text: str) -> bytes:
        """PTX (ASCII) for a module's text, libdevice linked in where it calls ``__nv_*``."""
        return self.compile_many([text])

    def compile_many(self, texts: list[str]) -> bytes:
        """One PTX module for several modules' texts (their symbols must differ): linked
        before libdevice and optimisation, so checking many kernels pays for those once."""
        mod = llvm.parse_assembly(texts[0])
        mod.verify()
        for text in texts[1:]:
            other = llvm.parse_assembly(text)
            other.verify()
            mod.link_in(other)
        needed = sorted(f.name for f in mod.functions
                        if f.is_declaration and f.name.startswith("__nv_"))
        if needed:
            lib = llvm.parse_bitcode(_libdevice_subset(tuple(needed)))
            lib.triple, lib.data_layout = mod.triple, mod.data_layout
            mod.link_in(lib)
            for f in mod.functions:
                if f.name.startswith("__nv_") and not f.is_declaration:
                    f.linkage = "internal"
        pto = llvm.create_pipeline_tuning_options(3)
        pb = llvm.create_pass_builder(self.tm, pto)
        # Maximizing bandwidth, as for every module before the CPU target chose per module
        # (PTX code is unchanged by that choice; not re-measured on a GPU); LLVM's machine
        # scheduler as LLVM has it, whatever the CPU target chose.
        with module_options(ModuleOptions(maximize_bandwidth=True)):
            pb.getModulePassManager().run(mod, pb)
            return self.tm.emit_assembly(mod).encode()

    def load(self, obj: bytes, names: list[str]) -> tuple[object, dict[str, int]]:
        raise CompileError("PTX is loaded by the CUDA launcher (runtime/cuda.py, "
                           "ti.init(arch=ti.cuda)), not by the code generator")


@functools.cache
def _libdevice_all() -> bytes:
    """The libdevice functions our math can call (and what they need), as bitcode: parsing
    and optimising all of libdevice (about 1 s) happens once per process."""
    path = find_libdevice()
    if path is None:
        raise CompileError("libdevice (libdevice.10.bc) not found: install the CUDA toolkit "
                           "or the nvidia-cuda-nvcc wheel, or set DIFFTAPE_LIBDEVICE")
    keep = {f"__nv_{n}{s}" for n in TRANSCENDENTAL for s in ("f", "")}
    return _only(llvm.parse_bitcode(path.read_bytes()), keep)


@functools.cache
def _libdevice_subset(names: tuple[str, ...]) -> bytes:
    """Bitcode with just ``names`` (and their callees) defined."""
    return _only(llvm.parse_bitcode(_libdevice_all()), set(names))


def _only(mod, keep: set[str]) -> bytes:
    for f in mod.functions:
        if not f.is_declaration and f.name not in keep:
            f.linkage = "internal"
    for g in mod.global_variables:
        if not g.is_declaration:
            g.linkage = "internal"
    mpm = llvm.create_new_module_pass_manager()
    mpm.add_global_dead_code_eliminate_pass()
    mpm.run(mod, llvm.create_pass_builder(llvm.Target.from_triple(CUDATarget.triple)
                                          .create_target_machine(),
                                          llvm.create_pipeline_tuning_options(0)))
    return mod.as_bitcode()


@functools.cache
def get_target(arch: str = DEFAULT_ARCH) -> CUDATarget:
    return CUDATarget(arch)
