"""ti.graph on a grid program (runtime/gridgraph.py): graph executables instantiated once.

On the simulated grid (``simulate_grid``; CI's stand-in for a GPU) and on the CUDA launcher
with the stand-in driver (tests/cuda_standin.py: stream capture, instantiation, graph launch
and in-place update, all deferred), a captured step replays as graph executables: one per
run of asynchronous launches and device copies, instantiated at the first replay and never
again; new scalars and arrays of the same shape reach the kernels through their launch
contexts in device memory (one upload per replay), new copy addresses through an update of
the executable. Replays equal eager runs bit for bit; errors come back at the next sync
point with the CPU's text; a launch whose host decides something after it (stack overflow
reruns, printing, debug checks) runs between executables as eagerly.
tests/lang/test_graph.py and tests/ad/test_graph_ad.py run whole under
``DIFFTAPE_SIMULATE_GPU``; tests/gpu/test_graph_device.py runs a step on a real device.
"""

import numpy as np
import pytest
from cuda_standin import FakeDriver, use

import difftape as ti
from difftape.runtime import program
from tests.lang.test_graph import assert_replay_matches_eager

pytestmark = pytest.mark.difftape_only

GRID = (2, 32)


@pytest.fixture
def grid():
    ti.init(arch=ti.cpu, simulate_grid=GRID)
    yield
    ti.reset()


@pytest.fixture
def fake(monkeypatch):
    """ti.init(arch=ti.cuda) finds the stand-in device; its code is the simulated grid's."""
    yield use(monkeypatch, FakeDriver())
    ti.reset()


def _step_program(n=100):
    """A step with scalar, vector, ndarray and field inputs, a fill and a copy."""
    x = ti.field(ti.f32, shape=n)
    y = ti.Vector.field(2, ti.f32, shape=n)
    w = ti.field(ti.f32, shape=n)
    total = ti.field(ti.f32, shape=())

    @ti.kernel
    def advance(dt: ti.f32, v: ti.types.vector(2, ti.f32), k: ti.i32,
                arr: ti.types.ndarray(dtype=ti.f32, ndim=1)):
        for i in range(k):
            x[i] = x[i] * 0.5 + dt * arr[i]
        for i in y:
            y[i] = v * x[i]

    @ti.kernel
    def reduce(src: ti.template()):
        for i in src:
            total[None] += src[i]

    return x, y, w, total, advance, reduce


def test_replays_instantiate_once_and_take_new_inputs_through_memory(grid):
    n = 100
    x, y, w, total, advance, reduce = _step_program(n)
    a = ti.ndarray(ti.f32, shape=n)
    b = ti.ndarray(ti.f32, shape=n)
    a.from_numpy(np.linspace(0, 1, n).astype(np.float32))
    b.from_numpy(np.linspace(5, 3, n).astype(np.float32))
    x.from_numpy(np.linspace(-1, 1, n).astype(np.float32))

    def step(dt=0.1, v=None, k=n, arr=a):
        advance(dt, v, k, arr)
        w.copy_from(x)
        w.fill(3.0)
        reduce(x)

    replays = [{"dt": 0.1, "v": ti.Vector([1.0, 2.0]), "k": n, "arr": a},
               {"dt": -0.3, "v": ti.Vector([0.5, 4.0]), "k": 40, "arr": b},
               {"dt": 0.7, "v": ti.Vector([2.0, -1.0]), "k": 7, "arr": a}]

    def declare(g):
        return {"dt": g.input("dt", ti.f32), "v": g.input("v", ti.types.vector(2, ti.f32)),
                "k": g.input("k", ti.i32), "arr": g.input("arr", a)}

    g = assert_replay_matches_eager(ti, step, declare=declare, replays=replays)
    assert g.launches == 2
    assert (g.instantiations, g.updates) == (1, 0)  # kernel nodes never change
    for _ in range(3):
        g.replay(dt=0.2, arr=b)
    assert (g.instantiations, g.updates) == (1, 0)


def test_a_copy_into_another_field_updates_the_executable_in_place(grid):
    a = ti.field(ti.f32, shape=8)
    b = ti.field(ti.f32, shape=8)
    c = ti.field(ti.f32, shape=9)
    out = ti.field(ti.f32, shape=8)

    @ti.kernel
    def double(src: ti.template()):
        for i in src:
            out[i] = 2 * src[i] + out[i]

    with ti.graph.capture() as g:
        src = g.input("src", a)
        src.fill(1)
        double(src)
        out.copy_from(src)
    g.replay()
    np.testing.assert_array_equal(out.to_numpy(), np.full(8, 1.0))
    b.from_numpy(np.arange(8, dtype=np.float32) + 100)
    g.replay(src=b)  # the fill and the copy address b now: the executable is updated
    np.testing.assert_array_equal(b.to_numpy(), np.ones(8))
    np.testing.assert_array_equal(out.to_numpy(), np.ones(8))
    assert (g.instantiations, g.updates) == (1, 1)
    a.from_numpy(np.zeros(8, np.float32))
    g.replay(src=a)
    g.replay()  # nothing moved: no update
    np.testing.assert_array_equal(a.to_numpy(), np.ones(8))
    assert (g.instantiations, g.updates) == (1, 2)
    with pytest.raises(ti.GraphError, match="capture the graph again"):
        g.replay(src=c)


def test_an_asynchronous_error_comes_back_at_the_next_sync_with_the_cpus_text(grid):
    ti.init(arch=ti.cpu, simulate_grid=GRID, check_out_of_bound=True)
    x = ti.field(ti.f32, shape=4)

    @ti.kernel
    def poke(i: ti.i32):
        x[i] = 1.0

    @ti.kernel
    def after():
        for i in x:
            x[i] += 10.0

    with ti.graph.capture() as g:
        poke(g.input("i", 0))
        after()
    g.replay(i=7)  # asynchronous: nothing has run yet
    with pytest.raises(ti.IndexOutOfRangeError) as replayed:
        ti.sync()
    np.testing.assert_array_equal(x.to_numpy(), np.zeros(4))  # `after` returned at once
    poke(7)
    with pytest.raises(ti.IndexOutOfRangeError) as eager:
        ti.sync()
    assert str(replayed.value) == str(eager.value)
    assert "poke" in str(eager.value)
    g.replay(i=2)  # the graph still runs after a failure
    np.testing.assert_array_equal(x.to_numpy(), [10, 10, 11, 10])
    assert g.instantiations == 1


@pytest.mark.parametrize("where", ["simulated grid", "CUDA stand-in"])
def test_a_host_step_over_another_field_leaves_the_kernels_own_context(where, request):
    """A host step (here: a kernel that prints) runs from the graph's packed context; after
    a replay that bound a field input to another field, the kernel's eager launches and later
    captures still address the kernel's own field (bench/fuzz_graph.py found eager launches,
    and a graph captured later, writing the other field)."""
    if where == "simulated grid":
        ti.init(arch=ti.cpu, simulate_grid=GRID)
    else:
        request.getfixturevalue("fake")
        ti.init(arch=ti.cuda)
    x = ti.field(ti.f32, shape=8)
    other = ti.field(ti.f32, shape=8)

    @ti.kernel
    def bump():
        for i in x:
            x[i] += 1.0
            if x[i] > 1e30:
                print("huge", i)

    with ti.graph.capture() as g:
        g.input("x", x)
        bump()
    assert [p for p in g._grid_graph.parts if isinstance(p, tuple)]  # a host step
    g.replay(x=other)
    bump()  # eagerly: x
    with ti.graph.capture() as g2:
        bump()
    g2.replay()  # x again
    np.testing.assert_array_equal(x.to_numpy(), np.full(8, 2.0))
    np.testing.assert_array_equal(other.to_numpy(), np.ones(8))
    ti.reset()


@pytest.mark.parametrize("where", ["simulated grid", "CUDA stand-in"])
def test_launches_the_host_decides_after_run_between_executables(where, request):
    """The MPM Tape step with a gradient step (tests/gpu/test_graph_device.py's): its p2g
    takes private copies, may overflow and is rerun from snapshots by the host, so it runs
    between the executables before and after it, as eagerly."""
    if where == "simulated grid":
        ti.init(arch=ti.cpu, simulate_grid=GRID, default_fp=ti.f64, deterministic=True)
    else:
        request.getfixturevalue("fake")
        ti.init(arch=ti.cuda, default_fp=ti.f64, deterministic=True)
    from tests.ad.test_mpm_modes import descent_step

    step, declare, init_v, other = descent_step(ti)
    g = assert_replay_matches_eager(ti, step, declare=declare, replays=[{"lr": 0.05}, {"lr": 0.02}])
    gg = g._grid_graph
    hosts = [p for p in gg.parts if isinstance(p, tuple)]
    assert hosts and all(not k.asynchronous for k, _ in hosts)
    segments = len(gg.parts) - len(hosts)
    assert (g.instantiations, g.updates) == (segments, 0)  # one per executable, once
    g.replay(lr=0.01, keep=other)
    np.testing.assert_array_equal(other.to_numpy(), init_v.to_numpy())
    assert (g.instantiations, g.updates) == (segments, 1)
    ti.reset()


def test_on_the_cuda_launcher_a_replay_is_captured_instantiated_and_launched_once(fake):
    ti.init(arch=ti.cuda)
    n = 100
    x, y, w, total, advance, reduce = _step_program(n)
    a = ti.ndarray(ti.f32, shape=n)
    a.from_numpy(np.linspace(0, 1, n).astype(np.float32))
    x.from_numpy(np.linspace(-1, 1, n).astype(np.float32))
    other = ti.field(ti.f32, shape=n)

    def step(dt=0.1, k=n, dst=w):
        advance(dt, ti.Vector([1.0, 2.0]), k, a)
        dst.copy_from(x)
        reduce(x)

    replays = [{"dt": 0.1, "k": n, "dst": w}, {"dt": -0.3, "k": 40, "dst": w}]
    g = assert_replay_matches_eager(
        ti, step, replays=replays,
        declare=lambda g: {"dt": g.input("dt", ti.f32), "k": g.input("k", ti.i32),
                           "dst": g.input("dst", w)})
    calls = fake.graph_calls
    assert calls["instantiate"] == 1 and calls["launch_graph"] == 2
    assert "exec_update" not in calls
    launches = len(fake.launches)
    g.replay(dt=0.5, dst=other)  # the copy's destination moved: updated, not instantiated
    assert len(fake.launches) == launches  # no kernel launched one by one
    assert len(fake.captured_launches) == 2 * 3  # 3 tasks, captured twice (the update's)
    assert (calls["instantiate"], calls["exec_update"], calls["launch_graph"]) == (1, 1, 3)
    assert (g.instantiations, g.updates) == (1, 1)
    np.testing.assert_array_equal(other.to_numpy(), x.to_numpy())
    assert calls["destroy_graph"] == calls["end_capture"] == 2  # captures: freed
    prog = program.get()
    del g
    import gc

    gc.collect()
    assert calls.get("destroy_exec") == 1
    assert prog.launcher.allocator.memory.stream.captured is None


def test_on_the_cuda_launcher_a_skipped_update_shows(fake, monkeypatch):
    """The stand-in's executables keep the addresses they were captured with: were the update
    skipped, the copy would still go to the first field (checks the stand-in itself)."""
    from difftape.runtime.cuda import CudaGraphExec

    ti.init(arch=ti.cuda)
    a = ti.field(ti.f32, shape=8)
    b = ti.field(ti.f32, shape=8)

    with ti.graph.capture() as g:
        g.input("dst", a).fill(2.0)
    g.replay()
    monkeypatch.setattr(CudaGraphExec, "update", lambda self, nodes: None)
    g.replay(dst=b)
    assert b.to_numpy().tolist() == [0.0] * 8  # the stale executable filled a again
    assert a.to_numpy().tolist() == [2.0] * 8


def test_numpy_arrays_in_a_grid_graph_are_refused_saying_what_to_use(grid):
    """A NumPy argument of a grid launch is copied into device memory for that launch only;
    a graph would replay over the copy made at capture time, so it is refused."""

    @ti.kernel
    def scale(arr: ti.types.ndarray(dtype=ti.f32, ndim=1)):
        for i in arr:
            arr[i] *= 2

    host = np.ones(4, np.float32)
    with pytest.raises(ti.GraphCaptureError, match=r"ti\.ndarray.*test_grid_graph\.py:\d+|"
                                                     r"test_grid_graph\.py:\d+.*ti\.ndarray"):
        with ti.graph.capture():
            scale(host)
    with pytest.raises(ti.GraphError, match="use a ti.ndarray"):
        with ti.graph.capture() as g:
            g.input("arr", host)
    np.testing.assert_array_equal(host, np.ones(4))
    nd = ti.ndarray(ti.f32, shape=4)
    nd.from_numpy(host)
    with ti.graph.capture() as g:
        scale(g.input("arr", nd))
    g.replay()
    g.replay()
    np.testing.assert_array_equal(nd.to_numpy(), np.full(4, 4.0))
    with pytest.raises(ti.GraphError, match="got a NumPy array"):
        g.replay(arr=host)


class _FakeLibcuda:
    """The graph calls of ``libcuda`` as ctypes makes them (handles as ``c_void_p``, outputs
    by reference), recorded; ``update_rc``: what ``cuGraphExecUpdate`` returns. Without
    ``v2`` it is CUDA 11's library (no ``cuGraphExecUpdate_v2``)."""

    def __init__(self, v2=True, update_rc=0):
        self.calls = []
        self.update_rc = update_rc
        if not v2:
            self.__dict__["cuGraphExecUpdate_v2"] = None  # (looked up, absent: see below)

    def __getattr__(self, name):
        if name == "cuGraphExecUpdate_v2" and "cuGraphExecUpdate_v2" in self.__dict__:
            raise AttributeError(name)  # CDLL's answer for a missing symbol

        def call(*args):
            self.calls.append((name, args))
            out = {"cuStreamEndCapture": (1, 0x6000), "cuGraphInstantiateWithFlags": (0, 0x7000)}
            if name in out:
                k, value = out[name]
                args[k]._obj.value = value
            if name.startswith("cuGraphExecUpdate"):
                return self.update_rc
            return 0
        return call


def _value(a):
    return getattr(a, "value", a)


@pytest.mark.parametrize("v2", [True, False], ids=["CUDA 12", "CUDA 11"])
def test_the_cuda_graph_calls_through_ctypes(v2):
    """runtime/cuda.py's binding of the CUDA graph calls (what the stand-in driver replaces):
    the right symbols with the handles and flags cuda.h declares, outputs read back, and
    cuGraphExecUpdate's refusal (CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE) told from an error."""
    from difftape.errors import DifftapeError
    from difftape.runtime.cuda import CudaDriverApi

    lib = _FakeLibcuda(v2=v2)
    api = CudaDriverApi(lib)
    api.begin_capture(0x42)
    assert api.end_capture(0x42) == 0x6000
    assert api.instantiate(0x6000) == 0x7000
    assert api.exec_update(0x7000, 0x6000) is True
    api.launch_graph(0x7000, 0x42)
    api.destroy_graph(0x6000)
    api.destroy_exec(0x7000)
    names = [n for n, _ in lib.calls]
    update = "cuGraphExecUpdate_v2" if v2 else "cuGraphExecUpdate"
    assert names == ["cuStreamBeginCapture_v2", "cuStreamEndCapture",
                     "cuGraphInstantiateWithFlags", update, "cuGraphLaunch", "cuGraphDestroy",
                     "cuGraphExecDestroy"]
    args = dict(lib.calls)
    assert [_value(a) for a in args["cuStreamBeginCapture_v2"]] == [0x42, 1]  # thread-local
    assert _value(args["cuGraphInstantiateWithFlags"][2]) == 0  # no flags
    assert len(args[update]) == (3 if v2 else 4)
    assert [_value(a) for a in args["cuGraphLaunch"]] == [0x7000, 0x42]
    lib.update_rc = 910
    assert api.exec_update(0x7000, 0x6000) is False  # not allowed in place: instantiate again
    lib.update_rc = 700
    with pytest.raises(DifftapeError, match=r"cuGraphExecUpdate failed \(CUDA error 700\)"):
        api.exec_update(0x7000, 0x6000)


def test_an_update_cuda_refuses_instantiates_again_saying_so(fake, monkeypatch, caplog):
    ti.init(arch=ti.cuda)
    a = ti.field(ti.f32, shape=8)
    b = ti.field(ti.f32, shape=8)
    with ti.graph.capture() as g:
        g.input("dst", a).fill(2.0)
    g.replay()
    monkeypatch.setattr(fake.api, "exec_update", lambda exe, graph: False)
    g.replay(dst=b)
    np.testing.assert_array_equal(b.to_numpy(), np.full(8, 2.0))
    assert (g.instantiations, g.updates) == (2, 1)
    assert fake.graph_calls["instantiate"] == 2 and fake.graph_calls["destroy_exec"] == 1
    assert "instantiated again" in caplog.text


# ---------------------------------------------------------------------------------------------
# saved graphs on a grid: the document is target-independent (kernels as IR, storage by name)

def _saved_step_program():
    """A Tape step with a scalar input, a fill, an element write and a copy between fields."""
    n = 48
    x = ti.field(ti.f32, shape=n, needs_grad=True, name="x")
    v = ti.Vector.field(2, ti.f32, shape=n, name="v")
    keep = ti.field(ti.f32, shape=n, name="keep")
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
        keep.copy_from(x)
        with ti.ad.Tape(loss):
            f(1.5)
        upd(lr)
        v.fill(0.25)
        v[3] = [7.0, 8.0]

    x.from_numpy(np.linspace(0, 1, n).astype(np.float32))
    return x, v, keep, loss, step


def _state(fields):
    return {k: (f.to_numpy(), f.grad.to_numpy() if k in ("x", "loss") else None)
            for k, f in fields.items()}


def _same_state(a, b):
    for k in a:
        for u, w in zip(a[k], b[k], strict=True):
            assert (u is None and w is None) or u.tobytes() == w.tobytes(), k


@pytest.mark.parametrize("load_on", ["grid", "cpu"])
def test_a_graph_saved_on_a_grid_loads_and_replays_equal_to_the_eager_step(tmp_path, load_on):
    """Saved on the simulated grid, loaded on the grid or the CPU: each replay equals the
    eager step on the target it runs on (a reduction's order is the target's)."""
    lrs = (0.1, 0.3, 0.05)

    def init():
        ti.init(arch=ti.cpu, simulate_grid=GRID) if load_on == "grid" else ti.init(arch=ti.cpu)

    init()  # the truth: the eager step where the graph is loaded
    x, v, keep, loss, step = _saved_step_program()
    x0 = x.to_numpy()
    for lr in lrs:
        step(lr)
    eager = _state({"x": x, "v": v, "keep": keep, "loss": loss})
    ti.reset()

    ti.init(arch=ti.cpu, simulate_grid=GRID)
    x, v, keep, loss, step = _saved_step_program()
    with ti.graph.capture() as g:
        step(g.input("lr", 0.1))
    path = str(tmp_path / "step.graph.json")
    g.save(path)
    if load_on == "grid":  # (the graph it was saved from replays alike)
        for lr in lrs:
            g.replay(lr=lr)
        _same_state(eager, _state({"x": x, "v": v, "keep": keep, "loss": loss}))
    ti.reset()

    init()
    loaded = ti.graph.load(path)
    assert sorted(loaded.fields) == ["keep", "loss", "v", "x"]
    loaded.fields["x"].from_numpy(x0)
    for lr in lrs:
        loaded.replay(lr=lr)
    _same_state(eager, _state(loaded.fields))
    assert (loaded.instantiations >= 1) == (load_on == "grid")  # graph executables
    ti.reset()


def test_a_graph_saved_on_the_cpu_loads_on_the_cuda_launcher(fake, tmp_path):
    ti.init(arch=ti.cuda)  # the truth: the eager step on the CUDA launcher
    x, v, keep, loss, step = _saved_step_program()
    x0 = x.to_numpy()
    for lr in (0.2, 0.1):
        step(lr)
    want = _state({"x": x, "v": v, "keep": keep, "loss": loss})
    ti.reset()

    ti.init(arch=ti.cpu)
    x, v, keep, loss, step = _saved_step_program()
    with ti.graph.capture() as g:
        step(g.input("lr", 0.1))
    path = str(tmp_path / "step.graph.json")
    g.save(path)
    ti.reset()

    ti.init(arch=ti.cuda)
    launched = fake.graph_calls.get("launch_graph", 0)
    loaded = ti.graph.load(path)
    loaded.fields["x"].from_numpy(x0)
    loaded.replay(lr=0.2)
    loaded.replay(lr=0.1)
    _same_state(want, _state(loaded.fields))
    assert fake.graph_calls["launch_graph"] - launched >= 2  # replayed as CUDA graphs


def _by_label(doc):
    """A saved-graph document with every field id replaced by the field's label (ids are
    per program)."""
    label = {int(k): f["label"] for k, f in doc["fields"].items()}

    def walk(o):
        if isinstance(o, dict):
            out = {k: walk(v) for k, v in o.items()}
            if isinstance(o.get("field"), int):
                out["field"] = label[o["field"]]
            if isinstance(o.get("source"), list):
                out["source"] = [label[o["source"][0]], *o["source"][1:]]
            return out
        if isinstance(o, list):
            if len(o) == 3 and o[0] == "field" and isinstance(o[1], int):
                return ["field", label[o[1]], o[2]]
            return [walk(v) for v in o]
        return o

    out = walk({k: v for k, v in doc.items() if k != "fields"})
    out["fields"] = sorted(f.items() for f in doc["fields"].values())
    return out


def test_a_graph_saved_on_a_grid_is_the_document_the_cpu_saves(tmp_path):
    """The document is target-independent: kernels as frontend IR, storage by field, a fill
    as a fill (a grid records it as a copy of the filled bytes)."""
    import json

    docs = []
    for grid in (None, GRID):
        ti.init(arch=ti.cpu, **({"simulate_grid": grid} if grid else {}))
        x, v, keep, loss, step = _saved_step_program()
        with ti.graph.capture() as g:
            step(g.input("lr", 0.1))
        path = tmp_path / f"{grid is not None}.json"
        g.save(str(path))
        docs.append(json.loads(path.read_text()))
        ti.reset()
    cpu, grid = docs
    assert any(op["op"] == "fill" for op in grid["ops"])
    assert _by_label(grid) == _by_label(cpu)
