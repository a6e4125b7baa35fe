"""ti.svd and ti.polar_decompose in 2-D and 3-D, checked against numpy.linalg."""

import numpy as np
import pytest

BATCH = 8


def _inputs(n):
    a = np.random.default_rng(n).uniform(-1.0, 1.0, (BATCH, n, n))
    a[0] = np.diag(np.arange(1.0, n + 1))  # already diagonal
    a[1] = -a[1]
    a[2] = np.diag([2.0] * (n - 1) + [-1.0])  # negative determinant
    return a


def _t(m):
    return np.swapaxes(m, -1, -2)


@pytest.mark.parametrize("n", [2, 3])
def test_svd_and_polar_decompose(ti, fp, n):
    # Taichi's 3-D SVD is iterative: f64 reconstruction is good to ~1e-10, not to machine eps.
    atol = 1e-5 if fp == ti.f32 else 1e-9
    A = ti.Matrix.field(n, n, float, shape=BATCH)
    U = ti.Matrix.field(n, n, float, shape=BATCH)
    S = ti.Matrix.field(n, n, float, shape=BATCH)
    V = ti.Matrix.field(n, n, float, shape=BATCH)
    R = ti.Matrix.field(n, n, float, shape=BATCH)
    P = ti.Matrix.field(n, n, float, shape=BATCH)

    @ti.kernel
    def decompose():
        for i in A:
            U[i], S[i], V[i] = ti.svd(A[i])
            R[i], P[i] = ti.polar_decompose(A[i])

    a = _inputs(n)
    A.from_numpy(a)
    decompose()
    u, s, v, r, p = (f.to_numpy().astype(np.float64) for f in (U, S, V, R, P))
    eye = np.broadcast_to(np.eye(n), a.shape)

    # SVD: A = U S V^T with orthogonal U, V and diagonal S holding the singular values
    np.testing.assert_allclose(u @ s @ _t(v), a, atol=atol)
    np.testing.assert_allclose(u @ _t(u), eye, atol=atol)
    np.testing.assert_allclose(v @ _t(v), eye, atol=atol)
    diag = np.diagonal(s, axis1=1, axis2=2)
    np.testing.assert_allclose(s, diag[:, :, None] * eye, atol=atol)
    want_sv = np.linalg.svd(a, compute_uv=False)
    np.testing.assert_allclose(np.sort(np.abs(diag), 1), np.sort(want_sv, 1), atol=atol)

    # polar: A = R P with orthogonal R and symmetric P
    np.testing.assert_allclose(r @ p, a, atol=atol)
    np.testing.assert_allclose(r @ _t(r), eye, atol=atol)
    np.testing.assert_allclose(p, _t(p), atol=atol)
    np.testing.assert_allclose(np.abs(np.linalg.det(r)), 1.0, atol=atol)

    if n == 3:
        # 3-D uses the rotation-variant convention: U and V are rotations, so a negative
        # determinant shows up as a negative smallest singular value.
        np.testing.assert_allclose(np.linalg.det(u), 1.0, atol=atol)
        np.testing.assert_allclose(np.linalg.det(v), 1.0, atol=atol)
        np.testing.assert_allclose(np.linalg.det(r), 1.0, atol=atol)
        np.testing.assert_allclose(np.prod(diag, 1), np.linalg.det(a), atol=atol)
    else:
        # 2-D polar: P is the positive semi-definite factor sqrt(A^T A)
        np.testing.assert_array_less(-atol, np.linalg.eigvalsh(p))


def _edge_inputs(n):
    rng = np.random.default_rng(10 + n)
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    q[:, 0] *= np.sign(np.linalg.det(q))  # a rotation
    flip = np.diag([1.0] * (n - 1) + [-1.0])
    return np.stack(
        [
            np.eye(n),
            -np.eye(n),
            np.zeros((n, n)),
            np.ones((n, n)),  # rank 1
            np.diag([1.0] + [0.0] * (n - 1)),  # rank 1, diagonal
            np.diag([3.0] * (n - 1) + [0.0]),  # rank n-1, repeated singular value
            q,  # rotation: all singular values 1
            2.5 * q,
            q @ flip,  # reflection
            np.eye(n)[::-1].copy(),  # permutation
            q @ np.diag(np.arange(n, 0, -1.0)) @ flip @ q.T,  # distinct, negative determinant
            np.diag(np.arange(1.0, n + 1)) + 1e-4 * rng.standard_normal((n, n)),
            rng.integers(-3, 4, (n, n)).astype(np.float64),
        ]
    )


def _decompose_batch(ti, a, n):
    """Run ti.svd and ti.polar_decompose on a batch of matrices in one kernel; returns the
    input as stored (in the field's precision) and (U, S, V, R, P), all as float64."""
    fields = [ti.Matrix.field(n, n, float, shape=a.shape[0]) for _ in range(6)]
    A, U, S, V, R, P = fields

    @ti.kernel
    def decompose():
        for i in A:
            U[i], S[i], V[i] = ti.svd(A[i])
            R[i], P[i] = ti.polar_decompose(A[i])

    A.from_numpy(a)
    decompose()
    return A.to_numpy().astype(np.float64), tuple(
        f.to_numpy().astype(np.float64) for f in (U, S, V, R, P))


@pytest.mark.parametrize("n", [2, 3])
def test_svd_and_polar_decompose_edge_cases(ti, fp, n):
    # Identity, zero, rank-deficient, repeated singular values, rotations and reflections, plus
    # Taichi's sign conventions: 2-D keeps S >= 0 and V a rotation (U carries det's sign);
    # 3-D keeps U and V rotations and puts det's sign on the last (smallest) singular value.
    atol = 2e-5 if fp == ti.f32 else 1e-9
    a = _edge_inputs(n)
    _, (u, s, v, r, p) = _decompose_batch(ti, a, n)
    assert all(np.isfinite(x).all() for x in (u, s, v, r, p))
    eye = np.broadcast_to(np.eye(n), a.shape)
    scale = np.maximum(np.abs(a).max(axis=(1, 2)), 1.0)[:, None, None]
    det_a = np.linalg.det(a)
    nonsingular = np.abs(det_a) > 1e-6

    np.testing.assert_allclose((u @ s @ _t(v)) / scale, a / scale, atol=atol)
    np.testing.assert_allclose(u @ _t(u), eye, atol=atol)
    np.testing.assert_allclose(v @ _t(v), eye, atol=atol)
    diag = np.diagonal(s, axis1=1, axis2=2)
    np.testing.assert_allclose(s, diag[:, :, None] * eye, atol=atol)
    sv = np.abs(diag) / scale[:, :, 0]
    np.testing.assert_array_less(sv[:, 1:] - atol, sv[:, :-1])  # decreasing magnitude
    want_sv = np.linalg.svd(a, compute_uv=False) / scale[:, :, 0]
    np.testing.assert_allclose(sv, want_sv, atol=atol)
    np.testing.assert_allclose(np.linalg.det(v), 1.0, atol=atol)

    np.testing.assert_allclose((r @ p) / scale, a / scale, atol=atol)
    np.testing.assert_allclose(r @ _t(r), eye, atol=atol)
    np.testing.assert_allclose(p / scale, _t(p) / scale, atol=atol)

    if n == 2:
        np.testing.assert_array_less(-atol, diag / scale[:, :, 0])
        sign = np.sign(det_a[nonsingular])
        np.testing.assert_allclose(np.linalg.det(u)[nonsingular], sign, atol=atol)
        np.testing.assert_allclose(np.linalg.det(r)[nonsingular], sign, atol=atol)
        np.testing.assert_array_less(-atol, np.linalg.eigvalsh(p) / scale[:, :, 0])
    else:
        np.testing.assert_allclose(np.linalg.det(u), 1.0, atol=atol)
        np.testing.assert_allclose(np.linalg.det(r), 1.0, atol=atol)
        np.testing.assert_array_equal(np.sign(diag[nonsingular, 2]), np.sign(det_a[nonsingular]))


@pytest.mark.difftape_only
@pytest.mark.parametrize("n", [2, 3])
def test_svd_and_polar_decompose_extreme_scales(ti, fp, n):
    # Inputs are rescaled by a power of two internally, so tiny and huge matrices decompose as
    # accurately as unit-sized ones (Taichi 1.7.4 returns NaN or garbage for several of these,
    # and its 3-D f64 SVD loses digits already at 1e-3).
    atol = 2e-6 if fp == ti.f32 else 1e-13
    rng = np.random.default_rng(n)
    base = rng.standard_normal((4, n, n))
    exps = [-30, -3, 30] if fp == ti.f32 else [-150, -30, -3, 30, 150]
    a = np.concatenate([base * 10.0**e for e in exps])
    a, (u, s, v, r, p) = _decompose_batch(ti, a, n)  # a: what the kernel actually saw
    scale = np.abs(a).max(axis=(1, 2))[:, None, None]
    eye = np.broadcast_to(np.eye(n), a.shape)
    np.testing.assert_allclose((u @ s @ _t(v)) / scale, a / scale, atol=atol)
    np.testing.assert_allclose((r @ p) / scale, a / scale, atol=atol)
    np.testing.assert_allclose(u @ _t(u), eye, atol=atol)
    np.testing.assert_allclose(v @ _t(v), eye, atol=atol)
    np.testing.assert_allclose(r @ _t(r), eye, atol=atol)
    want_sv = np.linalg.svd(a, compute_uv=False) / scale[:, :, 0]
    np.testing.assert_allclose(
        np.abs(np.diagonal(s, axis1=1, axis2=2)) / scale[:, :, 0], want_sv, atol=atol
    )


@pytest.mark.difftape_only  # Taichi 1.7.4 returns NaN for these
@pytest.mark.parametrize("n", [2, 3])
def test_svd_and_polar_decompose_largest_binade(ti, fp, npfp, n):
    # The largest entry at 2^bias or above (f32: 1.7e38): the internal scale 2^bias had the
    # subnormal inverse 2^-bias, flushed to zero, and every factor came out as for A == 0.
    top = np.ldexp(1.0, np.finfo(npfp).maxexp - 1)  # 2^bias
    rng = np.random.default_rng(7 + n)
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    diag = np.diag([1.5, 1.0, 0.75][:n])
    a = np.stack([diag, -diag[::-1], np.eye(n) * 1.25, q @ diag @ q.T * 1.2]) * top
    a, (u, s, v, r, p) = _decompose_batch(ti, a.astype(npfp), n)
    atol = 2e-6 if fp == ti.f32 else 1e-13
    scale = np.abs(a).max(axis=(1, 2))[:, None, None]
    assert (scale >= top).all()
    eye = np.broadcast_to(np.eye(n), a.shape)
    np.testing.assert_allclose(u @ (s / scale) @ _t(v), a / scale, atol=atol)
    np.testing.assert_allclose(u @ _t(u), eye, atol=atol)
    np.testing.assert_allclose(r @ _t(r), eye, atol=atol)
    if n == 2:  # 3-D symmetrises P = U^T A as (P + P^T) / 2, which overflows here
        np.testing.assert_allclose(r @ (p / scale), a / scale, atol=atol)


@pytest.mark.difftape_only  # the internal scale of difftape's decompositions
def test_decomposition_scale_is_the_power_of_two_near_the_largest_entry(ti, fp, npfp):
    from difftape.linalg.small import _pow2_scale

    info = np.finfo(npfp)
    exps = np.arange(info.minexp, info.maxexp)
    below_two = np.nextafter(npfp(2), npfp(0))
    m = np.concatenate([np.ldexp(npfp(f), exps) for f in (1.0, 1.5, below_two)])
    m = np.concatenate([m, [0.0, info.smallest_subnormal, info.tiny / 3]]).astype(npfp)
    M = ti.field(fp, shape=len(m))
    C = ti.field(fp, shape=len(m))

    @ti.kernel
    def scale():
        for i in M:
            C[i] = _pow2_scale(M[i], fp)

    M.from_numpy(m)
    scale()
    c = C.to_numpy()
    mant, e = np.frexp(c)
    assert (mant == 0.5).all()  # powers of two
    assert (1 / c >= info.tiny).all()  # normal inverses
    top = m >= np.ldexp(npfp(1), info.maxexp - 1)  # the largest binade, 2^bias and above
    normal = (m >= info.tiny) & ~top
    q = m[normal] / c[normal]
    assert ((q >= 0.5) & (q < 2)).all()
    # 2^E for m = f 2^E with E >= 0, 2^(E + 1) below 1 (the binary search it replaced)
    big_e = np.frexp(m[normal])[1] - 1
    want = np.ldexp(npfp(1), big_e + (big_e < 0))
    np.testing.assert_array_equal(c[normal], want.astype(npfp))
    assert c[m == 0] == 1.0
    np.testing.assert_array_equal(c[(m > 0) & (m < info.tiny)], info.tiny)  # finite 1 / c
    # 2^(bias - 1) at the top, whose inverse is normal (2^bias's is not)
    np.testing.assert_array_equal(c[top], np.ldexp(npfp(1), info.maxexp - 2))


@pytest.mark.difftape_only  # Taichi 1.7.4 returns NaN for these
@pytest.mark.parametrize("n", [2, 3])
def test_svd_and_polar_decompose_subnormal_entries(ti, fp, npfp, n):
    # The largest entry is subnormal: the result is finite, with orthogonal factors (the
    # scale was once 0 there, and everything NaN). Subnormal results flush to zero, as
    # kernels compute in Taichi's flush-to-zero mode, so S and P are only bounded here.
    tiny = np.finfo(npfp).tiny
    rng = np.random.default_rng(n)
    a = rng.uniform(-1.0, 1.0, (4, n, n)) * tiny / 4
    a[0] = np.eye(n) * tiny / 8
    a, (u, s, v, r, p) = _decompose_batch(ti, a, n)
    assert (np.abs(a).max(axis=(1, 2)) < tiny).all() and (a != 0).any()
    assert all(np.isfinite(x).all() for x in (u, s, v, r, p))
    eye = np.broadcast_to(np.eye(n), a.shape)
    atol = 2e-6 if fp == ti.f32 else 1e-13
    for q in (u, v, r):
        np.testing.assert_allclose(q @ _t(q), eye, atol=atol)
    assert np.abs(s).max() <= 2 * tiny and np.abs(p).max() <= 2 * tiny
