"""ti.linalg: SparseMatrixBuilder filled in kernels, SparseMatrix algebra, SparseSolver,
SparseCG, MatrixFreeCG/BICGSTAB, checked against NumPy (dense) truth."""

import numpy as np
import pytest

FORMATS = ["col_major", "row_major"]


def _dense(A) -> np.ndarray:
    """A sparse matrix as a dense array, through element access (Taichi's API)."""
    n, m = A.shape
    return np.array([[A[i, j] for j in range(m)] for i in range(n)])


def _fill_kernel(ti):
    @ti.kernel
    def fill(A: ti.types.sparse_matrix_builder(), rows: ti.types.ndarray(),
             cols: ti.types.ndarray(), vals: ti.types.ndarray()):
        for k in range(rows.shape[0]):  # parallel: appends race for positions
            A[rows[k], cols[k]] += vals[k]
            A[cols[k], rows[k]] -= 0.5 * vals[k]

    return fill


def _triplets(n, m, count, seed=0):
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, min(n, m), count).astype(np.int32)
    cols = rng.integers(0, min(n, m), count).astype(np.int32)
    vals = rng.uniform(-1.0, 1.0, count)
    want = np.zeros((n, m))
    np.add.at(want, (rows, cols), vals)  # duplicates are summed
    np.add.at(want, (cols, rows), -0.5 * vals)
    return rows, cols, vals, want


@pytest.mark.parametrize("storage_format", FORMATS)
def test_builder_in_a_parallel_kernel(ti, fp, npfp, storage_format):
    n, count = 12, 300
    rows, cols, vals, want = _triplets(n, n, count)
    B = ti.linalg.SparseMatrixBuilder(n, n, max_num_triplets=2 * count, dtype=fp,
                                      storage_format=storage_format)
    _fill_kernel(ti)(B, rows, cols, vals.astype(npfp))
    A = B.build()
    assert A.shape == (n, n)
    np.testing.assert_allclose(_dense(A), want, atol=1e-5 if fp == ti.f32 else 1e-12)


@pytest.mark.parametrize("storage_format", FORMATS)
def test_sparse_algebra(ti, fp, npfp, storage_format):
    n, k, m = 6, 5, 7
    ra, ca, va, a = _triplets(n, k, 40, seed=1)
    rb, cb, vb, b = _triplets(k, m, 40, seed=2)
    rc, cc, vc, c = _triplets(n, k, 40, seed=3)
    builders = [ti.linalg.SparseMatrixBuilder(r, s, max_num_triplets=80, dtype=fp,
                                              storage_format=storage_format)
                for r, s in ((n, k), (k, m), (n, k))]
    fill = _fill_kernel(ti)
    for B, (r, s, v) in zip(builders, ((ra, ca, va), (rb, cb, vb), (rc, cc, vc)), strict=True):
        fill(B, r, s, v.astype(npfp))
    A, Bm, C = (B.build() for B in builders)
    atol = 1e-5 if fp == ti.f32 else 1e-12
    np.testing.assert_allclose(_dense(A + C), a + c, atol=atol)
    np.testing.assert_allclose(_dense(A - C), a - c, atol=atol)
    np.testing.assert_allclose(_dense(A * 2.5), a * 2.5, atol=atol)
    np.testing.assert_allclose(_dense(2.5 * A), a * 2.5, atol=atol)
    np.testing.assert_allclose(_dense(A * C), a * c, atol=atol)
    np.testing.assert_allclose(_dense(A @ Bm), a @ b, atol=atol)
    np.testing.assert_allclose(_dense(A.transpose()), a.T, atol=atol)

    x = np.linspace(-1.0, 1.0, k)
    xf = ti.field(fp, shape=k)
    xf.from_numpy(x.astype(npfp))
    xn = ti.ndarray(fp, k)
    xn.from_numpy(x.astype(npfp))
    np.testing.assert_allclose(A @ xf, a @ x, atol=atol)
    np.testing.assert_allclose((A @ xn).to_numpy(), a @ x, atol=atol)
    np.testing.assert_allclose(A @ x.astype(npfp), a @ x, atol=atol)

    A[0, 0] = 1024.0
    assert A[0, 0] == 1024.0


@pytest.mark.difftape_only
def test_builder_overflow_is_refused(ti):
    # Taichi 1.7.4 writes the extra triplets past the end of its buffer.
    B = ti.linalg.SparseMatrixBuilder(4, 4, max_num_triplets=10)

    @ti.kernel
    def fill(A: ti.types.sparse_matrix_builder()):
        for i, j in ti.ndrange(4, 4):
            A[i, j] += 1.0

    with pytest.raises(ti.KernelAssertionError, match="max_num_triplets"):
        fill(B)
        ti.sync()  # (on a grid the launch is asynchronous: its error comes at a sync point)
    with pytest.raises(ti.SolverError, match="overflowed"):
        B.build()
    storage = B._triplets.storage.read()
    assert storage.shape == (3 + 3 * 10,)  # nothing was written past the 10 triplets


@pytest.mark.difftape_only
def test_builder_checks_indices_and_operators(ti):
    B = ti.linalg.SparseMatrixBuilder(4, 3, max_num_triplets=10)

    @ti.kernel
    def outside(A: ti.types.sparse_matrix_builder()):
        A[1, 3] += 1.0

    with pytest.raises(ti.KernelAssertionError, match="outside the matrix"):
        outside(B)
        ti.sync()  # (on a grid the launch is asynchronous: its error comes at a sync point)

    @ti.kernel
    def store(A: ti.types.sparse_matrix_builder()):
        A[1, 1] = 1.0

    with pytest.raises(ti.CompileError, match=r"'\+=' and '-='"):
        store(B)


def _spd(n, npfp, seed=4):
    rng = np.random.default_rng(seed)
    a = rng.uniform(0.0, 1.0, (n, n))
    return (a @ a.T + np.eye(n)).astype(npfp)


def _build_dense(ti, fp, a):
    n = a.shape[0]
    B = ti.linalg.SparseMatrixBuilder(n, n, max_num_triplets=n * n, dtype=fp)

    @ti.kernel
    def fill(A: ti.types.sparse_matrix_builder(), x: ti.types.ndarray()):
        for i, j in ti.ndrange(n, n):
            if x[i, j] != 0:
                A[i, j] += x[i, j]

    fill(B, a)
    return B.build()


@pytest.mark.parametrize("solver_type", ["LLT", "LDLT", "LU"])
@pytest.mark.parametrize("ordering", ["AMD", "COLAMD"])
def test_sparse_solver(ti, fp, npfp, solver_type, ordering):
    n = 10
    a = _spd(n, npfp)
    if solver_type == "LU":
        a = (a + np.triu(a, 1)).astype(npfp)  # not symmetric
    A = _build_dense(ti, fp, a)
    rhs = np.arange(1.0, n + 1).astype(npfp)
    solver = ti.linalg.SparseSolver(dtype=fp, solver_type=solver_type, ordering=ordering)
    solver.analyze_pattern(A)
    solver.factorize(A)
    assert solver.info()
    want = np.linalg.solve(a.astype(np.float64), rhs.astype(np.float64))
    rtol = 1e-3 if fp == ti.f32 else 1e-10
    np.testing.assert_allclose(solver.solve(rhs), want, rtol=rtol)
    b = ti.ndarray(fp, n)
    b.from_numpy(rhs)
    np.testing.assert_allclose(solver.solve(b).to_numpy(), want, rtol=rtol)
    bf = ti.field(fp, shape=n)
    bf.from_numpy(rhs)
    np.testing.assert_allclose(solver.solve(bf), want, rtol=rtol)


@pytest.mark.difftape_only
def test_sparse_solver_refuses_what_it_cannot_solve(ti):
    # Taichi's Eigen solvers read only the lower triangle for LLT/LDLT (a different system
    # for a non-symmetric matrix) and report failures only through info().
    a = _spd(6, np.float32)
    indefinite = a - 20.0 * np.eye(6, dtype=np.float32)
    nonsym = a + np.triu(a, 1)
    singular = a.copy()
    singular[3] = 0.0  # a zero row: singular exactly, whatever the rounding
    for kind, m, why in (("LLT", indefinite, "positive definite"), ("LLT", nonsym, "symmetric"),
                         ("LDLT", nonsym, "symmetric"), ("LU", singular, "singular")):
        solver = ti.linalg.SparseSolver(ti.f32, kind)
        with pytest.raises(ti.SolverError, match=why):
            solver.compute(_build_dense(ti, ti.f32, m))
    solver = ti.linalg.SparseSolver(ti.f32, "LDLT")  # symmetric indefinite is fine for LDLT
    solver.compute(_build_dense(ti, ti.f32, indefinite))
    rhs = np.ones(6, np.float32)
    np.testing.assert_allclose(solver.solve(rhs), np.linalg.solve(indefinite, rhs), rtol=1e-3)
    with pytest.raises(ti.OptionError):
        ti.linalg.SparseSolver(ti.f32, "QR")


def test_sparse_cg(ti, fp, npfp):
    n = 10
    a = _spd(n, npfp)
    A = _build_dense(ti, fp, a)
    b = ti.ndarray(fp, n)
    b.from_numpy(np.arange(1.0, n + 1).astype(npfp))
    x0 = ti.ndarray(fp, n)
    x, ok = ti.linalg.SparseCG(A, b, x0, max_iter=100, atol=1e-6).solve()
    assert ok
    # converged means |b - A x| <= atol |b| (relative, as Taichi's CPU CG): check that, up to
    # the rounding of the recursive residual
    rhs = np.arange(1.0, n + 1)
    a64 = a.astype(np.float64)
    assert np.linalg.norm(a64 @ x - rhs) <= 1e-5 * np.linalg.norm(rhs)
    np.testing.assert_allclose(x, np.linalg.solve(a64, rhs), rtol=1e-2)


@pytest.mark.parametrize("method", ["MatrixFreeCG", "MatrixFreeBICGSTAB"])
def test_matrix_free_solvers(ti, fp, npfp, method):
    # A 2-D five-point operator (made non-symmetric for BiCGSTAB), compared with a dense solve.
    grid = 8
    skew = 0.0 if method == "MatrixFreeCG" else 1.5
    x = ti.field(fp, shape=(grid, grid))
    b = ti.field(fp, shape=(grid, grid))

    @ti.kernel
    def apply(v: ti.template(), out: ti.template()):
        for i, j in v:
            left = v[i - 1, j] if i > 0 else 0.0
            right = v[i + 1, j] if i < grid - 1 else 0.0
            up = v[i, j + 1] if j < grid - 1 else 0.0
            down = v[i, j - 1] if j > 0 else 0.0
            out[i, j] = 6.0 * v[i, j] - (1.0 + skew) * left - right - up - down

    rng = np.random.default_rng(7)
    rhs = rng.uniform(-1.0, 1.0, (grid, grid))
    b.from_numpy(rhs.astype(npfp))
    solve = getattr(ti.linalg, method)
    ok = solve(ti.linalg.LinearOperator(apply), b, x, tol=1e-5, maxiter=500, quiet=True)
    assert ok
    dense = np.zeros((grid * grid, grid * grid))
    for i in range(grid):
        for j in range(grid):
            k = i * grid + j
            dense[k, k] = 6.0
            for di, dj, w in ((-1, 0, 1.0 + skew), (1, 0, 1.0), (0, 1, 1.0), (0, -1, 1.0)):
                if 0 <= i + di < grid and 0 <= j + dj < grid:
                    dense[k, (i + di) * grid + j + dj] = -w
    want = np.linalg.solve(dense, rhs.reshape(-1)).reshape(grid, grid)
    np.testing.assert_allclose(x.to_numpy(), want, atol=1e-4 if fp == ti.f32 else 1e-5)
