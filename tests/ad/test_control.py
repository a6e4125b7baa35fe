"""Reverse mode through control flow: branches, inner loops with loop-carried locals, atomics,
struct-for / ndrange / grouped loops, ti.func inlining, scalar kernel arguments.

The truth is an analytic derivative, or float64 finite differences of a NumPy re-implementation
of the kernel. The tests at the end are difftape-only: Taichi 1.7.4 cannot differentiate ``while``
loops or ``break`` ("auto_diff.cpp: Not supported") and rejects kernels that mix serial
statements with parallel loops ("Mixed usage of for-loops and statements without looping").
"""

import numpy as np
import pytest

from .helpers import FD_RTOL, check_loss_gradient, close, fd_grad, weights


def _tol(rtol, scale=16):
    return max(scale * rtol, FD_RTOL)


def _elementwise_fd(ref, xs, *extra):
    """d ref(x_i, *extra) / d x_i for every i, by finite differences in float64."""
    return np.array([fd_grad(lambda v: ref(v, *extra), x)[0] for x in np.asarray(xs, float)])


def _setup_xy(ti, npfp, xs, seed=0):
    n = len(xs)
    x = ti.field(float, n, needs_grad=True)
    y = ti.field(float, n, needs_grad=True)
    w = weights(n, seed=seed).astype(npfp)
    x.from_numpy(np.asarray(xs).astype(npfp))
    y.grad.from_numpy(w)
    return x, y, w.astype(np.float64)


def _run_elementwise(ti, npfp, rtol, body_kernel, ref, xs, seed=0, scale=16):
    """``body_kernel(x, y)`` returns a kernel computing ``y[i] = f(x[i])``; checks forward values
    against ``ref`` and ``x.grad`` against its finite-difference derivative."""
    x, y, w = _setup_xy(ti, npfp, xs, seed)
    run = body_kernel(x, y)
    run()
    run.grad()
    xv = x.to_numpy().astype(np.float64)
    close(y.to_numpy(), [ref(v) for v in xv], rtol=_tol(rtol, scale), err_msg="forward")
    close(x.grad.to_numpy(), w * _elementwise_fd(ref, xv), rtol=_tol(rtol, scale),
          err_msg="gradient")


# ------------------------------------------------------------------------------------ branches


def test_if_else_chosen_per_element(ti, fp, npfp, rtol):
    def kernel(x, y):
        @ti.kernel
        def run():
            for i in x:
                v = 0.0
                if x[i] > 0.5:
                    v = x[i] * x[i]
                else:
                    v = -3.0 * x[i] + ti.sin(x[i])
                y[i] = v * 2.0

        return run

    def ref(v):
        return 2 * (v * v if v > 0.5 else -3 * v + np.sin(v))

    _run_elementwise(ti, npfp, rtol, kernel, ref, np.linspace(-2, 2, 9) + 0.01)


def test_if_writes_output_in_both_branches(ti, fp, npfp, rtol):
    def kernel(x, y):
        @ti.kernel
        def run():
            for i in x:
                if x[i] < 0:
                    y[i] = ti.exp(x[i])
                else:
                    y[i] = 1.0 + x[i] + x[i] ** 3

        return run

    def ref(v):
        return np.exp(v) if v < 0 else 1 + v + v**3

    _run_elementwise(ti, npfp, rtol, kernel, ref, np.linspace(-2, 2, 8) + 0.03)


def test_nested_ifs(ti, fp, npfp, rtol):
    def kernel(x, y):
        @ti.kernel
        def run():
            for i in x:
                v = x[i]
                if v > 0:
                    if v > 1:
                        v = v * v * v
                    else:
                        v = ti.sqrt(v) + v
                elif v > -1:
                    v = ti.cos(v) * v
                else:
                    if v < -2:
                        v = -v
                y[i] = v * x[i]

        return run

    def ref(x):
        v = x
        if v > 0:
            v = v**3 if v > 1 else np.sqrt(v) + v
        elif v > -1:
            v = np.cos(v) * v
        elif v < -2:
            v = -v
        return v * x

    _run_elementwise(ti, npfp, rtol, kernel, ref, np.linspace(-3, 3, 13) + 0.021)


def test_ternary_expression_and_logic(ti, fp, npfp, rtol):
    def kernel(x, y):
        @ti.kernel
        def run():
            for i in x:
                a = x[i]
                y[i] = a * a if a > 0 and a < 1.5 else 2.0 * a

        return run

    def ref(a):
        return a * a if 0 < a < 1.5 else 2 * a

    _run_elementwise(ti, npfp, rtol, kernel, ref, np.linspace(-1, 3, 9) + 0.013)


def _taken_branch_kernel(ti, x, y, n):
    @ti.kernel
    def run():
        for i in y:
            v = x[i]
            s = x[i - 1] * v if i > 0 else v * v  # x[-1] exists neither as value nor adjoint
            s += ti.sin(x[i + 1]) if i < n - 1 and x[i + 1] > 0 else 0.5 * v
            y[i] = s

    return run


def _taken_branch_ref(a):
    n = len(a)
    out = np.zeros(n)
    for i in range(n):
        v = a[i]
        s = a[i - 1] * v if i > 0 else v * v
        s += np.sin(a[i + 1]) if i < n - 1 and a[i + 1] > 0 else 0.5 * v
        out[i] = s
    return out


def test_ternary_differentiates_only_the_taken_branch(ti, fp, npfp, rtol):
    ti.init(arch=ti.cpu, default_fp=fp, debug=True)  # an out-of-range read or write raises
    n = 8
    x = ti.field(float, n, needs_grad=True)
    y = ti.field(float, n, needs_grad=True)
    run = _taken_branch_kernel(ti, x, y, n)
    w = weights(n, seed=5).astype(npfp)
    x.from_numpy((np.linspace(-1, 1, n) + 0.05).astype(npfp))
    y.grad.from_numpy(w)
    run()
    run.grad()
    xs = x.to_numpy().astype(np.float64)
    close(y.to_numpy(), _taken_branch_ref(xs), rtol=_tol(rtol), err_msg="forward")
    want = fd_grad(lambda a: np.dot(w.astype(np.float64), _taken_branch_ref(a)), xs)[0]
    close(x.grad.to_numpy(), want, rtol=_tol(rtol), err_msg="gradient")


# --------------------------------------------------------------------------------- inner loops


def _horner(c, x):
    s = 0.0
    for ck in c:
        s = s * x + ck
    return s


def test_horner_inner_loop_carried_local(ti, fp, npfp, rtol):
    m, n = 5, 7
    x = ti.field(float, n, needs_grad=True)
    c = ti.field(float, m, needs_grad=True)
    y = ti.field(float, n, needs_grad=True)

    @ti.kernel
    def run():
        for i in x:
            s = 0.0
            for k in range(m):
                s = s * x[i] + c[k]
            y[i] = s

    xs = np.linspace(-1.5, 1.5, n) + 0.01
    cs = np.array([0.7, -1.2, 0.4, 2.0, -0.3])
    w = weights(n, seed=11).astype(npfp)
    x.from_numpy(xs.astype(npfp))
    c.from_numpy(cs.astype(npfp))
    y.grad.from_numpy(w)
    run()
    run.grad()
    xv, cv, w64 = (a.astype(np.float64) for a in (x.to_numpy(), c.to_numpy(), w))
    powers = np.arange(m - 1, -1, -1)  # c[k] multiplies x ** (m - 1 - k)
    close(y.to_numpy(), [_horner(cv, v) for v in xv], rtol=_tol(rtol))
    dp = np.array([np.sum(cv * powers * v ** np.maximum(powers - 1, 0)) for v in xv])
    close(x.grad.to_numpy(), w64 * dp, rtol=_tol(rtol))
    close(c.grad.to_numpy(), (w64[:, None] * xv[:, None] ** powers).sum(0), rtol=_tol(rtol))


def test_inner_loop_bound_from_kernel_argument(ti, fp, npfp, rtol):
    x = ti.field(float, 5, needs_grad=True)
    y = ti.field(float, 5, needs_grad=True)

    @ti.kernel
    def run(m: ti.i32):
        for i in x:
            s = 1.0
            for _ in range(m):
                s = s * x[i]
            y[i] = s

    xs = np.linspace(0.5, 1.5, 5)
    x.from_numpy(xs.astype(npfp))
    for m in (1, 3, 6):
        y.grad.fill(1)
        x.grad.fill(0)
        run(m)
        run.grad(m)
        xv = x.to_numpy().astype(np.float64)
        close(y.to_numpy(), xv**m, rtol=_tol(rtol))
        close(x.grad.to_numpy(), m * xv ** (m - 1), rtol=_tol(rtol), err_msg=f"m={m}")


def test_inner_loop_bounds_from_fields(ti, fp, npfp, rtol):
    n = 6
    x = ti.field(float, n, needs_grad=True)
    y = ti.field(float, n, needs_grad=True)
    lo = ti.field(ti.i32, ())
    counts = ti.field(ti.i32, n)

    @ti.kernel
    def run():
        for i in x:
            s = 0.0
            for k in range(lo[None], counts[i]):
                s = s * 0.5 + ti.sin(x[i] * k)
            y[i] = s

    def ref(v, lo_, hi):
        s = 0.0
        for k in range(lo_, hi):
            s = s * 0.5 + np.sin(v * k)
        return s

    cnt = np.array([0, 1, 2, 4, 5, 7])
    lo[None] = 1
    counts.from_numpy(cnt.astype(np.int32))
    xs = np.linspace(-1, 1, n) + 0.02
    w = weights(n, seed=12).astype(npfp)
    x.from_numpy(xs.astype(npfp))
    y.grad.from_numpy(w)
    run()
    run.grad()
    xv = x.to_numpy().astype(np.float64)
    close(y.to_numpy(), [ref(v, 1, h) for v, h in zip(xv, cnt, strict=True)], rtol=_tol(rtol))
    want = [w[i] * fd_grad(lambda v, h=cnt[i]: ref(v, 1, h), xv[i])[0] for i in range(n)]
    close(x.grad.to_numpy(), want, rtol=_tol(rtol))


def test_nested_inner_loops(ti, fp, npfp, rtol):
    def kernel(x, y):
        @ti.kernel
        def run():
            for i in x:
                s = 0.0
                for a in range(3):
                    for b in range(4):
                        s = s * 0.7 + ti.sin(x[i] * (a + 1) + b) * x[i]
                y[i] = s

        return run

    def ref(v):
        s = 0.0
        for a in range(3):
            for b in range(4):
                s = s * 0.7 + np.sin(v * (a + 1) + b) * v
        return s

    _run_elementwise(ti, npfp, rtol, kernel, ref, np.linspace(-1, 1, 6) + 0.02)


def test_two_sequential_inner_loops(ti, fp, npfp, rtol):
    # Taichi 1.7.4 accepts this although the older guide's kernel simplicity rule forbade it
    def kernel(x, y):
        @ti.kernel
        def run():
            for i in x:
                s = 0.0
                for _ in range(3):
                    s = s * x[i] + 1.0
                t = 0.0
                for k in range(2):
                    t = t + s * x[i] * (k + 1)
                y[i] = t

        return run

    def ref(v):
        s = v * v + v + 1
        return 3 * s * v

    _run_elementwise(ti, npfp, rtol, kernel, ref, np.linspace(0.5, 2, 4))


def test_three_level_nesting_with_carried_locals(ti, fp, npfp, rtol):
    def kernel(x, y):
        @ti.kernel
        def run():
            for i in x:
                s = 0.0
                for _a in range(3):
                    t = s
                    for _b in range(2):
                        u = t
                        for _c in range(2):
                            u = u * x[i] + 1.0
                        t = t + u * 0.5
                    s = s * 0.3 + t
                y[i] = s

        return run

    def ref(v):
        s = 0.0
        for _ in range(3):
            t = s
            for _ in range(2):
                u = t
                for _ in range(2):
                    u = u * v + 1.0
                t = t + u * 0.5
            s = s * 0.3 + t
        return s

    _run_elementwise(ti, npfp, rtol, kernel, ref, np.linspace(0.5, 2, 4), scale=64)


def test_if_inside_inner_loop(ti, fp, npfp, rtol):
    def kernel(x, y):
        @ti.kernel
        def run():
            for i in x:
                s = x[i]
                for k in range(6):
                    if k % 2 == 0:
                        s = s * x[i]
                    else:
                        s = s + ti.cos(s)
                y[i] = s

        return run

    def ref(v):
        s = v
        for k in range(6):
            s = s * v if k % 2 == 0 else s + np.cos(s)
        return s

    _run_elementwise(ti, npfp, rtol, kernel, ref, np.linspace(-1, 1.2, 6) + 0.01)


def test_static_unrolled_loop(ti, fp, npfp, rtol):
    coeffs = (0.5, -1.0, 2.0, 0.25)

    def kernel(x, y):
        @ti.kernel
        def run():
            for i in x:
                s = 0.0
                for k in ti.static(range(len(coeffs))):
                    s = s * x[i] + coeffs[k]
                y[i] = s

        return run

    _run_elementwise(ti, npfp, rtol, kernel, lambda v: _horner(coeffs, v),
                     np.linspace(-2, 2, 7) + 0.01)


def test_static_loops_inside_parallel_loop(ti, fp, npfp, rtol):
    # the older guide's workaround for the kernel simplicity rule: ti.static inner loops
    m = 4
    x = ti.field(float, (3, m), needs_grad=True)
    y = ti.field(float, 3, needs_grad=True)

    @ti.kernel
    def run():
        for i in range(3):
            for j in ti.static(range(m)):
                y[i] += x[i, j] ** 2
            for j in ti.static(range(m)):
                y[i] += ti.sin(x[i, j])

    xs = np.random.default_rng(13).uniform(-1, 1, (3, m))
    x.from_numpy(xs.astype(npfp))
    w = weights(3, seed=13).astype(npfp)
    y.grad.from_numpy(w)
    run()
    run.grad()
    xv = x.to_numpy().astype(np.float64)
    close(y.to_numpy(), (xv**2 + np.sin(xv)).sum(1), rtol=_tol(rtol))
    close(x.grad.to_numpy(), w.astype(np.float64)[:, None] * (2 * xv + np.cos(xv)),
          rtol=_tol(rtol))


def test_local_reassigned_many_times(ti, fp, npfp, rtol):
    def kernel(x, y):
        @ti.kernel
        def run():
            for i in x:
                a = x[i]
                a = a * a
                b = a + x[i]
                a = b * a
                a = a - ti.sin(b)
                y[i] = a

        return run

    def ref(v):
        a = v * v
        b = a + v
        a = b * a
        return a - np.sin(b)

    _run_elementwise(ti, npfp, rtol, kernel, ref, np.linspace(-1.5, 1.5, 7) + 0.01)


# ------------------------------------------------------------- atomics, loops over fields/ranges


def test_plus_equals_into_scalar_loss(ti, fp, npfp, rtol):
    n = 10
    x = ti.field(float, n, needs_grad=True)
    loss = ti.field(float, (), needs_grad=True)

    @ti.kernel
    def run():
        for i in x:
            loss[None] += x[i] ** 2 * (i + 1)
            loss[None] -= ti.sin(x[i])

    xs = np.linspace(-1, 1, n)
    x.from_numpy(xs.astype(npfp))
    loss.grad[None] = 1
    run()
    run.grad()
    xv = x.to_numpy().astype(np.float64)
    k = np.arange(1, n + 1)
    close(loss[None], np.sum(xv**2 * k - np.sin(xv)), rtol=_tol(rtol))
    close(x.grad.to_numpy(), 2 * xv * k - np.cos(xv), rtol=_tol(rtol))
    assert loss.grad[None] == 1  # accumulation leaves the output's adjoint in place


def test_atomic_add_calls_and_scattered_accumulation(ti, fp, npfp, rtol):
    n, m = 12, 3
    x = ti.field(float, n, needs_grad=True)
    bins = ti.field(float, m, needs_grad=True)
    total = ti.field(float, (), needs_grad=True)

    @ti.kernel
    def run():
        for i in x:
            ti.atomic_add(bins[i % m], x[i] * x[i])
            ti.atomic_add(total[None], 2.0 * x[i])

    xs = np.linspace(-1, 1, n) + 0.05
    wb = weights(m, seed=14).astype(npfp)
    x.from_numpy(xs.astype(npfp))
    bins.grad.from_numpy(wb)
    total.grad[None] = 0.5
    run()
    run.grad()
    xv = x.to_numpy().astype(np.float64)
    close(bins.to_numpy(), [np.sum(xv[k::m] ** 2) for k in range(m)], rtol=_tol(rtol))
    want = 2 * xv * wb.astype(np.float64)[np.arange(n) % m] + 0.5 * 2
    close(x.grad.to_numpy(), want, rtol=_tol(rtol))


def test_struct_for_over_2d_field(ti, fp, npfp, rtol):
    shape = (3, 4)
    x = ti.field(float, shape, needs_grad=True)
    z = ti.field(float, shape, needs_grad=True)
    loss = ti.field(float, (), needs_grad=True)

    @ti.kernel
    def run():
        for i, j in x:
            loss[None] += x[i, j] * z[i, j] ** 2 + (i - j) * x[i, j]

    rng = np.random.default_rng(15)
    xs, zs = rng.uniform(-1, 1, shape), rng.uniform(-1, 1, shape)
    x.from_numpy(xs.astype(npfp))
    z.from_numpy(zs.astype(npfp))
    loss.grad[None] = 1
    run()
    run.grad()
    xv, zv = x.to_numpy().astype(np.float64), z.to_numpy().astype(np.float64)
    ii, jj = np.indices(shape)
    close(x.grad.to_numpy(), zv**2 + (ii - jj), rtol=_tol(rtol))
    close(z.grad.to_numpy(), 2 * xv * zv, rtol=_tol(rtol))


def test_ndrange_pairs(ti, fp, npfp, rtol):
    n, m = 5, 4
    x = ti.field(float, n, needs_grad=True)
    z = ti.field(float, m, needs_grad=True)
    loss = ti.field(float, (), needs_grad=True)

    @ti.kernel
    def run():
        for i, j in ti.ndrange(n, (1, m)):
            loss[None] += ti.exp(-((x[i] - z[j]) ** 2))

    def ref(xa, za):
        d = xa[:, None] - za[None, 1:]
        return np.sum(np.exp(-(d**2)))

    x.from_numpy(np.linspace(-1, 1, n).astype(npfp))
    z.from_numpy(np.linspace(-0.5, 0.7, m).astype(npfp))
    loss.grad[None] = 1
    run()
    run.grad()
    xv, zv = x.to_numpy().astype(np.float64), z.to_numpy().astype(np.float64)
    gx, gz = fd_grad(ref, xv, zv)
    close(loss[None], ref(xv, zv), rtol=_tol(rtol))
    close(x.grad.to_numpy(), gx, rtol=_tol(rtol))
    close(z.grad.to_numpy(), gz, rtol=_tol(rtol))
    assert z.grad[0] == 0


def test_grouped_loop_over_vector_field(ti, fp, npfp, rtol):
    shape = (2, 3)
    x = ti.Vector.field(2, float, shape, needs_grad=True)
    loss = ti.field(float, (), needs_grad=True)

    @ti.kernel
    def run():
        for I in ti.grouped(x):  # noqa: E741 (Taichi's usual name)
            v = x[I]
            loss[None] += v.dot(v) * (I[0] + 1) + v[0] * v[1]

    def ref(a):
        k = np.arange(1, shape[0] + 1)[:, None]
        return np.sum((a**2).sum(-1) * k + a[..., 0] * a[..., 1])

    xs = np.random.default_rng(16).uniform(-1, 1, (*shape, 2))
    x.from_numpy(xs.astype(npfp))
    check_loss_gradient(x, loss, run, ref, _tol(rtol))


def test_neighbour_reads(ti, fp, npfp, rtol):
    n = 8
    x = ti.field(float, n, needs_grad=True)
    y = ti.field(float, n, needs_grad=True)

    @ti.kernel
    def run():
        for i in y:
            y[i] = x[i] * x[(i + 1) % n] - x[(i + n - 1) % n] ** 2

    def ref(a):
        return np.sum(w64 * (a * np.roll(a, -1) - np.roll(a, 1) ** 2))

    w = weights(n, seed=17).astype(npfp)
    w64 = w.astype(np.float64)
    x.from_numpy(np.linspace(-1, 1, n).astype(npfp))
    y.grad.from_numpy(w)
    run()
    run.grad()
    close(x.grad.to_numpy(), fd_grad(ref, x.to_numpy().astype(np.float64))[0], rtol=_tol(rtol))


def test_funcs_are_inlined(ti, fp, npfp, rtol):
    @ti.func
    def square(v):
        return v * v

    @ti.func
    def bump(v, c):
        return ti.exp(-square(v - c))

    @ti.func
    def combine(a, b):
        r = a
        if b > a:
            r = b
        return r * 2.0 + square(a)

    def kernel(x, y):
        @ti.kernel
        def run():
            for i in x:
                y[i] = combine(bump(x[i], 0.3), square(ti.sin(x[i])))

        return run

    def ref(v):
        a = np.exp(-((v - 0.3) ** 2))
        b = np.sin(v) ** 2
        return max(a, b) * 2 + a * a

    _run_elementwise(ti, npfp, rtol, kernel, ref, np.linspace(-2, 2, 9) + 0.01)


@pytest.mark.difftape_only
def test_func_with_inner_loop(ti, fp, npfp, rtol):
    # Taichi 1.7.4 gets this wrong (see test_local_copy_read_in_inner_loop): a func argument is
    # a local copy, and Taichi drops the gradient of a local that an inner loop only reads.
    @ti.func
    def poly(v, n: ti.template()):
        s = 0.0
        for k in range(n):
            s = s * v + (k + 1)
        return s

    def kernel(x, y):
        @ti.kernel
        def run():
            for i in x:
                y[i] = poly(x[i], 4) * poly(x[i] * 0.5, 2)

        return run

    def ref(v):
        return _horner([1, 2, 3, 4], v) * _horner([1, 2], 0.5 * v)

    _run_elementwise(ti, npfp, rtol, kernel, ref, np.linspace(-1.5, 1.5, 6) + 0.01)


@pytest.mark.difftape_only
def test_local_copy_read_in_inner_loop(ti, fp, npfp, rtol):
    # Taichi 1.7.4 returns x.grad == 0 here (true: p'(x) = 3x^2 + 4x + 3): the local `v` is
    # only read inside the inner loop and its adjoint is lost. Reading x[i] directly in the loop
    # (test_horner_inner_loop_carried_local) is differentiated correctly by Taichi.
    def kernel(x, y):
        @ti.kernel
        def run():
            for i in x:
                v = x[i]
                s = 0.0
                for k in range(4):
                    s = s * v + (k + 1)
                y[i] = s

        return run

    def ref(v):
        return v**3 + 2 * v**2 + 3 * v + 4

    x, y, w = _setup_xy(ti, npfp, np.array([0.5, 1.0, 1.5, -0.7]))
    run = kernel(x, y)
    run()
    run.grad()
    xv = x.to_numpy().astype(np.float64)
    close(y.to_numpy(), ref(xv), rtol=_tol(rtol))
    close(x.grad.to_numpy(), w * (3 * xv**2 + 4 * xv + 3), rtol=_tol(rtol))


def test_scalar_kernel_arguments(ti, fp, npfp, rtol):
    n = 6
    x = ti.field(float, n, needs_grad=True)
    y = ti.field(float, n, needs_grad=True)

    @ti.kernel
    def run(a: float, b: float, k: ti.i32):
        for i in x:
            y[i] = a * x[i] ** 2 + b * ti.sin(x[i] * k)

    xs = np.linspace(-1, 1, n)
    w = weights(n, seed=18).astype(npfp)
    x.from_numpy(xs.astype(npfp))
    y.grad.from_numpy(w)
    run(1.5, -0.5, 3)
    run.grad(1.5, -0.5, 3)
    xv, w64 = x.to_numpy().astype(np.float64), w.astype(np.float64)
    close(x.grad.to_numpy(), w64 * (3 * xv - 1.5 * np.cos(3 * xv)), rtol=_tol(rtol))


def test_two_parallel_loops_through_intermediate_field(ti, fp, npfp, rtol):
    n = 6
    x = ti.field(float, n, needs_grad=True)
    tmp = ti.field(float, n, needs_grad=True)
    loss = ti.field(float, (), needs_grad=True)

    @ti.kernel
    def run():
        for i in x:
            tmp[i] = ti.sin(x[i]) * 2.0
        for i in tmp:
            loss[None] += tmp[i] * tmp[(i + 1) % n]

    def ref(a):
        t = 2 * np.sin(a)
        return np.sum(t * np.roll(t, -1))

    x.from_numpy(np.linspace(-1, 1, n).astype(npfp))
    check_loss_gradient(x, loss, run, ref, _tol(rtol))


# ------------------------------------------------------------------------------ difftape only


@pytest.mark.difftape_only
def test_while_loop_fixed_count(ti, fp, npfp, rtol):
    def kernel(x, y):
        @ti.kernel
        def run():
            for i in x:
                s = 1.0
                k = 0
                while k < 5:
                    s = s * x[i]
                    k += 1
                y[i] = s

        return run

    _run_elementwise(ti, npfp, rtol, kernel, lambda v: v**5, np.linspace(-1.5, 1.5, 7))


@pytest.mark.difftape_only
def test_while_loop_data_dependent_count(ti, fp, npfp, rtol):
    # the trip count depends on x (locally constant), the gradient is K * x ** (K - 1)
    def kernel(x, y):
        @ti.kernel
        def run():
            for i in x:
                s = x[i]
                while s < 10.0:
                    s = s * x[i]
                y[i] = s

        return run

    def ref(v):
        s = v
        while s < 10:
            s = s * v
        return s

    _run_elementwise(ti, npfp, rtol, kernel, ref, np.array([1.3, 1.7, 2.2, 3.5, 4.1, 11.0]))


@pytest.mark.difftape_only
def test_while_newton_sqrt(ti, fp, npfp, rtol):
    # Newton's iteration for sqrt(a); its derivative converges to 1 / (2 sqrt(a))
    n = 5
    a = ti.field(float, n, needs_grad=True)
    y = ti.field(float, n, needs_grad=True)

    @ti.kernel
    def run(iterations: ti.i32):
        for i in a:
            r = a[i]
            k = 0
            while k < iterations:
                r = 0.5 * (r + a[i] / r)
                k += 1
            y[i] = r

    av = np.array([0.5, 1.0, 2.0, 9.0, 30.0])
    a.from_numpy(av.astype(npfp))
    y.grad.fill(1)
    run(40)
    run.grad(40)
    av = a.to_numpy().astype(np.float64)
    close(y.to_numpy(), np.sqrt(av), rtol=_tol(rtol))
    close(a.grad.to_numpy(), 0.5 / np.sqrt(av), rtol=_tol(rtol))


@pytest.mark.difftape_only
def test_break_in_inner_loop(ti, fp, npfp, rtol):
    def kernel(x, y):
        @ti.kernel
        def run():
            for i in x:
                s = 1.0
                for _ in range(8):
                    if s > 4.0:
                        break
                    s = s * x[i] + 0.5
                y[i] = s

        return run

    def ref(v):
        s = 1.0
        for _ in range(8):
            if s > 4.0:
                break
            s = s * v + 0.5
        return s

    # trip counts differ per element; no point lies on a threshold
    _run_elementwise(ti, npfp, rtol, kernel, ref, np.array([0.3, 0.9, 1.2, 1.6, 2.1, 3.3, 5.0]))


@pytest.mark.difftape_only
def test_continue_in_inner_loop(ti, fp, npfp, rtol):
    def kernel(x, y):
        @ti.kernel
        def run():
            for i in x:
                s = 0.0
                for k in range(7):
                    if k % 3 == 1:
                        continue
                    s = s * 0.5 + x[i] ** (k % 4) * (k + 1)
                y[i] = s

        return run

    def ref(v):
        s = 0.0
        for k in range(7):
            if k % 3 == 1:
                continue
            s = s * 0.5 + v ** (k % 4) * (k + 1)
        return s

    _run_elementwise(ti, npfp, rtol, kernel, ref, np.linspace(-1.5, 1.5, 7) + 0.01)


@pytest.mark.difftape_only
def test_break_inside_nested_loop_only_leaves_inner(ti, fp, npfp, rtol):
    def kernel(x, y):
        @ti.kernel
        def run():
            for i in x:
                s = 0.0
                for a in range(4):
                    t = 1.0
                    for _ in range(6):
                        t = t * x[i]
                        if t > 2.0 + a:
                            break
                    s = s + t * (a + 1)
                y[i] = s

        return run

    def ref(v):
        s = 0.0
        for a in range(4):
            t = 1.0
            for _ in range(6):
                t = t * v
                if t > 2.0 + a:
                    break
            s = s + t * (a + 1)
        return s

    _run_elementwise(ti, npfp, rtol, kernel, ref, np.array([0.5, 1.1, 1.3, 1.55, 1.9, 2.6]))


@pytest.mark.difftape_only
def test_serial_statement_mixed_with_parallel_loop(ti, fp, npfp, rtol):
    # the guide's "Bad" example: Taichi rejects it, difftape differentiates it
    n = 10
    x = ti.field(float, n, needs_grad=True)
    loss = ti.field(float, (), needs_grad=True)

    @ti.kernel
    def differentiable_task():
        loss[None] += x[0]
        for i in range(10):
            loss[None] += x[i] ** 2

    x.from_numpy(np.linspace(-1, 1, n).astype(npfp))
    loss.grad[None] = 1
    differentiable_task()
    differentiable_task.grad()
    xv = x.to_numpy().astype(np.float64)
    close(loss[None], xv[0] + np.sum(xv**2), rtol=_tol(rtol))
    want = 2 * xv
    want[0] += 1
    close(x.grad.to_numpy(), want, rtol=_tol(rtol))


@pytest.mark.difftape_only
@pytest.mark.parametrize("hoisted", [False, True], ids=["scale_in_loop", "scale_at_kernel_level"])
def test_serial_code_around_parallel_loop(ti, fp, npfp, rtol, hoisted):
    # hoisted: a kernel-level local, computed before the parallel loop, is read by every
    # iteration, so its adjoint is a sum over the loop's iterations
    n = 6
    x = ti.field(float, n, needs_grad=True)
    y = ti.field(float, n, needs_grad=True)
    loss = ti.field(float, (), needs_grad=True)

    @ti.kernel
    def run():
        scale = ti.exp(x[0])
        for i in x:
            if ti.static(hoisted):
                y[i] = x[i] * x[i] * scale
            else:
                y[i] = x[i] * x[i] * ti.exp(x[0])
        s = 0.0
        ti.loop_config(serialize=True)  # a serial loop after the parallel one
        for k in range(n):
            s = s * 0.5 + y[k]
        loss[None] = s * y[1] + scale

    def ref(a):
        yy = a * a * np.exp(a[0])
        s = 0.0
        for k in range(n):
            s = s * 0.5 + yy[k]
        return s * yy[1] + np.exp(a[0])

    x.from_numpy((np.linspace(-1, 1, n) + 0.1).astype(npfp))
    check_loss_gradient(x, loss, run, ref, _tol(rtol))


@pytest.mark.difftape_only
def test_parallel_loop_body_mixing_statements_and_loops(ti, fp, npfp, rtol):
    def kernel(x, y):
        @ti.kernel
        def run():
            for i in x:
                s = x[i]
                for _ in range(3):
                    s = s * x[i] + 1.0
                s = ti.sin(s)
                k = 0
                while k < 2:
                    t = 0.0
                    for j in range(3):
                        t = t + s * (j + 1)
                    s = t * 0.1 + s * x[i]
                    k += 1
                y[i] = s

        return run

    def ref(v):
        s = v
        for _ in range(3):
            s = s * v + 1.0
        s = np.sin(s)
        for _ in range(2):
            t = 0.0
            for j in range(3):
                t = t + s * (j + 1)
            s = t * 0.1 + s * v
        return s

    _run_elementwise(ti, npfp, rtol, kernel, ref, np.linspace(-1, 1, 5) + 0.01, scale=64)


@pytest.mark.difftape_only
def test_serial_kernel_with_loop_carried_locals(ti, fp, npfp, rtol):
    n = 6
    x = ti.field(float, n, needs_grad=True)
    loss = ti.field(float, (), needs_grad=True)

    @ti.kernel
    def run():
        s = 0.0
        ti.loop_config(serialize=True)  # `s` is carried from one iteration to the next
        for i in range(n):
            t = s
            for j in range(i):
                t = t * 0.5 + x[j] * x[i]
            s = s + ti.tanh(t)
        loss[None] = s

    def ref(a):
        s = 0.0
        ti.loop_config(serialize=True)  # `s` is carried from one iteration to the next
        for i in range(n):
            t = s
            for j in range(i):
                t = t * 0.5 + a[j] * a[i]
            s = s + np.tanh(t)
        return s

    x.from_numpy(np.linspace(-1, 1, n).astype(npfp))
    check_loss_gradient(x, loss, run, ref, _tol(rtol, 64))


class _Dual:
    """A number with its exact derivative (forward-mode chain rule), for analytic truth."""

    def __init__(self, v, d=0.0):
        self.v, self.d = float(v), float(d)

    def __add__(self, o):
        o = o if isinstance(o, _Dual) else _Dual(o)
        return _Dual(self.v + o.v, self.d + o.d)

    __radd__ = __add__

    def __mul__(self, o):
        o = o if isinstance(o, _Dual) else _Dual(o)
        return _Dual(self.v * o.v, self.d * o.v + self.v * o.d)

    __rmul__ = __mul__

    def __neg__(self):
        return _Dual(-self.v, -self.d)

    def sin(self):
        return _Dual(np.sin(self.v), np.cos(self.v) * self.d)


def _early_return_ref(v, paths):
    """The func of the early-return tests in plain Python; records which return was taken."""
    if v.v > 0.8:
        paths.add("cube")
        return v * v * v
    s = v.sin()
    for _ in range(4):
        s = s * v + 0.5
        if s.v > 1.0:
            paths.add("for")
            return s * 2.0
    k = 0
    while k < 3:
        if s.v < 0.4:
            paths.add("while")
            return -s * v
        s = s * 0.8
        k += 1
    paths.add("end")
    return s


def _early_return_kernel(ti, x, y):
    @ti.func
    def g(v) -> float:
        if v > 0.8:
            return v * v * v
        s = ti.sin(v)
        for _ in range(4):
            s = s * v + 0.5
            if s > 1.0:
                return s * 2.0
        k = 0
        while k < 3:
            if s < 0.4:
                return -s * v
            s = s * 0.8
            k += 1
        return s

    @ti.kernel
    def run():
        for i in x:
            y[i] = g(x[i])

    return run


_EARLY_RETURN_XS = np.array([-0.9, -0.6, -0.3, -0.05, 0.15, 0.3, 0.45, 0.7, 0.9])


def _early_return_truth(xv):
    paths: set = set()
    out = [_early_return_ref(_Dual(v, 1.0), paths) for v in xv]
    assert paths == {"cube", "for", "while", "end"}, paths  # every return is exercised
    return np.array([o.v for o in out]), np.array([o.d for o in out])


@pytest.mark.difftape_only  # Taichi refuses a return inside non-static if/for in a func
def test_reverse_through_func_with_early_returns(ti, fp, npfp, rtol):
    x, y, w = _setup_xy(ti, npfp, _EARLY_RETURN_XS)
    run = _early_return_kernel(ti, x, y)
    run()
    run.grad()
    value, slope = _early_return_truth(x.to_numpy().astype(np.float64))
    close(y.to_numpy(), value, rtol=_tol(rtol), err_msg="forward")
    close(x.grad.to_numpy(), w * slope, rtol=_tol(rtol), err_msg="gradient")


@pytest.mark.difftape_only  # Taichi refuses a return inside non-static if/for in a func
def test_forward_mode_through_func_with_early_returns(ti, fp, npfp, rtol):
    n = len(_EARLY_RETURN_XS)
    x = ti.field(float, n, needs_dual=True)
    y = ti.field(float, n, needs_dual=True)
    x.from_numpy(_EARLY_RETURN_XS.astype(npfp))
    run = _early_return_kernel(ti, x, y)
    seed = (np.arange(n) / 4 - 1.125).astype(npfp)
    with ti.ad.FwdMode(loss=y, param=x, seed=list(seed)):
        run()
    value, slope = _early_return_truth(x.to_numpy().astype(np.float64))
    close(y.to_numpy(), value, rtol=_tol(rtol), err_msg="forward")
    close(y.dual.to_numpy(), seed.astype(np.float64) * slope, rtol=_tol(rtol),
          err_msg="tangent")
