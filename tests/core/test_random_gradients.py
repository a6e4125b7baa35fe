"""Property-based: reverse-mode gradients of random kernels agree with finite differences,
forward mode (the kernels' tangent variants) agrees with reverse mode to rounding, and (with
the Tape, about half the examples) forward-over-reverse Hessian-vector products are symmetric
and match central differences of the gradient.

Hypothesis writes random differentiable kernels as Python source (a temporary file, compiled
with the helper of test_random_programs.py, since difftape reads kernel source), one test per
program shape: straight-line code (with a ti.func, range/ndrange loops, a scalar argument),
data-dependent branches (nested, elif, ti.select, continue), inner loops (loop-carried float and
integer locals, three levels, static/argument/index-dependent bounds, break/continue, while,
loops inside branches, a ti.func with a loop), atomics and kernel-level reductions (scatters,
sums over parallel loops, serial code between and after loops, serialized loops carrying
kernel-level locals), and small vectors and matrices (dot, norm, cross, outer product, matrix
products, determinant, element updates, loops). Everything runs in f64.

Inputs: x (1-D), p (0-D), B (2-D), V (vector field), A (matrix field), read directly, at
shifted indices and through an integer index field. Outputs: y, z (scatter target), Yv
(vector field), loss. For L = sum(wy * y) + sum(wz * z) + sum(wv . Yv) + loss with random
weights, the gradient of L with respect to every element of every input the kernel reads, from
the adjoint kernel (``kern(); kern.grad()`` after seeding y.grad = wy, z.grad = wz,
Yv.grad = wv, loss.grad = 1; with two launches, ``kern.grad`` in reverse order) and, for about
half of the examples, from ``ti.ad.Tape(loss)`` over the launches and a kernel adding the
weighted outputs into ``loss``, must match fourth-order central differences of the forward
launches, re-run from zeroed outputs for every evaluation (tolerance: RTOL, ATOL below).

Branch conditions on inputs keep their distance from the boundary: x lies on the lattice
0.1 + 0.2k (distinct per element), p on 0.2k (k != 0), each jittered by at most 0.03, and the
thresholds are multiples of 0.2 for x and odd multiples of 0.1 for p, so the stencil (at most
2e-5 wide) never crosses a branch. Kinks and jumps the inputs do not control (ti.abs,
ti.max/ti.min, clamp, floor, %, norm, comparisons of computed values) are detected where they
fall inside the stencil (second-order estimates with steps h and 2h disagree); those
coordinates are left out and counted (``hypothesis.event``).

The search is derandomized (the same examples on every run). A failing example is shrunk,
which can take a few minutes; its kernel source is printed with the failure.
"""
from contextlib import contextmanager

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, event, given, note, settings
from hypothesis import strategies as st
from test_random_programs import _compile

import difftape as ti
from difftape.ad.functional import forward_mode

N = 8
H = 1e-5  # finite-difference step (times max(1, |value|))
RTOL = 1e-7  # gradient vs finite differences, relative ...
ATOL = 1e-8  # ... plus absolute, times the magnitude of the objective's terms
KINK = 1e-5  # |FD(h) - FD(2h)| above KINK * scale: a kink or jump inside the stencil

# Deterministic for CI: a fixed derandomized search and no example database.
SETTINGS = {"deadline": None, "derandomize": True, "database": None,
            "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large,
                                      HealthCheck.filter_too_much]}

# ------------------------------------------------------------------------------- expressions

CONSTS = ["0.5", "1.25", "-0.75", "0.1 * i"]
UNARY = [
    "-({0})", "ti.sin({0})", "ti.cos({0})", "ti.tanh({0})", "ti.exp(ti.sin({0}))",
    "ti.exp(-0.5 * ({0}) ** 2)", "ti.log(1.0 + ({0}) ** 2)", "ti.sqrt(1.0 + ({0}) ** 2)",
    "({0}) ** 2", "({0}) ** 3", "ti.abs({0})", "(1.0 + ({0}) ** 2) ** 0.75",
    "2.0 ** ti.sin({0})", "(1.5 + ({0}) ** 2) ** -2", "ti.tan(0.5 * ti.sin({0}))",
    "ti.asin(0.9 * ti.tanh({0}))", "ti.acos(0.9 * ti.cos({0}))", "ti.atan({0})",
    "ti.rsqrt(1.0 + ({0}) ** 2)", "ti.math.clamp({0}, -1.0, 1.0)",
    "({0}) % 1.7", "ti.floor({0}) * 0.25 + ({0})",  # jumps: see KINK
]
BINARY = [
    "({0}) + ({1})", "({0}) - ({1})", "({0}) * ({1})", "({0}) / (1.5 + ({1}) ** 2)",
    "({0}) / (1.0 + ti.abs({1}))", "ti.max({0}, {1})", "ti.min({0}, {1})",
    "ti.atan2({0}, 1.0 + ({1}) ** 2)", "(1.0 + ({0}) ** 2) ** ti.sin({1})",
    "ti.math.mix({0}, {1}, 0.3)",
]
# Conditions on inputs only, at least 0.04 from their boundary (see the module docstring).
INPUT_CONDS = [
    "x[i] > 0.0", "x[i] < 0.4", "x[i] > -0.6", "x[(i + 1) % n] > 0.0", "x[i] > x[(i + 1) % n]",
    "x[i] < p[None]", "p[None] > 0.1", "x[i] * p[None] > 0.0",
    "x[i] > 0.0 and x[(i + 1) % n] < 0.4", "x[i] < -1.0 or p[None] > 0.5",
]
INDEX_CONDS = ["i % 2 == 0", "i < 3"]
UPDATES = [  # loop-carried updates of a local {v}
    "{v} = {v} * ti.tanh({e}) + {f}", "{v} += {e}", "{v} = 0.5 * {v} + {e}",
    "{v} = ti.sin({v}) * {e}", "{v} -= {e}", "{v} *= ti.cos({e})",
]

SOURCE = '''import difftape as ti


def make(x, p, B, idx, y, z, loss, V, A, Yv, wy, wz, wv, n):
{funcs}
    @ti.kernel
    def kern({params}):
{body}

    @ti.kernel
    def red():
        for i in y:
            loss[None] += wy[i] * y[i] + wz[i] * z[i] + wv[i].dot(Yv[i])

    return kern, red
'''


class Gen:
    """Writes a kernel body line by line from hypothesis draws, tracking the locals in scope
    so that every expression reads defined names only."""

    def __init__(self, data, binary=()):
        self.draw = data.draw
        self.lines: list[str] = []
        self.indent = 2
        self.scopes: list[list[str]] = [[]]
        self.reads: list[str] = []
        self.count = 0
        self.binary = BINARY + list(binary)

    # --- structure
    def emit(self, line: str) -> None:
        self.lines.append("    " * self.indent + line)

    @contextmanager
    def block(self, header: str, reads=()):
        self.emit(header)
        self.indent += 1
        self.scopes.append([])
        saved = self.reads
        self.reads = saved + list(reads)
        try:
            yield
        finally:
            if self.lines[-1].endswith(":"):
                self.emit("pass")
            self.reads = saved
            self.scopes.pop()
            self.indent -= 1

    def source(self, params: str = "", funcs: str = "") -> str:
        return SOURCE.format(params=params, funcs=funcs, body="\n".join(self.lines))

    # --- draws
    def pick(self, options):
        return self.draw(st.sampled_from(list(options)))

    def chance(self, p: float = 0.5) -> bool:
        return self.draw(st.integers(0, 99)) < 100 * p

    def locals(self) -> list[str]:
        return [v for scope in self.scopes for v in scope]

    def new_local(self, value: str) -> str:
        name = f"v{self.count}"
        self.count += 1
        self.emit(f"{name} = {value}")
        self.scopes[-1].append(name)
        return name

    def expr(self, max_ops: int = 4, leaves=None) -> str:
        """A random expression of up to ``max_ops`` operations; its leaves are inputs and
        locals (three times in four when any are in scope) or constants. Explicit ``leaves``
        are for code outside the loop over i (no index-dependent constants)."""
        consts = CONSTS if leaves is None else CONSTS[:3]
        leaves = list(leaves) if leaves is not None else self.reads + self.locals()
        return self._expr(self.draw(st.integers(0, max_ops)), leaves, consts)

    def _expr(self, ops: int, leaves, consts) -> str:
        if ops == 0:
            if not leaves or self.chance(0.25):
                return self.pick(consts)
            return self.pick(leaves)
        if self.chance():
            return self.pick(UNARY).format(self._expr(ops - 1, leaves, consts))
        left = self.draw(st.integers(0, ops - 1))
        template = self.pick(self.binary)
        if "{c}" in template:
            template = template.replace("{c}", self.pick(INPUT_CONDS))
        return template.format(self._expr(left, leaves, consts),
                               self._expr(ops - 1 - left, leaves, consts))

    def cond(self, extra=()) -> str:
        pool = INPUT_CONDS + INDEX_CONDS + list(extra)
        names = self.locals()
        if names:
            pool += ["{a} > {b}", "ti.sin({a}) > 0.2"]
        c = self.pick(pool)
        if "{a}" in c:
            c = c.format(a=self.pick(names), b=self.pick(names + ["0.3"]))
        return c

    def assign(self, outer_only=False) -> None:
        """Assign or update a local visible here (a new one if none is)."""
        names = self.locals() if not outer_only else [v for s in self.scopes[:-1] for v in s]
        if not names:
            self.new_local(self.expr())
            return
        v = self.pick(names)
        op = self.pick(["=", "+=", "-=", "*=", "/= 1.5 + "])
        e = self.expr(3)
        self.emit(f"{v} {op}({e}) ** 2" if op.startswith("/=") else f"{v} {op} {e}")

    def outputs(self, y_assigned=False) -> None:
        """Write y[i] and/or loss[None] from the locals."""
        kind = self.pick(["both", "y", "loss"])
        if kind in ("both", "y"):
            if not y_assigned and self.chance(0.3):
                self.emit(f"y[i] = {self.expr(3)}")  # overwritten: contributes nothing
                y_assigned = self.chance()
            self.emit(f"y[i] {'+=' if y_assigned else '='} {self.expr()}")
            if self.chance(0.3):
                self.emit(f"y[i] += {self.expr(2)}")
        if kind in ("both", "loss"):
            self.emit(f"loss[None] += {self.expr()}")


# ------------------------------------------------------------------------------- the harness

def _lattice_inputs(seed: int, d: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    odd = np.arange(-9, 10) * 0.2 + 0.1  # x: 0.1 + 0.2k, distinct per element
    even = np.array([k * 0.2 for k in range(-8, 9) if k])  # p: 0.2k, k != 0
    return {
        "x": rng.choice(odd, N, replace=False) + rng.uniform(-0.03, 0.03, N),
        "p": np.array(rng.choice(even) + rng.uniform(-0.03, 0.03)),
        "B": rng.uniform(-1.5, 1.5, (N, 2)),
        "V": rng.uniform(-1.5, 1.5, (N, d)),
        "A": rng.uniform(-1.5, 1.5, (N, d, d)),
    }


@pytest.fixture(scope="module")
def f64():
    ti.init(arch=ti.cpu, default_fp=ti.f64)
    yield
    ti.reset()


class Case:
    """One generated kernel with its fields: objective, finite differences, gradients."""

    def __init__(self, src: str, tmp_dir, launches=((),), seed: int = 0, d: int = 3) -> None:
        note(src)
        note(f"launches: {launches}")
        self.launches = [tuple(a) for a in launches]
        f = lambda shape=(): ti.field(ti.f64, shape=shape, needs_grad=True, needs_dual=True)
        self.x, self.p, self.y, self.z, self.loss = f(N), f(), f(N), f(N), f()
        self.B = f((N, 2))  # a 2-D input
        self.idx = ti.field(ti.i32, shape=N)  # indices for gathers and scatters, repeated
        self.V = ti.Vector.field(d, ti.f64, shape=N, needs_grad=True, needs_dual=True)
        self.A = ti.Matrix.field(d, d, ti.f64, shape=N, needs_grad=True, needs_dual=True)
        self.Yv = ti.Vector.field(d, ti.f64, shape=N, needs_grad=True, needs_dual=True)
        self.wy, self.wz = ti.field(ti.f64, shape=N), ti.field(ti.f64, shape=N)
        self.wv = ti.Vector.field(d, ti.f64, shape=N)
        rng = np.random.default_rng(seed + 1)
        sign = lambda shape: rng.uniform(0.5, 1.5, shape) * rng.choice([-1.0, 1.0], shape)
        self.w = {"y": sign(N), "z": sign(N), "Yv": sign((N, d))}
        self.wy.from_numpy(self.w["y"])
        self.wz.from_numpy(self.w["z"])
        self.wv.from_numpy(self.w["Yv"])
        values = _lattice_inputs(seed, d)
        self.idx.from_numpy(rng.integers(0, N, N).astype(np.int32))
        # only inputs the kernel reads get gradients; the others stay zero on both sides
        self.inputs = {name: arr for name, arr in values.items() if f"{name}[" in src}
        self.inputs.setdefault("x", values["x"])
        for name, arr in values.items():
            self._set(name, arr)
        ns = _compile(src, tmp_dir, "kern")
        self.kern, self.red = ns["make"](self.x, self.p, self.B, self.idx, self.y, self.z,
                                         self.loss, self.V, self.A, self.Yv, self.wy, self.wz,
                                         self.wv, N)

    def _set(self, name: str, arr: np.ndarray) -> None:
        field = getattr(self, name)
        if field.shape == ():
            field[None] = float(arr)
        else:
            field.from_numpy(arr)

    def _set_dual(self, name: str, arr: np.ndarray) -> None:
        dual = getattr(self, name).dual
        if dual.shape == ():
            dual[None] = float(arr)
        else:
            dual.from_numpy(arr)

    def _outputs(self):
        return (self.y, self.z, self.Yv, self.loss)

    def _reset(self) -> None:
        for out in self._outputs():
            out.fill(0)

    def objective(self) -> tuple[float, float]:
        """(L, sum of |terms| of L) after a forward run from zeroed outputs."""
        self._reset()
        for args in self.launches:
            self.kern(*args)
        terms = [self.w["y"] * self.y.to_numpy(), self.w["z"] * self.z.to_numpy(),
                 self.w["Yv"] * self.Yv.to_numpy(), np.array([self.loss[None]])]
        return (float(sum(t.sum() for t in terms)),
                float(sum(np.abs(t).sum() for t in terms)))

    def finite_differences(self):
        """{input: (fd gradient, mask of coordinates without a kink in the stencil)}, and the
        magnitude of L's terms."""
        base, mag = self.objective()
        assume(np.isfinite(base) and mag < 1e6)
        scale = max(1.0, mag)
        out = {}
        for name, arr in self.inputs.items():
            fd = np.zeros(arr.shape)
            smooth = np.ones(arr.shape, dtype=bool)
            for idx in np.ndindex(arr.shape):
                step = H * max(1.0, abs(float(arr[idx])))
                vals = {}
                for k in (-2, -1, 1, 2):
                    moved = arr.copy()
                    moved[idx] += k * step
                    self._set(name, moved)
                    vals[k] = self.objective()[0]
                self._set(name, arr)
                fd[idx] = (vals[-2] - 8 * vals[-1] + 8 * vals[1] - vals[2]) / (12 * step)
                c1 = (vals[1] - vals[-1]) / (2 * step)
                c2 = (vals[2] - vals[-2]) / (4 * step)
                smooth[idx] = abs(c1 - c2) <= KINK * max(scale, abs(c1))
            out[name] = (fd, smooth)
        skipped = sum(int((~m).sum()) for _, m in out.values())
        if skipped:
            event(f"coordinates left out at kinks: {min(skipped, 3)}{'+' if skipped > 3 else ''}")
        return out, scale

    def _grads(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name).grad.to_numpy() for name in self.inputs}

    def adjoint_grads(self) -> dict[str, np.ndarray]:
        self._reset()
        for args in self.launches:
            self.kern(*args)
        for name in self.inputs:
            getattr(self, name).grad.fill(0)
        self.y.grad.from_numpy(self.w["y"])
        self.z.grad.from_numpy(self.w["z"])
        self.Yv.grad.from_numpy(self.w["Yv"])
        self.loss.grad[None] = 1.0
        for args in reversed(self.launches):  # a hand-made tape
            self.kern.grad(*args)
        return self._grads()

    def tape_grads(self) -> dict[str, np.ndarray]:
        self._reset()
        with ti.ad.Tape(loss=self.loss):
            for args in self.launches:
                self.kern(*args)
            self.red()
        return self._grads()

    def directional(self, v: dict[str, np.ndarray]) -> float:
        """dL along the input direction ``v``, by forward mode (the kernels' tangent
        variants), from zeroed outputs."""
        self._reset()
        ti.ad.clear_all_duals()
        for name, arr in v.items():
            self._set_dual(name, arr)
        with forward_mode():
            for args in self.launches:
                self.kern(*args)
        return float((self.w["y"] * self.y.dual.to_numpy()).sum()
                     + (self.w["z"] * self.z.dual.to_numpy()).sum()
                     + (self.w["Yv"] * self.Yv.dual.to_numpy()).sum() + self.loss.dual[None])

    def check(self, tape: bool = False) -> None:
        fds, scale = self.finite_differences()
        grads = self.adjoint_grads()
        # Forward mode agrees with reverse mode: dL . v from tangents == grad . v, to rounding.
        rng = np.random.default_rng(7)
        v = {name: rng.uniform(-1, 1, arr.shape) for name, arr in self.inputs.items()}
        fwd = self.directional(v)
        rev = float(sum((grads[name] * v[name]).sum() for name in v))
        mag = float(sum(np.abs(grads[name] * v[name]).sum() for name in v))
        assert abs(fwd - rev) <= 1e-10 * max(1.0, mag), (
            f"forward mode dL.v = {fwd!r} but reverse mode grad.v = {rev!r}")
        runs = [("kern.grad()", grads)]
        if tape:
            runs.append(("ti.ad.Tape(loss)", self.tape_grads()))
            self.check_second_order(scale)
        for how, grads in runs:
            for name, (fd, smooth) in fds.items():
                got = grads[name]
                err = np.abs(got - fd)
                bad = smooth & (err > RTOL * np.abs(fd) + ATOL * scale)
                if bad.any():
                    idx = [tuple(int(v) for v in t) for t in np.argwhere(bad)][:6]
                    raise AssertionError(
                        f"{how}: d L / d {name} disagrees with finite differences at {idx}: "
                        f"gradient {[float(got[t]) for t in idx]}, "
                        f"FD {[float(fd[t]) for t in idx]} (scale {scale:.3g})")


    def program(self) -> None:
        """The launches and the reduction into ``loss``, from zeroed outputs."""
        self._reset()
        for args in self.launches:
            self.kern(*args)
        self.red()

    def check_second_order(self, scale: float) -> None:
        """Forward-over-reverse Hessian-vector products: symmetric (u . H v == v . H u), and
        equal to central differences of the gradient along v where the gradient is smooth."""
        names = list(self.inputs)
        fields = [getattr(self, n) for n in names]
        rng = np.random.default_rng(11)
        u = [rng.uniform(-1, 1, self.inputs[n].shape) for n in names]
        v = [rng.uniform(-1, 1, self.inputs[n].shape) for n in names]
        hu = ti.ad.hvp(self.program, self.loss, fields, u)
        hv = ti.ad.hvp(self.program, self.loss, fields, v)
        a = sum(float((x * y).sum()) for x, y in zip(v, hu, strict=True))
        b = sum(float((x * y).sum()) for x, y in zip(u, hv, strict=True))
        mag = sum(float(np.abs(x * y).sum()) for x, y in zip(v, hu, strict=True))
        assert abs(a - b) <= 1e-9 * max(1.0, mag), f"v.Hu = {a!r} but u.Hv = {b!r}"

        def grad_at(t: float) -> np.ndarray:
            for n, d in zip(names, v, strict=True):
                self._set(n, self.inputs[n] + t * d)
            with ti.ad.Tape(loss=self.loss):
                self.program()
            return np.concatenate([self._grads()[n].ravel() for n in names])

        h = 1e-5
        fd1 = (grad_at(h) - grad_at(-h)) / (2 * h)
        fd2 = (grad_at(2 * h) - grad_at(-2 * h)) / (4 * h)
        for n in names:
            self._set(n, self.inputs[n])
        # The five-point stencil (as for first derivatives): the central difference alone is
        # off by up to a third of |fd1 - fd2|, which the kink filter lets reach 3e-6 of the
        # size on steep programs (seen: H v right to 1e-11, fd1 off by 1.2e-6).
        fd = (4 * fd1 - fd2) / 3
        got = np.concatenate([x.ravel() for x in hv])
        size = max(scale, float(np.abs(fd1).max()))
        smooth = np.abs(fd1 - fd2) <= 1e-5 * size  # no kink of the gradient in the stencil
        bad = smooth & (np.abs(got - fd) > 1e-6 * size)
        assert not bad.any(), (f"H v disagrees with differences of the gradient at "
                               f"{np.argwhere(bad).ravel()[:6]}: {got[bad][:6]} vs "
                               f"{fd[bad][:6]}")


def _run(src: str, tmp_path_factory, seed: int, launches=((),), tape=False, d=3) -> None:
    """Compile ``src``, launch its kernel with each argument tuple of ``launches`` in turn,
    and check the gradients of the whole sequence."""
    case = Case(src, tmp_path_factory.mktemp("grad"), launches=launches, seed=seed, d=d)
    case.check(tape=tape)


# ------------------------------------------------------------------------------------- tests

TOP_READS = ["x[i]", "x[(i + 1) % n]", "p[None]", "x[n - 1 - i]", "x[idx[i]]", "B[i, 1]"]


@settings(max_examples=30, **SETTINGS)
@given(data=st.data(), seed=st.integers(0, 2**16), tape=st.booleans())
def test_straight_line_gradients(f64, tmp_path_factory, data, seed, tape):
    funcs = ""
    g = Gen(data)
    if g.chance(0.3):  # a ti.func, inlined where it is called
        body = g.expr(3, leaves=["a", "b"])
        funcs = ("    @ti.func\n    def f(a, b):\n"
                 f"        c = {body}\n        return {g.expr(3, leaves=['a', 'b', 'c'])}\n")
        g.binary.append("f({0}, {1})")
    header = g.pick(["for i in x:", "for i in range(n):", "for i in range(2, n):",
                     "for i, jj in ti.ndrange(n, 2):"])
    reads = TOP_READS + ["q"] + (["0.1 * jj"] if "jj" in header else [])
    with g.block(header, reads=reads):
        for _ in range(g.draw(st.integers(1, 4))):
            g.new_local(g.expr())
        for _ in range(g.draw(st.integers(0, 2))):
            g.assign()
        g.outputs(y_assigned="jj" in header)  # two iterations per y[i]: add only
    # q: a scalar float argument (no gradient of its own); one or two launches
    launches = [(0.7,), (-0.3,)][:g.draw(st.integers(1, 2))]
    _run(g.source(params="q: ti.f64", funcs=funcs), tmp_path_factory, seed, launches=launches,
         tape=tape)


def _branch_body(g: Gen, depth: int) -> None:
    for _ in range(g.draw(st.integers(1, 3))):
        what = g.pick(["local", "assign", "assign", "if", "y", "loss"] if depth < 2
                      else ["local", "assign", "assign", "y", "loss"])
        if what == "local":
            g.new_local(g.expr())
        elif what == "assign":
            g.assign(outer_only=depth > 0 and g.chance(0.7))
        elif what == "if":
            _branch(g, depth + 1)
        elif what == "y":
            g.emit(f"y[i] += {g.expr(3)}")
        else:
            g.emit(f"loss[None] += {g.expr(3)}")


def _branch(g: Gen, depth: int) -> None:
    with g.block(f"if {g.cond()}:"):
        _branch_body(g, depth)
    form = g.pick(["else", "none", "elif"])
    if form == "else":
        with g.block("else:"):
            _branch_body(g, depth)
    elif form == "elif":
        with g.block(f"elif {g.cond()}:"):
            _branch_body(g, depth)


@settings(max_examples=30, **SETTINGS)
@given(data=st.data(), seed=st.integers(0, 2**16), tape=st.booleans())
def test_branch_gradients(f64, tmp_path_factory, data, seed, tape):
    g = Gen(data)
    g.binary += ["ti.select({c}, {0}, {1})"] * 3
    with g.block("for i in x:", reads=TOP_READS):
        if g.chance(0.2):
            with g.block(f"if {g.pick(INPUT_CONDS)}:"):
                g.emit("continue")
        for _ in range(g.draw(st.integers(1, 3))):
            g.new_local(g.expr())
        for _ in range(g.draw(st.integers(1, 2))):
            _branch(g, 0)
        g.outputs(y_assigned=True)
    _run(g.source(), tmp_path_factory, seed, tape=tape)


def _update(g: Gen) -> str:
    """A loop-carried update of a float local in scope."""
    return g.pick(UPDATES).format(v=g.pick(g.locals()), e=g.expr(2), f=g.expr(2))


def _loop_body(g: Gen, var: str, depth: int, static=False, nest=0) -> None:
    for _ in range(g.draw(st.integers(1, 4))):
        options = ["update", "update", "local", "if", "out"] + ([] if static else ["exit"])
        if depth < 2:  # up to three nested loops
            options += ["loop", "while"]
        if "0.1 * k0" in g.reads:
            options.append("count")
        what = g.pick(options)
        if what == "update":
            g.emit(_update(g))
        elif what == "local":
            g.new_local(g.expr(3))
        elif what == "if":
            cond = g.cond([f"x[(i + {var}) % n] > 0.0", f"{var} % 2 == 0"])
            for header in [f"if {cond}:"] + (["else:"] if g.chance() else []):
                with g.block(header):
                    if nest < 1 and g.chance():
                        _loop_body(g, var, depth, static, nest + 1)
                    else:
                        g.emit(_update(g))
        elif what == "exit":
            cond = g.pick([f"{var} == 2", f"{var} % 2 == 1", f"{var} > i % 3",
                           f"x[(i + {var}) % n] > 1.0"])
            with g.block(f"if {cond}:"):
                g.emit(g.pick(["break", "continue"]))
        elif what == "out":
            g.emit(g.pick(["loss[None] += {}", f"z[(i + {var}) % n] += {{}}",
                           "y[i] += {}"]).format(g.expr(3)))
        elif what == "count":
            with g.block(f"if {g.cond([f'x[(i + {var}) % n] > 0.0'])}:"):
                g.emit("k0 += 1")
        elif what == "loop":
            _range_loop(g, depth + 1)
        else:
            _while_loop(g, depth + 1)


def _range_loop(g: Gen, depth: int) -> None:
    var = f"j{depth}"
    bound = g.pick(["range(1)", "ti.static(range(3))", "range(2)", "range(3)", "range(4)",
                    "range(m)", "range(1, m)", "range(i % 3)"])
    with g.block(f"for {var} in {bound}:", reads=[f"x[(i + {var}) % n]", f"0.1 * {var}"]):
        _loop_body(g, var, depth, static="static" in bound)


def _while_loop(g: Gen, depth: int) -> None:
    var = f"c{depth}"
    g.emit(f"{var} = 0")  # an integer counter, counted first so that `continue` is safe
    bound = g.pick(["m", "3", "i % 4", f"4 and x[(i + {var}) % n] < 1.0"])
    with g.block(f"while {var} < {bound}:",
                 reads=[f"x[(i + {var}) % n]"]):
        g.emit(f"{var} += 1")
        _loop_body(g, var, depth)


@settings(max_examples=25, **SETTINGS)
@given(data=st.data(), seed=st.integers(0, 2**16), m=st.lists(st.integers(0, 4), min_size=1,
                                                                max_size=2), tape=st.booleans())
def test_loop_gradients(f64, tmp_path_factory, data, seed, m, tape):
    g = Gen(data)
    funcs = ""
    if g.chance(0.3):  # a ti.func with a loop, inlined where it is called
        step = UPDATES[g.draw(st.integers(0, len(UPDATES) - 1))].format(
            v="acc", e=g.expr(2, leaves=["acc", "b", "0.1 * k"]),
            f=g.expr(2, leaves=["acc", "b"]))
        funcs = ("    @ti.func\n    def h(a, b):\n        acc = a\n"
                 f"        for k in range(3):\n            {step}\n        return acc\n")
        g.binary.append("h({0}, {1})")
    with g.block("for i in x:", reads=TOP_READS):
        if g.chance(0.3):  # an integer local carried by the loops, used as index and value
            g.emit("k0 = 0")
            g.reads += ["x[(i + k0) % n]", "0.1 * k0"]
        g.new_local(g.expr(2))
        if g.chance():
            g.new_local(g.pick(["0.0", g.expr(2)]))
        for _ in range(g.draw(st.integers(1, 2))):
            loop = _range_loop if g.chance(0.75) else _while_loop
            if g.chance(0.2):  # a loop inside a branch
                with g.block(f"if {g.cond()}:"):
                    loop(g, 0)
            else:
                loop(g, 0)
        g.outputs(y_assigned=True)
    _run(g.source(params="m: ti.i32", funcs=funcs), tmp_path_factory, seed,
         launches=[(k,) for k in m], tape=tape)


SCATTER = ["(i * 3) % n", "i // 2", "i % 3", "0", "(i + 1) % n", "idx[i]"]


def _atomic_statements(g: Gen, sums: list[str]) -> None:
    for _ in range(g.draw(st.integers(1, 4))):
        what = g.pick(["loss", "atomic_add", "z+=", "atomic_sub", "loss-="]
                      + (["sum"] * 3 if sums else []))
        e = g.expr(3)
        if what == "loss":
            g.emit(f"loss[None] += {e}")
        elif what == "loss-=":
            g.emit(f"loss[None] -= {e}")
        elif what == "atomic_add":
            g.emit(f"ti.atomic_add(z[{g.pick(SCATTER)}], {e})")
        elif what == "atomic_sub":
            g.emit(f"ti.atomic_sub(z[{g.pick(SCATTER)}], {e})")
        elif what == "z+=":
            g.emit(f"z[{g.pick(SCATTER)}] += {e}")
        else:
            g.emit(f"{g.pick(sums)} {g.pick(['+=', '-='])} {e}")


def _serialized_loop(g: Gen, sums: list[str]) -> None:
    """A serialized top-level loop: kernel-level locals carried from iteration to iteration
    and read by the loop, and maybe a break."""
    if g.chance(0.3):
        g.emit(f"s = {g.expr(2, leaves=['p[None]'])}")
    g.emit("ti.loop_config(serialize=True)")
    header = g.pick(["for i in range(n):", "for i in x:"])
    with g.block(header, reads=TOP_READS + sums):
        for _ in range(g.draw(st.integers(0, 2))):
            g.new_local(g.expr())
        for _ in range(g.draw(st.integers(1, 3))):
            g.emit(g.pick(UPDATES).format(v=g.pick(sums), e=g.expr(2), f=g.expr(2)))
        if g.chance(0.3):
            g.emit(f"y[i] = {g.expr()}")
        _atomic_statements(g, [] if g.chance() else sums)
        if "range" in header and g.chance(0.3):
            with g.block(f"if {g.pick(['i == 5', 'x[i] > 1.0'])}:"):
                g.emit("break")


@pytest.mark.parametrize("shape", ["scatter", "reduce", "two loops", "serialized"])
@settings(max_examples=8, **SETTINGS)
@given(data=st.data(), seed=st.integers(0, 2**16), tape=st.booleans())
def test_atomic_and_reduction_gradients(f64, tmp_path_factory, shape, data, seed, tape):
    """scatter: atomics into z and loss; reduce: a kernel-level sum over a parallel loop;
    two loops: with serial code between and after them; serialized: a loop carrying
    kernel-level locals from one iteration to the next."""
    g = Gen(data)
    sums: list[str] = []
    kernel_level: list[str] = []  # inactive kernel-level values the loops may read
    serial: list[str] = []  # active kernel-level values: read by serial code only
    if shape != "scatter":
        if g.chance(0.3):
            g.emit("c = 0.5")
            kernel_level = ["c"]
        sums = ["s"] + (["t"] if g.chance() else [])
        for v in sums:
            g.emit(f"{v} = 0.0")
    if shape == "serialized":
        _serialized_loop(g, sums)
    for loop in range(2 if shape == "two loops" else 1 if shape != "serialized" else 0):
        if loop and g.chance(0.3):  # a serial statement between the loops
            serial.append(f"u{loop}")
            g.emit(f"u{loop} = {g.expr(2, leaves=['p[None]'])}")
        with g.block("for i in x:", reads=TOP_READS + kernel_level):
            for _ in range(g.draw(st.integers(0, 2))):
                g.new_local(g.expr())
            if sums and (loop or g.chance()):
                g.emit(f"{g.pick(sums)} += {g.expr(3)}")
            _atomic_statements(g, sums if loop or g.chance() else [])
            if loop == 0 and shape != "reduce" and g.chance():
                g.emit(f"y[i] = {g.expr()}")
    if sums:  # serial code after the loops; may branch on an input
        leaves = ["p[None]"] + sums + serial
        final = lambda: g.pick(["s * s", g.expr(3, leaves=leaves)])
        if g.chance(0.3):
            with g.block(f"if {g.pick(['p[None] > 0.1', 'p[None] < -0.5'])}:"):
                g.emit(f"loss[None] {g.pick(['=', '+='])} {final()}")
            with g.block("else:"):
                g.emit(f"loss[None] {g.pick(['=', '+='])} {final()}")
        else:
            if g.chance(0.3):
                g.emit(f"u9 = {g.expr(2, leaves=leaves)}")
                leaves.append("u9")
            g.emit(f"loss[None] {g.pick(['=', '+='])} {final()}")
    _run(g.source(), tmp_path_factory, seed, tape=tape)


# ------------------------------------------------------------------------ vectors and matrices

class VecGen:
    """Typed expressions over scalars, d-vectors and d x d matrices."""

    def __init__(self, g: Gen, d: int) -> None:
        self.g, self.d = g, d
        self.vecs: list[str] = []
        self.mats: list[str] = []
        self.field_vecs = ["V[i]", "V[(i + 1) % n]"]

    def scalar(self) -> str:
        g = self.g
        options = ["plain"]
        if self.vecs:
            options += ["dot", "norm", "norm_sqr", "sum", "entry"]
        if self.mats:
            options += ["trace", "det", "mentry"]
        kind = g.pick(options)
        v = lambda: g.pick(self.vecs)
        m = lambda: g.pick(self.mats)
        k = lambda: g.draw(st.integers(0, self.d - 1))
        return {
            "plain": lambda: g.expr(2),
            "dot": lambda: f"{v()}.dot({v()})",
            "norm": lambda: f"{v()}.norm()",
            "norm_sqr": lambda: f"{v()}.norm_sqr()",
            "sum": lambda: f"{v()}.sum()",
            "entry": lambda: f"{v()}[{k()}]",
            "trace": lambda: f"{m()}.trace()",
            "det": lambda: f"{m()}.determinant()",
            "mentry": lambda: f"{m()}[{k()}, {k()}]",
        }[kind]()

    def vector(self) -> str:
        g = self.g
        options = ["build", "field", "field"]
        if self.vecs:
            options += ["add", "scale", "sin", "matvec", "tmatvec"]
            if self.d == 3 and len(self.vecs) > 1:
                options.append("cross")
        kind = g.pick(options)
        v = lambda: g.pick(self.vecs)
        m = lambda: g.pick(self.mats) if self.mats else "A[i]"
        return {
            "build": lambda: "ti.Vector([{}])".format(", ".join(g.expr(2)
                                                                for _ in range(self.d))),
            "field": lambda: g.pick(self.field_vecs),
            "add": lambda: f"{v()} + {v()}",
            "scale": lambda: f"{v()} * ({g.expr(2)})",
            "sin": lambda: f"ti.sin({v()})",
            "matvec": lambda: f"{m()} @ {v()}",
            "tmatvec": lambda: f"{m()}.transpose() @ {v()}",
            "cross": lambda: "{}.cross({})".format(*self.g.draw(
                st.permutations(self.vecs))[:2]),  # never v x v (norm of 0)
        }[kind]()

    def mutate(self) -> str:
        """A statement modifying a local vector in place."""
        g = self.g
        u = g.pick(self.vecs)
        k = g.draw(st.integers(0, self.d - 1))
        return g.pick([f"{u}[{k}] = {self.scalar()}", f"{u}[{k}] += {self.scalar()}",
                       f"{u} += {self.vector()}", f"{u} = {self.vector()}"])

    def matrix(self) -> str:
        g = self.g
        options = ["field"]
        if self.vecs:
            options += ["outer", "outer"]
        if self.mats:
            options += ["matmul", "add", "scale", "transpose"]
        kind = g.pick(options)
        v = lambda: g.pick(self.vecs)
        m = lambda: g.pick(self.mats)
        return {
            "field": lambda: g.pick(["A[i]", "A[n - 1 - i]"]),
            "outer": lambda: f"{v()}.outer_product({v()})",
            "matmul": lambda: f"{m()} @ {m()}",
            "add": lambda: f"{m()} + {m()}",
            "scale": lambda: f"{m()} * ({g.expr(2)})",
            "transpose": lambda: f"{m()}.transpose()",
        }[kind]()


@settings(max_examples=25, **SETTINGS)
@given(data=st.data(), seed=st.integers(0, 2**16), d=st.sampled_from([2, 3]),
       tape=st.booleans())
def test_vector_matrix_gradients(f64, tmp_path_factory, data, seed, d, tape):
    g = Gen(data)
    vg = VecGen(g, d)
    counter = iter(range(100))
    with g.block("for i in x:", reads=TOP_READS):
        for _ in range(g.draw(st.integers(2, 6))):
            kind = g.pick(["vec", "vec", "mat", "scalar", "mutate", "loop"])
            if kind == "vec":
                name = f"u{next(counter)}"
                g.emit(f"{name} = {vg.vector()}")
                vg.vecs.append(name)
            elif kind == "mat":
                name = f"M{next(counter)}"
                g.emit(f"{name} = {vg.matrix()}")
                vg.mats.append(name)
            elif kind == "scalar" or not vg.vecs or (kind == "loop" and not g.locals()):
                g.new_local(vg.scalar())
            elif kind == "mutate":
                g.emit(vg.mutate())
            else:  # a loop modifying local vectors and scalars
                with g.block(f"for j0 in range({g.draw(st.integers(1, 3))}):",
                             reads=["x[(i + j0) % n]"]):
                    vg.field_vecs.append("V[(i + j0) % n]")
                    for _ in range(g.draw(st.integers(1, 2))):
                        g.emit(vg.mutate() if g.chance(0.7) else _update(g))
                    vg.field_vecs.pop()
        if not vg.vecs:
            vg.vecs.append("V[i]")
        g.emit(f"Yv[i] = {vg.vector()}")
        if g.chance(0.3):
            g.emit(f"Yv[i][{g.draw(st.integers(0, d - 1))}] += {vg.scalar()}")
        g.emit(f"y[i] = {vg.scalar()}")
        if g.chance():
            g.emit(f"loss[None] += {vg.scalar()}")
    _run(g.source(), tmp_path_factory, seed, tape=tape, d=d)
