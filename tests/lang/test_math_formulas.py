"""``ti.math`` functions and the eps-taking vector methods follow Taichi's formulas exactly.

Each result is compared with the formula Taichi documents and implements
(python/taichi/math/mathimpl.py, python/taichi/lang/matrix_ops.py), evaluated in NumPy float64;
the functions run inside kernels, where Taichi defines them.
"""

import numpy as np
import pytest

from tests.conftest import tol


def _rng():
    return np.random.default_rng(1234)


def test_norm_normalized_and_norm_inv_with_eps(ti, fp, npfp):
    """normalized(eps) is v / (|v| + eps): eps guards the length, not the squared length."""
    n = 64
    v = ti.Vector.field(3, float, shape=n)
    out_n = ti.Vector.field(3, float, shape=n)
    out_n0 = ti.Vector.field(3, float, shape=n)
    norms = ti.field(float, shape=(n, 4))

    @ti.kernel
    def run(eps: float):
        for i in v:
            out_n[i] = v[i].normalized(eps)
            out_n0[i] = v[i].normalized()
            norms[i, 0] = v[i].norm(eps)
            norms[i, 1] = v[i].norm_inv(eps)
            norms[i, 2] = v[i].norm()
            norms[i, 3] = v[i].norm_sqr()

    rng = _rng()
    vs = rng.normal(size=(n, 3)) * rng.uniform(0.02, 2.0, size=(n, 1))
    v.from_numpy(vs.astype(npfp))
    eps = 1e-2
    run(eps)
    x = vs.astype(npfp).astype(np.float64)
    length = np.linalg.norm(x, axis=1, keepdims=True)
    r = 8 * tol(fp)
    np.testing.assert_allclose(out_n.to_numpy(), x / (length + eps), rtol=r, atol=r)
    np.testing.assert_allclose(out_n0.to_numpy(), x / length, rtol=r, atol=r)
    got = norms.to_numpy()
    np.testing.assert_allclose(got[:, 0], np.sqrt(length[:, 0] ** 2 + eps), rtol=r)
    np.testing.assert_allclose(got[:, 1], 1 / np.sqrt(length[:, 0] ** 2 + eps), rtol=r)
    np.testing.assert_allclose(got[:, 2], length[:, 0], rtol=r)
    np.testing.assert_allclose(got[:, 3], length[:, 0] ** 2, rtol=r)


SCALAR = {
    # name: NumPy formula over a, b, c (the kernel below computes the same, in this order)
    "clamp": lambda a, b, c: np.minimum(b + c, np.maximum(b, a)),
    "mix": lambda a, b, c: a * (1.0 - c) + b * c,
    "step": lambda a, b, c: (a >= b).astype(np.float64),
    "fract": lambda a, b, c: a - np.floor(a),
    "smoothstep": lambda a, b, c: (lambda t: t * t * (3.0 - 2.0 * t))(
        np.clip((a - b) / c, 0.0, 1.0)),
    "sign": lambda a, b, c: np.sign(a),
    "log2": lambda a, b, c: np.log2(c),
    "degrees": lambda a, b, c: np.degrees(a),
    "radians": lambda a, b, c: np.radians(a),
    "mod": lambda a, b, c: a - b * np.floor(a / b),
}


def test_scalar_math_functions_follow_taichi_formulas(ti, fp, npfp):
    n = 200
    a_ = ti.field(float, shape=n)
    b_ = ti.field(float, shape=n)
    c_ = ti.field(float, shape=n)
    out = ti.field(float, shape=(len(SCALAR), n))

    @ti.kernel
    def run():
        for i in a_:
            a, b, c = a_[i], b_[i], c_[i]
            out[0, i] = ti.math.clamp(a, b, b + c)
            out[1, i] = ti.math.mix(a, b, c)
            out[2, i] = ti.math.step(b, a)
            out[3, i] = ti.math.fract(a)
            out[4, i] = ti.math.smoothstep(b, b + c, a)
            out[5, i] = ti.math.sign(a)
            out[6, i] = ti.math.log2(c)
            out[7, i] = ti.math.degrees(a)
            out[8, i] = ti.math.radians(a)
            out[9, i] = ti.math.mod(a, b)

    rng = _rng()
    av = rng.uniform(-4, 4, size=n)
    av[:8] = [0.0, -0.0, 1.0, -1.0, 2.0, -2.5, 0.5, 3.0]  # ties and exact values
    bv = rng.uniform(-2, 2, size=n)
    bv[:8] = [0.5, 0.0, 1.0, -1.0, 1.5, -2.5, 0.25, 3.0]  # a == b: step's and clamp's edges
    cv = rng.uniform(0.1, 3, size=n)
    arrays = [x.astype(npfp) for x in (av, bv, cv)]
    for f, arr in zip((a_, b_, c_), arrays, strict=True):
        f.from_numpy(arr)
    run()
    got = out.to_numpy()
    args = [x.astype(np.float64) for x in arrays]
    r = 8 * tol(fp)
    for k, (name, reference) in enumerate(SCALAR.items()):
        np.testing.assert_allclose(got[k], reference(*args), rtol=r, atol=r, err_msg=name)


def test_sign_of_an_integer_is_a_float(ti, fp):
    @ti.kernel
    def run(x: ti.i32) -> float:
        return ti.math.sign(x) + 0.25

    assert [run(v) for v in (-7, 0, 3)] == [-0.75, 0.25, 1.25]


def test_vector_math_functions(ti, fp, npfp):
    n = 32
    x = ti.Vector.field(3, float, shape=n)
    y = ti.Vector.field(3, float, shape=n)
    eta = ti.field(float, shape=n)
    refl = ti.Vector.field(3, float, shape=n)
    refr = ti.Vector.field(3, float, shape=n)
    nrm = ti.Vector.field(3, float, shape=n)
    crs = ti.Vector.field(3, float, shape=n)
    scal = ti.field(float, shape=(n, 3))

    @ti.kernel
    def run():
        for i in x:
            unit = y[i].normalized()
            refl[i] = ti.math.reflect(x[i], unit)
            refr[i] = ti.math.refract(x[i], unit, eta[i])
            nrm[i] = ti.math.normalize(x[i])
            crs[i] = ti.math.cross(x[i], y[i])
            scal[i, 0] = ti.math.distance(x[i], y[i])
            scal[i, 1] = ti.math.length(x[i])
            scal[i, 2] = ti.math.dot(x[i], y[i])

    rng = _rng()
    xv, yv = rng.normal(size=(n, 3)), rng.normal(size=(n, 3))
    xv = xv / np.linalg.norm(xv, axis=1, keepdims=True)
    etas = rng.uniform(0.5, 2.5, size=n)  # some rays are totally reflected (result 0)
    x.from_numpy(xv.astype(npfp))
    y.from_numpy(yv.astype(npfp))
    eta.from_numpy(etas.astype(npfp))
    run()
    X, Y, E = (v.astype(npfp).astype(np.float64) for v in (xv, yv, etas))
    U = Y / np.linalg.norm(Y, axis=1, keepdims=True)
    dxn = np.sum(X * U, axis=1, keepdims=True)
    k = 1.0 - E[:, None] ** 2 * (1.0 - dxn**2)
    refr_want = np.where(k >= 0, E[:, None] * X - (E[:, None] * dxn + np.sqrt(np.maximum(k, 0)))
                         * U, 0.0)
    assert 0 < np.sum(k < 0) < n  # both branches are exercised
    r = 16 * tol(fp)
    np.testing.assert_allclose(refl.to_numpy(), X - 2.0 * dxn * U, rtol=r, atol=r)
    np.testing.assert_allclose(refr.to_numpy(), refr_want, rtol=r, atol=r)
    np.testing.assert_allclose(nrm.to_numpy(), X / np.linalg.norm(X, axis=1, keepdims=True),
                               rtol=r, atol=r)
    np.testing.assert_allclose(crs.to_numpy(), np.cross(X, Y), rtol=r, atol=r)
    got = scal.to_numpy()
    np.testing.assert_allclose(got[:, 0], np.linalg.norm(X - Y, axis=1), rtol=r)
    np.testing.assert_allclose(got[:, 1], np.linalg.norm(X, axis=1), rtol=r)
    np.testing.assert_allclose(got[:, 2], np.sum(X * Y, axis=1), rtol=r, atol=r)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_determinant_and_inverse(ti, fp, npfp, size):
    n = 16
    m = ti.Matrix.field(size, size, float, shape=n)
    inv = ti.Matrix.field(size, size, float, shape=n)
    det = ti.field(float, shape=n)

    @ti.kernel
    def run():
        for i in m:
            inv[i] = ti.math.inverse(m[i])
            det[i] = ti.math.determinant(m[i])

    rng = _rng()
    mats = rng.normal(size=(n, size, size)) + 3 * np.eye(size)
    m.from_numpy(mats.astype(npfp))
    run()
    A = mats.astype(npfp).astype(np.float64)
    r = 64 * tol(fp)
    np.testing.assert_allclose(det.to_numpy(), np.linalg.det(A), rtol=r)
    np.testing.assert_allclose(inv.to_numpy().reshape(A.shape), np.linalg.inv(A), rtol=r, atol=r)


def test_transform_matrices(ti, fp, npfp):
    out4 = ti.Matrix.field(4, 4, float, shape=6)
    out2 = ti.Matrix.field(2, 2, float, shape=1)
    out3 = ti.Matrix.field(3, 3, float, shape=1)
    vd = ti.Vector.field(2, float, shape=1)

    @ti.kernel
    def run(a: float, b: float, c: float):
        out4[0] = ti.math.translate(a, b, c)
        out4[1] = ti.math.scale(a, b, c)
        out4[2] = ti.math.rot_by_axis(ti.math.vec3(a, b, c), 0.7)
        out4[3] = ti.math.rot_yaw_pitch_roll(a, b, c)
        out4[4] = ti.math.rotation3d(a, b, c)
        out4[5] = ti.math.eye(4)
        out2[0] = ti.math.rotation2d(a)
        out3[0] = ti.math.eye(3)
        vd[0] = ti.math.vdir(b)

    a, b, c = 0.3, -1.1, 2.0
    run(a, b, c)
    a, b, c = (float(npfp(v)) for v in (a, b, c))
    r = 16 * tol(fp)
    got = out4.to_numpy()
    t = np.eye(4)
    t[:3, 3] = [a, b, c]
    np.testing.assert_allclose(got[0], t, rtol=r, atol=r)
    np.testing.assert_allclose(got[1], np.diag([a, b, c, 1.0]), rtol=r, atol=r)
    # Rodrigues' rotation about the unit axis, in Taichi's (row-vector) convention: R^T
    axis = np.array([a, b, c]) / np.linalg.norm([a, b, c])
    ang = float(npfp(0.7))
    K = np.array([[0, -axis[2], axis[1]], [axis[2], 0, -axis[0]], [-axis[1], axis[0], 0]])
    R = np.eye(3) + np.sin(ang) * K + (1 - np.cos(ang)) * K @ K
    want = np.eye(4)
    want[:3, :3] = R.T
    np.testing.assert_allclose(got[2], want, rtol=r, atol=r)

    def ypr(yaw, pitch, roll):
        ch, sh, cp, sp, cb, sb = (np.cos(yaw), np.sin(yaw), np.cos(pitch), np.sin(pitch),
                                  np.cos(roll), np.sin(roll))
        return np.array([[ch * cb + sh * sp * sb, sb * cp, -sh * cb + ch * sp * sb, 0],
                         [-ch * sb + sh * sp * cb, cb * cp, sb * sh + ch * sp * cb, 0],
                         [sh * cp, -sp, ch * cp, 0], [0, 0, 0, 1]])

    np.testing.assert_allclose(got[3], ypr(a, b, c), rtol=r, atol=r)
    np.testing.assert_allclose(got[4], ypr(c, a, b), rtol=r, atol=r)
    np.testing.assert_allclose(got[5], np.eye(4))
    np.testing.assert_allclose(out2.to_numpy()[0], [[np.cos(a), -np.sin(a)],
                                                    [np.sin(a), np.cos(a)]], rtol=r, atol=r)
    np.testing.assert_allclose(out3.to_numpy()[0], np.eye(3))
    np.testing.assert_allclose(vd.to_numpy()[0], [np.cos(b), np.sin(b)], rtol=r, atol=r)


def test_isnan_isinf(ti, fp, npfp):
    values = np.array([0.0, 1.5, -np.inf, np.inf, np.nan, -2.0], dtype=npfp)
    x = ti.field(float, shape=len(values))
    out = ti.field(ti.i32, shape=(len(values), 2))

    @ti.kernel
    def run():
        for i in x:
            out[i, 0] = ti.math.isnan(x[i])
            out[i, 1] = ti.math.isinf(x[i])

    x.from_numpy(values)
    run()
    np.testing.assert_array_equal(out.to_numpy()[:, 0], np.isnan(values))
    np.testing.assert_array_equal(out.to_numpy()[:, 1], np.isinf(values))


def test_vector_types_follow_the_defaults(backend):
    ti = backend
    ti.init(arch=ti.cpu, default_fp=ti.f64, default_ip=ti.i64)
    try:
        assert ti.math.vec3.dtype == ti.f64
        assert ti.math.ivec2.dtype == ti.i64
        assert ti.math.uvec2.dtype == ti.u64
        ti.init(arch=ti.cpu)
        assert ti.math.uvec4.dtype == ti.u32
        assert ti.math.mat2.dtype == ti.f32
    finally:
        ti.reset()


def test_refract_gradient_is_finite_under_total_internal_reflection(ti):
    """Taichi branches on k >= 0: the sqrt of a negative k is never differentiated."""
    x = ti.Vector.field(2, ti.f32, shape=2, needs_grad=True)
    loss = ti.field(ti.f32, shape=(), needs_grad=True)

    @ti.kernel
    def run():
        for i in x:
            r = ti.math.refract(x[i], ti.math.vec2(0.0, 1.0), 1.5)
            loss[None] += r.sum()

    c = np.cos(0.3)
    x.from_numpy(np.array([[0.0, -1.0], [c, -np.sqrt(1 - c * c)]], dtype=np.float32))
    with ti.ad.Tape(loss):
        run()
    g = x.grad.to_numpy()
    assert np.all(np.isfinite(g))
    np.testing.assert_array_equal(g[1], [0.0, 0.0])  # totally reflected: refract is 0
    # ray 0 along -n: r = eta * x - (eta * dxn + sqrt(k)) * n with dxn = -1, k = 1
    # d(sum r)/dx = eta * (1, 1) - (eta + eta^2 dxn / sqrt(k)) * n_y * n
    np.testing.assert_allclose(g[0], [1.5, 1.5 - (1.5 - 2.25)], rtol=1e-6)
