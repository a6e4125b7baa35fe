"""Reverse mode: a kernel's IR -> the IR of its adjoint kernel.

The adjoint is built before offloading, on the structured IR, in the manner of Taichi's
``MakeAdjoint`` but without its restrictions:

* The kernel body is split into *segments*: each top-level parallel loop, and each maximal run
  of other top-level statements. Segments are differentiated in reverse order. Before each,
  the serial statements that precede it are recomputed (without their global writes), so
  kernel-level variables hold the values the segment saw: serial code and parallel loops can be
  mixed freely in one kernel.
* A block is differentiated as *replay* + *reverse sweep*. The replay recomputes the block's
  values from the fields (global writes dropped); the sweep walks the statements backwards,
  accumulating adjoints in locals (LLVM turns them into registers) and into ``.grad`` buffers.
* Control flow: an ``if`` is reversed under its recomputed condition; before a region is
  recomputed inside the sweep, the outer locals it uses are restored to their values at region
  entry (snapshots taken during the replay). Loops push the locals they modify onto a per-task
  stack at every iteration; the sweep runs the iterations backwards, pops that state, and
  differentiates the body recursively (replay + sweep of one iteration). ``while`` loops count
  their iterations. ``break``/``continue`` were turned into flags first (structure.py), so
  every statement of an iteration that ran is known.
* Global writes: the adjoint of ``y[i] = v`` reads ``y.grad[i]`` into ``v``'s adjoint and then
  zeroes it (the overwritten value no longer influences anything); the adjoint of ``y[i] += v``
  reads it without zeroing; the adjoint of a read ``x[i]`` atomically adds into ``x.grad[i]``.

Only *active* statements (float values depending on a field with gradient storage, and
reaching a store into one) get adjoints, so integer bookkeeping, constants and values that
influence no differentiated output cost nothing in the adjoint kernel.

What cannot be differentiated correctly is refused with :class:`GradientRuleError`: a value that
the kernel reads and later overwrites (the recomputation would see the new value), values of
``ti.random()`` or of atomics feeding the computation, atomic min/max of active values, and
gradients flowing through kernel-level variables into parallel loops.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import GradientRuleError
from ..ir.nodes import Block, Buffer, KernelIR, Stmt, walk
from ..ir.ops import OPS
from ..ir.passes.dce import eliminate_blocks
from ..types import i32
from .rules import ADD_IDENTITY, Emitter, no_rule_message, partials, rule_error, scale
from .structure import (
    feeds_selection,
    local_sets,
    maybe_nonfinite,
    structurize_loops,
    useful_activity,
)

#: One sparse level above a buffer's cells, as the frontend describes it: the level's activity
#: buffer (a byte per cell, or a dynamic list's length), the map from the buffer's index to the
#: level's (axis, divisor) pairs, and whether the level is a dynamic list.
ActivityLevel = tuple[Buffer, list[tuple[int, int]], bool]


class _Scope:
    """Name resolution while building the adjoint: primal statement -> recomputed statement,
    loop ids -> index statements, and the adjoint locals of the statements this scope owns."""

    __slots__ = ("parent", "val", "loops", "owned", "adj", "decls", "snap", "pushed", "count")

    def __init__(self, parent: _Scope | None, owned: frozenset | set = frozenset()) -> None:
        self.parent = parent
        self.val: dict[Stmt, Stmt] = {}
        self.loops: dict[int, tuple[str, object]] = {}
        self.owned = owned
        self.adj: dict[Stmt, Stmt] = {}
        self.decls: Block = []
        self.snap: dict[Stmt, list[tuple[Stmt, Stmt]]] = {}
        self.pushed: dict[Stmt, list[Stmt]] = {}
        self.count: dict[Stmt, Stmt] = {}

    def v(self, s: Stmt) -> Stmt:
        sc = self
        while sc is not None:
            r = sc.val.get(s)
            if r is not None:
                return r
            sc = sc.parent
        raise KeyError(f"autodiff: no recomputed value for {s!r} ({s.op})")

    def loop(self, loop_id: int) -> tuple[str, object]:
        sc = self
        while sc is not None:
            r = sc.loops.get(loop_id)
            if r is not None:
                return r
            sc = sc.parent
        return ("id", loop_id)

    def owner(self, s: Stmt) -> _Scope:
        sc = self
        while sc is not None:
            if s in sc.owned:
                return sc
            sc = sc.parent
        raise KeyError(f"autodiff: no scope owns {s!r}")


class ReverseAD:
    def __init__(self, ir: KernelIR, has_grad: Callable[[Buffer], bool],
                 activity: Callable[[Buffer], list[ActivityLevel]] | None = None) -> None:
        self.ir = ir
        self.buffers = list(ir.buffers)
        self.grad_slot: dict[int, int] = {}
        # Sparse storage: a read's adjoint reaches the grad of an active cell only (below).
        self.guards: dict[int, list[tuple[int, list[tuple[int, int]], bool]]] = {}
        for slot, b in enumerate(ir.buffers):
            if b.key[2] == "primal" and has_grad(b):
                self.grad_slot[slot] = self._add_buffer(b.with_role("grad"))
                levels = activity(b) if activity is not None else []
                if levels:
                    self.guards[slot] = [(self._add_buffer(a), imap, dyn)
                                         for a, imap, dyn in levels]
        self._refuse_gradient_access()
        # Loads numbered in program order (stable across rebuilds of the same kernel), so the
        # run-time validation can find the primal loads the adjoint depends on.
        self.load_order = {s: k for k, s in enumerate(x for x in walk(ir.body)
                                                      if x.op == "load")}
        self.mattering: set[int] = set()
        ir.body = structurize_loops(ir.body)
        self.body = ir.body
        # Adjoints only for values that both depend on a differentiated input and can reach a
        # differentiated output: the adjoint of any other value is a known zero, and one kept
        # in a local would be -0.0 times its partials, which LLVM cannot fold without fast math
        # (p2g of the MPM benchmark: the unused ``P`` of ``r, _ = ti.polar_decompose(F)``).
        self.active = useful_activity(self.body, lambda slot: slot in self.grad_slot)
        # Zero-seed guards are needed only where a selection can send a zero adjoint into an
        # operation whose partial may be infinite or NaN.
        self.risky = maybe_nonfinite(self.body) & feeds_selection(self.body)
        self.accessed, self.written = local_sets(self.body)
        self.used: set[Stmt] = {a for s in walk(self.body) for a in s.args}
        self._relevant: dict[Stmt, bool] = {}
        self.next_loop = 1 + max((s.attr[0] for s in walk(self.body) if s.op == "range_for"),
                                 default=0)
        self.origin: dict[Stmt, Stmt] = {}  # recomputed load -> primal load
        self._in_parallel = False
        self._prefix = False
        self._current: Stmt | None = None  # the statement being swept, for error messages

    def _refuse_gradient_access(self) -> None:
        """The kernel must not itself read or write a ``.grad`` that its reverse pass
        accumulates into: the recomputed reads would see the gradients being added, and no
        derivative flows through a gradient's own values (it has no ``.grad``). Taichi refuses
        the same for ndarrays (and ignores it for fields, computing gradients from whatever
        the ``.grad`` holds then)."""
        accumulated = {self.buffers[g].key for g in self.grad_slot.values()}
        for s in walk(self.ir.body):
            if s.op in ("load", "store"):
                slot = s.attr
            elif s.op == "atomic":
                slot = s.attr[0]
            else:
                continue
            b = self.ir.buffers[slot]
            if b.key in accumulated:
                verb = "reads" if s.op == "load" else "writes"
                raise self.error(s, f"Cannot automatically differentiate through a grad tensor: "
                                 f"this kernel {verb} {b.name}, the gradient its own reverse "
                                 "pass accumulates into. Use the gradient in a kernel that is "
                                 "not differentiated (outside the Tape / kernel.grad), or copy "
                                 "it into a separate field or ndarray and pass that")

    def _add_buffer(self, b: Buffer) -> int:
        for slot, x in enumerate(self.buffers):
            if x.key == b.key:
                return slot
        self.buffers.append(b)
        return len(self.buffers) - 1

    def fresh_loop(self) -> int:
        self.next_loop += 1
        return self.next_loop

    # ------------------------------------------------------------------ predicates
    def relevant(self, s: Stmt) -> bool:
        """Does the reverse sweep have anything to do for ``s``?"""
        r = self._relevant.get(s)
        if r is None:
            if s.op in ("store", "atomic"):
                r = s.attr if s.op == "store" else s.attr[0]
                r = r in self.grad_slot
            elif s.op == "local_store":
                r = s.args[0] in self.active
            elif s.op == "local_atomic":
                r = s.args[1] in self.active
            elif s.blocks:
                r = any(self.relevant(x) for b in s.blocks for x in b)
            else:
                r = s in self.active
            self._relevant[s] = r
        return r

    # ------------------------------------------------------------------ errors
    def error(self, s: Stmt, message: str) -> GradientRuleError:
        return rule_error(message, self.ir.name, s.loc, self.ir.file)

    # ------------------------------------------------------------------ the kernel
    def build(self) -> KernelIR:
        segments: list[tuple[str, list[Stmt]]] = []
        for s in self.body:
            if s.op == "range_for" and s.attr[1] == "parallel":
                segments.append(("parallel", [s]))
            elif segments and segments[-1][0] == "serial":
                segments[-1][1].append(s)
            else:
                segments.append(("serial", [s]))
        kernel_scope = _Scope(None, owned=set(self.body))
        for s in self.body:  # kernel-level locals' adjoints are shared by all segments
            if s.op == "alloca" and s in self.active:
                self.adj_alloca(kernel_scope, s)
        out: Block = []
        for k in reversed(range(len(segments))):
            kind, stmts = segments[k]
            if not any(self.relevant(s) for s in stmts):
                continue
            scope = _Scope(kernel_scope)
            self._prefix = True  # recompute what the segment sees, reductions included
            for _, prev in segments[:k]:
                self.replay(prev, scope, out, top=False)
            self._prefix = False
            if kind == "serial":
                self.adjoint_block(stmts, scope, out, owned=frozenset())
            else:
                out.append(self.parallel_adjoint(stmts[0], scope))
        (body,) = eliminate_blocks([kernel_scope.decls + out])
        self.check_rules(body)
        return KernelIR(self.ir.name + "_grad", self.ir.params, self.buffers, body,
                        returns=[], source=self.ir.source, file=self.ir.file,
                        debug=self.ir.debug)

    def parallel_adjoint(self, loop: Stmt, scope: _Scope) -> Stmt:
        new_id = self.fresh_loop()
        inner = _Scope(scope)
        inner.loops[loop.attr[0]] = ("id", new_id)
        body: Block = []
        self._in_parallel = True
        self.adjoint_block(loop.blocks[0], inner, body, owned=frozenset(loop.blocks[0]))
        self._in_parallel = False
        return Stmt("range_for", None, (scope.v(loop.args[0]), scope.v(loop.args[1])),
                    (new_id, "parallel"), (body,), loc=loop.loc)

    # ------------------------------------------------------------------ replay + sweep
    def adjoint_block(self, block: Block, parent: _Scope, out: Block, owned) -> None:
        scope = _Scope(parent, owned=owned)
        self.replay(block, scope, out, top=True)
        sweep: Block = []
        for s in block:  # locals' adjoints exist before any of their uses is reversed
            if s.op == "alloca" and s in self.active and s in owned:
                self.adj_alloca(scope, s)
        self.sweep(block, scope, sweep)
        out += scope.decls
        out += sweep

    def replay(self, block: Block, scope: _Scope, out: Block, top: bool) -> None:
        """Recompute ``block``'s values into ``out`` without global side effects. With
        ``top``, record what the sweep of this block needs: snapshots of locals before each
        region and per-iteration pushes of the locals each loop modifies."""
        e = Emitter(out)
        for s in block:
            op = s.op
            e.loc = s.loc
            if op in ("store", "assert", "return", "print"):
                continue  # no global side effects (the primal run printed already)
            if op == "local_atomic" and self._prefix and s not in self.used:
                out.append(s.replace(args=tuple(scope.v(a) for a in s.args)))
                continue
            if op in ("atomic", "local_atomic"):
                if s in self.used:
                    raise self.error(s, "the value returned by an atomic operation cannot be "
                                     "recomputed by the reverse pass (it depends on the order "
                                     "in which threads ran). Compute it in a separate kernel, "
                                     "or mark this kernel @ti.ad.no_grad if it needs no "
                                     "gradient")
                continue
            if op == "random":
                if s in self.used:
                    raise self.error(s, "ti.random() in a kernel being differentiated "
                                     "(RandStmt not supported in autodiff): the "
                                     "reverse pass recomputes the kernel's values and would "
                                     "draw different numbers. Draw them in a separate kernel "
                                     "into a field and read that field here")
                continue
            if op == "loop_index":
                kind, what = scope.loop(s.attr)
                scope.val[s] = what if kind == "val" else e.emit("loop_index", i32, (), what)
                continue
            if op == "if":
                self._save(s, scope, e, top)
                blocks = []
                for b in s.blocks:
                    nb: Block = []
                    self.replay(b, _Scope(scope), nb, top=False)
                    blocks.append(nb)
                out.append(Stmt("if", None, (scope.v(s.args[0]),), None, tuple(blocks),
                                loc=s.loc))
                continue
            if op == "range_for":
                out.append(self._replay_loop(s, scope, top, e))
                continue
            if op == "while":
                out.append(self._replay_while(s, scope, top, e))
                continue
            if op in ("break", "continue"):
                out.append(Stmt(op, None, loc=s.loc))
                continue
            new = s.replace(args=tuple(scope.v(a) for a in s.args))
            out.append(new)
            scope.val[s] = new
            if op == "load":
                self.origin[new] = s

    def _save(self, s: Stmt, scope: _Scope, e: Emitter, top: bool) -> None:
        if top and self.relevant(s):
            scope.snap[s] = [(a, e.emit("local_load", a.dtype, (scope.v(a),)))
                             for a in self.accessed[s]]

    def _push_state(self, s: Stmt, inner: _Scope, body: Block) -> None:
        be = Emitter(body, s.loc)
        for a in self.written[s]:
            be.emit("stack_push", None, (be.emit("local_load", a.dtype, (inner.v(a),)),))

    def _replay_loop(self, s: Stmt, scope: _Scope, top: bool, e: Emitter) -> Stmt:
        self._save(s, scope, e, top)
        new_id = self.fresh_loop()
        inner = _Scope(scope)
        inner.loops[s.attr[0]] = ("id", new_id)
        body: Block = []
        if top and self.relevant(s):
            self._push_state(s, inner, body)
        self.replay(s.blocks[0], inner, body, top=False)
        return Stmt("range_for", None, (scope.v(s.args[0]), scope.v(s.args[1])),
                    (new_id, s.attr[1]), (body,), loc=s.loc)

    def _replay_while(self, s: Stmt, scope: _Scope, top: bool, e: Emitter) -> Stmt:
        self._save(s, scope, e, top)
        n_exit = s.attr or 0
        inner = _Scope(scope)
        body: Block = []
        self.replay(s.blocks[0][:n_exit], inner, body, top=False)
        if top and self.relevant(s):
            count = e.emit("alloca", i32)
            e.emit("local_store", None, (count, e.const(0, i32)))
            scope.count[s] = count
            self._push_state(s, inner, body)
            be = Emitter(body, s.loc)
            c = be.emit("local_load", i32, (count,))
            be.emit("local_store", None, (count, be.bin("add", c, be.const(1, i32))))
        self.replay(s.blocks[0][n_exit:], inner, body, top=False)
        return Stmt("while", None, (), s.attr, (body,), loc=s.loc)

    # ------------------------------------------------------------------ adjoint storage
    def adj_alloca(self, scope: _Scope, s: Stmt) -> Stmt:
        """The local holding ``s``'s adjoint (declared, zeroed, in the scope owning ``s``).
        Zeroed with ``-0.0`` (:data:`.rules.ADD_IDENTITY`): the first contribution added to
        it then folds away, and an adjoint only ever meets additions (into other adjoints and
        ``.grad``) and multiplications, where the sign of a zero changes no nonzero result."""
        owner = scope.owner(s)
        a = owner.adj.get(s)
        if a is None:
            a = Stmt("alloca", s.dtype, loc=s.loc)
            zero = Stmt("const", s.dtype, (), ADD_IDENTITY, loc=s.loc)
            owner.decls += [a, zero, Stmt("local_store", None, (a, zero), loc=s.loc)]
            owner.adj[s] = a
        return a

    def adj_value(self, scope: _Scope, s: Stmt, e: Emitter) -> Stmt | None:
        owner = scope.owner(s)
        a = owner.adj.get(s)
        if a is None:
            return None
        return e.emit("local_load", s.dtype, (a,))

    def accumulate(self, scope: _Scope, s: Stmt, g: Stmt | None, e: Emitter) -> None:
        if g is None or s not in self.active:
            return
        a = self.adj_alloca(scope, s)
        g = e.cast(g, s.dtype)
        if self._in_parallel and scope.owner(s).parent is None:
            # A kernel-level value read by every iteration: its adjoint is a sum over the
            # iterations, a reduction (privatized per chunk like any other).
            e.emit("local_atomic", s.dtype, (a, g), "add")
            return
        cur = e.emit("local_load", s.dtype, (a,))
        e.emit("local_store", None, (a, e.bin("add", cur, g)))

    # ------------------------------------------------------------------ the sweep
    def sweep(self, block: Block, scope: _Scope, out: Block) -> None:
        e = Emitter(out)
        for s in reversed(block):
            if not self.relevant(s):
                continue
            self._current = s
            e.loc = s.loc
            op = s.op
            if OPS[op].derivative is None:  # declared without a derivative: never a zero
                if self.adj_value(scope, s, e) is not None:
                    raise self.error(s, no_rule_message(op, "reverse"))
            elif callable(OPS[op].derivative):
                g = self.adj_value(scope, s, e)
                if g is None:
                    continue
                ps = partials(e, s, scope.v(s), tuple(scope.v(a) for a in s.args))
                guard = s in self.risky
                for a, p in zip(s.args, ps, strict=True):
                    if a in self.active:
                        self.accumulate(scope, a, scale(e, p, g, guard, ADD_IDENTITY), e)
            elif op == "local_load":
                self.accumulate(scope, s.args[0], self.adj_value(scope, s, e), e)
            elif op == "local_store":
                a, v = s.args
                if self._in_parallel and scope.owner(a).parent is None:
                    raise self.error(s, "this parallel loop assigns a variable defined outside "
                                     "it: the iterations race, so neither the value nor its "
                                     "gradient is well defined. Use `+=` (a reduction), or "
                                     "a field")
                adj = self.adj_alloca(scope, a)
                g = e.emit("local_load", a.dtype, (adj,))
                e.emit("local_store", None, (adj, e.const(ADD_IDENTITY, a.dtype)))
                self.accumulate(scope, v, g, e)
            elif op == "load":
                g = self.adj_value(scope, s, e)
                if g is not None:
                    gs = self.grad_slot[s.attr]
                    idx = tuple(scope.v(a) for a in s.args)
                    if s.attr in self.guards:
                        g = e.select(self._active(s.attr, idx, e), g, e.const(0.0, g.dtype))
                    e.emit("atomic", g.dtype, idx + (g,), (gs, "add"))
            elif op == "local_atomic":
                a, v = s.args
                if s.attr in ("add", "sub"):
                    g = e.emit("local_load", a.dtype, (self.adj_alloca(scope, a),))
                    self.accumulate(scope, v, g if s.attr == "add" else e.un("neg", g), e)
                else:
                    raise self.error(s, f"atomic {s.attr} of a value that needs a gradient "
                                     "cannot be differentiated: its derivative depends on which "
                                     "thread won")
            elif op == "store":
                self._sweep_store(s, scope, e, s.attr, "store")
            elif op == "atomic":
                self._sweep_store(s, scope, e, s.attr[0], s.attr[1])
            elif op == "if":
                self._sweep_if(s, scope, out)
            elif op in ("range_for", "while"):
                self._sweep_loop(s, scope, out)

    def _active(self, slot: int, idx: tuple[Stmt, ...], e: Emitter) -> Stmt:
        """Is the cell of sparse buffer ``slot`` at ``idx`` active (an i32)? A read of an
        inactive cell is a constant 0, so its adjoint is dropped: added into the grad there,
        it would break the sparse storage's invariant that an inactive cell holds zeros
        (``fill`` writes active cells only, so the stale value would outlive it)."""
        cond = None
        for act, imap, dynamic in self.guards[slot]:
            lidx = [idx[q] if d == 1 else e.bin("floordiv", idx[q], e.const(d, i32))
                    for q, d in imap]
            t = self.buffers[act].dtype
            if dynamic:
                *par, j = lidx
                c = e.cmp("lt", j, e.cast(e.emit("load", t, tuple(par), act), i32))
            else:
                c = e.cmp("ne", e.emit("load", t, tuple(lidx), act), e.const(0, t))
            cond = c if cond is None else e.bin("bit_and", cond, c)
        return cond

    def _sweep_store(self, s: Stmt, scope: _Scope, e: Emitter, slot: int, kind: str) -> None:
        gs = self.grad_slot[slot]
        v = s.args[-1]
        idx = tuple(scope.v(a) for a in s.args[:-1])
        t = self.buffers[gs].dtype
        if kind == "store":
            g = e.emit("load", t, idx, gs)
            e.emit("store", None, idx + (e.const(0, t),), gs)
            self.accumulate(scope, v, g, e)
        elif kind in ("add", "sub"):
            if v in self.active:
                g = e.emit("load", t, idx, gs)
                self.accumulate(scope, v, g if kind == "add" else e.un("neg", g), e)
        elif kind == "mul":
            raise self.error(s, f"atomic mul into '{self.buffers[slot].name}', which has "
                             "gradient storage: the derivative of a product needs the "
                             "element's value before each multiplication, which an atomic "
                             "does not keep. Multiply in a loop of your own, or keep the "
                             "target out of the differentiated program (a field without "
                             "needs_grad, or a kernel marked @ti.ad.no_grad)")
        else:
            # Even with a constant value: where it wins, the element's previous value (and
            # whatever it depended on) stops mattering, and only the winner knows.
            raise self.error(s, f"atomic {kind} into '{self.buffers[slot].name}', which has "
                             "gradient storage: the derivative depends on which value won, "
                             "which the reverse pass cannot know. Compute the result with "
                             "ti.max/ti.min in a reduction of your own, or keep the target "
                             "out of the differentiated program (a field without needs_grad, "
                             "or a kernel marked @ti.ad.no_grad)")

    def _restore(self, s: Stmt, scope: _Scope, block: Block) -> None:
        for a, snap in scope.snap.get(s, ()):
            block.append(Stmt("local_store", None, (scope.v(a), snap), loc=s.loc))

    def _sweep_if(self, s: Stmt, scope: _Scope, out: Block) -> None:
        blocks = []
        for b in s.blocks:
            nb: Block = []
            if any(self.relevant(x) for x in b):
                self._restore(s, scope, nb)
                self.adjoint_block(b, scope, nb, owned=frozenset(b))
            blocks.append(nb)
        out.append(Stmt("if", None, (scope.v(s.args[0]),), None, tuple(blocks), loc=s.loc))

    def _sweep_loop(self, s: Stmt, scope: _Scope, out: Block) -> None:
        e = Emitter(out, s.loc)
        self._restore(s, scope, out)
        new_id = self.fresh_loop()
        body: Block = []
        be = Emitter(body, s.loc)
        t = be.emit("loop_index", i32, (), new_id)
        inner = _Scope(scope)
        if s.op == "range_for":
            begin, end = scope.v(s.args[0]), scope.v(s.args[1])
            last = be.bin("sub", be.bin("add", begin, end), be.const(1, i32))
            inner.loops[s.attr[0]] = ("val", be.bin("sub", last, t))
            stmts = s.blocks[0]
        else:
            begin = e.const(0, i32)
            end = e.emit("local_load", i32, (scope.count[s],))
            stmts = s.blocks[0][s.attr or 0:]
        for a in reversed(self.written[s]):
            be.emit("local_store", None, (inner.v(a), be.emit("stack_pop", a.dtype)))
        self.adjoint_block(stmts, inner, body, owned=frozenset(stmts))
        out.append(Stmt("range_for", None, (begin, end), (new_id, "inner"), (body,), loc=s.loc))

    # ------------------------------------------------------------------ the access rules
    def check_rules(self, body: Block) -> None:
        """Refuse kernels that read an element and later modify it: the adjoint recomputes
        from the fields as the kernel left them, so it would see the new value. Only reads
        whose recomputation survives in the adjoint (after dead-code elimination) matter."""
        mattering = {self.origin[s] for s in walk(body) if s in self.origin}
        self.mattering = {self.load_order[s] for s in mattering}
        if not mattering:
            return
        order: dict[Stmt, int] = {}
        loops: dict[Stmt, tuple[Stmt, ...]] = {}

        def number(block: Block, enclosing: tuple[Stmt, ...]) -> None:
            for s in block:
                order[s] = len(order)
                loops[s] = enclosing
                inner = enclosing
                if s.op in ("range_for", "while") and not (
                        s.op == "range_for" and s.attr[1] == "parallel"):
                    inner = enclosing + (s,)
                for b in s.blocks:
                    number(b, inner)

        number(self.body, ())
        writes = [s for s in order if s.op in ("store", "atomic")]
        for r in sorted(mattering, key=order.__getitem__):
            for w in writes:
                slot = w.attr if w.op == "store" else w.attr[0]
                if slot != r.attr or not _same_index(r.args, w.args[:-1]):
                    continue
                if order[w] > order[r] or self._repeats(r, w, loops):
                    raise self._rule_error(r, w)

    def _repeats(self, r: Stmt, w: Stmt, loops: dict) -> bool:
        """Written before read, but in a loop enclosing both whose index the element does not
        depend on: the next iteration overwrites what this one read."""
        common = [lp for lp in loops[r] if lp in loops[w]]
        deps = _loop_ids(r.args)
        return any(lp.op == "while" or lp.attr[0] not in deps for lp in common)

    def _rule_error(self, r: Stmt, w: Stmt) -> GradientRuleError:
        buf = self.buffers[r.attr]
        rline = r.loc.line if r.loc else "?"
        text = r.loc.text if r.loc else ""
        how = "overwrites" if w.op == "store" else "modifies (atomically)"
        what = (f"this line reads an element of '{buf.name}' and then {how} it"
                if r.loc == w.loc else
                f"this line {how} an element of '{buf.name}' that line {rline} read "
                f"(`{text}`)")
        return self.error(w, f"{what}. Reverse mode recomputes the kernel's values from "
                          "the fields as the kernel left them, so its gradient would use the "
                          "new value (global data access rule #1: once read, an element must "
                          "not be modified). Fix: write the new value to another field "
                          "(double-buffering, or index the field by time step: "
                          "x[t + 1, i] = f(x[t, i])), or split the kernel so the write happens "
                          "in a kernel that runs after the gradient is taken")


def _same_index(a: tuple[Stmt, ...], b: tuple[Stmt, ...]) -> bool:
    return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b, strict=True))


def _same_value(x: Stmt, y: Stmt) -> bool:
    if x is y:
        return True
    if x.op != y.op or x.attr != y.attr or len(x.args) != len(y.args) or x.blocks or y.blocks:
        return False
    if not x.info.pure and x.op != "local_load":
        return False
    return all(_same_value(a, b) for a, b in zip(x.args, y.args, strict=True))


def _loop_ids(args: tuple[Stmt, ...]) -> set[int]:
    out: set[int] = set()
    stack = list(args)
    while stack:
        s = stack.pop()
        if s.op == "loop_index":
            out.add(s.attr)
        stack.extend(s.args)
    return out


def reverse_kernel(ir: KernelIR, has_grad: Callable[[Buffer], bool],
                   activity: Callable[[Buffer], list[ActivityLevel]] | None = None) -> KernelIR:
    """The adjoint of ``ir`` (a freshly built kernel, before the pass pipeline; consumed).
    ``activity(buf)``: the sparse levels above a buffer's cells (see :data:`ActivityLevel`)."""
    return ReverseAD(ir, has_grad, activity).build()
