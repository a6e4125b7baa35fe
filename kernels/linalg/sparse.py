"""``ti.linalg`` sparse matrices: ``SparseMatrixBuilder``, ``SparseMatrix``, ``SparseSolver``,
``SparseCG``.

A builder is filled inside kernels: it is a ``ti.types.sparse_matrix_builder()`` argument
whose storage is one integer ndarray (``annotations.TRIPLET_HEADER``), appended to with an
atomic counter by compiled code (``frontend.transformer.TripletArg``), never written past its
``max_num_triplets``. Everything after that is SciPy's (the ``linalg`` extra): ``build()``
turns the triplets into a ``scipy.sparse`` CSC (``col_major``) or CSR (``row_major``) matrix in
one vectorised step (duplicates summed, as Taichi/Eigen do), the arithmetic is scipy.sparse's,
the direct solvers are SuperLU (``scipy.sparse.linalg.splu``) and ``SparseCG`` is
``scipy.sparse.linalg.cg``; no Python loop touches the entries. Under ``arch=ti.remote``
the triplet ndarray lives on the server (the kernels filling it run there) and fields and
ndarrays are read and written through the session; the SciPy part runs in the user's
process, as locally, so results are the local ones bit for bit.

Where Taichi would return a wrong answer quietly, these raise: a factorisation of a singular
matrix, ``LLT``/``LDLT`` of a non-symmetric one (Eigen reads only its lower triangle), ``LLT``
of one that is not positive definite, mismatched shapes, unknown options.
"""

from __future__ import annotations

import numbers
import warnings

import numpy as np

from .. import types as T
from ..errors import ArgumentError, DifftapeError, OptionError, ShapeError, SolverError
from ..frontend.annotations import TRIPLET_HEADER
from ..frontend.field import Field
from ..frontend.ndarray import Ndarray, ndarray
from ..frontend.ops import resolve_dtype

_FORMATS = {"col_major": "csc", "row_major": "csr"}
_INDEX_DTYPE = {"f32": T.i32, "f64": T.i64}
# SuperLU's column orderings standing in for Eigen's: COLAMD is the same algorithm; AMD
# (approximate minimum degree on A + A^T) is closest to SuperLU's minimum degree on A^T + A.
# An ordering only changes fill-in (speed and memory), never the solution.
_ORDERINGS = {"AMD": "MMD_AT_PLUS_A", "COLAMD": "COLAMD"}
_SOLVERS = ("LLT", "LDLT", "LU")
# A matrix whose antisymmetric part exceeds this many units in the last place of max|A_ij|
# is not symmetric (rather than symmetric up to how it was computed).
_SYM_ULPS = 64


def _scipy():
    """``(scipy.sparse, scipy.sparse.linalg, scipy.io)``; SciPy is the ``linalg`` extra."""
    try:
        # Function-level: SciPy is optional (pip install 'difftape[linalg]') and heavy; only
        # programs that use ti.linalg's sparse matrices load it.
        import scipy.io as sio
        import scipy.sparse as sp
        import scipy.sparse.linalg as spla
    except ImportError as e:  # pragma: no cover - depends on the installation
        raise DifftapeError("ti.linalg's sparse matrices and solvers need SciPy: pip install "
                            "'difftape[linalg]' (or scipy)") from e
    return sp, spla, sio


def _value_dtype(dtype) -> T.DType:
    dt = resolve_dtype(dtype)
    if dt.name not in _INDEX_DTYPE:
        raise OptionError(f"sparse matrices hold f32 or f64 values (as Taichi's), got {dt}")
    return dt


def _storage_format(storage_format: str) -> str:
    if storage_format not in _FORMATS:
        raise OptionError(f"storage_format must be 'col_major' or 'row_major', got "
                          f"{storage_format!r}")
    return _FORMATS[storage_format]


def _size(value, what: str) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
        raise ArgumentError(f"{what} must be a non-negative integer, got {value!r}")
    return int(value)


class SparseMatrixBuilder:
    """``ti.linalg.SparseMatrixBuilder(num_rows, num_cols, max_num_triplets, dtype,
    storage_format)``: triplets ``(i, j, v)`` appended in kernels (``A[i, j] += v``, ``-=``)
    through a ``ti.types.sparse_matrix_builder()`` argument, turned into a
    :class:`SparseMatrix` by :meth:`build`.

    More than ``max_num_triplets`` appends is a run-time error of the kernel that made them
    (nothing is written past the storage), and :meth:`build` refuses such a builder too.
    """

    def __init__(self, num_rows=None, num_cols=None, max_num_triplets=0, dtype=T.f32,
                 storage_format: str = "col_major") -> None:
        if num_rows is None:
            raise ArgumentError("SparseMatrixBuilder needs num_rows")
        self.num_rows = _size(num_rows, "num_rows")
        self.num_cols = _size(num_cols, "num_cols") if num_cols else self.num_rows
        self.max_num_triplets = _size(max_num_triplets, "max_num_triplets")
        self.dtype = _value_dtype(dtype)
        self.storage_format = storage_format
        self._format = _storage_format(storage_format)
        # A ti.ndarray: under arch=ti.remote it lives on the server, where kernels fill it;
        # build() reads it (one transfer) and the matrix is SciPy's, here, as locally.
        self._triplets = ndarray(_INDEX_DTYPE[self.dtype.name],
                                 TRIPLET_HEADER + 3 * self.max_num_triplets)
        self._triplets[1] = self.num_rows
        self._triplets[2] = self.num_cols

    def _entries(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows, columns and values of the triplets appended so far (views of one read of
        the triplet storage: a transfer under arch=ti.remote)."""
        arr = self._triplets.to_numpy()
        count = int(arr[0])
        if count > self.max_num_triplets:
            raise SolverError(f"this SparseMatrixBuilder overflowed: {count} triplets were "
                              f"added to a builder of max_num_triplets={self.max_num_triplets} "
                              "(the kernel that added them failed); create it with a larger "
                              "max_num_triplets")
        body = arr[TRIPLET_HEADER:TRIPLET_HEADER + 3 * count]
        return body[0::3], body[1::3], body[2::3].view(self.dtype.np)

    def print_triplets(self) -> None:
        """Print the triplets appended so far (as Taichi's builder does)."""
        rows, cols, vals = self._entries()
        print(f"n={self.num_rows}, m={self.num_cols}, num_triplets={len(rows)} "
              f"(max={self.max_num_triplets})")
        for i, j, v in zip(rows.tolist(), cols.tolist(), vals.tolist(), strict=True):
            print(f"({i}, {j}) val={v}")

    def build(self, dtype=None, _format: str = "CSR") -> SparseMatrix:
        """The matrix of the triplets (duplicates summed), in ``dtype`` (default: the
        builder's). The builder is emptied, ready to be filled again."""
        if _format != "CSR":
            raise OptionError(f"SparseMatrixBuilder.build(_format=...) supports 'CSR' (as "
                              f"Taichi on the CPU), got {_format!r}")
        dt = self.dtype if dtype is None else _value_dtype(dtype)
        sp, _, _ = _scipy()
        rows, cols, vals = self._entries()
        mat = sp.coo_matrix((vals.astype(dt.np), (rows, cols)),
                            shape=(self.num_rows, self.num_cols)).asformat(self._format)
        mat.sum_duplicates()
        self._triplets[0] = 0
        return SparseMatrix._wrap(mat, dt, self.storage_format)


class SparseMatrix:
    """``ti.linalg.SparseMatrix(n, m, dtype, storage_format)``: a sparse matrix in Python
    scope (a ``scipy.sparse`` CSC or CSR matrix underneath; ``A.matrix``).

    ``A + B``, ``A - B``, ``A * s``/``s * A``, ``A * B`` (elementwise), ``A @ B``,
    ``A.transpose()``, ``A[i, j]`` (read and write), ``A.shape``; ``A @ x`` with a 1-D field
    or NumPy array gives a NumPy array and with a ti.ndarray a ti.ndarray (as in Taichi).
    """

    def __init__(self, n=None, m=None, sm=None, dtype=T.f32,
                 storage_format: str = "col_major") -> None:
        self.dtype = _value_dtype(dtype)
        self.storage_format = storage_format
        sp, _, _ = _scipy()
        if sm is not None:
            if not sp.issparse(sm):
                raise ArgumentError(f"SparseMatrix(sm=...) takes a scipy.sparse matrix, got "
                                    f"{type(sm).__name__}")
            self.matrix = sm.asformat(_storage_format(storage_format)).astype(self.dtype.np)
        else:
            if n is None:
                raise ArgumentError("SparseMatrix needs n (and m)")
            n = _size(n, "n")
            m = _size(m, "m") if m else n
            self.matrix = sp.csr_matrix((n, m), dtype=self.dtype.np).asformat(
                _storage_format(storage_format))
        self.n, self.m = self.matrix.shape

    @classmethod
    def _wrap(cls, mat, dtype: T.DType, storage_format: str) -> SparseMatrix:
        obj = object.__new__(cls)
        obj.matrix, obj.dtype, obj.storage_format = mat, dtype, storage_format
        obj.n, obj.m = mat.shape
        return obj

    def _result(self, mat) -> SparseMatrix:
        dt = T.from_numpy(mat.dtype) if mat.dtype.kind == "f" else self.dtype
        return SparseMatrix._wrap(mat.asformat(_FORMATS[self.storage_format]), dt,
                                  self.storage_format)

    def _same_shape(self, other, op: str) -> None:
        if not isinstance(other, SparseMatrix):
            raise ArgumentError(f"sparse matrix {op} takes another SparseMatrix, got "
                                f"{type(other).__name__}")
        if self.shape != other.shape:
            raise ShapeError(f"Dimension mismatch between sparse matrices {self.shape} and "
                             f"{other.shape} in {op}")

    @property
    def shape(self) -> tuple[int, int]:
        """``(rows, columns)``."""
        return (self.n, self.m)

    def __add__(self, other: SparseMatrix) -> SparseMatrix:
        self._same_shape(other, "addition")
        return self._result(self.matrix + other.matrix)

    def __sub__(self, other: SparseMatrix) -> SparseMatrix:
        self._same_shape(other, "subtraction")
        return self._result(self.matrix - other.matrix)

    def __iadd__(self, other: SparseMatrix) -> SparseMatrix:
        self._same_shape(other, "addition")
        self.matrix = (self.matrix + other.matrix).asformat(_FORMATS[self.storage_format])
        return self

    def __isub__(self, other: SparseMatrix) -> SparseMatrix:
        self._same_shape(other, "subtraction")
        self.matrix = (self.matrix - other.matrix).asformat(_FORMATS[self.storage_format])
        return self

    def __mul__(self, other) -> SparseMatrix:
        """``A * s`` (a number) or ``A * B``: the elementwise (Hadamard) product."""
        if isinstance(other, numbers.Real) and not isinstance(other, bool):
            return SparseMatrix._wrap(self.matrix * self.dtype.np.type(other), self.dtype,
                                      self.storage_format)
        if isinstance(other, SparseMatrix):
            self._same_shape(other, "elementwise multiplication")
            return self._result(self.matrix.multiply(other.matrix))
        return NotImplemented

    def __rmul__(self, other) -> SparseMatrix:
        if isinstance(other, numbers.Real) and not isinstance(other, bool):
            return self * other
        return NotImplemented

    def __neg__(self) -> SparseMatrix:
        return SparseMatrix._wrap(-self.matrix, self.dtype, self.storage_format)

    def transpose(self) -> SparseMatrix:
        """``A^T``, in the same storage format."""
        return self._result(self.matrix.transpose())

    def __matmul__(self, other):
        if isinstance(other, SparseMatrix):
            if self.m != other.n:
                raise ShapeError(f"Dimension mismatch between sparse matrices {self.shape} "
                                 f"and {other.shape} in A @ B")
            return self._result(self.matrix @ other.matrix)
        if isinstance(other, Ndarray):
            x = self._vector(other.to_numpy(), other.element_shape)
            out = ndarray(other.dtype, self.n)
            out.from_numpy(self.matrix @ x)
            return out
        if isinstance(other, Field):
            return self.matrix @ self._vector(other.to_numpy(), other.element_shape)
        if isinstance(other, np.ndarray):
            return self.matrix @ self._vector(other, ())
        raise ArgumentError(f"Sparse matrix-matrix/vector multiplication does not support "
                            f"{type(other).__name__}: use a SparseMatrix, a 1-D ti.field, "
                            "ti.ndarray or NumPy array")

    def _vector(self, arr: np.ndarray, element_shape: tuple) -> np.ndarray:
        """``arr`` as a vector of the matrix's dtype, checked against the column count."""
        if element_shape or arr.ndim != 1 or arr.shape[0] != self.m:
            raise ShapeError(f"Dimension mismatch between sparse matrix {self.shape} and "
                             f"vector of shape {arr.shape}: A @ x needs a 1-D x of length "
                             f"{self.m}")
        return arr.astype(self.dtype.np, copy=False)

    def _index(self, indices) -> tuple[int, int]:
        if not isinstance(indices, tuple) or len(indices) != 2:
            raise IndexError(f"a sparse matrix takes two indices, A[i, j]; got {indices!r}")
        i, j = (int(k) for k in indices)
        if not (0 <= i < self.n and 0 <= j < self.m):
            raise IndexError(f"index ({i}, {j}) out of range for a {self.n}x{self.m} sparse "
                             "matrix")
        return i, j

    def __getitem__(self, indices) -> float:
        i, j = self._index(indices)
        return float(self.matrix[i, j])

    def __setitem__(self, indices, value) -> None:
        i, j = self._index(indices)
        sp, _, _ = _scipy()
        with warnings.catch_warnings():  # a new nonzero changes the pattern: expected here
            warnings.simplefilter("ignore", sp.SparseEfficiencyWarning)
            self.matrix[i, j] = value

    def __str__(self) -> str:
        dense = self.matrix.toarray()
        return "".join("[" + ", ".join(f"{v:g}" for v in row) + "]\n" for row in dense)

    __repr__ = __str__

    def to_numpy(self) -> np.ndarray:
        """The matrix as a dense NumPy array (difftape; for inspection and tests)."""
        return self.matrix.toarray()

    def build_from_ndarray(self, arr) -> None:
        """Replace the contents by the triplets in ``arr`` (a ti.ndarray of ``(row, col,
        value)`` rows, e.g. ``ti.Vector.ndarray(3, ...)``); duplicates are summed."""
        if not isinstance(arr, Ndarray):
            raise ArgumentError("Sparse matrix only supports building from [ti.ndarray, "
                                f"ti.Vector.ndarray, ti.Matrix.ndarray], got "
                                f"{type(arr).__name__}")
        flat = arr.to_numpy().reshape(-1)
        if flat.size % 3:
            raise ShapeError(f"The number of ndarray elements must have a length that is "
                             f"divisible by 3, got {flat.size}")
        t = flat.reshape(-1, 3).astype(np.float64)
        rows, cols = t[:, 0], t[:, 1]
        ok = (rows == np.floor(rows)) & (cols == np.floor(cols)) & (rows >= 0) & \
            (rows < self.n) & (cols >= 0) & (cols < self.m)
        if not ok.all():
            k = int(np.argmin(ok))
            raise ShapeError(f"build_from_ndarray: triplet {k} has index ({t[k, 0]:g}, "
                             f"{t[k, 1]:g}), not an integer position in a {self.n}x{self.m} "
                             "matrix")
        sp, _, _ = _scipy()
        mat = sp.coo_matrix((flat.reshape(-1, 3)[:, 2].astype(self.dtype.np),
                             (rows.astype(np.int64), cols.astype(np.int64))), shape=self.shape)
        self.matrix = mat.asformat(_FORMATS[self.storage_format])
        self.matrix.sum_duplicates()

    def mmwrite(self, filename) -> None:
        """Write the matrix to a Matrix Market file."""
        _, _, sio = _scipy()
        sio.mmwrite(filename, self.matrix)


def _rhs(b, n: int, dtype: T.DType) -> np.ndarray:
    """A right-hand side (field, ndarray, NumPy array) as a vector of ``dtype``."""
    if isinstance(b, Ndarray | Field):
        arr, esh = b.to_numpy(), b.element_shape
    elif isinstance(b, np.ndarray):
        arr, esh = b, ()
    else:
        raise ArgumentError(f"The parameter type: {type(b).__name__} is not supported in "
                            "linear solvers: use a 1-D ti.field, ti.ndarray or NumPy array")
    if esh or arr.ndim != 1 or arr.shape[0] != n:
        raise ShapeError(f"the right-hand side has shape {arr.shape}; the matrix needs a 1-D "
                         f"vector of length {n}")
    return arr.astype(dtype.np, copy=False)


def _asymmetry(mat) -> float:
    """max |A - A^T| relative to max |A| (0 for the zero matrix)."""
    diff = abs(mat - mat.transpose())
    big = abs(mat).max() if mat.nnz else 0.0
    return float(diff.max() / big) if big > 0 and diff.nnz else 0.0


class SparseSolver:
    """``ti.linalg.SparseSolver(dtype, solver_type, ordering)``: a direct solver for
    ``A x = b`` with a :class:`SparseMatrix` ``A``.

    ``solver_type`` says what ``A`` is: ``"LLT"`` symmetric positive definite, ``"LDLT"``
    symmetric, ``"LU"`` any square nonsingular matrix. All three factorise with SuperLU (an
    LU with a symmetric ordering and diagonal pivots for LLT/LDLT), which is as accurate as
    a Cholesky there; what the type promises about ``A`` is checked, and ``factorize`` raises
    :class:`~difftape.SolverError` rather than factorising something else (Eigen's LLT/LDLT
    read only the lower triangle, so Taichi solves a different system for a non-symmetric
    ``A`` and reports failures only through ``info()``).
    """

    def __init__(self, dtype=T.f32, solver_type: str = "LLT", ordering: str = "AMD") -> None:
        if solver_type not in _SOLVERS or ordering not in _ORDERINGS:
            raise OptionError(f"The solver type {solver_type} with {ordering} is not supported "
                              f"for now. Only {list(_SOLVERS)} with {list(_ORDERINGS)} are "
                              "supported.")
        self.dtype = _value_dtype(dtype)
        self.solver_type = solver_type
        self.ordering = ordering
        self.matrix: SparseMatrix | None = None
        self._lu = None
        self._ok = False

    def _check_matrix(self, A) -> SparseMatrix:
        if not isinstance(A, SparseMatrix):
            raise ArgumentError(f"The parameter type: {type(A).__name__} is not supported in "
                                "linear solvers: use a ti.linalg.SparseMatrix")
        if A.dtype != self.dtype:
            raise ArgumentError(f"The SparseSolver's dtype {self.dtype} is not consistent with "
                                f"the SparseMatrix's dtype {A.dtype}.")
        if A.n != A.m:
            raise ShapeError(f"a SparseSolver needs a square matrix, got {A.n}x{A.m}")
        return A

    def analyze_pattern(self, sparse_matrix: SparseMatrix) -> None:
        """Check the matrix (the ordering is computed by :meth:`factorize`, with SuperLU)."""
        self.matrix = self._check_matrix(sparse_matrix)
        self._lu, self._ok = None, False

    def factorize(self, sparse_matrix: SparseMatrix) -> None:
        """Factorise ``sparse_matrix``; raises SolverError where it is singular or not what
        ``solver_type`` requires."""
        A = self._check_matrix(sparse_matrix)
        self.matrix, self._lu, self._ok = A, None, False
        _, spla, _ = _scipy()
        mat = A.matrix.tocsc()
        symmetric = self.solver_type in ("LLT", "LDLT")
        if symmetric:
            eps = np.finfo(self.dtype.np).eps
            if _asymmetry(mat) > _SYM_ULPS * eps:
                raise SolverError(f"SparseSolver({self.solver_type!r}) needs a symmetric "
                                  "matrix and this one is not; use solver_type='LU'")
        opts = {"permc_spec": _ORDERINGS[self.ordering]}
        if symmetric:
            opts.update(diag_pivot_thresh=0.0, options={"SymmetricMode": True})
        try:
            lu = spla.splu(mat, **opts)
        except RuntimeError as e:  # SuperLU: "Factor is exactly singular"
            raise SolverError(f"SparseSolver.factorize: the matrix is singular ({e})") from None
        if self.solver_type == "LLT":
            # Diagonal pivots in a symmetric order: U's diagonal is D of A = L D L^T, and A is
            # positive definite exactly when all of it is positive.
            if not (np.array_equal(lu.perm_r, lu.perm_c) and (lu.U.diagonal() > 0).all()):
                raise SolverError("SparseSolver('LLT') needs a positive definite matrix and "
                                  "this one is not; use solver_type='LDLT' (symmetric) or "
                                  "'LU'")
        self._lu, self._ok = lu, True

    def compute(self, sparse_matrix: SparseMatrix) -> None:
        """:meth:`analyze_pattern` and :meth:`factorize` in one call."""
        self.analyze_pattern(sparse_matrix)
        self.factorize(sparse_matrix)

    def solve(self, b):
        """``x`` with ``A x = b``: a NumPy array for a field or NumPy ``b``, a ti.ndarray for
        a ti.ndarray ``b`` (as in Taichi)."""
        if self._lu is None:
            raise SolverError("Please call compute() (or analyze_pattern() and factorize()) "
                              "before calling solve().")
        x = self._lu.solve(_rhs(b, self.matrix.n, self.dtype))
        if isinstance(b, Ndarray):
            out = ndarray(b.dtype, self.matrix.m)
            out.from_numpy(x)
            return out
        return x

    def info(self) -> bool:
        """True when the last factorisation succeeded (a failed one raised)."""
        return self._ok


class SparseCG:
    """``ti.linalg.SparseCG(A, b, x0=None, max_iter=50, atol=1e-6)``: conjugate gradients for
    a symmetric positive (semi-)definite :class:`SparseMatrix` ``A`` (SciPy's ``cg``).

    ``solve()`` returns ``(x, converged)``. Convergence is ``|b - A x| <= atol * |b|``:
    relative to ``b`` despite the name, which is what Taichi's CPU solver (Eigen's CG)
    does.
    """

    def __init__(self, A: SparseMatrix, b, x0=None, max_iter: int = 50,
                 atol: float = 1e-6) -> None:
        if not isinstance(A, SparseMatrix):
            raise ArgumentError(f"SparseCG takes a ti.linalg.SparseMatrix, got "
                                f"{type(A).__name__}")
        if A.n != A.m:
            raise ShapeError(f"SparseCG needs a square matrix, got {A.n}x{A.m}")
        self.dtype = A.dtype
        self.matrix = A
        self.b = _rhs(b, A.n, A.dtype).copy()
        self.x0 = None if x0 is None else _rhs(x0, A.n, A.dtype).copy()
        self.max_iter = _size(max_iter, "max_iter")
        self.atol = float(atol)

    def solve(self) -> tuple[np.ndarray, bool]:
        _, spla, _ = _scipy()
        x, info = spla.cg(self.matrix.matrix, self.b, x0=self.x0, rtol=self.atol, atol=0.0,
                          maxiter=self.max_iter)
        return x.astype(self.dtype.np, copy=False), info == 0
