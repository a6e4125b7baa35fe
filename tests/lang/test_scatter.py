"""Scatter-adds from a parallel loop (histograms, particle-to-grid, adjoints of gathers): exact
for integers, and for floats equal to the sum up to rounding, on all threads. Small targets are
accumulated per chunk and drained atomically (passes/scatter.py); large ones and targets the
loop also reads stay plain atomics."""

import numpy as np


def test_histogram_and_weighted_scatter(ti):
    n, bins = 1 << 20, 1000
    idx = ti.field(ti.i32, n)
    w = ti.field(ti.f32, n)
    count = ti.field(ti.i32, bins)
    mass = ti.field(ti.f32, bins)
    mass2 = ti.field(ti.f32, (bins // 10, 10))
    seen = ti.field(ti.i32, bins)

    @ti.kernel
    def scatter():
        for i in idx:
            b = idx[i]
            count[b] += 1
            mass[b] += w[i]
            ti.atomic_sub(mass2[b // 10, b % 10], w[i])
            old = ti.atomic_add(seen[b], 1)  # its old value is used: stays atomic
            if old == 0:
                count[b] += 0

    rng = np.random.default_rng(0)
    iv = rng.integers(0, bins, n).astype(np.int32)
    wv = rng.uniform(0, 1, n).astype(np.float32)
    idx.from_numpy(iv)
    w.from_numpy(wv)
    scatter()
    scatter()
    want_count = 2 * np.bincount(iv, minlength=bins)
    want_mass = 2 * np.bincount(iv, weights=wv.astype(np.float64), minlength=bins)
    np.testing.assert_array_equal(count.to_numpy(), want_count)
    np.testing.assert_array_equal(seen.to_numpy(), want_count)
    np.testing.assert_allclose(mass.to_numpy(), want_mass, rtol=1e-4)
    np.testing.assert_allclose(mass2.to_numpy().ravel(), -want_mass, rtol=1e-4)
