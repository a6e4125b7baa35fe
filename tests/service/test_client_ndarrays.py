"""``ti.types.ndarray()`` arguments through the client (issue 15 item 6, issue 19 items 1, 2
and 4), against a real server and an in-process engine, compared bit for bit with the same
programs run locally (``check_out_of_bound=True``, as the server compiles; see
test_client_programs.py).

A ``ti.ndarray`` made under ``arch=ti.remote`` lives on the server (an id, like a field); a
NumPy array (or a tensor) passed directly is uploaded with the launch and copied back only
when the kernel writes it. Round trips are counted with ``ti.remote_stats()``.
"""

import copy

import numpy as np
import pytest

import difftape as ti

from .test_client_programs import run_local, same


def local(program, **options):
    ti.init(arch=ti.cpu, check_out_of_bound=True, **options)
    try:
        return program()
    finally:
        ti.reset()


def round_trips() -> int:
    return ti.remote_stats()["round_trips"]


# ---------------------------------------------------------------------------- ti.ndarray

def ndarray_program():
    """Scalar, vector and matrix ndarrays made where the program runs: kernels, Python-scope
    element access (negative indices, entry writes through an element), fill, copies."""
    m = ti.Matrix.ndarray(2, 2, ti.i32, 5)
    v = ti.ndarray(ti.types.vector(3, ti.f64), (2, 3))
    s = ti.ndarray(ti.f32, 7)
    assert isinstance(m, ti.MatrixNdarray) and isinstance(v, ti.VectorNdarray)
    assert isinstance(s, ti.ScalarNdarray) and (m.n, m.m, v.n) == (2, 2, 3)

    @ti.kernel
    def mat(a: ti.types.ndarray()):
        for i in a:
            for j, k in ti.ndrange(2, 2):
                a[i][j, k] = j * j + k * k + i

    @ti.kernel
    def vec(a: ti.types.ndarray(dtype=ti.types.vector(3, ti.f64), ndim=2), t: ti.f64):
        for i, j in a:
            a[i, j] = ti.Vector([ti.sin(i + t), j * t, a[i, j].norm()])

    @ti.kernel
    def total(a: ti.types.ndarray(), b: ti.types.ndarray()) -> ti.f32:
        r = 0.0
        for i in range(a.shape[0]):
            r += a[i] * b[i % b.shape[0]][0, 1]
        return r

    mat(m)
    v.fill([0.5, -1.0, 2.0])
    vec(v, 0.25)
    s.from_numpy(np.linspace(-2, 2, 7))  # f64 values into f32: converted as locally
    s[-1] = 9.5
    s[2] = 3
    v[1, 2] = [7, 8, 9]
    v[0, 1][2] = -1.0  # an entry written through the element
    m[4] = 3  # a scalar fills the element
    out = {"m": m.to_numpy(), "v": v.to_numpy(), "s": s.to_numpy(), "s_last": s[-1],
           "v12": list(v[1, 2]), "m4": m[4].to_numpy(), "total": total(s, m)}
    c = copy.deepcopy(v)
    v.fill(0)
    out["copy"] = c.to_numpy()
    s2 = ti.ndarray(ti.f32, 7)
    s2.copy_from(s)
    out["copy_from"] = s2.to_numpy()
    return out


def test_ndarrays_live_on_the_server(remote):
    here = run_local(ndarray_program)
    same(here, remote(ndarray_program))


def test_large_ndarrays_move_as_bodies(remote):
    """Above 64 KiB an ndarray is uploaded and downloaded as a body of its own, bit for bit."""
    def program():
        a = ti.ndarray(ti.f64, (150, 100))

        @ti.kernel
        def step(x: ti.types.ndarray(ndim=2)):
            for i, j in x:
                x[i, j] = ti.sqrt(x[i, j]) + i * 0.001 - j

        a.from_numpy(np.arange(15000, dtype=np.float64).reshape(150, 100) / 7)
        step(a)
        return {"a": a.to_numpy(), "item": a[149, 99]}

    same(run_local(program), remote(program))


def grad_program():
    """tests/ad/test_ndarray_grad.py's programs: kernel.grad and Tapes over ndarrays."""
    out = {}
    n = 6
    a = ti.ndarray(float, n, needs_grad=True)
    b = ti.ndarray(float, n, needs_grad=True)

    @ti.kernel
    def run(x: ti.types.ndarray(), y: ti.types.ndarray()):
        for i in x:
            y[i] = ti.sin(x[i]) * x[i]

    a.from_numpy(np.linspace(-1.5, 1.5, n))
    b.grad.from_numpy(np.linspace(0.5, 1, n))
    run(a, b)
    run.grad(a, b)
    out.update(b=b.to_numpy(), a_grad=a.grad.to_numpy(), b_grad=b.grad.to_numpy())

    loss = ti.ndarray(float, (), needs_grad=True)

    @ti.kernel
    def reduce(x: ti.types.ndarray(), o: ti.types.ndarray()):
        for i in x:
            o[None] += x[i] ** 2 * (i + 1)

    a.grad.fill(0)  # (a Tape with an ndarray loss clears no gradients, as in Taichi)
    loss.from_numpy(np.array(42.0))
    with ti.ad.Tape(loss=loss):
        reduce(a, loss)
    out.update(loss=loss.to_numpy(), loss_grad=loss.grad.to_numpy(), a_grad2=a.grad.to_numpy())

    v = ti.ndarray(ti.types.vector(2, float), 3, needs_grad=True)
    floss = ti.field(float, (), needs_grad=True)

    @ti.kernel
    def vrun(x: ti.types.ndarray()):
        for i in x:
            floss[None] += x[i].norm_sqr() * (i + 1) + x[i][0] * x[i][1]

    v.from_numpy(np.arange(6.0).reshape(3, 2) * 0.5 - 1)
    with ti.ad.Tape(loss=floss):
        vrun(v)
    out.update(floss=floss[None], v_grad=v.grad.to_numpy())

    @ti.kernel
    def square(x: ti.types.ndarray(needs_grad=False), y: ti.types.ndarray()):
        for i in x:
            y[i] = x[i] * x[i]

    a.grad.fill(0)
    b.grad.fill(1.0)
    square(a, b)
    square.grad(a, b)  # compiled as if a had no .grad: it stays zero
    out.update(square_a_grad=a.grad.to_numpy(), square_b=b.to_numpy())
    return out


def test_ndarray_gradients(remote):
    here = local(grad_program, default_fp=ti.f64)
    same(here, remote(grad_program, default_fp=ti.f64))
    x = np.linspace(-1.5, 1.5, 6)  # and right: the analytic gradients
    np.testing.assert_allclose(here["a_grad"], np.linspace(0.5, 1, 6) *
                               (np.cos(x) * x + np.sin(x)), rtol=1e-12)
    np.testing.assert_allclose(here["a_grad2"], 2 * x * np.arange(1, 7), rtol=1e-12)
    np.testing.assert_array_equal(here["square_a_grad"], np.zeros(6))


def test_ndarray_grad_round_trips(remote):
    """A Tape over ndarrays and the reads of its loss and gradient: one request."""
    def program():
        x = ti.ndarray(ti.f64, 8, needs_grad=True)
        loss = ti.ndarray(ti.f64, (), needs_grad=True)

        @ti.kernel
        def energy(a: ti.types.ndarray(), o: ti.types.ndarray()):
            for i in a:
                o[None] += ti.cos(a[i]) * i

        x.from_numpy(np.linspace(0, 1, 8))
        ti.sync()
        before = round_trips()
        values = []
        for _ in range(3):
            x.grad.fill(0)
            with ti.ad.Tape(loss=loss):
                energy(x, loss)
            values.append((loss.to_numpy(), x.grad.to_numpy()))
        return values, round_trips() - before

    here, _ = run_local(program)
    there, cost = remote(program)
    same(here, there)
    # each iteration: one request (the loss read carries the Tape; the gradient rides in
    # it as a read-ahead from the second iteration on)
    assert cost <= 4


# ---------------------------------------------------------------------------- NumPy arrays

def numpy_program():
    @ti.kernel
    def axpy(x: ti.types.ndarray(), y: ti.types.ndarray(), a: ti.f32):
        for i in x:
            y[i] = a * x[i] + y[i]

    @ti.kernel
    def norm(x: ti.types.ndarray(dtype=ti.math.vec3, ndim=1)) -> ti.f32:
        s = 0.0
        for i in x:
            s += x[i].norm()
        return s

    @ti.kernel
    def scale(m: ti.types.ndarray(ndim=2), k: ti.f64):
        for i, j in m:
            m[i, j] *= k

    @ti.kernel
    def swap(p: ti.types.ndarray(), q: ti.types.ndarray()):
        for i in p:
            t = p[i]
            p[i] = q[i] + 1
            q[i] = t

    x = np.linspace(0, 1, 9, dtype=np.float32)
    y = np.ones(9, np.float32)
    axpy(x, y, 2.5)
    ro = np.arange(12, dtype=np.float32).reshape(4, 3)
    ro.flags.writeable = False  # read, not written: accepted, never copied back
    f = np.asfortranarray(np.arange(12, dtype=np.float64).reshape(3, 4))
    scale(f, -0.5)
    big = np.linspace(-1, 1, 20000)  # 160 KB: an upload and a download of its own
    scale(big.reshape(200, 100), 3.0)
    same_twice = np.arange(5, dtype=np.float32)
    swap(same_twice, same_twice)  # one array passed twice is one array, as locally
    return {"y": y, "x": x, "norm": norm(ro), "f": f, "f_order": f.flags.f_contiguous,
            "big": big, "twice": same_twice}


def test_numpy_arguments(remote):
    same(run_local(numpy_program), remote(numpy_program))


def test_numpy_arguments_cost_a_round_trip_only_when_written(remote):
    """Read-only inputs go with the next request; an argument the kernel writes is copied
    back right after the launch: one round trip (the launch and the read in one batch)."""
    def program():
        out = ti.field(ti.f64, 4)

        @ti.kernel
        def read(a: ti.types.ndarray()):
            for i in out:
                out[i] += a[i] * a[i]

        @ti.kernel
        def write(a: ti.types.ndarray(), b: ti.types.ndarray()):
            for i in a:
                b[i] = a[i] + out[i]

        ti.sync()
        cost = {}
        before = round_trips()
        for k in range(5):
            read(np.arange(4.0) + k)
        cost["read"] = round_trips() - before
        b = np.zeros(4)
        before = round_trips()
        write(np.arange(4.0), b)
        cost["write"] = round_trips() - before
        before = round_trips()
        values = out.to_numpy()
        cost["then_read"] = round_trips() - before
        return {"out": values, "b": b}, cost

    here, _ = run_local(program)
    there, cost = remote(program)
    same(here, there)
    # The five launches and their uploads wait for the write's request, which carries them.
    assert cost == {"read": 0, "write": 1, "then_read": 1}


def test_tensors_as_arguments(remote):
    """PyTorch tensors (also strided ones, staged) and JAX arrays (read-only) as arguments."""
    torch = pytest.importorskip("torch", reason="the [torch] extra (PyTorch) is not installed")
    jnp = pytest.importorskip("jax.numpy", reason="the [jax] extra (JAX) is not installed")

    def program():
        @ti.kernel
        def blend(x: ti.types.ndarray(), y: ti.types.ndarray()):
            for i in x:
                y[i] = y[i] * 0.5 + ti.exp(x[i])

        t = torch.linspace(0, 1, 6, dtype=torch.float32)
        u = torch.ones(12, dtype=torch.float32)[::2]  # strided: staged, written back
        blend(t, u)
        j = jnp.linspace(-1, 0, 6, dtype=jnp.float32)
        w = torch.zeros(6, dtype=torch.float32)
        blend(j, w)
        return {"u": u.numpy().copy(), "w": w.numpy().copy()}

    same(run_local(program), remote(program))


def test_local_ndarray_over_host_memory_as_argument(remote):
    """A ti.ndarray over host memory (ti.from_dlpack: local storage, even under arch=ti.remote)
    passed to a kernel: its values are uploaded with the launch; a kernel that writes it writes
    them back into that memory, a kernel that only reads it leaves it alone."""

    def program():
        @ti.kernel
        def scale(a: ti.types.ndarray()):
            for i in a:
                a[i] = a[i] * 2.0 + i

        @ti.kernel
        def total(a: ti.types.ndarray()) -> ti.f32:
            r = 0.0
            for i in range(a.shape[0]):
                r += a[i]
            return r

        base = np.linspace(-1, 1, 6, dtype=np.float32)
        nd = ti.from_dlpack(base)
        before = float(total(nd))
        scale(nd)
        return {"before": before, "after": float(total(nd)), "base": base.copy()}

    x = np.linspace(-1, 1, 6, dtype=np.float32)
    want = x * np.float32(2) + np.arange(6, dtype=np.float32)
    got = remote(program)
    np.testing.assert_array_equal(got["base"], want)
    assert got["before"] == pytest.approx(float(x.sum()), abs=1e-6)
    assert got["after"] == pytest.approx(float(want.sum()), rel=1e-6)
    same(run_local(program), got)


# ---------------------------------------------------------------------------- refusals

def test_refusals_match_local_ones(remote):
    """Wrong dtypes, element shapes and dimensions are refused before anything is sent, with
    the local errors; a bad index inside a kernel is an error response, and the session
    goes on."""
    def program():
        @ti.kernel
        def vec(a: ti.types.ndarray(dtype=ti.types.vector(2, ti.f32), ndim=1)):
            for i in a:
                a[i][0] = 1

        @ti.kernel
        def poke(a: ti.types.ndarray(dtype=ti.f32, ndim=1), k: ti.i32):
            a[k] = 1

        errors = []
        for bad in (ti.ndarray(ti.f64, 3), ti.Vector.ndarray(3, ti.f32, 3),
                    ti.ndarray(ti.types.vector(2, ti.f32), (2, 2)), np.zeros((3, 3), np.float32)):
            with pytest.raises(ti.ArgumentError) as e:
                vec(bad)
            errors.append(str(e.value))
        ro = np.zeros(3, np.float32)
        ro.flags.writeable = False
        with pytest.raises(ti.ArgumentError, match="read-only") as e:
            poke(ro, 0)
        errors.append(str(e.value))
        with pytest.raises(ti.ArgumentError, match="must be an array"):
            poke([1.0, 2.0], 0)
        a = ti.ndarray(ti.f32, 4)
        arr = np.zeros(4, np.float32)
        for target in (a, arr):
            with pytest.raises(ti.KernelAssertionError, match="out of bound|out of range"):
                poke(target, 4)
                ti.sync()
        poke(a, 3)  # the session goes on
        poke(arr, 2)
        return errors, a.to_numpy(), arr

    here = run_local(program)
    there = remote(program)
    assert here[0] == there[0]
    same(here[1:], there[1:])


def test_an_earlier_programs_ndarray_is_refused(remote):
    def program():
        return ti.ndarray(ti.f32, 3)

    old = remote(program)

    def later():
        @ti.kernel
        def touch(a: ti.types.ndarray()):
            for i in a:
                a[i] = 1

        with pytest.raises(ti.ArgumentError, match="earlier program"):
            touch(old)
        with pytest.raises(ti.DifftapeError, match="earlier program"):
            old.to_numpy()
        return True

    assert remote(later)


# ---------------------------------------------------------------------------- the protocol

def test_http_ndarray_storage_launches_and_refusals(alice, session):
    """The HTTP API itself: an ndarray made with ``POST .../fields`` (``ndarray: true``),
    uploaded as ``.npy``, bound by a launch's ``arrays``; its bytes count against the
    session's field memory; bad bindings and bad indices are 422 problems and the session
    goes on."""
    from .conftest import from_npy, npy, problem

    ti.init(arch=ti.cpu, check_out_of_bound=True)
    try:
        @ti.kernel
        def scale(a: ti.types.ndarray(dtype=ti.f32, ndim=1), k: ti.i32, s: ti.f32):
            a[k] *= s

        arr = np.arange(5, dtype=np.float32)
        _, spec = scale._specialize((arr, 0, 1.0))
        from difftape.ir import serialize
        from difftape.runtime import program

        ir = serialize.encode(scale.build_ir(program.get(), spec))
        scale(arr, 3, -2.5)  # local truth
    finally:
        ti.reset()
    base = f"/v1/sessions/{session}"
    r = alice.post(f"{base}/fields", json={"id": 40, "dtype": "f32", "shape": [5],
                                           "ndarray": True, "needs_grad": True})
    assert r.status_code == 201 and r.json()["nbytes"] == 40, r.text
    assert alice.get(base).json()["field_bytes"] == 40
    assert alice.put(f"{base}/fields/40/data", content=npy(np.arange(5, dtype=np.float32))
                     ).status_code == 204
    kid = alice.post(f"{base}/kernels", json={"ir": ir}).json()["kernel_id"]
    r = alice.post(f"{base}/kernels/{kid}/launch",
                   json={"args": [3, -2.5], "arrays": [{"arg": 0, "id": 40}]})
    assert r.status_code == 200, r.text
    assert from_npy(alice.get(f"{base}/fields/40/data").content).tobytes() == arr.tobytes()
    body = problem(alice.post(f"{base}/batch", json={"ops": [
        {"op": "create_field", "id": 41, "dtype": "f64", "shape": [5], "ndarray": True},
        {"op": "launch", "kernel_id": kid, "args": [0, 1.0], "arrays": [{"arg": 0, "id": 41}]},
    ]}), 422, "ArgumentError")
    assert body["index"] == 1 and "must be a 1-D ndarray of f32" in body["detail"]
    problem(alice.post(f"{base}/kernels/{kid}/launch", json={"args": [5, 1.0],
                       "arrays": [{"arg": 0, "id": 40}]}), 422, "IndexOutOfRangeError")
    problem(alice.post(f"{base}/kernels/{kid}/launch", json={"args": [0, 1.0]}), 422,
            "ArgumentError")
    r = alice.post(f"{base}/batch", json={"ops": [{"op": "get_bytes", "id": 40}]})
    assert r.status_code == 200 and alice.get(base).json()["state"] == "active"
