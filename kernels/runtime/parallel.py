"""A persistent pool of worker threads that run compiled task chunks, scheduled natively.

Each worker is a Python thread that calls one compiled function, ``dt_worker``, and stays in
it (ctypes releases the GIL for the call) until the pool closes. A launch, ``dt_run``, writes
the task into a small shared job record, publishes it by bumping a generation number, takes
chunks itself and waits until every chunk has run. Workers claim chunks with a compare-and-swap
on a counter that carries the generation in its high half, so a worker that wakes late can
never run a chunk of a newer job with an older job's function.

Nothing waits on a worker that is not there. The caller starts on the chunks at once; a
worker only helps with those still unclaimed when it shows up, so a worker the operating
system has parked behind another process, or one still asleep, only means less help. A chunk
of an unordered launch runs in a few grains taken one at a time from the thread's own claim
slot (``@drain``); a thread with nothing left to claim takes over half of what another has
claimed and not started (``@steal``), so only a grain already running can be held by a
parked thread. Between launches workers spin for a few microseconds (launches in a
simulation loop come back to back), and stop at once when the clock shows they lost their
core for a while; then they sleep on a futex, so that idle workers take no time from the
caller's Python or from other processes. A launch wakes sleepers with one system call, only
when there are any.

Workers keep off the CPU the caller runs on (``@keep_off``): their affinity is the pool's
CPUs less the one each launch was published from, changed when the caller moves. Linux puts
a thread that another wakes on the waker's CPU when its own CPU is busy; beside a process
spinning on the second core, every launch that woke the worker put it on the caller's core,
where it preempted the caller (about 90 times per MPM iteration, `perf sched`) while the
spinner had the other core to itself. When the caller has run out of work and waits for
grains that workers are running, it spins only briefly, then lends its CPU to those workers
(``@lend_all``: their affinity is the caller's CPU alone) and sleeps on a futex, so that a
worker the system parked mid-grain behind another process finishes on the idle core at once
instead of after that process's time slice (milliseconds, about once per slice on a shared
core); they get their own CPUs back when the launch ends. (A caller spinning or calling
``sched_yield`` kept its core busy, and the held chunk waited for its next time slice.)
Measured on the MPM benchmark beside a process spinning on core 1 (bench/busy.py,
bench/README.md), same process, alternating: the iteration 57-65 ms before, 43-51 ms with
grains, keeping off and lending together; the caller's wait for other threads' chunks 6-12
ms per iteration before, about 1 ms after. Keeping off alone or grains alone did not help
(a worker kept off the caller's core could no longer finish a held chunk there). A worker
spinning 100 us between launches, or chunks half as large, made the iteration 15-25 %
slower, quiet or not.

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
import os
import platform
import string
import sys
import threading
import time
import weakref

import numpy as np

from ..codegen import get_target
from . import cache

# The job record: int64 slots, on 64-byte lines so that what workers write (the chunk
# counter, the finished count) does not share a line with what they read while idle.
# Line 0, read-mostly: the job and the spin budgets.
GEN, FN, CTX, BEGIN, END, CHUNK, TOTAL, STOP = range(8)
NEXT = 8  # line 1: the chunk counter (generation << 32 | next chunk)
FINISHED, WAITING = 16, 17  # line 2: indices done; the caller sleeps on FINISHED
SLEEPERS = 24  # line 3: workers asleep on GEN
WORKER_SPIN_NS, CALLER_SPIN_NS = 25, 26  # spin budgets before sleeping (nanoseconds)
WORKER_GAP_NS = 27  # a spinning worker that lost its core for longer sleeps (0: never)
WORKER_SPIN_LONG_NS, WORKER_CALM_NS = 35, 36  # the spin budget on a quiet machine, and how
# long after losing its core a worker keeps to the short one (line 4)
TS_WORKER, TS_CALLER = 28, 30  # struct timespec {sec, nsec}: futex timeouts (a safety net)
CALLER_SLEEPS, LAUNCHES, CALLER_WAIT_NS = 32, 33, 34  # line 4: the caller's counters
GRAINS_PER_CHUNK = 37  # parts a chunk of an unordered job runs in (see @drain; <= 1: whole)
LANES = 40  # line 5: the job's claim order (see @chunks), read-mostly
CALLER_CPU = 41  # the CPU the caller published its last job from (-1: workers go anywhere)
AFFINITY_WORDS, AFFINITY_MASK = 42, 43  # the CPUs workers may use: 64-bit words at a pointer
GRAIN, ITEMS = 44, 45  # indices a claimed chunk is run by (0: whole chunks); the job's indices
OWNERS, THREADS = 46, 47  # the threads' claim slots (a pointer; each on its own line); how many
# A thread's line there: its claimed range, its thread id, whether it is inside a grain, and
# whether the caller lent it its CPU.
OWN_RANGE, OWN_TID, OWN_BUSY, OWN_LENT = 0, 1, 2, 3
SLOTS = 48

#: Spin budgets. A worker spins this long after a job before it sleeps: launches in a loop
#: come back to back, tens of microseconds apart, and waking a sleeper costs a system call
#: plus the wake-up latency. The caller spins this long for chunks other threads still hold
#: before it sleeps and gives its core to them.
WORKER_SPIN_NS_DEFAULT = 10_000
CALLER_SPIN_NS_DEFAULT = 20_000
#: A worker whose spinning was interrupted for longer than this (it checks the clock every
#: few microseconds) shares its core with another thread: it sleeps at once.
WORKER_GAP_NS_DEFAULT = 50_000
#: On a quiet machine a worker spins this long: single launches with a little Python between
#: them (a benchmark loop) find it awake. Once it has lost its core while spinning, it keeps to
#: WORKER_SPIN_NS for WORKER_CALM_NS: a worker spinning 1 ms made the MPM iteration beside a
#: busy process 1.5-1.8x slower (it took turns on a core with the caller's Python).
WORKER_SPIN_LONG_NS_DEFAULT = 500_000
WORKER_CALM_NS_DEFAULT = 1_000_000_000
#: futex system call numbers by machine (Linux); elsewhere sleeping is a short nap instead.
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98, "riscv64": 98}
_SYS_SETAFFINITY = {"x86_64": 203, "amd64": 203, "aarch64": 122, "arm64": 122, "riscv64": 122}
#: The most CPU ids a worker's affinity mask covers (64-bit words); beyond, workers go anywhere.
MASK_WORDS = 16

# The scheduler, in LLVM IR ($NAME: job-record slots and platform constants, filled in by
# _native_source). Fields of the job that workers read while the caller may be rewriting
# them are atomic (monotonic) loads and stores: the generation-tagged chunk counter decides
# which job a claim belongs to, and the caller retires the old counter before it rewrites
# the job, so a claim that succeeds saw the job it claims.
_SOURCE = r"""
declare void @llvm.x86.sse2.pause()
declare void @llvm.memcpy.p0.p0.i64(ptr, ptr, i64, i1)
declare void @llvm.memset.p0.i64(ptr, i8, i64, i1)
declare i64 @dt_syscall(i64, ...)
declare i32 @dt_usleep(i32)
declare i32 @dt_clock_gettime(i32, ptr)
declare i32 @dt_sched_getcpu()

define internal ptr @slot(ptr %job, i64 %k) alwaysinline {
entry:
  %p = getelementptr i64, ptr %job, i64 %k
  ret ptr %p
}

; ceil(a / b) for a >= 0, b > 0: chunk sizes and counts, as the Python launcher's -(-a // b)
define internal i64 @cdiv(i64 %a, i64 %b) alwaysinline {
entry:
  %a1 = add i64 %a, %b
  %a2 = sub i64 %a1, 1
  %q = sdiv i64 %a2, %b
  ret i64 %q
}

define internal i64 @now() {
entry:
  %ts = alloca [2 x i64], align 8
  %r = call i32 @dt_clock_gettime(i32 $CLOCK_MONOTONIC, ptr %ts)
  %s = load i64, ptr %ts
  %np = getelementptr i64, ptr %ts, i64 1
  %n = load i64, ptr %np
  %s9 = mul i64 %s, 1000000000
  %t = add i64 %s9, %n
  ret i64 %t
}

; Set the calling worker's affinity to the pool's CPUs less %cpu, the caller's. A worker
; that a launch wakes is otherwise put on the waker's CPU when its own is busy (the
; scheduler's wake-affine choice); there it preempted the caller, and the two took turns on
; one core while another process had the other. Nothing changes when %cpu is not one of
; them (or is all of them, or unknown: -1).
define internal void @keep_off(ptr %job, i64 %who, i64 %cpu) {
entry:
  %wordsp = call ptr @slot(ptr %job, i64 $AFFINITY_WORDS)
  %words = load atomic i64, ptr %wordsp monotonic, align 8
  %maskpp = call ptr @slot(ptr %job, i64 $AFFINITY_MASK)
  %maski = load atomic i64, ptr %maskpp monotonic, align 8
  %mask = inttoptr i64 %maski to ptr
  %known = icmp sge i64 %cpu, 0
  %w = lshr i64 %cpu, 6
  %inside = icmp ult i64 %w, %words
  %ok = and i1 %known, %inside
  br i1 %ok, label %build, label %exit
build:
  %buf = alloca [$MASK_WORDS x i64], align 8
  call void @llvm.memcpy.p0.p0.i64(ptr %buf, ptr %mask, i64 $MASK_BYTES, i1 false)
  %wp = getelementptr i64, ptr %buf, i64 %w
  %old = load i64, ptr %wp
  %b = and i64 %cpu, 63
  %bit = shl i64 1, %b
  %nbit = xor i64 %bit, -1
  %new = and i64 %old, %nbit
  %had = icmp ne i64 %new, %old
  br i1 %had, label %check, label %exit
check:
  store i64 %new, ptr %wp
  br label %scan
scan:
  %i = phi i64 [ 0, %check ], [ %i1, %scan ]
  %acc = phi i64 [ 0, %check ], [ %acc1, %scan ]
  %ip = getelementptr i64, ptr %buf, i64 %i
  %v = load i64, ptr %ip
  %acc1 = or i64 %acc, %v
  %i1 = add i64 %i, 1
  %more = icmp ult i64 %i1, %words
  br i1 %more, label %scan, label %scanned
scanned:
  %left = icmp ne i64 %acc1, 0
  br i1 %left, label %set, label %exit
set:
  %bytes = mul i64 %words, 8
  %r = call i64 (i64, ...) @dt_syscall(i64 $SYS_SETAFFINITY, i64 %who, i64 %bytes, ptr %buf)
  br label %exit
exit:
  ret void
}

; Let thread %who run on %cpu only (one of the pool's CPUs): the caller, out of work, lends
; its own CPU to a worker that holds a grain before it sleeps (see @lend_all).
define internal void @lend(ptr %job, i64 %who, i64 %cpu) {
entry:
  %wordsp = call ptr @slot(ptr %job, i64 $AFFINITY_WORDS)
  %words = load atomic i64, ptr %wordsp monotonic, align 8
  %maskpp = call ptr @slot(ptr %job, i64 $AFFINITY_MASK)
  %maski = load atomic i64, ptr %maskpp monotonic, align 8
  %mask = inttoptr i64 %maski to ptr
  %known = icmp sge i64 %cpu, 0
  %w = lshr i64 %cpu, 6
  %inside = icmp ult i64 %w, %words
  %ok = and i1 %known, %inside
  br i1 %ok, label %look, label %exit
look:
  %mp = getelementptr i64, ptr %mask, i64 %w
  %allowed = load i64, ptr %mp
  %b = and i64 %cpu, 63
  %bit = shl i64 1, %b
  %has = and i64 %allowed, %bit
  %in = icmp ne i64 %has, 0
  br i1 %in, label %set, label %exit
set:
  %buf = alloca [$MASK_WORDS x i64], align 8
  call void @llvm.memset.p0.i64(ptr %buf, i8 0, i64 $MASK_BYTES, i1 false)
  %wp = getelementptr i64, ptr %buf, i64 %w
  store i64 %bit, ptr %wp
  %bytes = mul i64 %words, 8
  %r = call i64 (i64, ...) @dt_syscall(i64 $SYS_SETAFFINITY, i64 %who, i64 %bytes, ptr %buf)
  br label %exit
exit:
  ret void
}

; The caller has run out of work and waits for grains other threads are running: each
; worker inside a grain may now run on the caller's CPU %cpu, which the caller leaves idle
; while it sleeps. A worker the system parked behind another process mid-grain held up the
; launch until that process's time slice ended (milliseconds); it now moves to the idle
; core at once. @unlend_all gives them back their own CPUs when the launch is done.
define internal void @lend_all(ptr %job, i64 %cpu) {
entry:
  %basep = call ptr @slot(ptr %job, i64 $OWNERS)
  %basei = load atomic i64, ptr %basep monotonic, align 8
  %base = inttoptr i64 %basei to ptr
  %nthp = call ptr @slot(ptr %job, i64 $THREADS)
  %nth = load atomic i64, ptr %nthp monotonic, align 8
  br label %loop
loop:
  %k = phi i64 [ 1, %entry ], [ %k1, %next ]
  %more = icmp ult i64 %k, %nth
  br i1 %more, label %look, label %exit
look:
  %kk = mul i64 %k, 8
  %line = getelementptr i64, ptr %base, i64 %kk
  %busyp = getelementptr i64, ptr %line, i64 $OWN_BUSY
  %busy = load atomic i64, ptr %busyp monotonic, align 8
  %held = icmp ne i64 %busy, 0
  br i1 %held, label %move, label %next
move:
  %tidp = getelementptr i64, ptr %line, i64 $OWN_TID
  %who = load atomic i64, ptr %tidp monotonic, align 8
  %known = icmp sgt i64 %who, 0  ; (0 would name the caller itself)
  br i1 %known, label %lendit, label %next
lendit:
  call void @lend(ptr %job, i64 %who, i64 %cpu)
  %lentp = getelementptr i64, ptr %line, i64 $OWN_LENT
  store atomic i64 1, ptr %lentp monotonic, align 8
  br label %next
next:
  %k1 = add i64 %k, 1
  br label %loop
exit:
  ret void
}

define internal void @unlend_all(ptr %job, i64 %cpu) {
entry:
  %basep = call ptr @slot(ptr %job, i64 $OWNERS)
  %basei = load atomic i64, ptr %basep monotonic, align 8
  %base = inttoptr i64 %basei to ptr
  %nthp = call ptr @slot(ptr %job, i64 $THREADS)
  %nth = load atomic i64, ptr %nthp monotonic, align 8
  br label %loop
loop:
  %k = phi i64 [ 1, %entry ], [ %k1, %next ]
  %more = icmp ult i64 %k, %nth
  br i1 %more, label %look, label %exit
look:
  %kk = mul i64 %k, 8
  %line = getelementptr i64, ptr %base, i64 %kk
  %lentp = getelementptr i64, ptr %line, i64 $OWN_LENT
  %lent = load atomic i64, ptr %lentp monotonic, align 8
  %was = icmp ne i64 %lent, 0
  br i1 %was, label %back, label %next
back:
  store atomic i64 0, ptr %lentp monotonic, align 8
  %tidp = getelementptr i64, ptr %line, i64 $OWN_TID
  %who = load atomic i64, ptr %tidp monotonic, align 8
  call void @keep_off(ptr %job, i64 %who, i64 %cpu)
  br label %next
next:
  %k1 = add i64 %k, 1
  br label %loop
exit:
  ret void
}

$SLEEP_WAKE

; Claim and run chunks of job %gen until none is left (or a newer job replaced it).
; Claims are numbered in order; with L lanes (L > 1) claim k runs chunk
; (k / L) + (k % L) q + min(k % L, r) of the n = q L + r chunks: the range is cut into L
; lanes of consecutive chunks and successive claims go to different lanes, so chunks that
; run at the same time are about n / L chunks apart. (In index order, a thread that started
; a chunk late ran just behind the next chunk's thread, and two threads scattering into the
; same grid nodes fought over those cache lines: MPM's p2g 2x slower than alone.)
define internal void @chunks(ptr %job, i64 %gen, i32 %tid) {
entry:
  %nextp = call ptr @slot(ptr %job, i64 $NEXT)
  %bp = call ptr @slot(ptr %job, i64 $BEGIN)
  %ep = call ptr @slot(ptr %job, i64 $END)
  %cp = call ptr @slot(ptr %job, i64 $CHUNK)
  %fnp = call ptr @slot(ptr %job, i64 $FN)
  %ctxp = call ptr @slot(ptr %job, i64 $CTX)
  %totp = call ptr @slot(ptr %job, i64 $TOTAL)
  %lanesp = call ptr @slot(ptr %job, i64 $LANES)
  %grainp = call ptr @slot(ptr %job, i64 $GRAIN)
  %tag = shl i64 %gen, 32
  br label %claim
claim:
  %cur = load atomic i64, ptr %nextp seq_cst, align 8
  %hi = and i64 %cur, -4294967296
  %same = icmp eq i64 %hi, %tag
  br i1 %same, label %try, label %done
try:
  %begin = load atomic i64, ptr %bp monotonic, align 8
  %end = load atomic i64, ptr %ep monotonic, align 8
  %chunk = load atomic i64, ptr %cp monotonic, align 8
  %ntot = load atomic i64, ptr %totp monotonic, align 8
  %lanes = load atomic i64, ptr %lanesp monotonic, align 8
  %k = and i64 %cur, 4294967295
  %more = icmp slt i64 %k, %ntot
  br i1 %more, label %order, label %done
order:
  %spread = icmp sgt i64 %lanes, 1
  %nl = select i1 %spread, i64 %lanes, i64 1
  %lane = urem i64 %k, %nl
  %pos = udiv i64 %k, %nl
  %q = udiv i64 %ntot, %nl
  %rm = urem i64 %ntot, %nl
  %lq = mul i64 %lane, %q
  %few = icmp ult i64 %lane, %rm
  %extra = select i1 %few, i64 %lane, i64 %rm
  %start = add i64 %lq, %extra
  %c = add i64 %pos, %start
  %b0 = mul i64 %c, %chunk
  %b = add i64 %begin, %b0
  br label %cas
cas:
  %nk = add i64 %cur, 1
  %r = cmpxchg ptr %nextp, i64 %cur, i64 %nk seq_cst seq_cst
  %ok = extractvalue { i64, i1 } %r, 1
  br i1 %ok, label %run, label %claim
run:
  ; The job cannot change before this chunk is counted finished.
  %e0 = add i64 %b, %chunk
  %lt = icmp slt i64 %e0, %end
  %e = select i1 %lt, i64 %e0, i64 %end
  %grain = load atomic i64, ptr %grainp monotonic, align 8
  %split = icmp ne i64 %grain, 0
  br i1 %split, label %publish, label %whole
whole:
  %fni = load atomic i64, ptr %fnp monotonic, align 8
  %fn = inttoptr i64 %fni to ptr
  %ctx = load atomic i64, ptr %ctxp monotonic, align 8
  %ctxptr = inttoptr i64 %ctx to ptr
  %wown = call ptr @own_slot(ptr %job, i32 %tid)
  %wbusyp = getelementptr i64, ptr %wown, i64 $OWN_BUSY
  store atomic i64 1, ptr %wbusyp monotonic, align 8
  call void %fn(ptr %ctxptr, i64 %b, i64 %e, i32 %tid)
  store atomic i64 0, ptr %wbusyp monotonic, align 8
  %n = sub i64 %e, %b
  call void @finish(ptr %job, i64 %n)
  br label %claim
publish:
  ; In grains, from this thread's claim slot: what it has not started, others may take.
  %own = call ptr @own_slot(ptr %job, i32 %tid)
  %lo = sub i64 %b, %begin
  %hi0 = sub i64 %e, %begin
  %hi1 = shl i64 %hi0, 32
  %range = or i64 %hi1, %lo
  store atomic i64 %range, ptr %own seq_cst, align 8
  %ran = call i64 @drain(ptr %job, ptr %own, i32 %tid)
  call void @finish(ptr %job, i64 %ran)
  br label %claim
done:
  ; No chunk left to claim: take over the part of others' chunks they have not started.
  %g = load atomic i64, ptr %grainp monotonic, align 8
  %steal = icmp ne i64 %g, 0
  br i1 %steal, label %help, label %out
help:
  call void @steal(ptr %job, i32 %tid)
  br label %out
out:
  ret void
}

define internal ptr @own_slot(ptr %job, i32 %tid) alwaysinline {
entry:
  %basep = call ptr @slot(ptr %job, i64 $OWNERS)
  %basei = load atomic i64, ptr %basep monotonic, align 8
  %base = inttoptr i64 %basei to ptr
  %t = zext i32 %tid to i64
  %k = mul i64 %t, 8
  %p = getelementptr i64, ptr %base, i64 %k
  ret ptr %p
}

; Count %n more indices done; the thread that completes the job wakes a sleeping caller.
define internal void @finish(ptr %job, i64 %n) {
entry:
  %finp = call ptr @slot(ptr %job, i64 $FINISHED)
  %itemsp = call ptr @slot(ptr %job, i64 $ITEMS)
  %waitp = call ptr @slot(ptr %job, i64 $WAITING)
  %any = icmp ne i64 %n, 0
  br i1 %any, label %count, label %exit
count:
  %items = load atomic i64, ptr %itemsp monotonic, align 8
  %f = atomicrmw add ptr %finp, i64 %n seq_cst
  %f1 = add i64 %f, %n
  %last = icmp sge i64 %f1, %items
  br i1 %last, label %check, label %exit
check:
  %w = load atomic i64, ptr %waitp seq_cst, align 8
  %asleep = icmp ne i64 %w, 0
  br i1 %asleep, label %wakeup, label %exit
wakeup:
  call void @wake(ptr %finp, i64 1)
  br label %exit
exit:
  ret void
}

; Run the range in claim slot %own (offsets from the job's begin: the next index in the low
; half, the end in the high half) a grain at a time, each taken with a compare-and-swap, so
; that what this thread has not started stays free for @steal. Returns the indices run.
; (A chunk claimed by a thread that the system then parked behind another process used to
; hold up the whole launch until that thread's next time slice.)
define internal i64 @drain(ptr %job, ptr %own, i32 %tid) {
entry:
  %grainp = call ptr @slot(ptr %job, i64 $GRAIN)
  %bp = call ptr @slot(ptr %job, i64 $BEGIN)
  %fnp = call ptr @slot(ptr %job, i64 $FN)
  %ctxp = call ptr @slot(ptr %job, i64 $CTX)
  br label %take
take:
  %done = phi i64 [ 0, %entry ], [ %done, %cut ], [ %done1, %go ]
  %v = load atomic i64, ptr %own seq_cst, align 8
  %n = and i64 %v, 4294967295
  %e = lshr i64 %v, 32
  %left = icmp ult i64 %n, %e
  br i1 %left, label %cut, label %out
cut:
  %g0 = load atomic i64, ptr %grainp monotonic, align 8
  %gz = icmp eq i64 %g0, 0
  %span = sub i64 %e, %n
  %g = select i1 %gz, i64 %span, i64 %g0
  %n1 = add i64 %n, %g
  %short = icmp ult i64 %n1, %e
  %m = select i1 %short, i64 %n1, i64 %e
  %ehi = shl i64 %e, 32
  %nv = or i64 %ehi, %m
  %r = cmpxchg ptr %own, i64 %v, i64 %nv seq_cst seq_cst
  %ok = extractvalue { i64, i1 } %r, 1
  br i1 %ok, label %go, label %take
go:
  ; Read after the grain is ours: the job cannot change before it is counted finished.
  %begin = load atomic i64, ptr %bp monotonic, align 8
  %fni = load atomic i64, ptr %fnp monotonic, align 8
  %fn = inttoptr i64 %fni to ptr
  %ctx = load atomic i64, ptr %ctxp monotonic, align 8
  %ctxptr = inttoptr i64 %ctx to ptr
  %gb = add i64 %begin, %n
  %ge = add i64 %begin, %m
  %busyp = getelementptr i64, ptr %own, i64 $OWN_BUSY
  store atomic i64 1, ptr %busyp monotonic, align 8
  call void %fn(ptr %ctxptr, i64 %gb, i64 %ge, i32 %tid)
  store atomic i64 0, ptr %busyp monotonic, align 8
  %cnt = sub i64 %m, %n
  %done1 = add i64 %done, %cnt
  br label %take
out:
  ret i64 %done
}

; Take the later half (rounded up, in grains) of what another thread has claimed and not
; started, run it from this thread's own slot (so it can be shared on in turn), and repeat
; until no thread has anything left to take. A thread's range is taken whole when one
; grain is left: the owner may be parked before starting it.
define internal void @steal(ptr %job, i32 %tid) {
entry:
  %grainp = call ptr @slot(ptr %job, i64 $GRAIN)
  %basep = call ptr @slot(ptr %job, i64 $OWNERS)
  %basei = load atomic i64, ptr %basep monotonic, align 8
  %base = inttoptr i64 %basei to ptr
  %nthp = call ptr @slot(ptr %job, i64 $THREADS)
  %nth = load atomic i64, ptr %nthp monotonic, align 8
  %t = zext i32 %tid to i64
  %ownk = mul i64 %t, 8
  %own = getelementptr i64, ptr %base, i64 %ownk
  br label %pass
pass:
  %i = phi i64 [ 1, %entry ], [ 1, %take ], [ %i1, %next ]
  %more = icmp ult i64 %i, %nth
  br i1 %more, label %look, label %out
look:
  %vt0 = add i64 %t, %i
  %vt = urem i64 %vt0, %nth
  %vk = mul i64 %vt, 8
  %vp = getelementptr i64, ptr %base, i64 %vk
  br label %peek
peek:
  %v = load atomic i64, ptr %vp seq_cst, align 8
  %n = and i64 %v, 4294967295
  %e = lshr i64 %v, 32
  %left = icmp ult i64 %n, %e
  br i1 %left, label %split, label %next
split:
  %g0 = load atomic i64, ptr %grainp monotonic, align 8
  %gz = icmp eq i64 %g0, 0
  %span = sub i64 %e, %n
  %g = select i1 %gz, i64 %span, i64 %g0
  %r = call i64 @cdiv(i64 %span, i64 %g)
  %h = lshr i64 %r, 1
  %hg = mul i64 %h, %g
  %m = add i64 %n, %hg
  %mhi = shl i64 %m, 32
  %nv = or i64 %mhi, %n
  %res = cmpxchg ptr %vp, i64 %v, i64 %nv seq_cst seq_cst
  %ok = extractvalue { i64, i1 } %res, 1
  br i1 %ok, label %take, label %peek
take:
  %ehi = shl i64 %e, 32
  %mine = or i64 %ehi, %m
  store atomic i64 %mine, ptr %own seq_cst, align 8
  %ran = call i64 @drain(ptr %job, ptr %own, i32 %tid)
  call void @finish(ptr %job, i64 %ran)
  br label %pass
next:
  %i1 = add i64 %i, 1
  br label %pass
out:
  ret void
}

define void @dt_worker(ptr %job, i64 %tid64) {
entry:
  %tid = trunc i64 %tid64 to i32
  %genp = call ptr @slot(ptr %job, i64 $GEN)
  %stopp = call ptr @slot(ptr %job, i64 $STOP)
  %sleepp = call ptr @slot(ptr %job, i64 $SLEEPERS)
  %budgetp = call ptr @slot(ptr %job, i64 $WORKER_SPIN_NS)
  %gapp = call ptr @slot(ptr %job, i64 $WORKER_GAP_NS)
  %longp = call ptr @slot(ptr %job, i64 $WORKER_SPIN_LONG_NS)
  %windowp = call ptr @slot(ptr %job, i64 $WORKER_CALM_NS)
  %tsp = call ptr @slot(ptr %job, i64 $TS_WORKER)
  %ccpup = call ptr @slot(ptr %job, i64 $CALLER_CPU)
  br label %idle_start
idle_start:
  ; Seen at first: generation 0, before any job (a worker that starts late joins the first).
  %seen0 = phi i64 [ 0, %entry ], [ %g, %run ], [ %seen, %woke ]
  ; Until %calm: this worker lost its core while spinning not long ago (another thread wants
  ; it), so it spins only briefly; otherwise it spins long (a quiet machine).
  %calm0 = phi i64 [ 0, %entry ], [ %calm, %run ], [ %calm1, %woke ]
  ; The caller's CPU this worker's affinity leaves out (-1: none yet).
  %off0 = phi i64 [ -1, %entry ], [ %off, %run ], [ %off0, %woke ]
  %t0 = call i64 @now()
  %short = load atomic i64, ptr %budgetp monotonic, align 8
  %long = load atomic i64, ptr %longp monotonic, align 8
  %busy = icmp slt i64 %t0, %calm0
  %budget = select i1 %busy, i64 %short, i64 %long
  %deadline = add i64 %t0, %budget
  %maxgap = load atomic i64, ptr %gapp monotonic, align 8
  %watch = icmp ne i64 %maxgap, 0
  br label %wait
wait:
  %seen = phi i64 [ %seen0, %idle_start ], [ %seen, %spin ]
  %n = phi i64 [ 0, %idle_start ], [ %n1, %spin ]
  %last = phi i64 [ %t0, %idle_start ], [ %last1, %spin ]
  %calm = phi i64 [ %calm0, %idle_start ], [ %calm, %spin ]
  %stop = load atomic i64, ptr %stopp seq_cst, align 8
  %quit = icmp ne i64 %stop, 0
  br i1 %quit, label %exit, label %poll
poll:
  %g = load atomic i64, ptr %genp seq_cst, align 8
  %new = icmp ne i64 %g, %seen
  br i1 %new, label %got, label %idle
got:
  ; The caller moved (or this is the first job): keep off its CPU from now on.
  %ccpu = load atomic i64, ptr %ccpup monotonic, align 8
  %moved = icmp ne i64 %ccpu, %off0
  br i1 %moved, label %reaffine, label %run
reaffine:
  call void @keep_off(ptr %job, i64 0, i64 %ccpu)
  br label %run
run:
  %off = phi i64 [ %off0, %got ], [ %ccpu, %reaffine ]
  call void @chunks(ptr %job, i64 %g, i32 %tid)
  br label %idle_start
idle:
  %n1 = add i64 %n, 1
  %m = and i64 %n1, 63
  %tick = icmp eq i64 %m, 0
  br i1 %tick, label %clock, label %spin
clock:
  ; Out of budget, or the clock jumped since the last look: the system took this core away
  ; for a while, so another thread wants it; spinning on would only compete with it.
  %t = call i64 @now()
  %late = icmp sge i64 %t, %deadline
  %gap = sub i64 %t, %last
  %jump = icmp sgt i64 %gap, %maxgap
  %taken = and i1 %watch, %jump
  %window = load atomic i64, ptr %windowp monotonic, align 8
  %until = add i64 %t, %window
  %calm1 = select i1 %taken, i64 %until, i64 %calm
  %give = or i1 %late, %taken
  br i1 %give, label %sleep, label %spin
spin:
  %last1 = phi i64 [ %last, %idle ], [ %t, %clock ]
  call void @llvm.x86.sse2.pause()
  br label %wait
sleep:
  ; Dekker with dt_run: count ourselves asleep, then look at the generation again; dt_run
  ; publishes the generation, then looks at the count. One of the two sees the other.
  %s0 = atomicrmw add ptr %sleepp, i64 1 seq_cst
  %g2 = load atomic i64, ptr %genp seq_cst, align 8
  %st2 = load atomic i64, ptr %stopp seq_cst, align 8
  %still = icmp eq i64 %g2, %seen
  %nostop = icmp eq i64 %st2, 0
  %both = and i1 %still, %nostop
  br i1 %both, label %nap, label %woke
nap:
  call void @sleep_on(ptr %genp, i64 %seen, ptr %tsp)
  br label %woke
woke:
  %s1 = atomicrmw sub ptr %sleepp, i64 1 seq_cst
  br label %idle_start
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
                    i64 %total, i64 %lanes) {
entry:
  %genp = call ptr @slot(ptr %job, i64 $GEN)
  %nextp = call ptr @slot(ptr %job, i64 $NEXT)
  %finp = call ptr @slot(ptr %job, i64 $FINISHED)
  %waitp = call ptr @slot(ptr %job, i64 $WAITING)
  %sleepp = call ptr @slot(ptr %job, i64 $SLEEPERS)
  %budgetp = call ptr @slot(ptr %job, i64 $CALLER_SPIN_NS)
  %tsp = call ptr @slot(ptr %job, i64 $TS_CALLER)
  %sleepsp = call ptr @slot(ptr %job, i64 $CALLER_SLEEPS)
  %launchp = call ptr @slot(ptr %job, i64 $LAUNCHES)
  %g = load atomic i64, ptr %genp seq_cst, align 8
  %g1 = add i64 %g, 1
  ; Retire the previous job's counter first: a late worker's claim on it fails from here on,
  ; so it can never pair the old counter with the new job's fields.
  %old = atomicrmw xchg ptr %nextp, i64 0 seq_cst
  %fnp = call ptr @slot(ptr %job, i64 $FN)
  store atomic i64 %fn, ptr %fnp monotonic, align 8
  %ctxp = call ptr @slot(ptr %job, i64 $CTX)
  store atomic i64 %ctx, ptr %ctxp monotonic, align 8
  %bp = call ptr @slot(ptr %job, i64 $BEGIN)
  store atomic i64 %begin, ptr %bp monotonic, align 8
  %ep = call ptr @slot(ptr %job, i64 $END)
  store atomic i64 %end, ptr %ep monotonic, align 8
  %cp = call ptr @slot(ptr %job, i64 $CHUNK)
  store atomic i64 %chunk, ptr %cp monotonic, align 8
  %totp = call ptr @slot(ptr %job, i64 $TOTAL)
  store atomic i64 %total, ptr %totp monotonic, align 8
  %lanesp = call ptr @slot(ptr %job, i64 $LANES)
  store atomic i64 %lanes, ptr %lanesp monotonic, align 8
  ; Grains: a chunk of an unordered job (L > 1 lanes) runs in a few parts that others may
  ; take; an ordered job's chunks are its results' boundaries, so they run whole.
  %items = sub i64 %end, %begin
  %itemsp = call ptr @slot(ptr %job, i64 $ITEMS)
  store atomic i64 %items, ptr %itemsp monotonic, align 8
  %gpcp = call ptr @slot(ptr %job, i64 $GRAINS_PER_CHUNK)
  %gpc = load atomic i64, ptr %gpcp monotonic, align 8
  %unordered = icmp sgt i64 %lanes, 1
  %parts = icmp sgt i64 %gpc, 1
  %fits = icmp ult i64 %items, 4294967296
  %sp0 = and i1 %unordered, %parts
  %sp = and i1 %sp0, %fits
  %gpc1 = select i1 %parts, i64 %gpc, i64 1
  %g0 = call i64 @cdiv(i64 %chunk, i64 %gpc1)
  %grain = select i1 %sp, i64 %g0, i64 0
  %grainp = call ptr @slot(ptr %job, i64 $GRAIN)
  store atomic i64 %grain, ptr %grainp monotonic, align 8
  %wordsp = call ptr @slot(ptr %job, i64 $AFFINITY_WORDS)
  %words = load atomic i64, ptr %wordsp monotonic, align 8
  %steer = icmp ne i64 %words, 0
  br i1 %steer, label %where, label %publish
where:
  %cpu32 = call i32 @dt_sched_getcpu()
  %cpu = sext i32 %cpu32 to i64
  %ccpup = call ptr @slot(ptr %job, i64 $CALLER_CPU)
  store atomic i64 %cpu, ptr %ccpup monotonic, align 8
  br label %publish
publish:
  %here = phi i64 [ -1, %entry ], [ %cpu, %where ]
  store atomic i64 0, ptr %finp seq_cst, align 8
  %tag = shl i64 %g1, 32
  store atomic i64 %tag, ptr %nextp seq_cst, align 8
  store atomic i64 %g1, ptr %genp seq_cst, align 8
  %nl = load i64, ptr %launchp
  %nl1 = add i64 %nl, 1
  store i64 %nl1, ptr %launchp
  %sl = load atomic i64, ptr %sleepp seq_cst, align 8
  %any = icmp ne i64 %sl, 0
  br i1 %any, label %wake, label %work
wake:
  call void @wake(ptr %genp, i64 2147483647)
  br label %work
work:
  call void @chunks(ptr %job, i64 %g1, i32 0)
  %f0 = load atomic i64, ptr %finp seq_cst, align 8
  %all0 = icmp sge i64 %f0, %items
  br i1 %all0, label %exit, label %spin_start
spin_start:
  ; Chunks other threads hold are still running: spin a little, then sleep, so that a
  ; worker the system parked can have this core.
  %t0 = call i64 @now()
  %budget = load atomic i64, ptr %budgetp monotonic, align 8
  %deadline = add i64 %t0, %budget
  br label %wait
wait:
  %n = phi i64 [ 0, %spin_start ], [ %n1, %spin ]
  %f = load atomic i64, ptr %finp seq_cst, align 8
  %all = icmp sge i64 %f, %items
  br i1 %all, label %waited, label %idle
idle:
  %n1 = add i64 %n, 1
  %m = and i64 %n1, 63
  %tick = icmp eq i64 %m, 0
  br i1 %tick, label %clock, label %spin
clock:
  ; (What another thread claimed and published after this thread last looked.)
  call void @steal(ptr %job, i32 0)
  %t = call i64 @now()
  %late = icmp sge i64 %t, %deadline
  br i1 %late, label %give, label %spin
give:
  %steering = icmp sge i64 %here, 0
  br i1 %steering, label %lendc, label %sleep
lendc:
  call void @lend_all(ptr %job, i64 %here)
  br label %sleep
spin:
  call void @llvm.x86.sse2.pause()
  br label %wait
sleep:
  ; Dekker with the worker that finishes the last chunk: say we sleep, then look again.
  store atomic i64 1, ptr %waitp seq_cst, align 8
  %f2 = load atomic i64, ptr %finp seq_cst, align 8
  %all2 = icmp sge i64 %f2, %items
  br i1 %all2, label %unwait, label %nap
nap:
  call void @sleep_on(ptr %finp, i64 %f2, ptr %tsp)
  %ns = load i64, ptr %sleepsp
  %ns1 = add i64 %ns, 1
  store i64 %ns1, ptr %sleepsp
  br label %sleep
unwait:
  store atomic i64 0, ptr %waitp seq_cst, align 8
  %steered = icmp sge i64 %here, 0
  br i1 %steered, label %unlend, label %waited
unlend:
  call void @unlend_all(ptr %job, i64 %here)
  br label %waited
waited:
  %t1 = call i64 @now()
  %dt = sub i64 %t1, %t0
  %waitnsp = call ptr @slot(ptr %job, i64 $CALLER_WAIT_NS)
  %wns = load i64, ptr %waitnsp
  %wns1 = add i64 %wns, %dt
  store i64 %wns1, ptr %waitnsp
  br label %exit
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
  %p5 = getelementptr i64, ptr %policy, i64 5
  %pminw = load i64, ptr %p5
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
  %c1 = call i64 @cdiv(i64 %cnt, i64 %detc)
  %c2 = call i64 @cdiv(i64 %minw, i64 %w)
  %cgt = icmp sgt i64 %c1, %c2
  %chunk = select i1 %cgt, i64 %c1, i64 %c2
  %whole = icmp sge i64 %chunk, %cnt
  br i1 %whole, label %inline_run, label %ord_split
ord_split:
  %big = icmp sge i64 %work, %inline
  %thr = and i1 %big, %multi
  br i1 %thr, label %ord_pool, label %ord_serial
ord_pool:
  %tot1 = call i64 @cdiv(i64 %cnt, i64 %chunk)
  call void @dt_run(ptr %job, i64 %fni, i64 %ctxi, i64 %b, i64 %e, i64 %chunk, i64 %tot1,
                    i64 1)
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
  %q = call i64 @cdiv(i64 %cnt, i64 %slots)
  %m = call i64 @cdiv(i64 %pminw, i64 %w)
  %qgt = icmp sgt i64 %q, %m
  %pchunk = select i1 %qgt, i64 %q, i64 %m
  %pwhole = icmp sge i64 %pchunk, %cnt
  br i1 %pwhole, label %inline_run, label %pool_go
pool_go:
  %tot2 = call i64 @cdiv(i64 %cnt, i64 %pchunk)
  ; A task with per-chunk partial sums (schedule 3) runs whole chunks: one lane, no grains.
  %wholetask = icmp eq i64 %sched, 3
  %lanes2 = select i1 %wholetask, i64 1, i64 %nth
  call void @dt_run(ptr %job, i64 %fni, i64 %ctxi, i64 %b, i64 %e, i64 %pchunk, i64 %tot2,
                    i64 %lanes2)
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

define void @dt_stop(ptr %job) {
entry:
  %stopp = call ptr @slot(ptr %job, i64 $STOP)
  store atomic i64 1, ptr %stopp seq_cst, align 8
  %genp = call ptr @slot(ptr %job, i64 $GEN)
  call void @wake(ptr %genp, i64 2147483647)
  ret void
}
"""

# Sleeping and waking: a futex on the low half of a slot (Linux), with a timeout as a safety
# net; elsewhere a short nap (and nothing to wake).
_FUTEX = r"""
define internal void @sleep_on(ptr %word, i64 %val, ptr %ts) {
entry:
  %v = and i64 %val, 4294967295
  %r = call i64 (i64, ...) @dt_syscall(i64 $SYS_FUTEX, ptr %word, i64 128, i64 %v, ptr %ts)
  ret void
}

define internal void @wake(ptr %word, i64 %n) {
entry:
  %r = call i64 (i64, ...) @dt_syscall(i64 $SYS_FUTEX, ptr %word, i64 129, i64 %n)
  ret void
}
"""
_NAP = r"""
define internal void @sleep_on(ptr %word, i64 %val, ptr %ts) {
entry:
  %r = call i32 @dt_usleep(i32 50)
  ret void
}

define internal void @wake(ptr %word, i64 %n) {
entry:
  ret void
}
"""


def _steering_syscall() -> int | None:
    """``sched_setaffinity``'s system call number where workers can keep off the caller's CPU
    (Linux with ``sched_getcpu``), else None."""
    if not (sys.platform.startswith("linux") and sys.byteorder == "little"):
        return None
    if not hasattr(ctypes.CDLL(None), "sched_getcpu"):
        return None
    return _SYS_SETAFFINITY.get(platform.machine().lower())


def _native_source(triple: str) -> str:
    """The scheduler's IR for this machine: futexes where Linux has them, `pause` on x86."""
    futex = _SYS_FUTEX.get(platform.machine().lower()) if sys.platform.startswith("linux") \
        and sys.byteorder == "little" else None
    text = string.Template(_SOURCE.replace("$SLEEP_WAKE", _FUTEX if futex else _NAP))
    source = text.substitute(
        GEN=GEN, FN=FN, CTX=CTX, BEGIN=BEGIN, END=END, CHUNK=CHUNK, TOTAL=TOTAL, STOP=STOP,
        NEXT=NEXT, FINISHED=FINISHED, WAITING=WAITING, SLEEPERS=SLEEPERS,
        WORKER_SPIN_NS=WORKER_SPIN_NS, CALLER_SPIN_NS=CALLER_SPIN_NS,
        WORKER_GAP_NS=WORKER_GAP_NS, WORKER_SPIN_LONG_NS=WORKER_SPIN_LONG_NS,
        WORKER_CALM_NS=WORKER_CALM_NS, TS_WORKER=TS_WORKER,
        TS_CALLER=TS_CALLER, CALLER_SLEEPS=CALLER_SLEEPS, LAUNCHES=LAUNCHES,
        CALLER_WAIT_NS=CALLER_WAIT_NS, LANES=LANES, CALLER_CPU=CALLER_CPU, GRAIN=GRAIN,
        ITEMS=ITEMS, OWNERS=OWNERS, THREADS=THREADS, GRAINS_PER_CHUNK=GRAINS_PER_CHUNK,
        OWN_TID=OWN_TID, OWN_BUSY=OWN_BUSY, OWN_LENT=OWN_LENT,
        AFFINITY_WORDS=AFFINITY_WORDS, AFFINITY_MASK=AFFINITY_MASK, MASK_WORDS=MASK_WORDS,
        MASK_BYTES=8 * MASK_WORDS, SYS_SETAFFINITY=_steering_syscall() or 0,
        CLOCK_MONOTONIC=time.CLOCK_MONOTONIC, SYS_FUTEX=futex or 0)
    if _steering_syscall() is None:  # no CPU to publish: workers go anywhere
        source = source.replace("declare i32 @dt_sched_getcpu()\n", "").replace(
            "call i32 @dt_sched_getcpu()", "add i32 0, -1")
    if not triple.startswith(("x86_64", "i686", "i386")):  # no `pause` elsewhere
        source = source.replace("declare void @llvm.x86.sse2.pause()\n", "").replace(
            "  call void @llvm.x86.sse2.pause()\n", "")
    return f'target triple = "{triple}"\n' + source


@functools.cache
def _native():
    """Compile the scheduler once per process: (engine, worker fn, run fn, serial fn, graph
    fn, stop fn)."""
    target = get_target()
    libc = ctypes.CDLL(None)
    for name in ("usleep", "syscall", "clock_gettime") + (
            ("sched_getcpu",) if _steering_syscall() is not None else ()):
        target.bind_symbol(f"dt_{name}", ctypes.cast(getattr(libc, name), ctypes.c_void_p).value)
    text = _native_source(target.triple)
    key = hashlib.sha256((text + target.fingerprint).encode()).hexdigest()
    directory = cache.cache_dir()
    obj = cache.load(key, directory)
    if obj is None:  # compiled once per machine, then loaded from the disk cache
        obj = target.compile(text)
        cache.store(key, obj, directory)
    engine, names = target.load(obj, ["dt_worker", "dt_run", "dt_serial", "dt_run_graph",
                                      "dt_stop"])
    worker = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64)(names["dt_worker"])
    run = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                           ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                           ctypes.c_int64, ctypes.c_int64)(names["dt_run"])
    serial = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                              ctypes.c_int64, ctypes.c_int64)(names["dt_serial"])
    run_graph = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_int64, ctypes.c_void_p)(names["dt_run_graph"])
    stop = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(names["dt_stop"])
    return engine, worker, run, serial, run_graph, stop


def _worker_cpus(num_threads: int) -> set[int] | None:
    """The CPUs workers may run on when they keep off the caller's: the calling thread's
    (workers inherit them), when there are at least as many as threads, each within the
    mask's reach; else None (oversubscribed, one CPU, or no way to steer: workers go
    anywhere)."""
    if _steering_syscall() is None or num_threads < 2:
        return None
    cpus = os.sched_getaffinity(0)
    if len(cpus) < num_threads or max(cpus) >= 64 * MASK_WORDS:
        return None
    return cpus


def _serve(worker, job: np.ndarray, addr: int, tid: int) -> None:
    """A worker thread's body: ``job`` (the record at ``addr``) stays alive while it runs."""
    worker(addr, tid)


def _stop_job(stop, job: np.ndarray, addr: int) -> None:
    """Tell a pool's workers to return (``job``, the record at ``addr``, is kept alive)."""
    stop(addr)


class ThreadPool:
    """The caller (thread 0) and ``num_threads - 1`` workers running chunks of launches."""

    #: A range is cut into about this many chunks per thread (fewer when that would make
    #: chunks smaller than ``MIN_CHUNK_WORK``): a late worker still finds chunks to take. In
    #: index order more chunks made scatters slower (threads on neighbouring chunks wrote the
    #: same cache lines); with the lane order of ``@chunks`` 8 per thread measured the same
    #: as 4, quiet or beside a busy process, within the noise of a loaded machine.
    CHUNKS_PER_THREAD = 4
    #: The least work (iterations x statements, as ``Task.weight`` counts) worth a chunk: a
    #: claim costs two atomic operations on a shared line and an indirect call.
    MIN_CHUNK_WORK = 1 << 12
    #: A chunk of an unordered launch runs in this many parts (grains), each claimed from the
    #: thread's own slot, so that a thread with nothing left to claim can take over what a
    #: parked thread has claimed but not started (``@steal``).
    GRAINS_PER_CHUNK = 4

    def __init__(self, num_threads: int, keep_off_caller: bool = True) -> None:
        """``keep_off_caller``: workers keep off the CPU the launching thread runs on (their
        affinity is this thread's CPUs less that one, followed as the caller moves), where
        there are at least as many CPUs as threads; see ``@keep_off``."""
        self.num_threads = num_threads
        # One 64-byte-aligned record (the slots are laid out on cache lines), then the mask of
        # CPUs workers may use (in the same buffer: workers read it while they live).
        # Then each thread's claim slot, on a line of its own.
        owners = SLOTS + MASK_WORDS
        self._buffer = np.zeros(owners + 8 * num_threads + 8, dtype=np.int64)
        skip = (-self._buffer.ctypes.data % 64) // 8
        self._job = self._buffer[skip:skip + SLOTS]
        self._job_addr = self._job.ctypes.data
        self._job[OWNERS] = self._buffer[skip + owners:].ctypes.data
        self._job[THREADS] = num_threads
        self._job[GRAINS_PER_CHUNK] = self.GRAINS_PER_CHUNK
        self._job[CALLER_CPU] = -1
        cpus = _worker_cpus(num_threads) if keep_off_caller else None
        if cpus is not None:
            mask = self._buffer[skip + SLOTS:skip + SLOTS + MASK_WORDS]
            bits = sum(1 << cpu for cpu in cpus)
            mask[:] = np.array([(bits >> (64 * w)) & (2**64 - 1) for w in range(MASK_WORDS)],
                               dtype=np.uint64).view(np.int64)
            self._job[AFFINITY_MASK] = mask.ctypes.data
            self._job[AFFINITY_WORDS] = MASK_WORDS
        self._job[WORKER_SPIN_NS] = WORKER_SPIN_NS_DEFAULT
        self._job[CALLER_SPIN_NS] = CALLER_SPIN_NS_DEFAULT
        self._job[WORKER_GAP_NS] = WORKER_GAP_NS_DEFAULT
        self._job[WORKER_SPIN_LONG_NS] = WORKER_SPIN_LONG_NS_DEFAULT
        self._job[WORKER_CALM_NS] = WORKER_CALM_NS_DEFAULT
        self._job[TS_WORKER:TS_WORKER + 2] = (0, 100_000_000)  # 100 ms
        self._job[TS_CALLER:TS_CALLER + 2] = (0, 10_000_000)  # 10 ms
        self._engine, worker, self._run, self._serial, self._run_graph, \
            self._stop = _native()
        # Each worker thread holds the job record (``_buffer``) until it returns: native code
        # reads and writes it to the end, so it must outlive a pool dropped or closed while a
        # worker still sleeps (freed, its memory went to the next NumPy array, which the
        # waking worker's sleeper count then changed by one ulp).
        self._workers = [threading.Thread(target=_serve, args=(worker, self._buffer,
                                                               self._job_addr, k + 1),
                                          daemon=True, name=f"difftape-worker-{k + 1}")
                         for k in range(num_threads - 1)]
        owner_lines = self._buffer[skip + owners:skip + owners + 8 * num_threads]
        for k, w in enumerate(self._workers):
            w.start()
            owner_lines[8 * (k + 1) + OWN_TID] = w.native_id  # (set before start returns)
        # A pool nobody closes (its program dropped without ti.reset(), an in-process engine)
        # stops its workers when it is collected, instead of leaving them asleep forever.
        self._finalizer = weakref.finalize(self, _stop_job, self._stop, self._buffer,
                                           self._job_addr)

    def run(self, fn, ctx: int, begin: int, end: int, weight: int = 1,
            address: int = 0, whole: bool = False) -> None:
        """Run ``fn(ctx, b, e, tid)`` over [begin, end) split into chunks, on all threads
        that show up; ``weight``: the work of one index, in statements. ``address``: ``fn``'s
        entry point when the caller has it (``ctypes.cast`` costs microseconds a launch).
        ``whole``: each chunk runs in one call, claimed in index order, never in grains (a
        task with per-chunk partial sums: its boundaries decide its result's bits)."""
        n = end - begin
        if self.num_threads == 1 or n <= 1:
            fn(ctx, begin, end, 0)
            return
        chunk = max(-(-n // (self.num_threads * self.CHUNKS_PER_THREAD)),
                    -(-self.MIN_CHUNK_WORK // max(1, weight)))
        if chunk >= n:
            fn(ctx, begin, end, 0)
            return
        addr = address or ctypes.cast(fn, ctypes.c_void_p).value
        self._run(self._job_addr, addr, ctx, begin, end, chunk, -(-n // chunk),
                  1 if whole else self.num_threads)

    def run_chunks(self, fn, ctx: int, begin: int, end: int, chunk: int,
                   threaded: bool = True, address: int = 0) -> None:
        """Run ``fn`` over [begin, end) in chunks of exactly ``chunk`` indices (the last one
        shorter), whatever the thread count: an ordered task's results depend on its chunk
        boundaries. Not ``threaded`` (small work) or on one thread: the chunks in order on
        the calling thread. With ``address`` (the entry point), ``fn`` may be None."""
        addr = address or ctypes.cast(fn, ctypes.c_void_p).value
        if threaded and self.num_threads > 1:
            # Claimed in index order (one lane): an ordered task's chunk waits for the
            # previous one's commit, which must already be claimed.
            self._run(self._job_addr, addr, ctx, begin, end, chunk, -(-(end - begin) // chunk),
                      1)
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

    def stats(self) -> dict[str, int]:
        """Counters since the pool started: ``launches`` (parallel runs), ``caller_sleeps``
        (times a launch's caller slept waiting for chunks other threads held) and
        ``caller_wait_s`` (time the caller spent waiting for them, spinning or asleep)."""
        return {"launches": int(self._job[LAUNCHES]),
                "caller_sleeps": int(self._job[CALLER_SLEEPS]),
                "caller_wait_s": int(self._job[CALLER_WAIT_NS]) * 1e-9}

    def close(self) -> None:
        self._finalizer()  # dt_stop, once
        for w in self._workers:
            w.join(timeout=1.0)
