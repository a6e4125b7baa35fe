"""Sparse SNodes (``pointer``, ``bitmasked``, ``dynamic``) run unchanged under
``arch=ti.remote``, bit for bit as the local run, over HTTP and through an in-process engine.

Locally a sparse level is dense storage plus a hidden activity field (frontend/sparse.py);
remotely those activity fields are fields of the session like any other, kernels over them
are ordinary IR, and each sparse field's ``create_field`` names its levels (``sparse``), so
that the engine does what local Python scope does with them: a write activates, ``fill`` and
``from_numpy`` reach active cells only, reverse-mode kernels guard adjoints of inactive
cells, ``deactivate_all`` zeroes (the ``zero`` op). Before this, ``pointer``/``bitmasked``/
``dynamic`` were refused under ``arch=ti.remote`` (every test here failed at the first
SNode)."""

import numpy as np
import pytest

import difftape as ti
from difftape.client import LocalTransport

from .conftest import remote_runner
from .test_client_programs import run_local, same


def sparse_program():
    """Every sparse feature a program reaches: activation by writes in kernels and in Python
    scope, struct-fors (one that activates while it runs: a snapshot), ``is_active``,
    ``ti.deactivate``, dynamic lists (``ti.append``/``ti.length``, ``x[i].append``),
    ``fill``/``from_numpy``/``copy_from``/``grad.fill``, ``deactivate_all``, and derivatives
    (Tape, ``kernel.grad()``, FwdMode) over sparse fields."""
    x = ti.field(ti.f32)
    blk = ti.root.pointer(ti.i, 4)
    cell = blk.bitmasked(ti.i, 4)
    cell.place(x, x.grad, x.dual)
    v = ti.Vector.field(2, ti.f64)
    ti.root.bitmasked(ti.ij, (3, 2)).dense(ti.ij, 2).place(v)
    lst = ti.field(ti.i32)
    ti.root.dense(ti.i, 3).dynamic(ti.j, 8, chunk_size=4).place(lst)
    flat = ti.field(ti.f32)
    ti.root.dynamic(ti.i, 6).place(flat)
    loss = ti.field(ti.f32, shape=(), needs_grad=True, needs_dual=True)

    @ti.kernel
    def init(a: ti.f32):
        for k in range(6):
            x[3 * k] = a * k
        for i in range(3):
            for k in range(i + 2):
                ti.append(lst.parent(), i, k * 10 + i)
        v[1, 2] = ti.Vector([1.5, -2.0])

    @ti.kernel
    def count() -> ti.i32:
        n = 0
        for _i in x:
            n += 1
        for _i, _j in v:
            n += 100
        return n

    @ti.kernel
    def spread():
        for i in x:  # activates its neighbours: the loop visits the cells active at its start
            x[(i + 1) % 16] += 1.0

    @ti.kernel
    def actives() -> ti.i32:
        n = 0
        for i in range(16):
            n += ti.is_active(cell, i) * (1 << i)
        return n + ti.is_active(blk, 2) * (1 << 20)

    @ti.kernel
    def total():
        for i in range(16):  # reads inactive cells too: their adjoints must not stick
            loss[None] += x[i] ** 2 + ti.sin(x[i])

    @ti.kernel
    def kill(i: ti.i32):
        ti.deactivate(blk, i)

    @ti.kernel
    def lists() -> ti.i32:
        return ti.length(lst.parent(), 0) * 100 + ti.length(lst.parent(), 1) * 10 + \
            ti.length(lst.parent(), 2)

    @ti.kernel
    def grow():
        lst[0].append(77)
        flat.append(0.25)
        flat.append(ti.cast(flat.length(), ti.f32))
        lst[2].deactivate()

    out = {}
    init(0.5)
    x[5] = 7.0  # Python scope: activates x's block and cell
    x[14] = -1.0
    out["x0"], out["n0"], out["act0"] = x.to_numpy(), count(), actives()
    spread()
    out["spread"], out["n1"] = x.to_numpy(), count()
    with ti.ad.Tape(loss):
        total()
    out["loss"], out["grad"] = loss[None], x.grad.to_numpy()
    loss.grad[None] = 2.0
    x.grad.fill(0.5)  # active cells only
    out["grad_fill"] = x.grad.to_numpy()
    total.grad()
    out["grad2"] = x.grad.to_numpy()
    with ti.ad.FwdMode(loss=loss, param=x, seed=[1.0] * 16):
        loss[None] = 0.0
        total()
    out["dual"] = loss.dual[None]
    x.fill(1.25)
    out["fill"] = x.to_numpy()
    kill(1)
    out["kill"], out["n2"], out["act1"] = x.to_numpy(), count(), actives()
    x.from_numpy(np.arange(16, dtype=np.float32))  # active cells only
    v.from_numpy(np.linspace(-1, 1, 48).reshape(6, 4, 2))
    out["from"], out["v"] = x.to_numpy(), v.to_numpy()
    out["lists0"] = lists()
    lst[1, 6] = 99  # a write past the end: the list grows to 7
    grow()
    out["lists1"], out["lst"], out["flat"] = lists(), lst.to_numpy(), flat.to_numpy()
    out["items"] = [x[5], x[6], lst[1, 6], v[2, 3], flat[1]]
    y = ti.field(ti.f32, shape=16)
    y.fill(2.0)
    x.copy_from(y)  # as Taichi: every cell activated
    out["copy"], out["n3"] = x.to_numpy(), count()
    blk.deactivate_all()
    out["da_blk"], out["n4"] = x.to_numpy(), count()
    ti.deactivate_all_snodes()
    out["da"] = [x.to_numpy(), v.to_numpy(), lst.to_numpy(), flat.to_numpy(), count(),
                 lists(), actives()]
    return out


def test_sparse_fields_run_remotely_bit_for_bit(remote):
    truth = run_local(sparse_program)
    # The local truth is what Taichi computes.
    x0 = np.zeros(16, np.float32)
    x0[::3] = 0.5 * np.arange(6)
    x0[5], x0[14] = 7.0, -1.0
    np.testing.assert_array_equal(truth["x0"], x0)
    assert truth["n0"] == 8 + 4 * 100  # x's cells 0 3 5 6 9 12 14 15; v's block (1, 1)
    # spread() activated each active cell's right neighbour: 2, 8 and 11 stay inactive, and
    # total()'s reads of them (sin(0) has slope 1) leave their adjoints 0
    np.testing.assert_array_equal(truth["grad"][[2, 8, 11]], 0.0)
    assert truth["grad"][1] == 2 * truth["spread"][1] + np.cos(truth["spread"][1])
    assert truth["lists0"] == 234 and truth["lists1"] == 370
    np.testing.assert_array_equal(truth["flat"][:2], [0.25, 1.0])
    assert truth["n3"] == 16 + 400 and truth["da"][4:] == [0, 0, 0]
    same(truth, remote(sparse_program))


def _grad_check_program():
    x = ti.field(ti.f64)
    ti.root.pointer(ti.i, 2).dense(ti.i, 2).place(x, x.grad)
    loss = ti.field(ti.f64, shape=(), needs_grad=True)

    @ti.kernel
    def f():
        for i in range(4):
            loss[None] += x[i] ** 2 + 3.0 * x[i]

    x[0] = 1.0
    with pytest.raises(ti.DifftapeError) as err:
        with ti.ad.Tape(loss, grad_check=[x]):
            f()
    return str(err.value)


def test_grad_check_of_sparse_fields_is_refused_remotely(remote):
    """Refused as locally: the finite differences would move inactive cells, which get no
    gradient (before, the remote check ran and reported x[2], x[3] as wrong)."""
    truth = run_local(_grad_check_program)
    assert "does not support programs with fields under sparse SNodes" in truth
    assert remote(_grad_check_program) == truth


def _large_program():
    """A sparse field over 64 KiB: from_numpy and to_numpy are transfers of their own (the
    engine's write and read), not batched bytes; the write reaches the active cells."""
    x = ti.field(ti.f32)
    ti.root.pointer(ti.i, 64).bitmasked(ti.i, 512).place(x)

    @ti.kernel
    def touch():
        for k in range(100):
            x[k * 311] = 1.0

    touch()
    x.from_numpy(np.linspace(-1.0, 1.0, 64 * 512, dtype=np.float32))
    return x.to_numpy()


def test_large_sparse_transfers_remotely(remote):
    truth = run_local(_large_program)
    assert np.count_nonzero(truth) == 100
    same(truth, remote(_large_program))


def _graph_program():
    """A captured step that activates (a kernel writes), clears (``deactivate_all``) and
    counts, replayed; then what a capture refuses for sparse fields, as locally."""
    x = ti.field(ti.f32)
    blk = ti.root.pointer(ti.i, 4)
    blk.dense(ti.i, 4).place(x)
    n = ti.field(ti.i32, shape=())

    @ti.kernel
    def fill_some(k: ti.i32):
        for i in range(k):
            x[(i * 5) % 16] += 1.0 + i

    @ti.kernel
    def count():
        for _i in x:
            n[None] += 1

    with ti.graph.capture() as g:
        ti.deactivate_all_snodes()
        fill_some(g.input("k", 2))
        count()
    seen = []
    for k in (1, 3, 5):
        g.replay(k=k)
        seen.append((x.to_numpy(), n[None]))
    errors = []
    for step in (lambda: x.fill(1.0), lambda: x.__setitem__(3, 1.0),
                 lambda: x.from_numpy(np.ones(16, np.float32)),
                 lambda: x.from_numpy(g.input("a", np.ones(16, np.float32))),
                 lambda: g.input("x", x)):
        with pytest.raises((ti.GraphCaptureError, ti.GraphError)) as err:
            with ti.graph.capture() as g:
                step()
        errors.append((type(err.value).__name__, str(err.value).split(" (at ")[0]))
    return seen, errors


def test_a_captured_graph_with_sparse_ops_replays_remotely(remote):
    truth = run_local(_graph_program)
    seen, errors = truth
    # deactivate_all replays: each replay starts from no active cell
    np.testing.assert_array_equal(seen[2][0][[0, 5, 10, 15, 4]], [1, 2, 3, 4, 5])
    assert [c for _, c in seen] == [4, 4 + 12, 16 + 16]  # blocks of 4 cells: 1, 3, 4
    assert "fields under sparse SNodes are filled/copied" in errors[0][1]
    same(truth, remote(_graph_program))


def test_the_session_save_keeps_activity():
    """A culled session resumes with its sparse fields' activity (the activity fields are
    fields of the session, and each sparse field's levels are saved with it)."""
    from difftape.runtime import program
    from difftape.server.engine import Engine

    engine = Engine()
    ti.init(arch=ti.remote, transport=LocalTransport(engine))
    try:
        x = ti.field(ti.f32)
        ti.root.pointer(ti.i, 4).bitmasked(ti.i, 2).place(x, x.grad)
        lst = ti.field(ti.i32)
        ti.root.dynamic(ti.i, 4).place(lst)

        @ti.kernel
        def count() -> ti.i32:
            n = 0
            for _i in x:
                n += 1
            return n * 10 + lst.length()

        x[3] = 2.0
        x[6] = 1.0
        lst[1] = 5
        assert count() == 22
        _, saved = engine.execute({"op": "save"})
        fresh = Engine()
        fresh.execute({"op": "load"}, bytes(saved))
        program.get().remote.transport.engine = fresh
        assert count() == 22
        x.fill(4.0)  # still the active cells only: the levels came back with the field
        lst[2] = 1  # and a write still activates
        x.grad[0] = 1.0  # activates cell 0 (bitmasked: that cell alone)
        np.testing.assert_array_equal(x.to_numpy(), [0, 0, 0, 4, 0, 0, 4, 0])
        assert count() == 33
    finally:
        ti.reset()


def test_activity_fields_count_in_the_memory_quota():
    """The hidden activity fields are storage of the session: the quota counts them (a
    pointer level over 4096 cells is 4096 bytes beside x's 16 KiB)."""
    from difftape.client.errors import QuotaExceededError
    from difftape.server.engine import Engine

    engine = Engine(max_memory_bytes=16384 + 4096 - 1)
    ti.init(arch=ti.remote, transport=LocalTransport(engine))
    try:
        x = ti.field(ti.f32)
        with pytest.raises(QuotaExceededError, match="holds 4096 bytes of fields"):
            ti.root.pointer(ti.i, 4096).place(x)
            ti.sync()
    finally:
        ti.reset()
    engine = Engine()
    ti.init(arch=ti.remote, transport=LocalTransport(engine))
    try:
        x = ti.field(ti.f32)
        ti.root.pointer(ti.i, 4096).place(x)
        x[7] = 1.0
        ti.sync()
        assert engine.storage_bytes() == 16384 + 4096
    finally:
        ti.reset()


def test_the_engine_checks_sparse_levels():
    """``create_field``'s ``sparse`` is checked: every index the engine derives from it is in
    range of the activity field it names."""
    from difftape.errors import DifftapeError
    from difftape.server.engine import Engine

    engine = Engine()
    run = engine.execute
    run({"op": "create_field", "id": 1, "dtype": "i8", "shape": [4]})
    run({"op": "create_field", "id": 2, "dtype": "i32", "shape": [4]})
    run({"op": "create_field", "id": 3, "dtype": "f32", "shape": [4], "offset": [2]})
    good = {"activity": 1, "map": [[0, 2]], "dynamic": False}
    run({"op": "create_field", "id": 10, "dtype": "f32", "shape": [8], "sparse": [good]})
    bad = [
        ({**good, "activity": 9}, "not a dense scalar field"),
        ({**good, "activity": 3}, "not a dense scalar field"),  # an offset
        ({**good, "activity": 10}, "not a dense scalar field"),  # itself sparse
        ({**good, "activity": 2}, "must be i8"),
        ({**good, "map": [[0, 3]]}, "does not divide"),
        ({**good, "map": [[0, 1]]}, "does not divide"),
        ({**good, "map": [[1, 2]]}, "map entries"),
        ({**good, "map": [[0, 0]]}, "map entries"),
        ({"activity": 2, "map": [[0, 2]], "dynamic": True}, "comes last, undivided"),
        ({**good, "extra": 1}, "expected"),
    ]
    for k, (lvl, msg) in enumerate(bad):
        with pytest.raises(DifftapeError, match=msg):
            run({"op": "create_field", "id": 20 + k, "dtype": "f32", "shape": [8],
                 "sparse": [lvl]})
    with pytest.raises(DifftapeError, match="another layout"):  # the levels are its layout
        run({"op": "create_field", "id": 10, "dtype": "f32", "shape": [8]})
    # a write activates; a fill reaches active cells only
    run({"op": "set_item", "id": 10, "index": [-3], "value": 2.5})
    run({"op": "fill", "id": 10, "value": 1.0})
    f = engine.prog.fields
    np.testing.assert_array_equal(f[1].storage.read(), [0, 0, 1, 0])
    np.testing.assert_array_equal(f[10].storage.read(), [0, 0, 0, 0, 1, 1, 0, 0])


def _close(a, b) -> None:
    """Equal activity, counts and integers; floats to rounding (a GPU's float atomics add
    in another order, and its sin is libdevice's)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _close(a[k], b[k])
    elif isinstance(a, list | tuple):
        for x, y in zip(a, b, strict=True):
            _close(x, y)
    elif isinstance(a, ti.Matrix):
        _close(list(a.entries), list(b.entries))
    elif isinstance(a, np.ndarray) and a.dtype.kind != "f" or isinstance(a, int):
        np.testing.assert_array_equal(a, b, strict=True)
    else:
        np.testing.assert_allclose(a, b, rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(a) == 0, np.asarray(b) == 0)


def test_sparse_fields_on_a_gpu_engine(request):
    """The same program on a ``--arch cuda`` server's engine (the CUDA target's lowering on
    the simulated grid): struct-fors, activation and guarded adjoints there too."""
    _close(run_local(sparse_program), remote_runner(request, "grid")(sparse_program))


def _sparse_matrix_program():
    """``ti.linalg`` sparse matrices: a builder filled by a kernel (its triplet storage is a
    ti.ndarray, on the server remotely), built, multiplied with ndarrays and fields, solved
    (direct and CG), built from an ndarray; then a full builder's error."""
    n = 8
    K = ti.linalg.SparseMatrixBuilder(n, n, max_num_triplets=3 * n, dtype=ti.f64)
    b = ti.ndarray(ti.f64, n)
    xf = ti.field(ti.f64, shape=n)

    @ti.kernel
    def fill(A: ti.types.sparse_matrix_builder(), b: ti.types.ndarray(), s: ti.f64):
        for i in range(n):  # each entry appended once: the sums do not depend on the order
            A[i, i] += 4.0 + i * s
            if i > 0:
                A[i, i - 1] -= 1.0
                A[i - 1, i] -= 1.0
            b[i] = ti.sin(i + s)

    fill(K, b, 1.0)
    A = K.build()
    solver = ti.linalg.SparseSolver(dtype=ti.f64, solver_type="LLT")
    solver.analyze_pattern(A)
    solver.factorize(A)
    x = solver.solve(b)
    xf.from_numpy(x.to_numpy())
    fill(K, b, 0.5)  # the builder is empty again after build()
    A2 = K.build()
    xc, ok = ti.linalg.SparseCG(A2, b, max_iter=100, atol=1e-12).solve()
    t = ti.Vector.ndarray(3, ti.f64, 4)
    t.from_numpy(np.array([[0, 1, 2.5], [3, 3, -1.0], [0, 1, 0.5], [7, 0, 4.0]]))
    C = ti.linalg.SparseMatrix(n, n, dtype=ti.f64)
    C.build_from_ndarray(t)
    out = {"A": A.to_numpy(), "x": x.to_numpy(), "Ax": (A @ x).to_numpy(), "Axf": A @ xf,
           "A2": A2.to_numpy(), "xc": xc, "ok": ok, "C": (C @ A).to_numpy()}
    full = ti.linalg.SparseMatrixBuilder(n, n, max_num_triplets=n, dtype=ti.f64)
    with pytest.raises(ti.KernelAssertionError) as err:
        fill(full, b, 1.0)
        ti.sync()
    out["full"] = str(err.value).split("\n")[0]
    return out


def test_sparse_matrices_run_remotely_bit_for_bit(remote):
    pytest.importorskip("scipy", reason="ti.linalg's sparse matrices need SciPy")
    truth = run_local(_sparse_matrix_program)
    np.testing.assert_allclose(truth["Ax"], np.sin(np.arange(8) + 1.0), rtol=1e-12)
    assert truth["ok"] and "is full" in truth["full"]
    same(truth, remote(_sparse_matrix_program))
