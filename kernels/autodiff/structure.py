"""Analyses and a normalisation the autodiff transforms share.

* :func:`structurize_loops` removes ``break``/``continue`` from loops by turning them into flag
  variables that guard the rest of the iteration. A reverse pass must know exactly which
  statements of an iteration ran; with flags, that is recorded in ordinary (pushed) locals.
  ``while`` loops keep one real exit test at the top of their body (``attr`` = the number of
  statements of that test), so the loop still terminates.
* :func:`activity` finds the *active* statements: floating-point values that depend on a
  buffer with gradient storage. Only they get adjoints or tangents. An op declared without a
  derivative (neither a rule nor ``NO_DERIVATIVE``) passes activity on, so that the transforms
  refuse it where a derivative would flow through it instead of giving a silent zero.
* :func:`local_sets` computes, for each control statement, the locals declared outside it that
  it reads or writes (restored before a region is recomputed) and those it writes (pushed per
  loop iteration).
"""

from __future__ import annotations

from collections.abc import Callable

from ..ir.nodes import Block, Stmt, walk
from ..ir.ops import NO_DERIVATIVE, OPS, STRUCTURAL
from ..types import i32

# ---------------------------------------------------------------------------------------------
# break / continue -> flags

def _exits(block: Block) -> bool:
    """Does the block contain a break/continue of the enclosing loop (not of an inner one)?"""
    for s in block:
        if s.op in ("break", "continue"):
            return True
        if s.op == "if" and any(_exits(b) for b in s.blocks):
            return True
    return False


class _Flags:
    def __init__(self, brk: Stmt | None, cont: Stmt | None, loc) -> None:
        self.brk, self.cont, self.loc = brk, cont, loc

    def set(self, flag: Stmt) -> Stmt:
        one = Stmt("const", i32, (), 1, loc=self.loc)
        return [one, Stmt("local_store", None, (flag, one), loc=self.loc)]

    def clear_test(self) -> tuple[list[Stmt], Stmt]:
        """Statements computing 'neither flag is set', and that value."""
        out: list[Stmt] = []
        flags = [f for f in (self.brk, self.cont) if f is not None]
        vals = [Stmt("local_load", i32, (f,), loc=self.loc) for f in flags]
        out += vals
        v = vals[0]
        for w in vals[1:]:
            v = Stmt("bit_or", i32, (v, w), loc=self.loc)
            out.append(v)
        ok = Stmt("logical_not", i32, (v,), loc=self.loc)
        out.append(ok)
        return out, ok


def _guard(block: Block, flags: _Flags) -> Block:
    out: Block = []
    for k, s in enumerate(block):
        if s.op == "break":
            out += flags.set(flags.brk)
            return out
        if s.op == "continue":
            out += flags.set(flags.cont)
            return out
        if s.op == "if" and any(_exits(b) for b in s.blocks):
            s.blocks = tuple(_guard(b, flags) for b in s.blocks)
            out.append(s)
            rest = _guard(block[k + 1:], flags)
            if rest:
                test, ok = flags.clear_test()
                out += test
                out.append(Stmt("if", None, (ok,), None, (rest, []), loc=s.loc))
            return out
        out.append(s)
    return out


def _zero_flag(loc) -> tuple[Stmt, list[Stmt]]:
    flag = Stmt("alloca", i32, loc=loc)
    zero = Stmt("const", i32, (), 0, loc=loc)
    return flag, [flag, zero, Stmt("local_store", None, (flag, zero), loc=loc)]


def structurize_loops(block: Block) -> Block:
    """``block`` with every loop's break/continue turned into guarded flag updates."""
    out: Block = []
    for s in block:
        for k, b in enumerate(s.blocks):
            s.blocks = s.blocks[:k] + (structurize_loops(b),) + s.blocks[k + 1:]
        if s.op not in ("range_for", "while"):
            out.append(s)
            continue
        body = s.blocks[0]
        exits = _exits(body)
        has_brk = any(x.op == "break" for x in _direct(body))
        has_cont = any(x.op == "continue" for x in _direct(body))
        if s.op == "range_for" and not exits:
            out.append(s)
            continue
        brk = cont = None
        if has_brk or s.op == "while":
            brk, init = _zero_flag(s.loc)
            out += init
        new_body: Block = []
        if has_cont:
            cont, init = _zero_flag(s.loc)
            new_body += init
        flags = _Flags(brk, cont, s.loc)
        guarded = _guard(body, flags) if exits else body
        if s.op == "while":
            test = Stmt("local_load", i32, (brk,), loc=s.loc)
            exit_if = Stmt("if", None, (test,), None, ([Stmt("break", None, loc=s.loc)], []),
                           loc=s.loc)
            s.blocks = ([test, exit_if] + new_body + guarded,)
            s.attr = 2  # the exit test: the first two statements of the body
        elif brk is not None:
            test, ok = _Flags(brk, None, s.loc).clear_test()
            s.blocks = (test + [Stmt("if", None, (ok,), None, (new_body + guarded, []),
                                     loc=s.loc)],)
        else:
            s.blocks = (new_body + guarded,)
        out.append(s)
    return out


def _direct(block: Block):
    """Statements of a loop body outside any inner loop."""
    for s in block:
        yield s
        if s.op == "if":
            for b in s.blocks:
                yield from _direct(b)


# ---------------------------------------------------------------------------------------------
# activity

def _forward_closure(body: Block, seed: Callable[[Stmt], bool | None],
                     initial: set[Stmt] | None = None) -> set[Stmt]:
    """The float statements reached forwards from those ``seed`` accepts (and from
    ``initial``, values defined outside ``body``), through operands and through locals (a local
    is reached when a reached value is stored into it). ``seed(s)`` returns True (reached),
    False (never reached) or None (reached if an operand is)."""
    stores: dict[Stmt, list[Stmt]] = {}
    stmts = list(walk(body))
    for s in stmts:
        if s.op in ("local_store", "local_atomic"):
            stores.setdefault(s.args[0], []).append(s.args[1])
    out: set[Stmt] = set(initial or ())
    changed = True
    while changed:
        changed = False
        for s in stmts:
            if s in out or s.dtype is None or not s.dtype.is_float:
                continue
            if s.op == "alloca":
                hit = any(v in out for v in stores.get(s, ()))
            elif s.op == "local_load":
                hit = s.args[0] in out
            else:
                hit = seed(s)
                if hit is None:
                    args = s.args[1:] if s.op == "select" else s.args
                    hit = any(a in out for a in args)
            if hit:
                out.add(s)
                changed = True
    return out


def carries_none(op: str) -> bool:
    """Values of ``op`` carry no derivative: its derivative is declared zero, or it is a
    structural op (loads, atomics' old values, ...) whose derivative the transforms seed."""
    return OPS[op].derivative in (NO_DERIVATIVE, STRUCTURAL)


def activity(body: Block, differentiable: Callable[[int], bool]) -> set[Stmt]:
    """Statements carrying derivatives: float values depending on a load from a buffer slot
    for which ``differentiable(slot)`` holds, and the locals they are stored in."""

    def seed(s: Stmt) -> bool | None:
        if s.op == "load":
            return differentiable(s.attr)
        return False if carries_none(s.op) else None

    return _forward_closure(body, seed)


def useful_activity(body: Block, differentiable: Callable[[int], bool]) -> set[Stmt]:
    """The statements a reverse pass gives adjoints: :func:`activity`'s (depending on a load
    from a slot ``differentiable`` accepts) whose derivative can also reach a store or atomic
    into such a slot (:func:`flows_into`), and the locals holding them. The adjoint of every
    other value is zero whatever the kernel computes."""
    stmts = list(walk(body))

    def sink(s: Stmt) -> bool:
        return s.op in ("store", "atomic") and differentiable(
            s.attr if s.op == "store" else s.attr[0])

    useful = flows_into(body, sink)
    useful |= {s.args[0] for s in stmts if s.op == "local_load" and s in useful}
    return activity(body, differentiable) & useful


def flows_into(body: Block, sink: Callable[[Stmt], bool]) -> set[Stmt]:
    """The statements whose derivative can reach a statement ``sink`` accepts: backwards from
    the sinks' derivative-carrying operands (a store's value, not its indices; a select's arms,
    not its condition; nothing through an op with no derivative), through locals."""
    stmts = list(walk(body))
    stored: dict[Stmt, list[Stmt]] = {}
    for s in stmts:
        if s.op in ("local_store", "local_atomic"):
            stored.setdefault(s.args[0], []).append(s.args[1])
    out: set[Stmt] = set()
    work = [s.args[-1] for s in stmts if sink(s) and s.args]
    while work:
        s = work.pop()
        if s in out:
            continue
        out.add(s)
        if s.op == "local_load":
            work += stored.get(s.args[0], ())
        elif not carries_none(s.op):
            work += s.args[1:] if s.op == "select" else s.args
    return out


#: Below this lower bound a positive value does not count as safely away from zero.
_SAFE_BOUND = 1e-6


def lower_bounds(body: Block) -> dict[Stmt, float]:
    """Proven lower bounds ``>= 0`` of float values: squares (``r.dot(r)``), sums of such and
    positive constants, their square roots, ``exp``, ``abs``. This is what ``norm(eps)`` gives:
    ``sqrt(r.dot(r) + eps) >= sqrt(eps)``, so its reciprocal and derivatives are finite and need
    no zero-seed guard (the N-body, spring and MPM kernels are full of them)."""
    out: dict[Stmt, float] = {}

    def visit(block: Block) -> None:
        last_store: dict[Stmt, int] = {}  # alloca -> position of its latest store here
        loaded: dict[Stmt, tuple[Stmt, int]] = {}  # local_load -> (alloca, store epoch)
        for k, s in enumerate(block):
            for b in s.blocks:
                visit(b)
            if s.blocks:
                for a in _written_in(s):
                    last_store[a] = k
            op = s.op
            if op in ("local_store", "local_atomic"):
                last_store[s.args[0]] = k
            elif op == "local_load":
                loaded[s] = (s.args[0], last_store.get(s.args[0], -1))
            if s.dtype is None or not s.dtype.is_float:
                continue
            lb = None
            if op == "const":
                lb = s.attr if s.attr >= 0 else None
            elif op == "mul":
                a, b = s.args
                if a is b or (a in loaded and loaded.get(b) == loaded[a]):
                    lb = 0.0  # a square
                elif a in out and b in out:
                    lb = out[a] * out[b]
            elif op == "add":
                a, b = s.args
                if a in out and b in out:
                    lb = out[a] + out[b]
            elif op == "sqrt" and s.args[0] in out:
                lb = out[s.args[0]] ** 0.5
            elif op in ("exp", "abs"):
                lb = 0.0
            elif op == "cast" and s.args[0] in out:
                lb = out[s.args[0]]
            if lb is not None:
                out[s] = float(lb)

    visit(body)
    return out


def _written_in(s: Stmt) -> set[Stmt]:
    return {x.args[0] for b in s.blocks for x in walk(b)
            if x.op in ("local_store", "local_atomic")}


def finite_partials(s: Stmt, bounds: dict[Stmt, float]) -> bool:
    """Is a :data:`~.rules.RISKY` op's value and partial finite for finite operands here,
    because the operand it divides by is bounded away from zero?"""
    op = s.op
    if op in ("sqrt", "rsqrt", "log"):
        return bounds.get(s.args[0], 0.0) >= _SAFE_BOUND
    if op == "div":
        return bounds.get(s.args[1], 0.0) >= _SAFE_BOUND
    return False


def maybe_nonfinite(body: Block) -> set[Stmt]:
    """Values that can be infinite or NaN although every field holds finite numbers: results of
    the :data:`~.rules.RISKY` ops and everything computed from them. Only partials involving
    these need the zero-seed guard (which costs a compare and a select per use)."""
    # Function-level: the rule table (~4 ms of import) loads with the first derivative, not
    # with `import difftape` (which loads this module for lost-derivative checks).
    from .rules import RISKY

    bounds = lower_bounds(body)

    def seed(s: Stmt) -> bool | None:
        if s.op in ("load", "const", "arg"):
            return False
        return True if s.op in RISKY and not finite_partials(s, bounds) else None

    return _forward_closure(body, seed)


def feeds_selection(body: Block) -> set[Stmt]:
    """Values whose adjoint can be an exact zero manufactured by a selection: those flowing
    (through any chain of operations and locals) into an arm of ``select``/``min``/``max``. The
    arm not taken receives a zero seed, and only there can ``0 * inf`` arise."""
    users: dict[Stmt, list[Stmt]] = {}
    loads: dict[Stmt, list[Stmt]] = {}
    stmts = list(walk(body))
    for s in stmts:
        if s.op == "local_load":
            loads.setdefault(s.args[0], []).append(s)
        for a in s.args:
            users.setdefault(a, []).append(s)
    out: set[Stmt] = set()
    work = [a for s in stmts if s.op in ("select", "min", "max")
            for a in (s.args[1:] if s.op == "select" else s.args)]
    while work:
        s = work.pop()
        if s in out or s.dtype is None or not s.dtype.is_float:
            continue
        out.add(s)
        if s.op == "alloca":
            continue
        if s.op == "local_load":
            a = s.args[0]
            work += [st.args[1] for st in users.get(a, ()) if st.op in ("local_store",
                                                                         "local_atomic")]
            continue
        work += [a for a in s.args if a.dtype is not None and a.dtype.is_float]
    return out


# ---------------------------------------------------------------------------------------------
# locals used by regions

def local_sets(body: Block) -> tuple[dict[Stmt, list[Stmt]], dict[Stmt, list[Stmt]]]:
    """For each control statement: (locals from outside it that it reads or writes, those it
    writes), each in a fixed order."""
    accessed: dict[Stmt, list[Stmt]] = {}
    written: dict[Stmt, list[Stmt]] = {}

    def visit(s: Stmt) -> tuple[set, set, set]:
        """(declared inside, accessed, written) for s including its blocks."""
        decl: set = set()
        acc: set = set()
        wr: set = set()
        for b in s.blocks:
            for x in b:
                d, a, w = visit(x)
                decl |= d
                acc |= a
                wr |= w
        if s.op == "alloca":
            decl.add(s)
        elif s.op == "local_load":
            acc.add(s.args[0])
        elif s.op in ("local_store", "local_atomic"):
            acc.add(s.args[0])
            wr.add(s.args[0])
        if s.blocks:
            accessed[s] = sorted(acc - decl, key=lambda x: x.uid)
            written[s] = sorted(wr - decl, key=lambda x: x.uid)
        return decl, acc, wr

    for s in body:
        visit(s)
    return accessed, written
