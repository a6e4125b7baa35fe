"""ndarrays: ``ti.ndarray`` / ``ti.Vector.ndarray`` / ``ti.Matrix.ndarray`` and NumPy arrays as
kernel arguments (``ti.types.ndarray(...)``): argument checks, Python-scope element access,
bulk copies, ``boundary="clamp"``, ``needs_grad`` and ``element_dim`` in annotations.

Patterns follow Taichi 1.7.4's own tests/python/test_ndarray.py. Taichi raises ``ValueError``
or ``TypeError`` for a mismatched argument; difftape raises ``ArgumentError``, which is both.
"""

import copy

import numpy as np
import pytest

MISMATCH = (TypeError, ValueError)


# ----------------------------------------------------------------------------- argument checks


def test_matrix_annotation_checks_numpy_trailing_axes(ti):
    """The element axes of a NumPy argument must be the annotation's element shape: the
    generated code indexes them with constants, so a smaller array would be written out of
    bounds (this once corrupted the heap)."""

    @ti.kernel
    def identity(a: ti.types.ndarray(dtype=ti.math.mat3, ndim=2)):
        for i, j in ti.ndrange(a.shape[0], a.shape[1]):
            a[i, j] = ti.Matrix.identity(float, 3) * (i + 10 * j)

    with pytest.raises(MISMATCH, match="a"):
        identity(np.zeros((2, 4, 3, 2), np.float32))  # 3x2 elements: 12 floats too few
    with pytest.raises(MISMATCH, match=r"Invalid value for argument a - required array has "
                       r"ndim=2 element_dim=2, array with 3 dimensions is provided"):
        identity(np.zeros((2, 4, 3), np.float32))  # too few axes for 2 dims of 3x3
    with pytest.raises(MISMATCH):
        identity(np.zeros((2, 3, 3), np.float32))  # ndim=1 of 3x3 elements
    good = np.full((2, 4, 3, 3), -1.0, np.float32)
    identity(good)
    want = np.einsum("ij,kl->ijkl", np.arange(2)[:, None] + 10 * np.arange(4)[None, :],
                     np.eye(3))
    np.testing.assert_array_equal(good, want)


def test_vector_annotation_checks_numpy_trailing_axis(ti):
    @ti.kernel
    def fill(a: ti.types.ndarray(dtype=ti.types.vector(2, ti.i32), ndim=1)):
        for i in a:
            a[i] = ti.Vector([i, -i])

    with pytest.raises(MISMATCH):
        fill(np.zeros((5, 1), np.int32))
    with pytest.raises(MISMATCH):
        fill(np.zeros(5, np.int32))
    x = np.full((5, 2), 7, np.int32)
    fill(x)
    np.testing.assert_array_equal(x, np.stack([np.arange(5), -np.arange(5)], axis=1))


def test_scalar_dtype_and_ndim_are_checked(ti):
    @ti.kernel
    def touch(x: ti.types.ndarray(dtype=ti.f32, ndim=1)):
        for i in x:
            x[i] += 1

    with pytest.raises(MISMATCH):
        touch(np.zeros(4, np.float64))
    with pytest.raises(MISMATCH):
        touch(np.zeros((2, 2), np.float32))
    with pytest.raises(MISMATCH):
        touch(ti.ndarray(ti.i32, 4))
    with pytest.raises(MISMATCH):
        touch(ti.ndarray(ti.f32, (2, 2)))
    with pytest.raises(MISMATCH):
        touch(ti.Vector.ndarray(2, ti.f32, 4))  # vector elements for a scalar annotation
    x = np.arange(4, dtype=np.float32)
    touch(x)
    np.testing.assert_array_equal(x, np.arange(4) + 1)


def test_ndarray_element_type_is_checked(ti):
    @ti.kernel
    def vec2(a: ti.types.ndarray(dtype=ti.types.vector(2, ti.i32))):
        pass

    @ti.kernel
    def mat22(a: ti.types.ndarray(dtype=ti.types.matrix(2, 2, ti.i32))):
        pass

    with pytest.raises(MISMATCH):
        vec2(ti.Matrix.ndarray(2, 3, ti.i32, shape=(4, 7)))
    with pytest.raises(MISMATCH):
        vec2(ti.Matrix.ndarray(2, 1, ti.i32, shape=(4, 7)))
    with pytest.raises(MISMATCH):
        vec2(ti.Vector.ndarray(3, ti.i32, shape=(4, 7)))
    with pytest.raises(MISMATCH):
        mat22(ti.Vector.ndarray(2, ti.i32, shape=(4, 7)))
    vec2(ti.Vector.ndarray(2, ti.i32, shape=(4, 7)))
    mat22(ti.Matrix.ndarray(2, 2, ti.i32, shape=3))


def test_annotation_without_sizes_matches_any_vector_or_matrix(ti):
    @ti.kernel
    def ones(x: ti.types.ndarray(dtype=ti.types.matrix())):
        for i in ti.grouped(x):
            x[i] = 1.0

    @ti.kernel
    def twos(x: ti.types.ndarray(dtype=ti.types.vector())):
        for i in ti.grouped(x):
            x[i] = 2.0

    a, b = ti.ndarray(ti.math.mat2, 3), ti.ndarray(ti.math.mat3, 2)
    ones(a)
    ones(b)
    np.testing.assert_array_equal(a.to_numpy(), np.ones((3, 2, 2)))
    np.testing.assert_array_equal(b.to_numpy(), np.ones((2, 3, 3)))
    v = ti.ndarray(ti.math.vec3, 4)
    twos(v)
    np.testing.assert_array_equal(v.to_numpy(), np.full((4, 3), 2.0))
    with pytest.raises(MISMATCH):
        ones(ti.ndarray(ti.math.vec2, 3))
    with pytest.raises(MISMATCH):
        twos(ti.ndarray(ti.math.mat2, 3))


@pytest.mark.difftape_only
def test_argument_errors_name_the_kernel_and_the_argument(ti):
    @ti.kernel
    def blend(src: ti.types.ndarray(dtype=ti.math.vec3, ndim=1), k: ti.f32):
        pass

    with pytest.raises(ti.ArgumentError, match=r"kernel 'blend': argument 'src'.*3-vector") as e:
        blend(np.zeros((4, 2), np.float32), 1.0)
    assert e.value.kernel == "blend"
    with pytest.raises(ti.ArgumentError, match=r"argument 'src' must be an array \(NumPy"):
        blend([1.0, 2.0, 3.0], 1.0)


def test_fortran_ordered_numpy_arrays_are_read_and_written(ti):
    """Transposed (Fortran-ordered) arrays are accepted, as in Taichi: the kernel sees the
    logical array and its writes reach the caller's array."""

    @ti.kernel
    def mark(a: ti.types.ndarray(dtype=ti.f32, ndim=2)):
        for i, j in a:
            a[i, j] = a[i, j] + 10 * i + j

    base = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = base.copy().T  # shape (4, 3), Fortran order
    assert not t.flags.c_contiguous
    mark(t)
    want = base.T + 10 * np.arange(4)[:, None] + np.arange(3)[None, :]
    np.testing.assert_array_equal(t, want)

    @ti.kernel
    def total(a: ti.types.ndarray(), out: ti.types.ndarray()):
        for i, j in a:
            out[None] += a[i, j] * (i + 1)

    out = np.zeros((), np.float32)
    total(t, out)
    assert out[()] == pytest.approx(float(np.sum(want * (np.arange(4)[:, None] + 1))))


def test_strided_numpy_views_are_refused(ti):
    @ti.kernel
    def fill(a: ti.types.ndarray()):
        for i in a:
            a[i] = 1

    x = np.zeros(10, np.int32)
    with pytest.raises(ValueError, match="contiguous"):
        fill(x[::2])
    assert not x.any()


@pytest.mark.difftape_only
def test_read_only_arrays_may_be_read_but_not_written(ti):
    @ti.kernel
    def bump(a: ti.types.ndarray()):
        for i in a:
            a[i] += 1

    @ti.kernel
    def total(a: ti.types.ndarray()) -> ti.i32:
        s = 0
        for i in a:
            s += a[i]
        return s

    frozen = np.frombuffer(bytes([1, 2, 3]), dtype=np.uint8)
    assert total(frozen) == 6
    with pytest.raises(ti.ArgumentError, match="read-only"):
        bump(frozen)
    assert frozen.tolist() == [1, 2, 3]


@pytest.mark.difftape_only
def test_misaligned_and_byte_swapped_numpy_arrays(ti):
    @ti.kernel
    def bump(a: ti.types.ndarray()):
        for i in a:
            a[i] = a[i] * 2 + 1

    raw = np.zeros(8 * 5 + 1, np.uint8)
    odd = raw[1:].view(np.float64)  # contiguous but not 8-byte aligned
    assert not odd.flags.aligned
    odd[:] = np.arange(5.0)
    bump(odd)
    np.testing.assert_array_equal(odd, np.arange(5.0) * 2 + 1)
    swapped = np.arange(4.0).astype(">f8")
    with pytest.raises(ti.ArgumentError, match="byte order"):
        bump(swapped)


def test_ndarray_is_refused_as_template_argument(ti):
    @ti.kernel
    def copy2d(src: ti.template(), dst: ti.template()):
        for i, j in ti.ndrange(*src.shape):
            dst[i, j] = src[i, j]

    a, b = ti.ndarray(ti.f32, (2, 3)), ti.ndarray(ti.f32, (2, 3))
    with pytest.raises(Exception, match="(?i)ndarray"):
        copy2d(a, b)


@pytest.mark.difftape_only
def test_ndarray_captured_as_global_is_refused(ti):
    a = ti.ndarray(ti.f32, 4)
    a.fill(3.0)

    @ti.kernel
    def read() -> ti.f32:
        return a[1]

    with pytest.raises(ti.CompileError, match="ti.types.ndarray"):
        read()


# ---------------------------------------------------------------------------- Python scope


def test_vector_and_matrix_ndarray_properties(ti):
    for shape, full in ((5, (5,)), ((2, 3), (2, 3)), ((), ())):
        s = ti.ndarray(ti.i64, shape)
        v = ti.Vector.ndarray(3, ti.f64, shape)
        m = ti.Matrix.ndarray(2, 3, ti.i32, shape)
        assert s.shape == v.shape == m.shape == full
        assert s.element_shape == () and v.element_shape == (3,) and m.element_shape == (2, 3)
        assert s.dtype == ti.i64 and v.dtype == ti.f64 and m.dtype == ti.i32
        assert v.n == 3 and m.n == 2 and m.m == 3
        assert isinstance(s, ti.ScalarNdarray) and isinstance(s, ti.Ndarray)
        assert isinstance(v, ti.VectorNdarray) and isinstance(m, ti.MatrixNdarray)
        assert v.to_numpy().shape == full + (3,) and m.to_numpy().shape == full + (2, 3)
    assert isinstance(ti.ndarray(ti.types.vector(3, ti.i32), (4, 4)), ti.VectorNdarray)
    c = ti.ndarray(ti.types.matrix(3, 4, float), shape=(4, 5))
    assert isinstance(c, ti.MatrixNdarray) and c.shape == (4, 5) and c.element_shape == (3, 4)
    assert ti.VectorNdarray(2, ti.f32, (3,)).shape == (3,)
    assert ti.MatrixNdarray(2, 2, ti.f32, (3, 3)).element_shape == (2, 2)


def test_matrix_ndarray_python_scope_writes_stick(ti):
    a = ti.Matrix.ndarray(2, 2, ti.i32, 5)
    for i in range(5):
        for j, k in ti.ndrange(2, 2):
            a[i][j, k] = j * j + k * k + 10 * i
    want = np.array([[[j * j + k * k + 10 * i for k in range(2)] for j in range(2)]
                     for i in range(5)])
    np.testing.assert_array_equal(a.to_numpy(), want)
    assert a[3][1, 1] == 32 and a[4][0, 1] == 41
    a[2] = [[7, 8], [9, 10]]
    np.testing.assert_array_equal(a.to_numpy()[2], [[7, 8], [9, 10]])
    assert a[2][1, 0] == 9


def test_vector_ndarray_python_scope_writes_stick(ti):
    a = ti.Vector.ndarray(10, ti.i32, 5)
    for i in range(5):
        for j in range(4):
            a[i][j * j] = j * j + i
    want = np.zeros((5, 10), np.int32)
    for i in range(5):
        for j in range(4):
            want[i, j * j] = j * j + i
    np.testing.assert_array_equal(a.to_numpy(), want)
    assert a[4][9] == 13 and a[1][0] == 1
    v = ti.Vector.ndarray(3, ti.f32, (2, 2))
    v[1, 0] = ti.Vector([1.0, 2.0, 3.0])
    v[0, 1] = [4.0, 5.0, 6.0]
    assert v[1, 0][2] == 3.0 and v[0, 1][0] == 4.0
    np.testing.assert_array_equal(v.to_numpy()[1, 0], [1, 2, 3])
    assert list(v[0, 1]) == [4.0, 5.0, 6.0]


def test_zero_dim_ndarrays(ti):
    x = ti.ndarray(dtype=ti.f32, shape=())
    x[()] = 1.0
    assert x[None] == 1.0
    y = ti.ndarray(dtype=ti.math.vec2, shape=())
    y[()] = [1.0, 2.0]
    assert list(y[None]) == [1.0, 2.0]

    @ti.kernel
    def write(x: ti.types.ndarray()):
        a = x[()] + 1
        x[None] = 2 * a

    write(x)
    write(y)
    assert x[None] == 4.0
    assert list(y[None]) == [4.0, 6.0]


def test_python_scope_index_count_is_checked(ti):
    x = ti.ndarray(dtype=ti.f32, shape=(4, 4))
    with pytest.raises(IndexError):
        x[0]
    with pytest.raises(IndexError):
        x[0, 0, 0]


@pytest.mark.difftape_only
def test_python_scope_index_range_is_checked(ti):
    x = ti.Vector.ndarray(2, ti.f32, shape=(4, 3))
    with pytest.raises(IndexError):
        x[4, 0]
    with pytest.raises(IndexError):
        x[0, 3] = [1.0, 2.0]
    x[-1, -1] = [1.0, 2.0]  # NumPy's negative indices
    assert list(x[3, 2]) == [1.0, 2.0]


def test_copy_from_fill_and_deepcopy(ti):
    a, b = ti.ndarray(ti.i32, shape=16), ti.ndarray(ti.i32, shape=16)
    a[0], a[4], b[0], b[4] = 1, 2, 4, 5
    a.copy_from(b)
    assert a[0] == 4 and a[4] == 5

    x, y = ti.Vector.ndarray(10, ti.i32, 5), ti.Vector.ndarray(10, ti.i32, 5)
    x[1][0], x[2][4], y[1][0], y[2][4] = 1, 2, 4, 5
    x.copy_from(y)
    assert x[1][0] == 4 and x[2][4] == 5

    m = ti.Matrix.ndarray(2, 2, ti.i32, 5)
    m[0][0, 0], m[4][1, 0] = 7, 9
    d = copy.deepcopy(m)
    assert (d.shape, d.dtype, d.n, d.m) == (m.shape, m.dtype, 2, 2)
    m[0][0, 0] = 3
    assert d[0][0, 0] == 7 and d[4][1, 0] == 9

    vec2 = ti.types.vector(2, ti.f32)
    v = ti.ndarray(vec2, (6, 6))
    v.fill(1.0)
    assert (v[2, 2] == [1.0, 1.0]).all()
    v.fill(vec2(2.0, 4.0))
    np.testing.assert_array_equal(v.to_numpy(), np.broadcast_to([2.0, 4.0], (6, 6, 2)))
    mat = ti.types.matrix(2, 2, ti.f32)
    w = ti.ndarray(mat, 3)
    w.fill(mat([[2.0, 4.0], [1.0, 3.0]]))
    np.testing.assert_array_equal(w.to_numpy(), np.broadcast_to([[2, 4], [1, 3]], (3, 2, 2)))


def test_numpy_round_trip(ti):
    x = ti.Vector.ndarray(5, ti.i32, (2,))
    x_np = 1 + np.arange(10).reshape(2, 5).astype(np.int32)
    x.from_numpy(x_np)
    np.testing.assert_array_equal(x.to_numpy(), x_np)
    m = ti.Matrix.ndarray(2, 3, ti.f32, 4)
    m_np = np.arange(24, dtype=np.float32).reshape(4, 2, 3)
    m.from_numpy(m_np)
    np.testing.assert_array_equal(m.to_numpy(), m_np)
    assert m[3][1, 2] == 23.0
    with pytest.raises(ValueError):
        m.from_numpy(np.zeros((4, 3, 2), np.float32))


@pytest.mark.parametrize("shape", [0, (1, 0), 1.5, (2, 0.5), 2**31])
def test_invalid_shapes_are_refused(ti, shape):
    with pytest.raises(Exception, match="not a valid shape"):
        ti.ndarray(ti.i32, shape)


def test_needs_grad_is_refused_for_integer_ndarrays(ti):
    with pytest.raises(Exception, match="needs_grad"):
        ti.ndarray(ti.i32, 3, needs_grad=True)
    assert ti.ndarray(ti.f32, 3).grad is None
    assert ti.ndarray(ti.f32, 3, needs_grad=False).grad is None


def test_unknown_ndarray_keywords_are_refused(ti):
    with pytest.raises(TypeError):
        ti.ndarray(ti.f32, 4, boundary="clamp")
    with pytest.raises(TypeError):
        ti.types.ndarray(dtype=ti.f32, layout=0)
    with pytest.raises(ValueError):
        ti.types.ndarray(boundary="wrap")
    with pytest.raises(ValueError):
        ti.types.ndarray(field_dim=2)


# ---------------------------------------------------------------------------- in kernels


def test_vector_and_matrix_ndarrays_in_kernels(ti):
    @ti.kernel
    def func(a: ti.types.ndarray()):
        for i in a:
            for j, k in ti.ndrange(2, 2):
                a[i][j, k] = j * j + k * k + i

    m = ti.Matrix.ndarray(2, 2, ti.i32, 5)
    func(m)
    want = np.array([[[j * j + k * k + i for k in range(2)] for j in range(2)]
                     for i in range(5)])
    np.testing.assert_array_equal(m.to_numpy(), want)

    @ti.kernel
    def grouped(a: ti.types.ndarray()):
        for i in ti.grouped(a):
            for j, k in ti.ndrange(2, 2):
                a[i][j, k] = j * j

    a2 = ti.Matrix.ndarray(2, 2, ti.i32, shape=(3, 3))
    grouped(a2)
    np.testing.assert_array_equal(a2.to_numpy(), np.broadcast_to([[0, 0], [1, 1]], (3, 3, 2, 2)))


def test_element_dim_one_means_vector_elements(ti):
    @ti.kernel
    def second(a: ti.types.ndarray(element_dim=1), out: ti.types.ndarray()):
        for i in out:
            out[i] = a[i][1] * 10 + a[i].norm_sqr()

    a = np.array([[1, 2], [3, 4], [5, 6]], np.float32)
    out = np.zeros(3, np.float32)
    second(a, out)
    np.testing.assert_array_equal(out, a[:, 1] * 10 + (a * a).sum(axis=1))

    @ti.kernel
    def trace(a: ti.types.ndarray(element_dim=2)) -> ti.f32:
        s = 0.0
        for i in a:
            s += a[i].trace()
        return s

    m = np.arange(12, dtype=np.float32).reshape(3, 2, 2)
    assert trace(m) == float(np.trace(m, axis1=1, axis2=2).sum())

    @ti.kernel
    def first(a: ti.types.ndarray(element_shape=(3,), ndim=1)) -> ti.f32:
        return a[1][2]

    assert first(np.arange(6, dtype=np.float32).reshape(2, 3)) == 5.0
    with pytest.raises(MISMATCH):
        first(np.arange(6, dtype=np.float32).reshape(3, 2))


def test_boundary_clamp_clamps_every_index(ti):
    @ti.kernel
    def read(x: ti.types.ndarray(boundary="clamp"), y: ti.i32) -> ti.f32:
        return x[y]

    x = ti.ndarray(ti.f32, shape=3)
    for i in range(3):
        x[i] = i + 1
    assert [read(x, k) for k in (-2, -1, 0, 2, 3, 4)] == [1, 1, 1, 3, 3, 3]

    @ti.kernel
    def read_vec(x: ti.types.ndarray(boundary="clamp"), i: ti.i32, y: ti.i32) -> ti.f32:
        return x[i, 2][y]

    x2 = ti.ndarray(ti.math.vec2, shape=(3, 3))
    for i in range(3):
        for j in range(3):
            x2[i, j] = [i, j]
    assert read_vec(x2, 1, -1) == 1 and read_vec(x2, 1, 2) == 2
    assert read_vec(x2, 7, 0) == 2 and read_vec(x2, -3, 1) == 2

    @ti.kernel
    def read_mat(x: ti.types.ndarray(boundary="clamp"), i: ti.i32, j: ti.i32) -> ti.f32:
        return x[1, 2][i, j]

    x3 = ti.ndarray(ti.math.mat2, shape=(3, 3))
    for i in range(3):
        for j in range(3):
            x3[i, j] = [[i, j], [i + 1, j + 1]]
    # Taichi clamps a matrix element's flattened offset i * 2 + j into [0, 3].
    assert [read_mat(x3, -1, 0), read_mat(x3, 1, -1), read_mat(x3, 2, 0),
            read_mat(x3, 1, 2)] == [1, 2, 3, 3]

    @ti.kernel
    def read2(x: ti.types.ndarray(boundary="clamp"), i: ti.i32, j: ti.i32) -> ti.f32:
        return x[i, j]

    a = np.arange(9, dtype=np.float32).reshape(3, 3)  # array axes clamp one by one
    assert [read2(a, i, j) for i, j in ((5, 0), (0, 5), (-1, 1), (1, -1), (1, 4))] == \
        [6, 2, 1, 3, 5]

    @ti.kernel
    def write(x: ti.types.ndarray(dtype=ti.f32, ndim=1, boundary="clamp"), y: ti.i32):
        x[y] = 100 + y

    z = np.zeros(4, np.float32)
    write(z, -5)
    write(z, 9)
    np.testing.assert_array_equal(z, [95, 0, 0, 109])


def test_numpy_zero_dim_array_as_loop_bound(ti):
    n = np.array(6)
    lo = np.array(2, dtype=np.int32)

    @ti.kernel
    def total() -> ti.i32:
        s = 0
        for i in range(lo, n):
            s += i
        return s

    assert total() == sum(range(2, 6))


# ---------------------------------------------------------------------------- gradients


def test_needs_grad_false_annotation_leaves_the_gradient_alone(ti):
    @ti.kernel
    def square(a: ti.types.ndarray(needs_grad=False), b: ti.types.ndarray()):
        for i in a:
            b[i] = a[i] * a[i]

    @ti.kernel
    def square_all(a: ti.types.ndarray(), b: ti.types.ndarray()):
        for i in a:
            b[i] = a[i] * a[i]

    a = ti.ndarray(ti.f32, 3, needs_grad=True)
    b = ti.ndarray(ti.f32, 3, needs_grad=True)
    a.from_numpy(np.array([1.0, 2.0, 3.0], np.float32))
    b.grad.fill(1.0)
    square(a, b)
    square.grad(a, b)
    np.testing.assert_array_equal(a.grad.to_numpy(), np.zeros(3))
    np.testing.assert_array_equal(b.to_numpy(), [1.0, 4.0, 9.0])
    b.grad.fill(1.0)
    square_all.grad(a, b)
    np.testing.assert_array_equal(a.grad.to_numpy(), [2.0, 4.0, 6.0])


def test_needs_grad_true_annotation_requires_a_gradient(ti):
    @ti.kernel
    def use(a: ti.types.ndarray(needs_grad=True)):
        pass

    with pytest.raises(ValueError, match="needs_grad"):
        use(ti.ndarray(ti.f32, 3))
    use(ti.ndarray(ti.f32, 3, needs_grad=True))


def test_func_ndarray_parameter_is_checked_against_its_annotation(ti):
    """A func's ndarray annotation (element type, ndim) is checked against the array it is
    given, as Taichi checks it ("Invalid value for argument ..."), not ignored."""
    @ti.func
    def fill(a: ti.types.ndarray(dtype=ti.math.vec3, ndim=1)):
        a[0] = [100, 200, 300]

    @ti.func
    def fill_vec2(a: ti.types.ndarray(dtype=ti.math.vec2, ndim=1)):
        a[0] = [100, 100]

    @ti.func
    def fill_2d(a: ti.types.ndarray(ndim=2)):
        a[0, 0] = [1, 1, 1]

    @ti.kernel
    def good(x: ti.types.ndarray(ndim=1)):
        fill(x)

    @ti.kernel
    def wrong_element(x: ti.types.ndarray(ndim=1)):
        fill_vec2(x)

    @ti.kernel
    def wrong_ndim(x: ti.types.ndarray(ndim=1)):
        fill_2d(x)

    arr = ti.ndarray(ti.math.vec3, shape=4)
    good(arr)
    np.testing.assert_array_equal(arr.to_numpy()[0], [100, 200, 300])
    with pytest.raises(ti.TaichiCompilationError, match="Invalid value for argument a"):
        wrong_element(arr)
    with pytest.raises(ti.TaichiCompilationError):  # Taichi: when it is indexed
        wrong_ndim(arr)


def test_element_shape_of_an_ndarray_argument(ti):
    # Taichi's real_func stable_fluid_graph.py picks bilerp2 or bilerp3 by
    # ti.static(vf.element_shape() == [2]) on an ndarray argument.
    @ti.func
    def kind(a: ti.template()) -> ti.i32:
        r = 0
        if ti.static(a.element_shape() == [2]):
            r = 2
        elif ti.static(a.element_shape() == [2, 3]):
            r = 23
        return r

    @ti.kernel
    def k(a: ti.types.ndarray(ndim=1)) -> ti.i32:
        return kind(a) * 10 + ti.static(len(a.element_shape()))

    assert k(ti.Vector.ndarray(2, ti.f32, 4)) == 21
    assert k(ti.Matrix.ndarray(2, 3, ti.f32, 4)) == 232
    assert k(ti.ndarray(ti.f32, 4)) == 0
