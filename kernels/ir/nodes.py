"""difftape's typed IR.

One node type, :class:`Stmt`, in the manner of tinygrad's UOp: an op name, a result type, operand
statements, one hashable attribute and (for structured control flow) nested blocks. A generic
shape keeps the printer, verifier, serializer and every pass short: they walk ``args`` and
``blocks`` without knowing each op. The op table :data:`OPS` says what each op is.

Statements live in blocks (Python lists) in program order; a statement's value is referred to
by the statement itself. Control flow is structured (``if``, ``range_for``, ``while``), which is
what reverse-mode autodiff needs: every loop and branch can be walked backwards.

Memory: kernel-visible arrays are *buffers* described by :class:`Buffer` in the kernel's table
and addressed by slot number; a field, its ``.grad`` and its ``.dual`` are three buffers.
Locals are ``alloca`` statements read and written with ``local_load``/``local_store``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from ..types import DType

# ---------------------------------------------------------------------------------------------
# The op table. kind: "const" | "unary" | "binary" | "cmp" | "ternary" | "mem" | "control" | ...

UNARY_FLOAT = ("sin", "cos", "tan", "asin", "acos", "atan", "tanh", "exp", "log", "sqrt",
               "rsqrt", "floor", "ceil", "round")
UNARY_ANY = ("neg", "abs", "logical_not", "bit_not")
BINARY_ARITH = ("add", "sub", "mul", "div", "floordiv", "mod", "pow", "min", "max", "atan2")
BINARY_BITS = ("bit_and", "bit_or", "bit_xor", "shl", "shr")
COMPARE = ("lt", "le", "gt", "ge", "eq", "ne")
ATOMIC_KINDS = ("add", "sub", "min", "max", "bit_and", "bit_or", "bit_xor")


@dataclass(frozen=True)
class OpInfo:
    kind: str
    nargs: int | None  # None: variable
    pure: bool  # no side effects, may be removed when unused and re-computed freely
    nblocks: int = 0


OPS: dict[str, OpInfo] = {
    "const": OpInfo("const", 0, True),
    "arg": OpInfo("arg", 0, True),  # attr: argument index
    "buf_shape": OpInfo("arg", 0, True),  # attr: (buffer slot, axis) runtime extent (ndarray)
    "cast": OpInfo("unary", 1, True),
    "select": OpInfo("ternary", 3, True),
    "stop_grad": OpInfo("unary", 1, True),
    "loop_index": OpInfo("arg", 0, True),  # attr: loop id; the index of an enclosing range_for
    "random": OpInfo("random", 0, False),
    "load": OpInfo("mem", None, True),  # args: indices; attr: buffer slot
    "store": OpInfo("mem", None, False),  # args: indices..., value; attr: buffer slot
    "atomic": OpInfo("mem", None, False),  # args: indices..., value; attr: (slot, kind)
    "alloca": OpInfo("local", 0, False),
    "local_load": OpInfo("local", 1, True),
    "local_store": OpInfo("local", 2, False),
    # A reduction into a kernel-level variable from a parallel loop (``s += v``): args alloca,
    # value; attr: atomic kind; returns the old value.
    "local_atomic": OpInfo("local", 2, False),
    "temp_load": OpInfo("local", 0, True),  # attr: temp slot (kernel-level locals, offloaded)
    "temp_store": OpInfo("local", 1, False),
    "temp_atomic": OpInfo("local", 1, False),  # attr: (temp slot, atomic kind)
    "if": OpInfo("control", 1, False, 2),
    "range_for": OpInfo("control", 2, False, 1),  # args: begin, end; attr: (loop id, flags)
    "while": OpInfo("control", 0, False, 1),
    "break": OpInfo("control", 0, False),
    "continue": OpInfo("control", 0, False),
    "assert": OpInfo("control", None, False),  # args: cond, *values; attr: message
    "return": OpInfo("control", 1, False),  # attr: return slot
    # The reverse-mode stack: one LIFO of 8-byte slots per task invocation, grown on demand.
    # The adjoint of a loop pushes the loop-carried locals at each iteration and pops them
    # when it walks the iterations backwards.
    "stack_push": OpInfo("stack", 1, False),
    "stack_pop": OpInfo("stack", 0, False),
}
for _n in UNARY_FLOAT + UNARY_ANY:
    OPS[_n] = OpInfo("unary", 1, True)
for _n in BINARY_ARITH + BINARY_BITS:
    OPS[_n] = OpInfo("binary", 2, True)
for _n in COMPARE:
    OPS[_n] = OpInfo("cmp", 2, True)
for _n in ("logical_and", "logical_or"):
    OPS[_n] = OpInfo("binary", 2, True)


# ---------------------------------------------------------------------------------------------

_ids = itertools.count()


class Stmt:
    """One IR statement. Identity matters: uses refer to the defining statement object."""

    __slots__ = ("op", "dtype", "args", "attr", "blocks", "loc", "uid")

    def __init__(self, op: str, dtype: DType | None, args: tuple[Stmt, ...] = (),
                 attr: Any = None, blocks: tuple[list[Stmt], ...] = (),
                 loc: tuple[str, int] | None = None) -> None:
        self.op = op
        self.dtype = dtype
        self.args = tuple(args)
        self.attr = attr
        self.blocks = tuple(blocks)
        self.loc = loc
        self.uid = next(_ids)

    @property
    def info(self) -> OpInfo:
        return OPS[self.op]

    def replace(self, **changes: Any) -> Stmt:
        """A copy with some fields changed (a new identity)."""
        kw = dict(op=self.op, dtype=self.dtype, args=self.args, attr=self.attr,
                  blocks=self.blocks, loc=self.loc)
        kw.update(changes)
        return Stmt(**kw)

    def __repr__(self) -> str:
        return f"%{self.uid}:{self.op}"


Block = list[Stmt]


@dataclass(frozen=True)
class Buffer:
    """A global array a kernel reads or writes.

    ``shape`` is the full scalar shape (field shape + element shape). For fields it is known at
    compile time; for ndarray arguments only ``ndim`` is, and the extents come at launch
    (``None`` entries). ``key`` identifies the storage at run time: ``("field", id, role)`` with
    role ``primal``/``grad``/``dual``, or ``("ndarray", arg index, role)``.
    """

    key: tuple
    dtype: DType
    shape: tuple[int | None, ...]
    name: str
    element_ndim: int = 0  # trailing axes that are vector/matrix components

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def is_ndarray(self) -> bool:
        return self.key[0] == "ndarray"

    def with_role(self, role: str) -> Buffer:
        return Buffer((self.key[0], self.key[1], role), self.dtype, self.shape,
                      f"{self.name}.{role}" if role != "primal" else self.name,
                      self.element_ndim)


@dataclass(frozen=True)
class Param:
    """A scalar kernel parameter (``arg`` statements read it)."""

    name: str
    dtype: DType


@dataclass
class KernelIR:
    """A kernel after the frontend: parameters, the buffer table and a body."""

    name: str
    params: list[Param]
    buffers: list[Buffer]
    body: Block
    returns: list[DType] = field(default_factory=list)
    # Filled by the offload pass:
    tasks: list[Task] | None = None
    num_temps: int = 0
    source: dict[int, str] = field(default_factory=dict)  # line -> text, for messages
    file: str = ""
    debug: bool = False
    # ti.init(deterministic=True): passes/determinism.py gives every range task a schedule
    # whose results do not depend on timing or the thread count.
    deterministic: bool = False


@dataclass
class Task:
    """A unit of launch. ``serial``: the body runs once. ``range``: the body runs for each index
    in [begin, end) on all cores; ``prologue``/``epilogue`` run once per chunk of indices (the
    reduction pass puts per-thread accumulators there)."""

    kind: str
    body: Block
    loop_id: int | None = None
    bounds: Block = field(default_factory=list)  # computes the begin/end statements below
    begin: Stmt | None = None
    end: Stmt | None = None
    prologue: Block = field(default_factory=list)
    epilogue: Block = field(default_factory=list)
    weight: int = 1  # rough per-iteration cost, for choosing inline vs. threaded launch
    # How a range task may be split (passes/determinism.py): "any" chunking and order;
    # "ordered": chunks fixed by the range alone, epilogues run in chunk order; "serial":
    # the whole range as one chunk on one thread, in index order.
    schedule: str = "any"


def walk(block: Block):
    """Every statement of a block, nested blocks included, in program order."""
    for s in block:
        yield s
        for b in s.blocks:
            yield from walk(b)


def task_blocks(task: Task) -> list[Block]:
    return [task.bounds, task.prologue, task.body, task.epilogue]
