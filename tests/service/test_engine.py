"""The worker-side engine, in process: every op of server/PROTOCOL.md against local truth.

Kernels are built by the local frontend over local fields (what a client does); the engine gets
fields with the same ids, so the IR's buffers refer to them. Results are compared bit for bit
with the same kernel run by the local runtime with ``check_out_of_bound=True``: the engine
compiles every kernel with bounds checks, and checks change code layout (FMA contraction,
vectorized math), so unchecked local code may differ in the last bit. Sizes are small enough
that every loop runs on one thread, so float reductions happen in the same order in both."""

import base64

import numpy as np
import pytest

import difftape as ti
from difftape.errors import (
    ArgumentError,
    CompileError,
    DifftapeError,
    KernelAssertionError,
    ShapeError,
)
from difftape.ir import serialize
from difftape.runtime import program
from difftape.server.engine import Engine, EngineError

N = 16


@pytest.fixture
def local():
    """Local fields and kernels; the IR of each kernel as a client would send it."""
    ti.init(arch=ti.cpu, check_out_of_bound=True)  # the engine's bounds checks: so does truth
    x = ti.field(ti.f32, shape=N, needs_grad=True)
    v = ti.Vector.field(3, ti.f64, shape=(4, 2), needs_grad=True)
    loss = ti.field(ti.f32, shape=(), needs_grad=True)

    @ti.kernel
    def energy(a: ti.f32, w: ti.types.vector(3, ti.f64)):
        for i in x:
            loss[None] += a * ti.sin(x[i]) * x[i]
        for i, j in v:
            v[i, j] = w * ti.cast(x[i + j], ti.f64)

    @ti.kernel
    def poke(k: ti.i32):
        x[k] = 1.0

    @ti.kernel
    def total() -> ti.f32:
        s = 0.0
        for i in x:
            s += x[i]
        return s

    @ti.kernel
    def ratio(a: ti.f32) -> ti.f32:
        return a / 0.0

    class NS:
        pass

    ns = NS()
    ns.x, ns.v, ns.loss = x, v, loss
    ns.kernels = {"energy": energy, "poke": poke, "total": total, "ratio": ratio}
    ns.ir = lambda name: serialize.encode(ns.kernels[name].build_ir(program.get(), ()))
    ns.data = np.linspace(-2, 3, N, dtype=np.float32)
    yield ns
    ti.reset()


@pytest.fixture
def engine(tmp_path):
    e = Engine(tmp_path / "cache")
    yield e
    e.close()


def create(engine, ns, needs_grad=True):
    for f in (ns.x, ns.v, ns.loss):
        engine.execute({"op": "create_field", "id": f.id, "dtype": f.dtype.name,
                        "shape": list(f.shape), "element_shape": list(f.element_shape),
                        "needs_grad": needs_grad, "name": f.name})


def register(engine, ns, name):
    return engine.execute({"op": "register", "ir": ns.ir(name)})[0]["kernel_id"]


def read(engine, f, role="data"):
    meta, data = engine.execute({"op": "read", "id": f.id, "role": role})
    return np.frombuffer(data, dtype=ti.types.by_name(meta["dtype"]).np).reshape(meta["shape"])


def test_write_read_bytes_exact(engine, local):
    create(engine, local)
    vals = np.array([np.nan, -0.0, np.inf, 1e-45] + [3.25] * (N - 4), dtype=np.float32)
    engine.execute({"op": "write", "id": local.x.id, "role": "data", "dtype": "f32",
                    "shape": [N]}, vals.tobytes())
    assert read(engine, local.x).tobytes() == vals.tobytes()
    # f64 data into an f32 field converts as from_numpy does locally.
    d = np.linspace(0, 1, N)
    engine.execute({"op": "write", "id": local.x.id, "role": "data", "dtype": "float64",
                    "shape": [N]}, d.tobytes())
    assert read(engine, local.x).tobytes() == d.astype(np.float32).tobytes()
    # The worker hands over payloads from its shared mapping as memoryviews.
    mapping = bytearray(b"\xff" * 8) + bytearray(vals.tobytes()) + bytearray(8)
    engine.execute({"op": "write", "id": local.x.id, "role": "data", "dtype": "f32",
                    "shape": [N]}, memoryview(mapping)[8:8 + 4 * N])
    assert read(engine, local.x).tobytes() == vals.tobytes()


@pytest.mark.parametrize("op, err", [
    ({"dtype": "f32", "shape": [N + 1]}, ShapeError),
    ({"dtype": "f32", "shape": [N], "short": True}, ShapeError),
    ({"dtype": "object", "shape": [N]}, EngineError),
    ({"dtype": "U4", "shape": [N]}, EngineError),
    ({"dtype": "f32", "shape": [N], "id": 999999}, EngineError),
    ({"dtype": "f32", "shape": [N], "role": "dual"}, DifftapeError),
])
def test_write_refusals(engine, local, op, err):
    create(engine, local)
    op = dict(op)
    payload = np.zeros(N, np.float32).tobytes()[: -4 if op.pop("short", False) else None]
    with pytest.raises(err):
        engine.execute({"op": "write", "id": local.x.id, "role": "data", **op}, payload)


def test_launch_matches_local_bit_for_bit(engine, local):
    create(engine, local)
    engine.execute({"op": "write", "id": local.x.id, "role": "data", "dtype": "f32",
                    "shape": [N]}, local.data.tobytes())
    kid = register(engine, local, "energy")
    assert kid == serialize.fingerprint(local.kernels["energy"].build_ir(program.get(), ()))
    # Registering again is idempotent.
    assert register(engine, local, "energy") == kid
    w = [0.5, -1.25, 3.0]
    engine.execute({"op": "launch", "kernel_id": kid, "variant": "primal",
                    "args": [1.5] + w})
    tid = register(engine, local, "total")
    got_total = engine.execute({"op": "launch", "kernel_id": tid, "args": []})[0]["result"]

    local.x.from_numpy(local.data)
    local.kernels["energy"](1.5, ti.Vector(w))
    assert read(engine, local.loss).tobytes() == local.loss.to_numpy().tobytes()
    assert read(engine, local.v).tobytes() == local.v.to_numpy().tobytes()
    assert got_total == local.kernels["total"]()
    assert isinstance(got_total, float)

    # The adjoint, seeded by loss.grad = 1, against the local kernel.grad.
    engine.execute({"op": "set_item", "id": local.loss.id, "role": "grad", "index": [],
                    "value": 1.0})
    engine.execute({"op": "launch", "kernel_id": kid, "variant": "grad", "args": [1.5] + w})
    local.loss.grad[None] = 1.0
    local.kernels["energy"].grad(1.5, ti.Vector(w))
    assert read(engine, local.x, "grad").tobytes() == local.x.grad.to_numpy().tobytes()
    assert np.any(local.x.grad.to_numpy() != 0)
    stats = engine.execute({"op": "stats"})[0]
    assert stats["launches"] == 3 and stats["kernels"] == 2
    assert stats["cache_misses"] + stats["cache_hits"] == 3
    assert stats["field_bytes"] == 2 * (N * 4 + 4 * 2 * 3 * 8 + 4)


def test_items_and_fill(engine, local):
    create(engine, local)
    engine.execute({"op": "fill", "id": local.x.id, "role": "data", "value": 0.1})
    assert read(engine, local.x).tobytes() == np.full(N, 0.1, np.float32).tobytes()
    engine.execute({"op": "set_item", "id": local.v.id, "role": "data", "index": [3, 1],
                    "value": [1, 2.5, "-Infinity"]})
    got = engine.execute({"op": "get_item", "id": local.v.id, "role": "data",
                          "index": [-1, -1]})[0]["value"]
    assert got == [1.0, 2.5, "-Infinity"]
    x_item = engine.execute({"op": "get_item", "id": local.x.id, "index": [2]})[0]["value"]
    assert x_item == float(np.float32(0.1))
    with pytest.raises(EngineError, match="out of bounds"):
        engine.execute({"op": "get_item", "id": local.x.id, "index": [N]})
    with pytest.raises(ShapeError):
        engine.execute({"op": "get_item", "id": local.x.id, "index": [1, 2]})
    with pytest.raises(ShapeError):
        engine.execute({"op": "set_item", "id": local.v.id, "index": [0, 0], "value": [1, 2]})


def test_bad_index_is_an_error_and_the_engine_goes_on(engine, local):
    create(engine, local)
    kid = register(engine, local, "poke")
    with pytest.raises(KernelAssertionError, match="out of range"):
        engine.execute({"op": "launch", "kernel_id": kid, "args": [N]})
    with pytest.raises(KernelAssertionError):
        engine.execute({"op": "launch", "kernel_id": kid, "args": [-1]})
    engine.execute({"op": "launch", "kernel_id": kid, "args": [N - 1]})
    assert read(engine, local.x)[N - 1] == 1.0


def test_register_checks_buffers(engine, local):
    # No fields at all: the kernel refers to ids this engine does not have.
    with pytest.raises(CompileError, match="does not have"):
        register(engine, local, "energy")
    # Same id, another shape.
    engine.execute({"op": "create_field", "id": local.x.id, "dtype": "f32", "shape": [N + 1]})
    with pytest.raises(CompileError, match="describes"):
        register(engine, local, "poke")
    # An IR claiming a wrong dtype for a field.
    e2 = Engine()
    create(e2, local)
    data = local.ir("poke")
    data["buffers"][0][1] = "f64"
    with pytest.raises(DifftapeError):
        e2.execute({"op": "register", "ir": data})
    # An ndarray buffer's array axes are known only at launch: fixed extents are malformed.
    data = local.ir("poke")
    data["buffers"][0][0] = {"t": ["ndarray", 0, "primal"]}
    with pytest.raises(DifftapeError, match="an ndarray's array axes are null"):
        e2.execute({"op": "register", "ir": data})
    with pytest.raises(DifftapeError):
        e2.execute({"op": "register", "ir": {"name": "k"}})
    e2.close()


def test_offsets_are_the_fields_and_the_irs_alike(engine, local):
    """A field's ``offset`` comes with ``create_field``; IR addressing it must say the same
    offset (its bounds checks report the user's index with it), and storage stays indexed
    from 0 (the client subtracts the offset)."""
    y = ti.field(ti.f32, shape=4, offset=-2)

    @ti.kernel
    def poke(k: ti.i32):
        y[k] = k

    data = serialize.encode(poke.build_ir(program.get(), ()))
    base = {"op": "create_field", "id": y.id, "dtype": "f32", "shape": [4]}
    for bad, match in (([-2, 0], "one entry per axis"), ([2**31 - 4], "i32"),
                       ([-2**31 - 1], "i32"), ([1.5], "list of integers")):
        with pytest.raises((ShapeError, EngineError), match=match):
            engine.execute({**base, "offset": bad})
    with pytest.raises(EngineError, match="ndarray has no offset"):
        engine.execute({**base, "offset": [-2], "ndarray": True})
    engine.execute(base)  # no offset: the IR's is refused
    with pytest.raises(CompileError, match=r"offset \(-2,\), but field .* has offset None"):
        engine.execute({"op": "register", "ir": data})
    with pytest.raises(EngineError, match="another layout"):
        engine.execute({**base, "offset": [-2]})
    e2 = Engine()
    e2.execute({**base, "offset": [-2]})
    e2.execute({**base, "offset": [-2]})  # idempotent
    kid = e2.execute({"op": "register", "ir": data})[0]["kernel_id"]
    e2.execute({"op": "launch", "kernel_id": kid, "args": [1]})
    with pytest.raises(KernelAssertionError, match=r"index 2 out of range for axis 0 of 'y' "
                                                   r"with shape \(4,\) and offset \(-2,\)"):
        e2.execute({"op": "launch", "kernel_id": kid, "args": [2]})
    assert read(e2, y).tolist() == [0, 0, 0, 1]
    e2.close()


def test_grad_needs_storage(engine, local):
    create(engine, local, needs_grad=False)
    ir = local.ir("energy")
    kid = engine.execute({"op": "register", "ir": ir})[0]["kernel_id"]
    # No .grad anywhere: the adjoint has nothing to write, and runs as a no-op.
    engine.execute({"op": "launch", "kernel_id": kid, "variant": "grad", "args": [1, 0, 0, 0]})
    # Companions added later are seen by a freshly derived adjoint.
    for f in (local.x, local.loss):
        engine.execute({"op": "companion", "id": f.id, "role": "grad"})
    engine.execute({"op": "fill", "id": local.x.id, "role": "data", "value": 0.5})
    engine.execute({"op": "fill", "id": local.loss.id, "role": "grad", "value": 1.0})
    engine.execute({"op": "launch", "kernel_id": kid, "variant": "grad", "args": [2, 0, 0, 0]})
    g = read(engine, local.x, "grad")
    expect = np.float32(2) * (np.sin(np.float32(0.5)) + np.float32(0.5) * np.cos(np.float32(0.5)))
    np.testing.assert_allclose(g, expect, rtol=1e-6)
    engine.execute({"op": "clear_grads"})
    assert not read(engine, local.x, "grad").any()


def test_launch_refusals(engine, local):
    create(engine, local)
    kid = register(engine, local, "poke")
    with pytest.raises(EngineError, match="unknown kernel"):
        engine.execute({"op": "launch", "kernel_id": "0" * 64, "args": [1]})
    with pytest.raises(ArgumentError):
        engine.execute({"op": "launch", "kernel_id": kid, "args": []})
    with pytest.raises(ArgumentError):
        engine.execute({"op": "launch", "kernel_id": kid, "args": ["1"]})
    with pytest.raises(EngineError, match="variant"):
        engine.execute({"op": "launch", "kernel_id": kid, "variant": "validate", "args": [1]})
    with pytest.raises(EngineError, match="unknown engine op"):
        engine.execute({"op": "exec", "code": "print(1)"})


def test_non_finite_results_travel_as_strings(engine, local):
    create(engine, local)
    kid = register(engine, local, "ratio")
    r = engine.execute({"op": "launch", "kernel_id": kid, "args": [1.0]})[0]["result"]
    assert r == "Infinity"


def test_batch_stops_at_first_error(engine, local):
    create(engine, local)
    kid = register(engine, local, "poke")
    ops = [{"op": "launch", "kernel_id": kid, "args": [0]},
           {"op": "launch", "kernel_id": kid, "args": [N + 3]},
           {"op": "launch", "kernel_id": kid, "args": [1]}]
    with pytest.raises(KernelAssertionError) as info:
        engine.execute({"op": "batch", "ops": ops})
    assert info.value.op_index == 1
    x = read(engine, local.x)
    assert x[0] == 1.0 and x[1] == 0.0  # ran up to the failing op, not after it
    with pytest.raises(EngineError, match="cannot be part of a batch"):
        engine.execute({"op": "batch", "ops": [{"op": "read", "id": local.x.id}]})
    res = engine.execute({"op": "batch", "ops": ops[:1] + [{"op": "stats"}]})[0]["results"]
    assert res[0] == {"result": None} and res[1]["launches"] == 3  # attempted launches


def test_batch_on_a_gpu_reports_the_failing_launch(tmp_path, monkeypatch, local):
    """On a grid (the CUDA launcher on the stand-in device) launches are asynchronous: the
    engine waits after each op, so a bounds error is the failing launch's, at its index in
    the batch, and the launches after it do not run."""
    from cuda_standin import FakeDriver, use

    use(monkeypatch, FakeDriver())
    engine = Engine(tmp_path / "cache", arch="cuda")
    try:
        assert engine.prog.launcher is not None
        create(engine, local)
        kid = register(engine, local, "poke")
        ops = [{"op": "launch", "kernel_id": kid, "args": [k]} for k in (0, N + 3, 1, 2)]
        with pytest.raises(KernelAssertionError) as info:
            engine.execute({"op": "batch", "ops": ops})
        assert info.value.op_index == 1
        x = read(engine, local.x)
        assert x[0] == 1.0 and not x[1:].any()  # ran up to the failing op, not after it
    finally:
        engine.close()


def test_save_load_and_warm_cache(tmp_path, local):
    """The save comes back as the .npz bytes (the gateway writes them where every gateway
    reaches them: a Ray actor's node need not share its disk); ``load`` takes them back in a
    new engine, says which fields it restored, and finds the kernels in the compile cache."""
    cache = tmp_path / "cache"
    e1 = Engine(cache)
    create(e1, local)
    e1.execute({"op": "companion", "id": local.x.id, "role": "grad_dual"})
    e1.execute({"op": "write", "id": local.x.id, "role": "data", "dtype": "f32",
                "shape": [N]}, local.data.tobytes())
    e1.execute({"op": "fill", "id": local.x.id, "role": "grad_dual", "value": 7})
    kid = register(e1, local, "total")
    before = e1.execute({"op": "launch", "kernel_id": kid, "args": []})[0]["result"]
    result, blob = e1.execute({"op": "save"})
    e1.close()
    assert result == {} and bytes(blob[:2]) == b"PK"  # a zip: the .npz itself

    e2 = Engine(cache)  # a new worker: same cache directory, nothing in memory of its own
    restored, _ = e2.execute({"op": "load"}, bytes(blob))
    assert {d["id"] for d in restored["fields"]} == {local.x.id, local.v.id, local.loss.id}
    x = next(d for d in restored["fields"] if d["id"] == local.x.id)
    assert x["dtype"] == "f32" and x["shape"] == [N] and x["roles"][0] == "primal"
    assert "grad_dual" in x["roles"]
    assert read(e2, local.x).tobytes() == local.data.tobytes()
    assert (read(e2, local.x, "grad_dual") == 7).all()
    assert e2.execute({"op": "launch", "kernel_id": kid, "args": []})[0]["result"] == before
    stats = e2.execute({"op": "stats"})[0]
    assert stats["cache_hits"] == 1 and stats["cache_misses"] == 0
    with pytest.raises(EngineError, match="cannot read the saved session"):
        e2.execute({"op": "load"}, b"not a zip")
    with pytest.raises(EngineError, match="takes the .npz"):
        e2.execute({"op": "load"})
    with pytest.raises(EngineError, match="takes no payload"):
        e2.execute({"op": "save"}, b"x")
    e2.close()


@pytest.mark.parametrize("bad, match", [
    ({"program": [{"op": "register", "ir": {}}]}, "cannot be part of a program"),
    ({"program": [{"op": "get_item", "id": 1, "index": [0]}]}, "cannot be part of a program"),
    ({"clear": "clear_all"}, "'clear' must be"),
    ({"vectors": [[1.0, 2.0]]}, "'vectors' must be base64"),
    ({"vectors": base64.b64encode(np.ones(N + 1).tobytes()).decode()}, "whole seed vectors"),
    ({"vectors": "not base64!"}, "not valid base64"),
])
def test_sweep_refusals(engine, local, bad, match):
    """A sweep repeats only ops that neither create nor read; its seeds match the seed
    storages' sizes."""
    create(engine, local)
    op = {"op": "sweep", "clear": "clear_duals", "program": [],
          "seed": {"role": "grad", "fields": [local.x.id]},
          "read": {"role": "grad", "fields": [local.loss.id]}, **bad}
    with pytest.raises(EngineError, match=match):
        engine.execute(op)


def test_sweep_one_hot_columns(engine, local):
    """With no vectors, one column per seed scalar: here the program is empty, so each
    column reads back its own one-hot seed (the identity), cleared in between."""
    create(engine, local)
    res, _ = engine.execute({"op": "sweep", "clear": "clear_grads", "program": [],
                             "seed": {"role": "grad", "fields": [local.x.id]},
                             "read": {"role": "grad", "fields": [local.x.id]}})
    assert res["shape"] == [N, N]
    cols = np.frombuffer(base64.b64decode(res["columns"]), dtype="<f8").reshape(N, N)
    np.testing.assert_array_equal(cols, np.eye(N))


def test_grad_check_needs_its_snapshot(engine, local):
    create(engine, local)
    with pytest.raises(EngineError, match="no such snapshot"):
        engine.execute({"op": "grad_check", "snapshot": 5, "loss": local.loss.id,
                        "fields": [local.x.id], "program": []})


# ---------------------------------------------------------------------------- ti.ndarray

def _ndarray_kernel():
    """A kernel with two templates (a field, a number), an ndarray and a scalar: the
    ndarray's buffers name argument 2, the scalar is the only param (the templates leave
    gaps: the IR has no trace of them)."""
    f = ti.field(ti.f64, shape=3)

    @ti.kernel
    def mix(t: ti.template(), n: ti.template(),
            a: ti.types.ndarray(dtype=ti.types.vector(2, ti.f64), ndim=1), s: ti.f64):
        for i in a:
            a[i] = a[i] * s + t[i % n]

    arr = np.zeros((4, 2))
    _, spec = mix._specialize((f, 3, arr, 1.0))
    return f, serialize.encode(mix.build_ir(program.get(), spec)), mix, arr


def test_ndarray_storage_is_bound_by_the_launch(engine, local):
    f, ir, mix, arr = _ndarray_kernel()
    engine.execute({"op": "create_field", "id": f.id, "dtype": "f64", "shape": [3]})
    engine.execute({"op": "create_field", "id": 500, "dtype": "f64", "shape": [4],
                    "element_shape": [2], "ndarray": True, "needs_grad": True})
    kid = engine.execute({"op": "register", "ir": ir})[0]["kernel_id"]
    f.from_numpy(np.array([1.0, 2.0, 3.0]))
    engine.execute({"op": "set_bytes", "id": f.id, "role": "data",
                    "b64": base64.b64encode(f.to_numpy().tobytes()).decode()})
    start = np.arange(8.0).reshape(4, 2)
    engine.execute({"op": "write", "id": 500, "role": "data", "dtype": "f64", "shape": [4, 2]},
                   start.tobytes())
    engine.execute({"op": "launch", "kernel_id": kid, "args": [0.5],
                    "arrays": [{"arg": 2, "id": 500, "grad": True}]})
    meta, data = engine.execute({"op": "read", "id": 500, "role": "data"})
    arr[...] = start
    mix(f, 3, arr, 0.5)  # local truth
    assert np.frombuffer(data, np.float64).reshape(4, 2).tobytes() == arr.tobytes()
    # clear_grads leaves ndarrays alone (as ti.ad.clear_all_gradients does locally)
    engine.execute({"op": "fill", "id": 500, "role": "grad", "value": 2.0})
    engine.execute({"op": "clear_grads"})
    assert engine.execute({"op": "get_item", "id": 500, "role": "grad", "index": [1]}
                          )[0]["value"] == [2.0, 2.0]
    with pytest.raises(EngineError, match="data and .grad storage only"):
        engine.execute({"op": "fill", "id": 500, "role": "dual", "value": 0})
    launch = {"op": "launch", "kernel_id": kid, "args": [0.5]}
    refusals = [
        ([], "not bound"),
        ([{"arg": 2, "id": f.id}], "not a ti.ndarray of this session"),
        ([{"arg": 2, "id": 999}], "not a ti.ndarray of this session"),
        ([{"arg": 1, "id": 500}], "not an ndarray argument"),
        ([{"arg": 2, "id": 500}, {"arg": 2, "id": 500}], "bound twice"),
    ]
    engine.execute({"op": "create_field", "id": 501, "dtype": "f32", "shape": [4],
                    "element_shape": [2], "ndarray": True})
    engine.execute({"op": "create_field", "id": 502, "dtype": "f64", "shape": [4],
                    "element_shape": [3], "ndarray": True})
    engine.execute({"op": "create_field", "id": 503, "dtype": "f64", "shape": [2, 2],
                    "element_shape": [2], "ndarray": True})
    refusals += [([{"arg": 2, "id": i}], "must be a 1-D ndarray of f64 with element shape "
                                        r"\(2,\)") for i in (501, 502, 503)]
    refusals.append(([{"arg": 2, "id": 501, "grad": True}], "no .grad storage"))
    for arrays, match in refusals:
        with pytest.raises(ArgumentError, match=match):
            engine.execute({**launch, "arrays": arrays})
    # ids are one space: an ndarray id is no field and the other way round
    with pytest.raises(EngineError, match="already a field"):
        engine.execute({"op": "create_field", "id": f.id, "dtype": "f64", "shape": [3],
                        "ndarray": True})
    with pytest.raises(EngineError, match="already a ti.ndarray"):
        engine.execute({"op": "create_field", "id": 500, "dtype": "f64", "shape": [4]})
    with pytest.raises(EngineError, match="is a ti.ndarray, not a field"):
        engine.execute({"op": "companion", "id": 500, "role": "dual"})


def test_ndarray_index_out_of_bounds_is_an_error(engine, local):
    @ti.kernel
    def poke(a: ti.types.ndarray(dtype=ti.f32, ndim=1), k: ti.i32):
        a[k] = 1

    _, spec = poke._specialize((np.zeros(2, np.float32), 0))
    kid = engine.execute({"op": "register", "ir": serialize.encode(
        poke.build_ir(program.get(), spec))})[0]["kernel_id"]
    engine.execute({"op": "create_field", "id": 7, "dtype": "f32", "shape": [3],
                    "ndarray": True})
    for k in (3, -1):
        with pytest.raises(KernelAssertionError):
            engine.execute({"op": "launch", "kernel_id": kid, "args": [k],
                            "arrays": [{"arg": 0, "id": 7}]})
    engine.execute({"op": "launch", "kernel_id": kid, "args": [2],
                    "arrays": [{"arg": 0, "id": 7}]})
    assert engine.execute({"op": "get_item", "id": 7, "index": [2]})[0]["value"] == 1.0


def test_ndarrays_are_saved_and_count_against_the_fields_quota(tmp_path, local):
    e = Engine(tmp_path / "cache", max_fields=2)
    e.execute({"op": "create_field", "id": 1, "dtype": "f32", "shape": [2],
               "ndarray": True, "needs_grad": True, "name": "nd"})
    e.execute({"op": "fill", "id": 1, "role": "grad", "value": 1.5})
    e.execute({"op": "set_item", "id": 1, "index": [1], "value": -3})
    e.execute({"op": "create_field", "id": 2, "dtype": "i32", "shape": [2]})
    with pytest.raises(DifftapeError, match="fields and ndarrays") as err:
        e.execute({"op": "create_field", "id": 3, "dtype": "f32", "shape": [2],
                   "ndarray": True})
    assert err.value.limit == "fields"
    assert e.execute({"op": "stats"})[0]["field_bytes"] == 2 * 8 + 8
    _, saved = e.execute({"op": "save"})
    e.close()
    e2 = Engine(tmp_path / "cache")
    restored = e2.execute({"op": "load"}, bytes(saved))[0]["fields"]
    # what came back, as the gateway records it: the field, then the ndarray with its .grad
    assert [(d["id"], d.get("ndarray", False)) for d in restored] == [(2, False), (1, True)]
    assert restored[1]["roles"] == ["primal", "grad"]
    assert e2.execute({"op": "get_bytes", "id": 1})[0]["b64"] == base64.b64encode(
        np.array([0, -3], np.float32).tobytes()).decode()
    assert e2.execute({"op": "get_item", "id": 1, "role": "grad", "index": [0]}
                      )[0]["value"] == 1.5
    assert 1 in e2.ndarrays and 1 not in e2.prog.fields
    e2.close()


def test_engine_actor_refuses_calls_of_an_older_epoch(tmp_path, local):
    """The Ray actor's side of taking a session over (server/raycluster.py; the class runs
    here as a plain object, without Ray): a call with an epoch older than one it has seen
    does not run (``moved``), so a gateway that lost the session to another never changes
    it behind that gateway's back; the newer holder's calls run."""
    from difftape.server.raycluster import EngineActor

    actor = EngineActor("difftape.server.engine:Engine", {"cache_dir": str(tmp_path / "c")})
    try:
        op = {"op": "create_field", "id": local.x.id, "dtype": "f32", "shape": [N],
              "element_shape": [], "needs_grad": False}
        assert "ok" in actor.execute(op, None, 0)[0]
        fill = {"op": "fill", "id": local.x.id, "role": "data", "value": 2.0}
        assert "ok" in actor.execute(fill, None, 3)[0]  # gateway B took it: epoch 3
        stale = {"op": "fill", "id": local.x.id, "role": "data", "value": 9.0}
        assert actor.execute(stale, None, 2) == ({"moved": 3}, None)  # A, before: refused
        reply, data = actor.execute({"op": "read", "id": local.x.id, "role": "data"}, None, 3)
        assert "ok" in reply and (np.frombuffer(data, np.float32) == 2.0).all()
    finally:
        actor.engine.close()
