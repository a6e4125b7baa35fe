"""Shared lowering of offloaded difftape IR to LLVM IR text.

Every target (``cpu.py``, ``cuda.py``) uses this module; a target supplies only what differs
(:class:`.target.Target`): the triple and data layout, each task's entry points and index
mapping, how transcendental math is called (libmvec variants on the CPU, libdevice on NVIDIA
GPUs), scratch memory (private copies, the reverse-mode stack), per-thread random states and
loop hints. We write LLVM IR as text rather than through ``llvmlite.ir`` so that call-site
attributes, fast-math flags and metadata are exactly what we mean.

A target writes a task's entry function with :meth:`Lowering.begin_task`, lowers the body
with :meth:`Lowering.range_body` (range tasks: prologue, the loop over this thread's indices,
epilogue) or :meth:`Lowering.block` (serial tasks), and ends it with
:meth:`Lowering.finish_task`. Locals are allocas in the entry block (LLVM's mem2reg turns them
into registers).
"""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass, field

from .. import types as T
from ..ir.assertfmt import Message, assert_messages
from ..ir.nodes import OPS, Block, KernelIR, Stmt, Task, task_blocks, walk
from ..ir.printf import line_format, print_formats, vararg_kind
from ..types import DType
from . import quant as Q
from .layout import CtxLayout


def ll_type(t: DType) -> str:
    if t.is_float:
        return {16: "half", 32: "float", 64: "double"}[t.bits]
    return f"i{t.bits}"


def ll_const(value, t: DType) -> str:
    if t.is_float:
        if t.bits == 16:  # LLVM writes half constants as their own bits
            return f"0xH{struct.unpack('<H', struct.pack('<e', float(value)))[0]:04X}"
        if t.bits == 32:
            value = struct.unpack("<f", struct.pack("<f", float(value)))[0]
        bits = struct.unpack("<Q", struct.pack("<d", float(value)))[0]
        return f"0x{bits:016X}"
    return str(int(value))


# Metadata numbering: loop and other nodes (``Lowering.metadata``) from !1, alias scopes after.
_ALIAS_MD = 1 << 20


@dataclass
class _Loop:
    cont: str
    brk: str


def _index_key(ix: Stmt):
    """What identifies an index value for store fusion (Taichi fuses stores through the same
    pointer, after common subexpressions are merged): a constant by its value, a pure
    computation by its operation and operands, anything else (a load of a local or of memory)
    by the statement."""
    if ix.op == "const":
        return ("const", ix.attr, ix.dtype)
    if OPS[ix.op].pure and ix.op not in ("load", "local_load", "temp_load"):
        return (ix.op, ix.attr, ix.dtype, tuple(_index_key(a) for a in ix.args))
    return ix


@dataclass
class FunctionText:
    """One LLVM function being written: entry allocas kept apart so they stay in entry."""

    header: str
    allocas: list[str] = field(default_factory=list)
    body: list[str] = field(default_factory=list)
    counter: int = 0
    terminated: bool = False

    def name(self, hint: str = "v") -> str:
        self.counter += 1
        return f"%{hint}{self.counter}"

    def label(self, hint: str) -> str:
        self.counter += 1
        return f"{hint}{self.counter}"

    def ins(self, text: str, hint: str = "v") -> str:
        if self.terminated:
            self.start_block(self.label("dead"))
        n = self.name(hint)
        self.body.append(f"  {n} = {text}")
        return n

    def void(self, text: str) -> None:
        if self.terminated:
            self.start_block(self.label("dead"))
        self.body.append(f"  {text}")

    def term(self, text: str) -> None:
        if not self.terminated:
            self.body.append(f"  {text}")
        self.terminated = True

    def start_block(self, label: str) -> None:
        if not self.terminated:
            self.body.append(f"  br label %{label}")
        self.body.append(f"{label}:")
        self.terminated = False

    def alloca(self, ty: str) -> str:
        n = self.name("a")
        self.allocas.append(f"  {n} = alloca {ty}")
        return n

    def text(self) -> str:
        return "\n".join([self.header + " {", "entry:", *self.allocas, "  br label %start",
                          "start:", *self.body, "}"])


#: the ops the target's math library computes (``libm:`` lowering keys)
TRANSCENDENTAL = tuple(name for name, info in OPS.items()
                       if any(k.startswith("libm:") for k in info.lower.values()))
#: ops compared by structure when pairing sin/cos operands (see Lowering.sin_and_cos)
_PURE_KEYED = frozenset({"load", "const", "arg", "buf_shape", "loop_index", "cast", "add", "sub",
                         "mul", "div", "neg", "min", "max"})
# Allow FMA formation: one rounding instead of two, so never less accurate; Taichi 1.7.4's CPU
# backend does not fuse (its fast_math flags are reassoc/nsz/ninf, without contract), so a
# kernel's last bits may differ from Taichi's. ti.init(fast_math=False) drops it.
FAST = "contract"


#: Called as ``observer(ir, layout, cached)`` for every kernel compiled in this process, after
#: its code was made without error or loaded from the compile cache (``cached``), by
#: :func:`notify_compiled`: ``ptx_check.py`` also lowers each one for the CUDA target, so a
#: warm cache checks what a cold one does.
observers: list = []


def notify_compiled(ir: KernelIR, layout: CtxLayout, cached: bool) -> None:
    """Tell the observers that ``ir`` was compiled (``cached``: its code came from the cache).
    The compiler calls it on both paths; the observers' own lowerings do not."""
    for observe in observers:
        observe(ir, layout, cached)


class Lowering:
    """Writes one module for a kernel's tasks."""

    def __init__(self, ir: KernelIR, layout: CtxLayout, target) -> None:
        self.ir = ir
        self.layout = layout
        self.target = target
        self.contract = FAST if ir.fast_math else ""  # see FAST
        self.declarations: set[str] = set()
        self.strings = 0  # constant format strings of print statements so far
        self.print_lines: dict | None = None  # a print line's number (ir.printf.print_formats)
        self.functions: list[str] = []
        self.symbol = ir.name
        self.messages = {m: k + 1 for k, m in enumerate(assert_messages(ir))}
        self.attribute_groups: dict[str, int] = {"nounwind": 0}
        self.metadata_nodes: list[str] = []

    @functools.cached_property
    def sin_and_cos(self) -> set[Stmt]:
        """Values whose sine and cosine both appear in the kernel (a derivative of one needs
        the other): the target may compute such a pair with one argument reduction. Operands
        are compared by structure (the IR does not merge two loads of ``x[i]``); a wrong match
        would only cost speed, never correctness."""
        memo: dict[Stmt, int] = {}  # statement -> number of its structure
        numbers: dict[tuple, int] = {}

        def key(root: Stmt) -> int:
            # Iterative (operand chains can be thousands deep), structures numbered flat.
            stack = [root]
            while stack:
                s = stack[-1]
                if s in memo:
                    stack.pop()
                elif s.op not in _PURE_KEYED:
                    memo[s] = numbers.setdefault(("stmt", id(s)), len(numbers))
                    stack.pop()
                elif pending := [a for a in s.args if a not in memo]:
                    stack.extend(pending)
                else:
                    shape = (s.op, s.dtype, repr(s.attr), tuple(memo[a] for a in s.args))
                    memo[s] = numbers.setdefault(shape, len(numbers))
                    stack.pop()
            return memo[root]

        seen: dict[str, dict[int, Stmt]] = {"sin": {}, "cos": {}}
        for task in self.ir.tasks or ():
            for block in task_blocks(task):
                for s in walk(block):
                    if s.op in seen:
                        seen[s.op].setdefault(key(s.args[0]), s.args[0])
        both = seen["sin"].keys() & seen["cos"].keys()
        return {seen[op][k] for k in both for op in seen}

    def attribute_group(self, text: str) -> str:
        """``#N`` for an attribute set; the module trailer defines them all."""
        if text not in self.attribute_groups:
            self.attribute_groups[text] = len(self.attribute_groups)
        return f"#{self.attribute_groups[text]}"

    # ------------------------------------------------------------------ module
    def module(self) -> str:
        for k, task in enumerate(self.ir.tasks):
            self.functions += self.target.task_functions(self, k, task)
        head = [f'target triple = "{self.target.triple}"']
        if self.target.datalayout:
            head.append(f'target datalayout = "{self.target.datalayout}"')
        trailer = self.target.module_trailer(self)
        groups = [f"attributes #{n} = {{ {text} }}" for text, n in self.attribute_groups.items()]
        text = "\n".join(head + sorted(self.declarations) + self.functions + trailer +
                         groups + self._alias_metadata()) + "\n"
        return text

    # ------------------------------------------------------------------ alias information
    def _field_slots(self) -> list[int]:
        return [k for k, b in enumerate(self.ir.buffers) if b.key[0] in ("field", "private")]

    def _alias_metadata(self) -> list[str]:
        """Distinct fields (and a field's value, .grad and .dual) are distinct arrays: tell
        LLVM, so a store to one does not force reloading another. Ndarray arguments get no
        scope (a caller may pass one array twice)."""
        fields = self._field_slots()
        if len(fields) < 2:
            return self.metadata_nodes
        m = _ALIAS_MD
        out = [f'!{m} = distinct !{{!{m}, !"difftape buffers"}}']
        for k in range(len(fields)):
            out.append(f"!{m + 1 + k} = distinct !{{!{m + 1 + k}, !{m}}}")
        base = m + 1 + len(fields)
        for k in range(len(fields)):
            others = ", ".join(f"!{m + 1 + o}" for o in range(len(fields)) if o != k)
            out.append(f"!{base + 2 * k} = !{{!{m + 1 + k}}}")
            out.append(f"!{base + 2 * k + 1} = !{{{others}}}")
        return out + self.metadata_nodes

    def metadata(self, text: str) -> int:
        """Number a module-level metadata node; ``{n}`` in ``text`` is its own number (for
        self-referencing distinct nodes)."""
        n = len(self.metadata_nodes) + 1
        self.metadata_nodes.append(f"!{n} = " + text.format(n=n))
        return n

    def alias_tags(self, slot: int) -> str:
        fields = self._field_slots()
        if len(fields) < 2 or slot not in fields:
            return ""
        k = fields.index(slot)
        base = _ALIAS_MD + 1 + len(fields)
        return f", !alias.scope !{base + 2 * k}, !noalias !{base + 2 * k + 1}"

    def group_tag(self, slot: int) -> str:
        """The parallel loop's access group on a load or store of buffer ``slot`` (see
        :meth:`range_body`): a field's or an ndarray's, not a chunk's private copy of a
        scattered-into buffer, whose elements iterations accumulate into in turn."""
        if self.access_group is None or self.ir.buffers[slot].key[0] not in ("field", "ndarray"):
            return ""
        return f", !llvm.access.group !{self.access_group}"

    def task_name(self, k: int) -> str:
        return f"{self.symbol}_task{k}"

    def bounds_name(self, k: int) -> str:
        return f"{self.symbol}_bounds{k}"

    def declare(self, text: str) -> None:
        self.declarations.add(text)

    # ------------------------------------------------------------------ functions
    def _new_function(self, header: str) -> FunctionText:
        self.fn = FunctionText(header)
        self.values: dict[Stmt, str] = {}
        self.allocas: dict[Stmt, str] = {}
        self.loop_index: dict[int, str] = {}
        self.loops: list[_Loop] = []
        self.buffer_bases: dict[int, str] = {}
        self.extents: dict[tuple[int, int], str] = {}
        self.stack = False  # has a reverse-mode stack (the target's, see Target.stack_*)
        self.stack_state: tuple[str, ...] = ()  # the target's allocas for it
        self.copies: list[str] = []  # per-chunk copies of privatized scatter targets
        self.turn: str | None = None  # ordered task: "waiting"/"holding" the commit ticket
        self.access_group: int | None = None  # see range_body
        return self.fn

    def begin_task(self, header: str, task: Task) -> FunctionText:
        """Start a task's entry function (``header`` is its ``define`` line, without ``{``)."""
        self.serial = task.kind == "serial"
        return self._new_function(header)

    def task_setup(self, task: Task) -> None:
        """What every task needs before its body: the reverse-mode stack, if it pushes."""
        if any(s.op == "stack_push" for b in task_blocks(task) for s in walk(b)):
            self.target.stack_init(self)
            self.stack = True

    def range_body(self, task: Task, indices, ordered: bool = True) -> None:
        """A range task's body for this invocation: the prologue, the loop over this
        invocation's indices, the epilogue (an ordered task's after the previous chunk's).
        ``indices()``, called after the prologue, gives the loop ``(begin, end, step,
        wide)``: indices ``begin, begin + step, ...`` below ``end``, i32 values (``step``
        None for 1), or i64 values when ``wide`` (a grid-stride loop, whose index may step
        past 2^31). ``ordered``: an ordered task's invocations are chunks that commit their
        epilogues in turn (``False`` where the target runs such a task on one thread)."""
        self.copies = self._private_copies(task)
        self.turn = "waiting" if ordered and task.schedule == "ordered" else None
        self.block(task.prologue)
        begin, end, step, wide = indices()
        # The iterations of a parallel loop are independent (they run in any order, on any
        # thread): its loads and stores of fields and ndarrays carry no dependence from one
        # iteration to another. Said to LLVM (an access group the loop names parallel), the
        # vectorizer needs no run-time overlap checks between them, which fail where a
        # body reads and writes several components of one field (their address ranges
        # interleave) whenever LLVM cannot compute the distance between two accesses of a
        # field (rows ``f`` and ``f + 1`` of an ``[s, p]``-indexed field).
        if not self.serial and self.turn is None and self.target.parallel_access_groups:
            self.access_group = self.metadata("distinct !{{}}")
        self.counted_loop(task.loop_id, begin, end, task.body, step=step, wide=wide,
                          group=self.access_group)
        self.access_group = None
        if self.turn:
            # Ordered: this chunk's epilogue runs after the previous chunk's, alone, so
            # its commits are plain read-modify-writes in chunk order.
            self._await_turn()
            self.serial = True
        self.block(task.epilogue)

    def finish_task(self) -> str:
        """Return from the task (releasing its scratch memory); the function's text."""
        self._return()
        return self.fn.text()

    def _await_turn(self) -> None:
        """Wait until the commit ticket reaches this chunk's ``%begin`` (acquire): every
        earlier chunk has committed. Chunks are claimed in index order and none waits before
        its body is done, so the chunk holding the ticket always makes progress."""
        fn = self.fn
        p = self.ctx_slot(self.layout.commit)
        wait, spin, go = fn.label("turn_wait"), fn.label("turn_spin"), fn.label("turn_go")
        fn.start_block(wait)
        c = fn.ins(f"load atomic i64, ptr {p} acquire, align 8")
        mine = fn.ins(f"icmp eq i64 {c}, %begin")
        fn.term(f"br i1 {mine}, label %{go}, label %{spin}")
        fn.start_block(spin)
        self.target.pause(self)
        fn.term(f"br label %{wait}")
        fn.start_block(go)
        self.turn = "holding"

    def _pass_turn(self) -> None:
        """Hand the commit ticket to the next chunk (release: our commits are visible)."""
        p = self.ctx_slot(self.layout.commit)
        self.fn.void(f"store atomic i64 %end, ptr {p} release, align 8")

    def _private_copies(self, task: Task) -> list[str]:
        """Zeroed per-invocation copies of the buffers ``passes/scatter.py`` privatized."""
        slots = sorted({s.attr if s.op in ("load", "store") else s.attr[0]
                        for b in task_blocks(task) for s in walk(b)
                        if s.op in ("load", "store", "atomic")})
        out = []
        for slot in slots:
            buf = self.ir.buffers[slot]
            if buf.key[0] != "private":
                continue
            n = 1
            for e in buf.shape:
                n *= e
            p = self.target.private_copy(self, n, buf.dtype.bits // 8)
            self.buffer_bases[slot] = p
            out.append(p)
        return out

    def _return(self) -> None:
        """Leave the task function (also from a failed assertion), releasing the reverse-mode
        stack and the per-chunk copies if it has them. A chunk of an ordered task hands on
        the commit ticket even when an assertion failed: later chunks wait for it."""
        turn = self.turn
        if turn == "waiting":
            self._await_turn()
        if turn:
            self._pass_turn()
            self.turn = turn  # other exits (assertions) are lowered after this one
        for p in self.copies:
            self.target.release_private(self, p)
        if self.stack:
            self.target.stack_release(self)
        self.fn.term("ret void")

    def bounds_function(self, k: int, task: Task) -> str:
        """``void @<kernel>_bounds<k>(ptr %ctx, ptr %out)``: a range task's [begin, end) as
        two i64 in ``out`` (an ordered task's commit ticket starts at begin)."""
        fn = self._new_function(f"define void @{self.bounds_name(k)}(ptr noalias %ctx, "
                                "ptr noalias %out) #0")
        self.serial = True
        self.block(task.bounds)
        for pos, s in enumerate((task.begin, task.end)):
            v = self.values[s]
            w = fn.ins(f"sext {ll_type(s.dtype)} {v} to i64")
            p = fn.ins(f"getelementptr i64, ptr %out, i64 {pos}")
            fn.void(f"store i64 {w}, ptr {p}")
            if pos == 0 and task.schedule == "ordered":  # the first chunk commits first
                fn.void(f"store i64 {w}, ptr {self.ctx_slot(self.layout.commit)}")
        fn.term("ret void")
        return fn.text()

    # ------------------------------------------------------------------ ctx access
    def ctx_slot(self, slot: int) -> str:
        return self.fn.ins(f"getelementptr i64, ptr %ctx, i64 {slot}", "p")

    def load_scalar(self, slot: int, t: DType) -> str:
        p = self.ctx_slot(slot)
        if t.is_float:
            d = self.fn.ins(f"load double, ptr {p}")
            return d if t.bits == 64 else self.fn.ins(f"fptrunc double {d} to {ll_type(t)}")
        w = self.fn.ins(f"load i64, ptr {p}")
        return w if t.bits == 64 else self.fn.ins(f"trunc i64 {w} to {ll_type(t)}")

    def store_scalar(self, slot: int, t: DType, v: str) -> None:
        self.store_at(self.ctx_slot(slot), t, v)

    def store_at(self, p: str, t: DType, v: str) -> None:
        """Store scalar ``v`` of type ``t`` as a 64-bit slot at pointer ``p`` (floats as f64
        bits, integers extended to i64), as launch-context slots hold them."""
        if t.is_float:
            d = v if t.bits == 64 else self.fn.ins(f"fpext {ll_type(t)} {v} to double")
            self.fn.void(f"store double {d}, ptr {p}")
        else:
            ext = "sext" if t.is_signed else "zext"
            w = v if t.bits == 64 else self.fn.ins(f"{ext} {ll_type(t)} {v} to i64")
            self.fn.void(f"store i64 {w}, ptr {p}")

    def _entry_load(self, text: str) -> str:
        n = self.fn.name("e")
        self.fn.allocas.append(f"  {n} = {text}")
        return n

    def buffer_base(self, slot: int) -> str:
        if slot not in self.buffer_bases:
            p = self._entry_load(f"getelementptr i64, ptr %ctx, i64 "
                                 f"{self.layout.buffer_ptr[slot]}")
            self.buffer_bases[slot] = self._entry_load(f"load ptr, ptr {p}")
        return self.buffer_bases[slot]

    def extent(self, slot: int, axis: int) -> str:
        """An axis extent as i64: a constant for fields, a ctx slot for ndarrays."""
        e = self.ir.buffers[slot].shape[axis]
        if e is not None:
            return str(e)
        key = (slot, axis)
        if key not in self.extents:
            p = self._entry_load(f"getelementptr i64, ptr %ctx, i64 "
                                 f"{self.layout.buffer_extent[key]}")
            self.extents[key] = self._entry_load(f"load i64, ptr {p}")
        return self.extents[key]

    def address(self, slot: int, indices: tuple[Stmt, ...]) -> str:
        """The element's pointer. For a field of fewer than 2^31 elements, the row-major
        index over the field's own axes is computed in i32 and widened once, and the
        element's components (vector and matrix axes) are the second index of a GEP over
        the elements: an index in range never overflows (``nsw`` holds); one out of range
        accesses memory outside the field, undefined anyway (as in Taichi; a bounds check
        runs before the access). With i64 arithmetic throughout, LLVM's SLP vectorizer
        packed a stencil's address computations (MPM's 3x3 gathers) into vector registers
        and extracted each address (g2p 69 -> 61 us per launch, one thread). Ndarrays
        (extents known at launch only) keep i64."""
        buf = self.ir.buffers[slot]
        # (a quantized field's storage holds one physical word per element)
        elem = f"i{buf.quant.word_bits}" if buf.quant is not None else ll_type(buf.dtype)
        base = self.buffer_base(slot)
        if not indices:
            return base
        field_axes = len(indices) - buf.element_ndim
        if field_axes < 1 or not all(isinstance(e, int) for e in buf.shape) or \
                math.prod(buf.shape) >= 1 << 31:
            linear = self._linear(slot, indices, 0, "i64")
            return self.fn.ins(f"getelementptr inbounds {elem}, ptr {base}, i64 {linear}", "p")
        cell = self.fn.ins(f"sext i32 {self._linear(slot, indices[:field_axes], 0, 'i32')} "
                           "to i64")
        if field_axes == len(indices):
            return self.fn.ins(f"getelementptr inbounds {elem}, ptr {base}, i64 {cell}", "p")
        part = self._linear(slot, indices[field_axes:], field_axes, "i64")
        n = math.prod(buf.shape[field_axes:])
        return self.fn.ins(f"getelementptr inbounds [{n} x {elem}], ptr {base}, i64 {cell}, "
                           f"i64 {part}", "p")

    def _linear(self, slot: int, indices: tuple[Stmt, ...], first: int, it: str) -> str:
        """The row-major index of ``indices`` over the axes ``first``, ``first + 1``, ...
        of buffer ``slot``, in the integer type ``it`` (indices are i32)."""
        linear = None
        for axis, ix in enumerate(indices, first):
            if ix.op == "const":
                w = str(ix.attr)
            elif it == "i32":
                w = self.values[ix]
            else:
                w = self.fn.ins(f"sext i32 {self.values[ix]} to {it}")
            if linear is None:
                linear = w
            else:
                scaled = self.fn.ins(f"mul nsw {it} {linear}, {self.extent(slot, axis)}")
                linear = self.fn.ins(f"add nsw {it} {scaled}, {w}")
        return linear

    def quant_address(self, slot: int, indices: tuple[Stmt, ...]) -> tuple[str, Q.Offset | None]:
        """A quantized field's element: the pointer to its physical word, and the bit offset
        of its digits when it is not the place's (an element of a quant_array: elements
        ``packed[a]`` apart along axis ``a`` share a word)."""
        place = self.ir.buffers[slot].quant
        if not place.packed:
            return self.address(slot, indices), None
        shape = self.ir.buffers[slot].shape
        word_linear: str | int = 0
        inner: str | int = 0
        for ix, n, d in zip(indices, shape, place.packed, strict=True):
            words = n // d
            if ix.op == "const":
                wi, ii = ix.attr // d, ix.attr % d
            else:
                v = self.values[ix]
                wi = v if d == 1 else self.fn.ins(f"udiv i32 {v}, {d}")
                ii = 0 if d == 1 else self.fn.ins(f"urem i32 {v}, {d}")
            word_linear = self._mul_add(word_linear, words, wi)
            inner = self._mul_add(inner, d, ii)
        base = self.buffer_base(slot)
        w = place.word_bits
        wl = word_linear if isinstance(word_linear, int) else \
            self.fn.ins(f"zext i32 {word_linear} to i64")
        p = self.fn.ins(f"getelementptr inbounds i{w}, ptr {base}, i64 {wl}", "p")
        bits = place.qtype.bits
        if isinstance(inner, int):
            return p, place.offset + bits * inner
        off = self.fn.ins(f"mul i32 {inner}, {bits}")
        return p, Q.to_width(self.fn, off, 32, w, False)

    def _mul_add(self, acc: str | int, n: int, v: str | int) -> str | int:
        """``acc * n + v`` as i32, folded where both are constants."""
        if isinstance(acc, int) and isinstance(v, int):
            return acc * n + v
        a = str(acc * n) if isinstance(acc, int) else self.fn.ins(f"mul i32 {acc}, {n}")
        return self.fn.ins(f"add i32 {a}, {v}")

    # ------------------------------------------------------------------ statements
    def block(self, block: Block) -> None:
        paired = self._paired_atomics(block)
        fused = self._fused_quant_stores(block)
        for s in block:
            if s in paired:
                if paired[s] is not None:  # the second of a pair: both as one atomic
                    self._atomic_pair(paired[s], s)
                continue
            if s in fused:
                group = fused[s]
                if group:  # the last store of a fused run: all of them, as one
                    self._quant_store(group)
                continue
            handler = getattr(self, "op_" + s.op, None)
            if handler is not None:
                v = handler(s)
            else:
                v = self.value_op(s)
            if v is not None:
                self.values[s] = v

    def _fused_quant_stores(self, block: Block) -> dict[Stmt, list[Stmt]]:
        """Taichi's bit-struct store fusion: stores to fields of one ``BitpackedFields`` word
        (same word, same index) in a straight run of a block become one store at the last
        of them, unless the word is read (or atomically updated) between them. It is what
        shared exponents mean: ``a[i] = x; b[i] = y`` picks the exponent of the larger of
        ``x`` and ``y``, where two stores would round ``x`` to the exponent of the old
        ``b[i]`` first. Returns each store of a fused run mapped to the run (the last) or to
        ``[]`` (the others, emitted with the last)."""
        out: dict[Stmt, list[Stmt]] = {}
        if not any(s.op == "store" for s in block):
            return out
        runs: dict[tuple, list[Stmt]] = {}
        read_after: set[tuple] = set()

        def close() -> None:
            for run in runs.values():
                if len(run) > 1:
                    for s in run[:-1]:
                        out[s] = []
                    out[run[-1]] = run
            runs.clear()
            read_after.clear()

        for s in block:
            if s.blocks or s.op in ("break", "continue", "return"):
                close()
                continue
            if s.op not in ("store", "load", "atomic"):
                continue
            slot = s.attr[0] if s.op == "atomic" else s.attr
            place = self.ir.buffers[slot].quant
            if place is None or place.packed:
                continue
            index = s.args[:-1] if s.op != "load" else s.args
            key = (place.word, tuple(_index_key(ix) for ix in index))
            if s.op != "store":
                if key in runs:
                    read_after.add(key)
            elif key in read_after:  # the word was read since: this store stands alone
                runs.pop(key, None)
                read_after.discard(key)
            else:
                runs.setdefault(key, []).append(s)
        close()
        return out

    def op_const(self, s: Stmt) -> str:
        # Constants are SSA immediates; a no-op add keeps one name per statement.
        t = ll_type(s.dtype)
        c = ll_const(s.attr, s.dtype)
        if s.dtype.is_float:
            if s.attr != 0.0 and s.dtype.flush(s.attr) == 0.0:
                # A subnormal constant comes only from a folded move (ti.bit_cast of an
                # integer constant: literals are flushed in the frontend); kernels' flush-to-
                # zero mode would zero it in the fadd, so its bits are moved in, as Taichi does.
                w = s.dtype.bits
                bits = struct.unpack(f"<{'I' if w == 32 else 'Q'}",
                                     struct.pack(f"<{'f' if w == 32 else 'd'}", s.attr))[0]
                return self.fn.ins(f"bitcast i{w} {bits} to {t}")
            return self.fn.ins(f"fadd {t} {c}, {ll_const(-0.0, s.dtype)}")
        return self.fn.ins(f"add {t} {c}, 0")

    def op_arg(self, s: Stmt) -> str:
        return self.load_scalar(self.layout.params[s.attr], s.dtype)

    def op_buf_shape(self, s: Stmt) -> str:
        slot, axis = s.attr
        e = self.extent(slot, axis)
        return self.fn.ins(f"trunc i64 {e} to i32") if not e.isdigit() else \
            self.fn.ins(f"add i32 {e}, 0")

    def op_loop_index(self, s: Stmt) -> str:
        return self.fn.ins(f"load i32, ptr {self.loop_index[s.attr]}")

    def op_bit_cast(self, s: Stmt) -> str:
        src, dst = s.args[0].dtype, s.dtype
        v = self.values[s.args[0]]
        if ll_type(src) == ll_type(dst):  # i32 <-> u32: one LLVM type
            return v
        return self.fn.ins(f"bitcast {ll_type(src)} {v} to {ll_type(dst)}")

    def lower_clz(self, s: Stmt, t: DType, args: list[str]) -> str:
        return self.intrinsic("ctlz", t, args, extra=", i1 false")

    def op_stop_grad(self, s: Stmt) -> str:
        return self.values[s.args[0]]

    def op_cast(self, s: Stmt) -> str:
        src, dst = s.args[0].dtype, s.dtype
        v = self.values[s.args[0]]
        a, b = ll_type(src), ll_type(dst)
        if src == dst:
            return v
        if dst.bits == 1:  # u1: "is nonzero", as in Taichi (not the low bit)
            if src.is_float:
                return self.fn.ins(f"fcmp une {a} {v}, {ll_const(0.0, src)}")
            return self.fn.ins(f"icmp ne {a} {v}, 0")
        if src.is_float and dst.is_float:
            op = "fpext" if dst.bits > src.bits else "fptrunc"
        elif src.is_float:
            # Saturating: NaN -> 0 and out-of-range values clamp. A plain fptosi gives LLVM a
            # poison value there, which could make a bounds check on the result vanish.
            if src.bits != 16 and not self.target.native_saturating_casts:
                return self._saturating_cast(src, dst, v)
            sat = "fptosi" if dst.is_signed else "fptoui"
            name = f"llvm.{sat}.sat.{b}.{a.replace('float', 'f32').replace('double', 'f64')}"
            if src.bits == 16:
                name = f"llvm.{sat}.sat.{b}.f16"
            self.declare(f"declare {b} @{name}({a})")
            return self.fn.ins(f"call {b} @{name}({a} {v})")
        elif dst.is_float:
            op = "sitofp" if src.is_signed else "uitofp"
        elif dst.bits > src.bits:
            op = "sext" if src.is_signed else "zext"
        elif dst.bits < src.bits:
            op = "trunc"
        else:
            return v
        return self.fn.ins(f"{op} {a} {v} to {b}")

    def _saturating_cast(self, src: DType, dst: DType, v: str) -> str:
        """``llvm.fpto[su]i.sat`` written out as compares and selects around a conversion of
        an in-range value (so never poison): the same results. x86 has no saturating
        conversion; LLVM expands the intrinsic one lane at a time with branches-free scalar
        code (MPM's g2p spent a fifth of its time there), while these compares and selects
        vectorize with the arithmetic around them."""
        fn = self.fn
        a, b = ll_type(src), ll_type(dst)
        lo = -(1 << (dst.bits - 1)) if dst.is_signed else 0
        hi = (1 << (dst.bits - 1 if dst.is_signed else dst.bits)) - 1
        lo_f, top_f = ll_const(float(lo), src), ll_const(float(hi + 1), src)  # powers of two
        above_lo = fn.ins(f"fcmp oge {a} {v}, {lo_f}")
        below_top = fn.ins(f"fcmp olt {a} {v}, {top_f}")
        inside = fn.ins(f"and i1 {above_lo}, {below_top}")  # false for NaN
        safe = fn.ins(f"select i1 {inside}, {a} {v}, {a} {ll_const(0.0, src)}")
        conv = fn.ins(f"{'fptosi' if dst.is_signed else 'fptoui'} {a} {safe} to {b}")
        over = fn.ins(f"fcmp oge {a} {v}, {top_f}")
        under = fn.ins(f"fcmp olt {a} {v}, {lo_f}")
        clamp = fn.ins(f"select i1 {under}, {b} {lo}, {b} 0")
        clamp = fn.ins(f"select i1 {over}, {b} {hi}, {b} {clamp}")
        return fn.ins(f"select i1 {inside}, {b} {conv}, {b} {clamp}")

    def op_select(self, s: Stmt) -> str:
        c, a, b = (self.values[x] for x in s.args)
        ct = ll_type(s.args[0].dtype)
        ci = self.fn.ins(f"icmp ne {ct} {c}, 0")
        t = ll_type(s.dtype)
        return self.fn.ins(f"select i1 {ci}, {t} {a}, {t} {b}")

    # ------------------------------------------------------------------ value ops
    def value_op(self, s: Stmt) -> str:
        """A value op, emitted as its lowering key in the op table (:mod:`..ir.ops`) says for
        the operands' type: ``inst:``, ``fcmp:``/``icmp:``, ``intrinsic:``, ``libm:`` or
        ``method:`` (a ``lower_<name>`` method here)."""
        t = s.args[0].dtype
        key = OPS[s.op].lower.get(t.kind)
        if key is None:
            raise NotImplementedError(f"no lowering for {s.op} on {t}")  # the verifier refuses
        form, name = key.split(":")
        args = [self.values[x] for x in s.args]
        ty = ll_type(t)
        if form == "inst":
            fast = ""
            if t.is_float:
                fast = ("reassoc nsz " + self.contract if s.attr == "reassoc"
                        else self.contract) + " "
            return self.fn.ins(f"{name} {fast}{ty} {args[0]}, {args[1]}")
        if form in ("fcmp", "icmp"):
            c = self.fn.ins(f"{form} {name} {ty} {args[0]}, {args[1]}")
            return self.fn.ins(f"zext i1 {c} to i32")
        if form == "intrinsic":
            return self.intrinsic(name, t, args)
        if form == "libm":
            if t.bits == 16:  # libm has no half functions: the f32 one, rounded once (Taichi)
                wide = [self.fn.ins(f"fpext half {a} to float") for a in args]
                r = self.target.math_call(self, name, T.f32, wide)
                return self.fn.ins(f"fptrunc float {r} to half")
            paired = name in ("sin", "cos") and s.args[0] in self.sin_and_cos
            return self.target.math_call(self, name, t, args, paired=paired)
        return getattr(self, "lower_" + name)(s, t, args)

    def lower_fneg(self, s: Stmt, t: DType, args: list[str]) -> str:
        return self.fn.ins(f"fneg {ll_type(t)} {args[0]}")

    def lower_ineg(self, s: Stmt, t: DType, args: list[str]) -> str:
        return self.fn.ins(f"sub {ll_type(t)} 0, {args[0]}")

    def lower_iabs(self, s: Stmt, t: DType, args: list[str]) -> str:
        return self.intrinsic("abs", t, args, extra=", i1 false")

    def lower_identity(self, s: Stmt, t: DType, args: list[str]) -> str:
        return args[0]  # e.g. abs of an unsigned value (llvm.abs would read it as signed)

    def lower_logical_not(self, s: Stmt, t: DType, args: list[str]) -> str:
        c = self.fn.ins(f"icmp eq {ll_type(t)} {args[0]}, 0")
        return self.fn.ins(f"zext i1 {c} to i32")

    def lower_bit_not(self, s: Stmt, t: DType, args: list[str]) -> str:
        return self.fn.ins(f"xor {ll_type(t)} {args[0]}, -1")

    def lower_logical(self, s: Stmt, t: DType, args: list[str]) -> str:
        ty = ll_type(t)
        ca = self.fn.ins(f"icmp ne {ty} {args[0]}, 0")
        cb = self.fn.ins(f"icmp ne {ty} {args[1]}, 0")
        r = self.fn.ins(f"{'and' if s.op == 'logical_and' else 'or'} i1 {ca}, {cb}")
        return self.fn.ins(f"zext i1 {r} to i32")

    def lower_overflows(self, s: Stmt, t: DType, args: list[str]) -> str:
        """``add/sub/mul_overflows``: LLVM's ``[su]{add,sub,mul}.with.overflow`` flag."""
        ty = ll_type(t)
        pair = f"{{{ty}, i1}}"
        name = f"llvm.{'s' if t.is_signed else 'u'}{s.op[:3]}.with.overflow.{ty}"
        self.declare(f"declare {pair} @{name}({ty}, {ty})")
        r = self.fn.ins(f"call {pair} @{name}({ty} {args[0]}, {ty} {args[1]})")
        flag = self.fn.ins(f"extractvalue {pair} {r}, 1")
        return self.fn.ins(f"zext i1 {flag} to i32")

    def lower_shl_overflows(self, s: Stmt, t: DType, args: list[str]) -> str:
        """``shl_overflows``: shifting back does not give ``a`` (Taichi's test), or the
        amount is outside [0, width) and ``a`` is not 0 (that shift is poison in LLVM, so
        its lane is not selected then)."""
        fn, ty = self.fn, ll_type(t)
        a, b = args
        inside = fn.ins(f"icmp ult {ty} {b}, {t.bits}")
        shifted = fn.ins(f"shl {ty} {a}, {b}")
        back = fn.ins(f"{'ashr' if t.is_signed else 'lshr'} {ty} {shifted}, {b}")
        lost = fn.ins(f"icmp ne {ty} {back}, {a}")
        nonzero = fn.ins(f"icmp ne {ty} {a}, 0")
        flag = fn.ins(f"select i1 {inside}, i1 {lost}, i1 {nonzero}")
        return fn.ins(f"zext i1 {flag} to i32")

    def lower_rsqrt(self, s: Stmt, t: DType, args: list[str]) -> str:
        r = self.intrinsic("sqrt", t, args)
        return self.fn.ins(f"fdiv {self.contract} {ll_type(t)} {ll_const(1.0, t)}, {r}")

    def lower_fdiv(self, s: Stmt, t: DType, args: list[str]) -> str:
        ty = ll_type(t)
        fast = "reassoc nsz " + self.contract if s.attr == "reassoc" else self.contract
        x = s.args[0]
        if x.op == "const" and x.attr == -1.0:
            # -1/b is exactly -(1/b): spelled so, the reciprocal is shared with other uses
            # of 1/b (derivative code is full of them: d(1/b) = -(1/b)^2 db).
            r = self.fn.ins(f"fdiv {fast} {ty} {ll_const(1.0, t)}, {args[1]}")
            return self.fn.ins(f"fneg {ty} {r}")
        return self.fn.ins(f"fdiv {fast} {ty} {args[0]}, {args[1]}")

    def lower_float_floordiv(self, s: Stmt, t: DType, args: list[str]) -> str:
        q = self.fn.ins(f"fdiv {ll_type(t)} {args[0]}, {args[1]}")
        return self.intrinsic("floor", t, [q])

    def lower_float_mod(self, s: Stmt, t: DType, args: list[str]) -> str:
        """Python semantics: the result has the divisor's sign."""
        ty = ll_type(t)
        a, b = args
        q = self.fn.ins(f"fdiv {ty} {a}, {b}")
        f = self.intrinsic("floor", t, [q])
        m = self.fn.ins(f"fmul {ty} {f}, {b}")
        return self.fn.ins(f"fsub {ty} {a}, {m}")

    def lower_int_div(self, s: Stmt, t: DType, args: list[str]) -> str:
        return self._int_floordiv_mod(s.op, t, *args)

    def lower_int_pow(self, s: Stmt, t: DType, args: list[str]) -> str:
        return self._int_pow(t, *args)

    def intrinsic(self, name: str, t: DType, args: list[str], extra: str = "") -> str:
        ty = ll_type(t)
        suffix = ll_type(t).replace("float", "f32").replace("double", "f64").replace(
            "half", "f16")
        decl_args = ", ".join([ty] * len(args)) + (", i1" if extra else "")
        self.declare(f"declare {ty} @llvm.{name}.{suffix}({decl_args})")
        call_args = ", ".join(f"{ty} {a}" for a in args) + extra
        return self.fn.ins(f"call {ty} @llvm.{name}.{suffix}({call_args})")

    def _int_floordiv_mod(self, op: str, t: DType, a: str, b: str) -> str:
        """Integer ``div`` (truncating), ``floordiv`` and ``mod`` (Python's signs) that never
        trap: x86 raises SIGFPE, killing the process, for a zero divisor and for
        ``INT_MIN / -1``. A zero divisor gives 0; dividing by -1 negates (wrapping)."""
        ty = ll_type(t)
        fn = self.fn
        zero = fn.ins(f"icmp eq {ty} {b}, 0")
        if not t.is_signed:
            safe_b = fn.ins(f"select i1 {zero}, {ty} 1, {ty} {b}")
            q = fn.ins(f"{'urem' if op in ('mod', 'rem') else 'udiv'} {ty} {a}, {safe_b}")
            return fn.ins(f"select i1 {zero}, {ty} 0, {ty} {q}")
        minus1 = fn.ins(f"icmp eq {ty} {b}, -1")
        bad = fn.ins(f"or i1 {zero}, {minus1}")
        safe_b = fn.ins(f"select i1 {bad}, {ty} 1, {ty} {b}")
        q = fn.ins(f"sdiv {ty} {a}, {safe_b}")
        if op == "div":
            neg = fn.ins(f"sub {ty} 0, {a}")
            q = fn.ins(f"select i1 {minus1}, {ty} {neg}, {ty} {q}")
            return fn.ins(f"select i1 {zero}, {ty} 0, {ty} {q}")
        r = fn.ins(f"srem {ty} {a}, {safe_b}")
        if op == "rem":  # C's remainder; a % -1 is 0 (r is 0 with safe_b = 1)
            return fn.ins(f"select i1 {zero}, {ty} 0, {ty} {r}")
        rnz = self.fn.ins(f"icmp ne {ty} {r}, 0")
        x = self.fn.ins(f"xor {ty} {r}, {safe_b}")
        neg = self.fn.ins(f"icmp slt {ty} {x}, 0")
        fix = self.fn.ins(f"and i1 {rnz}, {neg}")
        if op == "floordiv":
            q1 = self.fn.ins(f"sub {ty} {q}, 1")
            out = self.fn.ins(f"select i1 {fix}, {ty} {q1}, {ty} {q}")
            neg = fn.ins(f"sub {ty} 0, {a}")  # a // -1 (r is 0 there, so fix is false)
            out = fn.ins(f"select i1 {minus1}, {ty} {neg}, {ty} {out}")
        else:
            r1 = self.fn.ins(f"add {ty} {r}, {safe_b}")
            out = self.fn.ins(f"select i1 {fix}, {ty} {r1}, {ty} {r}")  # a % -1 == 0: r is 0
        return self.fn.ins(f"select i1 {zero}, {ty} 0, {ty} {out}")

    def _int_pow(self, t: DType, a: str, b: str) -> str:
        """``a ** b`` by repeated squaring, wrapping; a non-positive exponent gives 1."""
        ty = ll_type(t)
        signed = t.is_signed
        fname = f"dt_{'i' if signed else 'u'}pow_{ty}"
        done = "icmp sle" if signed else "icmp eq"
        shift = "ashr" if signed else "lshr"
        self.declare(
            f"define internal {ty} @{fname}({ty} %base, {ty} %exp) alwaysinline {{\n"
            f"entry:\n  br label %loop\nloop:\n"
            f"  %r = phi {ty} [1, %entry], [%r2, %step]\n"
            f"  %b = phi {ty} [%base, %entry], [%b2, %step]\n"
            f"  %e = phi {ty} [%exp, %entry], [%e2, %step]\n"
            f"  %done = {done} {ty} %e, 0\n"
            f"  br i1 %done, label %out, label %step\n"
            f"step:\n  %odd = and {ty} %e, 1\n  %isodd = icmp ne {ty} %odd, 0\n"
            f"  %rm = mul {ty} %r, %b\n"
            f"  %r2 = select i1 %isodd, {ty} %rm, {ty} %r\n"
            f"  %b2 = mul {ty} %b, %b\n  %e2 = {shift} {ty} %e, 1\n  br label %loop\n"
            f"out:\n  ret {ty} %r\n}}")
        return self.fn.ins(f"call {ty} @{fname}({ty} {a}, {ty} {b})")

    # ------------------------------------------------------------------ memory
    def op_load(self, s: Stmt) -> str:
        place = self.ir.buffers[s.attr].quant
        if place is not None:
            self._declare_quant(place)
            p, off = self.quant_address(s.attr, s.args)
            w = place.word_bits
            return Q.decode(self.fn, place, self.fn.ins(f"load atomic i{w}, ptr {p} monotonic, "
                                                        f"align {w // 8}"), off)
        p = self.address(s.attr, s.args)
        return self.fn.ins(f"load {ll_type(s.dtype)}, ptr {p}{self.alias_tags(s.attr)}"
                           f"{self.group_tag(s.attr)}")

    def op_store(self, s: Stmt) -> None:
        v = s.args[-1]
        place = self.ir.buffers[s.attr].quant
        if place is not None:
            self._quant_store([s])
            return
        p = self.address(s.attr, s.args[:-1])
        self.fn.void(f"store {ll_type(v.dtype)} {self.values[v]}, ptr {p}"
                     f"{self.alias_tags(s.attr)}{self.group_tag(s.attr)}")

    def _quant_store(self, stores: list[Stmt]) -> None:
        """Stores of quantized fields of one word (one, or several the lowering fused): one
        update of the word."""
        first = stores[0]
        place = self.ir.buffers[first.attr].quant
        p, off = self.quant_address(first.attr, first.args[:-1])
        items = []
        for s in stores:
            q = self.ir.buffers[s.attr].quant
            self._declare_quant(q)
            items.append((q, self.values[s.args[-1]]))
        Q.update(self.fn, place, p, self.serial,
                 lambda word: Q.encode_many(self.fn, word, items, off))

    def op_atomic(self, s: Stmt) -> str:
        slot, kind = s.attr
        v = self.values[s.args[-1]]
        t = s.dtype
        ty = ll_type(t)
        tags = self.alias_tags(slot)
        place = self.ir.buffers[slot].quant
        if place is not None:  # decode, combine, encode: in one update of the word
            self._declare_quant(place)
            p, off = self.quant_address(slot, s.args[:-1])
            old: list[str] = []

            def combined(word: str) -> str:
                old[:] = [Q.decode(self.fn, place, word, off)]
                return Q.encode(self.fn, place, word, self._combine(kind, t, old[0], v), off)
            Q.update(self.fn, place, p, self.serial, combined)
            return old[0]
        p = self.address(slot, s.args[:-1])
        if self.serial:  # one thread: a plain read-modify-write vectorizes and is exact
            old = self.fn.ins(f"load {ty}, ptr {p}{tags}")
            new = self._combine(kind, t, old, v)
            self.fn.void(f"store {ty} {new}, ptr {p}{tags}")
            return old
        return self._atomic_rmw(kind, t, p, v, tags)

    @functools.cached_property
    def _used(self) -> set[Stmt]:
        """Every statement some statement of the kernel reads."""
        return {a for task in self.ir.tasks or () for b in task_blocks(task) for s in walk(b)
                for a in s.args}

    def _pairable(self, s: Stmt) -> bool:
        """An f32 atomic add/sub, result unused, into one of the two components ``2k`` and
        ``2k + 1`` (a constant last index) of a field whose last axis has an even extent: the
        two components are then 8 bytes at an 8-byte aligned address (field storage is
        NumPy's, aligned to 16 bytes)."""
        if s.op != "atomic" or s.attr[1] not in ("add", "sub") or s.dtype != T.f32 or \
                len(s.args) < 2 or s.args[-2].op != "const" or s in self._used:
            return False
        buf = self.ir.buffers[s.attr[0]]
        return buf.key[0] == "field" and buf.quant is None and isinstance(buf.shape[-1], int) \
            and buf.shape[-1] % 2 == 0

    def _paired_atomics(self, block: Block) -> dict[Stmt, Stmt | None]:
        """Pairs of atomics in ``block`` that update the two f32 components of one 8-byte
        unit (``v[i, 0] += a; v[i, 1] += b``, a particle-to-grid scatter) with nothing but
        arithmetic between them (so no other memory access is reordered): on a target that
        asks for it (:attr:`paired_atomics`: the CPU, where a float atomic add is a
        compare-exchange loop), one 64-bit compare-exchange makes both updates. Each
        component gets the same addition as alone, so results do not change. Maps the first
        of a pair to None and the second to the first."""
        if self.serial or not self.target.paired_atomics:
            return {}
        out: dict[Stmt, Stmt | None] = {}
        for k, s in enumerate(block):
            if s in out or not self._pairable(s):
                continue
            for t in block[k + 1:]:
                if t.op == "atomic" and t not in out and self._pairable(t) and \
                        t.attr == s.attr and t.args[:-2] == s.args[:-2] and \
                        {s.args[-2].attr, t.args[-2].attr} == \
                        {s.args[-2].attr & ~1, s.args[-2].attr | 1}:
                    out[s], out[t] = None, s
                    break
                if not t.info.pure or t.op == "load" or t.blocks:
                    break
        return out

    def _atomic_pair(self, first: Stmt, second: Stmt) -> None:
        lo, hi = sorted((first, second), key=lambda a: a.args[-2].attr)
        slot, kind = lo.attr
        p = self.address(slot, lo.args[:-1])
        vec = "poison"
        for lane, a in enumerate((lo, hi)):
            vec = self.fn.ins(f"insertelement <2 x float> {vec}, float {self.values[a.args[-1]]}"
                              f", i32 {lane}")
        op = "fadd" if kind == "add" else "fsub"
        self.fn.ins(f"atomicrmw {op} ptr {p}, <2 x float> {vec} monotonic, align 8"
                    f"{self.alias_tags(slot)}")

    def _declare_quant(self, place) -> None:
        for text in Q.intrinsics([place]):
            self.declare(text)

    def _atomic_rmw(self, kind: str, t: DType, p: str, v: str, tags: str = "") -> str:
        ty = ll_type(t)
        if kind == "mul":  # LLVM has no atomicrmw mul
            return self._atomic_cas(kind, t, p, v, tags)
        if t.is_float:
            op = {"add": "fadd", "sub": "fsub", "min": "fmin", "max": "fmax"}.get(kind)
        else:
            op = {"add": "add", "sub": "sub", "bit_and": "and", "bit_or": "or",
                  "bit_xor": "xor", "min": "min" if t.is_signed else "umin",
                  "max": "max" if t.is_signed else "umax"}.get(kind)
        if op is None:
            raise NotImplementedError(f"atomic {kind} on {t}")  # frontend only emits the above
        return self.fn.ins(f"atomicrmw {op} ptr {p}, {ty} {v} monotonic{tags}")

    def _atomic_cas(self, kind: str, t: DType, p: str, v: str, tags: str = "") -> str:
        """An atomic read-modify-write as a compare-and-swap loop: read the element, combine,
        swap the result in if the element still holds what was read, else retry with what it
        holds now. Returns the old value (the one the successful swap replaced)."""
        fn = self.fn
        ty, it = ll_type(t), f"i{t.bits}"
        seen = fn.alloca(it)
        first = fn.ins(f"load atomic {it}, ptr {p} monotonic, align {t.bits // 8}")
        fn.void(f"store {it} {first}, ptr {seen}")
        loop, done = fn.label("cas"), fn.label("cas_done")
        fn.term(f"br label %{loop}")
        fn.start_block(loop)
        cur = fn.ins(f"load {it}, ptr {seen}")
        old = fn.ins(f"bitcast {it} {cur} to {ty}") if t.is_float else cur
        new = self._combine(kind, t, old, v)
        new_bits = fn.ins(f"bitcast {ty} {new} to {it}") if t.is_float else new
        pair = fn.ins(f"cmpxchg ptr {p}, {it} {cur}, {it} {new_bits} monotonic monotonic")
        fn.void(f"store {it} {fn.ins(f'extractvalue {{ {it}, i1 }} {pair}, 0')}, ptr {seen}")
        ok = fn.ins(f"extractvalue {{ {it}, i1 }} {pair}, 1")
        fn.term(f"br i1 {ok}, label %{done}, label %{loop}")
        fn.start_block(done)
        return old

    def _combine(self, kind: str, t: DType, a: str, b: str) -> str:
        fake = Stmt(kind, t, (Stmt("const", t), Stmt("const", t)))
        self.values[fake.args[0]], self.values[fake.args[1]] = a, b
        return self.value_op(fake)

    def op_alloca(self, s: Stmt) -> None:
        self.allocas[s] = self.fn.alloca(ll_type(s.dtype))

    def op_local_load(self, s: Stmt) -> str:
        return self.fn.ins(f"load {ll_type(s.dtype)}, ptr {self.allocas[s.args[0]]}")

    def op_local_store(self, s: Stmt) -> None:
        v = s.args[1]
        self.fn.void(f"store {ll_type(v.dtype)} {self.values[v]}, ptr {self.allocas[s.args[0]]}")

    # ------------------------------------------------------------------ reverse-mode stack
    def op_stack_push(self, s: Stmt) -> None:
        v = s.args[0]
        self.target.stack_push(self, self._to_i64(self.values[v], v.dtype))

    def op_stack_pop(self, s: Stmt) -> str:
        return self._from_i64(self.target.stack_pop(self), s.dtype)

    def _to_i64(self, v: str, t: DType) -> str:
        if t.is_float:
            w = f"i{t.bits}"
            v = self.fn.ins(f"bitcast {ll_type(t)} {v} to {w}")
            return v if t.bits == 64 else self.fn.ins(f"zext {w} {v} to i64")
        return v if t.bits == 64 else self.fn.ins(f"zext i{t.bits} {v} to i64")

    def _from_i64(self, bits: str, t: DType) -> str:
        if t.bits != 64:
            bits = self.fn.ins(f"trunc i64 {bits} to i{t.bits}")
        return self.fn.ins(f"bitcast i{t.bits} {bits} to {ll_type(t)}") if t.is_float else bits

    def op_local_atomic(self, s: Stmt) -> str:
        a, v = s.args
        ty = ll_type(s.dtype)
        p = self.allocas[a]
        old = self.fn.ins(f"load {ty}, ptr {p}")
        self.fn.void(f"store {ty} {self._combine(s.attr, s.dtype, old, self.values[v])}, "
                     f"ptr {p}")
        return old

    def op_temp_atomic(self, s: Stmt) -> str:
        slot, kind = s.attr
        t = s.dtype
        if self.serial:
            old = self.load_scalar(self.layout.temps + slot, t)
            self.store_scalar(self.layout.temps + slot, t,
                              self._combine(kind, t, old, self.values[s.args[0]]))
            return old
        # Temps are 64-bit slots (floats as double): one atomic on the widened value.
        wide = T.f64 if t.is_float else (T.i64 if t.is_signed else T.u64)
        v = self.values[s.args[0]]
        if wide != t:
            ext = "fpext" if t.is_float else ("sext" if t.is_signed else "zext")
            v = self.fn.ins(f"{ext} {ll_type(t)} {v} to {ll_type(wide)}")
        old = self._atomic_rmw(kind, wide, self.ctx_slot(self.layout.temps + slot), v)
        if wide != t:
            op = "fptrunc" if t.is_float else "trunc"
            old = self.fn.ins(f"{op} {ll_type(wide)} {old} to {ll_type(t)}")
        return old

    def op_temp_load(self, s: Stmt) -> str:
        return self.load_scalar(self.layout.temps + s.attr, s.dtype)

    def op_temp_store(self, s: Stmt) -> None:
        v = s.args[0]
        self.store_scalar(self.layout.temps + s.attr, v.dtype, self.values[v])

    def op_return(self, s: Stmt) -> None:
        v = s.args[0]
        self.store_scalar(self.layout.returns[s.attr], v.dtype, self.values[v])

    def op_random(self, s: Stmt) -> str:
        fn = self.fn
        base_p = self.ctx_slot(self.layout.rng)
        base = fn.ins(f"load ptr, ptr {base_p}")
        tid = self.target.rng_index(self)
        sp = fn.ins(f"getelementptr i64, ptr {base}, i64 {tid}", "p")
        x0 = fn.ins(f"load i64, ptr {sp}")
        a = fn.ins(f"lshr i64 {x0}, 12")
        x1 = fn.ins(f"xor i64 {x0}, {a}")
        b = fn.ins(f"shl i64 {x1}, 25")
        x2 = fn.ins(f"xor i64 {x1}, {b}")
        c = fn.ins(f"lshr i64 {x2}, 27")
        x3 = fn.ins(f"xor i64 {x2}, {c}")
        fn.void(f"store i64 {x3}, ptr {sp}")
        r = fn.ins(f"mul i64 {x3}, 2685821657736338717")
        t = s.dtype
        if t.is_float:
            if t.bits == 64:
                m = fn.ins(f"lshr i64 {r}, 11")
                f = fn.ins(f"uitofp i64 {m} to double")
                return fn.ins(f"fmul double {f}, {ll_const(2.0 ** -53, t)}")
            m = fn.ins(f"lshr i64 {r}, 40")
            f = fn.ins(f"uitofp i64 {m} to {ll_type(t)}")
            return fn.ins(f"fmul {ll_type(t)} {f}, {ll_const(2.0 ** -24, t)}")
        if t.bits == 64:  # all 64 bits, as Taichi's rand_u64/rand_i64
            return r
        hi = fn.ins(f"lshr i64 {r}, 32")  # the high half: xorshift64*'s best bits
        return fn.ins(f"trunc i64 {hi} to {ll_type(t)}")

    # ------------------------------------------------------------------ control flow
    def op_if(self, s: Stmt) -> None:
        fn = self.fn
        c = self.values[s.args[0]]
        ci = fn.ins(f"icmp ne {ll_type(s.args[0].dtype)} {c}, 0")
        then, other, merge = fn.label("then"), fn.label("else"), fn.label("endif")
        fn.term(f"br i1 {ci}, label %{then}, label %{other}")
        fn.start_block(then)
        self.block(s.blocks[0])
        fn.term(f"br label %{merge}")
        fn.start_block(other)
        self.block(s.blocks[1])
        fn.term(f"br label %{merge}")
        fn.start_block(merge)

    def op_range_for(self, s: Stmt) -> None:
        begin, end = (self.values[a] for a in s.args)
        self.counted_loop(s.attr[0], begin, end, s.blocks[0])

    def counted_loop(self, loop_id: int, begin: str, end: str, body_block: Block,
                     step: str | None = None, wide: bool = False,
                     group: int | None = None) -> None:
        """``for (i = begin; i < end; i += step) body`` with an i32 index in an alloca
        (mem2reg turns it into the induction variable the vectorizer wants). ``wide``: the
        bounds and step are i64 and so is the counter (a grid-stride loop, whose last step
        may pass 2^31); the body still sees the index as i32. ``group``: the access group
        of the body's field and ndarray accesses, which the loop declares parallel."""
        fn = self.fn
        ty = "i64" if wide else "i32"
        counter = fn.alloca(ty)
        idx = fn.alloca("i32") if wide else counter
        self.loop_index[loop_id] = idx
        fn.void(f"store {ty} {begin}, ptr {counter}")
        cond, body, latch, exit_ = (fn.label("cond"), fn.label("body"), fn.label("latch"),
                                    fn.label("exit"))
        fn.start_block(cond)
        i = fn.ins(f"load {ty}, ptr {counter}")
        c = fn.ins(f"icmp slt {ty} {i}, {end}")
        fn.term(f"br i1 {c}, label %{body}, label %{exit_}")
        fn.start_block(body)
        if wide:
            fn.void(f"store i32 {fn.ins(f'trunc i64 {i} to i32')}, ptr {idx}")
        self.loops.append(_Loop(latch, exit_))
        self.block(body_block)
        self.loops.pop()
        fn.start_block(latch)
        i2 = fn.ins(f"load {ty}, ptr {counter}")
        n = fn.ins(f"add nsw {ty} {i2}, {step or 1}")
        fn.void(f"store {ty} {n}, ptr {counter}")
        fn.term(f"br label %{cond}{self.target.loop_hint(self, body_block, group)}")
        fn.start_block(exit_)

    def op_while(self, s: Stmt) -> None:
        fn = self.fn
        head, exit_ = fn.label("while"), fn.label("wend")
        fn.start_block(head)
        self.loops.append(_Loop(head, exit_))
        self.block(s.blocks[0])
        self.loops.pop()
        fn.term(f"br label %{head}")
        fn.start_block(exit_)

    def op_break(self, s: Stmt) -> None:
        self.fn.term(f"br label %{self.loops[-1].brk}")

    def op_continue(self, s: Stmt) -> None:
        self.fn.term(f"br label %{self.loops[-1].cont}")

    def op_print(self, s: Stmt) -> None:
        """One printf call for the whole line: the text is one constant format string with
        ``%`` doubled, floats passed as double and short integers widened (C's varargs).
        The target also gets the line's number (``ir.printf.print_formats``), which
        identifies it where lines travel as records (the grid targets)."""
        fn = self.fn
        fmt = line_format(s.attr, [v.dtype for v in s.args])
        args = []
        for v in s.args:
            x, t = self.values[v], v.dtype
            if t.is_float:
                if t.bits != 64:
                    x = fn.ins(f"fpext {ll_type(t)} {x} to double")
                args.append(f"double {x}")
            elif t.bits < 32:
                ext = "sext" if t.is_signed else "zext"
                args.append(f"i32 {fn.ins(f'{ext} {ll_type(t)} {x} to i32')}")
            else:
                args.append(f"{ll_type(t)} {x}")
        data = fmt.encode() + b"\0"
        self.strings += 1
        name = f"@{self.symbol}_fmt{self.strings}"
        text = "".join(chr(b) if 32 <= b < 127 and b not in (34, 92) else f"\\{b:02X}"
                       for b in data)
        self.declare(f'{name} = private unnamed_addr constant [{len(data)} x i8] c"{text}"')
        if self.print_lines is None:
            self.print_lines = {f: k for k, f in enumerate(print_formats(self.ir))}
        kinds = tuple(vararg_kind(v.dtype) for v in s.args)
        self.target.print_call(self, name, args, self.print_lines[(fmt, kinds)])

    def op_assert(self, s: Stmt) -> None:
        fn = self.fn
        c = self.values[s.args[0]]
        ok = fn.ins(f"icmp ne {ll_type(s.args[0].dtype)} {c}, 0")
        fail, cont = fn.label("assert_fail"), fn.label("assert_ok")
        fn.term(f"br i1 {ok}, label %{cont}, label %{fail}")
        fn.start_block(fail)
        values = s.args[1:]
        self.report_error(self.messages[Message(s.attr, tuple(v.dtype for v in values))],
                          values)
        self._return()
        fn.start_block(cont)

    def report_error(self, code: int, values: tuple[Stmt, ...]) -> None:
        """Write the error report: the first failure wins. Threads that fail at once (chunks
        on the CPU's pool, a GPU's threads, a warp in one instruction) race for it; plain
        stores of the code and then of the values could leave one thread's code with another's
        values (a message naming the wrong index). So the code is claimed by
        compare-and-swap from 0, and only the thread that claimed it writes its values (the
        slots from ``CtxLayout.err_value`` on); the launcher reads them after the launch (a
        join or the kernel's end orders them)."""
        fn = self.fn
        p = self.ctx_slot(self.layout.err_code)
        old = fn.ins(f"cmpxchg ptr {p}, i64 0, i64 {code} monotonic monotonic")
        if values:
            won = fn.ins(f"extractvalue {{ i64, i1 }} {old}, 1")
            write, done = fn.label("err_value"), fn.label("err_done")
            fn.term(f"br i1 {won}, label %{write}, label %{done}")
            fn.start_block(write)
            for k, v in enumerate(values):
                self.store_scalar(self.layout.err_value + k, v.dtype, self.values[v])
            fn.term(f"br label %{done}")
            fn.start_block(done)
        self.target.error_reported(self, code, values)
