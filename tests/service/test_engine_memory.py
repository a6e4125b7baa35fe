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
from difftape.server.engine import Engine, EngineError, QuotaExceededError, QuotaUnavailableError

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
                           # 1 MiB of text and its header (cursor, capacity, dropped)
                           match=rf"the print sink \(kernel 'say' prints\) needs "
                                 rf"{(1 << 20) + 3 * 8} bytes"):
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


def _asks(answer):
    """An ``ask_scratch`` hook answering with ``answer(ask)``; the asks it got."""
    asked = []

    def ask(a):
        asked.append(a)
        return answer(a)

    return ask, asked


def test_scratch_past_the_grant_is_asked_for_before_it_is_taken(tmp_path, local):
    """With a grant (the gateway's reservation in the user's quota), scratch past it is
    asked for before it is allocated: refused, the launch fails with the gateway's reason
    and nothing ran or was taken; granted, it runs, and launches that take nothing new ask
    nothing (the hot path)."""
    x, y, irs = local
    engine = Engine(tmp_path / "cache", scratch_grant=0)
    try:
        ids = _setup(engine, x, y, irs)
        engine.ask_scratch, asked = _asks(lambda a: {"refuse": "held by session s_other"})
        with pytest.raises(QuotaExceededError, match="^held by session s_other$") as info:
            engine.execute({"op": "launch", "kernel_id": ids["say"], "args": [1]})
        assert info.value.limit == "field_bytes"
        sink = (1 << 20) + 3 * 8  # its text and header
        assert asked == [{"scratch": sink + engine.prog.rng.nbytes, "want": asked[0]["want"],
                          "what": "the print sink (kernel 'say' prints)", "bytes": sink}]
        assert engine.scratch()["print sink"] == 0 and engine.scratch_grant == 0
        engine.ask_scratch, asked = _asks(lambda a: {"grant": a["want"]})
        result, _ = engine.execute({"op": "launch", "kernel_id": ids["say"], "args": [1]})
        assert result["output"]["b64"]  # it printed
        held = sum(engine.scratch().values())
        assert held <= engine.scratch_grant == asked[-1]["want"]
        assert [a["what"] for a in asked] == ["the print sink (kernel 'say' prints)",
                                              "the launch context of kernel 'say'"]
        for k in range(5):
            engine.execute({"op": "launch", "kernel_id": ids["say"], "args": [k]})
        engine.execute({"op": "launch", "kernel_id": ids["double"], "args": []})
        assert len(asked) == 2  # the step covered the next kernel's launch context too
        # A grant never shrinks, and an answer under the need is an error, not a grant.
        engine.ask_scratch, asked = _asks(lambda a: {"grant": a["scratch"] - 1})
        engine.scratch_grant = 0
        with pytest.raises(EngineError, match="granted .* bytes of scratch memory where"):
            engine.execute({"op": "launch", "kernel_id": ids["walk"], "args": [2]})
    finally:
        engine.close()


def test_a_ray_actor_asks_within_the_op(tmp_path, local):
    """The Ray actor's side of an ask: ``execute`` returns the ask while the op waits, and
    ``answer`` goes on with it (the op's reply, or its next ask); a refusal fails the op as
    in a worker process; an ask whose gateway stopped waiting is refused by the next op."""
    from difftape.server.raycluster import EngineActor

    x, y, irs = local
    actor = EngineActor("difftape.server.engine:Engine",
                        {"cache_dir": str(tmp_path / "cache"), "scratch_grant": 0})
    try:
        for f in (x, y):
            reply, _ = actor.execute({"op": "create_field", "id": f.id, "dtype": "f32",
                                      "shape": [N], "element_shape": [], "name": f.name})
            assert "ok" in reply
        reply, _ = actor.execute({"op": "register", "ir": irs["say"]})
        say = {"op": "launch", "kernel_id": reply["ok"]["kernel_id"], "args": [7]}
        reply, _ = actor.execute(say)
        assert reply["ask"]["what"] == "the print sink (kernel 'say' prints)"
        reply, _ = actor.answer({"refuse": "no room"})
        assert reply["error"]["type"] == "QuotaExceededError"
        assert reply["error"]["message"] == "no room" and reply["error"]["limit"] == "field_bytes"
        reply, _ = actor.execute(say)
        assert "ask" in reply  # and its gateway never answers: the next op refuses it
        reply, _ = actor.execute({"op": "read", "id": x.id})
        assert "ok" in reply
        assert actor.engine.scratch()["print sink"] == 0
        reply, _ = actor.execute(say)
        while "ask" in reply:
            reply, _ = actor.answer({"grant": reply["ask"]["want"]})
        assert reply["ok"]["output"]["b64"]
        assert actor.answer({"grant": 1})[0]["error"]["message"] == "no op waits for an answer"
    finally:
        actor.engine.close()


def test_a_grids_stack_pool_is_asked_for(local, grid_engine):
    """On a grid, a reverse-mode launch's stack pool past the grant is asked for before it
    is taken: refused, nothing ran (no gradient); granted, the launch runs, and the pool,
    kept for the next launches, needs no further ask."""
    x, y, irs = local
    engine = grid_engine(None)
    ids = _setup(engine, x, y, irs)
    engine.scratch_grant = 0
    engine.ask_scratch, asked = _asks(lambda a: {"grant": a["want"]})
    engine.execute({"op": "launch", "kernel_id": ids["double"], "args": []})
    before = len(asked)
    engine.execute({"op": "fill", "id": y.id, "role": "grad", "value": 1.0})
    engine.ask_scratch, refused = _asks(lambda a: {"refuse": "no room"})
    with pytest.raises(QuotaExceededError, match="^no room$"):
        engine.execute({"op": "launch", "kernel_id": ids["walk"], "args": [5],
                        "variant": "grad"})
    assert any("stack pool of kernel 'walk_grad'" in a["what"] for a in refused), refused
    meta, data = engine.execute({"op": "read", "id": x.id, "role": "grad"})
    assert not np.frombuffer(data, np.float32).any()
    engine.ask_scratch, asked = _asks(lambda a: {"grant": a["want"]})
    engine.execute({"op": "launch", "kernel_id": ids["walk"], "args": [5], "variant": "grad"})
    assert _held(engine) - engine.storage_bytes() <= engine.scratch_grant
    n = len(asked)
    assert before > 0 and n > 0
    for _ in range(3):
        engine.execute({"op": "launch", "kernel_id": ids["walk"], "args": [5],
                        "variant": "grad"})
    assert len(asked) == n


def test_grad_check_snapshots_are_scratch(tmp_path, local):
    """``Tape(grad_check=...)`` keeps a copy of every field (``snapshot``): counted as the
    session's scratch, asked for before it is taken, and refused past the quota."""
    x, y, irs = local
    engine = Engine(tmp_path / "cache", scratch_grant=0)
    try:
        _setup(engine, x, y, irs)
        engine.ask_scratch, asked = _asks(lambda a: {"refuse": "no room"})
        with pytest.raises(QuotaExceededError, match="^no room$"):
            engine.execute({"op": "snapshot", "key": 1})
        copies = 2 * N * 4  # the primal storage of x and y
        assert asked[0]["bytes"] == copies and not engine.snapshots
        engine.ask_scratch, asked = _asks(lambda a: {"grant": a["want"]})
        engine.execute({"op": "snapshot", "key": 1})
        assert engine.scratch()["grad_check snapshots"] == copies <= engine.scratch_grant
    finally:
        engine.close()


def _walk_grad_truth(x: np.ndarray, n: int) -> np.ndarray:
    """d/dx of sin applied ``n`` times, in f64: the product of cos over the chain."""
    s, g = x.astype(np.float64), np.ones(len(x))
    for _ in range(n):
        g *= np.cos(s)
        s = np.sin(s)
    return g


def test_cpu_reverse_mode_stacks_are_asked_for(tmp_path, local):
    """The reverse-mode stacks the CPU's threads grow while a gradient runs (a thread's as
    deep as the loop it differentiates: 8 bytes per iteration) are scratch: a growth past
    the grant is asked for before it is allocated. Refused, the launch fails with the
    gateway's reason naming the kernel, after one ask per thread at most (a failed launch
    asks no more), with nothing accumulated and the stacks freed; granted, the gradient is
    right, and launches as deep ask nothing. (Before, stacks were never counted: the
    refused launch ran.)"""
    x, y, irs = local
    deep = 20_000  # 160 KB of stack per thread: past the first 64 KiB grant step
    engine = Engine(tmp_path / "cache", scratch_grant=0, num_threads=2)
    try:
        ids = _setup(engine, x, y, irs)
        engine.ask_scratch, asked = _asks(lambda a: {"grant": a["want"]})
        x_data = np.linspace(0.1, 1.5, N, dtype=np.float32)
        engine.execute({"op": "write", "id": x.id, "dtype": "f32"}, x_data.tobytes())
        engine.execute({"op": "launch", "kernel_id": ids["walk"], "args": [deep]})
        engine.execute({"op": "fill", "id": y.id, "role": "grad", "value": 1.0})
        grad = {"op": "launch", "kernel_id": ids["walk"], "args": [deep], "variant": "grad"}
        engine.ask_scratch, refused = _asks(lambda a: {"refuse": "no room"})
        with pytest.raises(QuotaExceededError, match=r"^no room \(kernel 'walk_grad' stopped "
                           "partway") as info:
            engine.execute(grad)
        assert info.value.kernel == "walk_grad" and info.value.limit == "field_bytes"
        assert 1 <= len(refused) <= 2, refused
        assert refused[0]["what"] == "the reverse-mode stacks of kernel 'walk_grad'"
        assert refused[0]["scratch"] > engine.scratch_grant
        assert engine.scratch()["reverse-mode stacks"] == 0
        # A gateway that cannot answer (its database failed): the server's error, a 503.
        engine.ask_scratch, _ = _asks(lambda a: {"unavailable": "the database failed; retry"})
        with pytest.raises(QuotaUnavailableError, match=r"^the database failed; retry \(kernel "
                           "'walk_grad' stopped partway"):
            engine.execute(grad)
        meta, data = engine.execute({"op": "read", "id": x.id, "role": "grad"})
        assert not np.frombuffer(data, np.float32).any()
        engine.ask_scratch, asked = _asks(lambda a: {"grant": a["want"]})
        engine.execute(grad)
        assert asked and all("reverse-mode stacks" in a["what"] for a in asked)
        assert engine.scratch_grant >= 2 * deep * 8  # both threads' stacks at once, at most
        meta, data = engine.execute({"op": "read", "id": x.id, "role": "grad"})
        np.testing.assert_allclose(np.frombuffer(data, np.float32),
                                   _walk_grad_truth(x_data, deep), rtol=1e-3, atol=1e-6)
        n = len(asked)
        for _ in range(3):
            engine.execute(grad)
        engine.execute({**grad, "args": [deep // 2]})
        assert len(asked) == n
        assert engine.scratch()["reverse-mode stacks"] == 0
    finally:
        engine.close()


def test_cpu_reverse_mode_stacks_count_against_the_sessions_quota(tmp_path, local):
    """Without a gateway's grant, the session's own memory quota bounds the stacks: a
    gradient whose stacks would pass it is refused naming the kernel and what the session
    holds; a shallower one runs."""
    x, y, irs = local
    probe = Engine(tmp_path / "cache", num_threads=2)
    try:
        ids = _setup(probe, x, y, irs)
        probe.execute({"op": "launch", "kernel_id": ids["walk"], "args": [1]})
        base = _held(probe)  # fields, a launch context, rng states
    finally:
        probe.close()
    engine = Engine(tmp_path / "cache", num_threads=2, max_memory_bytes=base + 64 * 1024)
    try:
        ids = _setup(engine, x, y, irs)
        engine.execute({"op": "launch", "kernel_id": ids["walk"], "args": [1]})
        engine.execute({"op": "fill", "id": y.id, "role": "grad", "value": 1.0})
        with pytest.raises(QuotaExceededError) as info:
            engine.execute({"op": "launch", "kernel_id": ids["walk"], "args": [20_000],
                            "variant": "grad"})
        msg = str(info.value)
        assert "memory quota exceeded: the reverse-mode stacks of kernel 'walk_grad' needs" \
            in msg, msg
        assert f"{2 * 2 * N * 4} bytes of fields and ndarrays" in msg
        assert info.value.kernel == "walk_grad"
        engine.execute({"op": "launch", "kernel_id": ids["walk"], "args": [1000],
                        "variant": "grad"})
    finally:
        engine.close()
