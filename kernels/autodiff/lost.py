"""Derivatives lost through storage that has no derivative companion.

Derivatives flow only through storage that holds them: a field's ``.dual`` in forward mode, its
``.grad`` in reverse mode. A value computed from a differentiated input and written to a float
field without that storage loses its derivative there (Taichi does the same). That is right
for a diagnostic (a log, a maximum) that never reaches the loss, but when a later kernel reads
the field into a differentiated result, the result's derivative silently misses that path.

Allocating the storage up front (as ``ti.ad.jvp`` does) is no general cure: whether a field is
a diagnostic is known only once a later kernel reads it, and giving a diagnostic target
derivative storage would refuse, for instance, an ``atomic_max`` into it. So the runtime
tracks, during one ``FwdMode`` or ``Tape``, which storage holds values whose derivative was
dropped, and refuses a launch that reads such storage into a differentiated result, naming the
field and the fix. The analysis (:func:`lost_flow`) is a pure function of a kernel's IR and the
storage that exists, so the local runtime and the remote client share it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..errors import GradientRuleError
from ..ir.nodes import Block, Buffer, KernelIR, Loc, Stmt, walk
from .rules import rule_error
from .structure import activity, flows_into

#: What each mode calls its storage, and how to allocate it.
_STORAGE = {"forward": ("dual storage", "needs_dual=True", "ti.root.lazy_dual()"),
            "reverse": ("gradient storage", "needs_grad=True", "ti.root.lazy_grad()")}


@dataclass(frozen=True)
class Access:
    """A store (of a value carrying a derivative) to, or a load (whose value would reach a
    differentiated result) from, storage without derivative storage."""

    key: tuple  # Buffer.key
    name: str
    loc: Loc | None


@dataclass(frozen=True)
class Flow:
    """Of one kernel: ``drops`` (stores that lose a derivative), ``needs`` (loads that would
    carry one into a differentiated result) and ``inner`` (a need after a drop of the same
    storage in the kernel itself: lost within one launch)."""

    drops: tuple[Access, ...] = ()
    needs: tuple[Access, ...] = ()
    inner: Access | None = None

    @property
    def empty(self) -> bool:
        return not self.drops and not self.needs and self.inner is None


NO_FLOW = Flow()


def _carrying_loop(s: Stmt) -> bool:
    """A loop whose iterations may read what earlier ones wrote (not a parallel loop, where
    that would be a race)."""
    return s.op == "while" or (s.op == "range_for" and s.attr[1] != "parallel")


def _positions(block: Block, loops: tuple = (), out: dict | None = None) -> dict:
    """Statement -> (program-order position, enclosing carrying loops)."""
    out = {} if out is None else out
    for s in block:
        out[s] = (len(out), loops)
        if s.blocks:
            inner = loops + (s,) if _carrying_loop(s) else loops
            for b in s.blocks:
                _positions(b, inner, out)
    return out


def lost_flow(ir: KernelIR, has: Callable[[Buffer], bool]) -> Flow:
    """Which of ``ir``'s float buffers without derivative storage (``has`` false) receive
    values carrying a derivative, and which are read into a differentiated result (a store to
    a buffer with storage). ``ir`` is the kernel's IR before differentiation; not modified."""
    bufs = ir.buffers
    carrying = [b.dtype.is_float and has(b) for b in bufs]
    bare = [b.dtype.is_float and not has(b) for b in bufs]
    if not any(bare) or not any(carrying):
        return NO_FLOW

    def slot(s: Stmt) -> int:
        return s.attr if s.op in ("load", "store") else s.attr[0]

    body = ir.body
    active = activity(body, lambda k: carrying[k])
    drops = [s for s in walk(body) if s.op in ("store", "atomic") and bare[slot(s)]
             and s.args[-1] in active]
    needed = flows_into(body, lambda s: s.op in ("store", "atomic") and carrying[slot(s)])
    needs = [s for s in walk(body) if s.op == "load" and bare[s.attr] and s in needed]
    if not drops and not needs:
        return NO_FLOW

    def access(s: Stmt) -> Access:
        b = bufs[slot(s)]
        return Access(b.key, b.name, s.loc)

    inner = None
    if drops and needs:
        pos = _positions(body)
        for load in needs:
            at, loops = pos[load]
            for st in drops:
                if slot(st) != load.attr:
                    continue
                st_at, st_loops = pos[st]
                if st_at < at or set(loops) & set(st_loops):
                    inner = access(load)
                    break
            if inner is not None:
                break
    return Flow(_unique(access(s) for s in drops), _unique(access(s) for s in needs), inner)


def _unique(accesses) -> tuple[Access, ...]:
    """One access per storage (the first in program order)."""
    out: dict[tuple, Access] = {}
    for a in accesses:
        out.setdefault(a.key, a)
    return tuple(out.values())


class LostTracker:
    """During one ``FwdMode`` (``mode="forward"``) or ``Tape`` (``"reverse"``): the storage
    holding values whose derivative was dropped, and the kernel that wrote them. Storage stays
    marked until the block ends (a later write may cover only part of it)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.lost: dict[tuple, tuple[str, str]] = {}  # storage -> (its name, the writer)
        self._keep: list = []  # ndarray arguments marked by identity, kept alive

    def _storage(self, key: tuple, args: tuple) -> tuple:
        if key[0] == "ndarray":  # ("ndarray", argument index, role): the argument itself
            a = args[key[1]]
            self._keep.append(a)
            return ("ndarray", id(a), key[2])
        return key

    def launch(self, kernel: str, flow: Flow, args: tuple) -> None:
        """Before ``kernel`` runs (or is recorded) with ``args``: refuse it if it reads lost
        derivatives into a differentiated result, else mark what it drops."""
        if flow.inner is not None:
            a = flow.inner
            raise self._error(kernel, a, f"kernel '{kernel}' writes values computed from "
                                         f"differentiated inputs to '{a.name}', which has no "
                                         f"{_STORAGE[self.mode][0]}, and then reads them")
        if self.lost:
            for a in flow.needs:
                hit = self.lost.get(self._storage(a.key, args))
                if hit is not None:
                    raise self._error(kernel, a, f"kernel '{hit[1]}' wrote values computed "
                                                 f"from differentiated inputs to '{a.name}', "
                                                 f"which has no {_STORAGE[self.mode][0]}, and "
                                                 f"kernel '{kernel}' reads them")
        for a in flow.drops:
            self.lost[self._storage(a.key, args)] = (a.name, kernel)

    def _error(self, kernel: str, a: Access, what: str) -> GradientRuleError:
        storage, flag, lazy = _STORAGE[self.mode]
        where = "the FwdMode block" if self.mode == "forward" else "the Tape"
        msg = (f"{what} into a differentiated result: their derivative was lost in "
               f"'{a.name}', so the result's derivative would miss that path. Create "
               f"'{a.name}' with {flag} (or call {lazy} before {where}); if the path should "
               "carry no derivative, write it through ti.stop_grad(...) or from a "
               "@ti.ad.no_grad kernel")
        return rule_error(msg, kernel, a.loc)
