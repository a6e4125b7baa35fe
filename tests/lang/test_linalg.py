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
