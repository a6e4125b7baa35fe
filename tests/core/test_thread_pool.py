"""The native thread pool (runtime/parallel.py): every index once, whoever runs it, and a
launch that does not fight the threads it waits for.

The pool is driven here with Python task functions (ctypes callbacks), so the tests see which
thread ran which chunk. A busy process pinned to the second core (``spinner``) makes workers
late and parks them mid-chunk, as on a loaded machine.
"""

import ctypes
import faulthandler
import gc
import os
import threading
import time
import weakref

import pytest

from difftape.runtime.parallel import GRAINS_PER_CHUNK, ThreadPool

pytestmark = pytest.mark.difftape_only

TASK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int32)


@pytest.fixture
def watchdog():
    """A hung launch fails the run with every thread's stack instead of hanging it."""
    faulthandler.dump_traceback_later(300, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture
def pool():
    p = ThreadPool(4)
    yield p
    p.close()


def test_every_index_runs_once_with_a_busy_core(pool, spinner, watchdog):
    seen = []
    task = TASK(lambda ctx, b, e, tid: seen.append((b, e, tid)))
    for k in range(300):
        begin, n = k % 7, 2 + (k * 37) % 900
        weight = (1, 64, 4096)[k % 3]
        seen.clear()
        pool.run(task, 0, begin, begin + n, weight)
        spans = sorted((b, e) for b, e, _ in seen)
        assert spans[0][0] == begin and spans[-1][1] == begin + n
        assert all(e0 == b1 for (_, e0), (b1, _) in zip(spans, spans[1:], strict=False))
        assert all(0 <= tid < 4 for _, _, tid in seen)


def test_run_chunks_keeps_its_chunk_boundaries(pool, spinner, watchdog):
    seen = []
    task = TASK(lambda ctx, b, e, tid: seen.append((b, e)))
    for n in (1, 5, 64, 1000, 1003):
        seen.clear()
        pool.run_chunks(task, 0, 10, 10 + n, 7)
        assert sorted(seen) == [(b, min(b + 7, 10 + n)) for b in range(10, 10 + n, 7)]


def test_successive_claims_run_distant_chunks(watchdog):
    """Chunks that run at the same time are far apart in the range: claim k + 1 is half the
    range after claim k on two threads. In index order, threads scattering into a grid
    (MPM's particle-to-grid) ran on neighbouring chunks and fought over the same cache
    lines. The first chunk to start waits until another has started (whoever runs it): the
    two are the first two claims, whether the worker showed up or the first thread came back.
    Which of the two records itself first is a race between the threads, so their order is
    not checked, only that they are half the range apart. Chunks run whole here (one grain
    each): a thread with no chunk left to claim takes over half of what another has not
    started, which is what the grain tests check."""
    pool = ThreadPool(2)
    pool._job[GRAINS_PER_CHUNK] = 1
    seen = []
    started = threading.Event()

    def body(ctx, b, e, tid):
        seen.append(b)
        if len(seen) == 1:
            started.wait(2.0)
        else:
            started.set()

    task = TASK(body)
    try:
        for n in (800, 801, 1000):
            seen.clear()
            started.clear()
            pool.run(task, 0, 0, n, 1 << 12)  # chunks of ceil(n / 8)
            chunk = -(-n // 8)
            chunks = -(-n // chunk)
            assert sorted(seen[:2]) == [0, chunk * -(-chunks // 2)]  # the second half's first
            assert sorted(seen) == list(range(0, n, chunk))
    finally:
        pool.close()


def _launch_with_a_parked_worker(whole: bool = False) -> tuple[list, float, float, dict]:
    """Launch 8 chunks of 8 indices on two threads, the worker holding the first piece it
    runs for 0.2 s (as when the OS parks it behind another process) and the caller waiting
    until the worker has claimed one: (the calls made as (begin, end, tid), wall seconds,
    the caller's CPU seconds, the pool's stats)."""
    pool = ThreadPool(2)
    held = threading.Event()
    seen = []

    def body(ctx, b, e, tid):
        seen.append((b, e, tid))
        if tid != 0 and not held.is_set():
            held.set()
            time.sleep(0.2)
        elif tid == 0:
            held.wait(5.0)  # let the worker claim a chunk first

    task = TASK(body)
    try:
        wall, cpu = time.perf_counter(), time.thread_time()
        pool.run(task, 0, 0, 64, 4096, whole=whole)
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        assert held.is_set()
        return seen, wall, cpu, pool.stats()
    finally:
        pool.close()


def test_a_waiting_caller_gives_its_core_away(watchdog):
    """The caller runs every chunk it can, then sleeps until the held one is done instead
    of spinning or yielding, which kept its core busy so that the held chunk could not move
    there."""
    _, wall, cpu, stats = _launch_with_a_parked_worker()
    assert wall >= 0.2
    assert cpu < 0.01, f"the caller used {cpu:.3f} s of CPU waiting {wall:.3f} s"
    assert stats["caller_sleeps"] >= 1


def test_what_a_parked_worker_has_not_started_is_taken_over(watchdog):
    """A worker parked in the first grain of its chunk holds up only that grain: the caller
    runs every other index of the launch, the rest of that chunk included. A worker that
    claimed a chunk used to run all of it, and the launch waited for its next time slice."""
    seen, *_ = _launch_with_a_parked_worker()
    grain = -(-8 // ThreadPool.GRAINS_PER_CHUNK)
    by_worker = [(b, e) for b, e, tid in seen if tid != 0]
    assert len(by_worker) == 1
    (b, e), = by_worker
    assert e - b == grain
    assert sorted(i for b, e, _ in seen for i in range(b, e)) == list(range(64))


def test_a_task_with_partial_sums_runs_whole_chunks(watchdog):
    """``whole`` (a task whose epilogue adds per-chunk partial sums, passes/reduce.py): every
    chunk runs in one call at its fixed boundaries, even when the worker that claimed one is
    parked, so the partial sums, and the bits of the total, do not depend on the timing.
    With grains the parked worker's chunk was split between the two threads."""
    seen, *_ = _launch_with_a_parked_worker(whole=True)
    assert sorted((b, e) for b, e, _ in seen) == [(b, b + 8) for b in range(0, 64, 8)]


def test_reduction_tasks_are_launched_whole():
    """The launcher gives a task with per-chunk partial sums the whole-chunk schedule, and a
    plain map the default one; eager launches and graph replays read the same code."""
    import difftape as ti
    from difftape.frontend.kernel import _ANY, _WHOLE

    ti.init(arch=ti.cpu, cpu_max_num_threads=2)
    x = ti.field(ti.f64, 4096)
    total = ti.field(ti.f64, ())

    @ti.kernel
    def reduce_():
        for i in x:
            total[None] += x[i]

    @ti.kernel
    def scale():
        for i in x:
            x[i] = 2.0 * x[i] + 1.0

    reduce_()
    scale()
    def schedules(kernel) -> list[int]:
        inst = kernel._fast  # a kernel without template parameters: one instance
        return [t[4] for t in inst.tasks]

    assert schedules(reduce_) == [_WHOLE]
    assert schedules(scale) == [_ANY]


def _affinity_after_a_launch(pool: ThreadPool) -> set[int]:
    """The first worker's CPUs once it has run a chunk of a launch made from here: a worker
    sets them when it takes a launch, before its first chunk."""
    worker_ran = threading.Event()

    def body(ctx, b, e, tid):
        if tid == 1:
            worker_ran.set()
        time.sleep(0.0005)

    task = TASK(body)
    while not worker_ran.is_set():
        pool.run(task, 0, 0, 16, 4096)
    return os.sched_getaffinity(pool._workers[0].native_id)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux thread affinity and two CPUs")
def test_workers_keep_off_the_callers_cpu(watchdog):
    """Workers may run anywhere but on the CPU the launching thread is on, and follow it when
    it moves. A launch's futex wake put a sleeping worker on the caller's CPU whenever its
    own was busy (another process there): it preempted the caller and the two took turns on
    one core while the other process had the second."""
    cpus = os.sched_getaffinity(0)
    first, second = sorted(cpus)[:2]
    pool = ThreadPool(2)
    try:
        for cpu in (first, second, first):
            os.sched_setaffinity(0, {cpu})  # this thread (the caller) moves to `cpu`
            assert _affinity_after_a_launch(pool) == cpus - {cpu}
    finally:
        os.sched_setaffinity(0, cpus)
        pool.close()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux thread affinity and two CPUs")
def test_a_waiting_caller_lends_its_cpu_to_the_worker_it_waits_for(watchdog):
    """A worker inside a grain when the caller has nothing left but to wait may run on the
    caller's CPU while the caller sleeps, and gets its own CPUs back when the launch ends.
    Kept off the caller's CPU, a worker the OS parked mid-grain behind another process held
    up the launch until that process's time slice ended, with the caller's core idle."""
    cpus = os.sched_getaffinity(0)
    first = min(cpus)
    pool = ThreadPool(2)
    held = threading.Event()
    during = []

    def body(ctx, b, e, tid):
        if tid != 0 and not held.is_set():
            held.set()
            deadline = time.monotonic() + 5.0
            while True:  # until the caller, out of work, lends its CPU
                during.append(os.sched_getaffinity(0))
                if during[-1] == {first} or time.monotonic() > deadline:
                    break
                time.sleep(0.001)
        elif tid == 0:
            held.wait(5.0)  # let the worker claim a chunk first

    task = TASK(body)
    os.sched_setaffinity(0, {first})  # the caller's CPU
    try:
        pool.run(task, 0, 0, 64, 4096)
        after = os.sched_getaffinity(pool._workers[0].native_id)
    finally:
        os.sched_setaffinity(0, cpus)
        pool.close()
    assert held.is_set() and during[0] == cpus - {first}  # kept off the caller's CPU
    assert during[-1] == {first}  # lent it while the caller waited
    assert after == cpus - {first}  # and kept off it again


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux thread affinity and two CPUs")
def test_workers_go_anywhere_when_oversubscribed_or_asked(watchdog):
    """More threads than CPUs (or keep_off_caller=False): workers keep every CPU."""
    cpus = os.sched_getaffinity(0)
    for pool in (ThreadPool(len(cpus) + 1), ThreadPool(2, keep_off_caller=False)):
        try:
            os.sched_setaffinity(0, {min(cpus)})
            assert _affinity_after_a_launch(pool) == cpus
        finally:
            os.sched_setaffinity(0, cpus)
            pool.close()


def test_idle_workers_sleep(pool):
    task = TASK(lambda ctx, b, e, tid: None)
    for _ in range(50):
        pool.run(task, 0, 0, 256, 4096)
    time.sleep(0.05)  # past the workers' spin budget
    cpu = time.process_time()
    time.sleep(0.3)
    assert time.process_time() - cpu < 0.03


def test_close_stops_sleeping_workers():
    pool = ThreadPool(3)
    time.sleep(0.01)  # the workers are asleep
    pool.close()
    assert not any(w.is_alive() for w in pool._workers)


def _gone(threads, timeout: float = 10.0) -> bool:
    for w in threads:
        w.join(timeout)
    return not any(w.is_alive() for w in threads)


def test_a_dropped_pool_stops_its_workers():
    """A pool collected without close() (a program nobody reset, an in-process engine)
    stops its workers. They used to sleep on in its freed job record, waking every 100 ms
    to change a counter there: the next NumPy array in that memory (a field read back by
    the client) was one ulp off."""
    pool = ThreadPool(3)
    task = TASK(lambda ctx, b, e, tid: None)
    pool.run(task, 0, 0, 64, 4096)
    workers = pool._workers
    del pool
    gc.collect()
    assert _gone(workers)


def test_workers_keep_the_job_record_alive():
    """A worker that has not returned when close() stops waiting for it still owns valid
    memory: the record goes when the last worker returns, not with the pool."""
    pool = ThreadPool(3)
    record = weakref.ref(pool._buffer.base if pool._buffer.base is not None
                         else pool._buffer)
    workers = pool._workers
    blocked = threading.Event()
    gate = threading.Event()

    def hold(ctx, b, e, tid):
        if tid != 0:
            blocked.set()
            gate.wait(10)
        else:
            time.sleep(0.05)  # leave chunks to the workers

    task = TASK(hold)
    caller = threading.Thread(target=pool.run, args=(task, 0, 0, 64, 4096))
    caller.start()
    assert blocked.wait(10)  # a worker is inside a chunk
    pool._finalizer()
    del pool
    gc.collect()
    assert record() is not None  # the busy worker still holds it
    gate.set()
    caller.join(10)
    del caller
    assert _gone(workers)
    gc.collect()
    assert record() is None


def test_a_local_transport_stops_its_engine_threads():
    import difftape as ti
    from difftape.client import LocalTransport

    before = {t for t in threading.enumerate() if t.name.startswith("difftape-worker")}
    ti.init(arch=ti.remote, transport=LocalTransport())
    try:
        x = ti.field(ti.f32, shape=1 << 16)

        @ti.kernel
        def fill():
            for i in x:
                x[i] = i * 0.5

        fill()
        assert x[3] == 1.5
    finally:
        ti.reset()
    after = [t for t in threading.enumerate()
             if t.name.startswith("difftape-worker") and t not in before]
    assert _gone(after)
