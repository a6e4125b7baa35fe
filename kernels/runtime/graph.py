"""The native side of a captured graph (``ti.graph``): launch records and their runner.

A graph is a flat array of fixed-size records, one per task of each captured launch and one
per captured fill or copy, run in order by one native call (``ThreadPool.run_graph``, the
loop ``dt_run_graph`` in :mod:`.parallel`). Each record names a task-shaped function
``fn(ctx, begin, end, tid)``, the launch context it runs with (the graph's own copy, packed
when the launch was captured) and how its index range is found:

- ``SERIAL``: a serial task, called once as ``fn(ctx, 0, 0, 0)``;
- ``BOUNDS``: a range task whose ``bounds(ctx, out)`` computes [begin, end) from the context
  (so a scalar bound as a graph input changes the range at replay);
- ``STATIC``: a fixed [begin, end) (fills and copies over a known number of bytes/elements).

and how it is split (``WEIGHT``, ``SCHEDULE``: the task's weight and schedule code, as the
Python launcher's ``_ANY``/``_SERIAL``/``_ORDERED``). ``ERR`` is the address of the context's
error word (0: none); the runner stops at the first record that sets it.

Fills and copies are tasks of :func:`host_ops`: ``fill`` repeats a ``k``-byte pattern over
elements [begin, end) (its context: destination, pattern, k), ``copy`` copies bytes [begin,
end) (context: destination, source), ``zero`` zeroes bytes [begin, end) (context:
destination).
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np

from ..codegen import get_target
from . import cache

#: Record layout (int64 slots).
FN, CTX, KIND, BOUNDS, WEIGHT, SCHEDULE, BEGIN, END, ERR = range(9)
RECORD_SLOTS = 10
SERIAL, RANGE, STATIC = 0, 1, 2  # KIND
#: Schedule codes the runner knows (those of frontend/kernel.py's launcher).
ANY, SERIAL_SCHEDULE, ORDERED, WHOLE = 0, 1, 2, 3

_OPS = r"""
declare void @llvm.memcpy.p0.p0.i64(ptr, ptr, i64, i1)
declare void @llvm.memset.p0.i64(ptr, i8, i64, i1)

define void @dt_graph_fill(ptr %ctx, i64 %b, i64 %e, i32 %tid) {
entry:
  %dsti = load i64, ptr %ctx
  %dst = inttoptr i64 %dsti to ptr
  %pp = getelementptr i64, ptr %ctx, i64 1
  %pati = load i64, ptr %pp
  %pat = inttoptr i64 %pati to ptr
  %kp = getelementptr i64, ptr %ctx, i64 2
  %k = load i64, ptr %kp
  %any = icmp slt i64 %b, %e
  br i1 %any, label %loop, label %exit
loop:
  %i = phi i64 [ %b, %entry ], [ %i1, %loop ]
  %off = mul i64 %i, %k
  %p = getelementptr i8, ptr %dst, i64 %off
  call void @llvm.memcpy.p0.p0.i64(ptr %p, ptr %pat, i64 %k, i1 false)
  %i1 = add i64 %i, 1
  %more = icmp slt i64 %i1, %e
  br i1 %more, label %loop, label %exit
exit:
  ret void
}

define void @dt_graph_zero(ptr %ctx, i64 %b, i64 %e, i32 %tid) {
entry:
  %dsti = load i64, ptr %ctx
  %dst = inttoptr i64 %dsti to ptr
  %d = getelementptr i8, ptr %dst, i64 %b
  %n = sub i64 %e, %b
  call void @llvm.memset.p0.i64(ptr %d, i8 0, i64 %n, i1 false)
  ret void
}

define void @dt_graph_copy(ptr %ctx, i64 %b, i64 %e, i32 %tid) {
entry:
  %dsti = load i64, ptr %ctx
  %dst = inttoptr i64 %dsti to ptr
  %sp = getelementptr i64, ptr %ctx, i64 1
  %srci = load i64, ptr %sp
  %src = inttoptr i64 %srci to ptr
  %d = getelementptr i8, ptr %dst, i64 %b
  %s = getelementptr i8, ptr %src, i64 %b
  %n = sub i64 %e, %b
  call void @llvm.memcpy.p0.p0.i64(ptr %d, ptr %s, i64 %n, i1 false)
  ret void
}
"""


@functools.cache
def host_ops() -> dict[str, int]:
    """Addresses of the graph's own tasks: ``fill``, ``copy`` and ``zero`` (compiled once per
    machine, then loaded from the disk cache)."""
    target = get_target()
    text = f'target triple = "{target.triple}"\n' + _OPS
    key = hashlib.sha256((text + target.fingerprint).encode()).hexdigest()
    directory = cache.cache_dir()
    obj = cache.load(key, directory)
    if obj is None:
        obj = target.compile(text)
        cache.store(key, obj, directory)
    names_ = ["dt_graph_fill", "dt_graph_copy", "dt_graph_zero"]
    engine, names = target.load(obj, names_)
    _keep.append(engine)
    return {n[len("dt_graph_"):]: names[n] for n in names_}


_keep: list = []  # the loaded code of host_ops (lives as long as the process)


def policy(num_threads: int, inline_work: int, deterministic_chunks: int,
           min_chunk_work: int, chunks_per_thread: int, pool_min_chunk_work: int
           ) -> np.ndarray:
    """How the runner splits ranges: the same numbers the Python launcher uses (ordered
    tasks: ``deterministic_chunk``'s; the others: ``ThreadPool.run``'s)."""
    return np.array([num_threads, inline_work, deterministic_chunks, min_chunk_work,
                     chunks_per_thread, pool_min_chunk_work], dtype=np.int64)


def records(rows: list[tuple[int, ...]]) -> np.ndarray:
    """The record array for ``rows`` of (fn, ctx, kind, bounds, weight, schedule, begin, end,
    err) addresses and numbers."""
    out = np.zeros((max(1, len(rows)), RECORD_SLOTS), dtype=np.int64)
    for k, row in enumerate(rows):
        out[k, :len(row)] = row
    return out
