"""Fields with an ``offset=``: indices run from the offset, in Python scope and in kernels.

``ti.field(dtype, shape=s, offset=o)`` (and ``ti.root.dense(...).place(x, offset=o)``) is a
field whose element ``x[o]`` is the first one: struct-fors run over ``o .. o + s``, Python
scope and kernels index with those indices, ``to_numpy``/``from_numpy`` see the elements in
order from the first (array index 0 is ``x[o]``), and the bounds checks of ``debug=True``
check (and report) the offset indices. Gradients live in ``x.grad`` at the same indices.
"""

import numpy as np
import pytest


def _logical_grid(shape, offset):
    """Each element's own index (``offset + array index``) along each axis."""
    return [g + o for g, o in zip(np.indices(shape), offset, strict=True)]


def test_struct_for_visits_the_offset_indices(ti):
    shape, offset = (4, 6), (-2, 3)
    x = ti.field(ti.i32, shape=shape, offset=offset)
    assert x.shape == shape

    @ti.kernel
    def fill():
        for i, j in x:
            x[i, j] = i * 100 + j

    fill()
    i, j = _logical_grid(shape, offset)
    np.testing.assert_array_equal(x.to_numpy(), i * 100 + j)
    assert x[-2, 3] == -200 + 3 and x[1, 8] == 108  # Python scope: the same indices


def test_python_writes_are_read_by_kernels_at_the_same_index(ti):
    x = ti.field(ti.f32, shape=8, offset=-4)
    for i in range(-4, 4):
        x[i] = i * 1.5
    out = ti.field(ti.f32, shape=())

    @ti.kernel
    def read(i: ti.i32):
        out[None] = x[i]

    for i in (-4, 0, 3):
        read(i)
        assert out[None] == i * 1.5
    np.testing.assert_array_equal(x.to_numpy(), np.arange(-4, 4) * 1.5)


def test_place_with_offset_and_grouped_and_ndrange_loops(ti):
    a = ti.field(ti.i32)
    b = ti.field(ti.i32)
    ti.root.dense(ti.ij, (3, 5)).place(a, b, offset=(10, -20))
    assert a.shape == b.shape == (3, 5)

    @ti.kernel
    def fill():
        for ij in ti.grouped(a):
            a[ij] = ij[0] * 1000 + ij[1]
        for i, j in ti.ndrange((10, 13), (-20, -15)):
            b[i, j] = a[i, j] + 1

    fill()
    i, j = _logical_grid((3, 5), (10, -20))
    np.testing.assert_array_equal(a.to_numpy(), i * 1000 + j)
    np.testing.assert_array_equal(b.to_numpy(), i * 1000 + j + 1)


def test_vector_and_matrix_fields_with_offset(ti):
    v = ti.Vector.field(2, ti.i32, shape=5, offset=7)
    m = ti.Matrix.field(2, 2, ti.f32, shape=(2, 3), offset=(-1, -1))

    @ti.kernel
    def fill():
        for i in v:
            v[i] = ti.Vector([i, 2 * i])
        for i, j in m:
            m[i, j][1, 0] = i + 10 * j

    fill()
    idx = np.arange(7, 12)
    np.testing.assert_array_equal(v.to_numpy(), np.stack([idx, 2 * idx], axis=1))
    assert v[9][1] == 18
    i, j = _logical_grid((2, 3), (-1, -1))
    np.testing.assert_array_equal(m.to_numpy()[:, :, 1, 0], i + 10 * j)
    assert m[0, 1][1, 0] == 10
    v[11] = [5, 6]  # a Python-scope write at the last index
    assert v.to_numpy()[4].tolist() == [5, 6]


def test_from_numpy_fill_and_copy_from_with_offsets(ti):
    x = ti.field(ti.f32, shape=(3, 4), offset=(5, -5))
    y = ti.field(ti.f32, shape=(3, 4), offset=(-1, 0))
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    x.from_numpy(arr)
    assert x[5, -5] == 0 and x[7, -2] == 11  # array index 0 is the first element
    y.copy_from(x)
    assert y[-1, 0] == 0 and y[1, 3] == 11
    np.testing.assert_array_equal(y.to_numpy(), arr)

    @ti.kernel
    def refill():
        x.fill(2.5)  # in a kernel: a loop over the field's (offset) indices

    refill()
    np.testing.assert_array_equal(x.to_numpy(), np.full((3, 4), 2.5))
    y.fill(-1)
    assert (y.to_numpy() == -1).all()


def test_offset_must_match_the_shape(ti):
    with pytest.raises(ti.TaichiCompilationError,
                       match="The dimensionality of shape and offset must be the same"):
        ti.field(ti.f32, shape=3, offset=(3, 4))
    with pytest.raises(ti.TaichiCompilationError, match="shape cannot be None when offset is set"):
        ti.Vector.field(3, ti.f32, shape=None, offset=(3,))
    with pytest.raises(ti.TaichiCompilationError,
                       match="The dimensionality of shape and offset must be the same"):
        ti.Matrix.field(2, 2, ti.f32, shape=(4, 4, 4), offset=(1, 1))


def test_bounds_checks_use_the_offset_indices(ti):
    ti.init(arch=ti.cpu, debug=True)
    x = ti.field(ti.i32, shape=(8, 16), offset=(-8, -8))

    @ti.kernel
    def write(i: ti.i32, j: ti.i32):
        x[i, j] = 1

    write(-8, -8)
    write(-1, 7)
    assert x[-8, -8] == 1 and x[-1, 7] == 1
    with pytest.raises(RuntimeError):
        write(0, 0)  # index 0 is one past the last along axis 0
    with pytest.raises(AssertionError):
        x[0, 0] = 1
    with pytest.raises(AssertionError):
        print(x[-9, 0])


@pytest.mark.difftape_only
def test_bounds_messages_report_the_offset_indices(ti):
    """(Taichi's messages say the same in other words.) Outside debug mode, a Python-scope
    access out of range is an IndexError too, rather than a wrapped-around NumPy index."""
    ti.init(arch=ti.cpu, debug=True)
    x = ti.field(ti.i32, shape=(8, 16), offset=(-8, -8))

    @ti.kernel
    def write(i: ti.i32, j: ti.i32):
        x[i, j] = 1

    with pytest.raises(ti.IndexOutOfRangeError,
                       match=r"index 0 out of range for axis 0 of 'x' with shape \(8, 16\) "
                             r"and offset \(-8, -8\)"):
        write(0, 0)
    with pytest.raises(ti.IndexOutOfRangeError, match="index 8 out of range for axis 1"):
        write(-1, 8)
    ti.init(arch=ti.cpu)
    y = ti.field(ti.i32, shape=3, offset=1)
    with pytest.raises(IndexError, match="index 0 out of range for axis 0"):
        y[0] = 1
    z = ti.field(ti.i32, shape=3)
    with pytest.raises(IndexError, match="index -1 out of range"):
        print(z[-1])
    with pytest.raises(TypeError, match="slicing a ti.field is not supported"):
        print(z[1.0])


@pytest.mark.difftape_only
def test_struct_field_with_offset(ti):
    """(Taichi 1.7.4's Struct.field hands offset= to its members without their shape and
    raises; difftape places the members together from the offset.)"""
    s = ti.Struct.field({"a": ti.i32, "v": ti.types.vector(2, ti.f32)}, shape=4, offset=-2)

    @ti.kernel
    def fill():
        for i in s:
            s[i].a = i
            s[i].v = ti.Vector([i, -i])

    fill()
    np.testing.assert_array_equal(s.a.to_numpy(), np.arange(-2, 2))
    assert s[1].a == 1 and s[-2].v[1] == 2
    with pytest.raises(ti.TaichiCompilationError, match="shape cannot be None"):
        ti.Struct.field({"a": ti.i32}, offset=1)


@pytest.mark.difftape_only
def test_offset_under_sparse_snodes_is_refused(ti):
    x = ti.field(ti.i32)
    with pytest.raises(ti.DifftapeError, match="under sparse SNodes"):
        ti.root.pointer(ti.i, 4).dense(ti.i, 2).place(x, offset=3)
    with pytest.raises(ti.DifftapeError, match="has 1 axes"):
        ti.root.dense(ti.i, 4).place(x, offset=(1, 2))


@pytest.mark.difftape_only
def test_offset_indices_must_be_i32(ti):
    """Kernels index fields with i32: a field whose indices (offset added) do not all fit is
    refused where it is made (Taichi 1.7.4 takes one and its indices wrap around), and one
    reaching the ends of the range works."""
    with pytest.raises(ti.ShapeError, match=r"index range 2147483644 \.\. 2147483652 \(end "
                                            r"excluded\) does not fit in i32"):
        ti.field(ti.f32, shape=8, offset=2**31 - 4)
    with pytest.raises(ti.ShapeError, match="does not fit in i32"):
        ti.Vector.field(2, ti.f32, shape=(2, 4), offset=(0, -2**31 - 1))
    x = ti.field(ti.f32)
    with pytest.raises(ti.ShapeError, match="does not fit in i32"):
        ti.root.dense(ti.i, 4).place(x, offset=2**31 - 4)
    lo = ti.field(ti.i64, shape=4, offset=-2**31)
    hi = ti.field(ti.i64, shape=4, offset=2**31 - 5)
    ti.root.dense(ti.i, 4).place(x, offset=7)

    @ti.kernel
    def fill():
        for i in lo:
            lo[i] = i
        for i in hi:
            hi[i] = i

    fill()
    np.testing.assert_array_equal(lo.to_numpy(), -2**31 + np.arange(4))
    np.testing.assert_array_equal(hi.to_numpy(), 2**31 - 5 + np.arange(4))
    assert lo[-2**31] == -2**31 and hi[2**31 - 2] == 2**31 - 2


def test_gradients_through_offset_fields(ti, fp, rtol):
    n, off = 6, -3
    x = ti.field(fp, shape=n, offset=off, needs_grad=True)
    w = ti.field(fp, shape=(n, 2), offset=(10, 0), needs_grad=True)
    loss = ti.field(fp, shape=(), needs_grad=True)
    xs = np.linspace(-1.0, 2.0, n)
    ws = np.arange(2.0 * n).reshape(n, 2) / 7.0
    x.from_numpy(xs)
    w.from_numpy(ws)

    @ti.kernel
    def compute():
        for i in x:
            loss[None] += x[i] ** 2 * w[i - off + 10, 1] + ti.sin(x[i]) * w[i + 13, 0]

    with ti.ad.Tape(loss=loss):
        compute()
    expected = (xs ** 2 * ws[:, 1] + np.sin(xs) * ws[:, 0]).sum()
    np.testing.assert_allclose(loss[None], expected, rtol=rtol)
    np.testing.assert_allclose(x.grad.to_numpy(), 2 * xs * ws[:, 1] + np.cos(xs) * ws[:, 0],
                               rtol=rtol)
    np.testing.assert_allclose(w.grad.to_numpy(), np.stack([np.sin(xs), xs ** 2], axis=1),
                               rtol=rtol)
    assert x.grad[off] == pytest.approx(2 * xs[0] * ws[0, 1] + np.cos(xs[0]) * ws[0, 0],
                                        rel=rtol)

    # kernel.grad() without a tape: the same derivatives, accumulated once more
    compute.grad()
    np.testing.assert_allclose(x.grad.to_numpy(),
                               2 * (2 * xs * ws[:, 1] + np.cos(xs) * ws[:, 0]), rtol=rtol)


def test_placed_gradient_of_an_offset_field(ti, fp, rtol):
    x = ti.field(fp)
    ti.root.dense(ti.i, 4).place(x, x.grad, offset=100)
    y = ti.field(fp, shape=(), needs_grad=True)
    x.from_numpy(np.array([1.0, 2.0, 3.0, 4.0]))

    @ti.kernel
    def f():
        for i in x:
            y[None] += (i - 100 + 1) * x[i] ** 3

    with ti.ad.Tape(loss=y):
        f()
    xs = np.arange(1.0, 5.0)
    np.testing.assert_allclose(x.grad.to_numpy(), 3 * xs ** 2 * xs, rtol=rtol)
    assert x.grad[103] == pytest.approx(3 * 16 * 4, rel=rtol)
