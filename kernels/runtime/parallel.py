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

A captured graph (``ti.graph``) runs all its launches through ``dt_run_graph``: one native
loop over launch records that splits each range as a Python launch would and calls ``dt_run``
per launch, so a replay costs no Python per launch.

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

define i64 @dt_run_graph(ptr %job, ptr %recs, i64 %n, ptr %policy) {
entry:
  %out = alloca [2 x i64]
  %nth = load i64, ptr %policy
  %p1 = getelementptr i64, ptr %policy, i64 1
  %inline = load i64, ptr %p1
  %p2 = getelementptr i64, ptr %policy, i64 2
  %detc = load i64, ptr %p2
  %p3 = getelementptr i64, ptr %policy, i64 3
  %minw = load i64, ptr %p3
  %p4 = getelementptr i64, ptr %policy, i64 4
  %cpt = load i64, ptr %p4
  %multi = icmp sgt i64 %nth, 1
  %has = icmp sgt i64 %n, 0
  br i1 %has, label %rec, label %finish
rec:
  %k = phi i64 [ 0, %entry ], [ %k1, %next ]
  %r = mul i64 %k, 10
  %rp = getelementptr i64, ptr %recs, i64 %r
  %fni = load i64, ptr %rp
  %fn = inttoptr i64 %fni to ptr
  %cp = getelementptr i64, ptr %rp, i64 1
  %ctxi = load i64, ptr %cp
  %ctx = inttoptr i64 %ctxi to ptr
  %kp = getelementptr i64, ptr %rp, i64 2
  %kind = load i64, ptr %kp
  %isserial = icmp eq i64 %kind, 0
  br i1 %isserial, label %serial_task, label %ranged
serial_task:
  call void %fn(ptr %ctx, i64 0, i64 0, i32 0)
  br label %check
ranged:
  %isbounds = icmp eq i64 %kind, 1
  br i1 %isbounds, label %call_bounds, label %static
call_bounds:
  %bdp = getelementptr i64, ptr %rp, i64 3
  %bdi = load i64, ptr %bdp
  %bd = inttoptr i64 %bdi to ptr
  call void %bd(ptr %ctx, ptr %out)
  %b1 = load i64, ptr %out
  %o1 = getelementptr i64, ptr %out, i64 1
  %e1 = load i64, ptr %o1
  br label %have_range
static:
  %sbp = getelementptr i64, ptr %rp, i64 6
  %b2 = load i64, ptr %sbp
  %sep = getelementptr i64, ptr %rp, i64 7
  %e2 = load i64, ptr %sep
  br label %have_range
have_range:
  %b = phi i64 [ %b1, %call_bounds ], [ %b2, %static ]
  %e = phi i64 [ %e1, %call_bounds ], [ %e2, %static ]
  %empty = icmp sle i64 %e, %b
  br i1 %empty, label %check, label %nonempty
nonempty:
  %cnt = sub i64 %e, %b
  %wp = getelementptr i64, ptr %rp, i64 4
  %w = load i64, ptr %wp
  %work = mul i64 %cnt, %w
  %sp = getelementptr i64, ptr %rp, i64 5
  %sched = load i64, ptr %sp
  %ordered = icmp eq i64 %sched, 2
  br i1 %ordered, label %ord, label %unord
ord:
  %c1a = add i64 %cnt, %detc
  %c1b = sub i64 %c1a, 1
  %c1 = sdiv i64 %c1b, %detc
  %c2a = add i64 %minw, %w
  %c2b = sub i64 %c2a, 1
  %c2 = sdiv i64 %c2b, %w
  %cgt = icmp sgt i64 %c1, %c2
  %chunk = select i1 %cgt, i64 %c1, i64 %c2
  %whole = icmp sge i64 %chunk, %cnt
  br i1 %whole, label %inline_run, label %ord_split
ord_split:
  %big = icmp sge i64 %work, %inline
  %thr = and i1 %big, %multi
  br i1 %thr, label %ord_pool, label %ord_serial
ord_pool:
  %t1a = add i64 %cnt, %chunk
  %t1b = sub i64 %t1a, 1
  %tot1 = sdiv i64 %t1b, %chunk
  call void @dt_run(ptr %job, i64 %fni, i64 %ctxi, i64 %b, i64 %e, i64 %chunk, i64 %tot1)
  br label %check
ord_serial:
  call void @dt_serial(i64 %fni, i64 %ctxi, i64 %b, i64 %e, i64 %chunk)
  br label %check
unord:
  %small = icmp slt i64 %work, %inline
  %single = icmp eq i64 %sched, 1
  %one = icmp sle i64 %cnt, 1
  %nomulti = xor i1 %multi, true
  %s1 = or i1 %small, %single
  %s2 = or i1 %s1, %one
  %s3 = or i1 %s2, %nomulti
  br i1 %s3, label %inline_run, label %pool
pool:
  %slots = mul i64 %nth, %cpt
  %q1 = add i64 %cnt, %slots
  %q2 = sub i64 %q1, 1
  %q = sdiv i64 %q2, %slots
  %qpos = icmp sgt i64 %q, 1
  %pchunk = select i1 %qpos, i64 %q, i64 1
  %t2a = add i64 %cnt, %pchunk
  %t2b = sub i64 %t2a, 1
  %tot2 = sdiv i64 %t2b, %pchunk
  call void @dt_run(ptr %job, i64 %fni, i64 %ctxi, i64 %b, i64 %e, i64 %pchunk, i64 %tot2)
  br label %check
inline_run:
  call void %fn(ptr %ctx, i64 %b, i64 %e, i32 0)
  br label %check
check:
  %ep = getelementptr i64, ptr %rp, i64 8
  %erri = load i64, ptr %ep
  %haserr = icmp ne i64 %erri, 0
  br i1 %haserr, label %read_err, label %next
read_err:
  %errp = inttoptr i64 %erri to ptr
  %errv = load i64, ptr %errp
  %failed = icmp ne i64 %errv, 0
  br i1 %failed, label %fail, label %next
fail:
  ret i64 %k
next:
  %k1 = add i64 %k, 1
  %more = icmp slt i64 %k1, %n
  br i1 %more, label %rec, label %finish
finish:
  ret i64 -1
}
"""


@functools.cache
def _native():
    """Compile the scheduler once per process: (engine, worker fn, run fn, serial fn, graph
    fn)."""
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
    engine, names = target.load(obj, ["dt_worker", "dt_run", "dt_serial", "dt_run_graph"])
    worker = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64)(names["dt_worker"])
    run = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                           ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                           ctypes.c_int64)(names["dt_run"])
    serial = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                              ctypes.c_int64, ctypes.c_int64)(names["dt_serial"])
    run_graph = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_int64, ctypes.c_void_p)(names["dt_run_graph"])
    return engine, worker, run, serial, run_graph


class ThreadPool:
    def __init__(self, num_threads: int) -> None:
        self.num_threads = num_threads
        self._job = np.zeros(16, dtype=np.int64)
        self._job_addr = self._job.ctypes.data
        self._engine, worker, self._run, self._serial, self._run_graph = _native()
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

    def run_graph(self, records: int, count: int, policy: int) -> int:
        """Run ``count`` launch records of a captured graph in order, in one native call
        (``dt_run_graph``; the record layout is ``runtime/graph.py``'s). Each record's range
        is split exactly as a Python launch splits it (``policy``: thread count, inline
        work, deterministic chunking, chunks per thread), so a replay computes bit for bit
        what the eager launches do. Returns the index of the first record whose kernel
        reported an error (its context's error word is set), or -1."""
        return self._run_graph(self._job_addr, records, count, policy)

    def close(self) -> None:
        self._job[STOP] = 1
        for w in self._workers:
            w.join(timeout=1.0)
