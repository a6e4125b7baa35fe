"""Fields with an ``offset=`` (Taichi's: the index of the first element along each axis) run
unchanged under ``arch=ti.remote``: kernels, struct-fors, Python-scope element access at
negative indices, whole-array transfers, gradients, captured and saved graphs, and the
bounds-check errors, all bit for bit as the local run (truth: ``check_out_of_bound=True``,
what the server compiles), over HTTP and through an in-process engine.

The service stores fields from index 0 (the frontend subtracts the offset in the IR, the
client in Python scope); the offset travels with the field (``create_field``) and with the
IR's buffers, so that what reports an index (the bounds checks) reports the user's index,
and the server refuses IR whose offset is not its field's."""

import json

import numpy as np
import pytest

import difftape as ti
from difftape.client import LocalTransport

from .test_client_programs import run_local, same


def offset_program():
    """Scalar, vector and matrix fields with offsets (``ti.field(offset=)`` and
    ``place(offset=)``), written and read every way a program can."""
    x = ti.field(ti.f32, shape=8, offset=-4, needs_grad=True)
    v = ti.Vector.field(2, ti.f32)
    ti.root.dense(ti.ij, (3, 4)).place(v, offset=(-1, 2))
    m = ti.Matrix.field(2, 2, ti.f64, shape=(2, 3), offset=(5, -7))
    loss = ti.field(ti.f32, shape=(), needs_grad=True)

    @ti.kernel
    def init(a: ti.f32):
        for i in x:  # a struct-for runs over offset .. offset + shape
            x[i] = a * i
        for i, j in v:
            v[i, j] = ti.Vector([i, j * a])
        for i, j in ti.ndrange((5, 7), (-7, -4)):
            m[i, j] = ti.Matrix([[i, j], [i * j, a]])

    @ti.kernel
    def total():
        for i in x:
            loss[None] += x[i] ** 2 + x[i] * v[-1, 2][0]

    @ti.kernel
    def shift():
        for i in range(-4, 3):
            x[i] = x[i + 1] - x[i]

    init(0.5)
    x[-4] = 3.0  # Python scope, as written
    x[3] += 1.0
    v[1, 5] = [7.0, -2.0]
    v[0, 3][1] = 9.0  # an entry of an element
    m[6, -5] = [[1.0, 2.0], [3.0, 4.0]]
    items = [x[-4], x[3], v[1, 5], v[-1, 2], m[6, -5], m[5, -7]]
    before = x.to_numpy()
    with ti.ad.Tape(loss):
        total()
    grads = x.grad.to_numpy()
    shift()
    arr = np.linspace(-1.0, 1.0, 24, dtype=np.float32).reshape(3, 4, 2)
    v.from_numpy(arr)
    return {"items": items, "before": before, "loss": loss[None], "grad": grads,
            "x": x.to_numpy(), "v": v.to_numpy(), "v[-1, 4]": v[-1, 4], "m": m.to_numpy(),
            "offsets": [x.offset, v.offset, m.offset, x.grad.offset]}


def test_offset_fields_run_remotely_bit_for_bit(remote):
    truth = run_local(offset_program)
    # The local truth is right: storage index k holds element k + offset.
    before = 0.5 * np.arange(-4, 4, dtype=np.float32)
    before[0], before[7] = 3.0, before[7] + 1
    np.testing.assert_array_equal(truth["before"], before)
    np.testing.assert_allclose(truth["grad"], 2 * before + truth["items"][3][0], rtol=1e-6)
    assert truth["offsets"] == [(-4,), (-1, 2), (5, -7), (-4,)]
    np.testing.assert_array_equal(truth["m"][1, 2], [[1.0, 2.0], [3.0, 4.0]])
    np.testing.assert_array_equal(truth["m"][0, 0], [[5.0, -7.0], [-35.0, 0.5]])
    same(truth, remote(offset_program))


def _out_of_range(local: bool):
    """Out-of-range indices into an offset field: in a kernel (debug mode), in Python scope.
    Returns the messages and exception classes."""
    x = ti.field(ti.f32, shape=8, offset=-4)
    v = ti.Vector.field(2, ti.f32, shape=(3, 4), offset=(-1, 2))

    @ti.kernel
    def poke(i: ti.i32, j: ti.i32):
        x[i] = 1.0
        v[j, 3][0] = 2.0

    poke(-4, -1)  # in range: fine
    out = []
    for i, j in ((4, 0), (-5, 0), (0, 2), (3, -2)):
        with pytest.raises(ti.IndexOutOfRangeError) as err:
            poke(i, j)
            ti.sync()
        out.append((type(err.value).__name__, str(err.value), err.value.kernel))
    for key in (4, -5):
        with pytest.raises(ti.IndexOutOfRangeError) as err:
            x[key]
        out.append((type(err.value).__name__, str(err.value)))
    with pytest.raises(ti.IndexOutOfRangeError) as err:
        v[2, 2] = [0.0, 0.0]
    out.append((type(err.value).__name__, str(err.value)))
    out.append(x.to_numpy())
    return out


def test_an_out_of_range_index_is_the_local_error(remote):
    ti.init(arch=ti.cpu, debug=True)
    try:
        local = _out_of_range(True)
    finally:
        ti.reset()
    # The user's index and the field's offset, as Taichi's debug mode reports them.
    assert "index 4 out of range for axis 0 of 'x' with shape (8,) and offset (-4,)" \
        in local[0][1]
    assert "index 2 out of range for axis 0" in local[2][1] and "offset (-1, 2)" in local[2][1]
    got = remote(lambda: _out_of_range(False), debug=True)
    same(local, got)


def graph_program():
    """A captured step over offset fields (a launch with an input, a fill, an element
    write), replayed."""
    x = ti.field(ti.f32, shape=10, offset=-5)
    y = ti.Vector.field(3, ti.f32, shape=(4, 2), offset=(2, -1))

    @ti.kernel
    def step(dt: ti.f32):
        for i in x:
            x[i] = ti.sin(x[i] + dt * i)
        for i, j in y:
            y[i, j] += ti.Vector([x[i - 5], x[j], dt])

    x.from_numpy(np.linspace(-1, 1, 10).astype(np.float32))
    with ti.graph.capture() as g:
        step(g.input("dt", 0.1))
        x[-5] = 2.0
        y.fill(0.25)
        step(0.5)
    for k in range(3):
        g.replay(dt=0.1 * (k + 1))
    return {"x": x.to_numpy(), "y": y.to_numpy(), "x[4]": x[4], "y[5, 0]": y[5, 0]}


def test_a_captured_graph_over_offset_fields_replays_remotely(remote):
    same(run_local(graph_program), remote(graph_program))


def test_a_bad_index_in_a_replay_reports_the_users_index(remote):
    def program():
        x = ti.field(ti.f32, shape=4, offset=10)

        @ti.kernel
        def poke(i: ti.i32):
            x[i] = 1.0

        with ti.graph.capture() as g:
            poke(g.input("i", 10))
        g.replay(i=13)
        with pytest.raises(ti.IndexOutOfRangeError) as err:
            g.replay(i=14)
        return str(err.value), x.to_numpy()

    local = run_local(program)
    assert "index 14 out of range for axis 0 of 'x' with shape (4,) and offset (10,)" \
        in local[0]
    same(local, remote(program))


def test_a_saved_graph_over_offset_fields_loads_with_its_offsets(remote, tmp_path):
    path = str(tmp_path / "step.json")

    def make():
        x = ti.field(ti.f32, shape=6, offset=-3, needs_grad=True, name="x")
        loss = ti.field(ti.f32, shape=(), needs_grad=True, name="loss")

        @ti.kernel
        def f():
            for i in x:
                loss[None] += x[i] * i

        @ti.kernel
        def upd(lr: ti.f32):
            for i in x:
                x[i] -= lr * x.grad[i]

        with ti.graph.capture() as g:
            with ti.ad.Tape(loss):
                f()
            upd(g.input("lr", 0.1))
        g.save(path)

    def use():
        g = ti.graph.load(path)
        x = g.fields["x"]
        x[-3] = 1.0
        x[2] = 2.0
        g.replay()
        g.replay(lr=0.5)
        return {"offset": x.offset, "x": x.to_numpy(), "x[-3]": x[-3],
                "grad": x.grad.to_numpy(), "loss": g.fields["loss"][None]}

    ti.init(arch=ti.cpu, check_out_of_bound=True)
    try:
        make()
        truth = use()
    finally:
        ti.reset()
    assert truth["offset"] == (-3,)
    np.testing.assert_array_equal(truth["grad"], np.arange(-3, 3))
    same(truth, remote(use))
    # The document's kernels index from the offset: a field without it is refused.
    doc = json.loads(open(path).read())
    (fid,) = [k for k, f in doc["fields"].items() if f["label"] == "x"]
    del doc["fields"][fid]["offset"]
    open(path, "w").write(json.dumps(doc))
    for run in (run_local, remote):
        with pytest.raises(ti.GraphError, match=r"buffer 'x' has offset \(-3,\), its field "
                                                "offset None"):
            run(lambda: ti.graph.load(path).replay())


def test_the_session_save_keeps_offsets():
    """A culled session resumes with its fields' offsets: its kernels register again and
    report the user's index."""
    from difftape.runtime import program
    from difftape.server.engine import Engine

    engine = Engine()
    ti.init(arch=ti.remote, transport=LocalTransport(engine))
    try:
        x = ti.field(ti.f32, shape=4, offset=-2)

        @ti.kernel
        def poke(i: ti.i32):
            x[i] = i

        poke(-2)
        ti.sync()
        _, saved = engine.execute({"op": "save"})
        fresh = Engine()
        fresh.execute({"op": "load"}, bytes(saved))
        assert fresh.prog.fields[x.id].offset == (-2,)
        program.get().remote.transport.engine = fresh
        poke(1)
        with pytest.raises(ti.IndexOutOfRangeError,
                           match=r"index 2 out of range .* and offset \(-2,\)"):
            poke(2)
            ti.sync()
        np.testing.assert_array_equal(x.to_numpy(), [-2.0, 0.0, 0.0, 1.0])
    finally:
        ti.reset()


def test_grad_check_names_the_users_index_remotely(remote):
    """``Tape(grad_check=...)`` (one server op) reports a wrong gradient at the element's
    index as the program writes it, as locally."""

    def program():
        x = ti.field(ti.f64, shape=4, offset=-2, needs_grad=True)
        loss = ti.field(ti.f64, (), needs_grad=True)

        @ti.kernel
        def f():
            for i in x:
                loss[None] += x[i] ** 2

        @ti.ad.grad_replaced
        def forward():
            f()

        @ti.ad.grad_for(forward)
        def backward():  # deliberately wrong at x[1] (storage index 3)
            f.grad()
            x.grad[1] = x.grad[1] + 1.0

        x.from_numpy(np.arange(1.0, 5.0))
        with pytest.raises(ti.ad.GradientCheckError) as info:
            with ti.ad.Tape(loss, grad_check=[x]):
                forward()
        return str(info.value)

    here = run_local(program)
    assert here.endswith("x[1]: gradient 9, finite difference 8")
    assert remote(program) == here
