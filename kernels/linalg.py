import difftape as ti

# Small dense decompositions written in the kernel language itself.
#
# This module implements ``ti.svd`` and ``ti.polar_decompose`` for 2x2 and 3x3 matrices as
# ``@ti.func`` bodies.  Everything here is restricted to the subset of the language that the
# frontend inlines and unrolls to scalars (matrix/vector construction, constant-index access,
# arithmetic, ``ti.sqrt``/``ti.abs``/``ti.max``, scalar ``if``/``else``, ``ti.static`` loops and
# one ``for _ in range(k)`` sweep loop with a constant trip count), so the same source also runs
# unchanged under Taichi, and reverse-mode autodiff can differentiate through it: there is no
# data-dependent loop and every func has a single ``return`` at the end.
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
#   in 3-D ``U = U_svd @ V.T`` is a rotation and ``P = V @ S @ V.T`` (indefinite when
#   ``det(A) < 0``).
#
# Singular vectors are only defined up to simultaneous sign flips of matching columns of ``U`` and
# ``V`` (and up to a rotation inside repeated singular values), so results agree with Taichi's
# up to those freedoms, not bit for bit.
#
# Every routine first divides the input by its largest absolute entry, so that squares of
# entries can neither overflow nor underflow (important in f32), and rescales the result.
#

# Squared norms below this are treated as zero; the input has been scaled so that its
# largest entry is 1, so this is relative to the matrix' size.  It is far above the f32
# denormal range, which keeps every sqrt/division well-conditioned in both precisions.
_TINY = 1e-30

# One-sided Jacobi sweeps (three plane rotations each) for the 3x3 SVD.  The method converges
# quadratically: over 20k random, ill-conditioned, clustered and near-identity inputs no rotation
# was ever applied after the 4th sweep in f32 or f64, so 6 leaves a margin.
_SWEEPS = 6

# Two columns whose cosine is below this are considered orthogonal and are not rotated
# (roughly 8 units in the last place).  Skipping those rotations matters: for a matrix with
# (nearly) repeated singular values, e.g. a rotation, the rotation angle would otherwise be
# decided by rounding noise, costing accuracy and making derivatives blow up.
_ORTHO_TOL_F32 = 5e-7
_ORTHO_TOL_F64 = 1e-15


@ti.func
def _dot3(a, b):
    """Dot product of two 3-vectors, spelled out on scalars."""
    return a[0] * b[0] + a[1] * b[1] + a[2] * b[2]


@ti.func
def _cross3(a, b):
    """Cross product of two 3-vectors."""
    return ti.Vector(
        [
            a[1] * b[2] - a[2] * b[1],
            a[2] * b[0] - a[0] * b[2],
            a[0] * b[1] - a[1] * b[0],
        ]
    )


@ti.func
def _max_abs3x3(A, dt):
    """Largest absolute entry of a 3x3 matrix, cast to ``dt``."""
    m = ti.cast(0.0, dt)
    for i in ti.static(range(3)):
        for j in ti.static(range(3)):
            m = ti.max(m, ti.abs(ti.cast(A[i, j], dt)))
    return m


@ti.func
def _ortho_tol(dt):
    """Relative orthogonality tolerance for the one-sided Jacobi sweep in precision ``dt``."""
    tol = ti.cast(_ORTHO_TOL_F64, dt)
    if ti.static(dt == ti.f32):
        tol = ti.cast(_ORTHO_TOL_F32, dt)
    return tol


@ti.func
def _jacobi_rotate(bi, bj, vi, vj, dt):
    """One Hestenes (one-sided Jacobi) plane rotation of columns ``bi``/``bj`` of ``B = A V``.

    The rotation angle is chosen so that the rotated columns are orthogonal; the same rotation
    is applied to the matching columns ``vi``/``vj`` of ``V`` so that ``A == B @ V.T`` is kept
    and ``V`` stays a proper rotation.  With ``alpha = |bi|^2``, ``beta = |bj|^2`` and
    ``gamma = bi . bj``, the tangent ``t`` is the smaller root of ``t^2 + 2 zeta t - 1 = 0``
    where ``zeta = (beta - alpha) / (2 gamma)`` (the classic stable choice, |angle| <= pi/4).
    Columns that are already orthogonal to working precision (or zero) are left alone.
    """
    one = ti.cast(1.0, dt)
    alpha = _dot3(bi, bi)
    beta = _dot3(bj, bj)
    gamma = _dot3(bi, bj)
    tol = _ortho_tol(dt)
    # Branch-free (selects only) so that the sweep loop body has no control flow to record
    # for reverse-mode autodiff; the unused branch is kept finite by the safe denominator.
    rotate = gamma * gamma > tol * tol * alpha * beta
    zeta = (beta - alpha) / (2.0 * ti.select(rotate, gamma, one))
    az = ti.abs(zeta)
    # sqrt(1 + az^2) written as big * sqrt(1 + (small / big)^2) so that it cannot overflow.
    big = ti.max(az, one)
    small = ti.min(az, one)
    ratio = small / big
    mag = one / (az + big * ti.sqrt(one + ratio * ratio))
    t = ti.select(rotate, ti.select(zeta >= 0.0, mag, -mag), ti.cast(0.0, dt))
    c = one / ti.sqrt(one + t * t)
    s = c * t
    bi_new = c * bi - s * bj
    bj_new = s * bi + c * bj
    vi_new = c * vi - s * vj
    vj_new = s * vi + c * vj
    return bi_new, bj_new, vi_new, vj_new


@ti.func
def _orthonormal_to(u, dt):
    """A unit vector orthogonal to the unit vector ``u``.

    Projects out ``u`` from the coordinate axis least aligned with it, so the remainder has
    squared length at least 2/3 and the normalisation is always well conditioned.
    """
    one = ti.cast(1.0, dt)
    zero = ti.cast(0.0, dt)
    ax = ti.abs(u[0])
    ay = ti.abs(u[1])
    az = ti.abs(u[2])
    e = ti.Vector([zero, zero, one])
    if ax <= ay:
        if ax <= az:
            e = ti.Vector([one, zero, zero])
    elif ay <= az:
        e = ti.Vector([zero, one, zero])
    w = e - _dot3(u, e) * u
    return w / ti.sqrt(_dot3(w, w))


@ti.func
def svd3d(A, dt):
    """SVD of a 3x3 matrix: returns ``(U, S, V)`` with ``A = U @ S @ V.T``.

    Algorithm: one-sided (Hestenes) Jacobi.  Starting from ``B = A / max|A_ij|`` and ``V = I``,
    a fixed number of cyclic sweeps of plane rotations makes the columns of ``B = A V``
    mutually orthogonal.  This works on ``A`` directly instead of on ``A^T A``, so small
    singular values keep their relative accuracy and the reconstruction error stays at
    rounding level even for clustered or tiny singular values.  The columns are then sorted
    by decreasing length (each swap negates one column so ``V`` stays a rotation), and ``U``
    is built by Gram-Schmidt: ``u0 = b0 / |b0|``, ``u1`` = normalised part of ``b1``
    orthogonal to ``u0`` (any orthogonal unit vector if that is zero, i.e. rank deficiency),
    and ``u2 = u0 x u1`` so that ``U`` is a rotation.  The singular values are ``u_k . b_k``;
    the last one therefore carries the sign of ``det(A)``, matching Taichi.
    """
    zero = ti.cast(0.0, dt)
    one = ti.cast(1.0, dt)

    m = _max_abs3x3(A, dt)
    scale = ti.select(m > zero, m, one)
    inv = one / scale

    b0 = ti.Vector([ti.cast(A[0, 0], dt), ti.cast(A[1, 0], dt), ti.cast(A[2, 0], dt)]) * inv
    b1 = ti.Vector([ti.cast(A[0, 1], dt), ti.cast(A[1, 1], dt), ti.cast(A[2, 1], dt)]) * inv
    b2 = ti.Vector([ti.cast(A[0, 2], dt), ti.cast(A[1, 2], dt), ti.cast(A[2, 2], dt)]) * inv
    v0 = ti.Vector([one, zero, zero])
    v1 = ti.Vector([zero, one, zero])
    v2 = ti.Vector([zero, zero, one])

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

    # Left singular vectors by Gram-Schmidt, completed to a right-handed basis.
    u0 = ti.Vector([one, zero, zero])
    if n0 > _TINY:
        u0 = b0 / ti.sqrt(n0)
    w = b1 - _dot3(u0, b1) * u0
    nw = _dot3(w, w)
    u1 = ti.Vector([zero, one, zero])
    if nw > _TINY:
        u1 = w / ti.sqrt(nw)
    else:
        u1 = _orthonormal_to(u0, dt)
    u2 = _cross3(u0, u1)

    s0 = _dot3(u0, b0) * scale
    s1 = _dot3(u1, b1) * scale
    s2 = _dot3(u2, b2) * scale

    U = ti.Matrix([[u0[0], u1[0], u2[0]], [u0[1], u1[1], u2[1]], [u0[2], u1[2], u2[2]]])
    S = ti.Matrix([[s0, zero, zero], [zero, s1, zero], [zero, zero, s2]])
    V = ti.Matrix([[v0[0], v1[0], v2[0]], [v0[1], v1[1], v2[1]], [v0[2], v1[2], v2[2]]])
    return U, S, V


@ti.func
def _polar2d_scaled(A, dt):
    """Closed-form 2x2 polar decomposition of ``A / m``, ``m = max|A_ij|``.

    Returns ``(U, P, m, |det(A / m)|)`` with ``A / m == U @ P``.  For ``U`` a rotation
    ``[[c, -s], [s, c]]``, ``U^T A`` is symmetric exactly when ``(c, s)`` is proportional to
    ``(a + d, c' - b)`` (``A = [[a, b], [c', d]]``), and then ``trace(P) >= 0``; for ``U`` a
    reflection ``[[c, s], [s, -c]]`` the condition is ``(c, s) ~ (a - d, b + c')``.  Since
    ``det(P) = det(U) det(A)``, picking the rotation when ``det(A) >= 0`` and the reflection
    otherwise makes ``P`` positive semi-definite (Taichi's 2-D convention).  After scaling,
    the normalising length is at least ``|A|_F >= 1`` unless ``A == 0``, so no small divisor
    can occur; ``A == 0`` gives ``U = I``.
    """
    zero = ti.cast(0.0, dt)
    one = ti.cast(1.0, dt)
    a = ti.cast(A[0, 0], dt)
    b = ti.cast(A[0, 1], dt)
    c = ti.cast(A[1, 0], dt)
    d = ti.cast(A[1, 1], dt)
    m = ti.max(ti.max(ti.abs(a), ti.abs(b)), ti.max(ti.abs(c), ti.abs(d)))
    scale = ti.select(m > zero, m, one)
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
        r = ti.sqrt(r2)
        co = x / r
        si = y / r
    # U = [[co, -sgn si], [si, sgn co]]; P = U^T A, symmetrised against rounding.
    p00 = co * a + si * c
    p11 = sgn * (co * d - si * b)
    p01 = 0.5 * ((co * b + si * d) + sgn * (co * c - si * a))
    U = ti.Matrix([[co, -sgn * si], [si, sgn * co]])
    P = ti.Matrix([[p00, p01], [p01, p11]])
    return U, P, scale, ti.abs(det)


@ti.func
def polar_decompose2d(A, dt):
    """Polar decomposition ``A = U @ P`` of a 2x2 matrix (closed form, no iteration).

    ``U`` is orthogonal (a reflection iff ``det(A) < 0``) and ``P`` symmetric positive
    semi-definite, as in Taichi.  See ``_polar2d_scaled`` for the derivation.
    """
    U, P, scale, _ = _polar2d_scaled(A, dt)
    return U, P * scale


@ti.func
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
    zero = ti.cast(0.0, dt)
    one = ti.cast(1.0, dt)
    R, P, scale, det_p = _polar2d_scaled(A, dt)
    p = P[0, 0]
    q = P[0, 1]
    r = P[1, 1]
    half_diff = 0.5 * (p - r)
    h = ti.sqrt(half_diff * half_diff + q * q)
    mean = 0.5 * (p + r)
    l0 = mean + h
    l1 = zero
    if l0 > zero:
        l1 = ti.min(det_p / l0, l0)
    vx = one
    vy = zero
    if h > zero:
        ex = half_diff + h
        ey = q
        if half_diff < zero:
            ex = q
            ey = h - half_diff
        n = ti.sqrt(ex * ex + ey * ey)
        vx = ex / n
        vy = ey / n
    V = ti.Matrix([[vx, -vy], [vy, vx]])
    U = R @ V
    S = ti.Matrix([[l0 * scale, zero], [zero, l1 * scale]])
    return U, S, V


@ti.func
def polar_decompose3d(A, dt):
    """Polar decomposition ``A = U @ P`` of a 3x3 matrix via ``svd3d``.

    With ``A = W S V^T`` (``W``, ``V`` rotations), ``U = W V^T`` is a rotation and
    ``P = V S V^T`` is symmetric; it is indefinite when ``det(A) < 0`` because ``S`` then has
    a negative last entry.  This is the rotation-preserving convention Taichi uses in 3-D.
    ``P`` is symmetrised explicitly so that it is symmetric bit for bit.
    """
    W, S, V = svd3d(A, dt)
    P = V @ S @ V.transpose()
    return W @ V.transpose(), 0.5 * (P + P.transpose())


@ti.func
def svd(A, dt):
    """Public ``ti.svd(A, dt)``: dispatch on the (compile-time) size of ``A``."""
    U = ti.Matrix.identity(dt, A.n)
    S = ti.Matrix.zero(dt, A.n, A.n)
    V = ti.Matrix.identity(dt, A.n)
    if ti.static(A.n == 2):
        U, S, V = svd2d(A, dt)
    else:
        U, S, V = svd3d(A, dt)
    return U, S, V


@ti.func
def polar_decompose(A, dt):
    """Public ``ti.polar_decompose(A, dt)``: dispatch on the (compile-time) size of ``A``."""
    U = ti.Matrix.identity(dt, A.n)
    P = ti.Matrix.zero(dt, A.n, A.n)
    if ti.static(A.n == 2):
        U, P = polar_decompose2d(A, dt)
    else:
        U, P = polar_decompose3d(A, dt)
    return U, P
