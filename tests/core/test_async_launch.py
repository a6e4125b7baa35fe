"""Asynchronous launches on a grid (runtime/grid.py), checked on the simulated grid.

A launch that needs nothing back is enqueued on the program's stream and the host goes on;
the simulated grid's stream is deferred (runtime/storage.py's SimulatedStream): nothing
enqueued runs until the host synchronises, so these tests see exactly what a GPU may show
when a sync point is missing, deterministically. The host waits at ti.sync(), reads of
device storage, return values, printing kernels, tasks that may overflow their stacks,
debug=True launches and the program's end; a failed check of an asynchronous launch is
raised there, and the launches queued after it do not run.
"""

import ctypes
import gc

import numpy as np
import pytest

import difftape as ti
from difftape.runtime import grid, program

pytestmark = pytest.mark.difftape_only


@pytest.fixture
def prog():
    ti.init(arch=ti.cpu, simulate_grid=(3, 4), check_out_of_bound=True)
    yield program.get()
    ti.reset()


def _device_values(storage, n):
    """What device memory holds now, read around every sync point (a test's peek)."""
    return np.ctypeslib.as_array((ctypes.c_float * n).from_address(storage.address)).copy()


def _fill_kernel(n):
    x = ti.field(ti.f32, shape=n)

    @ti.kernel
    def fill(v: ti.f32):
        for i in x:
            x[i] = v + i

    return x, fill


def test_a_launch_returns_before_it_runs_and_a_read_waits_for_it(prog):
    x, fill = _fill_kernel(8)
    fill(1.0)
    assert not prog.allocator.memory.stream.is_done()  # queued, not run
    np.testing.assert_array_equal(_device_values(x._storage, 8), np.zeros(8))
    np.testing.assert_array_equal(x.to_numpy(), 1.0 + np.arange(8))  # the sync point
    assert prog.allocator.memory.stream.is_done()
    fill(2.0)
    assert x[3] == 5.0  # element reads wait too
    fill(3.0)
    ti.sync()
    np.testing.assert_array_equal(_device_values(x._storage, 8), 3.0 + np.arange(8))


def test_a_read_that_skips_the_sync_point_sees_stale_data(prog, monkeypatch):
    """The deferred stream catches a missing sync: with the storage's sync point removed, a
    read downloads memory the queued launch has not written yet."""
    x, fill = _fill_kernel(8)
    fill(1.0)
    np.testing.assert_array_equal(x.to_numpy(), 1.0 + np.arange(8))
    monkeypatch.setattr(prog.allocator, "wait", lambda: None)  # the sync removed
    fill(5.0)
    stale = x.to_numpy()
    np.testing.assert_array_equal(stale, 1.0 + np.arange(8))  # the earlier launch's values
    assert not np.array_equal(stale, 5.0 + np.arange(8))
    monkeypatch.undo()
    fill(5.0)
    np.testing.assert_array_equal(x.to_numpy(), 5.0 + np.arange(8))


def test_each_pending_launch_keeps_its_own_arguments(prog, monkeypatch):
    """Launch contexts are not rewritten while a launch that uses them is pending: a ring of
    contexts per kernel, grown while all are in flight, up to MAX_CONTEXTS; then a launch
    waits for the oldest."""
    monkeypatch.setattr(grid, "MAX_CONTEXTS", 4)
    acc = ti.field(ti.i64, shape=5)

    @ti.kernel
    def add(v: ti.i64):
        for i in acc:
            acc[i] += v * (i + 1)

    for v in range(1, 11):
        add(v)
    assert len(add._fast.grid.ring) == 4
    np.testing.assert_array_equal(acc.to_numpy(), 55 * np.arange(1, 6))


def test_an_asynchronous_failure_is_raised_at_the_next_sync_point(prog):
    x = ti.field(ti.f32, shape=4)
    y = ti.field(ti.i32, shape=3)

    @ti.kernel
    def poke(j: ti.i32):
        for i in range(2):
            x[j + i] = 1.0

    @ti.kernel
    def mark(v: ti.i32):
        for i in y:
            y[i] = v

    poke(0)
    poke(8)  # fails on the device; the host does not know yet
    mark(7)  # queued after the failed launch: must not run
    with pytest.raises(ti.IndexOutOfRangeError,
                       match=r"index 8 out of range for axis 0 of 'x' with shape \(4,\)\n"
                             r"  in kernel 'poke', .*test_async_launch.py:\d+\n"
                             r"    x\[j \+ i\] = 1.0"):
        ti.sync()
    np.testing.assert_array_equal(y.to_numpy(), [0, 0, 0])  # mark did not run
    np.testing.assert_array_equal(x.to_numpy(), [1, 1, 0, 0])
    mark(3)  # the program goes on: the error was reported once and cleared
    np.testing.assert_array_equal(y.to_numpy(), [3, 3, 3])
    ti.sync()

    poke(3)  # a read of what a launch wrote is a sync point too
    with pytest.raises(ti.IndexOutOfRangeError, match=r"index 4 out of range (?s:.)*kernel 'poke'"):
        x.to_numpy()

    @ti.kernel
    def total() -> ti.f32:
        s = 0.0
        for i in x:
            s += x[i]
        return s

    poke(5)
    with pytest.raises(ti.IndexOutOfRangeError, match=r"index 5 out of range (?s:.)*kernel 'poke'"):
        total()  # a launch that returns a value waits, and reports the earlier failure
    assert total() == 3.0


def test_debug_launches_that_can_fail_are_synchronous(prog):
    """As Taichi checks for errors after every launch under debug=True: the error is raised
    by the failing call."""
    ti.init(arch=ti.cpu, simulate_grid=(3, 4), debug=True)
    x = ti.field(ti.f32, shape=4)

    @ti.kernel
    def poke(j: ti.i32):
        for _ in range(1):
            x[j] = 1.0

    with pytest.raises(ti.IndexOutOfRangeError, match="index 4 out of range"):
        poke(4)
    poke(1)
    np.testing.assert_array_equal(x.to_numpy(), [0, 1, 0, 0])


def test_an_asynchronous_assert_reports_its_message_values(prog, monkeypatch):
    """The status block carries the failed assert's message values (up to MAX_VALUES, of
    any type), written by the thread that claimed it: the message raised at the sync point
    shows one failing thread's values, as the synchronous launch's does."""
    init = grid.GridKernel.__init__

    def asynchronous_errors(self, *args, **kwargs):  # as without debug=True
        init(self, *args, **{**kwargs, "sync_errors": False})

    monkeypatch.setattr(grid.GridKernel, "__init__", asynchronous_errors)
    ti.init(arch=ti.cpu, simulate_grid=(3, 4), debug=True)
    n = 50
    x = ti.field(ti.i64, shape=n)
    y = ti.field(ti.f64, shape=n)
    x.from_numpy(np.arange(n, dtype=np.int64) * 3_000_000_000)
    y.from_numpy(np.arange(n) / 3.0)

    @ti.kernel
    def check(limit: ti.i64):
        for i in x:
            assert x[i] < limit, f"i={i} x={x[i]} y={y[i]} h={ti.cast(i, ti.u8)}"

    check(3_000_000_000 * n)
    assert check._fast.grid.asynchronous
    check(3_000_000_000 * 20)  # fails on the device: raised at the sync point
    with pytest.raises(ti.KernelAssertionError) as info:
        ti.sync()
    first = str(info.value).splitlines()[0]
    i = int(first.split()[0][2:])
    assert 20 <= i < n
    y_text = repr(i / 3.0).removesuffix(".0")  # Taichi's text of a float: no trailing .0
    assert first == f"i={i} x={i * 3_000_000_000} y={y_text} h={i}"


def test_the_program_end_waits_and_reports_a_failure_still_queued(prog):
    x = ti.field(ti.f32, shape=4)

    @ti.kernel
    def poke(j: ti.i32):
        for _ in range(1):
            x[j] = 1.0

    poke(6)
    with pytest.raises(ti.IndexOutOfRangeError, match="index 6 out of range"):
        ti.reset()
    assert program._current is None  # released all the same
    ti.init(arch=ti.cpu, simulate_grid=(3, 4))


def test_memory_a_pending_launch_uses_is_freed_after_it_ends(prog):
    """A temporary ndarray dropped while the launch that reads it is queued is freed only
    when the stream has drained."""
    out = ti.field(ti.f32, shape=6)

    @ti.kernel
    def copy(a: ti.types.ndarray()):
        for i in out:
            out[i] = a[i] * 2.0

    copy(np.zeros(6, np.float32))  # compiled
    ti.sync()
    memory = prog.allocator.memory
    held = memory.bytes_in_use
    a = ti.ndarray(ti.f32, shape=6)
    a.from_numpy(np.arange(6, dtype=np.float32))
    copy(a)
    del a
    assert memory.bytes_in_use == held + 24  # still held: the queued launch reads it
    np.testing.assert_array_equal(out.to_numpy(), 2.0 * np.arange(6))
    assert memory.bytes_in_use == held
    copy(np.arange(6, dtype=np.float32) + 1)  # a NumPy argument: staged, then dropped
    np.testing.assert_array_equal(out.to_numpy(), 2.0 * (np.arange(6) + 1))


def test_snapshot_and_stack_blocks_are_reused_between_launches(prog, monkeypatch):
    """A task that may overflow runs from snapshots with a stack pool: both are blocks kept
    by the program and grown on demand, not allocated per launch."""
    n = 40
    x = ti.field(ti.f64, shape=n, needs_grad=True)
    loss = ti.field(ti.f64, shape=(), needs_grad=True)

    @ti.kernel
    def k():
        for i in x:
            v = x[i]
            for _ in range(i % 5 + 1):
                v = ti.sin(v) + 0.1
            loss[None] += v

    x.from_numpy(np.linspace(0, 1, n))
    with ti.ad.Tape(loss=loss):
        k()
    first = x.grad.to_numpy().copy()
    assert grid.may_overflow(next(iter(k.grad.instances.values())).ir, 0)  # stacks
    memory = prog.allocator.memory
    allocs = []
    real_alloc = memory.alloc
    monkeypatch.setattr(memory, "alloc", lambda nbytes: allocs.append(nbytes) or
                        real_alloc(nbytes))
    for _ in range(3):
        with ti.ad.Tape(loss=loss):
            k()
        np.testing.assert_array_equal(x.grad.to_numpy(), first)
    assert allocs == []


def test_a_kernel_dropped_while_its_launch_is_pending_stays_loaded(prog):
    """The queue holds a pending launch's code until the next sync point: a kernel made and
    dropped at once (a builder's helper) is not unloaded under its launch."""
    x = ti.field(ti.f32, shape=8)

    def make():
        @ti.kernel
        def fill(v: ti.f32):
            for i in x:
                x[i] = v + i

        return fill

    make()(4.0)
    gc.collect()
    np.testing.assert_array_equal(x.to_numpy(), 4.0 + np.arange(8))
