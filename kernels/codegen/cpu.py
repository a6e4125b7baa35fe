"""The CPU target: host-tuned LLVM at O3, vector math from glibc's libmvec, ORC/JITLink loading.

Transcendentals are called through ``dt_<name>`` symbols bound to libm, each carrying a
``vector-function-abi-variant`` attribute that names libmvec's AVX2/AVX-512 version. LLVM's
loop vectorizer then calls e.g. ``_ZGVdN8v_sinf`` on 8 lanes at once (measured 8-16x faster
than the scalarized ``llvm.sin`` that LLVM emits without a vector library). Where libmvec is
missing (not glibc), the scalar calls remain and are still correct. The sine and cosine
of one value (what any derivative of either needs) are one call of our own ``dt_sincos[f]``
(:mod:`.vecmath`), inlined into the vector loop after vectorization.

The task ABI (:class:`.target.Target`): each task is ``void @<kernel>_task<k>(ptr %ctx, i64
%begin, i64 %end, i32 %tid)``, called by the thread pool (``runtime/parallel.py``) once per
chunk [begin, end) of a range task's indices (once for a serial task) with the pool thread's
id; a range task also gets ``void @<kernel>_bounds<k>(ptr %ctx, ptr %out)`` computing its
range. Scratch memory comes from libc: a chunk's private copies from ``calloc``, the
reverse-mode stack grows by ``realloc`` (counted first in the program's stack budget where it
has one: ``runtime/stackbudget.py``); a thread's random state is ``rng[tid]``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import itertools
import re
import threading

import llvmlite
import llvmlite.binding as llvm

from ..errors import CompileError
from ..ir.nodes import Block, Stmt, Task, walk
from ..types import DType
from . import vecmath
from .layout import (
    PRINT_SINK_HEADER,
    STACK_BUDGET_ASK,
    STACK_BUDGET_LIMIT,
    STACK_BUDGET_USED,
    STACK_REFUSED,
)
from .llvm_lowering import TRANSCENDENTAL, FunctionText, Lowering
from .optimize import ModuleOptions, module_options

_LIBM_NAMES = {"sin": "sin", "cos": "cos", "tan": "tan", "asin": "asin", "acos": "acos",
               "atan": "atan", "tanh": "tanh", "exp": "exp", "log": "log", "pow": "pow",
               "atan2": "atan2"}
_ARITY = {"pow": 2, "atan2": 2}

#: A load or store of a type narrower than 32 bits (an ``i8`` activation mask, a ``u8`` image,
#: ``f16``) in a module's text: see :meth:`CPUTarget.module_options`. A kernel's local of such a
#: type (an ``alloca`` before mem2reg) counts too, which errs on the side of the narrower width.
_NARROW_ACCESS = re.compile(r"\b(?:load|store)(?: atomic)? (?:i1|i8|i16|half|bfloat)\b")

#: A vector shift whose amount is a constant vector (its lanes listed), in optimized IR:
#: the element width, the amount's lanes and what follows them (see :func:`defined_shift_lanes`).
_CONSTANT_VECTOR_SHIFT = re.compile(
    r"= (?:shl|lshr|ashr)(?: nuw| nsw| exact)* <\d+ x i(\d+)> "
    r"(?:%[-\w.$]+|<[^<>]*>|splat \([^()]*\)|zeroinitializer|poison|undef), <([^<>]*)>")
_SHIFT_LANE = re.compile(r"i\d+ (-?\d+)")


def defined_shift_lanes(text: str) -> str | None:
    """``text`` with each lane of a constant vector shift amount that is not below the
    element width (a lane whose result is poison) made a shift by 0; None where none is.

    Why: LLVM 22's x86 backend miscompiles such lanes. SLP vectorizes the ``and`` of a
    ``zext(trunc)`` and the ``ashr`` of a ``sext(trunc)`` as two vectors with one constant
    operand vector (``ashr <255, 56, 4294967295, 32>``: the ``and``'s masks fill the
    shift's unused lanes) and blends them. Instruction selection treats the poison lanes of
    the shift as known zero and turns the blend into an OR (``vpternlogq``), while
    ``vpsravq`` fills those lanes with the sign: -1 leaked into the ``and``'s lanes
    (tests/lang/test_unsigned.py, bench/README.md). The IR is right -- the blend never reads
    the poison lanes -- so the lanes may be given any value; shift by 0 is defined, so no
    known-zero claim and no OR remain. Lanes the program reads are never out of range (they
    would be poison), so no result changes."""
    changed = False

    def lanes(m: re.Match) -> str:
        nonlocal changed
        width = int(m.group(1))

        def lane(c: re.Match) -> str:
            nonlocal changed
            if int(c.group(1)) % (1 << width) < width:
                return c.group(0)
            changed = True
            return f"i{width} 0"

        amounts = _SHIFT_LANE.sub(lane, m.group(2))
        return m.group(0)[: m.start(2) - m.start(0)] + amounts + ">"

    out = _CONSTANT_VECTOR_SHIFT.sub(lanes, text)
    return out if changed else None


#: What a branch may hold and still be vectorized: arithmetic and the kernel's own locals.
#: LLVM turns such a branch into ``select``s (both arms computed, no masked memory access).
_SELECTABLE = frozenset({"alloca", "local_store", "if"})


def _selectable(branch: Stmt) -> bool:
    """Does this ``if`` hold only arithmetic on values and locals, nothing that reads or
    writes memory (no loads: a guarded load may be out of bounds on the arm not taken)?"""
    return all(s.op in _SELECTABLE or (s.info.pure and s.op != "load")
               for b in branch.blocks for s in walk(b))


def _indexed_by_loads(body: Block) -> tuple[bool, bool]:
    """Does ``body`` load, and does it store (or update atomically), at an index computed
    from a load (a gather; a scatter)?"""
    data: set[Stmt] = set()
    gather = scatter = False
    for s in walk(body):
        if s.op in ("load", "local_load", "temp_load") or any(a in data for a in s.args):
            data.add(s)
        if s.op == "load" and any(a in data for a in s.args):
            gather = True
        if s.op in ("store", "atomic") and any(a in data for a in s.args[:-1]):
            scatter = True
    return gather, scatter


def worth_vectorizing(body: Block) -> bool:
    """Vectorize a parallel loop only when it stores at indices computed without loads and
    has no branches but ones LLVM if-converts into ``select``s (:func:`_selectable`).
    Stores and atomics at data-dependent indices become scatters, and branches around memory
    accesses masked loads and stores; for such bodies (particle-to-grid transfers) LLVM's cost
    model picks vector code that was measured 1.5-2.5x slower than scalar. Loads at
    data-dependent indices alone are gathers, which pay: MPM's grid-to-particle transfer ran
    1.8x faster and the adjoint of its particle-to-grid transfer (a gather of the grid's
    gradients, per-particle writes) 3.7x (AVX-512, 16 particles per iteration). Branches on
    values only (boundary conditions on a grid: MPM's grid update) run 3-4x faster
    vectorized."""
    if any(s.op == "while" or (s.op == "if" and not _selectable(s)) for s in walk(body)):
        return False
    return not _indexed_by_loads(body)[1]


class CPUTarget:
    name = "cpu"
    # x86/AArch64 float atomic adds are compare-exchange loops: one on 8 bytes does two.
    paired_atomics = True
    #: x86 has no saturating float-to-int conversion: casts are written out (see
    #: ``Lowering._saturating_cast``).
    native_saturating_casts = False
    # The reverse-mode stack grows with libc's allocator, bound under our own names.
    realloc_symbol = "dt_realloc"
    calloc_symbol = "dt_calloc"
    free_symbol = "dt_free"
    yield_symbol = "dt_sched_yield"  # a waiting ordered chunk gives its core away
    printf_symbol = "dt_printf"  # print() in kernels: C's printf (one call per line)
    snprintf_symbol = "dt_snprintf"  # ... or snprintf into the program's print sink
    #: LLVM's machine scheduler reorders each block before register allocation by its model
    #: of the CPU's latencies. Off, a block keeps the order instruction selection gave it
    #: (ours, mostly) and the out-of-order core does the reordering: MPM's p2g.grad (one
    #: unrolled 3x3 stencil adjoint, 900 instructions per particle) ran 4-7% faster, p2g
    #: and g2p 2-4%, no bench/ workload slower and compile time unchanged (Zen 4, LLVM 22).
    machine_scheduler = False
    #: A parallel loop's field and ndarray accesses form an access group the loop declares
    #: parallel (``Lowering.range_body``).
    parallel_access_groups = True
    #: In a loop whose remainder is folded into the vector body (a gather: see
    #: :meth:`loop_hint`), the components of a vector field are masked wide loads and
    #: stores, not one gather or scatter per component: MPM's p2g.grad 140 -> 68 us, g2p
    #: 48 -> 31 us (one thread, AVX-512). Loops without masking compile as before.
    masked_interleaved = True
    #: Code is position-independent, in the small code model: a constant (a vector mask, a
    #: table, a float that is no immediate) is one RIP-relative load and a call one ``call
    #: rel32``, where the JIT's default large model first materializes each address with a
    #: 10-byte ``movabs``. Safe because :meth:`load` links with JITLink (one allocation per
    #: object, stubs for far calls, out-of-range displacements refused). ad_forward's
    #: forward-mode maps ran 23-25% faster, elementwise and the reductions 5-8%; MPM's
    #: kernels as fast as before (their loops lost 1% of their instructions: the constants'
    #: addresses were loop-invariant). See bench/README.md.
    reloc, code_model = "pic", "small"

    def __init__(self) -> None:
        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
        self.cpu = llvm.get_host_cpu_name()
        self.features = llvm.get_host_cpu_features().flatten()
        self.tm = llvm.Target.from_default_triple().create_target_machine(
            cpu=self.cpu, features=self.features, opt=3, reloc=self.reloc,
            codemodel=self.code_model)
        self.triple = llvm.get_process_triple()
        self.datalayout = str(self.tm.target_data)
        self.isa, self.lanes = self._vector_isa()
        # Our sin/cos pair (vecmath) relies on fused multiply-adds being exact and fast.
        self.sincos = bool(self.lanes) and "+fma" in self.features.split(",")
        self.libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
        self.mvec = self._load_libmvec() if self.isa else None
        # ORC's LLJIT, linking objects with JITLink (see :meth:`load`). A failed link raises;
        # its cause (the symbols not found) LLVM reports on stderr.
        self._jit = llvm.create_lljit_compiler(self.tm, use_jit_link=True)
        self._jit_lock = threading.Lock()
        self._symbols: dict[str, int] = {}  # bound by bind_symbol: name -> address
        self._unlinked: dict[str, int] = {}  # ... and not yet in a runtime library
        self._runtime: list[object] = []  # the runtime libraries' resource trackers
        self._library_ids = itertools.count()
        self._bind_scalar_symbols()

    # ------------------------------------------------------------------ setup
    @property
    def vector_math(self) -> str:
        """What vectorized math calls run on, in words (``difftape info``): glibc's
        one-letter variant code (``_ZGVe...``) names the instruction set only to a linker."""
        if not (self.isa and self.mvec):
            return "scalar libm"
        isa = {"e": "AVX-512", "d": "AVX2", "b": "SSE2"}[self.isa]
        return f"libmvec, {isa} ({self.lanes[32]} x f32, {self.lanes[64]} x f64)"

    def _vector_isa(self) -> tuple[str | None, dict[int, int]]:
        feats = set(self.features.split(","))
        if "+avx512f" in feats:
            return "e", {32: 16, 64: 8}
        if "+avx2" in feats:
            return "d", {32: 8, 64: 4}
        if "+sse2" in feats:
            return "b", {32: 4, 64: 2}
        return None, {}

    def _load_libmvec(self):
        try:
            lib = ctypes.CDLL("libmvec.so.1")
            llvm.load_library_permanently("libmvec.so.1")
            return lib
        except OSError:
            return None

    def _bind_scalar_symbols(self) -> None:
        libc = ctypes.CDLL(None)
        # f16 <-> f32/f64 conversions LLVM may leave as compiler-runtime calls: resolve them
        # from libgcc rather than letting the JIT jump to an unresolved address.
        try:
            gcc = ctypes.CDLL("libgcc_s.so.1")
        except OSError:
            gcc = None
        for name in ("__extendhfsf2", "__truncsfhf2", "__truncdfhf2", "__extendhfdf2"):
            fn = getattr(gcc, name, None) if gcc is not None else None
            if fn is not None:
                self.bind_symbol(name, ctypes.cast(fn, ctypes.c_void_p).value)
        for name in ("malloc", "realloc", "calloc", "free", "sched_yield", "printf",
                     "snprintf"):
            self.bind_symbol(f"dt_{name}", ctypes.cast(getattr(libc, name), ctypes.c_void_p).value)
        for name in _LIBM_NAMES.values():
            for suffix in ("f", ""):
                fn = getattr(self.libm, name + suffix)
                self.bind_symbol(f"dt_{name}{suffix}", ctypes.cast(fn, ctypes.c_void_p).value)

    def bind_symbol(self, name: str, address: int) -> None:
        """Make ``name`` resolve to ``address`` in every object loaded from now on (our
        ``dt_*`` names of libc and libm functions, the scheduler's system calls). Other
        undefined names resolve to the process's symbols (libmvec, loaded globally; ``memset``
        or ``fmodf`` that LLVM calls); one that resolves nowhere fails the load. A name keeps
        its first address: loaded code may already call it."""
        with self._jit_lock:
            bound = self._symbols.get(name)
            if bound is None:
                self._symbols[name] = self._unlinked[name] = address
            elif bound != address:
                raise ValueError(f"{name} is bound to {bound:#x}, cannot rebind it to "
                                 f"{address:#x}")

    def vector_variant(self, name: str, t: DType) -> str | None:
        if self.mvec is None or t.bits not in self.lanes:
            return None
        arity = "v" * _ARITY.get(name, 1)
        suffix = "f" if t.bits == 32 else ""
        sym = f"_ZGV{self.isa}N{self.lanes[t.bits]}{arity}_{_LIBM_NAMES[name]}{suffix}"
        return sym if hasattr(self.mvec, sym) else None

    @functools.cached_property
    def fingerprint(self) -> str:
        variants = ",".join(v or "-" for n in TRANSCENDENTAL for v in
                            (self.vector_variant(n, DType("f32", "f", 32)),
                             self.vector_variant(n, DType("f64", "f", 64))))
        # The code model too: an object emitted for another is never loaded from the cache.
        return (f"cpu:{self.triple}:{self.cpu}:{self.features}:{self.reloc}:{self.code_model}"
                f":llvmlite{llvmlite.__version__}:{variants}")

    # ------------------------------------------------------------------ task entry points
    def task_functions(self, low: Lowering, k: int, task: Task) -> list[str]:
        """The chunk function of task ``k`` (and, for a range task, its bounds function): the
        body in a function of its own, called with subnormal results flushed to zero."""
        name = low.task_name(k)
        fn = low.begin_task(f"define internal void @{name}_body(ptr noalias %ctx, i64 %begin, "
                            f"i64 %end, i32 %tid) {self.body_attributes(low)}", task)
        low.task_setup(task)
        if task.kind == "serial":
            low.block(task.body)
        else:
            low.range_body(task, lambda: (fn.ins("trunc i64 %begin to i32"),
                                          fn.ins("trunc i64 %end to i32"), None, False))
        body = low.finish_task()
        enter, leave = self.flush_to_zero(low)
        out = [body, f"""define void @{name}(ptr noalias %ctx, i64 %begin, i64 %end, i32 %tid) #0 {{
entry:
{enter}
  call void @{name}_body(ptr %ctx, i64 %begin, i64 %end, i32 %tid)
{leave}
  ret void
}}
"""]
        if task.kind == "range":
            out.append(low.bounds_function(k, task))
        return out

    # ------------------------------------------------------------------ subnormals
    def body_attributes(self, low: Lowering) -> str:
        """A task body's attributes: kept out of line, so that no floating-point operation
        moves out from under the mode :meth:`flush_to_zero` sets; LLVM folds constants the
        way that mode computes (results flushed, operands not)."""
        return low.attribute_group('nounwind noinline "denormal-fp-math"="preserve-sign,ieee"')

    def flush_to_zero(self, low: Lowering) -> tuple[str, str]:
        """LLVM text (entry-block lines) that saves the thread's floating-point mode and sets
        flush-to-zero (subnormal results become zeros of their sign; subnormal operands are
        kept), and the text that restores the saved mode. Taichi's CPU backend runs with
        that mode (x86's MXCSR.FTZ, AArch64's FPCR.FZ) for the whole process; here it holds
        while kernel code runs, so NumPy and Python on the calling thread are unaffected."""
        if self.triple.startswith(("x86_64", "i686", "i386")):
            low.declare("declare void @llvm.x86.sse.stmxcsr(ptr)")
            low.declare("declare void @llvm.x86.sse.ldmxcsr(ptr)")
            return ("  %mxcsr.saved = alloca i32, align 4\n"
                    "  %mxcsr.ftz = alloca i32, align 4\n"
                    "  call void @llvm.x86.sse.stmxcsr(ptr %mxcsr.saved)\n"
                    "  %mxcsr.old = load i32, ptr %mxcsr.saved, align 4\n"
                    "  %mxcsr.new = or i32 %mxcsr.old, 32768\n"  # bit 15: FTZ
                    "  store i32 %mxcsr.new, ptr %mxcsr.ftz, align 4\n"
                    "  call void @llvm.x86.sse.ldmxcsr(ptr %mxcsr.ftz)",
                    "  call void @llvm.x86.sse.ldmxcsr(ptr %mxcsr.saved)")
        if self.triple.startswith(("aarch64", "arm64")):
            low.declare("declare i64 @llvm.aarch64.get.fpcr()")
            low.declare("declare void @llvm.aarch64.set.fpcr(i64)")
            return ("  %fpcr.old = call i64 @llvm.aarch64.get.fpcr()\n"
                    "  %fpcr.new = or i64 %fpcr.old, 16777216\n"  # bit 24: FZ
                    "  call void @llvm.aarch64.set.fpcr(i64 %fpcr.new)",
                    "  call void @llvm.aarch64.set.fpcr(i64 %fpcr.old)")
        raise NotImplementedError(f"difftape does not know how to flush subnormals to zero on "
                                  f"{self.triple} (as Taichi's CPU backend computes)")

    def entry_names(self, low: Lowering) -> list[str]:
        names = []
        for k, t in enumerate(low.ir.tasks):
            names.append(low.task_name(k))
            if t.kind == "range":
                names.append(low.bounds_name(k))
        return names

    def rng_index(self, low: Lowering) -> str:
        return low.fn.ins("sext i32 %tid to i64")

    def loop_hint(self, low: Lowering, body: Block, group: int | None = None) -> str:
        """The loop's metadata: its access group declared parallel (``group``), vectorization
        off where not :func:`worth_vectorizing`, and the remainder folded into the vector
        loop where the body gathers: LLVM's scalar remainder loop is optimized apart (the SLP
        vectorizer packs it, so fewer multiply-adds fuse), which gave particles near a
        chunk's end other last bits than the rest, so results depended on the thread count
        (MPM's p2g.grad); with the remainder run by masked vector code every index computes
        alike. Loops that do not gather keep LLVM's remainder loop, as before this change
        (their code is unchanged: bench/README.md)."""
        props = []
        if group is not None:
            props.append(low.metadata(f'!{{{{!"llvm.loop.parallel_accesses", !{group}}}}}'))
        if not worth_vectorizing(body):
            off = getattr(low, "_no_vectorize_md", None)
            if off is None:
                off = low._no_vectorize_md = low.metadata('!{{!"llvm.loop.vectorize.enable", '
                                                          "i1 false}}")
            props.append(off)
        elif _indexed_by_loads(body)[0]:
            props.append(low.metadata('!{{!"llvm.loop.vectorize.predicate.enable", i1 true}}'))
        if not props:
            return ""
        refs = "".join(f", !{n}" for n in props)
        return f", !llvm.loop !{low.metadata('distinct !{{!{n}' + refs + '}}')}"

    # ------------------------------------------------------------------ scratch memory
    def private_copy(self, low: Lowering, elements: int, elem_bytes: int) -> str:
        low.declare(f"declare ptr @{self.calloc_symbol}(i64, i64)")
        low.declare(f"declare void @{self.free_symbol}(ptr)")
        return low.fn.ins(f"call ptr @{self.calloc_symbol}(i64 {elements}, i64 {elem_bytes})")

    def release_private(self, low: Lowering, ptr: str) -> None:
        low.fn.void(f"call void @{self.free_symbol}(ptr {ptr})")

    def stack_init(self, low: Lowering) -> None:
        """The stack starts empty and unallocated; the first push allocates 256 slots. The
        launch context's stack budget (0 where the program does not count its stacks) is
        read once, at the task's entry."""
        fn = low.fn
        data, top, cap = fn.alloca("ptr"), fn.alloca("i64"), fn.alloca("i64")
        fn.allocas += [f"  store ptr null, ptr {data}", f"  store i64 0, ptr {top}",
                       f"  store i64 0, ptr {cap}"]
        slot = f"getelementptr i64, ptr %ctx, i64 {low.layout.stack_budget}"
        budget = low._entry_load(f"load ptr, ptr {low._entry_load(slot)}")
        low.declare(f"declare ptr @{self.realloc_symbol}(ptr, i64)")
        low.declare(f"declare void @{self.free_symbol}(ptr)")
        low.stack_state = (data, top, cap, budget)

    def stack_push(self, low: Lowering, bits: str) -> None:
        """Push, doubling the allocation when full (the stack never overflows). With a
        stack budget, a growth is counted there first and, past its limit, asked for
        (:meth:`_stack_budget_take`)."""
        fn: FunctionText = low.fn
        data, top, cap, _ = low.stack_state
        n = fn.ins(f"load i64, ptr {top}")
        c = fn.ins(f"load i64, ptr {cap}")
        full = fn.ins(f"icmp eq i64 {n}, {c}")
        grow, ok = fn.label("stack_grow"), fn.label("stack_ok")
        fn.term(f"br i1 {full}, label %{grow}, label %{ok}")
        fn.start_block(grow)
        dbl = fn.ins(f"shl i64 {c}, 1")
        z = fn.ins(f"icmp eq i64 {c}, 0")
        newcap = fn.ins(f"select i1 {z}, i64 256, i64 {dbl}")
        nbytes = fn.ins(f"shl i64 {newcap}, 3")
        self._stack_budget_take(low, fn.ins(f"sub i64 {nbytes}, {fn.ins(f'shl i64 {c}, 3')}"))
        old = fn.ins(f"load ptr, ptr {data}")
        new = fn.ins(f"call ptr @{self.realloc_symbol}(ptr {old}, i64 {nbytes})")
        fn.void(f"store ptr {new}, ptr {data}")
        fn.void(f"store i64 {newcap}, ptr {cap}")
        fn.start_block(ok)
        base = fn.ins(f"load ptr, ptr {data}")
        p = fn.ins(f"getelementptr i64, ptr {base}, i64 {n}", "p")
        fn.void(f"store i64 {bits}, ptr {p}")
        n1 = fn.ins(f"add i64 {n}, 1")
        fn.void(f"store i64 {n1}, ptr {top}")

    def _stack_budget_take(self, low: Lowering, delta: str) -> None:
        """Count ``delta`` more bytes of stack in the launch's stack budget, if it has one
        (``runtime/stackbudget.py``), before they are allocated: added at once (so threads
        growing together cannot all pass the limit), and past the limit asked for through
        the budget's function, which answers when the program's quota allows them. Refused,
        the bytes are given back and the task leaves as a failed check does, with the error
        code ``STACK_REFUSED`` (the launcher raises the budget's refusal); once the launch
        has failed, growths past the limit are refused without asking. Only a growth (a
        doubling) pays for this, never a push."""
        fn: FunctionText = low.fn
        budget = low.stack_state[3]
        count, ask, refuse, take = (fn.label("stack_count"), fn.label("stack_ask"),
                                    fn.label("stack_refused"), fn.label("stack_take"))
        fn.term(f"br i1 {fn.ins(f'icmp eq ptr {budget}, null')}, label %{take}, "
                f"label %{count}")
        fn.start_block(count)
        used = fn.ins(f"getelementptr i64, ptr {budget}, i64 {STACK_BUDGET_USED}")
        held = fn.ins(f"atomicrmw add ptr {used}, i64 {delta} monotonic")
        after = fn.ins(f"add i64 {held}, {delta}")
        limit_p = fn.ins(f"getelementptr i64, ptr {budget}, i64 {STACK_BUDGET_LIMIT}")
        limit = fn.ins(f"load atomic i64, ptr {limit_p} monotonic, align 8")
        fn.term(f"br i1 {fn.ins(f'icmp sgt i64 {after}, {limit}')}, label %{ask}, "
                f"label %{take}")
        fn.start_block(ask)
        # A launch that failed already (a refusal, a failed check) asks nothing more: its
        # other chunks would each ask again for what is refused.
        failed = fn.ins(f"load atomic i64, ptr {low.ctx_slot(low.layout.err_code)} "
                        "monotonic, align 8")
        asking = fn.label("stack_asking")
        fn.term(f"br i1 {fn.ins(f'icmp ne i64 {failed}, 0')}, label %{refuse}, "
                f"label %{asking}")
        fn.start_block(asking)
        ask_p = fn.ins(f"getelementptr i64, ptr {budget}, i64 {STACK_BUDGET_ASK}")
        asked = fn.ins(f"call i32 {fn.ins(f'load ptr, ptr {ask_p}')}(ptr %ctx, i64 {delta})")
        fn.term(f"br i1 {fn.ins(f'icmp eq i32 {asked}, 0')}, label %{refuse}, "
                f"label %{take}")
        fn.start_block(refuse)
        fn.ins(f"atomicrmw sub ptr {used}, i64 {delta} monotonic")
        low.report_error(STACK_REFUSED, ())
        low._return()
        fn.start_block(take)

    def stack_pop(self, low: Lowering) -> str:
        fn = low.fn
        data, top, _, _ = low.stack_state
        n = fn.ins(f"load i64, ptr {top}")
        n1 = fn.ins(f"sub i64 {n}, 1")
        fn.void(f"store i64 {n1}, ptr {top}")
        base = fn.ins(f"load ptr, ptr {data}")
        p = fn.ins(f"getelementptr i64, ptr {base}, i64 {n1}", "p")
        return fn.ins(f"load i64, ptr {p}")

    def stack_release(self, low: Lowering) -> None:
        """Free the stack, and give its bytes back to the stack budget if it has one."""
        fn = low.fn
        data, _, cap, budget = low.stack_state
        fn.void(f"call void @{self.free_symbol}(ptr {fn.ins(f'load ptr, ptr {data}')})")
        back, done = fn.label("stack_back"), fn.label("stack_freed")
        fn.term(f"br i1 {fn.ins(f'icmp eq ptr {budget}, null')}, label %{done}, "
                f"label %{back}")
        fn.start_block(back)
        nbytes = fn.ins(f"shl i64 {fn.ins(f'load i64, ptr {cap}')}, 3")
        used = fn.ins(f"getelementptr i64, ptr {budget}, i64 {STACK_BUDGET_USED}")
        fn.ins(f"atomicrmw sub ptr {used}, i64 {nbytes} monotonic")
        fn.start_block(done)

    # ------------------------------------------------------------------ lowering hooks
    def error_reported(self, low: Lowering, code: int, values: tuple) -> None:
        """Nothing beyond the launch context's error word: the CPU's launches are synchronous
        and the launcher reads it after each task."""

    def pause(self, low: Lowering) -> None:
        low.declare(f"declare i32 @{self.yield_symbol}()")
        low.fn.ins(f"call i32 @{self.yield_symbol}()")

    def print_call(self, low: Lowering, fmt: str, args: list[str], line: int) -> None:
        """C's printf; or, where the launch context names a print sink (a program that
        collects its kernels' output, the service's engine: ``runtime/printsink.py``), the
        same text, made by C's snprintf, appended to the sink: the line's bytes and its NUL
        reserved by an atomic add on the sink's cursor and written if they fit in its
        capacity, else the line counted as dropped (once the sink is full a print costs one
        load and one atomic add). Local printing is unchanged: the sink slot is 0 there."""
        fn = low.fn
        va = "".join(", " + a for a in args)
        sink = fn.ins(f"load ptr, ptr {low.ctx_slot(low.layout.print_sink)}")
        direct, collect = fn.label("printf"), fn.label("print_sink")
        measure, write = fn.label("print_measure"), fn.label("print_write")
        drop, done = fn.label("print_drop"), fn.label("printed")
        fn.term(f"br i1 {fn.ins(f'icmp eq ptr {sink}, null')}, label %{direct}, "
                f"label %{collect}")
        fn.start_block(direct)
        low.declare(f"declare i32 @{self.printf_symbol}(ptr, ...)")
        fn.ins(f"call i32 (ptr, ...) @{self.printf_symbol}(ptr {fmt}{va})")
        fn.term(f"br label %{done}")
        # The sink's header: cursor (bytes reserved), capacity, lines dropped; then the text.
        fn.start_block(collect)
        cap = fn.ins(f"load i64, ptr {fn.ins(f'getelementptr i64, ptr {sink}, i64 1', 'p')}")
        cursor = fn.ins(f"load atomic i64, ptr {sink} monotonic, align 8")
        fn.term(f"br i1 {fn.ins(f'icmp uge i64 {cursor}, {cap}')}, label %{drop}, "
                f"label %{measure}")
        fn.start_block(measure)
        low.declare(f"declare i32 @{self.snprintf_symbol}(ptr, i64, ptr, ...)")
        n = fn.ins(f"call i32 (ptr, i64, ptr, ...) @{self.snprintf_symbol}(ptr null, i64 0, "
                   f"ptr {fmt}{va})")
        size = fn.ins(f"add i64 {fn.ins(f'sext i32 {n} to i64')}, 1")
        off = fn.ins(f"atomicrmw add ptr {sink}, i64 {size} monotonic")
        end = fn.ins(f"add i64 {off}, {size}")
        fn.term(f"br i1 {fn.ins(f'icmp ule i64 {end}, {cap}')}, label %{write}, "
                f"label %{drop}")
        fn.start_block(write)
        at = fn.ins(f"add i64 {off}, {PRINT_SINK_HEADER}")
        dst = fn.ins(f"getelementptr i8, ptr {sink}, i64 {at}", "p")
        fn.ins(f"call i32 (ptr, i64, ptr, ...) @{self.snprintf_symbol}(ptr {dst}, "
               f"i64 {size}, ptr {fmt}{va})")
        fn.term(f"br label %{done}")
        fn.start_block(drop)
        dropped = fn.ins(f"getelementptr i64, ptr {sink}, i64 2", "p")
        fn.ins(f"atomicrmw add ptr {dropped}, i64 1 monotonic")
        fn.term(f"br label %{done}")
        fn.start_block(done)

    def math_call(self, low, name: str, t: DType, args: list[str], paired: bool = False) -> str:
        """A call of libm's ``name`` (libmvec's vector version once vectorized). ``paired``:
        the kernel also takes the other of sin/cos of this value; such pairs then share one
        argument reduction (:mod:`.vecmath`; a map of ``sin(x) + cos(x)`` over 2^24 f32 went
        from 8.4 to 6.7 ms) while a lone sin stays on libmvec, faster for one."""
        ty = "float" if t.bits == 32 else "double"
        scalar = f"dt_{_LIBM_NAMES[name]}{'f' if t.bits == 32 else ''}"
        params = ", ".join([ty] * len(args))
        pure = low.attribute_group("nounwind willreturn memory(none)")
        low.declare(f"declare {ty} @{scalar}({params}) {pure}")
        call_args = ", ".join(f"{ty} {a}" for a in args)
        if not low.ir.fast_math:  # ti.init(fast_math=False): the scalar libm, as Taichi
            return low.fn.ins(f"call {ty} @{scalar}({call_args})")
        if paired and self.sincos and t.bits in self.lanes:
            return self._sincos(low, name, t, args[0], pure)
        call_attrs = ""
        vec = self.vector_variant(name, t)
        if vec is not None:
            lanes = self.lanes[t.bits]
            vty = f"<{lanes} x {ty}>"
            low.declare(f"declare {vty} @{vec}({', '.join([vty] * len(args))}) {pure}")
            low.vector_functions = getattr(low, "vector_functions", set()) | {vec}
            arity = "v" * len(args)
            call_attrs = " " + low.attribute_group(
                f'"vector-function-abi-variant"="_ZGV_LLVM_N{lanes}{arity}_{scalar}({vec})"')
        return low.fn.ins(f"call {ty} @{scalar}({call_args}){call_attrs}")

    def _sincos(self, low, name: str, t: DType, x: str, pure: str) -> str:
        """sin or cos as one half of ``dt_sincos[f]`` (see :mod:`.vecmath`): the other
        half, when the kernel needs it too, comes from the same (merged) call."""
        lanes = self.lanes[t.bits]
        scalar, vector = vecmath.names(lanes, t.bits)
        ty = "float" if t.bits == 32 else "double"
        f = "f" if t.bits == 32 else ""
        for fn in ("sin", "cos"):
            low.declare(f"declare {ty} @dt_{fn}{f}({ty}) {pure}")
        text, decls = vecmath.definitions(
            lanes, f"dt_sin{f}", f"dt_cos{f}",
            low.attribute_group("alwaysinline nounwind willreturn memory(none)"),
            low.attribute_group("noinline nounwind willreturn memory(none)"), bits=t.bits)
        low.declare(text)
        for d in decls:
            low.declare(d)
        # Both kept as they are (the scalar one's signature too: were LLVM to drop its unused
        # half, the vectorizer would no longer find the vector variant).
        low.vector_functions = getattr(low, "vector_functions", set()) | {vector, scalar}
        attrs = low.attribute_group(
            f'"vector-function-abi-variant"="_ZGV_LLVM_N{lanes}v_{scalar}({vector})"')
        pair = low.fn.ins(f"call {{ {ty}, {ty} }} @{scalar}({ty} {x}) {attrs}")
        return low.fn.ins(f"extractvalue {{ {ty}, {ty} }} {pair}, {0 if name == 'sin' else 1}")

    def module_trailer(self, low) -> list[str]:
        vecs = sorted(getattr(low, "vector_functions", ()))
        if not vecs:
            return []
        items = ", ".join(f"ptr @{v}" for v in vecs)
        # Keeps the vector declarations alive until the loop vectorizer has looked them up.
        return [f'@llvm.compiler.used = appending global [{len(vecs)} x ptr] [{items}], '
                'section "llvm.metadata"']

    def warm_up(self) -> None:
        """Pay the JIT's one-time start-up costs once outside any kernel call."""
        if getattr(self, "_warm", False):
            return
        obj = self.compile(f'target triple = "{self.triple}"\n'
                           "define void @dt_warm_up() {\n  ret void\n}\n")
        self.load(obj, ["dt_warm_up"])
        self._warm = True

    def zero_task(self) -> int:
        """Address of a task-shaped ``memset``: ``(base, begin, end, tid)`` zeroes bytes
        [begin, end) of ``base``, so the thread pool can clear large arrays on all cores."""
        if getattr(self, "_zero", None) is None:
            text = (f'target triple = "{self.triple}"\n'
                    "declare void @llvm.memset.p0.i64(ptr, i8, i64, i1)\n"
                    "define void @dt_zero(ptr %base, i64 %b, i64 %e, i32 %tid) {\n"
                    "  %p = getelementptr i8, ptr %base, i64 %b\n"
                    "  %n = sub i64 %e, %b\n"
                    "  call void @llvm.memset.p0.i64(ptr %p, i8 0, i64 %n, i1 false)\n"
                    "  ret void\n}\n")
            self._zero_engine, names = self.load(self.compile(text), ["dt_zero"])
            self._zero = names["dt_zero"]
        return self._zero

    # ------------------------------------------------------------------ compile and load
    def compile(self, text: str) -> bytes:
        mod = llvm.parse_assembly(text)
        mod.verify()
        with module_options(self.module_options(text)):
            mod = self._optimize(mod)
            return self.tm.emit_object(mod)

    def optimized_ir(self, text: str) -> str:
        """The module after O3 (for inspection and tests of vectorization)."""
        mod = llvm.parse_assembly(text)
        with module_options(self.module_options(text)):
            mod = self._optimize(mod)
        return str(mod)

    def module_options(self, text: str) -> ModuleOptions:
        """LLVM's process-wide options for the module ``text``
        (:func:`.optimize.module_options` sets them around its pipeline and code generation).

        The loop vectorizer picks its width by the narrowest type a loop loads or stores
        ("maximize bandwidth"), not the widest, so that a loop of f32 math with an f64
        accumulator (our reductions) runs twice the lanes (N-body primal 1.45x faster) -- but
        only where no access is narrower than 32 bits. With bytes in the loop that width is 64
        lanes (AVX-512), and a loop whose accesses are strided (the outer index of an
        ``ndrange`` once LLVM has unrolled a short inner loop: activating a block of a
        ``bitmasked`` field) turned each store into 64 scalar stores or a 64-lane scatter:
        5,700 instructions from a 100-line kernel and 2.5-20 s of object emission. Without the
        option a loop runs as many lanes as its widest type fills, which for f32 math on bytes
        is as many as 32-bit lanes fill. The machine scheduler: :attr:`machine_scheduler`.
        """
        return ModuleOptions(maximize_bandwidth=_NARROW_ACCESS.search(text) is None,
                             machine_scheduler=self.machine_scheduler,
                             masked_interleaved=self.masked_interleaved)

    def _optimize(self, mod: llvm.ModuleRef) -> llvm.ModuleRef:
        """O3 with loop and SLP vectorization (under :meth:`module_options`): the module to
        emit (``mod``, or its copy with out-of-range shift lanes defined:
        :func:`defined_shift_lanes`)."""
        pto = llvm.create_pipeline_tuning_options(3)
        pto.loop_vectorization = True
        pto.slp_vectorization = True
        pb = llvm.create_pass_builder(self.tm, pto)
        pb.getModulePassManager().run(mod, pb)
        self._inline_vector_math(mod, pb)
        defined = defined_shift_lanes(str(mod))
        if defined is None:
            return mod
        mod = llvm.parse_assembly(defined)
        mod.verify()
        return mod

    @staticmethod
    def _inline_vector_math(mod, pb) -> None:
        """Inline our vector math functions into the loops the vectorizer made call them
        (they are ``alwaysinline``; the vectorizer runs after the inliner). Inside the loop
        the out-of-order core overlaps iterations, with no call, spills or struct return."""
        if not any(f.name.startswith("dt_sincos") and "_v" in f.name and not f.is_declaration
                   for f in mod.functions):
            return
        mpm = llvm.create_new_module_pass_manager()
        mpm.add_always_inliner_pass()
        mpm.add_instruction_combine_pass()
        mpm.add_simplify_cfg_pass()
        mpm.run(mod, pb)

    def load(self, obj: bytes, names: list[str]) -> tuple[object, dict[str, int]]:
        """Link ``obj`` into the process: what keeps its code loaded (freed once the last
        reference to it goes: hold it as long as any launcher, graph or queued launch may call
        the code) and the addresses of ``names``.

        Each object becomes a library of its own in ORC's LLJIT, linked by JITLink, whose
        in-process memory manager places all its sections in one allocation, so that 32-bit
        RIP-relative references to the object's own constants always reach; calls to the
        process (libm, libmvec, libc) go through stubs JITLink builds where a direct call does
        not reach, and a displacement that does not fit fails the link rather than jumping
        wrong. Symbols are resolved here, never at launch. Safe to call from several threads
        (ORC locks its session)."""
        with self._jit_lock:
            if self._unlinked:  # names bound since the last load: one more runtime library
                runtime = llvm.JITLibraryBuilder()
                for name, address in self._unlinked.items():
                    runtime.import_symbol(name, address)
                self._runtime.append(runtime.link(self._jit, f"dt_runtime{len(self._runtime)}"))
                self._unlinked = {}
            runtime_names = [r.name for r in self._runtime]
            library_name = f"dt_object{next(self._library_ids)}"
        library = llvm.JITLibraryBuilder().add_object_img(obj)
        for name in runtime_names:
            library.add_jit_library(name)
        for name in names:
            library.export_symbol(name)
        try:
            tracker = library.link(self._jit, library_name)
        except RuntimeError as e:
            raise CompileError(f"internal error: the JIT linker refused the object code of "
                               f"{', '.join(names)}: {e} (an undefined symbol is named on "
                               f"stderr)") from e
        return tracker, {name: tracker[name] for name in names}


@functools.cache
def get_target() -> CPUTarget:
    return CPUTarget()
