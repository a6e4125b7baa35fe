"""Python-scope operations written inside kernels.

A kernel's body runs once, at compile time, to build its IR, so a field method that simply did
its work then would run once instead of at every launch. ``fill`` compiles to a loop over the
field, as in Taichi; every other bulk or element-access method of Field, Vector/Matrix fields
and ndarrays is refused at compile time with the kernel's line.
"""

import numpy as np
import pytest


def test_fill_in_a_kernel_runs_at_every_launch(ti, fp, npfp):
    g = ti.field(float, shape=(4, 3))
    v = ti.Vector.field(2, float, shape=5)
    m = ti.Matrix.field(2, 2, ti.i32, shape=2)
    s = ti.field(ti.i32, shape=())

    @ti.kernel
    def step():
        g.fill(2.0)
        v.fill(1.5)
        m.fill(3)
        s.fill(0)
        for i, j in g:
            g[i, j] += 10
        for i in v:
            v[i] += ti.Vector([i, 1.0])
        for i in m:
            m[i][0, 1] += 1
        s[None] += 1

    for _ in range(3):
        step()
        np.testing.assert_array_equal(g.to_numpy(), np.full((4, 3), 12.0))
        np.testing.assert_array_equal(v.to_numpy(),
                                      np.stack([np.arange(5) + 1.5, np.full(5, 2.5)], 1))
        np.testing.assert_array_equal(m.to_numpy(), [[[3, 4], [3, 3]]] * 2)
        assert s[None] == 1


def test_fill_with_a_vector_and_a_runtime_value(ti, fp):
    v = ti.Vector.field(2, float, shape=3)
    g = ti.field(float, shape=4)

    @ti.kernel
    def run(a: float):
        v.fill(ti.Vector([a, 2 * a]))
        g.fill(a + 1)

    run(1.5)
    np.testing.assert_array_equal(v.to_numpy(), [[1.5, 3.0]] * 3)
    np.testing.assert_array_equal(g.to_numpy(), [2.5] * 4)
    run(-1.0)
    np.testing.assert_array_equal(v.to_numpy(), [[-1.0, -2.0]] * 3)
    np.testing.assert_array_equal(g.to_numpy(), [0.0] * 4)


def test_fill_in_a_kernel_is_differentiated(ti):
    x = ti.field(ti.f32, shape=(), needs_grad=True)
    y = ti.field(ti.f32, shape=4, needs_grad=True)
    loss = ti.field(ti.f32, shape=(), needs_grad=True)

    @ti.kernel
    def forward():
        y.fill(x[None] * 3.0)

    @ti.kernel
    def total():
        for i in y:
            loss[None] += y[i] * (i + 1)

    x[None] = 2.0
    with ti.ad.Tape(loss):
        forward()
        total()
    assert loss[None] == pytest.approx(6.0 * 10)
    assert x.grad[None] == pytest.approx(3.0 * 10)


def _line(key):
    """1-based number of the only line in this file that ends with ``# marker: <key>``."""
    with open(__file__, encoding="utf-8") as f:
        hits = [n for n, t in enumerate(f.read().splitlines(), 1)
                if t.rstrip().endswith(f"# marker: {key}")]
    assert len(hits) == 1, hits
    return hits[0]


@pytest.mark.difftape_only
def test_every_python_scope_method_is_refused_in_a_kernel(ti):
    """Walks the bulk and element-access methods of fields and ndarrays: each either compiles
    to kernel code (fill, indexing) or raises a CompileError naming this line."""
    g = ti.field(ti.f32, shape=4)
    h = ti.field(ti.f32, shape=4)
    v = ti.Vector.field(2, ti.f32, shape=3)
    a = ti.ndarray(ti.f32, shape=4)
    arr = np.zeros(4, dtype=np.float32)
    cases = {
        "field.to_numpy": lambda: g.to_numpy(),
        "field.from_numpy": lambda: g.from_numpy(arr),
        "field.copy_from": lambda: h.copy_from(g),
        "vector_field.to_numpy": lambda: v.to_numpy(),
        "vector_field.from_numpy": lambda: v.from_numpy(np.zeros((3, 2))),
        "vector_field.copy_from": lambda: v.copy_from(v),
        "ndarray.to_numpy": lambda: a.to_numpy(),
        "ndarray.from_numpy": lambda: a.from_numpy(arr),
        "ndarray.fill": lambda: a.fill(1.0),
        "ndarray.copy_from": lambda: a.copy_from(a),
        "ndarray.__getitem__": lambda: a[0],
        "ndarray.__setitem__": lambda: a.__setitem__(0, 1.0),
    }
    import difftape

    # Every public method of the classes is either covered here or known to be kernel-safe.
    # (append/length/deactivate of dynamic lists are kernel-only; parent() and
    # get_scalar_field() work in both.)
    kernel_safe = {"Field": {"fill", "companion", "buffer", "make_mark", "append", "length",
                             "deactivate", "parent", "get_scalar_field"}, "Ndarray": set()}
    for cls, prefix in ((difftape.Field, "field"), (difftape.Ndarray, "ndarray")):
        public = {n for n in vars(cls) if not n.startswith("_") and callable(getattr(cls, n))}
        covered = {k.split(".")[1] for k in cases if k.startswith(prefix + ".")}
        assert public <= covered | kernel_safe[cls.__name__], public - covered

    def kernel_calling(call):
        @ti.kernel
        def uses():
            call()  # marker: python-scope call

        return uses

    for name, call in cases.items():
        with pytest.raises(ti.CompileError) as info:
            kernel_calling(call)()
        message = str(info.value)
        assert "Python scope" in message, (name, message)
        assert f"line {_line('python-scope call')}," in message, (name, message)
    assert g.to_numpy().sum() == 0 and h.to_numpy().sum() == 0


@pytest.mark.difftape_only
def test_fill_inside_a_loop_is_refused(ti):
    g = ti.field(ti.f32, shape=4)

    @ti.kernel
    def nested():
        for i in range(2):
            g.fill(i)

    with pytest.raises(ti.CompileError, match="inside a loop"):
        nested()


@pytest.mark.difftape_only
def test_to_numpy_of_a_kernel_vector_is_refused(ti):
    v = ti.Vector.field(2, ti.f32, shape=3)

    @ti.kernel
    def run():
        for i in v:
            a = v[i].to_numpy()
            v[i] = a

    with pytest.raises(ti.CompileError, match="Python scope"):
        run()
