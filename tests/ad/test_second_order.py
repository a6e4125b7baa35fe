"""Second order (forward-over-reverse), derivatives of ti.funcs, Jacobians, jvp/vjp of Python
programs, and Tape.visualize. Truth: analytic derivatives, float64 finite differences of
gradients, and the other mode. Taichi has none of these APIs, so the module is difftape-only.
"""

import os
import runpy
import shutil
import sys
from xml.etree import ElementTree

import numpy as np
import pytest

from .helpers import close, fd_grad

pytestmark = pytest.mark.difftape_only


@pytest.fixture
def t64(ti):
    ti.init(arch=ti.cpu, default_fp=ti.f64)
    return ti


# ---------------------------------------------------------------------- derivatives of funcs

def test_seed_polynomial_derivative_is_4(ti, fp):
    @ti.func
    def f(x):
        return x**3 + 2 * x**2 - 3 * x + 1

    dfdx = ti.ad.grad(f)

    @ti.kernel
    def k() -> float:
        return dfdx(1.0)

    assert k() == 4.0


def test_second_derivative_by_nesting(t64):
    ti = t64

    @ti.func
    def f(x):
        return ti.sin(x) * x**3

    d2 = ti.ad.grad(ti.ad.grad(f))

    @ti.kernel
    def k(x: float) -> float:
        return d2(x)

    x = 0.7
    want = -np.sin(x) * x**3 + 6 * np.cos(x) * x**2 + 6 * x * np.sin(x)
    assert k(x) == pytest.approx(want, rel=1e-12)


def test_grad_of_vector_func_with_control_flow(t64):
    ti = t64

    @ti.func
    def f(v, s):
        acc = 0.0
        for k in range(3):
            if v[k] > 0:
                acc += ti.exp(s * v[k])
            else:
                acc -= v[k] ** 2 * s
        return acc + v.norm()

    g = ti.ad.grad(f, argnums=(0, 1))
    out = ti.Vector.field(4, ti.f64, shape=())

    @ti.kernel
    def k(a: float, b: float, c: float, s: float):
        gv, gs = g(ti.Vector([a, b, c]), s)
        out[None] = ti.Vector([gv[0], gv[1], gv[2], gs])

    def ref(a, b, c, s):
        acc = 0.0
        for vk in (a, b, c):
            acc += np.exp(s * vk) if vk > 0 else -vk**2 * s
        return acc + np.sqrt(a * a + b * b + c * c)

    args = (0.3, -0.8, 1.1, 0.6)
    k(*args)
    close(out[None].to_numpy(), [float(d) for d in fd_grad(ref, *args)], rtol=1e-9)


def test_jvp_and_vjp_of_a_vector_func(t64):
    ti = t64

    @ti.func
    def f(v):
        return ti.Vector([v[0] * v[1], ti.sin(v[0]) + v[1] ** 3, ti.exp(v[1] - v[0])])

    jf, vf = ti.ad.jvp(f), ti.ad.vjp(f)
    val = ti.Vector.field(3, ti.f64, shape=())
    tan = ti.Vector.field(3, ti.f64, shape=())
    cot = ti.Vector.field(2, ti.f64, shape=())

    @ti.kernel
    def k(a: float, b: float):
        y, t = jf(ti.Vector([a, b]), ti.Vector([0.5, -2.0]))
        y2, c = vf(ti.Vector([a, b]), ti.Vector([1.0, -1.0, 0.25]))
        val[None] = y - y2 + y  # y == y2
        tan[None] = t
        cot[None] = c

    a, b = 0.4, 0.9
    J = np.array([[b, a], [np.cos(a), 3 * b * b], [-np.exp(b - a), np.exp(b - a)]])
    k(a, b)
    close(val[None].to_numpy(), [a * b, np.sin(a) + b**3, np.exp(b - a)], rtol=1e-14)
    close(tan[None].to_numpy(), J @ [0.5, -2.0], rtol=1e-13)
    close(cot[None].to_numpy(), J.T @ [1.0, -1.0, 0.25], rtol=1e-13)


# ------------------------------------------------------------------------------- Jacobians

def _seed_jacobian_program(ti):
    n, m = 50, 100
    params = ti.field(float, shape=n, needs_grad=True, needs_dual=True)
    losses = ti.field(float, shape=m, needs_grad=True, needs_dual=True)

    @ti.kernel
    def compute():
        for i in params:
            for j in range(m):
                losses[j] += ti.sin(j / 16 * np.pi) * ti.sin(i / 16 * np.pi) * params[i]

    def run():
        losses.fill(0)
        compute()

    jj, ii = np.meshgrid(np.arange(m), np.arange(n), indexing="ij")
    run.kernel = compute
    return params, losses, run, np.sin(jj / 16 * np.pi) * np.sin(ii / 16 * np.pi)


def test_seed_jacobian_both_modes(ti, fp, rtol):
    params, losses, run, want = _seed_jacobian_program(ti)
    params.from_numpy(np.linspace(-1, 1, 50))
    fwd = ti.ad.jacobian(run, params, losses, mode="forward")
    rev = ti.ad.jacobian(run, params, losses, mode="reverse")
    auto = ti.ad.jacobian(run, params, losses)
    close(fwd, want, rtol=4 * rtol)
    close(rev, want, rtol=4 * rtol)
    # both modes agree to rounding (vectorized and scalar sin may differ in the last bit)
    close(fwd, rev, rtol=2 * rtol)
    np.testing.assert_array_equal(auto, fwd)


def test_seed_jacobian_with_fwdmode_and_kernel_grad(ti):
    """The seed's own formulation: one FwdMode pass per parameter, one kernel.grad per loss."""
    params, losses, run, want = _seed_jacobian_program(ti)
    n, m = want.shape[1], want.shape[0]
    fwd = np.zeros((m, n))
    for i in range(n):
        seed = [0.0] * n
        seed[i] = 1.0
        with ti.ad.FwdMode(loss=losses, param=params, seed=seed):
            run()
        fwd[:, i] = losses.dual.to_numpy()
    rev = np.zeros((m, n))
    run()
    for j in range(m):
        params.grad.fill(0)
        losses.grad.fill(0)
        losses.grad[j] = 1.0
        run.kernel.grad()
        rev[j] = params.grad.to_numpy()
    close(fwd, want, rtol=1e-5)
    close(rev, want, rtol=1e-5)


def test_jvp_vjp_of_a_python_program_against_differences(t64):
    ti = t64
    n = 5
    x = ti.field(float, n, needs_grad=True)
    w = ti.field(float, n, needs_grad=True)
    h = ti.field(float, n, needs_grad=True)
    y = ti.field(float, 3, needs_grad=True)

    @ti.kernel
    def first():
        for i in x:
            h[i] = ti.tanh(x[i] * w[i]) + x[(i + 1) % n] ** 2

    @ti.kernel
    def second():
        for i in h:
            y[i % 3] += h[i] * ti.cos(x[i])

    def run():
        y.fill(0)
        first()
        second()

    def ref(xs, ws):
        hs = np.tanh(xs * ws) + np.roll(xs, -1) ** 2
        out = np.zeros(3)
        for i in range(n):
            out[i % 3] += hs[i] * np.cos(xs[i])
        return out

    x0, w0 = np.linspace(-1, 1, n), np.linspace(0.5, 1.5, n)
    x.from_numpy(x0)
    w.from_numpy(w0)
    tx, tw = np.sin(np.arange(n) + 1.0), np.cos(np.arange(n))
    (ty,) = ti.ad.jvp(run, [x, w], [tx, tw], [y])
    want = [fd_grad(lambda t, k=k: ref(x0 + t * tx, w0 + t * tw)[k], 0.0)[0] for k in range(3)]
    close(ty, np.ravel(want), rtol=1e-9)
    u = np.array([1.0, -0.5, 2.0])
    gx, gw = ti.ad.vjp(run, [x, w], [y], [u])
    wx, ww = fd_grad(lambda a, b: ref(a, b) @ u, x0, w0)
    close(gx, wx, rtol=1e-9)
    close(gw, ww, rtol=1e-9)


# --------------------------------------------------------------------------- second order

def test_hvp_and_hessian_against_analytic(t64):
    ti = t64
    n = 4
    a = ti.field(float, n, needs_grad=True)
    L = ti.field(float, (), needs_grad=True)

    @ti.kernel
    def energy():
        for i in a:
            L[None] += ti.sin(a[i]) * a[(i + 1) % n] + a[i] ** 4

    a0 = np.array([0.1, -0.2, 0.3, 0.45])
    a.from_numpy(a0)
    H = np.zeros((n, n))
    for i in range(n):
        j = (i + 1) % n
        H[i, i] += -np.sin(a0[i]) * a0[j] + 12 * a0[i] ** 2
        H[i, j] += np.cos(a0[i])
        H[j, i] += np.cos(a0[i])
    close(ti.ad.hessian(energy, L, a), H, rtol=1e-13)
    v = np.array([1.0, -2.0, 0.5, 3.0])
    close(ti.ad.hvp(energy, L, a, v), H @ v, rtol=1e-13)
    # the gradient is left in a.grad, as a Tape leaves it
    g = np.array([np.cos(a0[i]) * a0[(i + 1) % n] + np.sin(a0[i - 1]) + 4 * a0[i] ** 3
                  for i in range(n)])
    close(a.grad.to_numpy(), g, rtol=1e-13)


def test_hvp_through_a_chain_of_kernels_against_gradient_differences(t64):
    """Intermediate fields, loops, vectors and two parameter fields: H v against central
    differences of the reverse-mode gradient."""
    ti = t64
    n = 6
    x = ti.Vector.field(2, float, n, needs_grad=True)
    k = ti.field(float, n, needs_grad=True)
    e = ti.field(float, n, needs_grad=True)
    L = ti.field(float, (), needs_grad=True)

    @ti.kernel
    def springs():
        for i in e:
            d = x[(i + 1) % n] - x[i]
            r = d.norm()
            acc = 0.0
            for m in range(2):
                acc += ti.exp(-0.5 * m * r)
            e[i] = k[i] * (r - 0.5) ** 2 + acc

    @ti.kernel
    def total():
        for i in e:
            L[None] += e[i] * e[i] * 0.1 + e[i]

    def run():
        springs()
        total()

    rng = np.random.default_rng(0)
    x0, k0 = rng.uniform(-1, 1, (n, 2)), rng.uniform(0.5, 2, n)
    vx, vk = rng.uniform(-1, 1, (n, 2)), rng.uniform(-1, 1, n)

    def grad_at(t):
        x.from_numpy(x0 + t * vx)
        k.from_numpy(k0 + t * vk)
        with ti.ad.Tape(L):
            run()
        return np.concatenate([x.grad.to_numpy().ravel(), k.grad.to_numpy()])

    h = 1e-5
    want = (-grad_at(2 * h) + 8 * grad_at(h) - 8 * grad_at(-h) + grad_at(-2 * h)) / (12 * h)
    x.from_numpy(x0)
    k.from_numpy(k0)
    hx, hk = ti.ad.hvp(run, L, [x, k], [vx, vk])
    close(np.concatenate([hx.ravel(), hk]), want, rtol=1e-8)


def test_hvp_equals_forward_of_reverse_and_reverse_of_forward(t64):
    """H v is symmetric in the sense v . H u == u . H v (a property of any correct Hessian)."""
    ti = t64
    n = 8
    x = ti.field(float, n, needs_grad=True)
    L = ti.field(float, (), needs_grad=True)

    @ti.kernel
    def f():
        for i in x:
            L[None] += ti.log(1 + x[i] ** 2) * ti.sin(x[(i + 2) % n]) + x[i] * x[(i + 1) % n]

    x.from_numpy(np.linspace(-1, 1, n))
    u, v = np.sin(np.arange(n)), np.cos(np.arange(n) * 0.3)
    hu, hv = ti.ad.hvp(f, L, x, u), ti.ad.hvp(f, L, x, v)
    assert v @ hu == pytest.approx(u @ hv, rel=1e-13)


def test_newton_example_converges_in_a_handful_of_iterations(ti):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
    try:
        ns = runpy.run_path(os.path.join(sys.path[0], "newton.py"))
    finally:
        sys.path.pop(0)
    its = ns["main"](n_free=8)
    assert its["newton"] <= 8
    assert its["gradient_descent"] > 20 * its["newton"]


# ------------------------------------------------------------------------------ visualize

def _recorded_tape(ti):
    """A Tape over square, reduce, square (y is written twice: two versions)."""
    x = ti.field(float, 4, needs_grad=True)
    y = ti.field(float, 4, needs_grad=True)
    L = ti.field(float, (), needs_grad=True)

    @ti.kernel
    def square():
        for i in x:
            y[i] = x[i] * x[i]

    @ti.kernel
    def reduce():
        for i in y:
            L[None] += y[i]

    with ti.ad.Tape(L) as tape:
        square()
        reduce()
        square()
    return tape


def test_tape_visualize_writes_the_launch_graph(ti, tmp_path):
    tape = _recorded_tape(ti)
    files = tape.visualize(str(tmp_path / "tape.dot"))
    dot = (tmp_path / "tape.dot").read_text()
    assert files[0].endswith("tape.dot")
    assert dot.startswith("digraph tape {") and dot.rstrip().endswith("}")
    for text in ('"0: square"', '"1: reduce"', '"2: square"', '"x@0" -> "launch 0"',
                 '"launch 0" -> "y@0"', '"y@0" -> "launch 1"', '"launch 2" -> "y@1"',
                 'label="y (v1)"'):
        assert text in dot, (text, dot)
    # The SVG beside it exactly when Graphviz's dot is installed.
    svg = str(tmp_path / "tape.svg")
    assert files == [str(tmp_path / "tape.dot")] + ([svg] if shutil.which("dot") else [])


@pytest.mark.skipif(shutil.which("dot") is None,
                    reason="Graphviz's dot is not installed (apt-get install graphviz)")
def test_tape_visualize_draws_svg(ti, tmp_path):
    """An .svg path is drawn by Graphviz: valid SVG naming every launch, the DOT beside."""
    tape = _recorded_tape(ti)
    files = tape.visualize(str(tmp_path / "tape.svg"))
    assert files == [str(tmp_path / "tape.dot"), str(tmp_path / "tape.svg")]
    root = ElementTree.parse(tmp_path / "tape.svg").getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    for label in ("0: square", "1: reduce", "2: square", "x", "y", "y (v1)", "L"):
        assert label in texts, (label, texts)
    # One box per launch: polygons under the three launch nodes.
    titles = [t.text for t in root.iter("{http://www.w3.org/2000/svg}title")]
    assert {"launch 0", "launch 1", "launch 2"} <= set(titles)


def test_tape_visualize_svg_without_graphviz_says_how_to_install(ti, tmp_path, monkeypatch):
    """No `dot` on the PATH: an .svg is refused naming the installs; the DOT is written, and a
    .dot path alone is fine."""
    tape = _recorded_tape(ti)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(ti.MediaError, match=r"apt install graphviz.*conda install"):
        tape.visualize(str(tmp_path / "tape.svg"))
    assert not (tmp_path / "tape.svg").exists()
    assert (tmp_path / "tape.dot").read_text().startswith("digraph tape {")
    assert tape.visualize(str(tmp_path / "only.dot")) == [str(tmp_path / "only.dot")]
    assert not (tmp_path / "only.svg").exists()


def test_hvp_through_loop_carried_nonlinear_state(t64):
    """The adjoint keeps the loop's state on its stack; forward-over-reverse must carry the
    tangents of those saved values too (pushed beside them)."""
    ti = t64
    n = 5
    x = ti.field(float, n, needs_grad=True)
    L = ti.field(float, (), needs_grad=True)

    @ti.kernel
    def f():
        for i in x:
            a = x[i]
            k = 0
            while k < 4:
                a = ti.tanh(a * x[(i + 1) % n] + 0.3) * ti.cos(a)
                k += 1
            L[None] += a * a

    x0 = np.linspace(-0.8, 0.9, n)
    v = np.cos(np.arange(n) * 1.3)

    def grad_at(t):
        x.from_numpy(x0 + t * v)
        with ti.ad.Tape(L):
            f()
        return x.grad.to_numpy()

    h = 1e-5
    want = (-grad_at(2 * h) + 8 * grad_at(h) - 8 * grad_at(-h) + grad_at(-2 * h)) / (12 * h)
    x.from_numpy(x0)
    close(ti.ad.hvp(f, L, x, v), want, rtol=1e-8)
