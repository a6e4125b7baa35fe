"""Forward mode: a kernel's IR -> the IR of its forward-mode (tangent) kernel.

Forward mode computes each value's tangent right after the value, in program order, so the
transform is one walk over the structured IR: no replay, no stacks, no restrictions on reading
and then overwriting fields (derivatives are computed eagerly). For each active statement the
tangent is ``sum(partial_k * tangent(operand_k))``, with the partials taken from the same
derivative table as reverse mode (:mod:`.rules`), so the two modes agree by construction.

Memory: a load from a buffer with dual storage also loads the tangent from its ``.dual``;
stores and atomic adds write tangents to the ``.dual``; locals holding active values get a
dual local. The transform works on any kernel IR, including the adjoint kernels that reverse
mode produces: applied to an adjoint (whose ``.grad`` buffers have ``.grad.dual`` companions)
it gives forward-over-reverse, i.e. Hessian-vector products in one pass. The reverse-mode
stack is handled by pushing each float value's tangent after the value and popping it first.

The same walk derives ``@ti.func`` derivatives at compile time (:func:`tangents_of_block`):
the func is inlined into a scratch block whose argument values are seeded.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import GradientRuleError
from ..ir.nodes import Block, Buffer, KernelIR, Stmt, walk
from ..ir.ops import OPS
from .rules import RISKY, Emitter, Scaled, no_rule_message, partials, rule_error, scale
from .structure import (
    _forward_closure,
    carries_none,
    finite_partials,
    flows_into,
    lower_bounds,
)

#: role of a buffer -> role of the buffer holding its tangents
DUAL_ROLE = {"primal": "dual", "grad": "grad_dual"}


class ForwardAD:
    """Builds tangent code for a block. ``dual_slot``: buffer slot -> slot of its tangents.
    ``tan``: statement -> its tangent statement (absent: the tangent is zero)."""

    def __init__(self, dual_slot: dict[int, int], name: str, file: str,
                 seeds: dict[Stmt, Stmt] | None = None, buffers: list[Buffer] = (),
                 inputs: bool = True) -> None:
        self.dual_slot = dual_slot
        self.inputs = inputs  # do loads from dual buffers carry tangents?
        self.buffers = list(buffers)
        self.name, self.file = name, file
        self.tan: dict[Stmt, Stmt] = dict(seeds or {})
        # A power-of-two factor of a tangent, kept apart (rules.Scaled): the tangent of s is
        # factor[s] * tan[s]. Multiplied in where a tangent leaves the arithmetic (_t).
        self.factor: dict[Stmt, float] = {}
        # A local_load -> an earlier load of the same local in the same block with no store
        # between: the same value, so the same tangent (no second dual load), and terms
        # through either merge (x * x with x loaded twice is still d(x*x) = 2 x dx).
        self.same: dict[Stmt, Stmt] = {}
        self.dual_local: dict[Stmt, Stmt] = {}
        self.active: set[Stmt] = set()

    # ------------------------------------------------------------------ analysis
    def analyse(self, body: Block) -> None:
        """Locals need their activity decided before the walk: a loop-carried local is read
        at the top of an iteration before the active store further down."""

        def seed(s: Stmt) -> bool | None:
            if s.op == "load":
                return self.inputs and s.attr in self.dual_slot
            if s.op == "stack_pop":
                return True
            return False if carries_none(s.op) else None

        self.active = _forward_closure(body, seed, initial=set(self.tan))
        # What reaches a tangent output (stores to dual storage, pushes of tangents); None:
        # everything counts (a func's derivative: its results are the outputs).
        self.needed = None if not self.dual_slot else flows_into(
            body, lambda s: (s.op in ("store", "atomic") and self._slot(s) in self.dual_slot)
            or s.op == "stack_push")
        self.used = {a for x in walk(body) for a in x.args}
        self.bounds = lower_bounds(body)

    @staticmethod
    def _slot(s: Stmt) -> int:
        return s.attr if s.op == "store" else s.attr[0]

    def buffers_name(self, slot: int) -> str:
        return self.buffers[slot].name if slot < len(self.buffers) else f"buffer {slot}"

    def error(self, s: Stmt, message: str) -> GradientRuleError:
        return rule_error(message, self.name, s.loc, self.file)

    # ------------------------------------------------------------------ the walk
    def block(self, block: Block) -> Block:
        out: Block = []
        e = Emitter(out)
        loaded: dict[Stmt, Stmt] = {}  # local -> its first load since the last store
        for s in block:
            e.loc = s.loc
            if s.blocks:
                loaded.clear()  # a nested block may store to any local
            elif s.op == "local_load":
                first = loaded.setdefault(s.args[0], s)
                if first is not s:
                    self.same[s] = first
            elif s.op in ("local_store", "local_atomic"):
                loaded.pop(s.args[0], None)
            if s.op == "stack_pop" and s.dtype is not None and s.dtype.is_float:
                # Pushed as (value, tangent): the tangent comes off the stack first.
                self.tan[s] = e.emit("stack_pop", s.dtype)
                out.append(s)
                continue
            if s.blocks:
                s.blocks = tuple(self.block(b) for b in s.blocks)
                out.append(s)
                continue
            out.append(s)
            self.tangent(s, e)
        return out

    def _t(self, e: Emitter, s: Stmt) -> Stmt | None:
        """The tangent of ``s`` as a value (its factor multiplied in)."""
        t = self.tan.get(s)
        k = self.factor.get(s)
        return t if t is None or k is None else e.bin("mul", t, e.const(k, t.dtype))

    def _t_or_zero(self, e: Emitter, s: Stmt) -> Stmt:
        t = self._t(e, s)
        return t if t is not None else e.const(0, s.dtype)

    def tangent(self, s: Stmt, e: Emitter) -> None:
        op = s.op
        if op == "load":
            d = self.dual_slot.get(s.attr)
            if d is not None and self.inputs:
                self.tan[s] = e.emit("load", s.dtype, s.args, d)
        elif op == "store":
            d = self.dual_slot.get(s.attr)
            if d is not None:
                *idx, v = s.args
                e.emit("store", None, (*idx, self._t_or_zero(e, v)), d)
        elif op == "atomic":
            self._atomic(s, e)
        elif op == "alloca":
            if s in self.active:
                self.dual_local[s] = e.emit("alloca", s.dtype)
        elif op == "local_store":
            a, v = s.args
            d = self.dual_local.get(a)
            if d is not None:
                e.emit("local_store", None, (d, self._t_or_zero(e, v)))
        elif op == "local_load":
            d = self.dual_local.get(s.args[0])
            first = self.same.get(s)
            if first is not None:
                if first in self.tan:
                    self.tan[s] = self.tan[first]
                    if first in self.factor:
                        self.factor[s] = self.factor[first]
            elif d is not None:
                self.tan[s] = e.emit("local_load", s.dtype, (d,))
        elif op == "local_atomic":
            a, v = s.args
            d = self.dual_local.get(a)
            if d is not None:
                if s.attr not in ("add", "sub"):
                    raise self.error(s, f"forward mode cannot differentiate an atomic "
                                        f"{s.attr} of a differentiated local")
                if s in self.used:
                    raise self.error(s, "forward mode cannot give a derivative to the old value "
                                        "returned by an atomic update of a differentiated local")
                t = self._t(e, v)
                if t is not None:
                    e.emit("local_atomic", s.dtype, (d, t), s.attr)
        elif op == "stack_push":
            v = s.args[0]
            if v.dtype is not None and v.dtype.is_float:
                e.emit("stack_push", None, (self._t_or_zero(e, v),))
        elif s.dtype is not None and s.dtype.is_float and not carries_none(op):
            if callable(OPS[op].derivative):
                self._rule(s, e)
            elif s in self.active and (self.needed is None or s in self.needed):
                raise self.error(s, no_rule_message(op, "forward"))

    def _rule(self, s: Stmt, e: Emitter) -> None:
        args = s.args[1:] if s.op == "select" else s.args
        if not any(a in self.tan for a in args):
            return
        ps = partials(e, s, s, s.args)
        # A zero tangent (most of them, when one direction is seeded) must give exactly zero
        # even where the partial is infinite: guard, unless the partial is provably finite.
        guard = s.op in RISKY and not finite_partials(s, self.bounds)
        # (tangent, partial, factor) per operand; equal terms merge (d(x*x) = 2 x dx).
        terms: list[list] = []
        for a, p in zip(s.args, ps, strict=True):
            t = self.tan.get(a)
            if t is None or p is None:
                continue
            if t.dtype != s.dtype:
                t = e.cast(t, s.dtype)
            k = self.factor.get(a, 1.0)
            if isinstance(p, Scaled):
                p, k = p.value, k * p.factor
            if isinstance(p, Stmt):
                p = self.same.get(p, p)
            for term in terms:
                if term[0] is t and term[1] is p and term[2] == k:
                    term[2] = 2 * k
                    break
            else:
                terms.append([t, p, k])
        parts = [(c, k) for t, p, k in terms if (c := scale(e, p, t, guard)) is not None]
        if not parts:
            return
        k = parts[0][1]
        if any(kk != k for _, kk in parts):  # different factors: multiply them in
            parts = [(c if kk == 1.0 else e.bin("mul", c, e.const(kk, c.dtype)), 1.0)
                     for c, kk in parts]
            k = 1.0
        total = parts[0][0]
        for c, _ in parts[1:]:
            total = e.bin("add", total, c)
        self.tan[s] = total
        if k != 1.0:
            self.factor[s] = k

    def _atomic(self, s: Stmt, e: Emitter) -> None:
        slot, kind = s.attr
        d = self.dual_slot.get(slot)
        if d is None:
            return
        *idx, v = s.args
        if kind == "mul":
            raise self.error(s, f"forward mode cannot differentiate atomic_mul into "
                                f"'{self.buffers_name(slot)}', which has dual storage: the "
                                "tangent of a product needs the element's value before each "
                                "multiplication, which an atomic does not keep. Multiply in a "
                                "loop of your own (or a serial one), or keep the target out of "
                                "the differentiated program (a field without needs_dual, or a "
                                "kernel marked @ti.ad.no_grad)")
        if kind in ("min", "max"):
            raise self.error(s, f"forward mode cannot differentiate atomic_{kind} into "
                                f"'{self.buffers_name(slot)}', which has dual storage: the "
                                "tangent must follow whichever value wins, which an atomic "
                                "cannot report. Compute the result with ti.max/ti.min in a "
                                "reduction of your own, or keep the target out of the "
                                "differentiated program (a field without needs_dual, or a "
                                "kernel marked @ti.ad.no_grad)")
        if s in self.used:
            raise self.error(s, "forward mode cannot give a derivative to the value an atomic "
                                "returns (the old value of a field with dual storage): another "
                                "thread may change the element between the value and its "
                                "tangent. Read the element in a separate kernel")
        t = self._t(e, v)
        if t is not None:
            e.emit("atomic", s.dtype, (*idx, t), (d, kind))


def _buffer_duals(buffers: list[Buffer], has_dual: Callable[[Buffer], bool]
                  ) -> tuple[list[Buffer], dict[int, int]]:
    out = list(buffers)
    dual_slot: dict[int, int] = {}
    for slot, b in enumerate(buffers):
        role = DUAL_ROLE.get(b.key[2])
        if role is None or not b.dtype.is_float or not has_dual(b):
            continue
        key = (b.key[0], b.key[1], role)
        for k, x in enumerate(out):
            if x.key == key:
                dual_slot[slot] = k
                break
        else:
            out.append(Buffer(key, b.dtype, b.shape, f"{b.name}.dual", b.element_ndim,
                              b.offset))
            dual_slot[slot] = len(out) - 1
    return out, dual_slot


def forward_kernel(ir: KernelIR, has_dual: Callable[[Buffer], bool], inputs: bool = True
                   ) -> KernelIR:
    """The forward-mode kernel: ``ir``'s computation plus the tangents of everything it
    computes from buffers with dual storage (``has_dual``). Consumes ``ir``'s body.
    ``inputs=False`` (a ``no_grad`` kernel under forward mode): what it reads carries no
    tangent, so it stores zero tangents for what it writes."""
    buffers, dual_slot = _buffer_duals(ir.buffers, has_dual)
    fwd = ForwardAD(dual_slot, ir.name, ir.file, buffers=buffers, inputs=inputs)
    fwd.analyse(ir.body)
    body = fwd.block(ir.body)
    return KernelIR(ir.name + "_fwd", ir.params, buffers, body, returns=list(ir.returns),
                    source=ir.source, file=ir.file, debug=ir.debug)


def tangents_of_block(block: Block, seeds: dict[Stmt, Stmt], name: str, file: str
                      ) -> tuple[Block, dict[Stmt, Stmt]]:
    """Tangent code for a block of kernel code (an inlined func) whose inputs ``seeds`` maps
    to their tangents. Returns the new block and the tangent map."""
    fwd = ForwardAD({}, name, file, seeds)
    fwd.analyse(block)
    out = fwd.block(block)
    # Hand out plain tangents: multiply in the factors of the block's own values (values
    # in nested blocks are not visible after it).
    e = Emitter(out)
    tan = dict(fwd.tan)
    for s in block:
        if s in fwd.factor:
            tan[s] = fwd._t(e, s)
    return out, tan
