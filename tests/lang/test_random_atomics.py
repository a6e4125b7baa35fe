"""ti.random and atomic read-modify-write operations."""

import numpy as np
import pytest


def _random_sequence(ti, n, seed=None):
    """Draws n numbers in one thread so that the order is reproducible."""
    if seed is None:
        ti.init(arch=ti.cpu)
    else:
        ti.init(arch=ti.cpu, random_seed=seed)
    x = ti.field(float, shape=n)

    @ti.kernel
    def draw():
        ti.loop_config(serialize=True)
        for i in x:
            x[i] = ti.random()

    draw()
    return x.to_numpy()


def test_random_values_are_uniform_in_unit_interval(ti, fp):
    n = 200_000
    x = ti.field(float, shape=n)

    @ti.kernel
    def draw():
        for i in x:
            x[i] = ti.random()

    draw()
    values = x.to_numpy()
    assert values.min() >= 0.0 and values.max() < 1.0
    assert abs(values.mean() - 0.5) < 0.01
    assert abs(values.var() - 1.0 / 12.0) < 0.005
    counts = np.bincount((values * 10).astype(int), minlength=10)
    assert counts.min() > 0.9 * n / 10 and counts.max() < 1.1 * n / 10
    assert len(np.unique(values)) > 0.9 * n  # not a short cycle


def test_random_seed_reproduces_the_sequence(ti):
    a = _random_sequence(ti, 500, seed=1234)
    b = _random_sequence(ti, 500, seed=1234)
    c = _random_sequence(ti, 500, seed=99)
    np.testing.assert_array_equal(a, b)
    assert np.mean(a == c) < 0.01
    # without a seed argument every init starts from the same default seed
    np.testing.assert_array_equal(_random_sequence(ti, 50), _random_sequence(ti, 50))


def test_random_state_advances_between_kernel_calls(ti):
    @ti.kernel
    def one() -> ti.f32:
        return ti.random()

    draws = [one() for _ in range(20)]
    assert len(set(draws)) == 20
    assert all(0.0 <= d < 1.0 for d in draws)


def test_atomic_ops_return_the_old_value(ti):
    x = ti.field(ti.i32, shape=4)
    old = ti.field(ti.i32, shape=8)

    @ti.kernel
    def run():
        x[0] = 10
        x[1] = 10
        x[2] = 10
        x[3] = 10
        old[0] = ti.atomic_add(x[0], 5)
        old[1] = ti.atomic_add(x[0], -2)
        old[2] = ti.atomic_sub(x[1], 4)
        old[3] = ti.atomic_min(x[2], 3)
        old[4] = ti.atomic_min(x[2], 7)
        old[5] = ti.atomic_max(x[3], 42)
        old[6] = ti.atomic_max(x[3], 0)
        old[7] = ti.atomic_add(x[1], 0)

    run()
    np.testing.assert_array_equal(x.to_numpy(), [13, 6, 3, 42])
    np.testing.assert_array_equal(old.to_numpy(), [10, 15, 10, 10, 3, 10, 42, 6])


def test_atomic_float_ops(ti, fp, rtol):
    x = ti.field(float, shape=3)

    @ti.kernel
    def run() -> float:
        x[0] = 1.5
        x[1] = 1.5
        x[2] = 1.5
        a = ti.atomic_add(x[0], 0.25)
        b = ti.atomic_min(x[1], -2.0)
        c = ti.atomic_max(x[2], 0.5)
        return a + b + c

    assert run() == 4.5
    np.testing.assert_allclose(x.to_numpy(), [1.75, -2.0, 1.5], rtol=rtol)


def test_atomic_add_in_parallel_hands_out_unique_slots(ti):
    n = 10_000
    counter = ti.field(ti.i32, shape=())
    slot = ti.field(ti.i32, shape=n)

    @ti.kernel
    def run():
        for i in slot:
            slot[i] = ti.atomic_add(counter[None], 1)

    run()
    assert counter[None] == n
    np.testing.assert_array_equal(np.sort(slot.to_numpy()), np.arange(n))


def test_parallel_histogram_with_augmented_assignment(ti):
    n, bins = 100_000, 17
    values = ti.field(ti.i32, shape=n)
    hist = ti.field(ti.i32, shape=bins)

    @ti.kernel
    def histogram():
        for i in values:
            hist[values[i] % bins] += 1

    data = np.random.default_rng(3).integers(0, 1000, n).astype(np.int32)
    values.from_numpy(data)
    histogram()
    np.testing.assert_array_equal(hist.to_numpy(), np.bincount(data % bins, minlength=bins))


def test_parallel_vector_scatter_adds_every_component(ti):
    """Many threads add 2-, 3- and 4-vectors and neighbouring scalars into grid nodes chosen
    by data (a particle-to-grid transfer): every component of every update arrives. The
    values are multiples of 1/4 below 2^10, so every order of the sums is exact."""
    n, side = 200_000, 160  # 160 * 160 nodes: too many elements for per-chunk copies
    idx = ti.field(ti.i32, shape=(n, 2))
    val = ti.Vector.field(4, ti.f32, shape=n)
    g2 = ti.Vector.field(2, ti.f32, shape=(side, side))
    g3 = ti.Vector.field(3, ti.f32, shape=(side, side))
    g4 = ti.Vector.field(4, ti.f32, shape=(side, side))
    flat = ti.field(ti.f32, shape=2 * side * side)

    @ti.kernel
    def scatter():
        for p in range(n):
            i, j = idx[p, 0], idx[p, 1]
            v = val[p]
            g2[i, j] += ti.Vector([v[0], v[1]])
            g3[i, j] -= ti.Vector([v[0], v[1], v[2]])
            g4[i, j] += v
            flat[2 * (i * side + j)] += v[2]
            flat[2 * (i * side + j) + 1] -= v[3]

    rng = np.random.default_rng(11)
    ij = rng.integers(0, 8, (n, 2)).astype(np.int32)  # 64 hot nodes: contended
    vals = (rng.integers(-4, 5, (n, 4)) / 4).astype(np.float32)
    idx.from_numpy(ij)
    val.from_numpy(vals)
    scatter()
    want = np.zeros((side, side, 4))
    np.add.at(want, (ij[:, 0], ij[:, 1]), vals.astype(np.float64))
    np.testing.assert_array_equal(g2.to_numpy(), want[..., :2])
    np.testing.assert_array_equal(g3.to_numpy(), -want[..., :3])
    np.testing.assert_array_equal(g4.to_numpy(), want)
    pairs = np.stack([want[..., 2], -want[..., 3]], axis=-1).reshape(-1)
    np.testing.assert_array_equal(flat.to_numpy(), pairs)


def test_bitwise_augmented_assignment_is_atomic(ti):
    # Each iteration sets, then clears, its own bit of a shared word (and toggles a word with
    # ^=): a lost update leaves a bit set, so any non-atomic &=, |= or ^= shows.
    n, words = 1 << 18, 4
    flags = ti.field(ti.i32, shape=words)
    parity = ti.field(ti.i32, shape=())
    vec = ti.Vector.field(2, ti.i32, shape=())
    data = ti.field(ti.i32, shape=n)

    @ti.kernel
    def run() -> ti.i32:
        acc = 0
        for i in data:
            bit = 1 << (i % 31)
            flags[i % words] |= bit
            flags[i % words] &= ~bit
            parity[None] ^= data[i]
            vec[None] ^= ti.Vector([data[i], i])
            acc ^= data[i]  # a kernel-level variable: a reduction
        return acc

    vals = np.random.default_rng(5).integers(0, 2**31 - 1, n).astype(np.int32)
    data.from_numpy(vals)
    for _ in range(8):
        flags.fill(0)
        parity[None] = 0
        vec[None] = [0, 0]
        acc = run()
        np.testing.assert_array_equal(flags.to_numpy(), np.zeros(words))
        assert parity[None] == acc == np.bitwise_xor.reduce(vals)
        assert list(vec[None]) == [np.bitwise_xor.reduce(vals),
                                   np.bitwise_xor.reduce(np.arange(n))]


@pytest.mark.difftape_only
def test_bitwise_atomics_on_floats_are_type_errors(ti):
    # (Taichi 1.7.4 aborts in LLVM on these.)
    x = ti.field(ti.f32, shape=2)
    y = ti.field(ti.i32, shape=2)

    @ti.kernel
    def float_target():
        for i in x:
            x[i] |= 1

    @ti.kernel
    def float_value():
        for i in y:
            ti.atomic_xor(y[i], 1.5)

    for k in (float_target, float_value):
        with pytest.raises(ti.TaichiTypeError, match="bitwise operation .* needs integer"):
            k()


def test_parallel_integer_sum_is_exact(ti):
    n = 1_000_000
    total = ti.field(ti.i64, shape=())
    balance = ti.field(ti.i32, shape=())

    @ti.kernel
    def run():
        for i in range(n):
            total[None] += i
            balance[None] -= i % 7
            ti.atomic_sub(balance[None], -(i % 7))

    run()
    assert total[None] == n * (n - 1) // 2
    assert balance[None] == 0


def test_parallel_min_max_reduction(ti, fp, npfp):
    n = 50_000
    x = ti.field(float, shape=n)
    lo = ti.field(float, shape=())
    hi = ti.field(float, shape=())

    @ti.kernel
    def run():
        lo[None] = 1e30
        hi[None] = -1e30
        for i in x:
            ti.atomic_min(lo[None], x[i])
            ti.atomic_max(hi[None], x[i])

    data = np.random.default_rng(5).standard_normal(n).astype(npfp)
    x.from_numpy(data)
    run()
    assert lo[None] == data.min() and hi[None] == data.max()


def test_parallel_float_sum(ti, fp, rtol):
    n = 100_000
    x = ti.field(float, shape=n)
    total = ti.field(float, shape=())

    @ti.kernel
    def run():
        for i in x:
            total[None] += x[i]

    data = np.random.default_rng(7).uniform(0, 1, n)
    x.from_numpy(data)
    run()
    # summation order is not fixed, so allow for f32 round-off accumulation
    np.testing.assert_allclose(total[None], data.sum(), rtol=100 * rtol)


def _f16_sum(n: int, v: float) -> float:
    """``n`` adds of ``v`` into an f16, each rounded to f16."""
    s = np.float16(0)
    for _ in range(n):
        s = np.float16(np.float32(s) + np.float32(v))
    return float(s)


def test_parallel_f16_sum_rounds_every_add(ti):
    """``f[0] += 1.12`` into an f16 field rounds each add to f16, as Taichi's atomics do, so
    the parallel sum is the serial f16 sum (1029: past 512, 1.12 adds round to 1), not a sum
    of per-chunk partial sums (it was 1119); the same for scatters (``h[i % 4] += ...``,
    which gets stuck at 4096 when each add rounds)."""
    f = ti.field(ti.f16, shape=3)
    h = ti.field(ti.f16, shape=4)

    @ti.kernel
    def run(n: ti.i32, m: ti.i32):
        for _i in range(n):
            f[0] += 1.12
        for _ in range(1):
            for _i in range(n):
                f[1] = f[1] + 1.12
        for _i in range(n):
            ti.atomic_add(f[2], 1.12)
        for i in range(4 * m):  # each of h's elements gets m adds, from several chunks
            h[i % 4] += 1.12

    run(1000, 100_000)
    assert f.to_numpy().tolist() == [_f16_sum(1000, 1.12)] * 3
    assert h.to_numpy().tolist() == [_f16_sum(100_000, 1.12)] * 4


def _draw_serial(ti, dtype, n, fn=None):
    """``n`` draws of ``ti.random(dtype)`` (or ``fn()``) in one thread, from a fixed seed:
    the same numbers on every run, so the statistical checks below cannot be flaky."""
    ti.init(arch=ti.cpu, random_seed=7)
    x = ti.field(dtype, shape=n)
    one = fn or (lambda: ti.random(dtype))

    @ti.kernel
    def draw():
        ti.loop_config(serialize=True)
        for i in x:
            x[i] = one()

    draw()
    return x.to_numpy()


def test_random_64_bit_integers_cover_the_whole_range(ti):
    """As Taichi's rand_u64/rand_i64: every one of the 64 bits is random, so i64 draws are
    negative half of the time and u64 draws reach [2**63, 2**64)."""
    n = 20_000
    for dtype, signed in ((ti.i64, True), (ti.u64, False)):
        v = _draw_serial(ti, dtype, n)
        bits = v.view(np.uint64)
        ones = [float(np.mean((bits >> np.uint64(k)) & np.uint64(1))) for k in range(64)]
        assert all(abs(f - 0.5) < 0.03 for f in ones), ones  # 8 sigma
        if signed:
            assert abs(np.mean(v < 0) - 0.5) < 0.03 and v.min() < -2**62 and v.max() > 2**62
        else:
            assert abs(np.mean(v >= 2**63) - 0.5) < 0.03
        assert len(np.unique(v)) == n


def test_random_32_bit_integers_cover_the_whole_range(ti):
    v = _draw_serial(ti, ti.i32, 20_000)
    bits = v.view(np.uint32)
    ones = [float(np.mean((bits >> np.uint32(k)) & np.uint32(1))) for k in range(32)]
    assert all(abs(f - 0.5) < 0.03 for f in ones), ones


def test_randn_is_standard_normal(ti):
    """Mean, variance and the mass within 1, 2 and 3 standard deviations of 200000 draws
    (fixed seed, one thread), each within about 6 standard errors of the normal law's."""
    import math

    n = 200_000
    for dtype in (ti.f32, ti.f64):
        v = _draw_serial(ti, dtype, n, fn=lambda dt=dtype: ti.randn(dt)).astype(np.float64)
        assert np.isfinite(v).all()
        assert abs(v.mean()) < 0.015
        assert abs(v.var() - 1.0) < 0.02
        for k in (1, 2, 3):
            p = math.erf(k / math.sqrt(2))
            se = math.sqrt(p * (1 - p) / n)
            assert abs(np.mean(np.abs(v) < k) - p) < 6 * se, (k, np.mean(np.abs(v) < k), p)
        # the tails are reached (Box-Muller from [0, 1) uniforms reaches about 5.6 in f32)
        assert np.abs(v).max() > 3.5


def test_randn_default_type_is_default_fp(ti):
    """With default_fp=f64, ti.randn() draws in f64: its values are not f32 numbers."""
    ti.init(arch=ti.cpu, default_fp=ti.f64, random_seed=7)
    x = ti.field(ti.f64, shape=1000)

    @ti.kernel
    def draw():
        for i in x:
            x[i] = ti.randn()

    draw()
    v = x.to_numpy()
    assert np.mean(v.astype(np.float32).astype(np.float64) != v) > 0.99


def test_atomic_mul_integers_from_a_parallel_loop(ti):
    """Contended integer products (wrapping, as C) and the old value returned."""
    n = 60_000
    p = ti.field(ti.i32, shape=3)
    q = ti.field(ti.i64, shape=())
    old = ti.field(ti.i32, shape=2)

    @ti.kernel
    def run():
        for k in range(3):
            p[k] = 1
        q[None] = 1
        for i in range(n):
            ti.atomic_mul(p[i % 3], i % 7 + 1)
            ti.atomic_mul(q[None], 2 if i % 1000 == 0 else 1)

    @ti.kernel
    def returned():
        for _ in range(1):  # (Taichi 1.7.4 aborts on an atomic_mul outside a loop)
            p[0] = 6
            old[0] = ti.atomic_mul(p[0], 7)
            old[1] = ti.atomic_mul(p[0], 2)

    run()
    for k in range(3):
        want = 1
        for i in range(k, n, 3):
            want = (want * (i % 7 + 1)) & 0xFFFFFFFF
        assert p[k] == (want - (1 << 32) if want >= 1 << 31 else want)
    assert q[None] == 2 ** (n // 1000)
    returned()
    assert (old[0], old[1], p[0]) == (6, 42, 84)


def test_atomic_mul_floats_from_a_parallel_loop(ti):
    n = 200_000
    p = ti.field(ti.f64, shape=())
    f = ti.field(ti.f32, shape=4)

    @ti.kernel
    def run():
        p[None] = 1.0
        for k in range(4):
            f[k] = 1.0
        for i in range(n):
            ti.atomic_mul(p[None], 1.0 + 1e-6 * (i % 5))
            ti.atomic_mul(f[i % 4], 1.0 + 1e-7 * (i % 3))

    run()
    i = np.arange(n)
    # the factors as the kernel computes them (literals in default_fp f32)
    f32 = np.float32
    fp = (f32(1.0) + f32(1e-6) * (i % 5).astype(f32)).astype(np.float64)
    ff = (f32(1.0) + f32(1e-7) * (i % 3).astype(f32)).astype(np.float64)
    assert p[None] == pytest.approx(np.exp(np.sum(np.log(fp))), rel=1e-9)
    for k in range(4):
        assert f[k] == pytest.approx(np.exp(np.sum(np.log(ff[k::4]))), rel=1e-4)


def test_atomic_mul_of_a_kernel_variable(ti):
    """``ti.atomic_mul`` on a kernel-level variable from a parallel loop: a reduction."""
    @ti.kernel
    def product(n: ti.i32) -> ti.i64:
        s = ti.i64(1)
        for i in range(n):
            ti.atomic_mul(s, 2 if i % 3 == 0 else 1)
        return s

    assert product(90) == 2 ** 30


@pytest.mark.difftape_only  # Taichi has no deterministic mode
def test_float_atomic_mul_is_reproducible_under_deterministic_mode(ti):
    """A float product depends on the order of its factors: deterministic=True runs the loop
    in index order, so it equals the sequential product bit for bit, run after run."""
    ti.init(arch=ti.cpu, deterministic=True, cpu_max_num_threads=4)
    n = 100_000
    x = ti.field(ti.f32, shape=n)
    p = ti.field(ti.f32, shape=())

    @ti.kernel
    def run():
        p[None] = 1.0
        for i in x:
            ti.atomic_mul(p[None], x[i])

    xs = (1.0 + np.random.default_rng(1).uniform(-1e-3, 1e-3, n)).astype(np.float32)
    x.from_numpy(xs)
    want = np.float32(1.0)
    for v in xs:
        want = np.float32(want * v)
    for _ in range(3):
        run()
        assert p[None] == want
    assert run._fast.ir.tasks[-1].schedule == "serial"


@pytest.mark.difftape_only
def test_atomic_mul_into_differentiated_storage_is_refused(ti):
    x = ti.field(ti.f64, shape=4, needs_grad=True, needs_dual=True)
    p = ti.field(ti.f64, shape=(), needs_grad=True, needs_dual=True)

    @ti.kernel
    def product():
        for i in x:
            ti.atomic_mul(p[None], x[i])

    x.from_numpy(np.array([1.0, 2.0, 3.0, 4.0]))
    with pytest.raises(ti.GradientRuleError, match="atomic mul into 'p'"):
        with ti.ad.Tape(p):
            product()
    with pytest.raises(ti.GradientRuleError, match="atomic_mul into 'p'"):
        with ti.ad.FwdMode(loss=p, param=x, seed=[1.0] * 4):
            product()
