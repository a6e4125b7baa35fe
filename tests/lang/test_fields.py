"""Fields, SNode layouts, Python-scope access, NumPy interop, and ndarrays."""

import numpy as np
import pytest


def test_field_shape_dtype_and_zero_initialisation(ti, fp, npfp):
    x = ti.field(float, shape=(3, 4))
    n = ti.field(ti.i32, shape=7)
    s = ti.field(ti.f64, shape=())
    assert x.shape == (3, 4) and n.shape == (7,) and s.shape == ()
    assert x.dtype == fp and n.dtype == ti.i32 and s.dtype == ti.f64
    np.testing.assert_array_equal(x.to_numpy(), np.zeros((3, 4)))
    assert x.to_numpy().dtype == npfp
    assert n.to_numpy().dtype == np.int32
    assert s[None] == 0.0


def test_field_with_needs_grad_has_a_zeroed_grad_field(ti, fp):
    x = ti.field(float, shape=5, needs_grad=True)
    assert x.grad.shape == (5,) and x.grad.dtype == fp
    x.from_numpy(np.arange(5.0))
    np.testing.assert_array_equal(x.grad.to_numpy(), np.zeros(5))
    x.grad[2] = 3.0  # the grad field is an ordinary field too
    np.testing.assert_array_equal(x.grad.to_numpy(), [0, 0, 3, 0, 0])
    np.testing.assert_array_equal(x.to_numpy(), np.arange(5.0))


def test_dense_layouts(ti):
    a = ti.field(ti.i32)
    ti.root.dense(ti.i, 6).place(a)
    b = ti.field(ti.i32)
    c = ti.field(ti.f32)
    ti.root.dense(ti.ij, (3, 5)).place(b, c)
    d = ti.field(ti.i32)
    ti.root.dense(ti.i, 4).dense(ti.j, 4).place(d)
    s = ti.field(ti.f32)
    ti.root.place(s)
    assert a.shape == (6,)
    assert b.shape == (3, 5) and c.shape == (3, 5)
    assert d.shape == (4, 4)
    assert s.shape == ()

    @ti.kernel
    def fill():
        for i in a:
            a[i] = i * i
        for i, j in b:
            b[i, j] = i * 10 + j
            c[i, j] = i - j * 0.5
        for i, j in d:
            d[i, j] = i * 4 + j
        s[None] = 2.5

    fill()
    np.testing.assert_array_equal(a.to_numpy(), np.arange(6) ** 2)
    i, j = np.indices((3, 5))
    np.testing.assert_array_equal(b.to_numpy(), i * 10 + j)
    np.testing.assert_array_equal(c.to_numpy(), (i - j * 0.5).astype(np.float32))
    np.testing.assert_array_equal(d.to_numpy(), np.arange(16).reshape(4, 4))
    assert s[None] == 2.5


def test_python_scope_element_access(ti, fp):
    x = ti.field(float, shape=4)
    g = ti.field(ti.i32, shape=(2, 3))
    s = ti.field(float, shape=())
    x[1] = 2.5
    x[3] = -1
    g[1, 2] = 7
    s[None] = 0.75
    assert x[1] == 2.5 and x[3] == -1.0 and x[0] == 0.0
    assert g[1, 2] == 7 and g[0, 2] == 0
    assert s[None] == 0.75
    np.testing.assert_array_equal(x.to_numpy(), [0, 2.5, 0, -1])

    @ti.kernel
    def read_back() -> float:
        return x[1] + x[3] + g[1, 2] + s[None]

    assert read_back() == 2.5 - 1 + 7 + 0.75


def test_python_scope_vector_and_matrix_elements(ti, fp, rtol):
    v = ti.Vector.field(3, float, shape=2)
    m = ti.Matrix.field(2, 2, float, shape=())
    v[0] = [1.0, 2.0, 3.0]
    v[1] = ti.Vector([4.0, 5.0, 6.0])
    m[None] = [[1.0, 2.0], [3.0, 4.0]]

    @ti.kernel
    def run() -> float:
        return (m[None] @ ti.Vector([v[0].x, v[1].z]))[1]

    np.testing.assert_allclose(run(), 3.0 * 1.0 + 4.0 * 6.0, rtol=rtol)
    np.testing.assert_allclose(np.asarray(v[1]), [4.0, 5.0, 6.0], rtol=rtol)
    np.testing.assert_allclose(np.asarray(m[None]), [[1, 2], [3, 4]], rtol=rtol)


def test_from_numpy_to_numpy_round_trip(ti, fp, npfp):
    x = ti.field(float, shape=(4, 3))
    v = ti.Vector.field(2, ti.i32, shape=5)
    m = ti.Matrix.field(2, 3, float, shape=4)
    data = np.random.default_rng(0).standard_normal((4, 3)).astype(npfp)
    vdata = np.arange(10, dtype=np.int32).reshape(5, 2)
    mdata = np.random.default_rng(1).standard_normal((4, 2, 3)).astype(npfp)
    x.from_numpy(data)
    v.from_numpy(vdata)
    m.from_numpy(mdata)
    np.testing.assert_array_equal(x.to_numpy(), data)
    np.testing.assert_array_equal(v.to_numpy(), vdata)
    np.testing.assert_array_equal(m.to_numpy(), mdata)
    # to_numpy returns a copy, not a view
    out = x.to_numpy()
    out[0, 0] = 1234.0
    assert x[0, 0] == data[0, 0]


def test_from_numpy_converts_dtype(ti):
    x = ti.field(ti.i32, shape=3)
    y = ti.field(ti.f32, shape=3)
    x.from_numpy(np.array([2.7, -2.7, 5.0]))  # float64 into i32 truncates toward zero
    y.from_numpy(np.array([1, 2, 3], dtype=np.int64))
    np.testing.assert_array_equal(x.to_numpy(), [2, -2, 5])
    np.testing.assert_array_equal(y.to_numpy(), np.array([1, 2, 3], dtype=np.float32))


def test_from_numpy_rejects_a_shape_mismatch(ti):
    x = ti.field(ti.i32, shape=(2, 3))
    with pytest.raises(ValueError):
        x.from_numpy(np.zeros((3, 2), dtype=np.int32))


def test_fill(ti, fp):
    x = ti.field(float, shape=(2, 3))
    v = ti.Vector.field(2, ti.i32, shape=3)
    x.fill(1.25)
    v.fill(-4)
    np.testing.assert_array_equal(x.to_numpy(), np.full((2, 3), 1.25))
    np.testing.assert_array_equal(v.to_numpy(), np.full((3, 2), -4))

    @ti.kernel
    def bump():
        for idx in ti.grouped(x):
            x[idx] += 1

    bump()
    x.fill(0)
    np.testing.assert_array_equal(x.to_numpy(), np.zeros((2, 3)))


def test_taichi_ndarray_is_passed_by_reference(ti):
    a = ti.ndarray(ti.f32, shape=(5,))
    assert a.shape == (5,) and a.dtype == ti.f32
    a.from_numpy(np.arange(5, dtype=np.float32))
    a[4] = 10.0

    @ti.kernel
    def scale(arr: ti.types.ndarray(), s: ti.f32):
        for i in arr:
            arr[i] = arr[i] * s + 1

    scale(a, 2.0)
    scale(a, 0.5)
    np.testing.assert_array_equal(a.to_numpy(), [1.5, 2.5, 3.5, 4.5, 11.5])
    assert a[4] == 11.5


def test_2d_taichi_ndarray_and_numpy_array_share_a_kernel(ti):
    @ti.kernel
    def transpose_add(src: ti.types.ndarray(), dst: ti.types.ndarray()):
        for i, j in ti.ndrange(src.shape[0], src.shape[1]):
            dst[j, i] += src[i, j]

    src = ti.ndarray(ti.i32, shape=(2, 3))
    src.from_numpy(np.arange(6, dtype=np.int32).reshape(2, 3))
    dst = np.ones((3, 2), dtype=np.int32)
    transpose_add(src, dst)
    np.testing.assert_array_equal(dst, np.arange(6).reshape(2, 3).T + 1)


def test_fields_and_ndarrays_together(ti, fp, npfp, rtol):
    weights = ti.field(float, shape=4)
    weights.from_numpy(np.array([0.5, 1.0, 2.0, 4.0]))

    @ti.kernel
    def weighted(a: ti.types.ndarray(), out: ti.types.ndarray()):
        for i in range(a.shape[0]):
            s = 0.0
            for k in range(4):
                s += a[i, k] * weights[k]
            out[i] = s

    a = np.random.default_rng(2).standard_normal((6, 4)).astype(npfp)
    out = np.zeros(6, dtype=npfp)
    weighted(a, out)
    want = a.astype(np.float64) @ [0.5, 1.0, 2.0, 4.0]
    np.testing.assert_allclose(out, want, rtol=10 * rtol, atol=10 * rtol)


def test_layout_dimensions_follow_axis_numbers(ti):
    """A field's dimensions are the axes its dense levels use, in axis-number order (ti.i
    first), whatever order the levels are nested in and whichever axis comes first."""
    x = ti.field(ti.f32)
    ti.root.dense(ti.k, 4).dense(ti.l, 3).place(x)
    y = ti.field(ti.f32)
    ti.root.dense(ti.l, 5).dense(ti.i, 2).place(y)
    z = ti.field(ti.i32)
    ti.root.dense(ti.jk, (3, 4)).dense(ti.i, 2).place(z)
    w = ti.field(ti.i32)
    ti.root.dense(ti.j, 3).place(w)
    assert x.shape == (4, 3)
    assert y.shape == (2, 5)
    assert z.shape == (2, 3, 4)
    assert w.shape == (3,)

    @ti.kernel
    def fill():
        for a, b in x:
            x[a, b] = a * 10 + b
        for a, b in y:
            y[a, b] = a * 10 + b
        for a, b, c in z:
            z[a, b, c] = a * 100 + b * 10 + c
        for a in w:
            w[a] = a + 1

    fill()
    a, b = np.indices((4, 3))
    np.testing.assert_array_equal(x.to_numpy(), a * 10 + b)
    a, b = np.indices((2, 5))
    np.testing.assert_array_equal(y.to_numpy(), a * 10 + b)
    a, b, c = np.indices((2, 3, 4))
    np.testing.assert_array_equal(z.to_numpy(), a * 100 + b * 10 + c)
    np.testing.assert_array_equal(w.to_numpy(), [1, 2, 3])
    assert x[3, 2] == 32


def test_every_axis_combination_is_exported(ti):
    names = ["i", "j", "k", "l", "ij", "ik", "il", "jk", "jl", "kl",
             "ijk", "ijl", "ikl", "jkl", "ijkl"]
    for name in names:
        f = ti.field(ti.i32)
        sizes = tuple(range(2, 2 + len(name)))
        ti.root.dense(getattr(ti, name), sizes).place(f)
        assert f.shape == sizes, name
    g = ti.field(ti.i32)
    ti.root.dense(ti.axes(0, 2), (3, 5)).place(g)
    assert g.shape == (3, 5)
    h = ti.field(ti.i32)
    ti.root.dense(ti.axes(1), 4).dense(ti.axes(0), 2).place(h)
    assert h.shape == (2, 4)


def test_to_numpy_keep_dims_and_column_matrices(ti):
    """Taichi's keep_dims: an n x 1 matrix field comes out as shape + (n,) unless keep_dims,
    a vector field as shape + (n, 1) with keep_dims; from_numpy takes either shape."""
    v = ti.Vector.field(3, ti.i32, shape=4)
    c = ti.Matrix.field(3, 1, ti.i32, shape=4)
    data = np.arange(12, dtype=np.int32).reshape(4, 3)
    v.from_numpy(data)
    c.from_numpy(data)
    assert v.to_numpy().shape == (4, 3) and c.to_numpy().shape == (4, 3)
    np.testing.assert_array_equal(v.to_numpy(keep_dims=True), data[:, :, None])
    np.testing.assert_array_equal(c.to_numpy(keep_dims=True), data[:, :, None])
    np.testing.assert_array_equal(c.to_numpy(), data)
    v.from_numpy(data[:, :, None] * 2)
    c.from_numpy(data[:, :, None] * 3)
    np.testing.assert_array_equal(v.to_numpy(), data * 2)
    assert c[1][2, 0] == 15
    m = ti.Matrix.field(2, 3, ti.f32, shape=2)
    assert m.to_numpy(keep_dims=True).shape == m.to_numpy().shape == (2, 2, 3)
    with pytest.raises((ValueError, AssertionError)):  # Taichi asserts
        m.from_numpy(np.zeros((2, 2), np.float32))


def test_python_scope_integer_stores_wrap_like_taichi(ti):
    """0xFFFF stored into an i16 element from Python is -1 (two's complement), as in Taichi."""
    x = ti.field(ti.i16, shape=2)
    u = ti.field(ti.u8, shape=())
    x[0] = 0xFFFF
    x[1] = 0x8000
    u[None] = 300
    assert x[0] == -1 and x[1] == -32768 and u[None] == 44


def test_scalar_and_matrix_field_classify_fields(ti):
    s = ti.field(ti.f32, shape=3)
    v = ti.Vector.field(2, ti.f32, shape=3)
    m = ti.Matrix.field(2, 2, ti.f32, shape=3)
    assert isinstance(s, ti.ScalarField) and not isinstance(s, ti.MatrixField)
    assert isinstance(v, ti.MatrixField) and not isinstance(v, ti.ScalarField)
    assert isinstance(m, ti.MatrixField) and isinstance(m, ti.Field)
    assert issubclass(ti.ScalarField, ti.Field) and issubclass(ti.MatrixField, ti.Field)
    assert not isinstance(np.zeros(3), ti.ScalarField) and not isinstance(3, ti.MatrixField)
    st = ti.Struct.field({"a": ti.f32}, shape=2)
    assert isinstance(st, ti.StructField) and not isinstance(st, ti.ScalarField)


def test_get_scalar_field_shares_storage(ti):
    m = ti.Matrix.field(2, 3, ti.f32, shape=4)
    v = ti.Vector.field(3, ti.i32, shape=4)
    sf = m.get_scalar_field(1, 2)
    assert isinstance(sf, ti.ScalarField) and sf.shape == (4,) and sf.dtype == ti.f32
    sf[2] = 5.0  # Python scope writes and reads go to the matrix field
    m[3] = [[1, 2, 3], [4, 5, 6]]
    assert m[2][1, 2] == 5.0 and sf[3] == 6.0

    @ti.kernel
    def bump(x: ti.template()):
        for i in x:
            x[i] += i

    bump(sf)
    expect = np.zeros((4, 2, 3), np.float32)
    expect[2, 1, 2], expect[3] = 5.0, [[1, 2, 3], [4, 5, 6]]
    expect[:, 1, 2] += np.arange(4)
    np.testing.assert_array_equal(m.to_numpy(), expect)
    np.testing.assert_array_equal(sf.to_numpy(), expect[:, 1, 2])
    sf.fill(-1.0)
    sf.from_numpy(np.arange(4.0, dtype=np.float32) * 2)
    expect[:, 1, 2] = np.arange(4) * 2
    np.testing.assert_array_equal(m.to_numpy(), expect)
    # one index: column 0 (a vector's entry i)
    v.get_scalar_field(1).fill(7)
    v.get_scalar_field(2, 0)[0] = 9
    np.testing.assert_array_equal(v.to_numpy(), [[0, 7, 9]] + [[0, 7, 0]] * 3)

    @ti.kernel
    def fill_in_kernel(x: ti.template()):
        x.fill(3)

    fill_in_kernel(m.get_scalar_field(0))  # entry (0, 0)
    expect[:, 0, 0] = 3
    np.testing.assert_array_equal(m.to_numpy(), expect)


def test_get_scalar_field_gradients_reach_the_matrix_field(ti, fp, npfp, rtol):
    m = ti.Matrix.field(2, 2, fp, shape=3, needs_grad=True, needs_dual=True)
    loss = ti.field(fp, shape=(), needs_grad=True, needs_dual=True)
    a = m.get_scalar_field(0, 1)
    b = m.get_scalar_field(1, 0)
    vals = np.random.default_rng(1).uniform(0.5, 2.0, (3, 2, 2))
    m.from_numpy(vals.astype(npfp))

    @ti.kernel
    def compute():
        for i in a:
            loss[None] += a[i] ** 2 * b[i]

    with ti.ad.Tape(loss):
        compute()
    expect = np.zeros((3, 2, 2))
    expect[:, 0, 1] = 2 * vals[:, 0, 1] * vals[:, 1, 0]
    expect[:, 1, 0] = vals[:, 0, 1] ** 2
    np.testing.assert_allclose(m.grad.to_numpy(), expect, rtol=rtol)


@pytest.mark.difftape_only
def test_get_scalar_field_in_forward_mode(ti, fp, npfp, rtol):
    # Taichi's view has no .dual, so FwdMode cannot take it as the parameter there.
    m = ti.Matrix.field(2, 2, fp, shape=3, needs_dual=True)
    loss = ti.field(fp, shape=(), needs_dual=True)
    a, b = m.get_scalar_field(0, 1), m.get_scalar_field(1, 0)
    vals = np.random.default_rng(2).uniform(0.5, 2.0, (3, 2, 2))
    m.from_numpy(vals.astype(npfp))

    @ti.kernel
    def compute():
        for i in a:
            loss[None] += a[i] ** 2 * b[i]

    with ti.ad.FwdMode(loss=loss, param=b, seed=[0.0, 1.0, 0.0]):  # d loss / d m[1][1, 0]
        compute()
    np.testing.assert_allclose(loss.dual[None], vals[1, 0, 1] ** 2, rtol=rtol)
    np.testing.assert_array_equal(m.dual.to_numpy(), 0)  # the seed is cleared on exit


def test_placing_the_entries_of_a_matrix_field_apart(ti):
    # Structure-of-arrays layout as DiffTaichi's diffmpm_benchmark.py and smoke_taichi_cpu.py
    # write it: each entry of a vector/matrix field placed in an SNode of its own.
    v = ti.Vector.field(2, ti.f64)
    m = ti.Matrix.field(2, 2, ti.f64)
    s = ti.field(ti.f64)
    loss = ti.field(ti.f64)
    block = ti.root.dense(ti.i, 3)
    for i in range(2):
        assert isinstance(v.get_scalar_field(i), ti.ScalarField)
        block.dense(ti.j, 4).place(v.get_scalar_field(i))
    for i in range(2):
        for j in range(2):
            ti.root.dense(ti.ij, (3, 4)).place(m.get_scalar_field(i, j))
    ti.root.dense(ti.ij, (3, 4)).place(s)
    ti.root.place(loss)
    ti.root.lazy_grad()
    assert v.shape == m.shape == (3, 4)

    @ti.kernel
    def energy():
        for i, j in v:
            loss[None] += (m[i, j] @ v[i, j]).dot(v[i, j]) * s[i, j]

    rng = np.random.default_rng(0)
    vs, ms, ss = rng.normal(size=(3, 4, 2)), rng.normal(size=(3, 4, 2, 2)), rng.normal(size=(3, 4))
    v.from_numpy(vs)
    m.from_numpy(ms)
    s.from_numpy(ss)
    with ti.ad.Tape(loss=loss):
        energy()
    assert loss[None] == pytest.approx(float(np.einsum("ijab,ijb,ija,ij", ms, vs, vs, ss)),
                                       rel=1e-12)
    sym = ms + np.swapaxes(ms, 2, 3)
    np.testing.assert_allclose(v.grad.to_numpy(),
                               np.einsum("ijab,ijb->ija", sym, vs) * ss[..., None], rtol=1e-12)
    np.testing.assert_allclose(m.grad.to_numpy(), np.einsum("ija,ijb,ij->ijab", vs, vs, ss),
                               rtol=1e-12)
    assert v.get_scalar_field(1)[2, 3] == vs[2, 3, 1]


@pytest.mark.difftape_only  # Taichi accepts mismatched entries (and then misindexes them)
def test_entries_placed_apart_need_one_shape_dense_snodes_and_one_place_each(ti):
    v = ti.Vector.field(2, ti.f32, name="v")
    ti.root.dense(ti.i, 4).place(v.get_scalar_field(0))
    with pytest.raises(ti.ShapeError, match="share one shape"):
        ti.root.dense(ti.i, 5).place(v.get_scalar_field(1))
    with pytest.raises(ti.DifftapeError, match=r"v\[0\] is already placed"):
        ti.root.dense(ti.i, 4).place(v.get_scalar_field(0))
    w = ti.Vector.field(2, ti.f32, name="w")
    with pytest.raises(ti.DifftapeError, match="dense SNodes only"):
        ti.root.pointer(ti.i, 2).dense(ti.i, 2).place(w.get_scalar_field(0))
    u = ti.Vector.field(2, ti.f32, shape=4, name="u")
    with pytest.raises(ti.DifftapeError, match="already placed"):
        ti.root.dense(ti.i, 4).place(u.get_scalar_field(0))


@pytest.mark.difftape_only
def test_get_scalar_field_grad_is_the_same_entry_of_the_grad(ti):
    # (Taichi gives None for the view's .grad; difftape a view of m.grad.)
    m = ti.Matrix.field(2, 2, ti.f32, shape=3, needs_grad=True)
    g = m.get_scalar_field(1, 1).grad
    g[2] = 4.0
    assert m.grad[2][1, 1] == 4.0 and not m.get_scalar_field(0, 0).has_dual
    with pytest.raises(ti.DifftapeError, match="2x2 entries"):
        m.get_scalar_field(2, 0)
    with pytest.raises(ti.DifftapeError, match="scalar field"):
        ti.field(ti.f32, shape=2).get_scalar_field(0)


def test_field_keywords_are_honoured_or_refused(ti):
    """An unknown keyword is a TypeError as in Taichi; ``order`` only picks a memory layout,
    values are unchanged. (``offset`` changes the indices: tests/lang/test_offsets.py.)"""
    with pytest.raises(TypeError):
        ti.field(ti.f32, shape=4, foo_bar=1)
    x = ti.field(ti.i32, shape=(2, 3), order="ji")

    @ti.kernel
    def fill():
        for i, j in x:
            x[i, j] = i * 10 + j

    fill()
    a, b = np.indices((2, 3))
    np.testing.assert_array_equal(x.to_numpy(), a * 10 + b)


@pytest.mark.parametrize("make", ["scalar", "vector"])
def test_a_bad_order_is_refused(ti, make):
    """``order=`` must name each axis of the field once, and needs a shape (it was ignored
    without one); Taichi's messages."""
    def field(**kw):
        if make == "scalar":
            return ti.field(dtype=ti.f32, **kw)
        return ti.Vector.field(3, dtype=ti.f32, **kw)

    error = ti.TaichiCompilationError
    with pytest.raises(error, match="The dimensionality of shape and order must be the same"):
        field(shape=3, order="ij")
    with pytest.raises(error, match="shape cannot be None when order is set"):
        field(shape=None, order="i")
    with pytest.raises(error, match="The axes in order must be different"):
        field(shape=(3, 4, 3), order="iji")
    with pytest.raises(error, match="Invalid axis"):
        field(shape=(3, 4, 3), order="ijl")


@pytest.mark.difftape_only
def test_entries_of_a_matrix_field_placed_apart(ti):
    """Taichi's structure-of-arrays layout: each entry's scalar field placed in an SNode of
    its own; entries share one shape, so a second shape is refused."""
    v = ti.Vector.field(2, ti.i32)
    ti.root.dense(ti.i, 8).place(v.get_scalar_field(0))
    ti.root.dense(ti.i, 8).place(v.get_scalar_field(1))
    w = ti.Vector.field(2, ti.i32)
    ti.root.dense(ti.i, 8).place(w.get_scalar_field(0))
    with pytest.raises(ti.DifftapeError, match="same shape|share one shape"):
        ti.root.dense(ti.i, 4).place(w.get_scalar_field(1))

    @ti.kernel
    def fill():
        for i in v:
            v[i] = [i, 2 * i]

    fill()
    assert v.shape == (8,)
    np.testing.assert_array_equal(v.to_numpy(), np.stack([np.arange(8), 2 * np.arange(8)], 1))


def test_python_scope_misuses_of_a_field_are_errors(ti):
    """A field is not a Python iterable, not sliceable, copy_from takes a field, and
    from_numpy checks the shape (a (1,) array is not a 0-D field's value)."""
    x = ti.field(ti.i32, shape=3)
    with pytest.raises(NotImplementedError, match="Struct for is only available in Taichi "
                                                  "scope"):
        for _ in x:
            pass
    y = ti.field(ti.i32, shape=(2, 2))
    with pytest.raises(TypeError, match="slicing a ti.field is not supported"):
        print(y[0, :])
    with pytest.raises(TypeError):
        y.copy_from(np.zeros((2, 2)))
    s = ti.field(ti.f32, shape=())
    with pytest.raises(ValueError):
        s.from_numpy(np.ones(1, dtype=np.float32))
    v = ti.Vector.field(2, ti.f32, shape=3)
    v.from_numpy(np.ones((3, 2, 1), dtype=np.float32))  # a column per element is fine
    assert v[2][1] == 1


def test_copy_from_converts_between_dtypes_as_an_assignment(ti):
    """copy_from between fields of different dtypes converts each element as a kernel's
    assignment does (Taichi copies in a kernel): floats truncate to integers, integers wrap,
    f64 rounds to f32 (difftape refused every float -> integer and signed -> unsigned copy with
    NumPy's casting error; found by the areas fuzzer). Another shape is refused."""
    f = ti.field(ti.f32, shape=4)
    i = ti.field(ti.i32, shape=4)
    u = ti.field(ti.u8, shape=4)
    d = ti.field(ti.f64, shape=4)
    fv = np.array([3.7, -3.7, 1e5, -0.5], np.float32)
    f.from_numpy(fv)
    i.copy_from(f)
    np.testing.assert_array_equal(i.to_numpy(), np.trunc(fv).astype(np.int32))
    iv = np.array([-1, 300, 70000, -129], np.int32)
    i.from_numpy(iv)
    u.copy_from(i)
    np.testing.assert_array_equal(u.to_numpy(), iv % 256)
    d.copy_from(i)
    np.testing.assert_array_equal(d.to_numpy(), iv.astype(np.float64))
    dv = np.array([1.0000001, 0.1, -2.5, 1e-3])
    d.from_numpy(dv)
    f.copy_from(d)
    np.testing.assert_array_equal(f.to_numpy(), dv.astype(np.float32))
    mf = ti.Matrix.field(2, 2, ti.f32, shape=2)
    mi = ti.Matrix.field(2, 2, ti.i32, shape=2)
    mv = np.arange(8, dtype=np.float32).reshape(2, 2, 2) * 1.5 - 4
    mf.from_numpy(mv)
    mi.copy_from(mf)
    np.testing.assert_array_equal(mi.to_numpy(), np.trunc(mv).astype(np.int32))
    with pytest.raises(ValueError):
        ti.field(ti.f32, shape=5).copy_from(f)


@pytest.mark.difftape_only
def test_copy_from_refuses_other_element_shapes(ti):
    """A scalar field's values are not broadcast into a matrix field of the same shape."""
    m = ti.Matrix.field(2, 2, ti.f32, shape=2)
    with pytest.raises(ti.ShapeError, match=r"elements \(2, 2\).*\(2,\), \(\)"):
        m.copy_from(ti.field(ti.f32, shape=2))


@pytest.mark.parametrize("companion", ["needs_grad", "needs_dual"])
def test_integer_fields_cannot_have_gradients(ti, companion):
    """A .grad/.dual of an integer field (scalar, vector, matrix, or an integer member of a
    struct) is refused with a RuntimeError naming the dtype, as Taichi does."""
    msg = r"is not supported for field with `needs_grad=True` or `needs_dual=True`"
    with pytest.raises(RuntimeError, match=msg):
        ti.field(int, shape=1, **{companion: True})
    with pytest.raises(RuntimeError, match=msg):
        ti.field(ti.math.ivec3, shape=1, **{companion: True})
    with pytest.raises(RuntimeError, match=msg):
        ti.field(ti.types.matrix(2, 3, int), shape=1, **{companion: True})
    with pytest.raises(RuntimeError, match=msg):
        ti.Struct.field({"pos": ti.types.vector(3, int), "mass": ti.f32}, shape=1,
                        **{companion: True})
    f = ti.field(float, shape=1, **{companion: True})  # a float field still gets one
    assert getattr(f, "grad" if companion == "needs_grad" else "dual").shape == (1,)


def _loop_unique(ti):
    """Taichi has it in taichi.lang.misc only; difftape also as ti.loop_unique."""
    import importlib

    return getattr(ti, "loop_unique", None) or \
        importlib.import_module(ti.__name__ + ".lang.misc").loop_unique


def test_loop_unique_returns_its_value_and_updates_stay_exact(ti):
    loop_unique = _loop_unique(ti)
    x = ti.field(ti.i32, shape=8)
    y = ti.field(ti.i32, shape=8)

    @ti.kernel
    def scatter():
        for i in x:
            a = loop_unique(x[i], covers=[y.snode])
            y[a] += i + 1

    perm = np.array([3, 0, 6, 1, 7, 2, 5, 4], dtype=np.int32)
    x.from_numpy(perm)
    y.from_numpy(np.full(8, 10, dtype=np.int32))
    scatter()
    want = np.full(8, 10)
    want[perm] += np.arange(8) + 1
    np.testing.assert_array_equal(y.to_numpy(), want)


def test_assume_in_range_returns_its_value(ti):
    # taichi_elements' p2g: `base[D] = ti.assume_in_range(base[D], Im[D], 0, 1)`, a hint for
    # GPU shared memory (ti.block_local) that changes no value (it was missing: AttributeError)
    x = ti.field(ti.i32, shape=6)

    @ti.kernel
    def run():
        for i in x:
            b = ti.Vector([i * 2, 0])  # (Taichi returns a bare expression: assign it)
            b[0] = ti.assume_in_range(b[0] + 1, i * 2, 0, 2)
            x[i] = b[0] * 10

    run()
    np.testing.assert_array_equal(x.to_numpy(), (np.arange(6) * 2 + 1) * 10)


def test_fields_builder_trees_hold_fields_apart_from_ti_root(ti):
    fb = ti.FieldsBuilder()
    x = ti.field(ti.f32)
    fb.dense(ti.i, 5).place(x)
    y = ti.field(ti.i32)
    fb.pointer(ti.i, 2).dense(ti.i, 3).place(y)
    tree = fb.finalize()
    assert x.shape == (5,) and y.shape == (6,)

    @ti.kernel
    def fill():
        for i in x:
            x[i] = i * 1.5
        y[4] = 7

    fill()
    np.testing.assert_array_equal(x.to_numpy(), np.arange(5) * 1.5)
    np.testing.assert_array_equal(y.to_numpy(), [0, 0, 0, 0, 7, 0])
    with pytest.raises(Exception, match="FieldsBuilder finalized"):
        fb.dense(ti.i, 2).place(ti.field(ti.f32))
    tree.destroy()
    with pytest.raises(Exception, match="destroyed"):
        tree.destroy()


@pytest.mark.difftape_only
def test_destroyed_fields_are_refused_in_kernels_and_python_scope(ti):
    """Taichi crashes using a field of a destroyed tree; difftape refuses, and kernels that
    held its storage compile again instead of writing freed memory."""
    fb = ti.FieldsBuilder()
    x = ti.field(ti.i32)
    fb.dense(ti.i, 4).place(x)
    tree = fb.finalize()
    keep = ti.field(ti.i32, shape=4)

    @ti.kernel
    def fill():
        for i in x:
            x[i] = i
            keep[i] = i + 1

    fill()
    tree.destroy()
    with pytest.raises(ti.DifftapeError, match="destroyed"):
        x[0]
    with pytest.raises(ti.DifftapeError, match="destroyed"):
        x.to_numpy()
    with pytest.raises(ti.CompileError, match="destroyed"):
        fill()
    np.testing.assert_array_equal(keep.to_numpy(), [1, 2, 3, 4])


def test_fields_builder_new_tree_after_destroy_starts_at_zero(ti):
    fb0 = ti.FieldsBuilder()
    a = ti.field(ti.i32)
    fb0.dense(ti.i, 3).place(a)
    c = fb0.finalize()
    a[0] = 5
    c.destroy()
    fb1 = ti.FieldsBuilder()
    b = ti.field(ti.f32, needs_grad=True)
    fb1.dense(ti.i, 3).place(b, b.grad)
    fb1.finalize()
    loss = ti.field(ti.f32, shape=(), needs_grad=True)

    @ti.kernel
    def square_sum():
        for i in b:
            loss[None] += b[i] * b[i]

    assert b[0] == 0
    b.from_numpy(np.array([1.0, 2.0, 3.0], dtype=np.float32))
    with ti.ad.Tape(loss=loss):
        square_sum()
    assert loss[None] == 14.0
    np.testing.assert_allclose(b.grad.to_numpy(), [2.0, 4.0, 6.0])


def test_layout_aos_and_soa_fields_hold_the_same_values(ti):
    a = ti.Vector.field(2, ti.i32, shape=(3, 2), layout=ti.Layout.AOS)
    b = ti.Matrix.field(2, 2, ti.f32, shape=4, layout=ti.Layout.SOA)

    @ti.kernel
    def fill():
        for i, j in a:
            a[i, j] = [i, j]
        for i in b:
            b[i][1, 0] = i * 0.5

    fill()
    i, j = np.indices((3, 2))
    np.testing.assert_array_equal(a.to_numpy(), np.stack([i, j], axis=-1))
    np.testing.assert_array_equal(b.to_numpy()[:, 1, 0], np.arange(4) * 0.5)


@pytest.mark.difftape_only
def test_layout_other_than_ti_layout_is_refused(ti):
    with pytest.raises(TypeError, match="ti.Layout"):
        ti.Vector.field(2, ti.f32, shape=3, layout="soa")


def test_cache_read_only_hint(ti):
    # Taichi's test_quant_fixed.py::test_quant_fixed_cache_read_only uses it on a read field.
    x = ti.field(ti.f32, shape=4)
    s = ti.types.struct(a=ti.i32, b=ti.f32).field(shape=4)
    out = ti.field(ti.f32, shape=4)

    @ti.kernel
    def read():
        ti.cache_read_only(x, s)
        for i in out:
            out[i] = x[i] * 2 + s[i].a + s[i].b

    x.from_numpy(np.arange(4, dtype=np.float32))
    s.a.from_numpy(np.arange(4, dtype=np.int32) * 10)
    s.b.fill(0.5)
    read()
    np.testing.assert_allclose(out.to_numpy(), np.arange(4) * 2 + np.arange(4) * 10 + 0.5)


@pytest.mark.difftape_only  # Taichi's CPU backend ignores the hint
def test_cache_read_only_field_written_is_refused(ti):
    y = ti.field(ti.f32, shape=4)

    @ti.kernel
    def bad():
        ti.cache_read_only(y)
        for i in y:
            y[i] += 1

    with pytest.raises(ti.CompileError, match="read-only in this kernel"):
        bad()
@pytest.mark.difftape_only
def test_a_field_larger_than_memory_is_refused_with_the_reason(ti):
    # Taichi's oit_renderer.py example: a dynamic list per pixel, stored by difftape at its
    # full capacity (16 TiB here); this was NumPy's MemoryError from deep inside the allocator.
    x = ti.field(ti.f32)
    with pytest.raises(ti.OutOfMemoryError, match=r"needs 1\.64e\+04 GiB.*dynamic SNode"):
        ti.root.dense(ti.ij, (2**14, 2**14)).dynamic(ti.k, 2**14).place(x)
