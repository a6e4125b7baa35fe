"""``ti.math``: vector/matrix types and math functions usable in kernels and Python scope.

Every formula is Taichi's (python/taichi/math/mathimpl.py), operation for operation, so that a
program ported from Taichi computes the same values with the same rounding. Functions that take
or return vectors work on scalars too where Taichi's do (elementwise).
"""

from __future__ import annotations

import math as _m

from .frontend import ops as _ops
from .frontend.matrix import UNSIGNED_DEFAULT as _UNSIGNED
from .frontend.matrix import Matrix as _Matrix
from .frontend.matrix import MatrixType
from .frontend.ops import (  # noqa: F401 - re-exported API
    acos,
    asin,
    atan,
    atan2,
    ceil,
    clz,
    cos,
    exp,
    floor,
    log,
    max,
    min,
    pow,
    round,
    rsqrt,
    select,
    sin,
    sqrt,
    tan,
    tanh,
)

pi = _m.pi
e = _m.e
inf = _m.inf
nan = _m.nan

# Element types follow ti.init's default_fp / default_ip (and its unsigned twin), as in Taichi.
vec2, vec3, vec4 = (MatrixType(n, 1, 1, float) for n in (2, 3, 4))
ivec2, ivec3, ivec4 = (MatrixType(n, 1, 1, int) for n in (2, 3, 4))
uvec2, uvec3, uvec4 = (MatrixType(n, 1, 1, _UNSIGNED) for n in (2, 3, 4))
mat2, mat3, mat4 = (MatrixType(n, n, 2, float) for n in (2, 3, 4))


def _float(x):
    """``ti.cast(x, float)``: a comparison's 0/1 as the default float type."""
    return _ops.cast(x, float)


def clamp(x, xmin, xmax):
    """``min(xmax, max(xmin, x))``."""
    return min(xmax, max(xmin, x))


def mix(x, y, a):
    """``x * (1.0 - a) + y * a``."""
    return x * (1.0 - a) + y * a


def step(edge, x):
    """``1.0`` where ``x >= edge``, else ``0.0`` (default float type)."""
    return _float(x >= edge)


def fract(x):
    """``x - floor(x)``."""
    return x - floor(x)


def smoothstep(edge0, edge1, x):
    """Hermite interpolation of ``clamp((x - edge0) / (edge1 - edge0), 0, 1)``."""
    t = clamp((x - edge0) / (edge1 - edge0), 0.0, 1.0)
    return t * t * (3.0 - 2.0 * t)


def sign(x):
    """``-1.0``, ``0.0`` or ``1.0`` in the default float type (also for integer ``x``)."""
    return _float(x >= 0.0) - _float(x <= 0.0)


def normalize(v):
    """``v / v.norm()`` (a division, unlike ``v.normalized()``, which multiplies)."""
    return v / v.norm()


def log2(x):
    """``log(x) / log(2)``."""
    return log(x) / _m.log(2.0)


def exp2(x):
    """``2 ** x`` (difftape's; Taichi's ti.math has no exp2). Exact at integer ``x``."""
    return pow(2.0, x)


def reflect(x, n):
    """``x - 2 * dot(x, n) * n``."""
    k = x.dot(n)
    return x - 2.0 * k * n


def refract(x, n, eta):
    """The refraction of ``x`` through a surface of normal ``n`` and ratio ``eta``; zero on total
    internal reflection (``1 - eta^2 (1 - dot(x, n)^2) < 0``)."""
    return _refract(x, n, eta)


def degrees(x):
    return x * (180.0 / pi)


def radians(x):
    return x * (pi / 180.0)


def distance(x, y):
    """``(x - y).norm()``."""
    return (x - y).norm()


def length(x):
    """``x.norm()``."""
    return x.norm()


def dot(x, y):
    return x.dot(y)


def cross(x, y):
    return x.cross(y)


def mod(x, y):
    """``x - y * floor(x / y)``: the result has the sign of ``y`` (GLSL's mod)."""
    return x - y * floor(x / y)


def determinant(m):
    return m.determinant()


def inverse(m):
    return m.inverse()


def eye(n: int):
    """The n x n identity in the default float type."""
    return _Matrix.identity(float, n)


def translate(dx, dy, dz):
    """The 4x4 homogeneous translation by (dx, dy, dz)."""
    return mat4([[1.0, 0.0, 0.0, dx], [0.0, 1.0, 0.0, dy], [0.0, 0.0, 1.0, dz],
                 [0.0, 0.0, 0.0, 1.0]])


def scale(sx, sy, sz):
    """The 4x4 homogeneous scaling by (sx, sy, sz)."""
    return mat4([[sx, 0.0, 0.0, 0.0], [0.0, sy, 0.0, 0.0], [0.0, 0.0, sz, 0.0],
                 [0.0, 0.0, 0.0, 1.0]])


def rot_by_axis(axis, ang):
    """The 4x4 rotation by ``ang`` radians about ``axis`` (normalized here)."""
    c = cos(ang)
    s = sin(ang)
    axis = normalize(axis)
    temp = (1 - c) * axis
    return mat4([
        [c + temp[0] * axis[0], temp[0] * axis[1] + s * axis[2],
         temp[0] * axis[2] - s * axis[1], 0.0],
        [temp[1] * axis[0] - s * axis[2], c + temp[1] * axis[1],
         temp[1] * axis[2] + s * axis[0], 0.0],
        [temp[2] * axis[0] + s * axis[1], temp[2] * axis[1] - s * axis[0],
         c + temp[2] * axis[2], 0.0],
        [0.0, 0.0, 0.0, 1.0],
    ])


def rot_yaw_pitch_roll(yaw, pitch, roll):
    """The 4x4 rotation by yaw (about y), pitch (about x) and roll (about z), in radians."""
    ch, sh = cos(yaw), sin(yaw)
    cp, sp = cos(pitch), sin(pitch)
    cb, sb = cos(roll), sin(roll)
    return mat4([
        [ch * cb + sh * sp * sb, sb * cp, -sh * cb + ch * sp * sb, 0.0],
        [-ch * sb + sh * sp * cb, cb * cp, sb * sh + ch * sp * cb, 0.0],
        [sh * cp, -sp, ch * cp, 0.0],
        [0.0, 0.0, 0.0, 1.0],
    ])


def rotation2d(ang):
    """The 2x2 rotation by ``ang`` radians."""
    ca, sa = cos(ang), sin(ang)
    return mat2([[ca, -sa], [sa, ca]])


def rotation3d(ang_x, ang_y, ang_z):
    """The 4x4 rotation ``rot_yaw_pitch_roll(ang_z, ang_x, ang_y)``."""
    return rot_yaw_pitch_roll(ang_z, ang_x, ang_y)


def vdir(ang):
    """The unit 2-vector at angle ``ang``."""
    return vec2(cos(ang), sin(ang))


def isnan(x):
    """1 where ``x`` (as the default float type) is NaN, else 0."""
    fx = _float(x)
    return fx != fx


def isinf(x):
    """1 where ``x`` (as the default float type) is +-infinity, else 0."""
    fx = _float(x)
    return _ops.abs(fx) == inf


from .frontend.decorators import func as _func  # noqa: E402


@_func
def _refract(x, n, eta):
    # A runtime branch, as in Taichi: under a select, sqrt of the negative k would still be
    # differentiated (0 * NaN) on the reverse pass.
    dxn = x.dot(n)
    result = x * 0
    k = 1.0 - eta * eta * (1.0 - dxn * dxn)
    if k >= 0.0:
        result = eta * x - (eta * dxn + sqrt(k)) * n
    return result


# ---------------------------------------------------------------- complex numbers as 2-vectors
# Taichi's ti.math complex helpers: z = vec2(real, imaginary); the multivalued ones (csqrt,
# cpow, clog) take the principal branch, arg z in (-pi, pi] (atan2), and map 0 to 0.


def cmul(z1, z2):
    """The complex product ``z1 * z2``."""
    return vec2(z1[0] * z2[0] - z1[1] * z2[1], z1[0] * z2[1] + z1[1] * z2[0])


def cconj(z):
    """The complex conjugate of ``z``."""
    return vec2(z[0], -z[1])


def cdiv(z1, z2):
    """The complex quotient ``z1 / z2``."""
    return cmul(z1, cconj(z2)) / z2.dot(z2)


def cinv(z):
    """The complex reciprocal ``1 / z``."""
    return cconj(z) / z.dot(z)


def cexp(z):
    """``e ** z``."""
    return exp(z[0]) * vec2(cos(z[1]), sin(z[1]))


def clog(z):
    """The principal logarithm of ``z``: ``(log |z|, arg z)``."""
    return vec2(log(z.norm()), atan2(z[1], z[0]))


@_func
def cpow(z, n):
    """``z ** n`` for a real exponent ``n`` (principal branch; ``0 ** n`` is 0)."""
    result = vec2(0.0, 0.0)
    if z[0] != 0.0 or z[1] != 0.0:
        r = pow(z.norm(), n)
        angle = atan2(z[1], z[0]) * n
        result = r * vec2(cos(angle), sin(angle))
    return result


@_func
def csqrt(z):
    """The principal square root of ``z`` (``sqrt(0)`` is 0)."""
    result = vec2(0.0, 0.0)
    if z[0] != 0.0 or z[1] != 0.0:
        r = sqrt(z.norm())
        angle = atan2(z[1], z[0]) * 0.5
        result = r * vec2(cos(angle), sin(angle))
    return result
