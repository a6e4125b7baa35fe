"""Parallel launches while another process keeps the second core busy.

A process spinning on a core of its own (``spinner``: ``taskset -c 1``) makes worker threads
late and parks them in the middle of a chunk, as on a shared machine. Results must not
change: each program below runs once on a quiet machine and many times with the spinner, and
every run must equal the quiet one bit for bit (and NumPy's). Only operations whose result
does not depend on the order of chunks are used (element-wise maps, integer atomics, owned
adjoints), so any difference would be a chunk lost, run twice, or run with the wrong job.
"""

import faulthandler

import numpy as np
import pytest

from tests.conftest import start_spinner, stop_spinner

N = 1 << 18


@pytest.fixture
def watchdog():
    """A hung launch fails the run with every thread's stack instead of hanging it."""
    faulthandler.dump_traceback_later(300, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def _program(ti):
    x = ti.field(ti.f32, N, needs_grad=True)
    y = ti.field(ti.f32, N)
    hist = ti.field(ti.i32, 64)
    total = ti.field(ti.i64, ())
    loss = ti.field(ti.f32, (), needs_grad=True)

    @ti.kernel
    def fill(seed: ti.i32):
        for i in x:
            x[i] = ti.cast((i * 7919 + seed) % 1000, ti.f32) * 0.001 - 0.5

    @ti.kernel
    def map_and_count(scale: ti.f32):
        for i in x:
            y[i] = ti.sin(x[i] * scale) * x[i]
            ti.atomic_add(hist[i % 64], 1 + i % 3)
            ti.atomic_add(total[None], ti.cast(i, ti.i64))

    @ti.kernel
    def square_sum():
        for i in x:
            loss[None] += x[i] * x[i]

    def run(rounds: int, seed: int) -> dict:
        hist.fill(0)
        total[None] = 0
        fill(seed)
        for r in range(rounds):
            map_and_count(1.0 + 0.25 * r)
        with ti.ad.Tape(loss=loss):
            square_sum()
        return {"x": x.to_numpy(), "y": y.to_numpy(), "hist": hist.to_numpy(),
                "total": int(total[None]), "grad": x.grad.to_numpy()}

    return run


def test_parallel_results_do_not_change_with_a_busy_core(ti, watchdog):
    run = _program(ti)
    rounds = 40
    quiet = run(rounds, seed=3)
    i = np.arange(N)
    xs = ((i * 7919 + 3) % 1000).astype(np.float32) * np.float32(0.001) - np.float32(0.5)
    np.testing.assert_allclose(quiet["x"], xs, rtol=0, atol=1e-7)
    last = np.float32(1.0 + 0.25 * (rounds - 1))
    xq = quiet["x"]
    np.testing.assert_allclose(quiet["y"], np.sin(xq * last) * xq, rtol=1e-5, atol=1e-6)
    per = np.bincount(i % 64, weights=1 + i % 3).astype(np.int64) * rounds
    np.testing.assert_array_equal(quiet["hist"], per)
    assert quiet["total"] == rounds * (N * (N - 1) // 2)
    np.testing.assert_array_equal(quiet["grad"], 2 * xq)  # 2 * x is exact in f32

    proc = start_spinner()
    try:
        for _ in range(5):
            busy = run(rounds, seed=3)
            for k, v in quiet.items():
                np.testing.assert_array_equal(busy[k], v, err_msg=k)
    finally:
        stop_spinner(proc)
