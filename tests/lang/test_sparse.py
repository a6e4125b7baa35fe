"""Sparse SNodes: pointer, bitmasked and dynamic levels, their activity, struct-fors over them.

Every expectation is computed from what the test wrote (NumPy truth); the behaviours are
Taichi's (these tests pass on Taichi 1.7.4 with DIFFTAPE_TEST_PEER=taichi) except where marked.
"""

import numpy as np
import pytest


def _pointer_field(ti, dtype=None, blocks=4, block=8, needs_grad=False):
    x = ti.field(dtype or ti.i32)
    ptr = ti.root.pointer(ti.i, blocks)
    if needs_grad:
        ptr.dense(ti.i, block).place(x, x.grad)
    else:
        ptr.dense(ti.i, block).place(x)
    return x, ptr


def test_pointer_write_activates_its_block_and_struct_for_visits_active_cells(ti):
    x, ptr = _pointer_field(ti)
    written = [9, 10, 30]

    @ti.kernel
    def write():
        for k in ti.static(written):
            x[k] = k + 1

    @ti.kernel
    def visit() -> ti.i32:
        s = 0
        for i in x:
            s += 1
            x[i] += 100
        return s

    write()
    blocks = {k // 8 for k in written}
    assert visit() == 8 * len(blocks)
    expect = np.zeros(32, dtype=np.int32)
    for b in blocks:
        expect[8 * b:8 * b + 8] = 100
    for k in written:
        expect[k] += k + 1
    np.testing.assert_array_equal(x.to_numpy(), expect)


def test_bitmasked_struct_for_visits_written_cells_only(ti):
    y = ti.field(ti.f32)
    bm = ti.root.dense(ti.i, 4).bitmasked(ti.j, 8)
    bm.place(y)
    cells = [(0, 1), (2, 7), (3, 0), (2, 6)]

    @ti.kernel
    def write():
        for c in ti.static(cells):
            y[c[0], c[1]] = 1.5

    @ti.kernel
    def total() -> ti.f32:
        s = 0.0
        for i, j in y:
            s += y[i, j] + i * 8 + j
        return s

    @ti.kernel
    def count_active() -> ti.i32:
        c = 0
        for i, j in ti.ndrange(4, 8):
            c += ti.is_active(bm, [i, j])
        return c

    write()
    assert total() == pytest.approx(sum(1.5 + i * 8 + j for i, j in cells))
    assert count_active() == len(cells)


def test_struct_for_over_sparse_snode_gives_its_own_indices(ti):
    x, ptr = _pointer_field(ti)
    x[3] = 1
    x[27] = 1
    seen = ti.field(ti.i32, shape=4)

    @ti.kernel
    def mark():
        for b in ptr:
            seen[b] += 1

    mark()
    np.testing.assert_array_equal(seen.to_numpy(), [1, 0, 0, 1])


def test_deactivate_pointer_cell_zeroes_it_and_reactivation_starts_from_zero(ti):
    x, ptr = _pointer_field(ti)

    @ti.kernel
    def write():
        x[9] = 5
        x[10] = 6
        x[20] = 7

    @ti.kernel
    def deactivate(b: ti.i32):
        ti.deactivate(ptr, [b])

    @ti.kernel
    def active(b: ti.i32) -> ti.i32:
        return ti.is_active(ptr, [b])

    @ti.kernel
    def count() -> ti.i32:
        s = 0
        for _i in x:
            s += 1
        return s

    write()
    assert [active(b) for b in range(4)] == [0, 1, 1, 0]
    deactivate(1)
    assert [active(b) for b in range(4)] == [0, 0, 1, 0]
    assert count() == 8
    assert x[9] == 0 and x[10] == 0 and x[20] == 7
    x[11] = 1  # Python-scope writes activate too
    assert active(1) == 1 and count() == 16
    expect = np.zeros(32, dtype=np.int32)
    expect[11], expect[20] = 1, 7
    np.testing.assert_array_equal(x.to_numpy(), expect)


def test_python_scope_fill_and_from_numpy_touch_active_cells_only(ti):
    x, ptr = _pointer_field(ti)

    @ti.kernel
    def count() -> ti.i32:
        s = 0
        for _i in x:
            s += 1
        return s

    x[9] = 3
    x.fill(7)
    expect = np.zeros(32, dtype=np.int32)
    expect[8:16] = 7
    np.testing.assert_array_equal(x.to_numpy(), expect)
    x.from_numpy(np.arange(32, dtype=np.int32))
    expect[8:16] = np.arange(8, 16)
    np.testing.assert_array_equal(x.to_numpy(), expect)
    assert count() == 8
    ptr.deactivate_all()
    assert count() == 0
    np.testing.assert_array_equal(x.to_numpy(), np.zeros(32))


def test_root_deactivate_all_clears_every_sparse_tree(ti):
    a = ti.field(ti.i32)
    b = ti.field(ti.i32)
    ti.root.pointer(ti.i, 2).bitmasked(ti.i, 4).place(a)
    ti.root.bitmasked(ti.i, 8).place(b)

    @ti.kernel
    def count() -> ti.i32:
        s = 0
        for _i in a:
            s += 1
        for _i in b:
            s += 10
        return s

    a[1] = 1
    a[6] = 1
    b[3] = 1
    assert count() == 2 + 10
    ti.root.deactivate_all()
    assert count() == 0
    assert a[1] == 0 and a[6] == 0  # the pointer's blocks are recycled


def test_struct_for_visits_the_cells_active_when_it_starts(ti):
    # The loop activates blocks ahead of it: Taichi lists the active cells first, so the
    # newly activated ones are not visited, whatever order the iterations run in.
    x, ptr = _pointer_field(ti)

    @ti.kernel
    def shift():
        for i in x:
            x[(i + 8) % 32] = x[i] + 1

    @ti.kernel
    def count() -> ti.i32:
        s = 0
        for _i in x:
            s += 1
        return s

    x[11] = 1
    shift()
    assert count() == 16
    expect = np.zeros(32, dtype=np.int32)
    expect[11] = 1
    expect[16:24] = 1
    expect[19] = 2
    np.testing.assert_array_equal(x.to_numpy(), expect)


def test_is_active_and_activate_on_nested_pointers(ti):
    x = ti.field(ti.i32)
    block1 = ti.root.pointer(ti.ij, 3)
    block2 = block1.pointer(ti.ij, 2)
    pixel = block2.bitmasked(ti.ij, 2)
    pixel.place(x)

    @ti.kernel
    def act():
        ti.activate(block1, [1, 0])
        ti.activate(block2, [3, 1])
        ti.activate(pixel, [7, 3])

    @ti.kernel
    def check(i: ti.i32, j: ti.i32) -> ti.i32:
        return ti.is_active(block1, [i // 4, j // 4]) * 100 + \
            ti.is_active(block2, [i // 2, j // 2]) * 10 + ti.is_active(pixel, [i, j])

    @ti.kernel
    def count() -> ti.i32:
        s = 0
        for _i, _j in x:
            s += 1
        return s

    act()
    assert check(7, 3) == 111
    assert check(6, 3) == 110
    assert check(0, 0) == 0
    assert count() == 1
    assert ti.rescale_index(x, block1, [7, 3]) == [1, 0]


def test_dynamic_append_length_and_struct_for(ti):
    x = ti.field(ti.i32)
    lst = ti.root.dense(ti.i, 3).dynamic(ti.j, 16, chunk_size=4)
    lst.place(x)
    lengths = ti.field(ti.i32, shape=3)

    @ti.kernel
    def fill():
        for i in range(3):
            for k in range(2 * i + 1):
                ti.append(lst, i, 10 * i + k)

    @ti.kernel
    def measure():
        for i in range(3):
            lengths[i] = ti.length(lst, i)

    @ti.kernel
    def visit() -> ti.i32:
        s = 0
        for i, j in x:
            s += x[i, j]
        return s

    fill()
    measure()
    np.testing.assert_array_equal(lengths.to_numpy(), [1, 3, 5])
    assert visit() == sum(10 * i + k for i in range(3) for k in range(2 * i + 1))

    @ti.kernel
    def rows():
        x[1].deactivate()
        x[2].append(99)
        x[0, 6] = 4  # a write past the end extends the list to it

    rows()
    measure()
    np.testing.assert_array_equal(lengths.to_numpy(), [7, 0, 6])
    assert visit() == 0 + 4 + sum(20 + k for k in range(5)) + 99
    expect = np.zeros((3, 16), dtype=np.int32)
    expect[0, 0], expect[0, 6] = 0, 4
    expect[2, :6] = [20, 21, 22, 23, 24, 99]
    np.testing.assert_array_equal(x.to_numpy(), expect)


def test_dynamic_list_at_the_root(ti):
    x = ti.field(ti.f32)
    ti.root.dynamic(ti.i, 32).place(x)
    n = ti.field(ti.i32, shape=())

    @ti.kernel
    def push(k: ti.i32):
        for i in range(k):
            x.append(i * 0.5)
        n[None] = x.length()

    @ti.kernel
    def total() -> ti.f32:
        s = 0.0
        for i in x:
            s += x[i]
        return s

    push(5)
    assert n[None] == 5
    assert total() == pytest.approx(sum(i * 0.5 for i in range(5)))

    @ti.kernel
    def clear():
        x.deactivate()
        n[None] = x.length()

    clear()
    assert n[None] == 0 and total() == 0.0


def test_vector_field_under_pointer(ti):
    v = ti.Vector.field(3, ti.f32)
    ptr = ti.root.pointer(ti.i, 4)
    ptr.dense(ti.i, 2).place(v)

    @ti.kernel
    def norms() -> ti.f32:
        s = 0.0
        for i in v:
            s += v[i].norm_sqr() + 1.0
        return s

    v[5] = [1.0, 2.0, 2.0]
    assert norms() == pytest.approx(9.0 + 2.0)
    v[0][1] = 3.0  # an entry write through a Python-scope element activates too
    assert norms() == pytest.approx(9.0 + 9.0 + 4.0)


def test_tape_over_a_pointer_field(ti):
    x, ptr = _pointer_field(ti, ti.f32, needs_grad=True)
    loss = ti.field(ti.f32, shape=(), needs_grad=True)
    x[9] = 3.0

    @ti.kernel
    def square_sum():
        for i in x:
            loss[None] += x[i] ** 2

    x.from_numpy(np.arange(32, dtype=np.float32))
    with ti.ad.Tape(loss):
        square_sum()
    expect = np.zeros(32)
    expect[8:16] = 2 * np.arange(8, 16)
    np.testing.assert_allclose(x.grad.to_numpy(), expect)
    assert loss[None] == pytest.approx(float(np.sum(np.arange(8, 16) ** 2)))


@pytest.mark.difftape_only
def test_struct_for_over_sparse_field_inside_a_loop_is_refused(ti):
    x, ptr = _pointer_field(ti)

    @ti.kernel
    def nested():
        for k in range(2):
            for i in x:
                x[i] += k

    with pytest.raises(ti.CompileError, match="top level"):
        nested()


@pytest.mark.difftape_only
def test_deactivate_in_a_differentiated_kernel_is_refused(ti):
    x, ptr = _pointer_field(ti, ti.f32, needs_grad=True)
    loss = ti.field(ti.f32, shape=(), needs_grad=True)

    @ti.kernel
    def f():
        for i in x:
            loss[None] += x[i]
        ti.deactivate(ptr, [0])

    x[1] = 1.0
    with pytest.raises(ti.GradientRuleError, match="deactivate"):
        with ti.ad.Tape(loss):
            f()


@pytest.mark.difftape_only
def test_bitmasked_deactivate_zeroes_the_cell(ti):
    # Taichi's docs: "reading an inactive pixel returns zero" and deactivated cells are
    # zero-filled. (Taichi 1.7.4 on the CPU keeps a deactivated bitmasked cell's old value;
    # difftape gives the documented 0, the same as for pointer cells.)
    y = ti.field(ti.i32)
    bm = ti.root.bitmasked(ti.i, 8)
    bm.place(y)

    @ti.kernel
    def deactivate():
        ti.deactivate(bm, [3])

    y[3] = 7
    y[5] = 8
    deactivate()
    assert y[3] == 0 and y[5] == 8
    y[5] = 9
    bm.deactivate_all()
    assert y[5] == 0


@pytest.mark.difftape_only
def test_grad_check_with_sparse_fields_is_refused(ti):
    x, ptr = _pointer_field(ti, ti.f32, needs_grad=True)
    loss = ti.field(ti.f32, shape=(), needs_grad=True)
    with pytest.raises(ti.DifftapeError, match="sparse SNodes"):
        with ti.ad.Tape(loss, grad_check=[x]):
            pass


def test_gradients_through_a_sparse_intermediate_both_modes(ti):
    # y (another pointer tree) is written by a struct-for over x: only x's active blocks
    # activate y's, and both modes see the same active cells.
    x = ti.field(ti.f32)
    y = ti.field(ti.f32)
    ti.root.pointer(ti.i, 4).dense(ti.i, 8).place(x, x.grad, x.dual)
    ti.root.pointer(ti.i, 4).dense(ti.i, 8).place(y, y.grad, y.dual)
    loss = ti.field(ti.f32, shape=(), needs_grad=True, needs_dual=True)
    x[9] = 1.0
    x[20] = 2.0

    @ti.kernel
    def f():
        for i in x:
            y[i] = x[i] * 3.0 + 1.0

    @ti.kernel
    def g():
        for i in y:
            loss[None] += y[i] ** 2

    with ti.ad.Tape(loss):
        f()
        g()
    xs = x.to_numpy()
    active = np.zeros(32, dtype=bool)
    active[8:24] = True  # blocks 1 and 2
    assert loss[None] == pytest.approx(float(np.sum((3 * xs[active] + 1) ** 2)))
    np.testing.assert_allclose(x.grad.to_numpy(), np.where(active, 6 * (3 * xs + 1), 0))
    with ti.ad.FwdMode(loss=loss, param=x, seed=[1.0] * 32):
        loss[None] = 0
        f()
        g()
    assert loss.dual[None] == pytest.approx(float(np.sum(6 * (3 * xs[active] + 1))))


def test_reading_inactive_cells_leaves_no_stale_gradient(ti):
    """A kernel reading every cell of a sparse field, inactive ones too (0), under the Tape:
    after ``s.grad.fill(0)`` every gradient reads 0, so a later backward pass that activates
    more cells computes the right gradient. (The adjoint of the read added into the grad of
    inactive cells without activating them, which fill(), writing active cells only, then
    left: a kernel read 2.6 instead of 0 and the second gradient was 3x instead of 2x.)"""
    x = ti.field(ti.f64, shape=8, needs_grad=True)
    loss = ti.field(ti.f64, shape=(), needs_grad=True)
    s = ti.field(ti.f64)
    ti.root.pointer(ti.i, 4).dense(ti.i, 2).place(s, s.grad)

    @ti.kernel
    def k1(m: ti.i32):
        for i in range(8):
            if i < m:
                s[i] = x[i] * 2.0

    @ti.kernel
    def k2():
        for i in range(8):
            loss[None] += s[i] * x[i]

    @ti.kernel
    def grad_total() -> ti.f64:
        t = 0.0
        for i in range(8):
            t += ti.abs(s.grad[i])
        return t

    xs = np.linspace(0.1, 0.8, 8)
    x.from_numpy(xs)
    with ti.ad.Tape(loss):
        k1(3)
        k2()
    np.testing.assert_allclose(x.grad.to_numpy(), np.where(np.arange(8) < 3, 4 * xs, 0.0))
    s.grad.fill(0.0)
    assert grad_total() == 0.0
    np.testing.assert_array_equal(s.grad.to_numpy(), np.zeros(8))
    x.grad.fill(0.0)
    loss[None] = 0.0
    k1(8)
    k2()
    loss.grad[None] = 1.0
    k2.grad()
    k1.grad(8)
    np.testing.assert_allclose(x.grad.to_numpy(), 4 * xs)


@pytest.mark.difftape_only
def test_append_to_a_full_list_raises(ti):
    # Storage is dense: a list cannot outgrow its declared size (Taichi's can), so appending
    # past it is an error rather than a dropped value.
    x = ti.field(ti.i32)
    ti.root.dynamic(ti.i, 4).place(x)

    @ti.kernel
    def push(n: ti.i32):
        for i in range(n):
            ti.append(x.parent(), [], i + 1)

    push(3)
    np.testing.assert_array_equal(x.to_numpy(), [1, 2, 3, 0])
    with pytest.raises(ti.KernelAssertionError, match="full"):
        push(3)
        ti.sync()  # (on a grid the launch is asynchronous: its error comes at a sync point)


def test_a_fields_snode_is_one_object(ti):
    """``x.snode`` is the same SNode each time: its ``parent(0)`` is itself (as in Taichi)."""
    val = ti.field(ti.i32)
    blk1 = ti.root.dense(ti.k, 3)
    blk2 = blk1.dense(ti.i, 7)
    blk3 = blk2.dense(ti.j, 11)
    blk3.place(val)
    m = ti.Matrix.field(3, 2, ti.i32, shape=4)
    for f in (val, m):
        assert f.snode == f.snode and f.snode.parent(0) == f.snode
    assert val.snode.parent() == blk3 and val.snode.parent(3) == blk1
    assert val.snode.parent(4) == ti.root and val.shape == (7, 11, 3)
    assert m.snode.parent().shape == (4,)


def test_parent_of_a_field_made_with_shape(ti):
    x = ti.field(ti.f32, shape=(4, 5))
    v = ti.Vector.field(2, ti.f32, shape=3)
    s = ti.field(ti.f32, shape=())
    p = x.parent()
    assert p.shape == (4, 5) and x.parent(2) == ti.root and p.parent() == ti.root
    assert x.parent() == p and x.snode.parent() == p
    assert v.parent().shape == (3,)
    assert s.parent().shape == () and s.parent(2) == ti.root and s.parent(3) is None

    @ti.kernel
    def count() -> ti.i32:
        n = 0
        for i, j in x.parent():  # a struct-for over the implicit SNode
            n += 1 + i * 0 + j * 0
        return n

    assert count() == 20


def test_append_a_struct_with_a_matrix_to_a_list(ti):
    # Taichi's test_dynamic.py::test_append_struct / test_append_matrix_in_struct.
    mat = ti.types.matrix(n=2, m=2, dtype=ti.u8)
    struct = ti.types.struct(a=ti.u64, b=mat, c=ti.u16)
    f = struct.field()
    ti.root.dense(ti.i, 4).dynamic(ti.j, 6, 4).place(f)

    @ti.kernel
    def make_list():
        for i in range(4):
            for j in range(i + 2):
                f[i].append(struct(i * j * ti.u64(10**10),
                                   ti.Matrix([[i * j, i * j * 2], [i * j * 3, i * j * 40]],
                                             dt=ti.u8),
                                   i * j * 5000))

    @ti.kernel
    def lengths() -> ti.types.vector(4, ti.i32):
        return ti.Vector([f[i].length() for i in range(4)])

    make_list()
    assert list(lengths()) == [2, 3, 4, 5]
    for i in range(4):
        for j in range(i + 2):
            assert f[i, j].a == i * j * 10**10
            np.testing.assert_array_equal(
                np.array(f[i, j].b), np.array([[i * j, i * j * 2], [i * j * 3, i * j * 40]]) % 256)
            assert f[i, j].c == i * j * 5000 % 65536
def test_one_size_serves_every_axis_of_a_node(ti):
    # As in Taichi (SNode::create_node): a size list of one entry is that size on each axis;
    # Taichi's mgpcg.py example builds its grid with ti.root.pointer(ti.ijk, [N // 4]).
    x = ti.field(ti.i32)
    ti.root.pointer(ti.ij, [2]).dense(ti.ij, [3]).place(x)
    assert x.shape == (6, 6)

    @ti.kernel
    def fill():
        for i, j in ti.ndrange(6, 6):
            x[i, j] = i * 10 + j

    fill()
    np.testing.assert_array_equal(x.to_numpy(), np.add.outer(np.arange(6) * 10, np.arange(6)))


def test_a_struct_field_in_a_dynamic_list(ti):
    # Taichi's marching_squares.py: a struct field placed in a dynamic SNode is a list of
    # structs, with edges.append(Edge(...)), edges.length() and edges.deactivate().
    Edge = ti.types.struct(a=ti.math.vec2, n=ti.i32)
    edges = Edge.field()
    ti.root.dynamic(ti.i, 16, chunk_size=4).place(edges)

    @ti.kernel
    def build(m: ti.i32) -> ti.i32:
        edges.deactivate()
        for i in range(m):
            edges.append(Edge(ti.math.vec2(i, 2 * i), i * i))
        return edges.length()

    def entries(m):
        n, a = edges.n.to_numpy()[:m], edges.a.to_numpy()[:m]
        return sorted((int(k), v.tolist()) for k, v in zip(n, a, strict=True))

    assert build(5) == 5
    assert entries(5) == [(i * i, [i, 2 * i]) for i in range(5)]
    assert build(3) == 3  # the list was cleared first
    assert entries(3) == [(i * i, [i, 2 * i]) for i in range(3)]


def test_snode_ops_out_of_range_raise_in_debug_mode_naming_the_index(ti):
    # ti.deactivate's bounds check used to fire on the zeroing of the cell's data, naming a
    # field the user never wrote and the scaled index ("index 36 ... of 'field#1' with shape
    # (16,)" for index 9 of a 4-cell pointer): now the cell index is checked first, as for
    # ti.is_active and ti.activate
    ti.init(arch=ti.cpu, debug=True)
    x, ptr = _pointer_field(ti, blocks=4, block=4)

    @ti.kernel
    def deactivate(j: ti.i32):
        ti.deactivate(ptr, [j])

    @ti.kernel
    def is_active(j: ti.i32) -> ti.i32:
        return ti.is_active(ptr, [j])

    @ti.kernel
    def activate(j: ti.i32):
        ti.activate(ptr, [j])

    x[13] = 5
    deactivate(3)  # in range: cell 3 (x[12:16]) is gone
    assert is_active(3) == 0 and x[13] == 0
    activate(2)
    assert is_active(2) == 1
    error = getattr(ti, "KernelAssertionError", None) or ti.TaichiAssertionError
    for call in (deactivate, is_active, activate):
        with pytest.raises(error) as info:
            call(9)
        msg = str(info.value)
        assert "9" in msg and "4" in msg and "36" not in msg, msg
