"""Differentiable steps captured as graphs (``ti.graph.capture()``): a ``ti.ad.Tape`` with its
reverse launches, ``ti.ad.FwdMode`` launches and ``kernel.grad()`` are recorded like any launch
and replayed natively; every field, gradient and tangent must have the bytes the eager step
leaves. The MPM rollout is tests/ad/test_mpm_modes.py's; it runs with ``deterministic=True``
because without it its scatter atomics make two eager runs differ in the last bits (a replay
is compared with eager runs, so they must be reproducible).
"""

import numpy as np
import pytest

from tests.lang.test_graph import assert_replay_matches_eager

from .test_mpm_modes import _build

pytestmark = pytest.mark.difftape_only


def test_tape_step_with_gradient_descent_replays_bit_for_bit(ti):
    ti.init(arch=ti.cpu, default_fp=ti.f64, deterministic=True)
    init_v, loss, rollout = _build(ti)
    init_v.from_numpy(np.array([0.7, -0.4]))

    @ti.kernel
    def descend(lr: ti.f64):
        init_v[None] -= lr * init_v.grad[None]

    def step(lr=0.05):
        with ti.ad.Tape(loss=loss):
            rollout()
        descend(lr)

    g = assert_replay_matches_eager(ti, step, declare=lambda g: {"lr": g.input("lr", 0.05)},
                                    replays=[{"lr": 0.05}, {"lr": 0.02}, {"lr": 0.1}])
    assert g.launches > 40  # forward and adjoint launches of the rollout
    assert np.all(np.abs(init_v.grad.to_numpy()) > 1e-3)  # a real gradient flowed


def test_fwdmode_step_replays_bit_for_bit(ti):
    ti.init(arch=ti.cpu, default_fp=ti.f64, deterministic=True)
    init_v, loss, rollout = _build(ti)
    init_v.from_numpy(np.array([0.7, -0.4]))

    def step():
        with ti.ad.FwdMode(loss=loss, param=init_v, seed=[1.0, 0.5]):
            rollout()

    assert_replay_matches_eager(ti, step, repeats=2)
    assert abs(loss.dual[None]) > 1e-3


def test_kernel_grad_calls_replay_bit_for_bit(ti):
    n = 200
    x = ti.field(ti.f32, shape=n, needs_grad=True)
    y = ti.field(ti.f32, shape=n, needs_grad=True)

    @ti.kernel
    def f(a: ti.f32):
        for i in x:
            y[i] = ti.exp(ti.sin(x[i]) * a) + x[i] * x[i]

    x.from_numpy(np.linspace(-1, 1, n).astype(np.float32))

    def step(a=1.5):
        f(a)
        y.grad.fill(1.0)
        f.grad(a)

    assert_replay_matches_eager(ti, step, declare=lambda g: {"a": g.input("a", ti.f32)},
                                replays=[{"a": 1.5}, {"a": -0.5}])
    xs = np.linspace(-1, 1, n).astype(np.float32).astype(np.float64)
    want = sum(np.exp(np.sin(xs) * a) * np.cos(xs) * a + 2 * xs for a in (1.5, -0.5))
    np.testing.assert_allclose(x.grad.to_numpy(), want, rtol=1e-5, atol=1e-5)
