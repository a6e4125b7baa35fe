"""ti.Vector / ti.Matrix / ti.math vector types: construction, indexing and linear algebra."""

import numpy as np
import pytest


def _rand(shape, seed=0):
    return np.random.default_rng(seed).uniform(-1.0, 1.0, shape)


def test_vector_construction_indexing_and_components(ti, fp, rtol):
    out = ti.Vector.field(4, float, shape=3)

    @ti.kernel
    def run(a: float, b: float):
        v = ti.Vector([a, b, a + b, a * b])
        out[0] = v
        out[1] = ti.Vector([v.x, v.y, v.z, v.w]) * 2
        w = ti.math.vec4(0.0)
        w[0] = v[3]
        w.y = v[2]
        w.z = v.y
        w[3] = v[0]
        out[2] = w

    run(1.5, -0.25)
    v = np.array([1.5, -0.25, 1.25, -0.375])
    np.testing.assert_allclose(out.to_numpy(), [v, 2 * v, v[::-1]], rtol=rtol)


def test_math_vector_and_matrix_types(ti, fp, rtol):
    out_v = ti.Vector.field(4, float, shape=4)
    out_m = ti.Matrix.field(4, 4, float, shape=3)

    @ti.kernel
    def run():
        out_v[0] = ti.math.vec4(ti.math.vec2(1, 2), 3, 4)
        out_v[1] = ti.math.vec4(ti.math.vec3(5, 6, 7), 8)
        out_v[2] = ti.math.vec4(2.5)
        out_v[3] = ti.math.vec4(ti.math.vec3(1.0).x, 0, 0, 1)
        m2 = ti.math.mat2([[1, 2], [3, 4]])
        m3 = ti.math.mat3([[1, 2, 3], [4, 5, 6], [7, 8, 10]])
        m4 = ti.math.mat4(0.0)
        for i in ti.static(range(2)):
            for j in ti.static(range(2)):
                m4[i, j] = m2[i, j]
        out_m[0] = m4
        for i, j in ti.static(ti.ndrange(3, 3)):
            m4[i, j] = m3[i, j]
        out_m[1] = m4
        out_m[2] = ti.math.mat4(1.0)

    run()
    np.testing.assert_allclose(
        out_v.to_numpy(), [[1, 2, 3, 4], [5, 6, 7, 8], [2.5] * 4, [1, 0, 0, 1]], rtol=rtol
    )
    m = out_m.to_numpy()
    want0 = np.zeros((4, 4))
    want0[:2, :2] = [[1, 2], [3, 4]]
    want1 = want0.copy()
    want1[:3, :3] = [[1, 2, 3], [4, 5, 6], [7, 8, 10]]
    np.testing.assert_allclose(m[0], want0, rtol=rtol)
    np.testing.assert_allclose(m[1], want1, rtol=rtol)
    np.testing.assert_allclose(m[2], np.ones((4, 4)), rtol=rtol)


def test_matrix_indexing_with_runtime_indices(ti, fp, rtol):
    a = ti.Matrix.field(3, 3, float, shape=())
    out = ti.field(float, shape=(3, 3))

    @ti.kernel
    def run():
        m = a[None]
        for i, j in ti.ndrange(3, 3):
            out[i, j] = m[i, j] * 10 + m[j, i]

    a_np = _rand((3, 3))
    a.from_numpy(a_np)
    run()
    np.testing.assert_allclose(out.to_numpy(), a_np * 10 + a_np.T, rtol=rtol, atol=rtol)


def test_matrix_indexed_by_a_vector_of_indices(ti):
    """m[I] with I a vector of two indices is m[I[0], I[1]], as for fields (Taichi flattens
    vector indices; its test_static_grouped_static): compile-time I from a ti.static grouped
    ndrange, and runtime I from a grouped loop. It was refused as one index of a matrix."""
    x = ti.Matrix.field(2, 3, dtype=ti.f32, shape=(16, 4))
    y = ti.field(ti.f32, shape=(2, 3))

    @ti.kernel
    def static_grouped():
        for i, j in ti.ndrange(16, 4):
            for ij in ti.static(ti.grouped(ti.ndrange(2, 3))):
                x[i, j][ij] = ij[0] + ij[1] * 10 + i + j * 4

    @ti.kernel
    def runtime_grouped():
        m = ti.Matrix([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
        for ij in ti.grouped(ti.ndrange(2, 3)):
            y[ij] = m[ij] * 10 + x[3, 1][ij]

    static_grouped()
    row, col = np.meshgrid(np.arange(2), np.arange(3), indexing="ij")
    i, j = np.arange(16)[:, None, None, None], np.arange(4)[None, :, None, None]
    want = row + col * 10 + i + j * 4
    np.testing.assert_array_equal(x.to_numpy(), want)
    runtime_grouped()
    np.testing.assert_array_equal(y.to_numpy(), np.arange(1, 7).reshape(2, 3) * 10 + want[3, 1])


def test_matmul_transpose_and_elementwise(ti, fp, rtol):
    a = ti.Matrix.field(3, 2, float, shape=())
    b = ti.Matrix.field(2, 4, float, shape=())
    v = ti.Vector.field(2, float, shape=())
    prod = ti.Matrix.field(3, 4, float, shape=())
    at = ti.Matrix.field(2, 3, float, shape=())
    av = ti.Vector.field(3, float, shape=())
    ew = ti.Matrix.field(3, 2, float, shape=5)

    @ti.kernel
    def run():
        prod[None] = a[None] @ b[None]
        at[None] = a[None].transpose()
        av[None] = a[None] @ v[None]
        m = a[None]
        ew[0] = m * 2 + 1
        ew[1] = m + m * m
        ew[2] = -m - 0.5
        ew[3] = abs(m) / 4
        ew[4] = ti.sin(m) + ti.exp(m) ** 2

    a_np, b_np, v_np = _rand((3, 2), 1), _rand((2, 4), 2), _rand(2, 3)
    a.from_numpy(a_np)
    b.from_numpy(b_np)
    v.from_numpy(v_np)
    run()
    np.testing.assert_allclose(prod.to_numpy(), a_np @ b_np, rtol=rtol, atol=rtol)
    np.testing.assert_allclose(at.to_numpy(), a_np.T, rtol=rtol)
    np.testing.assert_allclose(av.to_numpy(), a_np @ v_np, rtol=rtol, atol=rtol)
    want = [
        a_np * 2 + 1,
        a_np + a_np * a_np,
        -a_np - 0.5,
        np.abs(a_np) / 4,
        np.sin(a_np) + np.exp(a_np) ** 2,
    ]
    np.testing.assert_allclose(ew.to_numpy(), want, rtol=10 * rtol, atol=rtol)


def test_vector_products_and_norms(ti, fp, rtol):
    a = ti.Vector.field(3, float, shape=())
    b = ti.Vector.field(3, float, shape=())
    scalars = ti.field(float, shape=5)
    cross = ti.Vector.field(3, float, shape=())
    unit = ti.Vector.field(3, float, shape=())
    outer = ti.Matrix.field(3, 3, float, shape=())

    @ti.kernel
    def run():
        u, w = a[None], b[None]
        scalars[0] = u.dot(w)
        scalars[1] = u.norm()
        scalars[2] = u.norm(1e-3)
        scalars[3] = u.norm_sqr()
        scalars[4] = ti.Vector([u.x, u.y]).cross(ti.Vector([w.x, w.y]))
        cross[None] = u.cross(w)
        unit[None] = u.normalized()
        outer[None] = u.outer_product(w)

    a_np, b_np = np.array([0.3, -1.2, 2.0]), np.array([1.5, 0.25, -0.75])
    a.from_numpy(a_np)
    b.from_numpy(b_np)
    run()
    want = [
        a_np @ b_np,
        np.linalg.norm(a_np),
        np.sqrt(a_np @ a_np + 1e-3),
        a_np @ a_np,
        a_np[0] * b_np[1] - a_np[1] * b_np[0],
    ]
    np.testing.assert_allclose(scalars.to_numpy(), want, rtol=rtol)
    np.testing.assert_allclose(cross.to_numpy(), np.cross(a_np, b_np), rtol=rtol)
    np.testing.assert_allclose(unit.to_numpy(), a_np / np.linalg.norm(a_np), rtol=rtol)
    np.testing.assert_allclose(outer.to_numpy(), np.outer(a_np, b_np), rtol=rtol)


def test_determinant_inverse_trace(ti, fp, rtol):
    m2 = ti.Matrix.field(2, 2, float, shape=())
    m3 = ti.Matrix.field(3, 3, float, shape=())
    m4 = ti.Matrix.field(4, 4, float, shape=())
    dets = ti.field(float, shape=3)
    traces = ti.field(float, shape=3)
    inv2 = ti.Matrix.field(2, 2, float, shape=())
    inv3 = ti.Matrix.field(3, 3, float, shape=())
    inv4 = ti.Matrix.field(4, 4, float, shape=())

    @ti.kernel
    def run():
        dets[0] = m2[None].determinant()
        dets[1] = m3[None].determinant()
        dets[2] = m4[None].determinant()
        traces[0] = m2[None].trace()
        traces[1] = m3[None].trace()
        traces[2] = m4[None].trace()
        inv2[None] = m2[None].inverse()
        inv3[None] = m3[None].inverse()
        inv4[None] = m4[None].inverse()

    # well-conditioned inputs: identity plus a perturbation
    mats = [np.eye(n) * 2 + _rand((n, n), n) for n in (2, 3, 4)]
    for field, value in zip((m2, m3, m4), mats, strict=True):
        field.from_numpy(value)
    run()
    loose = 100 * rtol
    np.testing.assert_allclose(dets.to_numpy(), [np.linalg.det(m) for m in mats], rtol=loose)
    np.testing.assert_allclose(traces.to_numpy(), [np.trace(m) for m in mats], rtol=rtol)
    for field, value in zip((inv2, inv3, inv4), mats, strict=True):
        np.testing.assert_allclose(field.to_numpy(), np.linalg.inv(value), rtol=loose, atol=loose)


def test_diag_identity_zero(ti, fp, rtol):
    out = ti.Matrix.field(3, 3, float, shape=3)
    z = ti.Matrix.field(2, 3, float, shape=())

    @ti.kernel
    def run(s: float):
        out[0] = ti.Matrix.diag(3, s)
        out[1] = ti.Matrix.identity(float, 3) * 2 + ti.Matrix.diag(3, 1.0)
        out[2] = ti.Matrix.zero(float, 3, 3) + 7
        z[None] = ti.Matrix.zero(float, 2, 3)

    z.from_numpy(np.ones((2, 3)))
    run(-1.5)
    np.testing.assert_allclose(
        out.to_numpy(), [np.eye(3) * -1.5, np.eye(3) * 3, np.full((3, 3), 7)]
    )
    np.testing.assert_array_equal(z.to_numpy(), np.zeros((2, 3)))


def test_vector_and_matrix_fields_layout(ti, fp, npfp, rtol):
    n = 6
    pos = ti.Vector.field(3, float, shape=n)
    mats = ti.Matrix.field(2, 2, float, shape=(2, n))
    assert pos.shape == (n,) and mats.shape == (2, n)
    assert pos.n == 3 and mats.n == 2 and mats.m == 2

    @ti.kernel
    def run():
        for i in pos:
            pos[i] = ti.Vector([i, i * 2, i * 3]) * 0.5
        for k, i in mats:
            mats[k, i] = ti.Matrix([[i, k], [-k, i + 1.0]])

    run()
    p = pos.to_numpy()
    assert p.shape == (n, 3) and p.dtype == npfp
    i = np.arange(n)
    np.testing.assert_allclose(p, np.stack([i, 2 * i, 3 * i], 1) * 0.5, rtol=rtol)
    m = mats.to_numpy()
    assert m.shape == (2, n, 2, 2)
    for k in range(2):
        for j in range(n):
            np.testing.assert_allclose(m[k, j], [[j, k], [-k, j + 1.0]], rtol=rtol)


def test_vector_field_python_scope_access(ti):
    v = ti.Vector.field(3, ti.i32, shape=4)
    m = ti.Matrix.field(2, 2, ti.i32, shape=2)
    v[1] = [1, 2, 3]
    v[2][0] = 9
    m[0] = [[1, 2], [3, 4]]
    m[1][0, 1] = 7
    assert list(v[1]) == [1, 2, 3]
    assert v[1][2] == 3 and v[2][0] == 9
    assert m[0][1, 0] == 3 and m[1][0, 1] == 7
    want_v = np.zeros((4, 3), dtype=np.int32)
    want_v[1] = [1, 2, 3]
    want_v[2, 0] = 9
    np.testing.assert_array_equal(v.to_numpy(), want_v)
    np.testing.assert_array_equal(m.to_numpy(), [[[1, 2], [3, 4]], [[0, 7], [0, 0]]])


def test_kernel_returns_vector_and_matrix(ti, fp, rtol):
    @ti.kernel
    def vec(a: float) -> ti.types.vector(3, float):
        return ti.Vector([a, a * 2, a * 3])

    @ti.kernel
    def mat(a: float) -> ti.types.matrix(2, 2, float):
        return ti.Matrix([[a, 1.0], [2.0, a * a]])

    np.testing.assert_allclose(np.asarray(vec(1.5)), [1.5, 3.0, 4.5], rtol=rtol)
    np.testing.assert_allclose(np.asarray(mat(3.0)), [[3.0, 1.0], [2.0, 9.0]], rtol=rtol)


def test_any_and_all_of_vectors_and_matrices(ti, fp):
    out = ti.Vector.field(4, ti.i32, shape=4)

    @ti.kernel
    def run(x: float, k: ti.i32):
        z = ti.Matrix([[0.0, 0.0], [0.0, 0.0]]) * x
        m = ti.Matrix([[3.0, x], [1.0, 2.0]])
        v = ti.Vector([k, 1, 2])
        c = ti.Matrix([[0, 0], [0, 0]])  # compile-time constants
        out[0] = ti.Vector([any(z), all(z), any(m), all(m)])
        out[1] = ti.Vector([z.any(), z.all(), m.any(), m.all()])
        out[2] = ti.Vector([any(v), all(v), v.any(), v.all()])
        out[3] = ti.Vector([any(c), all(c), c.any(), c.all()])

    for x, k in [(1.5, 0), (0.0, 3), (-2.0, -1)]:
        run(x, k)
        want = [[0, 0, 1, int(x != 0)], [0, 0, 1, int(x != 0)], [1, int(k != 0)] * 2,
                [0, 0, 0, 0]]
        np.testing.assert_array_equal(out.to_numpy(), want)


@pytest.mark.difftape_only  # Taichi 1.7.4 refuses any()/all() of a list ("not tensor type")
def test_any_and_all_of_a_list_of_runtime_conditions(ti):
    @ti.kernel
    def run(x: ti.i32) -> ti.types.vector(4, ti.i32):
        return ti.Vector([any([x > 0, x > 5]), all((x > 0, x > 5)), any([0, 0]), all([1, 2])])

    for x in (-1, 1, 6):
        np.testing.assert_array_equal(run(x), [x > 0, x > 5, 0, 1])


def test_swizzles_read_and_write(ti):
    out = ti.Vector.field(4, ti.i32, shape=4)

    @ti.kernel
    def run():
        v = ti.Vector([1, 2, 3])
        out[0] = ti.math.ivec4(v.zxy, v.x)
        v.brg += 10            # b, r, g: entries 2, 0, 1
        v.xy = v.yx            # the right side is read before the write: a swap
        out[1] = ti.math.ivec4(v, v.s)
        w = ti.math.ivec4(0)
        w.wz = [7, 8]
        w.x += v.z
        out[2] = w
        out[3] = ti.math.ivec4(v.stp.zy, v.rgb.xx)

    run()
    np.testing.assert_array_equal(out.to_numpy(), [[3, 1, 2, 1], [12, 11, 13, 12],
                                                   [13, 0, 8, 7], [13, 11, 12, 12]])
    # Python scope too; naming a component the vector lacks is a syntax error, as in Taichi.
    v = ti.math.vec3(1, 2, 3)
    np.testing.assert_allclose(v.zyx.to_numpy(), [3, 2, 1])
    v.rg = (5, 6)
    np.testing.assert_allclose(v.to_numpy(), [5, 6, 3])
    with pytest.raises(ti.TaichiSyntaxError, match=r"only has attributes"):
        ti.math.vec2(1, 2).xyz = [1, 2, 3]


def test_bitwise_operators_on_integer_vectors(ti):
    out = ti.Vector.field(3, ti.i32, shape=7)

    @ti.kernel
    def run(a: ti.types.vector(3, ti.i32), b: ti.types.vector(3, ti.i32)):
        out[0], out[1], out[2] = a & b, a | b, a ^ b
        out[3], out[4], out[5] = ~a, a << 2, b >> 1
        c = a
        c |= 8
        c <<= b
        out[6] = c

    a, b = np.array([1, 6, 12]), np.array([3, 5, 2])
    run(ti.Vector(list(a)), ti.Vector(list(b)))
    want = [a & b, a | b, a ^ b, ~a, a << 2, b >> 1, (a | 8) << b]
    np.testing.assert_array_equal(out.to_numpy(), want)
    np.testing.assert_array_equal((ti.Vector([1, 6]) ^ ti.Vector([3, 3])).to_numpy(), [2, 5])


def test_runtime_indexed_augmented_assignment_of_local_vectors_and_matrices(ti):
    out = ti.Vector.field(3, ti.i32, shape=())
    mat = ti.Matrix.field(2, 2, ti.i32, shape=())

    @ti.kernel
    def run(k: ti.i32):
        v = ti.Vector([10, 20, 30])
        m = ti.Matrix([[1, 2], [3, 4]])
        for j in range(3):
            v[(k + j) % 3] += j + 1
        for i, j in ti.ndrange(2, 2):
            m[i, j] *= i * 2 + j + 1
        m[k % 2, 1 - k % 2] -= 100
        out[None] = v
        mat[None] = m

    run(1)
    np.testing.assert_array_equal(out[None].to_numpy(), [13, 21, 32])
    np.testing.assert_array_equal(mat[None].to_numpy(), [[1, 4], [-91, 16]])


def test_a_vector_of_mixed_types_has_their_promoted_type(ti):
    """``ti.Vector([i64, u32, i32])`` is one i64 vector (Taichi promotes the entries, numbers
    as default_ip/default_fp), so a runtime index reads -5 as -5, and ``[1, 2.5]`` is a float
    vector that keeps 2.7 written into its first entry. difftape kept each entry's own type: the
    runtime-index select chain promoted i32 and u32 to u32 (-5 read as 4294967291), and the
    first entry of ``[1, 2.5]`` was an i32 that truncated 2.7 to 2."""
    a = ti.field(ti.i32, shape=())
    u = ti.field(ti.u32, shape=())
    big = ti.field(ti.i64, shape=())
    out = ti.field(ti.i64, shape=3)
    fout = ti.field(ti.f32, shape=3)
    a[None], u[None], big[None] = -5, 7, 2**33

    @ti.kernel
    def run(j: ti.i32):
        v = ti.Vector([big[None], u[None], a[None]])
        out[0] = v[j]
        out[1] = v[2] ^ big[None]
        m = ti.Matrix([[a[None], u[None]], [big[None], a[None]]])
        out[2] = m[j - 1, j - 2]
        w = ti.Vector([1, 2.5])
        w[0] = 2.7
        fout[0] = w[0]
        fout[1] = ti.Vector([a[None], 0.5])[j - 2] / 2
        x = ti.Vector([a[None], 1.5])
        x[j - 2] = 0.25
        fout[2] = x[0]

    run(2)
    np.testing.assert_array_equal(out.to_numpy(), [-5, -5 ^ 2**33, 2**33])
    np.testing.assert_allclose(fout.to_numpy(), [2.7, -2.5, 0.25], rtol=1e-6)


def test_lists_concatenate_and_repeat_like_python(ti):
    out = ti.field(ti.i32, shape=6)

    @ti.kernel
    def run(x: ti.i32):
        a = [x, 1] + [2]
        b = [0] * 3
        for i in ti.static(range(3)):
            out[i] = a[i]
            out[3 + i] = b[i] + i

    run(5)
    np.testing.assert_array_equal(out.to_numpy(), [5, 1, 2, 0, 1, 2])


def test_numpy_scalar_and_vector_in_python_scope(ti):
    v = np.float64(2.0) + ti.Vector([1.0, 2.0])
    w = np.float32(3.0) * ti.Vector([1.0, 2.0])
    assert isinstance(v, ti.Matrix) and isinstance(w, ti.Matrix)
    np.testing.assert_allclose(v.to_numpy(), [3.0, 4.0])
    np.testing.assert_allclose(w.to_numpy(), [3.0, 6.0])


def test_slices_of_vectors_and_matrices_in_kernels(ti):
    """``v[a:b:c]`` and ``m[rows, cols]`` with compile-time slices read a vector/matrix of the
    entries; with one runtime index (``m[:, j]``) too; slice assignments and ``+=`` write
    them back."""
    b = 6

    @ti.kernel
    def read(j: ti.i32) -> ti.types.matrix(3, 3, ti.i32):
        c = ti.Vector([0, 1, 2, 3, 4, 5, 6])
        a = ti.Matrix([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
        v = c[:b:2]  # 0 2 4
        low = a[1:, :]  # rows 1 and 2
        col = a[:, j]
        return ti.Matrix([[v[0], v[1], v[2]], [low[0, 0], low[1, 2], a[:1, 1:][0, 1]],
                          [col[0], col[1], col[2]]])

    np.testing.assert_array_equal(read(1), [[0, 2, 4], [4, 9, 3], [2, 5, 8]])
    np.testing.assert_array_equal(read(2), [[0, 2, 4], [4, 9, 3], [3, 6, 9]])

    @ti.kernel
    def write(i: ti.i32) -> ti.types.matrix(3, 4, ti.i32):
        mat = ti.Matrix([[1, 1, 1, 1] for _ in range(3)])
        rows = ti.Matrix([[1, 2, 3, 4] for _ in range(2)])
        mat[:2, :] += rows
        mat[i, 1:3] = ti.Vector([7, 8])
        mat[:, 0] = ti.Vector([-1, -2, -3])
        return mat

    want = np.array([[-1, 3, 4, 5], [-2, 3, 4, 5], [-3, 1, 1, 1]])
    for i in range(3):
        expected = want.copy()
        expected[i, 1:3] = [7, 8]
        np.testing.assert_array_equal(write(i), expected)


def test_slices_carry_gradients(ti, fp, rtol):
    x = ti.Vector.field(4, fp, shape=2, needs_grad=True)
    loss = ti.field(fp, shape=(), needs_grad=True)
    xs = np.arange(8.0).reshape(2, 4) / 3
    x.from_numpy(xs)

    @ti.kernel
    def f():
        for i in x:
            v = x[i]
            loss[None] += (v[1:3] * v[:2]).sum()

    with ti.ad.Tape(loss=loss):
        f()
    np.testing.assert_allclose(loss[None], (xs[:, 1:3] * xs[:, :2]).sum(), rtol=rtol)
    grad = np.zeros_like(xs)
    grad[:, 1:3] += xs[:, :2]
    grad[:, :2] += xs[:, 1:3]
    np.testing.assert_allclose(x.grad.to_numpy(), grad, rtol=rtol)


def test_slice_bounds_must_be_compile_time(ti):
    @ti.kernel
    def runtime_bound(i: ti.i32):
        a = ti.Vector([0, 1, 2, 3, 4, 5, 6])
        print(a[i::2])

    with pytest.raises(ti.TaichiCompilationError,
                       match="Taichi does not support variables in slice now"):
        runtime_bound(1)


def test_negative_slice_bounds_are_refused_in_kernels(ti):
    @ti.kernel
    def foo(i: int):
        x = ti.Vector([i, i + 1, i + 2])
        print(x[:-1])

    with pytest.raises(ti.TaichiSyntaxError,
                       match="Negative indices are not supported in Taichi kernels"):
        foo(0)


def test_python_lists_slice_as_in_python_in_kernels(ti):
    """A Python list in a kernel (of fields under ti.static, or of values) is sliced as Python
    slices it, negative bounds and steps included; only vectors' slices refuse them (found by
    the areas fuzzer: ``ti.static([a, b, c][::-1])`` was refused)."""
    fs = [ti.field(ti.i32, shape=2) for _ in range(3)]
    out = ti.field(ti.i32, shape=4)

    @ti.kernel
    def run():
        for q, f in ti.static(enumerate(fs[::-1])):
            f[0] = q + 1
        for f in ti.static(fs[-2:]):
            f[1] = 7
        vals = [10, 20, 30, 40]
        out[0] = vals[::-1][0]
        out[1] = vals[-3:-1][1]
        out[2] = vals[::-2][1]
        out[3] = ti.static([1, 2, 3][:-1])[1]

    run()
    assert [f.to_numpy().tolist() for f in fs] == [[3, 0], [2, 7], [1, 7]]
    np.testing.assert_array_equal(out.to_numpy(), [40, 30, 20, 2])


@pytest.mark.difftape_only
def test_slicing_a_field_in_a_kernel_is_refused(ti):
    x = ti.field(ti.i32, shape=3)

    @ti.kernel
    def foo():
        print(x[:2])

    with pytest.raises(ti.KernelIndexError, match="Slicing is not supported on ti.field"):
        foo()


def test_vector_indexed_with_two_indices_is_refused_once_named(ti):
    """vec[0, 0] in a kernel: refused as an index error saying how many indices a vector
    takes (Taichi's wording), and the kernel line is named once, not twice."""
    @ti.kernel
    def bar() -> ti.i32:
        vec = ti.Vector([1, 2, 3, 4])
        return vec[0, 0]

    with pytest.raises(ti.TaichiCompilationError, match=r"Expected 1 indices, got 2") as e:
        bar()
    if ti.__name__ != "taichi":  # Taichi quotes the line twice
        assert str(e.value).count("return vec[0, 0]") == 1


def test_matrix_indexed_with_three_indices_is_refused(ti):
    """m[0, 1, 0] was read as the row m[0] (the extra indices dropped): refused, read or
    write."""
    @ti.kernel
    def baz() -> ti.i32:
        m = ti.Matrix([[1, 2], [3, 4]])
        return m[0, 1, 0]

    with pytest.raises(ti.TaichiCompilationError, match=r"Expected 2 indices, got 3"):
        baz()

    @ti.kernel
    def qux() -> ti.i32:
        m = ti.Matrix([[1, 2], [3, 4]])
        m[1, 0, 0] = 7
        return m[1, 0]

    with pytest.raises(ti.TaichiCompilationError, match=r"Expected 2 indices, got 3"):
        qux()


def test_trace_of_a_non_square_matrix_is_refused_in_a_kernel(ti):
    @ti.kernel
    def square() -> ti.f32:
        return ti.Matrix([[0.1, 3.0], [5.0, 7.0]]).trace()

    assert square() == pytest.approx(7.1, rel=1e-6)

    @ti.kernel
    def failed() -> ti.f32:
        return ti.Matrix([[0.1, 3.0], [5.0, 7.0], [1.0, 2.0]]).trace()

    with pytest.raises(ti.TaichiCompilationError,
                       match=r"expected a square matrix, got shape \(3, 2\)"):
        failed()


def test_a_matrix_takes_two_indices(ti):
    """As Taichi: m[i] of a matrix (also a matrix field's element or a struct member) is
    refused instead of read as a row; v[i, j] of a vector too. The row is m[i, :]."""
    f = ti.Matrix.field(3, 3, ti.f32, shape=())
    s = ti.Struct.field({"v": ti.types.vector(3, ti.f32), "m": ti.types.matrix(3, 3, ti.f32)},
                        shape=())

    @ti.kernel
    def local_row():
        m = ti.Matrix([[1, 2, 3], [4, 5, 6]])
        print(m[0])

    @ti.kernel
    def field_row():
        print(f[None][0])

    @ti.kernel
    def member_row():
        print(s[None].m[0])

    @ti.kernel
    def vector_two():
        v = ti.Vector([1, 2, 3, 4])
        print(v[0, 0])

    @ti.kernel
    def row_slice() -> ti.types.vector(3, ti.i32):
        m = ti.Matrix([[1, 2, 3], [4, 5, 6]])
        return m[1, :]

    for k in (local_row, field_row, member_row):
        with pytest.raises(IndexError, match=r"Expected 2 indices, got 1"):
            k()
    with pytest.raises(IndexError, match=r"Expected 1 indices, got 2"):
        vector_two()
    np.testing.assert_array_equal(row_slice().to_numpy(), [4, 5, 6])


def test_a_vector_has_no_transpose(ti):
    """As Taichi: v.transpose() is refused, naming outer_product, which gives a @ b^T."""
    @ti.kernel
    def transposed():
        x = ti.Vector([1, 2])
        y = ti.Vector([3, 4])
        z = x @ y.transpose()  # noqa: F841

    @ti.kernel
    def outer() -> ti.types.matrix(2, 2, ti.i32):
        return ti.Vector([1, 2]).outer_product(ti.Vector([3, 4]))

    with pytest.raises(ti.TaichiCompilationError, match=r"`transpose\(\)` cannot apply to a "
                       r"vector. If you want something like `a @ b.transpose\(\)`, write "
                       r"`a.outer_product\(b\)` instead."):
        transposed()
    np.testing.assert_array_equal(outer().to_numpy(), np.outer([1, 2], [3, 4]))


def test_a_kernel_vector_written_by_index_in_a_parallel_loop(ti):
    """`ret[i] = i` for i in a parallel loop (Taichi's test_ret_4k): each iteration writes its
    own entry; none may undo another's (a guarded rewrite of every entry once raced)."""
    n = 1024
    vec = ti.types.vector(n, ti.i32)

    @ti.kernel
    def fill() -> vec:
        ret = vec(0)
        for i in range(n):
            ret[i] = i
        return ret

    for _ in range(200):
        np.testing.assert_array_equal(fill().to_numpy(), np.arange(n))


def test_unit_vector_is_integer_by_default_and_indexes_fields(ti):
    # Taichi's Vector.unit(n, i, dt=None) makes an int vector: mgpcg_advanced.py steps through
    # a grid with x[I + ti.Vector.unit(dim, i)].
    x = ti.field(ti.f32, shape=(3, 3))
    x.from_numpy(np.arange(9, dtype=np.float32).reshape(3, 3))

    @ti.kernel
    def neighbours(i: ti.i32, j: ti.i32) -> ti.f32:
        p = ti.Vector([i, j])
        s = 0.0
        for k in ti.static(range(2)):
            e = ti.Vector.unit(2, k)
            s += x[p + e] + x[p - e]
        return s

    assert neighbours(1, 1) == 1 + 7 + 3 + 5

    @ti.kernel
    def scaled() -> ti.f32:
        return (ti.Vector.unit(3, 1) * 0.5).y + ti.Vector.unit(3, 2, ti.f32).z / 4

    assert scaled() == 0.75


def test_assigning_a_list_to_a_vector_variable(ti):
    # Taichi's mciso_advanced.py: R = float(I), then R = [i + p, j] in a branch
    out = ti.Vector.field(2, ti.f32, shape=4)

    @ti.kernel
    def fill():
        for i in out:
            R = float(ti.Vector([i, 1]))
            if i % 2 == 1:
                R = [i + 0.5, 2]
            out[i] = R

    fill()
    np.testing.assert_array_equal(out.to_numpy(), [[0, 1], [1.5, 2], [2, 1], [3.5, 2]])


def test_python_scope_vector_arithmetic_with_numpy_arrays(ti):
    # As in Taichi: a NumPy operand is a vector/matrix of its values (diff_sph.py moves its
    # camera with camera.curr_position + a NumPy array).
    v = ti.Vector([1.0, 2.0, 3.0])
    a = np.array([0.5, 0.25, 2.0])
    np.testing.assert_array_equal((a + v).to_numpy(), [1.5, 2.25, 5.0])
    np.testing.assert_array_equal((v - a).to_numpy(), [0.5, 1.75, 1.0])
    m = ti.Matrix([[1.0, 2.0], [3.0, 4.0]])
    np.testing.assert_array_equal((np.eye(2) * m).to_numpy(), [[1.0, 0.0], [0.0, 4.0]])


def test_numpy_functions_and_operators_with_python_scope_vectors(ti):
    # GeoTaichi (QuadrilateralElement4Nodes.get_boundary_nodes): np.ceil(points / grid_size)
    # with grid_size a ti.Vector; NumPy refused it ("does not support ufuncs"). As in Taichi,
    # NumPy's functions take the vector as the array it converts to, and NumPy scalars and
    # arrays on the left of an operator give a vector.
    g = ti.Vector([0.05, 0.25])
    r = [0.049, 1.0] / g
    assert isinstance(r, ti.Matrix)
    c = np.ceil(r)
    assert isinstance(c, np.ndarray)
    np.testing.assert_array_equal(c, [1.0, 4.0])
    np.testing.assert_allclose(np.sqrt(g), np.sqrt([0.05, 0.25]))
    for v in (np.float64(2) * g, np.array([1.0, 2.0]) + g):
        assert isinstance(v, ti.Matrix)
    np.testing.assert_allclose((np.array([1.0, 2.0]) + g).to_numpy(), [1.05, 2.25])
