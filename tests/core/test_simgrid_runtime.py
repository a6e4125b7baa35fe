"""The grid launch protocol (runtime/grid.py) on the simulated grid, driven directly.

A task that takes private copies from the device heap can overflow too (the heap runs out on
a GPU; libc's never does here), and such a task may draw random numbers and scatter-add. The
launcher's rerun must then restore what the failed attempt wrote and the random states it
advanced. Here the task's grid driver is wrapped so that its first attempt reports an overflow
after running to the end, as a thread whose heap ran out would leave it.
"""

import ctypes

import numpy as np
import pytest

import difftape as ti
from difftape.runtime import grid, program

pytestmark = pytest.mark.difftape_only


@pytest.fixture
def prog():
    ti.init(arch=ti.cpu, simulate_grid=(3, 4), random_seed=11)
    yield program.get()
    ti.reset()


def _scatter_kernel(n, bins):
    idx = ti.field(ti.i32, shape=n)
    count = ti.field(ti.i32, shape=bins)
    noise = ti.field(ti.f64, shape=n)

    @ti.kernel
    def k():
        for i in idx:
            count[idx[i]] += 1
            noise[i] = ti.random(ti.f64)

    idx.from_numpy((np.arange(n) * 7 % bins).astype(np.int32))
    return count, noise, k


class _Flaky:
    """A launcher over the program's own: each launch runs the task (unless ``run`` is
    False), then, on the calls ``overflows(call number)`` names, sets the overflow flag in the
    launch context in (simulated) device memory, as a thread whose heap ran out would. Both
    are enqueued on the program's stream, in order, as the launch itself is."""

    def __init__(self, inst, overflows, run=True):
        self.real, self.slot = inst.grid.launcher, inst.layout.overflow
        self.overflows, self.run, self.calls = overflows, run, []
        self.grid, self.allocator = self.real.grid, self.real.allocator
        inst.grid.launcher = self

    def launch(self, entry, ctx):
        if self.run:
            self.real.launch(entry, ctx)
        self.calls.append(1)
        if self.overflows(len(self.calls)):
            def overflow():
                ctypes.c_int64.from_address(ctx + 8 * self.slot).value = 1
            self.real.memory.stream.enqueue(overflow)


def _overflowing_once(inst):
    """The kernel's launches report an overflow on their first call (after running)."""
    return _Flaky(inst, lambda n: n == 1).calls


def test_rerun_restores_scatter_targets_and_random_states(prog):
    n, bins = 200, 5
    count, noise, k = _scatter_kernel(n, bins)
    k()  # compiles; a normal launch
    inst = k._fast
    assert grid.may_overflow(inst.ir, 0)  # the scatter is privatized: heap copies
    rng_before = prog.rng.read().copy()  # (device memory: through the sync points)
    count.fill(0)
    k()
    want_count, want_noise, want_rng = count.to_numpy(), noise.to_numpy(), prog.rng.read().copy()

    prog.rng.write()[:] = rng_before
    count.fill(0)
    calls = _overflowing_once(inst)
    k()
    assert len(calls) == 2 and inst.grid.reruns == 1
    np.testing.assert_array_equal(count.to_numpy(), want_count)  # added once, not twice
    np.testing.assert_array_equal(noise.to_numpy(), want_noise)  # the same draws
    np.testing.assert_array_equal(prog.rng.read(), want_rng)
    np.testing.assert_array_equal(want_count, np.bincount(np.arange(n) * 7 % bins))


def test_a_pool_beyond_the_limit_is_refused(prog, monkeypatch):
    """A launch that keeps overflowing stops at MAX_POOL_BYTES with an error saying so."""
    count, noise, k = _scatter_kernel(16, 4)
    k()
    inst = k._fast
    monkeypatch.setattr(grid, "MAX_POOL_BYTES", 3 * 4 * 8 * grid.FIRST_STACK_SLOTS * 4)

    _Flaky(inst, lambda n: True, run=False)
    with pytest.raises(ti.DifftapeError, match="reverse-mode stacks need more than 256 slots"):
        k()  # 64 -> 128 -> 256 slots per thread, then over the limit


def test_a_rerun_prints_once_and_adds_atomics_once(prog, capfd):
    """A task that may overflow and prints: the records of an attempt that overflowed are
    discarded before the rerun from the snapshot, and those of the attempt that fits are
    written. The output appears once, and what the task adds atomically into a field and an
    ndarray argument is added once."""
    n, bins = 24, 4
    idx = ti.field(ti.i32, shape=n)
    count = ti.field(ti.i32, shape=bins)
    total = ti.field(ti.i64, shape=())
    idx.from_numpy((np.arange(n) * 5 % bins).astype(np.int32))

    @ti.kernel
    def k(a: ti.types.ndarray()):
        for i in idx:
            count[idx[i]] += 1  # privatized: heap copies, so the task may overflow
            ti.atomic_add(total[None], i)
            ti.atomic_add(a[i % 3], 1)
            if i % 10 == 3:
                print("index", i)

    a = np.zeros(3, np.int32)
    k(a)  # compiles; a normal launch
    inst = next(iter(k._instances.values()))  # the one the call compiled
    assert grid.may_overflow(inst.ir, 0) and grid.prints(inst.ir, 0)
    assert sorted(capfd.readouterr().out.splitlines()) == ["index 13", "index 23", "index 3"]
    count.fill(0)
    total[None] = 0
    a[:] = 0
    calls = _overflowing_once(inst)
    k(a)
    assert sorted(capfd.readouterr().out.splitlines()) == ["index 13", "index 23", "index 3"]
    # overflowed (its lines discarded), fits (its lines written): two runs, not a third to
    # print (as the quiet-flag protocol this replaced needed)
    assert len(calls) == 2 and inst.grid.reruns == 1
    np.testing.assert_array_equal(count.to_numpy(), np.bincount(np.arange(n) * 5 % bins))
    assert total[None] == n * (n - 1) // 2
    np.testing.assert_array_equal(a, np.bincount(np.arange(n) % 3))
