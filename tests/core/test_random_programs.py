"""Property-based: random arithmetic programs compiled by difftape agree with NumPy.

Hypothesis draws expression trees over three input fields (+ - * / min max abs sin cos exp
sqrt tanh, selects on comparisons, small integer powers) and a statement shape (straight line,
if/else, an inner loop accumulating a local). The kernel is compiled and run in f64; the same
tree is evaluated with NumPy in f64. Agreement is to 1e-9 relative (transcendentals differ in
the last bits between libmvec and NumPy).
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import difftape as ti
from difftape.ir.interpret import Interpreter
from difftape.ir.passes import run_pipeline
from difftape.runtime import program

N = 64

LEAVES = ["a[i]", "b[i]", "c[i]", "1.5", "0.25", "t"]
UNARY = {
    "ti.sin({})": np.sin, "ti.cos({})": np.cos, "ti.abs({})": np.abs,
    "ti.exp(ti.min({}, 2.0))": lambda x: np.exp(np.minimum(x, 2.0)),
    "ti.sqrt(ti.abs({}) + 1.0)": lambda x: np.sqrt(np.abs(x) + 1.0),
    "ti.tanh({})": np.tanh, "({}) ** 2": lambda x: x**2, "-({})": lambda x: -x,
}
BINARY = {
    "({}) + ({})": np.add, "({}) - ({})": np.subtract, "({}) * ({})": np.multiply,
    "({}) / (ti.abs({}) + 1.0)": lambda x, y: x / (np.abs(y) + 1.0),
    "ti.min({}, {})": np.minimum, "ti.max({}, {})": np.maximum,
    "ti.select(({}) > 0.3, {}, 0.5)": None,
}


def _expr():
    leaf = st.sampled_from(LEAVES).map(lambda s: (s, s))

    def extend(children):
        un = st.tuples(st.sampled_from(sorted(UNARY)), children).map(
            lambda t: (t[0].format(t[1][0]), (t[0], t[1][1])))
        bi = st.tuples(st.sampled_from(sorted(BINARY)), children, children).map(
            lambda t: (t[0].format(t[1][0], t[2][0]), (t[0], t[1][1], t[2][1])))
        return un | bi

    return st.recursive(leaf, extend, max_leaves=8)


def _eval(tree, env):
    if isinstance(tree, str):
        return env[tree]
    if len(tree) == 2:
        return UNARY[tree[0]](_eval(tree[1], env))
    op, x, y = tree[0], _eval(tree[1], env), _eval(tree[2], env)
    if op.startswith("ti.select"):
        return np.where(x > 0.3, y, 0.5)
    return BINARY[op](x, y)


def _compile(src: str, tmp_path, name: str):
    path = tmp_path / f"{name}.py"
    path.write_text(src)
    namespace: dict = {}
    code = compile(src, str(path), "exec")
    exec(code, namespace)  # the kernel's source must be a real file: difftape reads it
    return namespace


@pytest.fixture(scope="module")
def fields():
    ti.init(arch=ti.cpu, default_fp=ti.f64)
    yield
    ti.reset()


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(expr=_expr(), shape=st.sampled_from(["line", "branch", "loop"]), seed=st.integers(0, 99))
def test_random_program_matches_numpy(fields, tmp_path_factory, expr, shape, seed):
    text, tree = expr
    if shape == "line":
        body = ["t = a[i] * 0.5", f"out[i] = {text}"]
    elif shape == "branch":
        body = ["t = a[i] * 0.5", "if b[i] > 0.0:", f"    out[i] = {text}", "else:",
                f"    out[i] = -({text})"]
    else:
        body = ["t = a[i] * 0.5", "acc = 0.0", "for k in range(3):", f"    acc += {text}",
                "    t += 0.1", "out[i] = acc"]
    src = "\n".join(["import difftape as ti", "", "def make(a, b, c, out):", "    @ti.kernel",
                     "    def k():", "        for i in out:",
                     *("            " + line for line in body), "    return k", ""])
    ns = _compile(src, tmp_path_factory.mktemp("prog"), "prog")
    rng = np.random.default_rng(seed)
    a, b, c, out = (ti.field(ti.f64, shape=N) for _ in range(4))
    av, bv, cv = (rng.uniform(-2, 2, N) for _ in range(3))
    a.from_numpy(av)
    b.from_numpy(bv)
    c.from_numpy(cv)
    kernel = ns["make"](a, b, c, out)
    kernel()
    # The reference evaluator runs the same optimized IR in Python: agreement separates the
    # LLVM lowering from the frontend and passes.
    ir = run_pipeline(kernel.build_ir(program.get(), ()))
    fields = {f.id: f for f in (a, b, c, out)}
    reference = [fields[buf.key[1]].to_numpy() for buf in ir.buffers]
    Interpreter(ir, reference, []).run()
    out_slot = next(k for k, buf in enumerate(ir.buffers) if buf.key[1] == out.id)
    np.testing.assert_allclose(out.to_numpy(), reference[out_slot], rtol=1e-12, atol=1e-14)
    env = {"a[i]": av, "b[i]": bv, "c[i]": cv, "1.5": 1.5, "0.25": 0.25}
    if shape == "line":
        env["t"] = av * 0.5
        want = _eval(tree, env)
    elif shape == "branch":
        env["t"] = av * 0.5
        v = _eval(tree, env)
        want = np.where(bv > 0.0, v, -v)
    else:
        want = np.zeros(N)
        for k in range(3):
            env["t"] = av * 0.5 + 0.1 * k
            want = want + _eval(tree, env)
    want = np.broadcast_to(want, (N,))
    np.testing.assert_allclose(out.to_numpy(), want, rtol=1e-9, atol=1e-12)
