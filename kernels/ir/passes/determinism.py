"""Deterministic schedules: ``ti.init(deterministic=True)``.

By default a parallel loop's result can depend on timing: chunks run on whichever thread
claims them, floating-point atomic adds land in whatever order threads reach them, and the
per-chunk partial sums of ``reduce.py`` and ``scatter.py`` are added into their targets as
chunks finish. Floating-point addition is not associative, so gradients (whose scatters are
all such adds) differ in the last bits from run to run and with the thread count, and chaotic
simulations amplify that.

Under ``deterministic=True`` this pass, the last of the pipeline, gives every range task one of
three schedules (``Task.schedule``):

- ``"any"``: nothing in the task depends on the order of iterations or on the chunking (plain
  loads and stores, owned-element updates, integer atomics whose values are not read), so it
  runs exactly as by default, at full speed.
- ``"ordered"``: the body is order-free, but the epilogue adds per-chunk partial results
  (privatized reductions and scatters) into shared floats. The chunk boundaries are then fixed
  by the range and the task's weight alone (``frontend/kernel.py``, ``deterministic_chunk``),
  never by the thread count or the inline/threaded choice, and each chunk's epilogue waits for
  the previous chunk's (a ticket in the launch context): partial sums are combined in chunk
  order. Chunks still run in parallel; only the short epilogues are serialized.
- ``"serial"``: the body itself is order-sensitive: a floating-point atomic that could not be
  privatized (a scatter into a buffer larger than ``scatter.MAX_ELEMENTS``, an ndarray, a
  min/max, any ``atomic_mul``: float products round differently in another order), an atomic
  whose old value is used, a buffer both updated atomically and read, atomics of kinds that do
  not commute with each other, or ``ti.random()`` (whose state is per thread). The whole range
  then runs as one chunk on the calling thread in index order: the same as one thread, whatever
  the thread count. This is the price of determinism for such loops (e.g. an MPM particle-to-
  grid transfer); see the README for measurements.

No floating-point atomic whose order can vary remains: the ones left run in a serial task or,
in an ordered epilogue, one chunk at a time in chunk order (lowered as plain read-modify-writes).
"""

from __future__ import annotations

from collections import defaultdict

from ..nodes import KernelIR, Stmt, Task, walk
from .reduce import _slot

#: Atomic kinds that commute with each other, by class: integer adds and subtracts may be
#: reordered freely, but an add and a max may not.
_CLASS = {"add": "add", "sub": "add", "mul": "mul", "min": "min", "max": "max",
          "bit_and": "and", "bit_or": "or", "bit_xor": "xor"}


def order_sensitive(t: Task) -> bool:
    """Can the result of ``t``'s body depend on the order its iterations run in (given that
    distinct iterations' plain stores do not collide, which would be a race in any mode)?"""
    used = {a for s in walk(t.body) for a in s.args}
    kinds: dict[tuple, set[str]] = defaultdict(set)
    other: set[tuple] = set()
    for s in walk(t.body):
        if s.op == "random":
            return True
        slot = _slot(s)
        if slot is None:
            continue
        if s.op in ("atomic", "temp_atomic"):
            if s.dtype.is_float or s in used:
                return True
            kinds[slot].add(_CLASS[s.attr[1]])
        else:
            other.add(slot)
    return any(len(k) > 1 or slot in other for slot, k in kinds.items())


def _float_commit(s: Stmt) -> bool:
    return s.op in ("atomic", "temp_atomic") and s.dtype.is_float


def schedule_deterministically(ir: KernelIR) -> KernelIR:
    if not ir.deterministic:
        return ir
    for t in ir.tasks or []:
        if t.kind != "range":
            continue
        if order_sensitive(t):
            t.schedule = "serial"
        elif any(_float_commit(s) for s in walk(t.epilogue)):
            t.schedule = "ordered"
    return ir
