"""The f32 sine/cosine pair (kernels/codegen/vecmath.py) against float64 NumPy.

Kernels that take both sin and cos of a value compute them with one argument reduction of our
own; these tests hold it to libm-class accuracy (ulps of the f32 result), on the vectorized
body, the scalar loop remainder and the rare-lane libm path alike."""

import numpy as np
import pytest

import difftape as ti
from difftape.codegen import llvm_lowering, vecmath
from difftape.codegen.cpu import get_target
from difftape.codegen.layout import ctx_layout
from difftape.ir.passes import run_pipeline
from difftape.runtime import program

pytestmark = pytest.mark.skipif(not get_target().sincos,
                                reason="host without FMA or vector ISA: libm pairs are used")

@pytest.fixture
def prog():
    ti.init(arch=ti.cpu)
    yield program.get()
    ti.reset()


#: Worst case seen over 2**22 random inputs per range was 1.53 ulp; libmvec's own bound is 4.
MAX_ULP = 2.0


def _sincos_kernel(n: int):
    x = ti.field(ti.f32, shape=n)
    s = ti.field(ti.f32, shape=n)
    c = ti.field(ti.f32, shape=n)

    @ti.kernel
    def k():
        for i in x:
            s[i] = ti.sin(x[i])
            c[i] = ti.cos(x[i])

    def run(xs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x.from_numpy(xs.astype(np.float32))
        k()
        return s.to_numpy(), c.to_numpy()

    return k, run


def _ulps(got: np.ndarray, xs: np.ndarray, f) -> np.ndarray:
    ref = f(xs.astype(np.float64))
    ulp = np.spacing(np.abs(ref).astype(np.float32)).astype(np.float64)
    return np.abs(got.astype(np.float64) - ref) / ulp


@pytest.mark.parametrize("half_width", [1.0, 4.0, 100.0, vecmath.LIMIT, 1e5, 3e38])
def test_accuracy_in_ulps(prog, half_width):
    _, run = _sincos_kernel(1 << 18)
    xs = np.random.default_rng(int(half_width) % 1000).uniform(
        -half_width, half_width, 1 << 18).astype(np.float32)
    s, c = run(xs)
    assert _ulps(s, xs, np.sin).max() <= MAX_ULP
    assert _ulps(c, xs, np.cos).max() <= MAX_ULP


def test_hard_arguments(prog):
    """Near multiples of pi/2 (cancellation in the reduction), the edge of the fast path, and
    the values whose sign or class must survive."""
    k = np.arange(1, 5000, dtype=np.float64)
    near = (k * np.pi / 2).astype(np.float32)
    near = np.concatenate([near, np.nextafter(near, np.float32(np.inf)),
                           np.nextafter(near, np.float32(-np.inf))])
    edge = np.array([vecmath.LIMIT, np.nextafter(np.float32(vecmath.LIMIT), np.float32(1e9)),
                     -vecmath.LIMIT, 1e10, -1e30, 3.4e38], np.float32)
    xs = np.concatenate([near, -near, edge])
    _, run = _sincos_kernel(len(xs))
    s, c = run(xs)
    assert _ulps(s, xs, np.sin).max() <= MAX_ULP
    assert _ulps(c, xs, np.cos).max() <= MAX_ULP

    special = np.array([0.0, -0.0, 1e-30, -1e-30, 1e-45, np.inf, -np.inf, np.nan], np.float32)
    _, run = _sincos_kernel(len(special))
    s, c = run(special)
    assert np.signbit(s[1]) and not np.signbit(s[0])  # sin(-0) = -0
    assert s[2] == special[2] and s[3] == special[3] and s[4] == special[4]
    assert list(c[:5]) == [1.0] * 5
    assert np.isnan(s[5:]).all() and np.isnan(c[5:]).all()


def test_result_does_not_depend_on_position(prog):
    """The loop remainder runs the same code on one lane as the vector body on eight."""
    xs = np.random.default_rng(5).uniform(-50, 50, 1003).astype(np.float32)
    _, run = _sincos_kernel(len(xs))
    s, c = run(xs)
    _, run1 = _sincos_kernel(3)
    for i in (0, 500, 1000, 1001, 1002):
        s1, c1 = run1(np.array([xs[i], xs[i], xs[i]]))
        assert s1[0] == s[i] and c1[0] == c[i]


def _optimized(k, prog) -> str:
    ir = run_pipeline(k.build_ir(prog, ()))
    target = get_target()
    return target.optimized_ir(llvm_lowering.Lowering(ir, ctx_layout(ir), target).module())


def test_pairs_share_one_reduction_and_lone_sines_do_not(prog):
    k, _ = _sincos_kernel(1 << 10)
    opt = _optimized(k, prog)
    start = opt.index("define void @k_task0")
    task = opt[start:opt.index("\n}\n", start)]
    assert "_ZGVdN" not in opt and "_ZGVeN" not in opt  # neither half went to libmvec
    assert "@llvm.fma.v" in task and "call { <" not in task  # inlined into the vector loop

    x = ti.field(ti.f32, shape=1 << 10)

    @ti.kernel
    def lone():
        for i in x:
            x[i] = ti.sin(x[i])

    assert "dt_sincosf" not in _optimized(lone, prog)


def test_forward_and_reverse_of_sin_use_the_pair(prog):
    """The derivative of sin needs cos: both modes' kernels get the shared reduction, and
    their derivatives match the float64 truth."""
    n = 1 << 12
    x = ti.field(ti.f32, shape=n, needs_grad=True, needs_dual=True)
    y = ti.field(ti.f32, shape=n, needs_grad=True, needs_dual=True)

    @ti.kernel
    def f():
        for i in x:
            y[i] = ti.sin(x[i]) * x[i]

    xs = np.random.default_rng(2).uniform(-6, 6, n).astype(np.float32)
    x.from_numpy(xs)
    x64 = xs.astype(np.float64)
    truth = np.cos(x64) * x64 + np.sin(x64)
    x.dual.fill(1.0)
    with ti.ad.FwdMode(loss=y, param=x, seed=[1.0] * n, clear_gradients=False):
        f()
    assert np.abs(y.dual.to_numpy() - truth).max() < 4e-6
    y.grad.fill(1.0)
    x.grad.fill(0.0)
    f.grad()
    assert np.abs(x.grad.to_numpy() - truth).max() < 4e-6


@pytest.mark.bench
def test_every_f32_up_to_the_limit(prog):
    """Every f32 with 2**-12 <= x <= LIMIT (the code is odd/even symmetric), in 2**22 chunks:
    about 210 million values, a minute or two. Run with ``-m bench``."""
    chunk = 1 << 22
    _, run = _sincos_kernel(chunk)
    lo = np.float32(2.0 ** -12).view(np.int32)
    hi = np.float32(vecmath.LIMIT).view(np.int32)
    worst = 0.0
    for start in range(int(lo), int(hi) + 1, chunk):
        bits = np.arange(start, start + chunk, dtype=np.int64)
        bits = np.minimum(bits, hi).astype(np.int32)
        xs = bits.view(np.float32)
        s, c = run(xs)
        worst = max(worst, _ulps(s, xs, np.sin).max(), _ulps(c, xs, np.cos).max())
    print(f"worst {worst:.3f} ulp")
    assert worst <= MAX_ULP
