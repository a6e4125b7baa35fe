"""PyTorch and JAX against a difftape server (issue 19, item 4): tensors go in and out of
remote fields as bytes, and ``difftape.interop.torch.operator`` / ``interop.jax.function``
run their program on the server, forward and backward one request each (counted with
``ti.remote_stats()``), with results equal bit for bit to the same program run locally
(``check_out_of_bound=True``: the server compiles with bounds checks, see test_client_programs.py).
``examples/torch_controller.py`` trains through the server with the losses of a local run.
"""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

import difftape as ti
from difftape.client import LocalTransport

from .test_client_programs import same

torch = pytest.importorskip("torch", reason="the [torch] extra (PyTorch) is not installed")

N = 5
REPO = Path(__file__).resolve().parents[2]


def run_local(program):
    ti.init(arch=ti.cpu, check_out_of_bound=True, default_fp=ti.f64)
    try:
        return program()
    finally:
        ti.reset()


@pytest.fixture(params=["http", "inproc"])
def remote(request):
    """Runs a program remotely: over HTTP to the shared server, or in-process."""

    def run(program):
        if request.param == "http":
            service = request.getfixturevalue("service")
            ti.init(arch=ti.remote, server=service.url, token=service.tokens["alice"],
                    default_fp=ti.f64)
        else:
            ti.init(arch=ti.remote, transport=LocalTransport(), default_fp=ti.f64)
        try:
            return program()
        finally:
            ti.reset()

    return run


@pytest.fixture
def jax64():
    """JAX with float64 arrays (restored afterwards)."""
    jax = pytest.importorskip("jax", reason="the [jax] extra (JAX) is not installed")
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield jax
    jax.config.update("jax_enable_x64", previous)


def round_trips() -> int:
    return ti.remote_stats()["round_trips"]  # zero locally


def is_remote() -> bool:
    from difftape.runtime import program

    return program.get().remote is not None


def _storage():
    """y[i] = sin(x[i]) w[i]^2 + x[(i+1) % n] w[i];  s = sum(y^2)  (fields, f64)."""
    x = ti.field(ti.f64, N, needs_grad=True)
    w = ti.field(ti.f64, N, needs_grad=True)
    y = ti.field(ti.f64, N, needs_grad=True)
    s = ti.field(ti.f64, (), needs_grad=True)

    @ti.kernel
    def compute():
        for i in x:
            y[i] = ti.sin(x[i]) * w[i] * w[i] + x[(i + 1) % N] * w[i]

    @ti.kernel
    def total():
        for i in y:
            s[None] += y[i] * y[i]

    def program():
        compute()
        total()

    return program, [x, w], [y, s]


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(N, dtype=torch.float64, generator=g, requires_grad=True)
            for _ in range(2)]


def _np(t) -> np.ndarray:
    return t.detach().numpy().copy()


# ---------------------------------------------------------------------------- arrays

class _DLPackOnly:
    def __init__(self, a):
        self._a = a

    def __dlpack__(self, *args, **kwargs):
        return self._a.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_tensors_in_and_out_of_remote_fields(remote, jax64):
    """from_numpy takes tensors (also ones autograd tracks), JAX arrays and DLPack objects,
    small (inline in a batch) and large (an upload); to_torch/to_jax give them back."""
    jnp = jax64.numpy
    small = np.linspace(-1, 2, 6).reshape(3, 2)
    large = np.sin(np.arange(40000.0)).reshape(20000, 2)  # 320 KB: not inline

    def program():
        out = []
        for want in (small, large):
            f = ti.Vector.field(2, ti.f64, shape=want.shape[0])
            for src in (torch.tensor(want, requires_grad=True), jnp.asarray(want),
                        _DLPackOnly(torch.tensor(want))):
                f.fill(0)
                f.from_numpy(src)
                got = f.to_numpy()
                assert got.tobytes() == want.tobytes()
                out.append(got)
            t = f.to_torch()
            assert isinstance(t, torch.Tensor) and t.numpy().tobytes() == want.tobytes()
            assert np.asarray(f.to_jax()).tobytes() == want.tobytes()
            f.from_torch(torch.tensor(want[::-1].copy()))
            out.append(f.to_numpy())
        return out

    same(run_local(program), remote(program))


# ---------------------------------------------------------------------------- PyTorch

def test_torch_operator_runs_on_the_server(remote):
    """Forward and backward: one round trip each, the latest call's recording reused or an
    older call run again (interleaved calls), values and gradients equal to local ones."""
    from difftape.interop.torch import operator

    def program():
        fn, ins, outs = _storage()
        op = operator(fn, inputs=ins, outputs=outs)
        a, b = _inputs(0)
        c, d = _inputs(1)
        trips = []
        before = round_trips()
        y1, s1 = op(a, b)
        trips.append(round_trips() - before)
        before = round_trips()
        y2, s2 = op(c, d)
        trips.append(round_trips() - before)
        before = round_trips()
        (s2 + y2.sum()).backward()  # the latest call: its recording
        trips.append(round_trips() - before)
        before = round_trips()
        (s1 * 3).backward()  # an older one: run again from its inputs
        trips.append(round_trips() - before)
        if is_remote():
            assert trips == [1, 1, 1, 1], trips
        return [_np(t) for t in (y1, s1, y2, s2, a.grad, b.grad, c.grad, d.grad)]

    local = run_local(program)
    same(local, remote(program))
    # and the gradient is the right one (central differences, in PyTorch's own check)
    def check():
        fn, ins, outs = _storage()
        op = operator(fn, inputs=ins, outputs=outs)
        return torch.autograd.gradcheck(op, tuple(_inputs(2)))

    assert remote(check)


def test_torch_forward_mode_and_double_backward_remotely(remote):
    """Forward mode (torch.autograd.forward_ad) and double backward (create_graph=True) run
    difftape's forward mode and forward-over-reverse on the server, one request each."""
    import torch.autograd.forward_ad as fwAD

    from difftape.interop.torch import operator

    def program():
        fn, ins, outs = _storage()
        op = operator(fn, inputs=ins, outputs=outs)
        a, b = _inputs(3)
        ta, tb = (torch.linspace(-1, 1, N, dtype=torch.float64) * k for k in (1.0, 0.5))
        before = round_trips()
        with fwAD.dual_level():
            y, s = op(fwAD.make_dual(a.detach(), ta), fwAD.make_dual(b.detach(), tb))
            jvp = [fwAD.unpack_dual(o).tangent for o in (y, s)]
        jvp_trips = round_trips() - before
        y, s = op(a, b)
        ga, gb = torch.autograd.grad(s, (a, b), create_graph=True)
        before = round_trips()
        h = torch.autograd.grad((ga * ta).sum() + (gb * tb).sum(), (a, b))
        hvp_trips = round_trips() - before
        if is_remote():
            assert jvp_trips == 2, jvp_trips  # PyTorch calls forward, then jvp
            assert hvp_trips == 1, hvp_trips
        return [_np(t) for t in (*jvp, ga, gb, *h)]

    same(run_local(program), remote(program))


def _ndarray_storage():
    """_storage()'s program with ti.ndarray storage, the kernels taking it as arguments
    (an intermediate ndarray between them)."""
    x = ti.ndarray(ti.f64, N, needs_grad=True)
    w = ti.ndarray(ti.f64, N, needs_grad=True)
    y = ti.ndarray(ti.f64, N, needs_grad=True)
    s = ti.ndarray(ti.f64, (), needs_grad=True)
    tmp = ti.ndarray(ti.f64, N, needs_grad=True)

    @ti.kernel
    def compute(a: ti.types.ndarray(), b: ti.types.ndarray(), o: ti.types.ndarray()):
        for i in a:
            o[i] = ti.sin(a[i]) * b[i] * b[i] + a[(i + 1) % N] * b[i]

    @ti.kernel
    def copy(a: ti.types.ndarray(), o: ti.types.ndarray()):
        for i in a:
            o[i] = a[i]

    @ti.kernel
    def total(a: ti.types.ndarray(), o: ti.types.ndarray()):
        for i in a:
            o[None] += a[i] * a[i]

    def program():
        compute(x, w, tmp)
        copy(tmp, y)
        total(tmp, s)

    return program, [x, w], [y, s]


def test_ndarray_storage_runs_on_the_server(remote, jax64):
    """ti.ndarray as the declared storage of a PyTorch operator and of a JAX function: on the
    server as field storage is, forward and backward one request each, values and gradients
    equal to the local ones (where the ndarrays share the tensors' memory)."""
    jax, jnp = jax64, jax64.numpy
    from difftape.interop.jax import function
    from difftape.interop.torch import operator

    def program():
        fn, ins, outs = _ndarray_storage()
        op = operator(fn, inputs=ins, outputs=outs)
        a, b = _inputs(0)
        c, d = _inputs(1)
        trips = []
        before = round_trips()
        y1, s1 = op(a, b)
        y2, s2 = op(c, d)
        trips.append(round_trips() - before)
        before = round_trips()
        (s2 + y2.sum()).backward()  # the latest call: its recording
        (s1 * 3).backward()  # an older one: run again from its inputs
        trips.append(round_trips() - before)
        f = function(fn, inputs=ins, outputs=outs)
        value, grads = jax.value_and_grad(lambda p, q: f(p, q)[1], argnums=(0, 1))(
            jnp.asarray(_np(a)), jnp.asarray(_np(b)))
        if is_remote():
            assert trips == [2, 2], trips
        return [_np(t) for t in (y1, s1, y2, s2, a.grad, b.grad, c.grad, d.grad)] + \
            [float(value), *(np.asarray(g) for g in grads)]

    here = run_local(program)
    same(here, remote(program))
    # the right gradient: d/da of s = sum(y^2), y = sin(a) b^2 + roll(a) b
    a, b = (_np(t) for t in _inputs(0))
    y = np.sin(a) * b * b + np.roll(a, -1) * b
    ga = 3 * 2 * y * np.cos(a) * b * b + np.roll(3 * 2 * y * b, 1)
    np.testing.assert_allclose(here[4], ga, rtol=1e-12)

    def check():  # PyTorch's own check, against the server
        fn, ins, outs = _ndarray_storage()
        return torch.autograd.gradcheck(operator(fn, inputs=ins, outputs=outs),
                                        tuple(_inputs(2)))

    assert remote(check)


def test_local_ndarray_storage_is_refused_remotely(remote):
    from difftape.interop.torch import operator

    x = run_local(lambda: ti.ndarray(ti.f64, N, needs_grad=True))  # local memory

    def program():
        y = ti.ndarray(ti.f64, N, needs_grad=True)
        with pytest.raises(ti.DifftapeError, match="must live on the server"):
            operator(lambda: None, inputs=[x], outputs=[y])
        return True

    assert remote(program)


# ---------------------------------------------------------------------------- JAX

def test_jax_function_runs_on_the_server(remote, jax64):
    jax, jnp = jax64, jax64.numpy

    from difftape.interop.jax import function

    def program():
        fn, ins, outs = _storage()
        f = function(fn, inputs=ins, outputs=outs)
        a, b = (jnp.asarray(_np(t)) for t in _inputs(4))
        def total(a, b):
            y, s = f(a, b)
            return s + y.sum()

        loss = jax.jit(jax.value_and_grad(total, argnums=(0, 1)))
        before = round_trips()
        value, (ga, gb) = loss(a, b)
        value = float(value)  # waits for the callbacks
        trips = round_trips() - before
        if is_remote():
            assert trips == 2, trips  # the forward pass, the backward pass
        fwd = function(fn, inputs=ins, outputs=outs, mode="forward")
        t = jnp.linspace(-1.0, 1.0, N)
        before = round_trips()
        _, jvp = jax.jvp(lambda a: fwd(a, b)[0], (a,), (t,))
        jvp_trips = round_trips() - before
        if is_remote():
            assert jvp_trips == 2, jvp_trips  # the outputs, the tangents (two callbacks)
        return [value, *(np.asarray(v) for v in (ga, gb, jvp))]

    same(run_local(program), remote(program))


# ---------------------------------------------------------------------------- the example

def _example():
    spec = importlib.util.spec_from_file_location("torch_controller",
                                                  REPO / "examples" / "torch_controller.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_torch_controller_trains_through_the_server(service):
    """The example's first iterations, locally and with ``arch=ti.remote``: the same losses
    bit for bit, and two round trips per physics step (its forward and its backward)."""
    ex = _example()
    iters = 3
    local = ex.train(iters, check_out_of_bound=True)
    ti.reset()
    remote = ex.train(iters, arch=ti.remote, server=service.url, token=service.tokens["alice"])
    trips = ti.remote_stats()["round_trips"]
    ti.reset()
    assert remote == local, (remote, local)
    assert local[-1] < local[0]
    # per iteration: each step's forward and backward pass; plus opening the session
    assert trips <= iters * 2 * ex.STEPS + 1, trips
