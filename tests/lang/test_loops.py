"""Range-for, struct-for, grouped and ndrange loops, while/break/continue, loop_config."""

import numpy as np
import pytest


def test_range_for_with_begin_and_end(ti):
    x = ti.field(ti.i32, shape=12)

    @ti.kernel
    def run(lo: ti.i32, hi: ti.i32):
        for i in range(3, 9):
            x[i] += i
        for i in range(lo, hi):
            x[i] += 100

    run(7, 11)
    want = np.zeros(12, dtype=np.int32)
    want[3:9] += np.arange(3, 9)
    want[7:11] += 100
    np.testing.assert_array_equal(x.to_numpy(), want)


def test_empty_and_reversed_ranges_do_not_run(ti):
    @ti.kernel
    def count(lo: ti.i32, hi: ti.i32) -> ti.i32:
        c = 0
        for _ in range(lo, hi):
            c += 1
        return c

    assert count(0, 0) == 0
    assert count(5, 2) == 0
    assert count(-3, 4) == 7


def test_struct_for_1d(ti, fp, rtol):
    x = ti.field(float, shape=9)

    @ti.kernel
    def run():
        for i in x:
            x[i] = i * 1.5 - 2.0

    run()
    np.testing.assert_allclose(x.to_numpy(), np.arange(9) * 1.5 - 2.0, rtol=rtol)


def test_struct_for_2d_two_indices(ti):
    x = ti.field(ti.i32, shape=(4, 7))

    @ti.kernel
    def run():
        for i, j in x:
            x[i, j] = i * 10 + j

    run()
    i, j = np.indices((4, 7))
    np.testing.assert_array_equal(x.to_numpy(), i * 10 + j)


def test_grouped_struct_for_3d(ti):
    x = ti.field(ti.i32, shape=(2, 3, 4))

    @ti.kernel
    def run():
        for idx in ti.grouped(x):
            x[idx] = idx[0] * 100 + idx[1] * 10 + idx[2] + idx.sum()

    run()
    i, j, k = np.indices((2, 3, 4))
    np.testing.assert_array_equal(x.to_numpy(), i * 100 + j * 10 + k + i + j + k)


def test_ndrange_with_begin_end_tuples(ti):
    x = ti.field(ti.i32, shape=(6, 4))

    @ti.kernel
    def run():
        for i, j in ti.ndrange((1, 5), 3):
            x[i, j] = 1 + i * j

    run()
    want = np.zeros((6, 4), dtype=np.int32)
    i, j = np.indices((6, 4))
    mask = (i >= 1) & (i < 5) & (j < 3)
    want[mask] = 1 + (i * j)[mask]
    np.testing.assert_array_equal(x.to_numpy(), want)


def test_ndrange_argument_of_three_is_a_syntax_error(ti):
    """As Taichi: a tuple argument of ndrange that is not (begin, end) is a syntax error
    (it was a TypeError)."""
    @ti.kernel
    def foo():
        for _i in ti.ndrange((1, 2, 3)):
            pass

    with pytest.raises(ti.TaichiSyntaxError, match=r"Every argument of ndrange should be a "
                                                   r"scalar or a tuple/list like \(begin, end\)"):
        foo()


def test_ndrange_three_dims_and_grouped_ndrange(ti):
    @ti.kernel
    def count3(a: ti.i32, b: ti.i32) -> ti.i32:
        s = 0
        for i, j, k in ti.ndrange(a, (2, b), (-1, 1)):
            s += (i + 1) * j * (k + 2)
        return s

    want = sum((i + 1) * j * (k + 2) for i in range(3) for j in range(2, 5) for k in range(-1, 1))
    assert count3(3, 5) == want

    y = ti.field(ti.i32, shape=(5, 5))

    @ti.kernel
    def grouped():
        for idx in ti.grouped(ti.ndrange((1, 3), (2, 5))):
            y[idx] = idx[0] * 5 + idx[1]

    grouped()
    want_y = np.zeros((5, 5), dtype=np.int32)
    for i in range(1, 3):
        for j in range(2, 5):
            want_y[i, j] = i * 5 + j
    np.testing.assert_array_equal(y.to_numpy(), want_y)


def test_ndrange_of_unpacked_and_repeated_lists_and_tuples(ti):
    x = ti.field(ti.i32, shape=(2, 3, 4))
    shape = x.shape
    dims = [2] * 2

    @ti.kernel
    def run():
        for i, j, k in ti.ndrange(*shape):
            x[i, j, k] += 1
        for idx in ti.grouped(ti.ndrange(*dims, (1, 3))):
            x[idx] += 10
        for i, j in ti.ndrange(*((0, 2),) * 2):
            x[i, j, 3] += 100

    run()
    want = np.ones((2, 3, 4), np.int32)
    want[:2, :2, 1:3] += 10
    want[:2, :2, 3] += 100
    np.testing.assert_array_equal(x.to_numpy(), want)


def test_block_local_is_a_hint_that_takes_fields(ti):
    x = ti.field(ti.f32, shape=8)
    v = ti.Vector.field(2, ti.f32, shape=8)

    @ti.kernel
    def run():
        ti.block_local(x, v)
        for i in x:
            ti.block_local(x)
            x[i] = i
            v[i] = [i, 2 * i]

    run()
    np.testing.assert_array_equal(x.to_numpy(), np.arange(8))
    np.testing.assert_array_equal(v.to_numpy()[:, 1], 2 * np.arange(8))


@pytest.mark.difftape_only
def test_block_local_of_a_non_field_is_a_type_error(ti):
    # (Taichi fails with an AttributeError from its internals.)
    @ti.kernel
    def run():
        ti.block_local(3)

    with pytest.raises(ti.TaichiTypeError, match="takes fields"):
        run()


def test_while_loop_with_break(ti):
    steps = ti.field(ti.i32, shape=30)

    @ti.kernel
    def collatz():
        for i in steps:
            n = i + 1
            c = 0
            while True:
                if n == 1:
                    break
                if n % 2 == 0:
                    n = n // 2
                else:
                    n = 3 * n + 1
                c += 1
            steps[i] = c

    def reference(n):
        c = 0
        while n != 1:
            n = n // 2 if n % 2 == 0 else 3 * n + 1
            c += 1
        return c

    collatz()
    np.testing.assert_array_equal(steps.to_numpy(), [reference(n) for n in range(1, 31)])


def test_while_condition_loop(ti):
    @ti.kernel
    def digits(n: ti.i32) -> ti.i32:
        c = 1
        m = n  # kernel arguments are immutable inside the kernel
        while m >= 10:
            m //= 10
            c += 1
        return c

    for n in (0, 7, 10, 99, 12345, 2**31 - 1):
        assert digits(n) == len(str(n))


def test_continue_and_break_in_inner_loops(ti):
    out = ti.field(ti.i32, shape=8)

    @ti.kernel
    def run():
        for i in out:
            s = 0
            for j in range(20):
                if j % 3 == 0:
                    continue
                if j > i + 5:
                    break
                s += j
            out[i] = s

    run()
    want = [sum(j for j in range(20) if j % 3 != 0 and j <= i + 5) for i in range(8)]
    np.testing.assert_array_equal(out.to_numpy(), want)


def test_nested_loops_matrix_product(ti, fp, rtol):
    n, m, p = 5, 4, 3
    a = ti.field(float, shape=(n, m))
    b = ti.field(float, shape=(m, p))
    c = ti.field(float, shape=(n, p))

    @ti.kernel
    def matmul():
        for i, j in c:
            s = 0.0
            for k in range(m):
                s += a[i, k] * b[k, j]
            c[i, j] = s

    rng = np.random.default_rng(1)
    a_np, b_np = rng.standard_normal((n, m)), rng.standard_normal((m, p))
    a.from_numpy(a_np)
    b.from_numpy(b_np)
    matmul()
    np.testing.assert_allclose(c.to_numpy(), a_np @ b_np, rtol=10 * rtol, atol=10 * rtol)


def test_serialized_loop_prefix_sum(ti):
    n = 1000
    x = ti.field(ti.i32, shape=n)

    @ti.kernel
    def prefix_sum():
        ti.loop_config(serialize=True)
        for i in range(1, n):
            x[i] += x[i - 1]

    values = np.random.default_rng(0).integers(-50, 50, n).astype(np.int32)
    x.from_numpy(values)
    prefix_sum()
    np.testing.assert_array_equal(x.to_numpy(), np.cumsum(values))


def test_serialized_outer_loop_may_break(ti):
    x = ti.field(ti.i32, shape=10)

    @ti.kernel
    def run() -> ti.i32:
        last = -1
        ti.loop_config(serialize=True)
        for i in range(10):
            if i * i > 20:
                break
            x[i] = 1
            last = i
        return last

    assert run() == 4
    np.testing.assert_array_equal(x.to_numpy(), [1] * 5 + [0] * 5)


def test_parallel_loop_reduction_into_local(ti):
    @ti.kernel
    def total(n: ti.i32) -> ti.i64:
        s = ti.i64(0)
        for i in range(n):
            s += i
        return s

    assert total(1_000_000) == 499_999_500_000


def test_outermost_loops_run_one_after_another(ti):
    # Each outermost loop is parallel, but it finishes before the next one starts.
    n = 4096
    x = ti.field(ti.i32, shape=n)
    y = ti.field(ti.i32, shape=n)

    @ti.kernel
    def run():
        for i in x:
            x[i] = i * 3
        for i in y:
            y[i] = x[n - 1 - i] + x[(i * 7) % n]

    run()
    i = np.arange(n)
    np.testing.assert_array_equal(y.to_numpy(), (n - 1 - i) * 3 + ((i * 7) % n) * 3)


def test_parallel_loop_iterations_have_private_locals(ti, fp, rtol):
    n = 10_000
    x = ti.field(float, shape=n)

    @ti.kernel
    def run():
        for i in range(n):
            t = i * 0.5
            u = t * t
            for _ in range(3):
                u = u * 0.5 + t
            x[i] = u

    run()
    t = np.arange(n) * 0.5
    u = t * t
    for _ in range(3):
        u = u * 0.5 + t
    np.testing.assert_allclose(x.to_numpy(), u, rtol=rtol)


def test_loops_under_a_plain_if_are_not_the_outermost(ti):
    """As in Taichi, an ``if`` on a Python constant (not ti.static) is compiled as a runtime
    ``if``: a loop in it is not an outermost (parallel) loop, so it may ``break``; under
    ``if ti.static(...)`` it is, and it may not."""
    @ti.kernel
    def count() -> ti.i32:
        a = 0
        if True:
            for i in range(1000):
                if i == 100:
                    break
                a += 1
        return a

    assert count() == 100

    @ti.kernel
    def top_level_break():
        for _i in range(10):
            break

    with pytest.raises(ti.TaichiSyntaxError, match="Cannot break in the outermost loop"):
        top_level_break()

    @ti.kernel
    def static_if_break():
        if ti.static(True):
            for _i in range(10):
                break

    with pytest.raises(ti.TaichiSyntaxError, match="Cannot break in the outermost loop"):
        static_if_break()
