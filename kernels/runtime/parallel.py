"""A persistent pool of worker threads that run compiled task chunks, scheduled natively.

Each worker is a Python thread that calls one compiled function, ``dt_worker``, and stays in
it (ctypes releases the GIL for the call) until the pool closes. A launch, ``dt_run``, writes
the task into a small shared job record, publishes it by bumping a generation number, takes
chunks itself and spins until every chunk has run. Workers claim chunks with a compare-and-swap
on a counter that carries the generation in its high half, so a worker that wakes late can
never run a chunk of a newer job with an older job's function. Between launches workers spin
briefly, then yield the core to other threads for a while (launches in a simulation loop come
back to back; on a busy machine a spinning worker must not steal the caller's core), then nap
0.5 ms at a time. The caller never waits for a worker to wake: it takes chunks itself, so a sleeping
worker only means less help for one launch.

Waking Python threads through events and the GIL cost ~50 us per launch on this machine;
this costs a few microseconds, which matters for kernels that themselves take ~100 us.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import threading

import numpy as np

from ..codegen import get_target
from . import cache

# The job record: int64 slots.
GEN, FN, CTX, BEGIN, END, CHUNK, NEXT, FINISHED, TOTAL, STOP = range(10)

_SOURCE = r"""
declare void @llvm.x86.sse2.pause()
declare i32 @dt_usleep(i32)
declare i32 @dt_yield()

define internal void @chunks(ptr %job, i64 %gen, i32 %tid) {
entry:
  %fnp = getelementptr i64, ptr %job, i64 1
  %fni = load i64, ptr %fnp
  %fn = inttoptr i64 %fni to ptr
  %ctxp = getelementptr i64, ptr %job, i64 2
  %ctx = load i64, ptr %ctxp
  %ctxptr = inttoptr i64 %ctx to ptr
  %bp = getelementptr i64, ptr %job, i64 3
  %begin = load i64, ptr %bp
  %ep = getelementptr i64, ptr %job, i64 4
  %end = load i64, ptr %ep
  %cp = getelementptr i64, ptr %job, i64 5
  %chunk = load i64, ptr %cp
  %nextp = getelementptr i64, ptr %job, i64 6
  %finp = getelementptr i64, ptr %job, i64 7
  %tag = shl i64 %gen, 32
  br label %claim
claim:
  %cur = load atomic i64, ptr %nextp seq_cst, align 8
  %hi = and i64 %cur, -4294967296
  %same = icmp eq i64 %hi, %tag
  br i1 %same, label %try, label %done
try:
  %k = and i64 %cur, 4294967295
  %b0 = mul i64 %k, %chunk
  %b = add i64 %begin, %b0
  %more = icmp slt i64 %b, %end
  br i1 %more, label %cas, label %done
cas:
  %nk = add i64 %cur, 1
  %r = cmpxchg ptr %nextp, i64 %cur, i64 %nk seq_cst seq_cst
  %ok = extractvalue { i64, i1 } %r, 1
  br i1 %ok, label %run, label %claim
run:
  %e0 = add i64 %b, %chunk
  %lt = icmp slt i64 %e0, %end
  %e = select i1 %lt, i64 %e0, i64 %end
  call void %fn(ptr %ctxptr, i64 %b, i64 %e, i32 %tid)
  %f = atomicrmw add ptr %finp, i64 1 seq_cst
  br label %claim
done:
  ret void
}

define void @dt_worker(ptr %job, i64 %tid64) {
entry:
  %tid = trunc i64 %tid64 to i32
  %genp = getelementptr i64, ptr %job, i64 0
  %stopp = getelementptr i64, ptr %job, i64 9
  %g0 = load atomic i64, ptr %genp seq_cst, align 8
  br label %wait
wait:
  %seen = phi i64 [ %g0, %entry ], [ %seen, %cpu_pause ], [ %seen, %yield ], [ %seen, %nap ],
                [ %g, %got ]
  %spins = phi i64 [ 0, %entry ], [ %spins1, %cpu_pause ], [ %spins1, %yield ],
                 [ %spins1, %nap ], [ 0, %got ]
  %stop = load atomic i64, ptr %stopp seq_cst, align 8
  %quit = icmp ne i64 %stop, 0
  br i1 %quit, label %exit, label %poll
poll:
  %g = load atomic i64, ptr %genp seq_cst, align 8
  %new = icmp ne i64 %g, %seen
  br i1 %new, label %got, label %idle
got:
  call void @chunks(ptr %job, i64 %g, i32 %tid)
  br label %wait
idle:
  %spins1 = add i64 %spins, 1
  %long = icmp ugt i64 %spins1, 20000
  br i1 %long, label %nap, label %pause
pause:
  %short = icmp ult i64 %spins1, 2000
  br i1 %short, label %cpu_pause, label %yield
cpu_pause:
  call void @llvm.x86.sse2.pause()
  br label %wait
yield:
  %y = call i32 @dt_yield()
  br label %wait
nap:
  %z = call i32 @dt_usleep(i32 500)
  br label %wait
exit:
  ret void
}

define void @dt_serial(i64 %fn, i64 %ctx, i64 %begin, i64 %end, i64 %chunk) {
entry:
  %f = inttoptr i64 %fn to ptr
  %c = inttoptr i64 %ctx to ptr
  br label %loop
loop:
  %b = phi i64 [ %begin, %entry ], [ %e, %loop ]
  %e0 = add i64 %b, %chunk
  %lt = icmp slt i64 %e0, %end
  %e = select i1 %lt, i64 %e0, i64 %end
  call void %f(ptr %c, i64 %b, i64 %e, i32 0)
  %more = icmp slt i64 %e, %end
  br i1 %more, label %loop, label %exit
exit:
  ret void
}

define void @dt_run(ptr %job, i64 %fn, i64 %ctx, i64 %begin, i64 %end, i64 %chunk,
                    i64 %total) {
entry:
  %genp = getelementptr i64, ptr %job, i64 0
  %g = load atomic i64, ptr %genp seq_cst, align 8
  %g1 = add i64 %g, 1
  %fnp = getelementptr i64, ptr %job, i64 1
  store i64 %fn, ptr %fnp
  %ctxp = getelementptr i64, ptr %job, i64 2
  store i64 %ctx, ptr %ctxp
  %bp = getelementptr i64, ptr %job, i64 3
  store i64 %begin, ptr %bp
  %ep = getelementptr i64, ptr %job, i64 4
  store i64 %end, ptr %ep
  %cp = getelementptr i64, ptr %job, i64 5
  store i64 %chunk, ptr %cp
  %nextp = getelementptr i64, ptr %job, i64 6
  %tag = shl i64 %g1, 32
  store atomic i64 %tag, ptr %nextp seq_cst, align 8
  %finp = getelementptr i64, ptr %job, i64 7
  store atomic i64 0, ptr %finp seq_cst, align 8
  store atomic i64 %g1, ptr %genp seq_cst, align 8
  call void @chunks(ptr %job, i64 %g1, i32 0)
  br label %wait
wait:
  %n = phi i64 [ 0, %entry ], [ %n1, %spin ], [ %n1, %yield ]
  %f = load atomic i64, ptr %finp seq_cst, align 8
  %all = icmp sge i64 %f, %total
  br i1 %all, label %exit, label %next
next:
  %n1 = add i64 %n, 1
  %short = icmp ult i64 %n1, 2000
  br i1 %short, label %spin, label %yield
spin:
  call void @llvm.x86.sse2.pause()
  br label %wait
yield:
  %y = call i32 @dt_yield()
  br label %wait
exit:
  ret void
}
"""


@functools.cache
def _native():
    """Compile the scheduler once per process: (engine, worker fn, run fn, serial fn)."""
    import llvmlite.binding as llvm

    target = get_target()
    libc = ctypes.CDLL(None)
    llvm.add_symbol("dt_usleep", ctypes.cast(libc.usleep, ctypes.c_void_p).value)
    llvm.add_symbol("dt_yield", ctypes.cast(libc.sched_yield, ctypes.c_void_p).value)
    source = _SOURCE
    if not target.triple.startswith(("x86_64", "i686", "i386")):  # no `pause` elsewhere
        source = source.replace("declare void @llvm.x86.sse2.pause()\n", "").replace(
            "  call void @llvm.x86.sse2.pause()\n", "")
    text = f'target triple = "{target.triple}"\n' + source
    key = hashlib.sha256((text + target.fingerprint).encode()).hexdigest()
    directory = cache.cache_dir()
    obj = cache.load(key, directory)
    if obj is None:  # compiled once per machine, then loaded from the disk cache
        obj = target.compile(text)
        cache.store(key, obj, directory)
    engine, names = target.load(obj, ["dt_worker", "dt_run", "dt_serial"])
    worker = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64)(names["dt_worker"])
    run = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                           ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                           ctypes.c_int64)(names["dt_run"])
    serial = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                              ctypes.c_int64, ctypes.c_int64)(names["dt_serial"])
    return engine, worker, run, serial


class ThreadPool:
    def __init__(self, num_threads: int) -> None:
        self.num_threads = num_threads
        self._job = np.zeros(16, dtype=np.int64)
        self._job_addr = self._job.ctypes.data
        self._engine, worker, self._run, self._serial = _native()
        self._workers = [threading.Thread(target=worker, args=(self._job_addr, k + 1),
                                          daemon=True, name=f"difftape-worker-{k + 1}")
                         for k in range(num_threads - 1)]
        for w in self._workers:
            w.start()

    def run(self, fn, ctx: int, begin: int, end: int, chunks_per_thread: int = 4) -> None:
        """Run ``fn(ctx, b, e, tid)`` over [begin, end) split into chunks, on all threads."""
        n = end - begin
        if self.num_threads == 1 or n <= 1:
            fn(ctx, begin, end, 0)
            return
        chunk = max(1, -(-n // (self.num_threads * chunks_per_thread)))
        total = -(-n // chunk)
        addr = ctypes.cast(fn, ctypes.c_void_p).value
        self._run(self._job_addr, addr, ctx, begin, end, chunk, total)

    def run_chunks(self, fn, ctx: int, begin: int, end: int, chunk: int,
                   threaded: bool = True) -> None:
        """Run ``fn`` over [begin, end) in chunks of exactly ``chunk`` indices (the last one
        shorter), whatever the thread count: an ordered task's results depend on its chunk
        boundaries. Not ``threaded`` (small work) or on one thread: the chunks in order on
        the calling thread."""
        addr = ctypes.cast(fn, ctypes.c_void_p).value
        if threaded and self.num_threads > 1:
            self._run(self._job_addr, addr, ctx, begin, end, chunk, -(-(end - begin) // chunk))
        else:
            self._serial(addr, ctx, begin, end, chunk)

    def close(self) -> None:
        self._job[STOP] = 1
        for w in self._workers:
            w.join(timeout=1.0)
