"""``ti.algorithms``: parallel_sort and PrefixSumExecutor, checked against NumPy."""

import numpy as np
import pytest


@pytest.mark.parametrize("n,offset", [(1, 0), (7, 0), (256, -3), (1000, 5), (20001, 123)])
def test_parallel_sort_orders_keys_and_permutes_values_alike(ti, n, offset):
    keys = ti.field(ti.f32, n, offset=offset)
    values = ti.field(ti.i32, n, offset=offset)
    rng = np.random.default_rng(n)
    data = rng.integers(0, n // 2 + 1, n).astype(np.float32)  # with repeated keys
    keys.from_numpy(data)
    values.from_numpy(np.arange(n, dtype=np.int32))
    ti.algorithms.parallel_sort(keys, values)
    got_keys, got_values = keys.to_numpy(), values.to_numpy()
    np.testing.assert_array_equal(got_keys, np.sort(data))
    # values followed their keys: a permutation, each value next to the key it came with
    np.testing.assert_array_equal(np.sort(got_values), np.arange(n))
    np.testing.assert_array_equal(data[got_values], got_keys)


def test_parallel_sort_of_keys_alone(ti):
    keys = ti.field(ti.i32, 3000)
    data = np.random.default_rng(7).integers(-10**6, 10**6, 3000).astype(np.int32)
    keys.from_numpy(data)
    ti.algorithms.parallel_sort(keys)
    np.testing.assert_array_equal(keys.to_numpy(), np.sort(data))


@pytest.mark.difftape_only  # Taichi runs its prefix sum on CUDA and Vulkan only
@pytest.mark.parametrize("n,total,offset", [(1, 1, 0), (1000, 1003, -7), (1024, 1024, 0),
                                            (1025, 1030, 4), (70001, 70001, 0)])
def test_prefix_sum_executor_scans_the_first_length_elements(ti, n, total, offset):
    x = ti.field(ti.i32, total, offset=offset)
    data = np.random.default_rng(n).integers(-1000, 1000, total).astype(np.int32)
    x.from_numpy(data)
    executor = ti.algorithms.PrefixSumExecutor(n)
    executor.run(x)
    want = data.copy()
    want[:n] = np.cumsum(data[:n])
    np.testing.assert_array_equal(x.to_numpy(), want)
    executor.run(x)  # the executor is reusable
    want[:n] = np.cumsum(want[:n])
    np.testing.assert_array_equal(x.to_numpy(), want)


@pytest.mark.difftape_only
def test_prefix_sum_of_floats(ti):
    x = ti.field(ti.f64, 5000)
    data = np.random.default_rng(3).random(5000)
    x.from_numpy(data)
    ti.algorithms.PrefixSumExecutor(5000).run(x)
    np.testing.assert_allclose(x.to_numpy(), np.cumsum(data), rtol=1e-12)


@pytest.mark.difftape_only
def test_algorithms_refuse_what_they_cannot_do_right(ti):
    with pytest.raises(ti.DifftapeError, match="same length"):
        ti.algorithms.parallel_sort(ti.field(ti.f32, 8), ti.field(ti.f32, 4))
    with pytest.raises(ti.DifftapeError, match="1-D"):
        ti.algorithms.parallel_sort(ti.field(ti.f32, (4, 4)))
    with pytest.raises(ti.DifftapeError, match="1-D scalar field"):
        ti.algorithms.parallel_sort(ti.Vector.field(2, ti.f32, 8))
    with pytest.raises(ti.DifftapeError, match="only 4 elements"):
        ti.algorithms.PrefixSumExecutor(8).run(ti.field(ti.i32, 4))
