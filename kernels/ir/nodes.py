"""difftape's typed IR.

One node type, :class:`Stmt`, in the manner of tinygrad's UOp: an op name, a result type, operand
statements, one hashable attribute and (for structured control flow) nested blocks. A generic
shape keeps the printer, verifier, serializer and every pass short: they walk ``args`` and
``blocks`` without knowing each op. The op table (:mod:`.ops`) says what each op is.

Statements live in blocks (Python lists) in program order; a statement's value is referred to
by the statement itself. Control flow is structured (``if``, ``range_for``, ``while``), which is
what reverse-mode autodiff needs: every loop and branch can be walked backwards.

Memory: kernel-visible arrays are *buffers* described by :class:`Buffer` in the kernel's table
and addressed by slot number; a field, its ``.grad`` and its ``.dual`` are three buffers.
Locals are ``alloca`` statements read and written with ``local_load``/``local_store``.
"""

from __future__ import annotations

import itertools
import linecache
import re
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..types import DType
from .ops import ATOMIC_KINDS, OPS, OpInfo

__all__ = ["ATOMIC_KINDS", "OPS", "Block", "Buffer", "KernelIR", "Loc", "OpInfo", "Param", "Stmt",
           "Task", "task_blocks", "walk"]

#: A source line's text is kept up to this many characters (a location is data that travels
#: with the IR to the service, whose validator bounds it the same way).
MAX_SOURCE_TEXT = 512
#: Control characters (tab excepted) a location's file or text may not hold: they would break
#: the layout of the messages that quote them. ``Loc.at`` writes them as "?".
CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


class Loc(NamedTuple):
    """Where a statement comes from: the file, the line, and that line's text (stripped).

    The text is read once, where the kernel is built, and travels with the IR (its wire
    format, ``serialize``): whatever reports the line later (a bounds check, an autodiff
    rule, the service compiling a kernel a client sent) quotes it without reading a file,
    which the server could not (and must not) do for a client's kernel."""

    file: str
    line: int
    text: str = ""

    @classmethod
    def at(cls, file: str, line: int) -> Loc:
        """The location of ``file``:``line``, its text from the file (``linecache``)."""
        text = linecache.getline(file, line).strip()[:MAX_SOURCE_TEXT]
        return cls(file, line, CONTROL.sub("?", text))

    def where(self, kernel: str) -> str:
        """The end of a run-time message naming the kernel, the line and its text, as a
        local and a remote launch both report it."""
        text = f"\n    {self.text}" if self.text else ""
        return f"\n  in kernel '{kernel}', {self.file}:{self.line}{text}"

# ---------------------------------------------------------------------------------------------

_ids = itertools.count()


class Stmt:
    """One IR statement. Identity matters: uses refer to the defining statement object."""

    __slots__ = ("op", "dtype", "args", "attr", "blocks", "loc", "uid")

    def __init__(self, op: str, dtype: DType | None, args: tuple[Stmt, ...] = (),
                 attr: Any = None, blocks: tuple[list[Stmt], ...] = (),
                 loc: Loc | None = None) -> None:
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

    ``offset`` is a field's ``offset=`` (Taichi's): the index of its first element along each
    field axis, empty for none. Accesses in the IR index from 0 (the frontend subtracts the
    offset where it builds them, in ``frontend.field.kernel_element``); the offset is kept here
    so that what reports an index to the user (the bounds checks) reports the user's index.

    ``quant``: a quantized field's :class:`~difftape.quant_types.QuantPlace` (None for every
    other buffer). ``dtype`` is then its compute type; the storage holds one physical word per
    element, which loads decode and stores encode (``codegen/quant.py``).
    """

    key: tuple
    dtype: DType
    shape: tuple[int | None, ...]
    name: str
    element_ndim: int = 0  # trailing axes that are vector/matrix components
    offset: tuple[int, ...] = ()
    quant: Any = None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def is_ndarray(self) -> bool:
        return self.key[0] == "ndarray"

    def with_role(self, role: str) -> Buffer:
        return Buffer((self.key[0], self.key[1], role), self.dtype, self.shape,
                      f"{self.name}.{role}" if role != "primal" else self.name,
                      self.element_ndim, self.offset, self.quant)


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
    # ti.init(debug=True) on a local program: integer add/sub/mul/shl print a report when
    # they overflow (passes/overflow.py). Apart from ``debug``, which the server sets on
    # every kernel for its bounds checks.
    overflow_checks: bool = False
    # ti.init(deterministic=True): passes/determinism.py gives every range task a schedule
    # whose results do not depend on timing or the thread count.
    deterministic: bool = False
    # ti.init(fast_math=False): IEEE evaluation as written, no fused multiply-adds, and
    # transcendentals from the scalar libm (not libmvec's vector versions, nor our sin/cos
    # pair), as Taichi's fast_math=False compiles (codegen/llvm_lowering.py).
    fast_math: bool = True
    # Of a derivative variant: the derivatives its launches may lose through storage without
    # .dual/.grad (autodiff/lost.py's Flow), checked by the runtime at launch; not compiled.
    lost: Any = None


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
