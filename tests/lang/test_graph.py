"""Graphs (``ti.graph``): a step captured once and replayed natively must compute bit for bit
what the eager step computes, take new values for its named inputs without a recapture, and
refuse what a replay could not repeat (host reads, other shapes) with an error naming the line.

The ``GraphBuilder`` tests are Taichi's API and also run on Taichi 1.7.4
(``DIFFTAPE_TEST_PEER=taichi``); ``ti.graph.capture()`` is difftape's (``difftape_only``).
The Tape / FwdMode / ``kernel.grad`` programs captured here are in tests/ad/test_graph_ad.py.
Under ``DIFFTAPE_SIMULATE_GPU`` the same tests replay graphs on the simulated grid
(runtime/gridgraph.py: graph executables, device memory), saved graphs included;
tests/core/test_grid_graph.py checks what only a grid has (instantiation, updates, asynchronous
errors, the CUDA stand-in). NumPy arrays as inputs need host memory (``host_memory``).
"""

import numpy as np
import pytest

difftape_only = pytest.mark.difftape_only


# ---------------------------------------------------------------------------------------------
# helpers: eager vs replay over every field of the program


def _storage():
    """Every field's storage (and .grad/.dual) by (field id, role)."""
    from difftape.runtime import program

    out = {}
    for fid, f in program.get().fields.items():
        for role in ("primal", "grad", "dual", "grad_dual"):
            c = f.companion(role)
            if c is not None:
                out[(fid, role)] = c.storage
    return out


def assert_replay_matches_eager(ti, step, repeats=3, declare=None, replays=None):
    """Run ``step`` eagerly ``repeats`` times, restore every field, capture it once and replay
    it ``repeats`` times: every field (and .grad/.dual) must have the same bytes.
    ``declare(g)``: declares the graph's inputs inside the capture and returns the arguments
    ``step`` takes; ``replays[k]``: the inputs of replay k (the eager step gets them too).
    Storage is read and written through its sync points, so this runs on the simulated grid
    too (device memory; a read waits for the replay's launches)."""
    store = _storage()
    before = {k: s.read().copy() for k, s in store.items()}
    replays = replays or [{}] * repeats
    for kw in replays:
        step(**kw)
    eager = {k: s.read().copy() for k, s in store.items()}
    for k, s in store.items():
        s.write()[...] = before[k]
    with ti.graph.capture() as g:
        args = declare(g) if declare is not None else {}
        step(**args)
    for k, s in store.items():  # capturing ran nothing
        assert s.read().tobytes() == before[k].tobytes(), f"capture changed {k}"
    for kw in replays:
        g.replay(**kw)
    for k, s in store.items():
        assert s.read().tobytes() == eager[k].tobytes(), f"replay differs from eager in {k}"
    return g


# ---------------------------------------------------------------------------------------------
# capture and replay


@difftape_only
def test_replay_equals_eager_for_launches_fills_and_copies(ti):
    n = 300
    x = ti.field(ti.f32, shape=n)
    y = ti.Vector.field(3, ti.f32, shape=(n, 2))
    z = ti.field(ti.i32, shape=())
    w = ti.field(ti.f32, shape=n)

    @ti.kernel
    def advance(dt: ti.f32, v: ti.types.vector(3, ti.f32)):
        for i in x:
            x[i] = ti.sin(x[i] + dt * i) * 1.5
        for i, j in y:
            y[i, j] = y[i, j] * 0.5 + v * x[i]
        z[None] += 1

    @ti.kernel
    def reduce():
        for i in x:
            z[None] += ti.cast(x[i] > 0, ti.i32)

    x.from_numpy(np.linspace(-1, 1, n).astype(np.float32))

    def step():
        advance(0.01, ti.Vector([1.0, 2.0, 3.0]))
        reduce()
        w.copy_from(x)
        x[3] = 7.0
        y[2, 1] = [1.0, 2.0, 3.0]

    g = assert_replay_matches_eager(ti, step)
    assert g.launches == 2


@difftape_only
def test_a_fill_with_negative_zero_keeps_its_sign(ti):
    """-0.0 is all-zero as a number but not as bits: the replay must write -0.0, as the eager
    fill does (it was recorded as zeroing the memory)."""
    x = ti.field(ti.f32, shape=4)
    v = ti.Vector.field(2, ti.f64, shape=3)
    x.fill(1)

    def step():
        x.fill(-0.0)
        v.fill([0.0, -0.0])

    assert_replay_matches_eager(ti, step)
    assert np.signbit(x.to_numpy()).all() and np.signbit(v.to_numpy()[:, 1]).all()


@difftape_only
@pytest.mark.host_memory  # (NumPy inputs)
def test_named_inputs_take_new_values_without_recapture(ti):
    n = 64
    x = ti.field(ti.f32, shape=n)
    out = ti.field(ti.f32, shape=n)

    @ti.kernel
    def scale(a: ti.f32, k: ti.i32, arr: ti.types.ndarray(dtype=ti.f32, ndim=1)):
        for i in range(k):
            out[i] = x[i] * a + arr[i]

    x.from_numpy(np.arange(n, dtype=np.float32))
    src = np.ones(n, dtype=np.float32)
    with ti.graph.capture() as g:
        a = g.input("a", 2.0)
        k = g.input("k", ti.i32)
        arr = g.input("arr", src)
        scale(a, k, arr)
    assert sorted(g.inputs) == ["a", "arr", "k"]
    with pytest.raises(ti.GraphError, match="input 'k' has no value"):
        g.replay()
    g.replay(k=n)
    np.testing.assert_array_equal(out.to_numpy(), np.arange(n) * 2.0 + 1)
    other = np.full(n, 10, dtype=np.float32)
    out.fill(0)
    g.replay(a=0.5, k=10, arr=other)  # the range depends on k: computed at replay
    want = np.zeros(n)
    want[:10] = np.arange(10) * 0.5 + 10
    np.testing.assert_array_equal(out.to_numpy(), want)
    g.replay(a=3.0)  # the others keep their last values
    want[:10] = np.arange(10) * 3.0 + 10
    np.testing.assert_array_equal(out.to_numpy(), want)
    with pytest.raises(ti.GraphError, match="captured with shape"):
        g.replay(arr=np.ones(2 * n, dtype=np.float32))
    with pytest.raises(ti.GraphError, match="dtype=f64"):
        g.replay(arr=np.ones(n))
    with pytest.raises(ti.ArgumentError, match="must be an integer"):
        g.replay(k=1.5)
    with pytest.raises(ti.GraphError, match="no input 'b'"):
        g.replay(b=1)


@difftape_only
def test_field_inputs_are_swapped_for_fields_of_the_same_kind(ti):
    a = ti.field(ti.f32, shape=8)
    b = ti.field(ti.f32, shape=8)
    c = ti.field(ti.f32, shape=9)
    out = ti.field(ti.f32, shape=8)

    @ti.kernel
    def double(src: ti.template()):
        for i in src:
            out[i] = 2 * src[i]

    a.from_numpy(np.arange(8, dtype=np.float32))
    b.from_numpy(np.arange(8, dtype=np.float32) + 100)
    with ti.graph.capture() as g:
        src = g.input("src", a)
        src.fill(1)
        double(src)
    g.replay()
    np.testing.assert_array_equal(out.to_numpy(), np.full(8, 2.0))
    b.from_numpy(np.arange(8, dtype=np.float32) + 100)
    g.replay(src=b)
    np.testing.assert_array_equal(b.to_numpy(), np.ones(8))  # the fill went to b
    np.testing.assert_array_equal(out.to_numpy(), np.full(8, 2.0))
    with pytest.raises(ti.GraphError, match="capture the graph again"):
        g.replay(src=c)


@difftape_only
def test_deactivating_every_cell_inside_a_capture_is_a_step_of_the_graph(ti):
    """SNode.deactivate_all() in Python scope inside the capture clears the cells where it
    stands in the step, at each replay (it ran once, while capturing, before any launch:
    bench/fuzz_graph.py)."""
    d = ti.field(ti.i32)
    ti.root.dynamic(ti.i, 32, chunk_size=4).place(d)
    p = ti.field(ti.i32)
    blk = ti.root.pointer(ti.i, 4)
    blk.dense(ti.i, 4).place(p)
    c = ti.field(ti.i32, shape=4)

    @ti.kernel
    def fill():
        for i in range(5):
            ti.append(d.parent(), [], i)
        for i in range(16):
            p[i] = i

    @ti.kernel
    def count(k: ti.i32):
        c[k] = ti.length(d.parent(), [])
        for i in p:
            c[k + 1] += p[i] * 0 + 1

    def step():
        c.fill(0)
        fill()
        count(0)
        d.parent().deactivate_all()
        blk.deactivate_all()
        count(2)

    assert_replay_matches_eager(ti, step, repeats=2)
    np.testing.assert_array_equal(c.to_numpy(), [5, 16, 0, 0])


@difftape_only
def test_host_reads_inside_a_capture_are_refused_naming_the_line(ti):
    x = ti.field(ti.f32, shape=4)
    nd = ti.ndarray(ti.f32, shape=4)

    @ti.kernel
    def total() -> ti.f32:
        s = 0.0
        for i in x:
            s += x[i]
        return s

    @ti.kernel
    def inc(a: ti.f32):
        for i in x:
            x[i] += a

    cases = [
        lambda g: x[0],
        lambda g: x.to_numpy(),
        lambda g: nd.to_numpy(),
        lambda g: nd[1],
        lambda g: total(),
        lambda g: inc(1.0) if x[0] > 0 else None,  # a Python branch on a field value
        lambda g: inc(g.input("a", 1.0) * 2),  # Python arithmetic on an input
        lambda g: float(g.input("b", ti.f32)),
    ]
    for case in cases:
        with pytest.raises(ti.GraphCaptureError, match=r"test_graph\.py:\d+"):
            with ti.graph.capture() as g:
                case(g)
        with ti.graph.capture() as g2:  # the program is left able to capture again
            inc(1.0)
        assert g2.launches == 1
    # nothing ran: the refused captures and the captures never replayed left x as it was
    np.testing.assert_array_equal(x.to_numpy(), np.zeros(4))


@difftape_only
def test_replay_raises_the_eager_error_of_a_failing_launch(ti):
    ti.init(arch=ti.cpu, debug=True)
    x = ti.field(ti.f32, shape=4)

    @ti.kernel
    def poke(i: ti.i32):
        x[i] = 1.0

    with ti.graph.capture() as g:
        poke(g.input("i", 0))
    g.replay(i=3)
    assert x[3] == 1.0
    with pytest.raises(ti.IndexOutOfRangeError) as eager:
        poke(7)
    with pytest.raises(ti.IndexOutOfRangeError) as replayed:
        g.replay(i=7)
    assert str(replayed.value) == str(eager.value)
    g.replay(i=2)  # the graph still runs after a failure
    assert x[2] == 1.0


@difftape_only
def test_replay_shows_a_failed_asserts_values_as_the_eager_launch(ti):
    ti.init(arch=ti.cpu, debug=True)
    x = ti.field(ti.f32, shape=4)

    @ti.kernel
    def check(limit: ti.f32, k: ti.i64):
        for i in x:
            assert x[i] < limit, f"x[{i}] = {x[i]} >= {limit} (k={k})"

    x.from_numpy(np.array([0.0, 0.25, 2.5, 0.0], np.float32))
    with ti.graph.capture() as g:
        check(g.input("limit", 1.0), g.input("k", 0))
    g.replay(limit=3.0, k=1)
    with pytest.raises(ti.KernelAssertionError) as eager:
        check(1.0, -(2 ** 40))
    with pytest.raises(ti.KernelAssertionError) as replayed:
        g.replay(limit=1.0, k=-(2 ** 40))
    assert str(eager.value).startswith(f"x[2] = 2.5 >= 1 (k={-(2 ** 40)})\n")
    assert str(replayed.value) == str(eager.value)


@difftape_only
def test_a_graph_of_an_ended_program_is_refused(ti):
    x = ti.field(ti.f32, shape=4)

    @ti.kernel
    def inc():
        for i in x:
            x[i] += 1

    with ti.graph.capture() as g:
        inc()
    g()
    ti.reset()
    ti.init(arch=ti.cpu)
    with pytest.raises(ti.GraphError, match="capture it again"):
        g()


# ---------------------------------------------------------------------------------------------
# Taichi's GraphBuilder API (these also run on Taichi 1.7.4)


def test_graph_builder_ndarray_and_scalar_arguments(ti):
    n = 4

    @ti.kernel
    def fill(pos: ti.types.ndarray(dtype=ti.f32, ndim=1), v: ti.f32, k: ti.i32):
        for i in range(n):
            pos[i] = v + i * k

    sym_pos = ti.graph.Arg(ti.graph.ArgKind.NDARRAY, "pos", ti.f32, ndim=1)
    sym_v = ti.graph.Arg(ti.graph.ArgKind.SCALAR, "v", ti.f32)
    sym_k = ti.graph.Arg(ti.graph.ArgKind.SCALAR, "k", ti.i32)
    builder = ti.graph.GraphBuilder()
    builder.dispatch(fill, sym_pos, sym_v, sym_k)
    g = builder.compile()
    a = ti.ndarray(ti.f32, shape=(n,))
    g.run({"pos": a, "v": 2.5, "k": 1})
    np.testing.assert_array_equal(a.to_numpy(), [2.5, 3.5, 4.5, 5.5])
    b = ti.ndarray(ti.f32, shape=(8,))  # another shape: an ndarray argument fixes ndim only
    g.run({"pos": b, "v": 1.0, "k": 3})
    np.testing.assert_array_equal(b.to_numpy(), [1, 4, 7, 10, 0, 0, 0, 0])
    with pytest.raises(RuntimeError, match="but got an ndarray with dtype="):
        g.run({"pos": ti.ndarray(ti.i32, shape=(n,)), "v": 1.0, "k": 1})
    with pytest.raises(RuntimeError, match="Dispatch node is compiled for"):
        g.run({"pos": ti.ndarray(ti.f32, shape=(n, n)), "v": 1.0, "k": 1})


def test_graph_builder_sequential_and_matrix_arguments(ti):
    @ti.kernel
    def vector_sum(mat: ti.types.vector(3, ti.f32), res: ti.types.ndarray(dtype=ti.f32, ndim=1)):
        res[0] = mat.sum() + mat[2]

    @ti.kernel
    def matrix_sum(mat: ti.types.matrix(2, 2, ti.i32), res: ti.types.ndarray(dtype=ti.i32,
                                                                             ndim=0)):
        res[None] = mat.sum()

    @ti.kernel
    def double(res: ti.types.ndarray(dtype=ti.f32, ndim=1)):
        res[0] = res[0] * 2

    sym_v = ti.graph.Arg(ti.graph.ArgKind.MATRIX, "v", ti.types.vector(3, ti.f32))
    sym_m = ti.graph.Arg(ti.graph.ArgKind.MATRIX, "m", ti.types.matrix(2, 2, ti.i32))
    sym_r = ti.graph.Arg(ti.graph.ArgKind.NDARRAY, "r", ti.f32, ndim=1)
    sym_ri = ti.graph.Arg(ti.graph.ArgKind.NDARRAY, "ri", ti.i32, ndim=0)
    builder = ti.graph.GraphBuilder()
    seq = builder.create_sequential()
    seq.dispatch(vector_sum, sym_v, sym_r)
    seq.dispatch(double, sym_r)
    builder.dispatch(matrix_sum, sym_m, sym_ri)
    builder.append(seq)
    g = builder.compile()
    r = ti.ndarray(ti.f32, shape=(1,))
    ri = ti.ndarray(ti.i32, shape=())
    g.run({"v": ti.Vector([1.5, 2.0, 4.0]), "m": ti.Matrix([[1, 2], [3, 4]]), "r": r, "ri": ri})
    assert r.to_numpy()[0] == 2 * (7.5 + 4.0)
    assert ri.to_numpy() == 10


def test_graph_builder_refuses_mismatched_arguments_at_dispatch(ti):
    @ti.kernel
    def test(pos: ti.types.ndarray(dtype=ti.f32, ndim=1), val: ti.f32):
        for i in range(4):
            pos[i] = val

    builder = ti.graph.GraphBuilder()
    with pytest.raises(ti.TaichiCompilationError, match="doesn't match kernel's annotated ndim"):
        builder.dispatch(test, ti.graph.Arg(ti.graph.ArgKind.NDARRAY, "pos", ti.f32, ndim=2),
                         ti.graph.Arg(ti.graph.ArgKind.SCALAR, "val", ti.f32))
    with pytest.raises(ti.TaichiCompilationError,
                       match="doesn't match kernel's annotated dtype"):
        builder.dispatch(test, ti.graph.Arg(ti.graph.ArgKind.NDARRAY, "pos", ti.i32, ndim=1),
                         ti.graph.Arg(ti.graph.ArgKind.SCALAR, "val", ti.f32))
    with pytest.raises(ti.TaichiCompilationError,
                       match="doesn't match kernel's annotated dtype"):
        builder.dispatch(test, ti.graph.Arg(ti.graph.ArgKind.NDARRAY, "pos", ti.f32, ndim=1),
                         ti.graph.Arg(ti.graph.ArgKind.SCALAR, "val", ti.i32))


def test_graph_builder_refuses_one_name_for_two_arguments(ti):
    @ti.kernel
    def test1(pos: ti.types.ndarray(ndim=1)):
        pos[0] = 2.5

    @ti.kernel
    def test2(v: ti.f32, out: ti.types.ndarray(ndim=1)):
        out[0] = v

    builder = ti.graph.GraphBuilder()
    builder.dispatch(test1, ti.graph.Arg(ti.graph.ArgKind.NDARRAY, "pos", ti.f32, ndim=1))
    with pytest.raises(RuntimeError):
        builder.dispatch(test2, ti.graph.Arg(ti.graph.ArgKind.SCALAR, "pos", ti.f32),
                         ti.graph.Arg(ti.graph.ArgKind.NDARRAY, "out", ti.f32, ndim=1))


# ---------------------------------------------------------------------------------------------
# saved graphs

_SAVED_PROGRAM = '''
import sys, numpy as np, difftape as ti
mode, path = sys.argv[1], sys.argv[2]
ti.init(arch=ti.cpu)
n = 64
if mode == "save":
    x = ti.field(ti.f32, shape=n, needs_grad=True, name="x")
    v = ti.Vector.field(2, ti.f32, shape=n, name="v")
    loss = ti.field(ti.f32, shape=(), needs_grad=True, name="loss")

    @ti.kernel
    def f(a: ti.f32):
        for i in x:
            loss[None] += ti.sin(x[i] * a) ** 2
            v[i] = ti.Vector([x[i], a])

    @ti.kernel
    def upd(lr: ti.f32):
        for i in x:
            x[i] -= lr * x.grad[i]

    def step(lr):
        with ti.ad.Tape(loss):
            f(1.5)
        upd(lr)
        v[3] = [7.0, 8.0]

    x.from_numpy(np.linspace(0, 1, n).astype(np.float32))
    x0 = x.to_numpy()
    with ti.graph.capture() as g:
        step(g.input("lr", 0.1))
    g.save(path)
    for lr in (0.1, 0.2):
        step(lr)
    np.savez(path + ".npz", x0=x0, x=x.to_numpy(), v=v.to_numpy(), g=x.grad.to_numpy(),
             loss=loss.to_numpy())
else:
    ref = np.load(path + ".npz")
    g = ti.graph.load(path)
    assert sorted(g.fields) == ["loss", "v", "x"], g.fields
    g.fields["x"].from_numpy(ref["x0"])
    g.replay()
    g.replay(lr=0.2)
    got = {"x": g.fields["x"].to_numpy(), "v": g.fields["v"].to_numpy(),
           "g": g.fields["x"].grad.to_numpy(), "loss": g.fields["loss"].to_numpy()}
    assert all(got[k].tobytes() == ref[k].tobytes() for k in got), "replay differs"
    print("same")
'''


def _cache_files(path):
    return sorted(p for p in path.rglob("*") if p.is_file())


def _run_saved(tmp_path, mode, graph_file, cache):
    import os
    import subprocess
    import sys

    script = tmp_path / "saved_program.py"
    script.write_text(_SAVED_PROGRAM)
    env = dict(os.environ, DIFFTAPE_CACHE_DIR=str(cache))
    r = subprocess.run([sys.executable, str(script), mode, str(graph_file)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


@difftape_only
def test_a_saved_graph_replays_in_another_process_from_the_disk_cache(tmp_path):
    cache = tmp_path / "cache"
    graph_file = tmp_path / "step.graph.json"
    _run_saved(tmp_path, "save", graph_file, cache)
    compiled = _cache_files(cache)
    assert compiled
    assert "same" in _run_saved(tmp_path, "load", graph_file, cache)
    assert _cache_files(cache) == compiled  # every kernel came from the disk cache


@difftape_only
def test_loading_validates_a_graph_file_from_elsewhere(ti, tmp_path):
    import json

    x = ti.field(ti.f32, shape=8, name="x")

    @ti.kernel
    def inc(a: ti.f32):
        for i in x:
            x[i] += a

    with ti.graph.capture() as g:
        inc(1.0)
        x.fill(2.0)
    path = tmp_path / "g.json"
    g.save(str(path))
    good = json.loads(path.read_text())

    def refused(edit, match):
        doc = json.loads(json.dumps(good))
        edit(doc)
        path.write_text(json.dumps(doc))
        with pytest.raises(ti.GraphError, match=match):
            ti.graph.load(str(path))

    fid = next(iter(good["fields"]))
    refused(lambda d: d["fields"][fid].update(shape=[4]), "not one of the graph's fields")
    refused(lambda d: d["fields"][fid].update(dtype="i32"), "not one of the graph's fields")
    refused(lambda d: d["ops"][1].update(end=9), "does not fit")
    refused(lambda d: d["kernels"][0].update(variant="native"), "variant")
    refused(lambda d: d["kernels"][0]["ir"].update(buffers=[]), "kernel 0")
    refused(lambda d: d["ops"][0].update(params=[1, 2]), "parameters")
    refused(lambda d: d.update(format="pickle"), "not a difftape-graph file")
    path.write_text(json.dumps(good))
    g2 = ti.graph.load(str(path), fields={"x": x})
    x.fill(0)
    g2()
    np.testing.assert_array_equal(x.to_numpy(), np.full(8, 2.0))
    with pytest.raises(ti.GraphError, match="must be a dense field"):
        ti.graph.load(str(path), fields={"x": ti.field(ti.f32, shape=9)})


@difftape_only
def test_a_saved_graph_keeps_its_fields_offsets(ti, tmp_path):
    """Its kernels index from a field's offset=: the field a load makes has it (Python scope
    and the bounds checks count from it), and a field given for it must have it."""
    import json

    x = ti.field(ti.f32, shape=6, offset=-3, name="x")
    v = ti.Vector.field(2, ti.f32, shape=(2, 3), offset=(4, -1), name="v")

    @ti.kernel
    def step(a: ti.f32):
        for i in x:
            x[i] += a * i
        for i, j in v:
            v[i, j] = ti.Vector([x[i - 6], x[j]])

    with ti.graph.capture() as g:
        step(g.input("a", 1.0))
    path = str(tmp_path / "g.json")
    g.save(path)
    doc = json.loads(open(path).read())
    assert sorted(f.get("offset") for f in doc["fields"].values()) == [[-3], [4, -1]]
    loaded = ti.graph.load(path)
    lx, lv = loaded.fields["x"], loaded.fields["v"]
    assert (lx.offset, lv.offset) == ((-3,), (4, -1))
    lx[-3] = 10.0
    loaded.replay(a=2.0)
    want = np.array([4.0, -4.0, -2.0, 0.0, 2.0, 4.0], np.float32)  # x[i] = 2 * i, x[-3] + -6
    np.testing.assert_array_equal(lx.to_numpy(), want)
    assert lx[-3] == 4.0 and list(lv[5, 1]) == [want[2], want[4]]
    with pytest.raises(ti.GraphError, match=r"offset \(-3,\)"):
        ti.graph.load(path, fields={"x": ti.field(ti.f32, shape=6, name="x")})
    loaded = ti.graph.load(path, fields={"x": x})
    x.fill(1.0)
    loaded.replay()
    np.testing.assert_array_equal(x.to_numpy(), 1.0 + np.arange(-3, 3))
    (fid,) = [k for k, f in doc["fields"].items() if f["label"] == "x"]
    for bad, match in (([2**31 - 6], "does not fit in i32"), ([0], "zeros"),
                       ([1, 2], "one integer per axis"), (["1"], "must be an integer")):
        doc["fields"][fid]["offset"] = bad
        with open(path, "w") as fh:
            json.dump(doc, fh)
        with pytest.raises(ti.GraphError, match=match):
            ti.graph.load(path)


@difftape_only
def test_a_saved_copy_between_fields_reads_the_source_at_each_replay(ti, tmp_path):
    """``b.copy_from(a)`` in a saved graph copies ``a``'s bytes of the replay, not the bytes
    ``a`` held when the graph was saved."""
    a = ti.field(ti.f32, shape=6, name="a")
    b = ti.field(ti.f32, shape=6, name="b")

    @ti.kernel
    def bump():
        for i in a:
            a[i] += 1.0

    a.from_numpy(np.arange(6, dtype=np.float32))
    with ti.graph.capture() as g:
        bump()
        b.copy_from(a)
    path = str(tmp_path / "copy.json")
    g.save(path)
    loaded = ti.graph.load(path, fields={"a": a, "b": b})
    a.from_numpy(np.full(6, 10, np.float32))
    loaded()
    loaded()
    np.testing.assert_array_equal(b.to_numpy(), np.full(6, 12.0))
    np.testing.assert_array_equal(a.to_numpy(), np.full(6, 12.0))
