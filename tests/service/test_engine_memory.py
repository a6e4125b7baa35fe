"""The session's memory quota counts scratch memory too (server/engine.py ``scratch``): the
print sink, random states and launch contexts, and on a GPU grid the stack pool, snapshot
blocks, the print buffer and the status block (runtime/grid.py's ``Scratch``). A field, an
ndarray or a launch's scratch block that would take the session past the quota is refused
before it is allocated, with an error naming what needs the memory and what holds it.

The grid engine is a ``--arch cuda`` server's on the pycuda stand-in (it runs the CUDA
target's lowering on the simulated grid)."""

import numpy as np
import pytest

import difftape as ti
from difftape.graph import wire
from difftape.ir import serialize
from difftape.runtime import grid, program
from difftape.server.engine import Engine, QuotaExceededError

pytestmark = pytest.mark.difftape_only

N = 64


@pytest.fixture
def local():
    ti.init(arch=ti.cpu)
    x = ti.field(ti.f32, shape=N, needs_grad=True)
    y = ti.field(ti.f32, shape=N, needs_grad=True)

    @ti.kernel
    def say(k: ti.i32):
        print("k is", k)

    @ti.kernel
    def double():
        for i in x:
            y[i] = 2.0 * x[i]

    @ti.kernel
    def walk(n: ti.i32):
        for i in x:
            s = x[i]
            for _ in range(n):  # a dynamic loop: its adjoint pops values pushed on stacks
                s = ti.sin(s)
            y[i] = s

    kernels = {"say": say, "double": double, "walk": walk}
    yield x, y, {n: serialize.encode(k.build_ir(program.get(), ())) for n, k in kernels.items()}
    ti.reset()


def _setup(engine, x, y, irs):
    for f in (x, y):
        engine.execute({"op": "create_field", "id": f.id, "dtype": "f32", "shape": [N],
                        "element_shape": [], "needs_grad": True, "name": f.name})
    return {n: engine.execute({"op": "register", "ir": ir})[0]["kernel_id"]
            for n, ir in irs.items()}


@pytest.fixture
def grid_engine(tmp_path, monkeypatch):
    from cuda_standin import FakeDriver, use

    use(monkeypatch, FakeDriver())
    made = []

    def make(limit):
        made.append(Engine(tmp_path / "cache", arch="cuda", max_memory_bytes=limit))
        return made[-1]

    yield make
    for e in made:
        e.close()


def _held(engine) -> int:
    return engine.storage_bytes() + sum(engine.scratch().values())


def test_a_printing_kernels_buffer_counts_against_the_quota(local, grid_engine):
    """The print buffer (RECORD_BYTES of device memory) is taken with the first kernel that
    prints: past the quota, that launch is refused naming it; the session goes on."""
    x, y, irs = local
    probe = grid_engine(None)
    probe_ids = _setup(probe, x, y, irs)
    probe.execute({"op": "launch", "kernel_id": probe_ids["double"], "args": []})
    base = _held(probe)  # fields, a launch context, the status block, the sink, rng states
    engine = grid_engine(base + grid.RECORD_BYTES // 2)
    ids = _setup(engine, x, y, irs)
    with pytest.raises(QuotaExceededError) as info:
        engine.execute({"op": "launch", "kernel_id": ids["say"], "args": [3]})
    msg = str(info.value)
    assert "memory quota exceeded: the print buffer (kernel 'say' prints) needs" in msg
    assert f"{2 * 2 * N * 4} bytes of fields and ndarrays" in msg and "print sink" in msg
    assert info.value.limit == "field_bytes"
    assert "print buffer" not in engine.scratch()
    x_data = np.arange(N, dtype=np.float32)
    engine.execute({"op": "write", "id": x.id, "dtype": "f32"}, x_data.tobytes())
    engine.execute({"op": "launch", "kernel_id": ids["double"], "args": []})
    meta, data = engine.execute({"op": "read", "id": y.id})
    np.testing.assert_array_equal(np.frombuffer(data, np.float32), 2 * x_data)
    ok = grid_engine(base + wire.MAX_OUTPUT_BYTES + grid.RECORD_BYTES + 4096)  # + the sink
    ids = _setup(ok, x, y, irs)
    result, _ = ok.execute({"op": "launch", "kernel_id": ids["say"], "args": [3]})
    assert ok.scratch()["print buffer"] >= grid.RECORD_BYTES
    assert result["output"]["dropped"] == 0


def test_the_stack_pool_of_a_gradient_counts_against_the_quota(local, grid_engine):
    """A reverse-mode launch on the grid takes a stack pool (64 slots per thread first,
    doubled while threads overflow): refused past the quota, naming the pool and the
    kernel, before anything ran (the gradient is not accumulated)."""
    x, y, irs = local
    engine = grid_engine(None)
    ids = _setup(engine, x, y, irs)
    engine.execute({"op": "launch", "kernel_id": ids["double"], "args": []})
    threads = engine.prog.launcher.grid[0] * engine.prog.launcher.grid[1]
    engine.max_memory_bytes = _held(engine) + threads * 8 * 16  # less than 64 slots each
    engine.execute({"op": "fill", "id": y.id, "role": "grad", "value": 1.0})
    with pytest.raises(QuotaExceededError,
                       match="the reverse-mode stack pool of kernel 'walk_grad' needs"):
        engine.execute({"op": "launch", "kernel_id": ids["walk"], "args": [5],
                        "variant": "grad"})
    meta, data = engine.execute({"op": "read", "id": x.id, "role": "grad"})
    assert not np.frombuffer(data, np.float32).any()
    engine.max_memory_bytes = None
    engine.execute({"op": "launch", "kernel_id": ids["walk"], "args": [5], "variant": "grad"})
    assert engine.scratch()["stack pool"] >= threads * 8 * grid.FIRST_STACK_SLOTS


def test_fields_count_the_scratch_already_held(tmp_path, local):
    """On the CPU too: the print sink (1 MiB, taken with the first kernel that prints) is
    refused past the quota; once held, a field that fits the quota on its own but not
    beside it is refused, saying what holds the memory."""
    x, y, irs = local
    engine = Engine(tmp_path / "cache", max_memory_bytes=(1 << 20) + 64 * 1024)
    try:
        assert engine.scratch()["print sink"] == 0  # nothing printed: nothing held
        ids = _setup(engine, x, y, irs)
        engine.max_memory_bytes = 1 << 19
        with pytest.raises(QuotaExceededError,
                           match=r"the print sink \(kernel 'say' prints\) needs 1048576 bytes"):
            engine.execute({"op": "launch", "kernel_id": ids["say"], "args": [1]})
        engine.max_memory_bytes = (1 << 20) + 64 * 1024
        result, _ = engine.execute({"op": "launch", "kernel_id": ids["say"], "args": [1]})
        assert result["output"]["b64"]  # it printed
        scratch = engine.scratch()
        assert scratch["print sink"] >= 1 << 20 and scratch["random states"] > 0
        with pytest.raises(QuotaExceededError) as info:
            engine.execute({"op": "create_field", "id": 99, "dtype": "f32", "shape": [16384],
                            "element_shape": [], "name": "big"})
        assert (f"memory quota exceeded: field 'big' needs 65536 bytes; this session holds "
                f"{2 * 2 * N * 4} bytes of fields and ndarrays and") in str(info.value)
        assert f"print sink {scratch['print sink']}" in str(info.value)
        engine.execute({"op": "create_field", "id": 99, "dtype": "f32", "shape": [1024],
                        "element_shape": [], "name": "small"})
        assert engine.execute({"op": "stats"})[0]["scratch"] == engine.scratch()
    finally:
        engine.close()
