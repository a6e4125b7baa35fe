"""``ti.linalg`` and the small-matrix routines behind ``ti.svd`` & co.

* :mod:`.small`: ``ti.svd``, ``ti.polar_decompose``, ``ti.solve``, ``ti.sym_eig``, ``ti.eig``
  on 2x2/3x3 matrices inside kernels, written as funcs against the frontend.
* :mod:`.sparse`: ``SparseMatrixBuilder`` (filled inside kernels through a
  ``ti.types.sparse_matrix_builder()`` argument), ``SparseMatrix``, ``SparseSolver`` and
  ``SparseCG``, on SciPy's sparse matrices and factorisations (the ``linalg`` extra).
* :mod:`.matrixfree`: ``LinearOperator``, ``MatrixFreeCG`` and ``MatrixFreeBICGSTAB``: Krylov
  solvers whose vector updates and dot products are compiled kernels over fields.
"""

from .matrixfree import LinearOperator, MatrixFreeBICGSTAB, MatrixFreeCG
from .small import eig, polar_decompose, solve, svd, sym_eig
from .sparse import SparseCG, SparseMatrix, SparseMatrixBuilder, SparseSolver

__all__ = ["LinearOperator", "MatrixFreeBICGSTAB", "MatrixFreeCG", "SparseCG", "SparseMatrix",
           "SparseMatrixBuilder", "SparseSolver", "eig", "polar_decompose", "solve", "svd",
           "sym_eig"]
