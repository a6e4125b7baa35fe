from .. import types as T
from ..frontend import builder as _b
from ..frontend import ops
from ..frontend.decorators import func
from ..frontend.matrix import Matrix, Vector
from ..frontend.transformer import static
from ..ir.nodes import Loc

# Small dense decompositions written in the kernel language itself.
#
# This module implements ``ti.svd`` and ``ti.polar_decompose`` for 2x2 and 3x3 matrices as
# ``@ti.func`` bodies.  Everything here is restricted to the subset of the language that the
# frontend inlines and unrolls to scalars (matrix/vector construction, constant-index access,
# arithmetic, ``ti.sqrt``/``ti.abs``/``ti.max``, scalar ``if``/``else``, ``ti.static`` loops and
# one ``for _ in range(k)`` sweep loop with a constant trip count), so the same code (with
# ``ti.`` before the names) also runs under Taichi, and reverse-mode autodiff can differentiate
# through it: there is no data-dependent loop and every func has a single ``return`` at the end.
#
# Conventions (measured against Taichi 1.7.4, which this API mirrors):
#
# * ``svd(A)`` returns ``(U, S, V)`` with ``A == U @ S @ V.transpose()``; ``S`` is a *diagonal
#   matrix*, not a vector, ordered by decreasing magnitude.
# * 2x2: the singular values are non-negative and ``V`` is a rotation; ``U`` is a rotation when
#   ``det(A) >= 0`` and a reflection (``det(U) == -1``) when ``det(A) < 0``.
# * 3x3: ``U`` and ``V`` are both rotations; when ``det(A) < 0`` the sign is carried by the last
#   (smallest-magnitude) singular value, which is then negative.
# * ``polar_decompose(A)`` returns ``(U, P)`` with ``A == U @ P`` and ``P`` symmetric.  In 2-D
#   ``U`` is orthogonal (a reflection when ``det(A) < 0``) and ``P`` is positive semi-definite;
#   in 3-D ``U = U_svd @ V.T`` is a rotation and ``P = U.T @ A = V @ S @ V.T`` (indefinite
#   when ``det(A) < 0``).
#
# Singular vectors are only defined up to simultaneous sign flips of matching columns of ``U`` and
# ``V`` (and up to a rotation inside repeated singular values), so results agree with Taichi's
# up to those freedoms, not bit for bit.
#
# Every routine first divides the input by a power of two close to its largest absolute entry
# (exact, and derivative-free), so that squares of entries can neither overflow nor underflow
# (important in f32), and rescales the result.

# Squared norms below this are treated as zero.  The input has been scaled so that its largest
# entry is in [0.5, 2), so this is relative to the matrix' size.  It is far above the f32
# denormal range, which keeps every sqrt/division well-conditioned in both precisions.
_TINY = 1e-30

# One-sided Jacobi sweeps (three plane rotations each) for the 3x3 SVD.  The method converges
# quadratically: over 20k random, ill-conditioned, clustered, repeated and near-identity inputs
# the worst column non-orthogonality reached its rounding floor after the 4th sweep in both f32
# and f64 (worst after 3 sweeps: 2e-5 / 4e-6), so 6 leaves a margin of two sweeps.
_SWEEPS = 6

# A column pair that is orthogonal *and* of equal length to this relative precision (about 8
# units in the last place) is a repeated singular value and is not rotated.  Any rotation would
# be valid there, but its angle would be decided by rounding noise, costing accuracy and making
# derivatives blow up (think of the identity or a rotation matrix as input).
_ORTHO_TOL_F32 = 5e-7
_ORTHO_TOL_F64 = 1e-15

# Gram-Schmidt remainders with a squared length below this (relative to unit-length inputs)
# are treated as zero, which only happens for a rank-deficient input.
_MIN_GS_NORM2 = 1e-6


@func
def _dot3(a, b):
    """Dot product of two 3-vectors, spelled out on scalars."""
    return a[0] * b[0] + a[1] * b[1] + a[2] * b[2]


@func
def _cross3(a, b):
    """Cross product of two 3-vectors."""
    return Vector(
        [
            a[1] * b[2] - a[2] * b[1],
            a[2] * b[0] - a[0] * b[2],
            a[0] * b[1] - a[1] * b[0],
        ]
    )


@func
def _max_abs3x3(A, dt):
    """Largest absolute entry of a 3x3 matrix, cast to ``dt``."""
    m = ops.cast(0.0, dt)
    for i in static(range(3)):
        for j in static(range(3)):
            m = ops.max(m, ops.abs(ops.cast(A[i, j], dt)))
    return m


@func
def _ortho_tol(dt):
    """Relative orthogonality tolerance for the one-sided Jacobi sweep in precision ``dt``."""
    tol = ops.cast(_ORTHO_TOL_F64, dt)
    if static(dt == T.f32):
        tol = ops.cast(_ORTHO_TOL_F32, dt)
    return tol


# IEEE layouts by width: the integer type of the same width, mantissa bits, exponent bias.
_FLOAT_BITS = {16: (T.i16, 10, 15), 32: (T.i32, 23, 127), 64: (T.i64, 52, 1023)}


@func
def _pow2_scale(m, dt):
    """A power of two ``c`` with ``m / c`` in ``[0.5, 2)`` (``c = 1`` when ``m == 0``).

    Inputs are divided by ``c`` before decomposing, so squares of entries can neither overflow
    nor underflow and the absolute thresholds below act as relative ones.  ``c`` is made from
    the exponent bits of ``m`` (``m >= 0``): ``2^E`` for ``m = f 2^E`` with ``E >= 0`` and
    ``2^(E + 1)`` for ``E < 0``, ``f`` in ``[1, 2)``.  It is exact in floating point and
    carries no derivative: the decompositions are homogeneous, so treating ``c`` as a constant
    still gives the true derivative, without ``1 / m^2`` intermediates that would overflow in
    the reverse pass for tiny inputs.  (A binary search on the exponent with comparisons and
    constant factors gave the same ``c`` for every normal ``m``, but as 14 dependent steps it
    was 40 % of an MPM particle-to-grid kernel.)  A subnormal ``m`` gets the smallest normal
    power of two (``m / c`` below 0.5 then, but its inverse is finite), an ``m`` in the top
    binade (``>= 2^bias``, or inf/NaN) the largest power whose inverse is normal (``m / c`` in
    ``[2, 4)`` then; ``2^bias`` had the subnormal inverse ``2^-bias``, which flushes to zero and
    made every factor come out as for a zero matrix).
    """
    one = ops.cast(1.0, dt)
    ity, mant, bias = static(_FLOAT_BITS[dt.bits])
    e = ops.cast(ops.bit_cast(m, ity) >> ops.cast(mant, ity), T.i32)  # biased exponent
    # zero/subnormal: 1; the top binade and inf/nan: 2 bias - 1, so that 1 / c is normal
    e = ops.min(e + ops.select(e < bias, 1, 0), 2 * bias - 1)
    c = ops.bit_cast(ops.cast(e, ity) << ops.cast(mant, ity), dt)
    return ops.select(m > 0.0, c, one)


@func
def _cast3x3(A, dt):
    """``A`` with every entry cast to ``dt``."""
    return Matrix(
        [
            [ops.cast(A[0, 0], dt), ops.cast(A[0, 1], dt), ops.cast(A[0, 2], dt)],
            [ops.cast(A[1, 0], dt), ops.cast(A[1, 1], dt), ops.cast(A[1, 2], dt)],
            [ops.cast(A[2, 0], dt), ops.cast(A[2, 1], dt), ops.cast(A[2, 2], dt)],
        ]
    )


@func
def _jacobi_rotate(bi, bj, vi, vj, dt):
    """One Hestenes (one-sided Jacobi) plane rotation of columns ``bi``/``bj`` of ``B = A V``.

    The rotation angle is chosen so that the rotated columns are orthogonal; the same rotation
    is applied to the matching columns ``vi``/``vj`` of ``V`` so that ``A == B @ V.T`` is kept
    and ``V`` stays a proper rotation.  With ``alpha = |bi|^2``, ``beta = |bj|^2``,
    ``gamma = bi . bj`` and ``d = (beta - alpha) / 2``, the tangent of the (smaller, at most
    pi/4) angle is ``t = sign(d) gamma / (|d| + sqrt(d^2 + gamma^2))``.  Written this way
    (rather than via ``zeta = d / gamma``) it is a smooth function of ``gamma`` at 0 whenever
    the column norms differ, so exactly orthogonal inputs such as diagonal matrices still get
    correct derivatives, and no intermediate can overflow.

    A pair whose columns are orthogonal *and* of equal length to working precision is
    degenerate (a repeated singular value): any rotation is valid, the formula would only
    amplify rounding noise (costing accuracy and producing huge derivatives), so such pairs are
    left alone.  Everything is branch-free (``ops.select`` with finite operands on both sides).
    """
    one = ops.cast(1.0, dt)
    zero = ops.cast(0.0, dt)
    alpha = _dot3(bi, bi)
    beta = _dot3(bj, bj)
    gamma = _dot3(bi, bj)
    tol = _ortho_tol(dt)
    d = 0.5 * (beta - alpha)
    h2 = d * d + gamma * gamma
    rotate = h2 > tol * tol * alpha * beta
    # Safe operands: when not rotating, sqrt and the division see 1 instead of (maybe) 0.
    denom = ops.abs(d) + ops.sqrt(ops.select(rotate, h2, one))
    t = ops.select(d >= zero, gamma, -gamma) / denom
    t = ops.select(rotate, t, zero)
    c = one / ops.sqrt(one + t * t)
    s = c * t
    bi_new = c * bi - s * bj
    bj_new = s * bi + c * bj
    vi_new = c * vi - s * vj
    vj_new = s * vi + c * vj
    return bi_new, bj_new, vi_new, vj_new


@func
def _orthonormal_to(u, dt):
    """A unit vector orthogonal to the unit vector ``u``.

    Projects out ``u`` from the coordinate axis least aligned with it, so the remainder has
    squared length at least 2/3 and the normalisation is always well conditioned.
    """
    one = ops.cast(1.0, dt)
    zero = ops.cast(0.0, dt)
    ax = ops.abs(u[0])
    ay = ops.abs(u[1])
    az = ops.abs(u[2])
    e = Vector([zero, zero, one])
    if ax <= ay:
        if ax <= az:
            e = Vector([one, zero, zero])
    elif ay <= az:
        e = Vector([zero, one, zero])
    w = e - _dot3(u, e) * u
    return w / ops.sqrt(_dot3(w, w))


@func
def _inv_norm(n2, dt):
    """``(sqrt(n2), 1 / sqrt(n2))``, or ``(0, 0)`` when ``n2`` is negligible."""
    s = ops.cast(0.0, dt)
    inv = ops.cast(0.0, dt)
    if n2 > _TINY:
        s = ops.sqrt(n2)
        inv = 1.0 / s
    return s, inv


@func
def _lowdin_coeff(f, inv_i, inv_j, s_i, s_j, dt):
    """Off-diagonal entry of ``(B^T B)^(-1/2)`` to first order in ``f = b_i . b_j``.

    For ``B^T B = diag(s^2) + F`` the Daleckii-Krein formula for ``x -> x^(-1/2)`` gives
    ``-f / (s_i s_j (s_i + s_j))``, which stays finite when ``s_i == s_j``.
    """
    k = ops.cast(0.0, dt)
    if s_i + s_j > 0.0:
        k = -f * inv_i * inv_j / (s_i + s_j)
    return k


@func
def svd3d(A, dt):
    """SVD of a 3x3 matrix: returns ``(U, S, V)`` with ``A = U @ S @ V.T``.

    Algorithm: one-sided (Hestenes) Jacobi.  Starting from ``B = A / c`` (``c`` ~ max|A_ij|,
    see ``_pow2_scale``) and ``V = I``, a fixed number of cyclic sweeps of plane rotations
    (``_jacobi_rotate``) makes the columns of ``B = A V`` mutually orthogonal.  This works on
    ``A`` directly instead of on ``A^T A``, so the reconstruction error stays at rounding level
    even for clustered or tiny singular values.  The columns are then sorted by decreasing
    length (each swap negates one column so ``V`` stays a rotation).

    ``U`` is the orthogonal polar factor of ``B`` (columns ``b_k / |b_k|`` plus the first-order
    symmetric correction from ``_lowdin_coeff``), re-orthonormalised by Gram-Schmidt and
    completed by ``u2 = u0 x u1`` so that ``U`` is a rotation; rank deficiency (a zero column)
    falls back to an arbitrary orthonormal completion.  Because ``polar(A V) = polar(A) V``
    for any rotation ``V``, this makes ``U @ V.T`` (and hence the polar decomposition) correct,
    with correct derivatives, even where Jacobi left a degenerate pair unrotated, e.g. at the
    identity.  The singular values are ``u_k . b_k``; the last one therefore carries the sign
    of ``det(A)``, matching Taichi.
    """
    zero = ops.cast(0.0, dt)
    one = ops.cast(1.0, dt)

    scale = _pow2_scale(_max_abs3x3(A, dt), dt)
    inv = one / scale

    b0 = Vector([ops.cast(A[0, 0], dt), ops.cast(A[1, 0], dt), ops.cast(A[2, 0], dt)]) * inv
    b1 = Vector([ops.cast(A[0, 1], dt), ops.cast(A[1, 1], dt), ops.cast(A[2, 1], dt)]) * inv
    b2 = Vector([ops.cast(A[0, 2], dt), ops.cast(A[1, 2], dt), ops.cast(A[2, 2], dt)]) * inv
    v0 = Vector([one, zero, zero])
    v1 = Vector([zero, one, zero])
    v2 = Vector([zero, zero, one])

    for _ in range(_SWEEPS):
        b0, b1, v0, v1 = _jacobi_rotate(b0, b1, v0, v1, dt)
        b0, b2, v0, v2 = _jacobi_rotate(b0, b2, v0, v2, dt)
        b1, b2, v1, v2 = _jacobi_rotate(b1, b2, v1, v2, dt)

    # Sort columns by decreasing length with a 3-element sorting network.  Swapping columns
    # (i, j) as (b_j, -b_i) in both B and V keeps A = B V^T and det(V) = +1.
    n0 = _dot3(b0, b0)
    n1 = _dot3(b1, b1)
    n2 = _dot3(b2, b2)
    if n0 < n1:
        tb = b0
        tv = v0
        tn = n0
        b0 = b1
        v0 = v1
        n0 = n1
        b1 = -tb
        v1 = -tv
        n1 = tn
    if n0 < n2:
        tb = b0
        tv = v0
        tn = n0
        b0 = b2
        v0 = v2
        n0 = n2
        b2 = -tb
        v2 = -tv
        n2 = tn
    if n1 < n2:
        tb = b1
        tv = v1
        tn = n1
        b1 = b2
        v1 = v2
        n1 = n2
        b2 = -tb
        v2 = -tv
        n2 = tn

    # Polar factor of B to first order: c_k = sum_i b_i M_ik, M ~ (B^T B)^(-1/2).
    s0, i0 = _inv_norm(n0, dt)
    s1, i1 = _inv_norm(n1, dt)
    s2, i2 = _inv_norm(n2, dt)
    k01 = _lowdin_coeff(_dot3(b0, b1), i0, i1, s0, s1, dt)
    k02 = _lowdin_coeff(_dot3(b0, b2), i0, i2, s0, s2, dt)
    k12 = _lowdin_coeff(_dot3(b1, b2), i1, i2, s1, s2, dt)
    c0 = i0 * b0 + k01 * b1 + k02 * b2
    c1 = k01 * b0 + i1 * b1 + k12 * b2

    # Exact orthonormalisation (Gram-Schmidt, projecting twice), right-handed completion.
    u0 = Vector([one, zero, zero])
    nc0 = _dot3(c0, c0)
    if nc0 > _TINY:
        u0 = c0 / ops.sqrt(nc0)
    w = c1 - _dot3(u0, c1) * u0
    w = w - _dot3(u0, w) * u0
    nw = _dot3(w, w)
    u1 = Vector([zero, one, zero])
    if nw > _MIN_GS_NORM2:
        u1 = w / ops.sqrt(nw)
    else:
        u1 = _orthonormal_to(u0, dt)
    if _dot3(u1, b1) < zero:  # only possible for the arbitrary fallback direction
        u1 = -u1
    u2 = _cross3(u0, u1)

    sv0 = _dot3(u0, b0) * scale
    sv1 = _dot3(u1, b1) * scale
    sv2 = _dot3(u2, b2) * scale

    U = Matrix([[u0[0], u1[0], u2[0]], [u0[1], u1[1], u2[1]], [u0[2], u1[2], u2[2]]])
    S = Matrix([[sv0, zero, zero], [zero, sv1, zero], [zero, zero, sv2]])
    V = Matrix([[v0[0], v1[0], v2[0]], [v0[1], v1[1], v2[1]], [v0[2], v1[2], v2[2]]])
    return U, S, V


@func
def _polar2d_scaled(A, dt):
    """Closed-form 2x2 polar decomposition of ``A / m``, ``m`` = a power of two near max|A_ij|.

    Returns ``(U, P, m, |det(A / m)|)`` with ``A / m == U @ P``.  For ``U`` a rotation
    ``[[c, -s], [s, c]]``, ``U^T A`` is symmetric exactly when ``(c, s)`` is proportional to
    ``(a + d, c' - b)`` (``A = [[a, b], [c', d]]``), and then ``trace(P) >= 0``; for ``U`` a
    reflection ``[[c, s], [s, -c]]`` the condition is ``(c, s) ~ (a - d, b + c')``.  Since
    ``det(P) = det(U) det(A)``, picking the rotation when ``det(A) >= 0`` and the reflection
    otherwise makes ``P`` positive semi-definite (Taichi's 2-D convention).  The squared
    normalising length is ``|A|_F^2 + 2 |det(A)| >= |A|_F^2 >= 1/4`` after scaling unless
    ``A == 0``, so no small divisor can occur; ``A == 0`` gives ``U = I``.
    """
    zero = ops.cast(0.0, dt)
    one = ops.cast(1.0, dt)
    a = ops.cast(A[0, 0], dt)
    b = ops.cast(A[0, 1], dt)
    c = ops.cast(A[1, 0], dt)
    d = ops.cast(A[1, 1], dt)
    m = ops.max(ops.max(ops.abs(a), ops.abs(b)), ops.max(ops.abs(c), ops.abs(d)))
    scale = _pow2_scale(m, dt)
    inv = one / scale
    a = a * inv
    b = b * inv
    c = c * inv
    d = d * inv

    det = a * d - b * c
    sgn = one
    if det < zero:
        sgn = -one
    x = a + sgn * d
    y = c - sgn * b
    r2 = x * x + y * y
    co = one
    si = zero
    if r2 > _TINY:
        r = ops.sqrt(r2)
        co = x / r
        si = y / r
    # U = [[co, -sgn si], [si, sgn co]]; P = U^T A, symmetrised against rounding.
    p00 = co * a + si * c
    p11 = sgn * (co * d - si * b)
    p01 = 0.5 * ((co * b + si * d) + sgn * (co * c - si * a))
    U = Matrix([[co, -sgn * si], [si, sgn * co]])
    P = Matrix([[p00, p01], [p01, p11]])
    return U, P, scale, ops.abs(det)


@func
def polar_decompose2d(A, dt):
    """Polar decomposition ``A = U @ P`` of a 2x2 matrix (closed form, no iteration).

    ``U`` is orthogonal (a reflection iff ``det(A) < 0``) and ``P`` symmetric positive
    semi-definite, as in Taichi.  See ``_polar2d_scaled`` for the derivation.
    """
    U, P, scale, _ = _polar2d_scaled(A, dt)
    return U, P * scale


@func
def svd2d(A, dt):
    """SVD of a 2x2 matrix: returns ``(U, S, V)`` with ``A = U @ S @ V.T``.

    Algorithm: closed form.  First the polar decomposition ``A = R P`` (``P`` symmetric PSD),
    then the symmetric 2x2 eigenproblem ``P = V D V^T`` with one exact Jacobi rotation: with
    ``h = sqrt(((p00 - p11) / 2)^2 + p01^2)`` the eigenvalues are ``(p00 + p11) / 2 +- h`` and
    the dominant eigenvector is taken from whichever of the two equivalent formulas avoids
    cancellation.  The small eigenvalue is computed as ``det(P) / lambda_max`` with
    ``det(P) = |det(A)|`` so it is non-negative and relatively accurate.  Then ``U = R V``:
    ``V`` is a rotation, ``S`` is non-negative and decreasing, and ``det(U) = sign(det(A))``,
    which is Taichi's 2-D convention.
    """
    zero = ops.cast(0.0, dt)
    one = ops.cast(1.0, dt)
    R, P, scale, det_p = _polar2d_scaled(A, dt)
    p = P[0, 0]
    q = P[0, 1]
    r = P[1, 1]
    half_diff = 0.5 * (p - r)
    h2 = half_diff * half_diff + q * q
    h = zero
    if h2 > _TINY:  # otherwise P is a multiple of I and V = I (also keeps sqrt'(0) out of AD)
        h = ops.sqrt(h2)
    mean = 0.5 * (p + r)
    l0 = mean + h
    l1 = zero
    if l0 > zero:
        l1 = ops.min(det_p / l0, l0)
    vx = one
    vy = zero
    if h2 > _TINY:
        ex = half_diff + h
        ey = q
        if half_diff < zero:
            ex = q
            ey = h - half_diff
        n = ops.sqrt(ex * ex + ey * ey)
        vx = ex / n
        vy = ey / n
    V = Matrix([[vx, -vy], [vy, vx]])
    U = R @ V
    S = Matrix([[l0 * scale, zero], [zero, l1 * scale]])
    return U, S, V


@func
def polar_decompose3d(A, dt):
    """Polar decomposition ``A = U @ P`` of a 3x3 matrix via ``svd3d``.

    With ``A = W S V^T`` (``W``, ``V`` rotations), ``U = W V^T`` is a rotation and
    ``P = U^T A = V S V^T`` is symmetric; it is indefinite when ``det(A) < 0`` because ``S``
    then has a negative last entry.  This is the rotation-preserving convention Taichi uses in
    3-D.  ``P`` is formed as the symmetric part of ``U^T A`` (rather than ``V S V^T``) so that
    it is symmetric bit for bit and its derivative is right even where ``V`` is arbitrary
    (repeated singular values).
    """
    W, S, V = svd3d(A, dt)
    U = W @ V.transpose()
    P = U.transpose() @ _cast3x3(A, dt)
    return U, 0.5 * (P + P.transpose())


def svd(A, dt=None):
    """Public ``ti.svd(A, dt)``: dispatch on the (compile-time) size of ``A``, which must be
    2x2 or 3x3."""
    n = _square(A, "ti.svd", (2, 3))
    dt = _float_dtype(dt, "ti.svd")
    return svd2d(A, dt) if n == 2 else svd3d(A, dt)


def polar_decompose(A, dt=None):
    """Public ``ti.polar_decompose(A, dt)``: dispatch on the (compile-time) size of ``A``,
    which must be 2x2 or 3x3."""
    n = _square(A, "ti.polar_decompose", (2, 3))
    dt = _float_dtype(dt, "ti.polar_decompose")
    return polar_decompose2d(A, dt) if n == 2 else polar_decompose3d(A, dt)


# ---------------------------------------------------------------------------------------------
# ti.solve, ti.sym_eig, ti.eig
#
# Same rules as above: unrolled code on scalars, branch-free where a branch would cut a
# derivative, inputs scaled by a power of two (exact) before anything is squared.  What would
# otherwise be a silently wrong result (a singular matrix in ``solve``, a non-symmetric one in
# ``sym_eig``) is refused at run time with ``ops.runtime_check``, whatever ``debug`` says
# (Taichi checks these only with ``debug=True`` and returns inf/nan or garbage otherwise).

# ``sym_eig`` decomposes the symmetric part of ``A``; an antisymmetric part larger than this
# many units in the last place of max|A_ij| means the input was not symmetric (rather than
# symmetric up to the rounding of how it was computed) and is refused.
_SYM_ULPS = 64.0
_EPS_F32 = 2.0 ** -23
_EPS_F64 = 2.0 ** -52

# Cyclic two-sided Jacobi sweeps for the symmetric 3x3 eigenproblem (quadratic convergence,
# like the one-sided sweeps of ``svd3d``; the off-diagonal reaches rounding level after 4).
_EIG_SWEEPS = 6


def _float_dtype(dt, name: str):
    """``dt`` resolved (default: ``default_fp``); an integer type is refused."""
    dt = ops.resolve_dtype(dt if dt is not None else float)
    if not dt.is_float:
        raise ops._err(f"{name} computes in floating point: dt must be ti.f32 or ti.f64, got {dt}")
    return dt


#: Taichi's name of each routine in its size errors ("Polar decomposition only supports 2D and
#: 3D matrices."), which programs written for Taichi may match.
_TAICHI_NAMES = {"ti.svd": "SVD", "ti.polar_decompose": "Polar decomposition",
                 "ti.solve": "Solver", "ti.sym_eig": "Symmetric eigen solver",
                 "ti.eig": "Eigen solver"}


def _square(A, name: str, sizes: tuple[int, ...]) -> int:
    """The size of the square matrix ``A``; anything else is a compile error naming ``name``
    in Taichi's words (what sizes it supports) and ours (what it got)."""
    if isinstance(A, Matrix) and A.ndim == 2 and A.n == A.m and A.n in sizes:
        return A.n
    n, m = getattr(A, "n", None), getattr(A, "m", None)
    kind = "matrix" if isinstance(A, Matrix) else type(A).__name__
    what = (f"a {A.n}-vector" if isinstance(A, Matrix) and A.ndim == 1 else
            f"a {n}x{m} {kind}" if isinstance(n, int) and isinstance(m, int) else f"a {kind}")
    hint = "" if isinstance(A, Matrix) else " (pass a matrix value, e.g. x[i] of a field x)"
    raise ops._err(f"{_TAICHI_NAMES[name]} only supports "
                   f"{' and '.join(f'{k}D' for k in sizes)} matrices. {name} takes a "
                   f"{' or '.join(f'{k}x{k}' for k in sizes)} matrix, got {what}{hint}")


def _call_site() -> Loc | None:
    """The line of the kernel (or func) calling the public routine, for run-time messages."""
    bld = _b.current()
    return bld.loc if bld is not None else None


@func
def _solve(A, b, dt, site):
    """Gaussian elimination with partial pivoting on ``[A | b]``, unrolled for ``A.n``.

    The pivot search compares at run time; rows are exchanged with ``ops.select`` (no
    branch), so reverse- and forward-mode derivatives flow through every entry.  A zero pivot
    means ``A`` is singular (no unique solution): refused, never inf/nan.
    """
    M = Matrix.zero(dt, A.n, A.n)
    r = Vector.zero(dt, A.n)
    for i in static(range(A.n)):
        r[i] = ops.cast(b[i], dt)
        for j in static(range(A.n)):
            M[i, j] = ops.cast(A[i, j], dt)
    for k in static(range(A.n)):
        # pivot: the largest |M[p, k]| for p >= k (the first of equals, as LAPACK)
        p = k
        best = ops.abs(M[k, k])
        for i in static(range(k + 1, A.n)):
            if ops.abs(M[i, k]) > best:
                p = i
                best = ops.abs(M[i, k])
        ops.runtime_check(best != 0.0, "ti.solve: the matrix is singular (a zero pivot in "
                          "Gaussian elimination), Ax = b has no unique solution", site)
        for i in static(range(k + 1, A.n)):
            swap = p == i
            for j in static(range(k, A.n)):
                mk = M[k, j]
                M[k, j] = ops.select(swap, M[i, j], mk)
                M[i, j] = ops.select(swap, mk, M[i, j])
            rk = r[k]
            r[k] = ops.select(swap, r[i], rk)
            r[i] = ops.select(swap, rk, r[i])
        for i in static(range(k + 1, A.n)):
            f = M[i, k] / M[k, k]
            for j in static(range(k + 1, A.n)):
                M[i, j] = M[i, j] - f * M[k, j]
            r[i] = r[i] - f * r[k]
    x = Vector.zero(dt, A.n)
    for i in static(range(A.n - 1, -1, -1)):
        s = r[i]
        for j in static(range(i + 1, A.n)):
            s = s - M[i, j] * x[j]
        x[i] = s / M[i, i]
    return x


def solve(A, b, dt=None):
    """``ti.solve(A, b)``: ``x`` with ``A @ x == b`` for a 2x2 or 3x3 ``A`` (Gaussian
    elimination with partial pivoting, differentiable); a singular ``A`` is a run-time error."""
    n = _square(A, "ti.solve", (2, 3))
    if not isinstance(b, Matrix) or (b.ndim == 2 and b.m != 1) or b.n != n:
        what = f"{b.n}x{b.m}" if isinstance(b, Matrix) else type(b).__name__
        raise ops._err(f"ti.solve: b must be a {n}-vector to match the {n}x{n} matrix, got {what}")
    return _solve(A, b, _float_dtype(dt, "ti.solve"), _call_site())


@func
def _symmetric_scaled(A, dt, site):
    """``(S, c)``: ``S`` the symmetric part of ``A / c``, ``c`` a power of two near max|A_ij|.

    Refuses (at run time) an ``A`` whose antisymmetric part is more than rounding.
    """
    m = ops.cast(0.0, dt)
    for i in static(range(A.n)):
        for j in static(range(A.n)):
            m = ops.max(m, ops.abs(ops.cast(A[i, j], dt)))
    c = _pow2_scale(m, dt)
    inv = 1.0 / c
    S = Matrix.zero(dt, A.n, A.n)
    asym = ops.cast(0.0, dt)
    for i in static(range(A.n)):
        for j in static(range(A.n)):
            aij = ops.cast(A[i, j], dt) * inv
            aji = ops.cast(A[j, i], dt) * inv
            S[i, j] = 0.5 * (aij + aji)
            asym = ops.max(asym, ops.abs(aij - aji))
    eps = static(_SYM_ULPS * (_EPS_F32 if dt == T.f32 else _EPS_F64))
    ops.runtime_check(asym <= eps * 2.0, "ti.sym_eig: the matrix is not symmetric (A[i, j] "
                      "!= A[j, i] beyond rounding); use ti.eig for a general matrix", site)
    return S, c


@func
def _sym_eig2x2(A, dt, site):
    """Closed-form symmetric 2x2 eigenproblem, eigenvalues in Taichi's order (larger first).

    With ``h = sqrt(((p - r) / 2)^2 + q^2)`` the eigenvalues are ``(p + r) / 2 +- h``; the
    eigenvector of the larger one is taken from whichever of two equivalent formulas avoids
    cancellation (as in ``svd2d``) and the other is its rotation by 90 degrees, so the
    eigenvector matrix is a rotation.  A multiple of the identity (``h == 0``) gives ``I``.
    """
    S, c = _symmetric_scaled(A, dt, site)
    zero = ops.cast(0.0, dt)
    one = ops.cast(1.0, dt)
    p = S[0, 0]
    q = S[0, 1]
    r = S[1, 1]
    half_diff = 0.5 * (p - r)
    h2 = half_diff * half_diff + q * q
    h = zero
    vx = one
    vy = zero
    if h2 > _TINY:  # otherwise S is a multiple of I (also keeps sqrt'(0) out of AD)
        h = ops.sqrt(h2)
        ex = half_diff + h
        ey = q
        if half_diff < zero:
            ex = q
            ey = h - half_diff
        nrm = ops.sqrt(ex * ex + ey * ey)
        vx = ex / nrm
        vy = ey / nrm
    mean = 0.5 * (p + r)
    w = Vector([(mean + h) * c, (mean - h) * c])
    V = Matrix([[vx, -vy], [vy, vx]])
    return w, V


@func
def _sym_rotate(app, aqq, apq, arp, arq, vp, vq, tol, dt):
    """One two-sided Jacobi rotation zeroing ``A[p, q]`` of a symmetric 3x3 matrix.

    ``r`` is the third index; ``vp``/``vq`` are columns ``p``/``q`` of the accumulated
    eigenvector matrix.  With ``d = (a_qq - a_pp) / 2`` and ``g = a_pq`` the tangent of the
    (at most 45 degree) angle is ``t = sign(d) g / (|d| + sqrt(d^2 + g^2))``, a smooth
    function of ``g`` at 0 whenever ``d != 0``, so diagonal inputs get the right derivatives.
    A pair with ``d`` and ``g`` both at rounding level is a repeated eigenvalue: any rotation
    is valid there and one decided by rounding noise would only cost accuracy, so it is left.
    """
    one = ops.cast(1.0, dt)
    zero = ops.cast(0.0, dt)
    d = 0.5 * (aqq - app)
    h2 = d * d + apq * apq
    rotate = h2 > tol * tol
    denom = ops.abs(d) + ops.sqrt(ops.select(rotate, h2, one))
    t = ops.select(d >= zero, apq, -apq) / denom
    t = ops.select(rotate, t, zero)
    c = one / ops.sqrt(one + t * t)
    s = c * t
    app_new = app - t * apq
    aqq_new = aqq + t * apq
    apq_new = ops.select(rotate, zero, apq)
    arp_new = c * arp - s * arq
    arq_new = s * arp + c * arq
    vp_new = c * vp - s * vq
    vq_new = s * vp + c * vq
    return app_new, aqq_new, apq_new, arp_new, arq_new, vp_new, vq_new


@func
def _sym_eig3x3(A, dt, site):
    """Symmetric 3x3 eigenproblem by cyclic Jacobi, eigenvalues ascending (Taichi's order).

    A fixed number of sweeps (no data-dependent loop) keeps it differentiable in both modes;
    Taichi's own 3x3 routine (Cardano with a QL fallback) is not differentiable.  The
    eigenvector matrix is a rotation; columns are sorted with their eigenvalues (each swap
    negates one column to keep the determinant).
    """
    S, c = _symmetric_scaled(A, dt, site)
    zero = ops.cast(0.0, dt)
    one = ops.cast(1.0, dt)
    tol = _ortho_tol(dt)
    a00 = S[0, 0]
    a11 = S[1, 1]
    a22 = S[2, 2]
    a01 = S[0, 1]
    a02 = S[0, 2]
    a12 = S[1, 2]
    v0 = Vector([one, zero, zero])
    v1 = Vector([zero, one, zero])
    v2 = Vector([zero, zero, one])
    for _ in range(_EIG_SWEEPS):
        a00, a11, a01, a02, a12, v0, v1 = _sym_rotate(a00, a11, a01, a02, a12, v0, v1, tol, dt)
        a00, a22, a02, a01, a12, v0, v2 = _sym_rotate(a00, a22, a02, a01, a12, v0, v2, tol, dt)
        a11, a22, a12, a01, a02, v1, v2 = _sym_rotate(a11, a22, a12, a01, a02, v1, v2, tol, dt)
    w0 = a00
    w1 = a11
    w2 = a22
    if w1 < w0:
        tw = w0
        tv = v0
        w0 = w1
        v0 = v1
        w1 = tw
        v1 = -tv
    if w2 < w0:
        tw = w0
        tv = v0
        w0 = w2
        v0 = v2
        w2 = tw
        v2 = -tv
    if w2 < w1:
        tw = w1
        tv = v1
        w1 = w2
        v1 = v2
        w2 = tw
        v2 = -tv
    w = Vector([w0 * c, w1 * c, w2 * c])
    V = Matrix([[v0[0], v1[0], v2[0]], [v0[1], v1[1], v2[1]], [v0[2], v1[2], v2[2]]])
    return w, V


def sym_eig(A, dt=None):
    """``ti.sym_eig(A)`` -> ``(w, V)``: eigenvalues (a vector) and unit eigenvectors (the
    columns of ``V``, a rotation) of a symmetric 2x2 or 3x3 matrix, ``A @ V == V @ diag(w)``.

    As Taichi: 2x2 gives the larger eigenvalue first, 3x3 sorts ascending.  A non-symmetric
    ``A`` is a run-time error.  Differentiable (also in 3-D, where Taichi's is not) wherever
    the eigenvalues are distinct.
    """
    n = _square(A, "ti.sym_eig", (2, 3))
    dt = _float_dtype(dt, "ti.sym_eig")
    if n == 2:
        return _sym_eig2x2(A, dt, _call_site())
    return _sym_eig3x3(A, dt, _call_site())


@func
def _unit_col(x0, x1, y0, y1):
    """The longer of the columns ``(x0, x1)`` and ``(y0, y1)`` (complex entries as
    ``(re, im)`` pairs: ``x0 = (re, im)`` ...), normalised; a 4-vector ``(re0, im0, re1,
    im1)``.  Both are eigenvectors of the same eigenvalue (columns of ``A - mu I``); the
    longer one is never zero unless ``A - mu I`` is."""
    nx = x0.dot(x0) + x1.dot(x1)
    ny = y0.dot(y0) + y1.dot(y1)
    v = Vector([x0[0], x0[1], x1[0], x1[1]])
    nv = nx
    if ny > nx:
        v = Vector([y0[0], y0[1], y1[0], y1[1]])
        nv = ny
    return v / ops.sqrt(nv)


@func
def _eig2x2(A, dt):
    """Eigenvalues and right eigenvectors of a real 2x2 matrix, in Taichi's complex layout.

    ``gap = (a - d)^2 + 4 b c`` (the discriminant, written without the cancellation of
    ``tr^2 - 4 det``) decides real or complex-conjugate eigenvalues ``(tr +- sqrt(gap)) / 2``.
    By Cayley-Hamilton the columns of ``A - mu_2 I`` are eigenvectors of ``mu_1`` and vice
    versa; the longer column is used (Taichi takes the first, which can be zero).  ``A = mu I``
    gives the unit vectors; a defective ``A`` (one eigenvector) gives it twice, as NumPy does.
    """
    zero = ops.cast(0.0, dt)
    one = ops.cast(1.0, dt)
    a = ops.cast(A[0, 0], dt)
    b = ops.cast(A[0, 1], dt)
    cc = ops.cast(A[1, 0], dt)
    d = ops.cast(A[1, 1], dt)
    m = ops.max(ops.max(ops.abs(a), ops.abs(b)), ops.max(ops.abs(cc), ops.abs(d)))
    sc = _pow2_scale(m, dt)
    inv = one / sc
    a = a * inv
    b = b * inv
    cc = cc * inv
    d = d * inv
    half_tr = 0.5 * (a + d)
    half_diff = 0.5 * (a - d)
    gap4 = half_diff * half_diff + b * cc  # gap / 4
    re1 = half_tr
    re2 = half_tr
    im = zero  # imaginary part of the first eigenvalue (the second is conjugate)
    if gap4 > zero:
        h = ops.sqrt(gap4)
        re1 = half_tr + h
        re2 = half_tr - h
    elif gap4 < zero:
        im = ops.sqrt(-gap4)
    # columns of A - mu I as (re, im) pairs, for mu = mu_2 (-> eigenvector 1) and mu_1
    v1 = Vector([zero, zero, one, zero])
    v2 = Vector([one, zero, zero, zero])
    c2a = Vector([a - re2, im])  # (A - mu_2 I)[0, 0]; mu_2 = re2 - i im
    c2b = Vector([cc, zero])
    c2c = Vector([b, zero])
    c2d = Vector([d - re2, im])
    c1a = Vector([a - re1, -im])  # (A - mu_1 I)[0, 0]; mu_1 = re1 + i im
    c1d = Vector([d - re1, -im])
    n2 = c2a.dot(c2a) + c2b.dot(c2b) + c2c.dot(c2c) + c2d.dot(c2d)
    n1 = c1a.dot(c1a) + c2b.dot(c2b) + c2c.dot(c2c) + c1d.dot(c1d)
    if n2 > _TINY:
        v1 = _unit_col(c2a, c2b, c2c, c2d)
    if n1 > _TINY:
        v2 = _unit_col(c1a, c2b, c2c, c1d)
    if n2 <= _TINY:  # A - mu_2 I == 0: A = mu I, mu_1 == mu_2, any basis
        v1 = Vector([one, zero, zero, zero])
        v2 = Vector([zero, zero, one, zero])
    elif n1 <= _TINY:
        v2 = v1
    w = Matrix([[re1 * sc, im * sc], [re2 * sc, -im * sc]])
    V = Matrix([[v1[0], v2[0]], [v1[1], v2[1]], [v1[2], v2[2]], [v1[3], v2[3]]])
    return w, V


def eig(A, dt=None):
    """``ti.eig(A)`` -> ``(w, V)`` for a real 2x2 matrix, in Taichi's layout: ``w`` is 2x2,
    row ``k`` the eigenvalue ``k`` as ``(re, im)``; ``V`` is 4x2, column ``k`` its unit
    eigenvector as ``(re0, im0, re1, im1)``."""
    _square(A, "ti.eig", (2,))
    return _eig2x2(A, _float_dtype(dt, "ti.eig"))
