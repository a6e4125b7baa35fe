"""``ti.graph.capture()`` under ``arch=ti.remote`` (issue 20, item 4): the same capture API,
no user code changes; the graph goes to the server once and each replay is one request that
replays it natively there. A remote replay must leave every field bit for bit as a local
replay does (truth: the local runtime with ``check_out_of_bound=True``, what the server
compiles), over HTTP against the real server and through an in-process engine. Sizes keep
every parallel loop on one thread (float atomics then add in the same order everywhere).
"""

import json

import numpy as np
import pytest

import difftape as ti
from difftape.client import LocalTransport

from .test_client_programs import run_local, same


def trips(f):
    before = ti.remote_stats()["round_trips"]
    f()
    return ti.remote_stats()["round_trips"] - before


# ---------------------------------------------------------------------------- programs

def launches_fills_and_writes():
    """Launches with scalar and vector inputs, a fill, element writes, a from_numpy."""
    n = 40
    x = ti.field(ti.f32, shape=n)
    y = ti.Vector.field(3, ti.f32, shape=(n, 2))
    z = ti.field(ti.i32, shape=())
    w = ti.field(ti.f32, shape=n)

    @ti.kernel
    def advance(dt: ti.f32, v: ti.types.vector(3, ti.f32), k: ti.i32):
        for i in x:
            x[i] = ti.sin(x[i] + dt * i) * 1.5
        for i, j in y:
            y[i, j] = y[i, j] * 0.5 + v * x[i]
        z[None] += k

    x.from_numpy(np.linspace(-1, 1, n).astype(np.float32))
    with ti.graph.capture() as g:
        dt = g.input("dt", 0.01)
        v = g.input("v", ti.types.vector(3, ti.f32))
        advance(dt, v, 2)
        w.fill(3.0)
        x[3] = 7.0
        y[2, 1] = [1.0, 2.0, 3.0]
        z.from_numpy(np.array(5, dtype=np.int32))
    for k in range(3):
        g.replay(dt=0.01 * (k + 1), v=ti.Vector([1.0, k, -2.0]))
    g.replay(dt=-0.5)  # v keeps its last value
    return {"x": x.to_numpy(), "y": y.to_numpy(), "z": z.to_numpy(), "w": w.to_numpy(),
            "launches": g.launches}


def tape_step():
    """A Tape (forward and reverse launches, gradients cleared, the loss seeded) and a
    gradient-descent update with the learning rate as an input."""
    n = 16
    x = ti.field(ti.f64, shape=n, needs_grad=True)
    y = ti.field(ti.f64, shape=n, needs_grad=True)
    loss = ti.field(ti.f64, shape=(), needs_grad=True)

    @ti.kernel
    def forward(a: ti.f64):
        for i in x:
            y[i] = ti.sin(x[i] * a) + x[i] ** 2
        for i in y:
            loss[None] += y[i] * y[i]

    @ti.kernel
    def descend(lr: ti.f64):
        for i in x:
            x[i] -= lr * x.grad[i]

    x.from_numpy(np.linspace(-1, 1, n))
    with ti.graph.capture() as g:
        lr = g.input("lr", 0.01)
        with ti.ad.Tape(loss=loss):
            forward(1.3)
        descend(lr)
    losses = []
    for lr in (0.01, 0.02, 0.005):
        g.replay(lr=lr)
        losses.append(loss.to_numpy())
    return {"x": x.to_numpy(), "grad": x.grad.to_numpy(), "y": y.to_numpy(),
            "losses": losses}


def forward_mode_and_kernel_grad():
    """``FwdMode`` launches and ``kernel.grad()`` calls, captured together."""
    n = 12
    x = ti.field(ti.f32, shape=n, needs_grad=True, needs_dual=True)
    y = ti.field(ti.f32, shape=n, needs_grad=True, needs_dual=True)
    loss = ti.field(ti.f32, shape=(), needs_dual=True)

    @ti.kernel
    def f(a: ti.f32):
        for i in x:
            y[i] = ti.exp(ti.sin(x[i]) * a) + x[i] * x[i]

    @ti.kernel
    def total():
        for i in y:
            loss[None] += y[i]

    x.from_numpy(np.linspace(-1, 1, n).astype(np.float32))
    with ti.graph.capture() as g:
        a = g.input("a", ti.f32)
        with ti.ad.FwdMode(loss=loss, param=x, seed=[1.0] * n):
            f(a)
            total()
        y.grad.fill(1.0)
        f.grad(a)
    out = {}
    for a in (1.5, -0.5):
        g.replay(a=a)
        out[f"dual{a}"] = loss.dual.to_numpy()
    out["x_grad"] = x.grad.to_numpy()
    out["y"] = y.to_numpy()
    return out


def array_and_field_inputs():
    """NumPy array inputs (bytes each replay; written ones copied back), a ti.ndarray
    argument, and a field input swapped for another field of its kind."""
    n = 8
    a = ti.field(ti.f32, shape=n)
    b = ti.field(ti.f32, shape=n)
    out = ti.field(ti.f32, shape=n)
    nd = ti.ndarray(ti.f32, shape=n)

    @ti.kernel
    def mix(src: ti.template(), arr: ti.types.ndarray(dtype=ti.f32, ndim=1),
            res: ti.types.ndarray(dtype=ti.f32, ndim=1), k: ti.i32):
        for i in range(k):
            out[i] = 2 * src[i] + arr[i]
            res[i] = out[i] + 1

    @ti.kernel
    def bump(q: ti.types.ndarray(dtype=ti.f32, ndim=1)):
        for i in q:
            q[i] += 0.5

    a.from_numpy(np.arange(n, dtype=np.float32))
    b.from_numpy(np.arange(n, dtype=np.float32) + 100)
    arr = np.ones(n, dtype=np.float32)
    res = np.zeros(n, dtype=np.float32)
    with ti.graph.capture() as g:
        src = g.input("src", a)
        src.fill(1)
        mix(src, g.input("arr", arr), g.input("res", res), g.input("k", n))
        bump(nd)
    g.replay()
    first = res.copy()
    other, res2 = np.full(n, 10, dtype=np.float32), np.zeros(n, dtype=np.float32)
    g.replay(arr=other, res=res2, src=b, k=5)
    arr[:] = -1  # the graph reads the array's bytes at each replay
    g.replay(src=a)
    return {"first": first, "res2": res2, "res": res, "out": out.to_numpy(),
            "a": a.to_numpy(), "b": b.to_numpy(), "nd": nd.to_numpy()}


def numpy_inputs_copied_in():
    """NumPy array inputs given to from_numpy (a field's, a vector field's, an ndarray's)
    inside the capture: each replay copies the array bound then (another one, or the same
    one changed in place), never the bytes it had at capture."""
    n = 6
    x = ti.field(ti.f64, shape=n)
    v = ti.Vector.field(2, ti.f32, shape=n)
    nd = ti.ndarray(ti.i32, shape=n)
    total = ti.field(ti.f64, shape=())

    @ti.kernel
    def add(q: ti.types.ndarray(dtype=ti.i32, ndim=1)):
        for i in x:
            total[None] += x[i] * q[i] + v[i][1]

    xv = np.linspace(-1, 1, n)
    vv = np.arange(2 * n, dtype=np.float32).reshape(n, 2)
    iv = np.arange(n, dtype=np.int32)
    with ti.graph.capture() as g:
        x.from_numpy(g.input("xv", xv))
        v.from_numpy(g.input("vv", vv))
        nd.from_numpy(g.input("iv", iv))
        add(nd)
    g.replay()
    first = (x.to_numpy(), total.to_numpy())
    g.replay(xv=xv[::-1].copy(), iv=-iv)
    second = (x.to_numpy(), v.to_numpy(), nd.to_numpy(), total.to_numpy())
    vv[:] = 7.0  # the array bound to 'vv' changed in place: the next replay copies it
    g.replay()
    return {"first": first, "second": second, "x": x.to_numpy(), "v": v.to_numpy(),
            "nd": nd.to_numpy(), "total": total.to_numpy()}


def nonfinite_constants():
    """Kernels whose IR holds infinite and NaN constants (ti.math.isinf compares with
    infinity): the graph's document, and its id, carry them as the eager launches do."""
    n = 4
    x = ti.field(ti.f32, shape=n)
    o = ti.field(ti.f32, shape=(n, 3))

    @ti.kernel
    def k(s: ti.f32):
        for i in range(n):
            o[i, 0] = ti.cast(ti.math.isinf(x[i] * s), ti.f32)
            o[i, 1] = ti.min(x[i], ti.math.inf) + ti.max(x[i] * s, -ti.math.inf)
            o[i, 2] = ti.select(x[i] > 1.0, ti.math.nan, x[i])

    x.from_numpy(np.array([0.5, 2.0, -3e38, 1e-3], dtype=np.float32))
    with ti.graph.capture() as g:
        k(g.input("s", 1.0))
    g.replay()
    first = o.to_numpy()
    g.replay(s=1e10)
    return {"first": first, "o": o.to_numpy()}


def test_numpy_inputs_copied_in_are_copied_at_each_replay():
    """The local truth of numpy_inputs_copied_in is what the replays should copy."""
    _check_numpy_inputs_copied_in(run_local(numpy_inputs_copied_in))


def _check_numpy_inputs_copied_in(got: dict) -> None:
    xs, vs, iv = np.linspace(-1, 1, 6), np.arange(12.0).reshape(6, 2), np.arange(6)
    t1 = np.sum(xs * iv + vs[:, 1])
    t2 = t1 + np.sum(xs[::-1] * -iv + vs[:, 1])
    same(got["second"][0], xs[::-1].copy())
    same(got["second"][2], (-iv).astype(np.int32))
    same(got["v"], np.full((6, 2), 7.0, dtype=np.float32))
    assert got["total"] == pytest.approx(t2 + np.sum(xs[::-1] * -iv + 7.0), rel=1e-12)


@pytest.mark.parametrize("program", [launches_fills_and_writes, tape_step,
                                     forward_mode_and_kernel_grad, array_and_field_inputs,
                                     numpy_inputs_copied_in, nonfinite_constants],
                         ids=lambda p: p.__name__)
def test_remote_replay_equals_local_replay_bit_for_bit(remote, program):
    truth = run_local(program)
    got = remote(program)
    same(truth, got)


def test_local_truth_is_the_eager_step():
    """The local replays the remote ones are compared with equal the eager step (here for
    the Tape step: the same descent run without a graph)."""
    replayed = run_local(tape_step)

    def eager():
        n = 16
        x = ti.field(ti.f64, shape=n, needs_grad=True)
        y = ti.field(ti.f64, shape=n, needs_grad=True)
        loss = ti.field(ti.f64, shape=(), needs_grad=True)

        @ti.kernel
        def forward(a: ti.f64):
            for i in x:
                y[i] = ti.sin(x[i] * a) + x[i] ** 2
            for i in y:
                loss[None] += y[i] * y[i]

        @ti.kernel
        def descend(lr: ti.f64):
            for i in x:
                x[i] -= lr * x.grad[i]

        x.from_numpy(np.linspace(-1, 1, n))
        losses = []
        for lr in (0.01, 0.02, 0.005):
            with ti.ad.Tape(loss=loss):
                forward(1.3)
            descend(lr)
            losses.append(loss.to_numpy())
        xs = np.linspace(-1, 1, n)  # analytic first gradient, as a sanity check
        return {"x": x.to_numpy(), "grad": x.grad.to_numpy(), "y": y.to_numpy(),
                "losses": losses}, xs

    truth, xs = run_local(eager)
    same(replayed, truth)
    y0 = np.sin(1.3 * xs) + xs ** 2
    assert truth["losses"][0] == pytest.approx(np.sum(y0 ** 2), rel=1e-12)


# ---------------------------------------------------------------------------- requests

def test_each_replay_is_one_request_and_the_graph_is_sent_once(remote):
    def program():
        x = ti.field(ti.f32, shape=16)

        @ti.kernel
        def inc(a: ti.f32):
            for i in x:
                x[i] += a

        @ti.kernel
        def double():
            for i in x:
                x[i] *= 2

        ti.sync()
        with ti.graph.capture() as g:
            a = g.input("a", 1.0)
            for _ in range(20):  # 40 launches
                inc(a)
                double()
        assert trips(lambda: None) == 0
        cost = [trips(lambda k=k: g.replay(a=float(k))) for k in range(4)]
        sent = ti.remote_stats()["bytes_sent"]
        g.replay(a=0.5)
        small = ti.remote_stats()["bytes_sent"] - sent
        return cost, small, x.to_numpy()

    cost, small, x = remote(program)
    assert cost == [1, 1, 1, 1]
    assert small < 600, small  # a replay's request: the graph's id and the inputs
    want = np.zeros(16, dtype=np.float32)
    for a in (0.0, 1.0, 2.0, 3.0, 0.5):
        for _ in range(20):
            want = (want + np.float32(a)) * np.float32(2)
    assert x.tobytes() == want.tobytes()


# ---------------------------------------------------------------------------- errors

def _bad_index_in_a_replay(remote):
    """A replay whose launch indexes out of range raises what the local replay raises (the
    kernel, file, line and its text) and what an eager remote launch raises; ``remote``
    runs a program against a server (a CPU or a GPU one)."""
    def program(local):
        x = ti.field(ti.f32, shape=4)

        @ti.kernel
        def poke(i: ti.i32):
            x[i] = 1.0

        with ti.graph.capture() as g:
            poke(g.input("i", 0))
        g.replay(i=3)
        with pytest.raises(ti.IndexOutOfRangeError) as err:
            g.replay(i=7)
        g.replay(i=2)  # the graph (and the session) go on
        e = err.value
        if not local:
            with pytest.raises(ti.IndexOutOfRangeError) as eager:
                poke(7)
                ti.sync()
            assert str(eager.value) == str(e)  # what an eager remote launch raises
            assert e.kernel == "poke" and "kernel 'poke'" in str(e.__notes__)
        return str(e), type(e).__name__, x.to_numpy()

    ti.init(arch=ti.cpu, check_out_of_bound=True)
    try:
        local = program(True)
    finally:
        ti.reset()
    got = remote(lambda: program(False))
    assert got[0] == local[0]  # the kernel, the file, the line and its text
    assert "x[i] = 1.0" in got[0] and f"{__file__}:" in got[0]
    assert got[1] == local[1] == "IndexOutOfRangeError"
    same(local[2], got[2])


def test_a_bad_index_in_a_replay_is_the_kernels_error_with_its_line(remote):
    _bad_index_in_a_replay(remote)


def test_what_a_replay_cannot_repeat_is_refused_naming_the_line(remote):
    def program():
        x = ti.field(ti.f32, shape=4)

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

        @ti.kernel
        def into(arr: ti.types.ndarray(dtype=ti.f32, ndim=1)):
            for i in x:
                arr[i] = x[i]

        cases = [lambda g: x[0], lambda g: x.to_numpy(), lambda g: total(),
                 lambda g: inc(1.0) if x[0] > 0 else None,
                 lambda g: into(np.zeros(4, dtype=np.float32)),  # not an input
                 lambda g: inc(g.input("a", 1.0) * 2),
                 # a NumPy input copied in must have the target's dtype (as locally)
                 lambda g: x.from_numpy(g.input("xs", np.zeros(4)))]
        for case in cases:
            with pytest.raises(ti.GraphCaptureError, match=r"test_client_graphs\.py:\d+"):
                with ti.graph.capture() as g:
                    case(g)
        with ti.graph.capture() as g:  # the program can capture again
            inc(1.0)
        g.replay()
        with pytest.raises(ti.GraphError, match="GraphBuilder is not available"):
            ti.graph.GraphBuilder()
        return x.to_numpy()

    np.testing.assert_array_equal(remote(program), np.ones(4))


def test_a_graph_of_an_ended_program_is_refused(remote):
    def program():
        x = ti.field(ti.f32, shape=4)

        @ti.kernel
        def inc():
            for i in x:
                x[i] += 1

        with ti.graph.capture() as g:
            inc()
        g()
        return g

    g = remote(program)
    ti.init(arch=ti.remote, transport=LocalTransport())
    try:
        with pytest.raises(ti.GraphError, match="capture it again"):
            g.replay()
    finally:
        ti.reset()


# ---------------------------------------------------------------------------- saved graphs

def test_a_saved_graph_loads_and_replays_remotely(remote, tmp_path):
    path = str(tmp_path / "step.json")

    def make():
        x = ti.field(ti.f32, shape=32, needs_grad=True, name="x")
        loss = ti.field(ti.f32, shape=(), needs_grad=True, name="loss")

        @ti.kernel
        def f(a: ti.f32):
            for i in x:
                loss[None] += ti.sin(x[i] * a) ** 2

        @ti.kernel
        def upd(lr: ti.f32):
            for i in x:
                x[i] -= lr * x.grad[i]

        with ti.graph.capture() as g:
            lr = g.input("lr", 0.1)
            with ti.ad.Tape(loss):
                f(1.5)
            upd(lr)
        g.save(path)

    def use():
        g = ti.graph.load(path)
        g.fields["x"].from_numpy(np.linspace(0, 1, 32).astype(np.float32))
        g.replay()
        g.replay(lr=0.2)
        return {k: g.fields[k].to_numpy() for k in ("x", "loss")} | {
            "g": g.fields["x"].grad.to_numpy()}

    ti.init(arch=ti.cpu, check_out_of_bound=True)
    try:
        make()
        truth = use()
    finally:
        ti.reset()
    got = remote(use)
    same(truth, got)
    # tampered documents are refused by the server's validation, as locally
    doc = json.loads(open(path).read())
    doc["kernels"][0]["ir"]["buffers"] = []
    open(path, "w").write(json.dumps(doc))
    with pytest.raises(ti.GraphError, match="kernel 0"):
        remote(use)


def test_graphs_are_saved_with_the_session():
    """The engine saves its graphs with the session and makes them again on load."""
    from difftape.server.engine import Engine

    engine = Engine()
    ti.init(arch=ti.remote, transport=LocalTransport(engine))
    try:
        x = ti.field(ti.f32, shape=8)

        @ti.kernel
        def inc(a: ti.f32):
            for i in x:
                x[i] += a

        with ti.graph.capture() as g:
            inc(g.input("a", 1.0))
        g.replay()
        _, saved = engine.execute({"op": "save"})
        fresh = Engine()
        fresh.execute({"op": "load"}, bytes(saved))
        g.rt.transport.engine = fresh
        g.replay(a=2.0)
        np.testing.assert_array_equal(x.to_numpy(), np.full(8, 3.0))
        assert len(fresh.graphs) == 1
    finally:
        ti.reset()


# ---------------------------------------------------------------------------- a GPU server
# An engine on a grid target (``python -m difftape.server --arch cuda``): here the CUDA
# launcher on the stand-in device (tests/cuda_standin.py, whose code is the simulated grid's
# and whose CUDA graphs are deferred and checked), in-process. The graph a client sends is
# built into the grid replay there (runtime/gridgraph.py: graph executables).

@pytest.fixture
def gpu_server(monkeypatch):
    """``run(program)``: the program under ``arch=ti.remote`` against an engine on the CUDA
    stand-in; ``run.engine``, ``run.driver``: the last run's engine and the stand-in."""
    from cuda_standin import FakeDriver, use

    from difftape.server.engine import Engine

    drv = use(monkeypatch, FakeDriver())
    engines = []

    def run(program):
        engine = Engine(arch="cuda")
        engines.append(engine)
        run.engine = engine
        ti.init(arch=ti.remote, transport=LocalTransport(engine))
        try:
            assert engine.prog.launcher is not None  # a grid program, not the CPU
            return program()
        finally:
            ti.reset()

    run.driver = drv
    yield run
    for engine in engines:
        engine.close()


def gpu_step(captured):
    """A Tape step with scalar, ti.ndarray and NumPy inputs, a fill and an element write, run
    eagerly or captured and replayed with the same inputs."""
    n = 24
    x = ti.field(ti.f32, shape=n, needs_grad=True)
    loss = ti.field(ti.f32, shape=(), needs_grad=True)
    w = ti.field(ti.f32, shape=n)
    nd1, nd2 = ti.ndarray(ti.f32, shape=n), ti.ndarray(ti.f32, shape=n)
    nd1.from_numpy(np.linspace(-1, 1, n).astype(np.float32))
    nd2.from_numpy(np.linspace(3, 2, n).astype(np.float32))
    h1, h2 = np.linspace(0, 2, n).astype(np.float32), np.full(n, 0.5, np.float32)

    @ti.kernel
    def shift(arr: ti.types.ndarray(dtype=ti.f32, ndim=1)):
        for i in x:
            x[i] += 0.01 * arr[i]

    @ti.kernel
    def forward(a: ti.f32):
        for i in x:
            loss[None] += ti.sin(x[i] * a) ** 2

    @ti.kernel
    def descend(lr: ti.f32, h: ti.types.ndarray(dtype=ti.f32, ndim=1)):
        for i in x:
            x[i] -= lr * x.grad[i]
            h[i] = h[i] * 0.5 + x[i]

    def step(lr, arr, h):
        shift(arr)
        with ti.ad.Tape(loss):
            forward(1.3)
        descend(lr, h)
        w.fill(2.0)
        w[1] = 5.0

    x.from_numpy(np.linspace(0, 1, n).astype(np.float32))
    plan = [(0.1, nd1, h1), (0.2, nd2, h2), (0.05, nd1, h1)]
    if captured:
        with ti.graph.capture() as g:
            step(g.input("lr", 0.1), g.input("arr", nd1), g.input("h", h1))
        requests = [trips(lambda p=p: g.replay(lr=p[0], arr=p[1], h=p[2])) for p in plan]
    else:
        for p in plan:
            step(*p)
        requests = None
    return {"x": x.to_numpy(), "grad": x.grad.to_numpy(), "loss": loss.to_numpy(),
            "w": w.to_numpy(), "h1": h1, "h2": h2, "nd1": nd1.to_numpy(),
            "nd2": nd2.to_numpy()}, requests


def test_on_a_gpu_server_a_replay_equals_the_eager_remote_run_one_request_each(gpu_server):
    eager, _ = gpu_server(lambda: gpu_step(False))
    launched = gpu_server.driver.graph_calls.get("launch_graph", 0)
    replayed, requests = gpu_server(lambda: gpu_step(True))
    same(eager, replayed)
    assert requests == [1, 1, 1]
    (graph, _), = gpu_server.engine.graphs.values()
    assert graph.instantiations >= 1  # the server replays graph executables
    assert gpu_server.driver.graph_calls["launch_graph"] - launched >= 3


def test_on_a_gpu_server_numpy_inputs_copied_in_are_copied_at_each_replay(gpu_server):
    got = gpu_server(numpy_inputs_copied_in)
    _check_numpy_inputs_copied_in(got)


@pytest.mark.parametrize("program", [launches_fills_and_writes, tape_step,
                                     forward_mode_and_kernel_grad], ids=lambda p: p.__name__)
def test_on_a_gpu_server_a_replay_equals_the_local_gpu_replay(gpu_server, program):
    """(The programs' NumPy-free ones: a local grid program refuses NumPy inputs.)"""
    ti.init(arch=ti.cuda, check_out_of_bound=True)  # what the server compiles
    try:
        truth = program()
    finally:
        ti.reset()
    same(truth, gpu_server(program))


def test_on_a_gpu_server_a_bad_index_is_the_cpus_error(gpu_server):
    _bad_index_in_a_replay(gpu_server)


def test_on_a_gpu_server_a_saved_graph_loads_and_graphs_survive_a_session_restore(
        gpu_server, tmp_path):
    from difftape.server.engine import Engine

    path = str(tmp_path / "step.json")
    ti.init(arch=ti.cpu)
    try:
        x = ti.field(ti.f32, shape=16, name="x")

        @ti.kernel
        def inc(a: ti.f32):
            for i in x:
                x[i] = x[i] * 2 + a

        with ti.graph.capture() as g:
            inc(g.input("a", 1.0))
            x[0] = -1.0
        g.save(path)
    finally:
        ti.reset()

    def use():
        g = ti.graph.load(path)
        g.replay()
        _, saved = gpu_server.engine.execute({"op": "save"})
        fresh = Engine(arch="cuda")
        try:
            fresh.execute({"op": "load"}, bytes(saved))
            g.rt.transport.engine = fresh
            g.replay(a=0.5)
            return g.fields["x"].to_numpy(), len(fresh.graphs)
        finally:
            g.rt.transport.engine = gpu_server.engine
            fresh.close()

    want = np.zeros(16, np.float32)
    for a in (1.0, 0.5):
        want = want * np.float32(2) + np.float32(a)
        want[0] = -1.0
    got, graphs = gpu_server(use)
    assert got.tobytes() == want.tobytes() and graphs == 1
