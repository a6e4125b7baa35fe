"""``ti.linalg.LinearOperator``, ``MatrixFreeCG`` and ``MatrixFreeBICGSTAB``: Krylov solvers
for ``A x = b`` where ``A`` is only known by a kernel computing ``A v`` on fields.

The loop of the method runs in Python (a handful of launches per iteration); every vector
operation (linear combinations, dot products) is a compiled kernel over the fields, so no
element is touched from Python. The work vectors are fields of the shape of ``b``, made once
per program, shape and dtype and reused by later calls (their kernels compile once).
Dot products accumulate in f64 whatever the fields' type.

Both return whether the residual norm ``|b - A x|`` fell below ``tol`` (an absolute
tolerance, as documented by Taichi). A breakdown (``p . A p <= 0`` in CG: ``A`` is not
positive definite; ``r0 . r == 0`` or ``r0 . v == 0`` in BiCGSTAB) ends the iteration with
``False`` and leaves ``x`` at the last finite iterate, never NaN.
"""


import math
from collections.abc import Callable

from .. import types as T
from ..errors import ArgumentError, ShapeError
from ..frontend import ops
from ..frontend.annotations import template
from ..frontend.decorators import kernel
from ..frontend.field import Field, make_field
from ..frontend.transformer import Grouped
from ..runtime import program


class LinearOperator:
    """``ti.linalg.LinearOperator(matvec_kernel)``: ``A`` given by a kernel
    ``matvec_kernel(x, Ax)`` that writes ``A x`` into ``Ax`` (both fields of one shape)."""

    def __init__(self, matvec_kernel: Callable) -> None:
        self._matvec = matvec_kernel

    def matvec(self, x: Field, Ax: Field) -> None:
        """``Ax = A x``."""
        if x.shape != Ax.shape:
            raise ShapeError(f"Dimension mismatch x.shape{x.shape} != Ax.shape{Ax.shape}.")
        self._matvec(x, Ax)


_KERNELS: dict[str, tuple] = {}


def _kernels(dt: T.DType) -> tuple:
    """``(combine, dot)`` for fields of ``dt``: ``z = a x + b y + c w`` and ``x . y``."""
    ks = _KERNELS.get(dt.name)
    if ks is not None:
        return ks

    @kernel
    def combine(z: template(), a: dt, x: template(), b: dt, y: template(), c: dt,
                w: template()):
        for e in Grouped(z):
            z[e] = a * x[e] + b * y[e] + c * w[e]

    @kernel
    def dot(x: template(), y: template()) -> T.f64:
        s = ops.cast(0.0, T.f64)
        for e in Grouped(x):
            s += ops.cast(x[e], T.f64) * ops.cast(y[e], T.f64)
        return s

    ks = _KERNELS[dt.name] = (combine, dot)
    return ks


_WORK: dict[tuple, list[Field]] = {}


def _work(dt: T.DType, shape: tuple, count: int) -> list[Field]:
    """``count`` scratch fields of ``dt`` and ``shape`` owned by the current program."""
    prog = program.get()
    for key in [k for k in _WORK if k[0] is not prog or k[1] != prog.generation]:
        del _WORK[key]  # fields of an earlier program (ti.reset / ti.init)
    fields = _WORK.setdefault((prog, prog.generation, dt.name, shape), [])
    while len(fields) < count:
        fields.append(make_field(dt, shape=shape))
    return fields[:count]


def _check(name: str, A, b, x) -> T.DType:
    if not isinstance(A, LinearOperator):
        raise ArgumentError(f"{name} takes a ti.linalg.LinearOperator, got {type(A).__name__}")
    for what, f in (("b", b), ("x", x)):
        if not isinstance(f, Field) or f.element_shape:
            raise ArgumentError(f"{name}: {what} must be a scalar ti.field, got "
                                f"{type(f).__name__}")
    if b.dtype != x.dtype:
        raise ArgumentError(f"Dtype mismatch b.dtype({b.dtype}) != x.dtype({x.dtype}).")
    if b.dtype.name not in ("f32", "f64"):
        raise ArgumentError(f"{name}: Not supported dtype: {b.dtype} (use f32 or f64)")
    if b.shape != x.shape:
        raise ShapeError(f"Dimension mismatch b.shape{b.shape} != x.shape{x.shape}.")
    if not 1 <= len(b.shape) <= 3:
        raise ShapeError(f"{name} only support 1D, 2D, 3D inputs; your inputs is "
                         f"{len(b.shape)}-D.")
    return b.dtype


def MatrixFreeCG(A: LinearOperator, b: Field, x: Field, tol: float = 1e-6,
                 maxiter: int = 5000, quiet: bool = True) -> bool:
    """Conjugate gradients for a symmetric positive definite ``A``: improves the initial
    guess ``x`` in place; True when ``|b - A x| < tol`` was reached."""
    dt = _check("MatrixFreeCG", A, b, x)
    combine, dot = _kernels(dt)
    r, p, Ap, Ax = _work(dt, b.shape, 4)
    A.matvec(x, Ax)
    combine(r, 1.0, b, -1.0, Ax, 0.0, Ax)  # r = b - A x
    combine(p, 1.0, r, 0.0, r, 0.0, r)  # p = r
    rr = dot(r, r)
    if not quiet:
        print(f">>> Initial residual = {math.sqrt(rr):e}")
    for it in range(maxiter):
        if math.sqrt(rr) < tol:
            break
        A.matvec(p, Ap)
        pap = dot(p, Ap)
        if not pap > 0.0:  # breakdown: A is not positive definite along p (or NaN)
            if not quiet:
                print(f">>> Conjugate Gradient broke down (p.Ap = {pap:e})")
            break
        alpha = rr / pap
        combine(x, 1.0, x, alpha, p, 0.0, p)
        combine(r, 1.0, r, -alpha, Ap, 0.0, Ap)
        rr_new = dot(r, r)
        if not quiet:
            print(f">>> Iter = {it + 1:4}, Residual = {math.sqrt(rr_new):e}")
        combine(p, 1.0, r, rr_new / rr, p, 0.0, p)
        rr = rr_new
    converged = math.sqrt(rr) < tol
    if not quiet:
        print(">>> Conjugate Gradient method converged." if converged else
              f">>> Conjugate Gradient method failed to converge in {maxiter} iterations: "
              f"Residual = {math.sqrt(rr):e}")
    return converged


def MatrixFreeBICGSTAB(A: LinearOperator, b: Field, x: Field, tol: float = 1e-6,
                       maxiter: int = 5000, quiet: bool = True) -> bool:
    """BiCGSTAB (van der Vorst) for a general nonsingular ``A``: improves the initial guess
    ``x`` in place; True when ``|b - A x| < tol`` was reached."""
    dt = _check("MatrixFreeBICGSTAB", A, b, x)
    combine, dot = _kernels(dt)
    r, r0, p, v, s, t = _work(dt, b.shape, 6)
    A.matvec(x, v)
    combine(r, 1.0, b, -1.0, v, 0.0, v)  # r = b - A x
    combine(r0, 1.0, r, 0.0, r, 0.0, r)  # the shadow residual
    rr = dot(r, r)
    if not quiet:
        print(f">>> Initial residual = {math.sqrt(rr):e}")
    rho_old = alpha = omega = 1.0
    for it in range(maxiter):
        if math.sqrt(rr) < tol:
            break
        rho = dot(r0, r)
        if rho == 0.0 or not math.isfinite(rho):
            break  # breakdown
        if it == 0:
            combine(p, 1.0, r, 0.0, r, 0.0, r)
        else:
            beta = (rho / rho_old) * (alpha / omega)
            combine(p, 1.0, r, beta, p, -beta * omega, v)  # p = r + beta (p - omega v)
        A.matvec(p, v)
        r0v = dot(r0, v)
        if r0v == 0.0 or not math.isfinite(r0v):
            break
        alpha = rho / r0v
        combine(s, 1.0, r, -alpha, v, 0.0, v)  # s = r - alpha v
        ss = dot(s, s)
        if math.sqrt(ss) < tol:
            combine(x, 1.0, x, alpha, p, 0.0, p)
            rr = ss
            break
        A.matvec(s, t)
        tt = dot(t, t)
        if not tt > 0.0:
            break
        omega = dot(t, s) / tt
        combine(x, 1.0, x, alpha, p, omega, s)
        combine(r, 1.0, s, -omega, t, 0.0, t)  # r = s - omega t
        rr = dot(r, r)
        if not quiet:
            print(f">>> Iter = {it + 1:4}, Residual = {math.sqrt(rr):e}")
        if omega == 0.0:
            break
        rho_old = rho
    converged = math.sqrt(rr) < tol
    if not quiet:
        print(">>> BICGSTAB method converged." if converged else
              f">>> BICGSTAB failed to converge in {maxiter} iterations: Residual = "
              f"{math.sqrt(rr):e}")
    return converged
