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


#: Worst case seen: f32 1.53 ulp (every f32 up to the limit), f64 1.47 ulp (2**20 random
#: arguments per range, against long double); libmvec's own bound is 4.
MAX_ULP = 2.0

#: (difftape type, NumPy type, reference type: wider than the result, so the ulps measured are
#: the kernel's own)
TYPES = {32: (ti.f32, np.float32, np.float64), 64: (ti.f64, np.float64, np.longdouble)}


def _sincos_kernel(n: int, bits: int = 32):
    t = TYPES[bits][0]
    x = ti.field(t, shape=n)
    s = ti.field(t, shape=n)
    c = ti.field(t, shape=n)

    @ti.kernel
    def k():
        for i in x:
            s[i] = ti.sin(x[i])
            c[i] = ti.cos(x[i])

    def run(xs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x.from_numpy(xs.astype(TYPES[bits][1]))
        k()
        return s.to_numpy(), c.to_numpy()

    return k, run


def _ulps(got: np.ndarray, xs: np.ndarray, f) -> np.ndarray:
    wide = np.float64 if got.dtype == np.float32 else np.longdouble
    ref = f(xs.astype(wide))
    ulp = np.spacing(np.abs(ref).astype(got.dtype)).astype(wide)
    return np.abs(got.astype(wide) - ref) / ulp


@pytest.mark.parametrize("bits", [32, 64])
@pytest.mark.parametrize("half_width", [1.0, 4.0, 100.0, 8192.0, 1e5, 3e38])
def test_accuracy_in_ulps(prog, half_width, bits):
    _, run = _sincos_kernel(1 << 18, bits)
    xs = np.random.default_rng(int(half_width) % 1000).uniform(
        -half_width, half_width, 1 << 18).astype(TYPES[bits][1])
    s, c = run(xs)
    assert _ulps(s, xs, np.sin).max() <= MAX_ULP
    assert _ulps(c, xs, np.cos).max() <= MAX_ULP


@pytest.mark.parametrize("bits", [32, 64])
def test_hard_arguments(prog, bits):
    """Near multiples of pi/2 (cancellation in the reduction), the edge of the fast path, and
    the values whose sign or class must survive."""
    npt = TYPES[bits][1]
    limit = vecmath.TYPES[bits].limit
    pi = np.longdouble("3.14159265358979323846264338327950288")
    near = (np.arange(1, 5000 if bits == 32 else 50000, dtype=np.longdouble) * pi / 2).astype(npt)
    near = np.concatenate([near, np.nextafter(near, npt(np.inf)),
                           np.nextafter(near, npt(-np.inf))])
    edge = np.array([limit, np.nextafter(npt(limit), npt(1e9)), -limit, 1e10, -1e30, 3.4e38],
                    npt)
    xs = np.concatenate([near, -near, edge])
    _, run = _sincos_kernel(len(xs), bits)
    s, c = run(xs)
    assert _ulps(s, xs, np.sin).max() <= MAX_ULP
    assert _ulps(c, xs, np.cos).max() <= MAX_ULP

    tiny = 1e-45 if bits == 32 else 5e-324
    special = np.array([0.0, -0.0, 1e-30, -1e-30, tiny, np.inf, -np.inf, np.nan], npt)
    _, run = _sincos_kernel(len(special), bits)
    s, c = run(special)
    assert np.signbit(s[1]) and not np.signbit(s[0])  # sin(-0) = -0
    assert s[2] == special[2] and s[3] == special[3]
    assert s[4] == 0.0 and not np.signbit(s[4])  # a subnormal result: flushed (FTZ, as Taichi)
    assert list(c[:5]) == [1.0] * 5
    assert np.isnan(s[5:]).all() and np.isnan(c[5:]).all()


@pytest.mark.parametrize("bits", [32, 64])
def test_result_does_not_depend_on_position(prog, bits):
    """The loop remainder runs the same code on one lane as the vector body on all."""
    xs = np.random.default_rng(5).uniform(-50, 50, 1003).astype(TYPES[bits][1])
    _, run = _sincos_kernel(len(xs), bits)
    s, c = run(xs)
    _, run1 = _sincos_kernel(3, bits)
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
    start = opt.index("@k_task0_body(")  # the task body (kept out of line: cpu.py)
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
    """Every f32 with 2**-12 <= x <= 8192, the fast path's limit (the code is odd/even
    symmetric), in 2**22 chunks: about 210 million values, ten seconds. Run with
    ``-m bench``."""
    chunk = 1 << 22
    _, run = _sincos_kernel(chunk)
    lo = np.float32(2.0 ** -12).view(np.int32)
    hi = np.float32(vecmath.F32.limit).view(np.int32)
    worst = 0.0
    for start in range(int(lo), int(hi) + 1, chunk):
        bits = np.arange(start, start + chunk, dtype=np.int64)
        bits = np.minimum(bits, hi).astype(np.int32)
        xs = bits.view(np.float32)
        s, c = run(xs)
        worst = max(worst, _ulps(s, xs, np.sin).max(), _ulps(c, xs, np.cos).max())
    print(f"worst {worst:.3f} ulp")
    assert worst <= MAX_ULP
