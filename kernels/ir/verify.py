"""The IR verifier: run between passes in tests (and with ``DIFFTAPE_VERIFY_IR=1``), and on every
kernel the service decodes from a client (``validate.decode_untrusted``).

Checks that every op is known, has the right number of operands and blocks, that operands are
defined before use in the same or an enclosing block (structured dominance) and are values, that
loop control sits inside a loop and ``loop_index`` inside its loop, that attributes have the
shape their op needs (buffer slots, parameter and return slots, atomic kinds, loop ids), and
that types agree wherever the lowering relies on them. The type rules are exactly the ones the
LLVM lowering assumes (e.g. integer conditions, ``i32`` indices and loop bounds, one type on
both sides of a binary op): IR that breaks one would be rejected by LLVM with an unhelpful
message, or worse, accepted and miscompiled (a ``load`` of the wrong width reads past the end of
its buffer). Because decoded client IR goes through here, the checks never assume the IR is
well formed: every attribute is type-checked before it is used as an index.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable

from .. import types as T
from ..errors import DifftapeError
from .assertfmt import check_template
from .nodes import ATOMIC_KINDS, OPS, Block, KernelIR, Stmt


class IRVerificationError(DifftapeError):
    """The compiler produced malformed IR: a difftape bug, not a user error (or, through
    ``validate.decode_untrusted``, a client sent it). ``stmt``: the offending statement."""

    stmt: Stmt | None = None


# Statements without a value: they may not be used as operands. ``alloca`` has a dtype (its
# local's type) but its "value" is an address, usable only by the local_* ops.
NO_VALUE = frozenset({"store", "alloca", "local_store", "if", "range_for", "while", "break",
                      "continue", "assert", "return", "print", "stack_push", "temp_store"})
LOCAL_OPS = ("local_load", "local_store", "local_atomic")
LOOP_FLAGS = ("parallel", "serial", "inner")
_BIT_KINDS = ("bit_and", "bit_or", "bit_xor")


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_pair(x: object) -> bool:
    return isinstance(x, tuple) and len(x) == 2


class _Checker:
    """One verification run. ``visible`` is the set of statements in scope, maintained as blocks
    are entered and left (linear time: copying the scope per block would make a kernel of many
    small blocks quadratic, which a client could use to stall the service)."""

    def __init__(self, ir: KernelIR, locate: Callable[[Stmt], str | None] | None) -> None:
        self.ir = ir
        self.locate = locate
        self.where = f"kernel {ir.name}"
        self.visible: set[Stmt] = set()
        self.loop_ids: list[int | None] = []  # enclosing loops, innermost last; None: while

    def name(self, s: Stmt) -> str:
        loc = self.locate(s) if self.locate else None
        return loc if loc is not None else repr(s)

    def fail(self, s: Stmt, message: str) -> IRVerificationError:
        loc = self.locate(s) if self.locate else None
        e = IRVerificationError(f"{loc}: {message}" if loc is not None else
                                f"{self.where}: {s!r}: {message}")
        e.stmt = s
        return e

    # -- structure -----------------------------------------------------------------------------
    def block(self, block: Block) -> None:
        defined: list[Stmt] = []
        try:
            for s in block:
                self.stmt(s)
                self.visible.add(s)
                defined.append(s)
        finally:
            self.visible.difference_update(defined)

    def stmt(self, s: Stmt) -> None:
        info = OPS.get(s.op) if isinstance(s.op, str) else None
        if info is None:
            raise self.fail(s, f"unknown op {s.op!r}")
        if info.nargs is not None and len(s.args) != info.nargs:
            raise self.fail(s, f"op '{s.op}' takes {info.nargs} operand"
                               f"{'' if info.nargs == 1 else 's'}, has {len(s.args)}")
        if len(s.blocks) != info.nblocks:
            raise self.fail(s, f"op '{s.op}' takes {info.nblocks} block"
                               f"{'' if info.nblocks == 1 else 's'}, has {len(s.blocks)}")
        for k, a in enumerate(s.args):
            if a not in self.visible:
                raise self.fail(s, f"operand {k} ({self.name(a)}) does not dominate its use: "
                                   "operands must be defined earlier in the same block or an "
                                   "enclosing one")
            if a.op == "alloca":
                if not (k == 0 and s.op in LOCAL_OPS):
                    raise self.fail(s, f"operand {k} is an alloca, which only local_load, "
                                       "local_store and local_atomic take (as operand 0)")
            elif a.op in NO_VALUE:
                raise self.fail(s, f"operand {k} ({self.name(a)}, op '{a.op}') has no value")
        if s.op in LOCAL_OPS and s.args[0].op != "alloca":
            raise self.fail(s, f"{s.op} of a non-alloca {self.name(s.args[0])}")
        if (s.op in NO_VALUE) != (s.dtype is None) and s.op != "alloca":
            raise self.fail(s, f"op '{s.op}' must have no result type" if s.op in NO_VALUE
                            else f"op '{s.op}' needs a result type")
        if s.dtype is not None and not isinstance(s.dtype, T.DType):
            raise self.fail(s, f"result type {s.dtype!r} is not a dtype")
        if s.op == "alloca" and s.dtype is None:
            raise self.fail(s, "an alloca needs the type of its local")
        if s.op in ("break", "continue") and not self.loop_ids:
            raise self.fail(s, f"{s.op} outside a loop")
        self.types(s)
        if s.blocks:
            loop = s.op in ("range_for", "while")
            if loop:
                self.loop_ids.append(s.attr[0] if s.op == "range_for" else None)
            try:
                for b in s.blocks:
                    self.block(b)
            finally:
                if loop:
                    self.loop_ids.pop()

    # -- attributes and types ------------------------------------------------------------------
    def slot(self, s: Stmt, slot: object):
        """The buffer at ``slot``, checked."""
        if not _is_int(slot) or not 0 <= slot < len(self.ir.buffers):
            raise self.fail(s, f"buffer slot {slot!r} out of range (the kernel has "
                               f"{len(self.ir.buffers)} buffers)")
        return self.ir.buffers[slot]

    def kind(self, s: Stmt, kind: object, dtype: T.DType) -> None:
        if not isinstance(kind, str) or kind not in ATOMIC_KINDS:
            raise self.fail(s, f"atomic kind {kind!r} is not one of {', '.join(ATOMIC_KINDS)}")
        if kind in _BIT_KINDS and not dtype.is_int:
            raise self.fail(s, f"atomic {kind} needs an integer type, not {dtype}")

    def cond(self, s: Stmt, c: Stmt, what: str) -> None:
        if not c.dtype.is_int:
            raise self.fail(s, f"{what} must be an integer (compare with 0 first), not {c.dtype}")

    def same(self, s: Stmt, *stmts: Stmt) -> None:
        types = [x.dtype for x in stmts]
        if any(t != types[0] for t in types):
            raise self.fail(s, f"op '{s.op}' mixes {' and '.join(str(t) for t in types)}")

    def types(self, s: Stmt) -> None:
        op, a, t = s.op, s.args, s.dtype
        kind = OPS[op].kind
        if op == "const":
            if not isinstance(s.attr, numbers.Real) or isinstance(s.attr, bool):
                raise self.fail(s, f"constant value {s.attr!r} is not a number")
            held = t.wrap(s.attr) if t is not None and t.bits > 1 else s.attr
            if held != s.attr and held == held:  # NaN aside: a value the type cannot hold
                raise self.fail(s, f"constant {s.attr!r} is not a {t} value (it holds {held!r}"
                                   "): promoting or casting it would use the wrong number")
        elif op == "arg":
            if not _is_int(s.attr) or not 0 <= s.attr < len(self.ir.params):
                raise self.fail(s, f"argument index {s.attr!r} out of range (the kernel has "
                                   f"{len(self.ir.params)} parameters)")
            if t != self.ir.params[s.attr].dtype:
                raise self.fail(s, f"argument {s.attr} is {self.ir.params[s.attr].dtype}, "
                                   f"read as {t}")
        elif op == "buf_shape":
            if not _is_pair(s.attr):
                raise self.fail(s, "buf_shape takes (buffer slot, axis)")
            buf = self.slot(s, s.attr[0])
            if not _is_int(s.attr[1]) or not 0 <= s.attr[1] < buf.ndim:
                raise self.fail(s, f"axis {s.attr[1]!r} out of range for a {buf.ndim}-D buffer")
            if t != T.i32:
                raise self.fail(s, f"buf_shape is i32, not {t}")
        elif op == "loop_index":
            if not _is_int(s.attr) or s.attr not in self.loop_ids:
                raise self.fail(s, f"loop_index of loop {s.attr!r}, which does not enclose it")
            if t != T.i32:
                raise self.fail(s, f"loop indices are i32, not {t}")
        elif OPS[op].types is not None:
            self.value_types(s, OPS[op].types)
        elif op in ("load", "store", "atomic"):
            if op == "atomic":
                if not _is_pair(s.attr):
                    raise self.fail(s, "atomic takes (buffer slot, kind)")
                buf = self.slot(s, s.attr[0])
                self.kind(s, s.attr[1], buf.dtype)
            else:
                buf = self.slot(s, s.attr)
            index = a if op == "load" else a[:-1]
            if op != "load" and not a:
                raise self.fail(s, f"op '{op}' needs indices and a value")
            if len(index) != buf.ndim:
                raise self.fail(s, f"op '{op}' takes 1 index per buffer axis ('{buf.name}' has "
                                   f"{buf.ndim}), got {len(index)}")
            for k, ix in enumerate(index):
                if ix.dtype != T.i32:
                    raise self.fail(s, f"index {k} is {ix.dtype}; indices are i32")
            if op != "store" and t != buf.dtype:
                raise self.fail(s, f"op '{op}' on '{buf.name}' ({buf.dtype}) gives {t}")
            if op != "load" and a[-1].dtype != buf.dtype:
                raise self.fail(s, f"op '{op}' of a {a[-1].dtype} value into '{buf.name}' "
                                   f"({buf.dtype})")
        elif op in LOCAL_OPS:
            lt = a[0].dtype
            if op == "local_store":
                if a[1].dtype != lt:
                    raise self.fail(s, f"local_store of a {a[1].dtype} value into a {lt} local")
            elif t != lt:
                raise self.fail(s, f"op '{op}' of a {lt} local gives {t}")
            if op == "local_atomic":
                self.kind(s, s.attr, lt)
                if a[1].dtype != lt:
                    raise self.fail(s, f"local_atomic of a {a[1].dtype} value into a {lt} local")
        elif op in ("temp_load", "temp_store", "temp_atomic"):
            slot = s.attr[0] if op == "temp_atomic" and _is_pair(s.attr) else s.attr
            if not _is_int(slot) or slot < 0:
                raise self.fail(s, f"temp slot {slot!r} is not a slot")
            if op == "temp_atomic":
                if not _is_pair(s.attr):
                    raise self.fail(s, "temp_atomic takes (temp slot, kind)")
                self.kind(s, s.attr[1], t)
                self.same(s, a[0], s)
        elif op == "if":
            self.cond(s, a[0], "an if condition")
        elif op == "assert":
            if not a:
                raise self.fail(s, "assert takes a condition and the values its message shows")
            self.cond(s, a[0], "an assert condition")
            why = check_template(s.attr, [v.dtype for v in a[1:]])
            if why:
                raise self.fail(s, why)
        elif op == "print":
            if not isinstance(s.attr, tuple) or len(s.attr) != 2 * len(a) + 1 or not all(
                    isinstance(x, str) for x in s.attr[::2]):
                raise self.fail(s, "print takes (text, conversion, ..., text) around its "
                                   f"{len(a)} operands")
            # Function-level: the printf checker loads with the first print verified, not on import.
            from .printf import check

            for k, v in enumerate(a):
                why = check(s.attr[2 * k + 1], v.dtype)
                if why:
                    raise self.fail(s, f"print operand {k}: {why}")
        elif op == "return":
            returns = self.ir.returns
            if not _is_int(s.attr) or not 0 <= s.attr < len(returns):
                raise self.fail(s, f"return slot {s.attr!r} out of range (the kernel returns "
                                   f"{len(returns)} values)")
            if a[0].dtype != returns[s.attr]:
                raise self.fail(s, f"return slot {s.attr} is {returns[s.attr]}, given "
                                   f"{a[0].dtype}")
        elif op == "range_for":
            if not (_is_pair(s.attr) and _is_int(s.attr[0]) and s.attr[1] in LOOP_FLAGS):
                raise self.fail(s, f"range_for takes (loop id, one of {', '.join(LOOP_FLAGS)}), "
                                   f"got {s.attr!r}")
            if s.attr[0] in self.loop_ids:
                raise self.fail(s, f"loop id {s.attr[0]} is already used by an enclosing loop")
            for k, x in enumerate(a):
                if x.dtype != T.i32:
                    raise self.fail(s, f"range bound {k} is {x.dtype}; loop bounds are i32")
        elif kind not in ("unary", "random", "local", "stack", "control"):
            raise self.fail(s, f"no type rule for op '{op}'")  # a new op needs one here


    def value_types(self, s: Stmt, rule: str) -> None:
        """The type rules of the value ops (``ops.TYPE_RULES``), as the lowering assumes them."""
        op, a, t = s.op, s.args, s.dtype
        if rule == "select":
            self.cond(s, a[0], "a select condition")
            if a[1].dtype != t or a[2].dtype != t:
                raise self.fail(s, f"select of {a[1].dtype} and {a[2].dtype} gives {t}")
        elif rule in ("same", "float", "real", "int"):
            if a[0].dtype != t:
                raise self.fail(s, f"op '{op}' of {a[0].dtype} gives {a[0].dtype}, not {t}")
            if rule in ("float", "real") and not t.is_float:
                raise self.fail(s, f"op '{op}' needs a float operand, not {t}")
            if rule == "int" and not t.is_int:
                raise self.fail(s, f"{op} needs an integer operand, not {t}")
        elif rule == "cond":
            self.cond(s, a[0], f"the operand of {op}")
            if t != T.i32:
                raise self.fail(s, f"{op} gives i32, not {t}")
        elif rule in ("arith", "fdiv", "farith", "bits", "shift"):
            self.same(s, a[0], a[1], s)
            if rule in ("bits", "shift") and not t.is_int:
                raise self.fail(s, f"op '{op}' needs integer operands, not {t}")
            if rule == "farith" and not t.is_float:
                raise self.fail(s, f"{op} needs float operands, not {t}")
            if s.attr not in (None, "reassoc"):
                raise self.fail(s, f"op '{op}' takes no attribute, got {s.attr!r}")
        elif rule in ("cmp", "logical", "overflow"):
            self.same(s, a[0], a[1])
            if rule == "overflow" and not a[0].dtype.is_int:
                raise self.fail(s, f"op '{op}' needs integer operands, not {a[0].dtype}")
            if rule == "logical":
                self.cond(s, a[0], f"an operand of {op}")
            if t != T.i32:
                raise self.fail(s, f"op '{op}' gives i32, not {t}")
        elif rule == "bit_cast":
            if a[0].dtype.bits != t.bits:
                raise self.fail(s, f"bit_cast of {a[0].dtype} to {t}: the widths differ")
        elif rule != "cast":
            raise self.fail(s, f"no type rule {rule!r} for op '{op}'")


def verify(ir: KernelIR, *, locate: Callable[[Stmt], str | None] | None = None) -> KernelIR:
    """Check ``ir`` (frontend form or offloaded into tasks); raise IRVerificationError.

    ``locate`` names a statement in messages (the service passes the statement's path in the
    client's JSON); without it, statements are named by their ``%uid``.
    """
    c = _Checker(ir, locate)
    if ir.tasks is None:
        c.block(ir.body)
        return ir
    for k, t in enumerate(ir.tasks):
        c.where = f"kernel {ir.name} task {k}"
        c.block(t.bounds)
        if t.kind == "range" and (t.begin not in t.bounds or t.end not in t.bounds):
            raise IRVerificationError(f"{c.where}: range bounds are not computed in its bounds")
        try:
            c.block(t.prologue)
            c.visible.update(t.prologue)
            c.loop_ids = [t.loop_id] if t.kind == "range" else []
            c.block(t.body)
            c.loop_ids = []
            c.block(t.epilogue)
        finally:
            c.visible.clear()
            c.loop_ids = []
    return ir
