"""Reverse mode through ndarrays: ``ti.ndarray(..., needs_grad=True)`` passed to kernels with
``ti.types.ndarray()`` parameters; the same ndarrays are passed to ``kernel.grad`` and the
gradients land in ``arr.grad``.

Taichi 1.7.4 notes: ``ti.Vector.ndarray`` has no ``needs_grad`` argument, so vector ndarrays
are made with ``ti.ndarray(ti.types.vector(n, dtype), shape, needs_grad=True)``. A Tape whose
loss is an ndarray zeroes the loss on entry but does not clear gradients, so these tests zero
the ndarray gradients themselves where it matters.
"""

import numpy as np
import pytest

from .helpers import FD_RTOL, close, fd_grad, weights


def test_kernel_grad_with_ndarray_arguments(ti, fp, npfp, rtol):
    n = 6
    a = ti.ndarray(float, n, needs_grad=True)
    b = ti.ndarray(float, n, needs_grad=True)

    @ti.kernel
    def run(x: ti.types.ndarray(), y: ti.types.ndarray()):
        for i in x:
            y[i] = ti.sin(x[i]) * x[i]

    xs = np.linspace(-1.5, 1.5, n)
    w = weights(n, seed=30).astype(npfp)
    a.from_numpy(xs.astype(npfp))
    b.grad.from_numpy(w)
    run(a, b)
    run.grad(a, b)
    xv, w64 = a.to_numpy().astype(np.float64), w.astype(np.float64)
    close(b.to_numpy(), np.sin(xv) * xv, rtol=8 * rtol)
    close(a.grad.to_numpy(), w64 * (np.cos(xv) * xv + np.sin(xv)), rtol=8 * rtol)
    np.testing.assert_array_equal(b.grad.to_numpy(), np.zeros(n))  # assigned output: consumed


def test_tape_with_ndarray_loss(ti, fp, npfp, rtol):
    n = 5
    a = ti.ndarray(float, n, needs_grad=True)
    loss = ti.ndarray(float, (), needs_grad=True)

    @ti.kernel
    def reduce(x: ti.types.ndarray(), out: ti.types.ndarray()):
        for i in x:
            out[None] += x[i] ** 2 * (i + 1)

    xs = np.linspace(-1, 1, n)
    a.from_numpy(xs.astype(npfp))
    loss.from_numpy(np.array(42.0, dtype=npfp))  # the Tape zeroes the loss on entry
    with ti.ad.Tape(loss=loss):
        reduce(a, loss)
    xv = a.to_numpy().astype(np.float64)
    k = np.arange(1, n + 1)
    close(loss.to_numpy(), np.sum(xv**2 * k), rtol=8 * rtol)
    close(loss.grad.to_numpy(), 1.0, rtol=0)
    close(a.grad.to_numpy(), 2 * xv * k, rtol=8 * rtol)


def test_tape_with_field_loss_and_ndarray_input(ti, fp, npfp, rtol):
    n = 4
    a = ti.ndarray(float, n, needs_grad=True)
    loss = ti.field(float, (), needs_grad=True)

    @ti.kernel
    def reduce(x: ti.types.ndarray()):
        for i in x:
            loss[None] += x[i] ** 3

    xs = np.array([-1.0, -0.5, 0.25, 2.0])
    a.from_numpy(xs.astype(npfp))
    with ti.ad.Tape(loss=loss):
        reduce(a)
    xv = a.to_numpy().astype(np.float64)
    close(loss[None], np.sum(xv**3), rtol=8 * rtol)
    close(a.grad.to_numpy(), 3 * xv**2, rtol=8 * rtol)


def test_vector_ndarray(ti, fp, npfp, rtol):
    n = 3
    v = ti.ndarray(ti.types.vector(2, float), n, needs_grad=True)
    loss = ti.field(float, (), needs_grad=True)

    @ti.kernel
    def run(x: ti.types.ndarray()):
        for i in x:
            loss[None] += x[i].norm_sqr() * (i + 1) + x[i][0] * x[i][1]

    xs = np.arange(2 * n, dtype=np.float64).reshape(n, 2) * 0.5 - 1
    v.from_numpy(xs.astype(npfp))
    with ti.ad.Tape(loss=loss):
        run(v)
    xv = v.to_numpy().astype(np.float64)
    k = np.arange(1, n + 1)[:, None]
    want = 2 * xv * k + xv[:, ::-1]
    close(v.grad.to_numpy(), want, rtol=8 * rtol)


def test_2d_ndarray_with_inner_loop_over_shape(ti, fp, npfp, rtol):
    m = ti.ndarray(float, (2, 3), needs_grad=True)
    out = ti.ndarray(float, 2, needs_grad=True)

    @ti.kernel
    def rows(a: ti.types.ndarray(dtype=float, ndim=2), o: ti.types.ndarray(dtype=float, ndim=1)):
        for i in range(a.shape[0]):
            s = 0.0
            for j in range(a.shape[1]):
                s = s * 0.5 + a[i, j] ** 2
            o[i] = s

    def ref(a):
        s = np.zeros(a.shape[0])
        for j in range(a.shape[1]):
            s = s * 0.5 + a[:, j] ** 2
        return np.sum(np.array([1.0, 2.0]) * s)

    m.from_numpy((np.arange(6.0).reshape(2, 3) * 0.3 - 0.4).astype(npfp))
    out.grad.from_numpy(np.array([1.0, 2.0], dtype=npfp))
    rows(m, out)
    rows.grad(m, out)
    close(m.grad.to_numpy(), fd_grad(ref, m.to_numpy())[0], rtol=max(16 * rtol, FD_RTOL))


def test_ndarray_and_field_chained_in_tape(ti, fp, npfp, rtol):
    n = 5
    x = ti.field(float, n, needs_grad=True)
    tmp = ti.ndarray(float, n, needs_grad=True)
    loss = ti.field(float, (), needs_grad=True)

    @ti.kernel
    def expand(t: ti.types.ndarray()):
        for i in x:
            t[i] = ti.exp(x[i]) - x[i]

    @ti.kernel
    def reduce(t: ti.types.ndarray()):
        for i in t:
            loss[None] += t[i] * t[i]

    xs = np.linspace(-1, 1, n)
    x.from_numpy(xs.astype(npfp))
    with ti.ad.Tape(loss):
        expand(tmp)
        reduce(tmp)
    xv = x.to_numpy().astype(np.float64)
    t = np.exp(xv) - xv
    close(loss[None], np.sum(t * t), rtol=8 * rtol)
    close(x.grad.to_numpy(), 2 * t * (np.exp(xv) - 1), rtol=8 * rtol)


def test_same_kernel_with_different_ndarrays(ti, fp, npfp, rtol):
    @ti.kernel
    def run(x: ti.types.ndarray(), y: ti.types.ndarray()):
        for i in x:
            y[i] = x[i] * x[i] * x[i]

    grads = []
    for n, lo in ((3, -1.0), (7, 0.5)):
        a = ti.ndarray(float, n, needs_grad=True)
        b = ti.ndarray(float, n, needs_grad=True)
        a.from_numpy(np.linspace(lo, lo + 1, n).astype(npfp))
        b.grad.fill(1)
        run(a, b)
        run.grad(a, b)
        grads.append((a, a.grad.to_numpy()))
    for a, g in grads:
        close(g, 3 * a.to_numpy().astype(np.float64) ** 2, rtol=8 * rtol)


def test_integer_ndarray_with_needs_grad_is_refused_as_a_runtime_error(ti):
    # Taichi raises TaichiRuntimeError naming the dtype; a RuntimeError either way
    with pytest.raises(ti.TaichiRuntimeError, match=r"i32 is not supported for ndarray"):
        ti.ndarray(ti.i32, shape=3, needs_grad=True)
    with pytest.raises(RuntimeError, match=r"i32 is not supported for ndarray"):
        ti.ndarray(ti.i32, shape=3, needs_grad=True)
