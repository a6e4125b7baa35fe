"""ti.solve, ti.sym_eig and ti.eig inside kernels, checked against numpy.linalg (f64 truth)."""

import numpy as np
import pytest

BATCH = 8


def _tol(ti, fp):
    return 2e-5 if fp == ti.f32 else 1e-11


def _systems(n):
    """Random systems plus ones that need row exchanges (zero and tiny leading pivots)."""
    rng = np.random.default_rng(40 + n)
    a = rng.uniform(-1.0, 1.0, (BATCH, n, n)) + np.eye(n) * 0.5
    a[0] = np.eye(n)[::-1] * 2.0  # anti-diagonal: every pivot needs an exchange
    a[1, 0, 0] = 0.0
    a[2, 0, 0] = 1e-9  # without pivoting, f32 would lose every digit
    b = rng.uniform(-2.0, 2.0, (BATCH, n))
    return a, b


@pytest.mark.parametrize("n", [2, 3])
def test_solve(ti, fp, n):
    A = ti.Matrix.field(n, n, float, shape=BATCH)
    B = ti.Vector.field(n, float, shape=BATCH)
    X = ti.Vector.field(n, float, shape=BATCH)

    @ti.kernel
    def run():
        for i in A:
            X[i] = ti.solve(A[i], B[i])

    a, b = _systems(n)
    A.from_numpy(a)
    B.from_numpy(b)
    run()
    a, b = A.to_numpy().astype(np.float64), B.to_numpy().astype(np.float64)
    want = np.linalg.solve(a, b[..., None])[..., 0]
    scale = np.abs(want).max(axis=1, keepdims=True)
    np.testing.assert_allclose(X.to_numpy() / scale, want / scale, atol=_tol(ti, fp) * 10)


@pytest.mark.parametrize("n", [2, 3])
def test_solve_gradient(ti, n):
    # d(c . x)/dA = -y x^T and d(c . x)/db = y with A^T y = c (reverse mode, f64).
    ti.reset()
    ti.init(arch=ti.cpu, default_fp=ti.f64)
    A = ti.Matrix.field(n, n, ti.f64, shape=(), needs_grad=True)
    B = ti.Vector.field(n, ti.f64, shape=(), needs_grad=True)
    L = ti.field(ti.f64, shape=(), needs_grad=True)
    c = np.arange(1.0, n + 1)

    @ti.kernel
    def loss():
        x = ti.solve(A[None], B[None])
        for k in ti.static(range(n)):
            L[None] += (k + 1.0) * x[k]

    a, b = _systems(n)
    a, b = a[1], b[1]  # needs a row exchange
    A.from_numpy(a)
    B.from_numpy(b)
    with ti.ad.Tape(L):
        loss()
    x = np.linalg.solve(a, b)
    y = np.linalg.solve(a.T, c)
    np.testing.assert_allclose(L[None], c @ x, rtol=1e-12)
    np.testing.assert_allclose(A.grad.to_numpy(), -np.outer(y, x), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(B.grad.to_numpy(), y, rtol=1e-10, atol=1e-12)


@pytest.mark.difftape_only
def test_solve_singular_is_refused(ti):
    # Taichi checks this only with debug=True and returns inf/nan otherwise.
    A = ti.Matrix.field(2, 2, float, shape=())
    X = ti.Vector.field(2, float, shape=())

    @ti.kernel
    def run():
        X[None] = ti.solve(A[None], ti.Vector([1.0, 2.0]))

    A.from_numpy(np.array([[1.0, 2.0], [2.0, 4.0]]))
    with pytest.raises(ti.KernelAssertionError, match="singular"):
        run()
        ti.sync()  # (on a grid the launch is asynchronous: its error comes at a sync point)
    A.from_numpy(np.array([[1.0, 2.0], [2.0, 5.0]]))
    run()
    np.testing.assert_allclose(X.to_numpy(), [1.0, 0.0], atol=1e-6)


@pytest.mark.difftape_only
def test_solve_sizes_are_checked(ti):
    @ti.kernel
    def four():
        ti.solve(ti.Matrix.identity(float, 4), ti.Vector([1.0, 2.0, 3.0, 4.0]))

    with pytest.raises(ti.CompileError, match="Solver only supports 2D and 3D matrices"):
        four()

    @ti.kernel
    def mismatch():
        ti.solve(ti.Matrix.identity(float, 3), ti.Vector([1.0, 2.0]))

    with pytest.raises(ti.CompileError, match="3-vector"):
        mismatch()


def _symmetric(n, edge=False):
    """Random symmetric matrices; ``edge``: the identity, diagonals, zero, clustered
    eigenvalues."""
    rng = np.random.default_rng(50 + n)
    m = rng.uniform(-1.0, 1.0, (BATCH, n, n))
    s = m + np.swapaxes(m, 1, 2)
    if edge:
        s[0] = np.eye(n)
        s[1] = np.diag(np.arange(n, 0, -1.0))  # diagonal, eigenvalues out of order
        s[2] = np.zeros((n, n))
        s[3] = 3.0 * np.eye(n) + 1e-3 * s[3]  # clustered eigenvalues
        s[4] = -2.0 * np.eye(n)
        s[5, 0, 1:] = s[5, 1:, 0] = 0.0  # block diagonal
    return s


def _check_sym_eig(ti, fp, n, edge):
    A = ti.Matrix.field(n, n, float, shape=BATCH)
    W = ti.Vector.field(n, float, shape=BATCH)
    V = ti.Matrix.field(n, n, float, shape=BATCH)

    @ti.kernel
    def run():
        for i in A:
            W[i], V[i] = ti.sym_eig(A[i])

    A.from_numpy(_symmetric(n, edge))
    run()
    a = A.to_numpy().astype(np.float64)
    w, v = W.to_numpy().astype(np.float64), V.to_numpy().astype(np.float64)
    atol = _tol(ti, fp) * 4
    # Taichi's orders: 2x2 larger eigenvalue first, 3x3 ascending
    want = np.linalg.eigvalsh(a)
    want = want[:, ::-1] if n == 2 else want
    np.testing.assert_allclose(w, want, atol=atol)
    np.testing.assert_allclose(a @ v, v * w[:, None, :], atol=atol)  # A v_k = w_k v_k
    np.testing.assert_allclose(np.swapaxes(v, 1, 2) @ v, np.broadcast_to(np.eye(n), a.shape),
                               atol=atol)


@pytest.mark.parametrize("n", [2, 3])
def test_sym_eig(ti, fp, n):
    _check_sym_eig(ti, fp, n, edge=False)


@pytest.mark.difftape_only
@pytest.mark.parametrize("n", [2, 3])
def test_sym_eig_edge_cases(ti, fp, n):
    # Taichi 1.7.4 returns NaN for some of these (multiples of I in f64) and loses digits
    # (5e-4 in f32) on clustered eigenvalues (Cardano's formula); Jacobi does not.
    _check_sym_eig(ti, fp, n, edge=True)


@pytest.mark.parametrize("n", [2, 3])
def test_sym_eig_gradient(ti, n):
    # d(sum_k c_k w_k)/dA = V diag(c) V^T for distinct eigenvalues (reverse mode, f64).
    if n == 3 and ti.__name__ == "taichi":
        pytest.skip("Taichi 1.7.4's 3x3 sym_eig is not differentiable (its QL fallback loops "
                    "on data: auto_diff 'Not supported'); difftape's is")
    ti.reset()
    ti.init(arch=ti.cpu, default_fp=ti.f64)
    A = ti.Matrix.field(n, n, ti.f64, shape=(), needs_grad=True)
    L = ti.field(ti.f64, shape=(), needs_grad=True)

    @ti.kernel
    def loss():
        w, _ = ti.sym_eig(A[None])
        for k in ti.static(range(n)):
            L[None] += (k + 1.0) * w[k]

    a = _symmetric(n)[5]
    A.from_numpy(a)
    with ti.ad.Tape(L):
        loss()
    w, v = np.linalg.eigh(a)
    c = np.arange(1.0, n + 1)
    if n == 2:
        v = v[:, ::-1]  # larger first
    np.testing.assert_allclose(A.grad.to_numpy(), v @ np.diag(c) @ v.T, rtol=1e-9, atol=1e-12)


@pytest.mark.difftape_only
def test_sym_eig_refuses_a_nonsymmetric_matrix(ti):
    A = ti.Matrix.field(3, 3, float, shape=())
    W = ti.Vector.field(3, float, shape=())

    @ti.kernel
    def run():
        W[None], _ = ti.sym_eig(A[None])

    a = np.diag([1.0, 2.0, 3.0])
    a[0, 2] = 0.5
    A.from_numpy(a)
    with pytest.raises(ti.KernelAssertionError, match="not symmetric"):
        run()
        ti.sync()  # (on a grid the launch is asynchronous: its error comes at a sync point)
    a[2, 0] = 0.5
    A.from_numpy(a)
    run()
    np.testing.assert_allclose(W.to_numpy(), np.linalg.eigvalsh(a), rtol=1e-5)


def _check_eig2x2(ti, fp, cases):
    # Taichi's layout: eigenvalue k as row (re, im) of w, eigenvector k as column
    # (re0, im0, re1, im1) of V.
    cases = np.array(cases)
    A = ti.Matrix.field(2, 2, float, shape=len(cases))
    W = ti.Matrix.field(2, 2, float, shape=len(cases))
    V = ti.Matrix.field(4, 2, float, shape=len(cases))

    @ti.kernel
    def run():
        for i in A:
            W[i], V[i] = ti.eig(A[i])

    A.from_numpy(cases)
    run()
    w, v = W.to_numpy().astype(np.float64), V.to_numpy().astype(np.float64)
    lam = w[:, :, 0] + 1j * w[:, :, 1]
    vec = v[:, 0::2, :] + 1j * v[:, 1::2, :]
    atol = _tol(ti, fp) * 4
    for k, a in enumerate(cases):
        np.testing.assert_allclose(np.sort_complex(lam[k]), np.sort_complex(np.linalg.eigvals(a)),
                                   atol=atol)
        np.testing.assert_allclose(a @ vec[k], vec[k] * lam[k][None, :], atol=atol)
        np.testing.assert_allclose(np.linalg.norm(vec[k], axis=0), 1.0, atol=atol)


def test_eig2x2(ti, fp):
    # real distinct and complex-conjugate eigenvalues
    _check_eig2x2(ti, fp, [[[1.0, 1.0], [2.0, 3.0]], [[1.0, -1.0], [1.0, 1.0]],
                           [[0.0, 2.0], [-3.0, 0.5]], [[4.0, 0.0], [1.0, -2.0]]])


@pytest.mark.difftape_only
def test_eig2x2_edge_cases(ti, fp):
    # Taichi 1.7.4 returns NaN eigenvectors for these: a multiple of I, a defective matrix,
    # and upper-triangular ones whose first column of A - mu I is zero.
    _check_eig2x2(ti, fp, [[[2.0, 0.0], [0.0, 2.0]], [[1.0, 1.0], [0.0, 1.0]],
                           [[3.0, 1.0], [0.0, 1.0]], [[-1.0, 2.0], [0.0, 0.5]]])


def test_decomposition_sizes_are_checked_in_taichis_words(ti):
    """ti.polar_decompose / ti.svd of anything but a 2x2 or 3x3 matrix (here a 1x1 matrix
    field passed whole, and a 4x4 matrix) are refused with Taichi's message."""
    m = ti.Matrix.field(1, 1, ti.f32)
    ti.root.place(m)

    @ti.kernel
    def polar_of_a_field():
        ti.polar_decompose(m, ti.f32)

    @ti.kernel
    def svd4():
        ti.svd(ti.Matrix.identity(ti.f32, 4), ti.f32)

    with pytest.raises(ti.TaichiCompilationError,
                       match="Polar decomposition only supports 2D and 3D matrices."):
        polar_of_a_field()
    with pytest.raises(ti.TaichiCompilationError, match="SVD only supports 2D and 3D matrices."):
        svd4()
