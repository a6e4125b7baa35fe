"""difftape's reverse-mode machinery: stacks, reductions, rule checks, caching, grad_check.

Truth here is analytic; the language-level gradient tests are in tests/ad.
"""

import numpy as np
import pytest

import difftape as ti
from difftape.ir.nodes import walk
from difftape.ir.passes import run_pipeline
from difftape.runtime import program


@pytest.fixture
def prog():
    ti.init(arch=ti.cpu, default_fp=ti.f64)
    yield
    ti.reset()


def test_the_loop_stack_grows_past_its_first_allocation(prog):
    # 5000 iterations of a carried local push 5000 slots: the stack starts at 256 and must
    # grow (realloc) several times, per thread.
    n, steps = 64, 5000
    x = ti.field(float, n, needs_grad=True)
    y = ti.field(float, n, needs_grad=True)

    @ti.kernel
    def run(m: ti.i32):
        for i in x:
            s = x[i]
            for _ in range(m):
                s = ti.sin(s) * 0.999 + 0.001
            y[i] = s

    xs = np.linspace(-1, 1, n)
    x.from_numpy(xs)
    run(steps)
    y.grad.fill(1.0)
    run.grad(steps)
    want = np.ones(n)
    s = xs.copy()
    for _ in range(steps):
        want *= np.cos(s) * 0.999
        s = np.sin(s) * 0.999 + 0.001
    np.testing.assert_allclose(x.grad.to_numpy(), want, rtol=1e-9, atol=1e-300)


def test_kernel_level_reduction_is_exact_across_threads(prog):
    n = 1 << 20
    x = ti.field(float, n)
    out = ti.field(float, ())

    @ti.kernel
    def total():
        s = 0.0
        for i in x:
            s += x[i]
        out[None] = s

    x.from_numpy(np.ones(n))
    total()
    assert out[None] == n


def test_owned_elements_are_updated_without_atomics(prog):
    x = ti.field(float, 16, needs_grad=True)
    y = ti.field(float, 16, needs_grad=True)

    @ti.kernel
    def k():
        for i in x:
            y[i] = x[i] * x[i]

    ir = run_pipeline(k.build_ir(program.get(), (), "grad"))
    assert not [s for t in ir.tasks for s in walk(t.body) if s.op == "atomic"]


def test_scatter_keeps_its_atomics(prog):
    x = ti.field(float, 16, needs_grad=True)
    y = ti.field(float, 16, needs_grad=True)

    @ti.kernel
    def k():
        for i in x:
            y[(i * 3) % 16] += x[i]

    ir = run_pipeline(k.build_ir(program.get(), (), "grad"))
    # the adjoint of reading x[i] is owned; the primal scatter has none in the adjoint
    assert not [s for t in ir.tasks for s in walk(t.body) if s.op == "atomic"]
    # the primal's scatter into a small field goes to a per-chunk copy, drained atomically
    ir = run_pipeline(k.build_ir(program.get(), ()))
    assert not [s for t in ir.tasks for s in walk(t.body) if s.op == "atomic"]
    assert [s for t in ir.tasks for s in walk(t.epilogue) if s.op == "atomic"]
    # ... into a large one it stays atomic
    big = ti.field(float, 1 << 16)

    @ti.kernel
    def k2():
        for i in x:
            big[(i * 3) % 16] += x[i]

    ir = run_pipeline(k2.build_ir(program.get(), ()))
    assert [s for t in ir.tasks for s in walk(t.body) if s.op == "atomic"]


def test_rule_error_names_kernel_line_rule_and_fix(prog):
    b = ti.field(float, (), needs_grad=True)
    loss = ti.field(float, (), needs_grad=True)

    @ti.kernel
    def bad():
        loss[None] = b[None] * b[None]
        b[None] += 1.0

    with pytest.raises(ti.GradientRuleError) as info:
        with ti.ad.Tape(loss):
            bad()
    text = str(info.value)
    assert "kernel 'bad'" in text and "b[None] += 1.0" in text
    assert "rule #1" in text and "Fix:" in text
    assert b[None] == 0.0  # refused before it ran


def test_a_read_the_gradient_does_not_need_is_not_refused(prog):
    # d(2b)/db does not depend on b, so modifying b afterwards cannot change the gradient.
    b = ti.field(float, (), needs_grad=True)
    loss = ti.field(float, (), needs_grad=True)

    @ti.kernel
    def fine():
        loss[None] = b[None] * 2.0
        b[None] += 1.0

    with ti.ad.Tape(loss):
        fine()
    assert b.grad[None] == 2.0


def test_validation_refuses_a_cross_kernel_overwrite(prog):
    f = ti.field(float, 8, needs_grad=True)
    loss = ti.field(float, (), needs_grad=True)

    @ti.kernel
    def use():
        for i in f:
            loss[None] += f[i] * f[i]

    @ti.kernel
    def scale():
        for i in f:
            f[i] = f[i] * 2.0

    f.fill(1.0)
    with pytest.raises(ti.GradientRuleError, match="'scale'"):
        with ti.ad.Tape(loss, validation=True):
            use()
            scale()


def test_random_values_cannot_feed_a_gradient(prog):
    x = ti.field(float, 4, needs_grad=True)
    y = ti.field(float, 4, needs_grad=True)

    @ti.kernel
    def noisy():
        for i in x:
            y[i] = x[i] * ti.random()

    with pytest.raises(ti.GradientRuleError, match="ti.random"):
        noisy.grad()


def test_grad_check_names_the_entries_that_disagree(prog):
    x = ti.field(float, 4, needs_grad=True)
    loss = ti.field(float, (), needs_grad=True)

    @ti.kernel
    def f():
        for i in x:
            loss[None] += x[i] ** 2

    @ti.ad.grad_replaced
    def forward():
        f()

    @ti.ad.grad_for(forward)
    def backward():  # deliberately wrong: half the true gradient
        f.grad()
        x.grad.from_numpy(x.grad.to_numpy() * 0.5)

    x.from_numpy(np.arange(1.0, 5.0))
    with pytest.raises(ti.ad.GradientCheckError, match=r"x\[0\]"):
        with ti.ad.Tape(loss, grad_check=[x]):
            forward()
    # the fields are left as the recorded program left them
    assert loss[None] == pytest.approx(30.0)


def test_tapes_do_not_nest(prog):
    loss = ti.field(float, (), needs_grad=True)
    with ti.ad.Tape(loss):
        with pytest.raises(ti.DifftapeError, match="nested"):
            with ti.ad.Tape(loss):
                pass


def test_adjoint_kernels_come_from_the_disk_cache(tmp_path):
    import json
    import os
    import subprocess
    import sys

    script = tmp_path / "k.py"
    script.write_text(
        "import json, difftape as ti\n"
        "ti.init(default_fp=ti.f64)\n"
        "x = ti.field(float, 4, needs_grad=True)\n"
        "y = ti.field(float, 4, needs_grad=True)\n"
        "@ti.kernel\n"
        "def k():\n"
        "    for i in x:\n"
        "        y[i] = ti.exp(x[i])\n"
        "k(); y.grad.fill(1.0); k.grad()\n"
        "inst = k.grad.instances[next(iter(k.grad.instances))]\n"
        "print(json.dumps({'hit': k.last_compile.cache_hit, 'g': x.grad[0]}))\n")
    env = dict(os.environ, DIFFTAPE_CACHE_DIR=str(tmp_path / "cache"))
    runs = [json.loads(subprocess.run([sys.executable, str(script)], env=env, check=True,
                                      capture_output=True, text=True).stdout)
            for _ in range(2)]
    assert runs[0]["hit"] is False and runs[1]["hit"] is True
    assert runs[0]["g"] == runs[1]["g"] == 1.0


def test_the_demo_runs_and_its_autodiff_forces_match(capsys):
    import re

    from difftape import demo

    assert demo.main(steps=2) == 0
    out = capsys.readouterr().out
    deviation = float(re.search(r"hand-written forces ([0-9.e+-]+)", out).group(1))
    assert deviation < 1e-4
    ti.reset()


def test_forward_mode_cancels_power_of_two_factors(prog):
    """A norm's tangent: d(x*x) = 2 x dx (x loaded twice from a local still merges) meets the
    1/2 of d(sqrt): the forward kernel multiplies by neither, and every tangent that leaves
    the arithmetic with a factor (a square stored as is, a sqrt stored as is, factors mixed
    in one sum) gets it multiplied in. Truth: analytic, in f64."""
    from difftape.autodiff.forward import forward_kernel

    n = 16
    x = ti.Vector.field(2, float, n, needs_dual=True)
    out = ti.Vector.field(4, float, n, needs_dual=True)

    @ti.kernel
    def k():
        for i in x:
            a = x[i][0]
            b = x[i][1]
            out[i][0] = ti.sqrt(a * a + b * b)   # the factors cancel
            out[i][1] = a * a                    # factor 2 multiplied in at the store
            out[i][2] = ti.sqrt(b * b + 1.0) + ti.sqrt(a * a)  # 2 * 1/2 twice, then a sum
            out[i][3] = a * a + ti.sin(b)         # factors 2 and 1 in one sum

    p = program.get()
    ir = k.build_ir(p, ())
    fwd = run_pipeline(forward_kernel(ir, lambda buf: True))
    consts = {st.attr for st in walk(fwd.tasks[-1].body) if st.op == "const"}
    assert 0.5 not in consts

    xs = np.random.default_rng(0).uniform(0.5, 2.0, (n, 2))
    v = np.random.default_rng(1).uniform(-1, 1, (n, 2))
    x.from_numpy(xs)
    x.dual.from_numpy(v)
    from difftape.ad.functional import forward_mode

    with forward_mode():
        k()
    a, b, da, db = xs[:, 0], xs[:, 1], v[:, 0], v[:, 1]
    r = np.hypot(a, b)
    truth = np.stack([(a * da + b * db) / r, 2 * a * da,
                      b * db / np.sqrt(b * b + 1) + da, 2 * a * da + np.cos(b) * db], axis=1)
    np.testing.assert_allclose(out.dual.to_numpy(), truth, rtol=1e-13, atol=1e-14)
