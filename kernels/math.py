"""``ti.math``: vector/matrix types and math functions usable in kernels and Python scope."""

from __future__ import annotations

import math as _m

from .frontend.matrix import MatrixType
from .frontend.ops import (  # noqa: F401 - re-exported API
    acos,
    asin,
    atan,
    atan2,
    ceil,
    clamp,
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

vec2, vec3, vec4 = (MatrixType(n, 1, 1, float) for n in (2, 3, 4))
ivec2, ivec3, ivec4 = (MatrixType(n, 1, 1, int) for n in (2, 3, 4))
mat2, mat3, mat4 = (MatrixType(n, n, 2, float) for n in (2, 3, 4))


def sign(x):
    """-1, 0 or 1 with the type of ``x``."""
    from .frontend import ops

    return ops.binary("sub", ops.binary("gt", x, 0), ops.binary("lt", x, 0)) \
        if not isinstance(x, int | float) else (x > 0) - (x < 0)


def length(v):
    return v.norm()


def normalize(v):
    return v.normalized()


def dot(a, b):
    return a.dot(b)


def cross(a, b):
    return a.cross(b)


def mix(x, y, a):
    return x * (1 - a) + y * a


def fract(x):
    return x - floor(x)


def step(edge, x):
    from .frontend import ops

    return ops.cast(ops.binary("ge", x, edge), float) if not isinstance(x, int | float) \
        else float(x >= edge)


def smoothstep(edge0, edge1, x):
    t = clamp((x - edge0) / (edge1 - edge0), 0.0, 1.0)
    return t * t * (3.0 - 2.0 * t)


def log2(x):
    return log(x) / _m.log(2.0)


def exp2(x):
    return exp(x * _m.log(2.0))


def degrees(x):
    return x * (180.0 / _m.pi)


def radians(x):
    return x * (_m.pi / 180.0)
