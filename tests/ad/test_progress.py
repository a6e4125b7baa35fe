"""Progress bars (difftape/runtime/progress.py) where a user waits: a long Tape's
back-propagation, Jacobians and Hessians built column by column. tqdm draws them (on stderr
outside Jupyter); without tqdm, or with DIFFTAPE_PROGRESS=0, nothing is shown and the results
are the same. The bars' delay and redraw interval are 0 here. Taichi shows no bars:
difftape-only.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

pytestmark = pytest.mark.difftape_only


@pytest.fixture
def now(monkeypatch):
    """Bars appear at once (not after a second) and draw every step (so the last is seen
    before a finished bar is cleared)."""
    from difftape.runtime import progress

    pytest.importorskip("tqdm", reason="pip install tqdm (the test extra)")
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    monkeypatch.setattr(progress, "REDRAW_S", 0.0)
    monkeypatch.delenv("DIFFTAPE_PROGRESS", raising=False)


def _rollout(ti, steps: int):
    """x_{k+1} = x_k * 1.01 + 0.1 over ``steps`` launches; loss = sum(x_N)."""
    x = ti.field(ti.f64, 8, needs_grad=True)
    L = ti.field(ti.f64, (), needs_grad=True)

    @ti.kernel
    def step():
        for i in x:
            x[i] = x[i] * 1.01 + 0.1

    @ti.kernel
    def total():
        for i in x:
            L[None] += x[i]

    x.from_numpy(np.arange(8.0))
    with ti.ad.Tape(L):
        for _ in range(steps):
            step()
        total()
    return x


def test_long_tape_shows_its_backward_pass(ti, now, capsys):
    x = _rollout(ti, 99)
    err = capsys.readouterr().err
    assert "Tape backward" in err and "100/100" in err, err
    # The literal 1.01 is an f32 (the default float), as in Taichi, also times an f64 field.
    np.testing.assert_allclose(x.grad.to_numpy(), np.full(8, float(np.float32(1.01)) ** 99),
                               rtol=1e-12)


def test_short_tape_shows_nothing(ti, now, capsys):
    from difftape.ad.tape import PROGRESS_MIN_LAUNCHES

    _rollout(ti, PROGRESS_MIN_LAUNCHES - 2)
    assert capsys.readouterr().err == ""


def test_jacobian_and_hessian_show_their_columns(ti, now, capsys):
    x = ti.field(ti.f64, 5, needs_grad=True, needs_dual=True)
    y = ti.field(ti.f64, 3, needs_grad=True, needs_dual=True)
    L = ti.field(ti.f64, (), needs_grad=True, needs_dual=True)
    a = np.array([0.5, -1.0, 2.0, 0.25, 1.5])

    @ti.kernel
    def f():
        for i in y:
            y[i] = x[i] * x[i + 1]

    @ti.kernel
    def g():
        for i in x:
            L[None] += x[i] * x[i] * x[i]

    x.from_numpy(a)
    jf = ti.ad.jacobian(f, x, y, mode="forward")
    err = capsys.readouterr().err
    assert "jacobian (forward)" in err and "5/5" in err, err
    jr = ti.ad.jacobian(f, x, y, mode="reverse")
    err = capsys.readouterr().err
    assert "jacobian (reverse)" in err and "3/3" in err, err
    truth = np.zeros((3, 5))
    for i in range(3):
        truth[i, i], truth[i, i + 1] = a[i + 1], a[i]
    np.testing.assert_allclose(jf, truth, rtol=1e-12)
    np.testing.assert_allclose(jr, truth, rtol=1e-12)
    h = ti.ad.hessian(g, L, x)
    err = capsys.readouterr().err
    assert "hessian" in err and "5/5" in err, err
    np.testing.assert_allclose(h, np.diag(6 * a), rtol=1e-12)


def test_off_by_environment_and_without_tqdm(ti, now, capsys, monkeypatch):
    from difftape.runtime import progress

    monkeypatch.setenv("DIFFTAPE_PROGRESS", "0")
    x = _rollout(ti, 99)
    assert capsys.readouterr().err == ""
    # The literal 1.01 is an f32 (the default float), as in Taichi, also times an f64 field.
    np.testing.assert_allclose(x.grad.to_numpy(), np.full(8, float(np.float32(1.01)) ** 99),
                               rtol=1e-12)
    ti.reset()
    ti.init(arch=ti.cpu)
    monkeypatch.delenv("DIFFTAPE_PROGRESS")
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # `import tqdm.auto` fails
    x = _rollout(ti, 99)
    assert capsys.readouterr().err == ""
    # The literal 1.01 is an f32 (the default float), as in Taichi, also times an f64 field.
    np.testing.assert_allclose(x.grad.to_numpy(), np.full(8, float(np.float32(1.01)) ** 99),
                               rtol=1e-12)
    # Asked for explicitly, a bar without tqdm is refused, saying how to get one.
    with pytest.raises(ti.DifftapeError, match="pip install tqdm"):
        progress.bar(3, "job", show=True)
