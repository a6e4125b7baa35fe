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
from interop_programs import sin_roll_program

import difftape as ti

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


@pytest.fixture
def remote(remote):
    """The service's ``remote`` fixture, with f64 as the default float."""

    def run(program):
        return remote(program, default_fp=ti.f64)

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
    return sin_roll_program(ti, N)


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


# ---------------------------------------------------------------------------- PyTorch inside

STEPS = 3


def _rollout(call, steps: int = STEPS, ndarray_input: bool = False):
    """A rollout on fields: at each step a PyTorch (or JAX) function, run with ``call``, reads
    the state and its output (a force, one field per step: the Tape's rule) drives a kernel
    that advances the state; the loss is a kernel too. ``ndarray_input``: the function reads
    a ti.ndarray copy of the state instead of a field."""
    state = ti.field(ti.f64, (steps + 1, N, 2), needs_grad=True, needs_dual=True)
    forces = [ti.field(ti.f64, (N, 2), needs_grad=True, needs_dual=True) for _ in range(steps)]
    loss = ti.field(ti.f64, (), needs_grad=True, needs_dual=True)
    now = ti.ndarray(ti.f64, (N, 2), needs_grad=True) if ndarray_input else \
        ti.field(ti.f64, (N, 2), needs_grad=True, needs_dual=True)

    @ti.kernel
    def read(t: ti.i32, now: ti.template()):
        for i, j in ti.ndrange(N, 2):
            now[i, j] = state[t, i, j]

    @ti.kernel
    def read_nd(t: ti.i32, now: ti.types.ndarray()):
        for i, j in ti.ndrange(N, 2):
            now[i, j] = state[t, i, j]

    @ti.kernel
    def advance(t: ti.i32, force: ti.template()):
        for i, j in force:
            state[t + 1, i, j] = state[t, i, j] + 0.1 * ti.sin(force[i, j])

    @ti.kernel
    def total():
        for i, j in ti.ndrange(N, 2):
            loss[None] += state[steps, i, j] * state[steps, i, j]

    def program(net, **kwargs):
        for t in range(steps):
            (read_nd if ndarray_input else read)(t, now)
            call(net, [now], [forces[t]], **kwargs)
            advance(t, forces[t])
        total()

    return state, loss, program


def _net(seed: int = 0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 2)).double()


def _torch_rollout(net, s0, steps: int = STEPS):
    s = s0
    for _ in range(steps):
        s = s + 0.1 * torch.sin(net(s))
    return (s * s).sum()


def _s0(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random((N, 2))


@pytest.mark.parametrize("ndarray_input", [False, True], ids=["field", "ndarray"])
def test_torch_call_inside_a_tape_runs_against_the_server(remote, ndarray_input):
    """interop.torch.call between kernel launches on the server, inside a ti.ad.Tape: the
    loss, the state's gradient and the network's parameter gradients equal the local run's
    bit for bit (and PyTorch's own rollout's); one round trip per call forward (its inputs,
    read with the launches queued before them) and one per call backward (the outputs'
    and the inputs' gradients, read together)."""
    from difftape.interop.torch import call

    def program():
        state, loss, run = _rollout(call, ndarray_input=ndarray_input)
        net = _net()
        for p in net.parameters():
            p.grad = torch.ones_like(p)  # the caller's: PyTorch accumulates into them once
        state.from_numpy(np.concatenate([_s0(0)[None], np.zeros((STEPS, N, 2))]))
        before = round_trips()
        with ti.ad.Tape(loss):
            run(net)
        trips = round_trips() - before
        if is_remote():
            assert trips == 2 * STEPS, trips
        return [loss.to_numpy(), state.grad.to_numpy()] + \
            [p.grad.numpy().copy() for p in net.parameters()]

    here = run_local(program)
    same(here, remote(program))
    ref = _net()
    s0 = torch.tensor(_s0(0), requires_grad=True)
    value = _torch_rollout(ref, s0)
    value.backward()
    assert float(here[0]) == pytest.approx(value.item(), rel=1e-13)
    np.testing.assert_allclose(here[1][0], s0.grad.numpy(), rtol=1e-11)
    for got, p in zip(here[2:], ref.parameters(), strict=True):
        np.testing.assert_allclose(got, p.grad.numpy() + 1, rtol=1e-11)


def test_torch_call_on_large_fields_against_the_server(remote):
    """Fields over INLINE_BYTES (a download and an upload of their own, beside the batch):
    a call's value and gradient equal the local ones bit for bit and the analytic ones,
    with an input that is an output too (its gradient zeroed, then added into)."""
    from difftape.interop.torch import call

    n = 20000  # 320 KB of f64 per field

    def program():
        x = ti.field(ti.f64, (n, 2), needs_grad=True)
        y = ti.field(ti.f64, (n, 2), needs_grad=True)
        loss = ti.field(ti.f64, (), needs_grad=True)

        @ti.kernel
        def total():
            for i, j in y:
                loss[None] += x[i, j] * y[i, j]

        x.from_numpy(np.sin(np.arange(2.0 * n)).reshape(n, 2))
        with ti.ad.Tape(loss):
            call(torch.sin, [x], [y])
            call(lambda t: t * 2, [y], [y])  # y = 2 sin(x)
            total()
        return [loss.to_numpy(), x.grad.to_numpy(), y.to_numpy()]

    here = run_local(program)
    same(here, remote(program))
    x0 = np.sin(np.arange(2.0 * n)).reshape(n, 2)
    np.testing.assert_allclose(here[0], np.sum(2 * x0 * np.sin(x0)), rtol=1e-12)
    np.testing.assert_allclose(here[1], 2 * np.sin(x0) + 2 * x0 * np.cos(x0), rtol=1e-12)


def test_torch_call_under_forward_mode_runs_against_the_server(remote):
    """Under ti.ad.FwdMode the call's inputs and their tangents are read in one request;
    the tangent of the loss equals the local one bit for bit and torch.func.jvp's."""
    from difftape.interop.torch import call

    seed = np.zeros((STEPS + 1, N, 2))
    seed[0] = np.random.default_rng(2).random((N, 2))

    def program():
        state, loss, run = _rollout(call)
        net = _net(1)
        state.from_numpy(np.concatenate([_s0(1)[None], np.zeros((STEPS, N, 2))]))
        before = round_trips()
        with ti.ad.FwdMode(loss=loss, param=state, seed=seed.reshape(-1).tolist()):
            run(net)
        trips = round_trips() - before
        if is_remote():
            assert trips == STEPS, trips
        return [loss.to_numpy(), loss.dual.to_numpy()]

    here = run_local(program)
    same(here, remote(program))
    net = _net(1)
    _, tangent = torch.func.jvp(lambda s: _torch_rollout(net, s),
                                (torch.tensor(_s0(1)),), (torch.tensor(seed[0]),))
    assert float(here[1]) == pytest.approx(tangent.item(), rel=1e-11)


def test_operator_around_a_torch_call_passes_gradcheck_against_the_server(remote):
    """A PyTorch operator whose difftape program calls PyTorch in turn (the state's start as
    its input, the loss as its output): PyTorch's gradcheck, in f64, against the server."""
    from difftape.interop.torch import call, operator

    def check():
        state, loss, run = _rollout(call)
        start = ti.field(ti.f64, (N, 2), needs_grad=True)
        net = _net(2)

        @ti.kernel
        def begin():
            for i, j in start:
                state[0, i, j] = start[i, j]

        def fn():
            begin()
            run(net)

        op = operator(fn, inputs=[start], outputs=[loss])
        s0 = torch.tensor(_s0(3), requires_grad=True)
        return torch.autograd.gradcheck(op, (s0,))

    assert remote(check)


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


def test_jax_call_inside_a_tape_runs_against_the_server(remote, jax64):
    """interop.jax.call inside a ti.ad.Tape and under ti.ad.FwdMode on the server: values,
    gradients (the state's, the parameters') and tangents equal the local run's bit for bit
    and JAX's own rollout's; one round trip per call forward and per call backward."""
    jax, jnp = jax64, jax64.numpy
    from difftape.interop.jax import Params, call

    r = np.random.default_rng(0)
    start = {"w1": r.normal(size=(2, 8)) * 0.5, "b1": np.zeros(8),
             "w2": r.normal(size=(8, 2)) * 0.5, "b2": np.zeros(2)}

    def mlp(p, s):
        return jnp.tanh(s @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]

    seed = np.zeros((STEPS + 1, N, 2))
    seed[0] = np.random.default_rng(2).random((N, 2))

    def program():
        state, loss, run = _rollout(call)
        params = Params({k: jnp.asarray(v) for k, v in start.items()})
        state.from_numpy(np.concatenate([_s0(0)[None], np.zeros((STEPS, N, 2))]))
        before = round_trips()
        with ti.ad.Tape(loss):
            run(mlp, params=params)
        trips = round_trips() - before
        out = [loss.to_numpy(), state.grad.to_numpy()] + \
            [np.asarray(params.grad[k]) for k in sorted(start)]
        before = round_trips()
        with ti.ad.FwdMode(loss=loss, param=state, seed=seed.reshape(-1).tolist()):
            run(mlp, params=params)
        fwd_trips = round_trips() - before
        if is_remote():
            assert (trips, fwd_trips) == (2 * STEPS, STEPS), (trips, fwd_trips)
        return out + [loss.dual.to_numpy()]

    here = run_local(program)
    same(here, remote(program))

    def rollout(p, s):
        for _ in range(STEPS):
            s = s + 0.1 * jnp.sin(mlp(p, s))
        return jnp.sum(s * s)

    p0 = {k: jnp.asarray(v) for k, v in start.items()}
    value, (gp, gs) = jax.value_and_grad(rollout, argnums=(0, 1))(p0, jnp.asarray(_s0(0)))
    assert float(here[0]) == pytest.approx(float(value), rel=1e-13)
    np.testing.assert_allclose(here[1][0], gs, rtol=1e-11)
    for got, k in zip(here[2:-1], sorted(start), strict=True):
        np.testing.assert_allclose(got, gp[k], rtol=1e-11, atol=1e-14)
    _, tangent = jax.jvp(lambda s: rollout(p0, s), (jnp.asarray(_s0(0)),),
                         (jnp.asarray(seed[0]),))
    assert float(here[-1]) == pytest.approx(float(tangent), rel=1e-11)


def test_jax_function_passes_check_grads_against_the_server(remote, jax64):
    """jax.test_util.check_grads in f64 on a difftape JAX function run by the server:
    reverse mode to second order (forward-over-reverse), and forward mode."""
    jnp = jax64.numpy
    from jax.test_util import check_grads

    from difftape.interop.jax import function

    def check():
        fn, ins, outs = _storage()
        a, b = (jnp.asarray(_np(t)) for t in _inputs(5))
        f = function(fn, inputs=ins, outputs=outs)
        check_grads(lambda p, q: f(p, q)[1], (a, b), order=2, modes=["rev"])
        g = function(fn, inputs=ins, outputs=outs, mode="forward")
        check_grads(lambda p, q: g(p, q)[1], (a, b), order=1, modes=["fwd"])
        return True

    assert remote(check)



@pytest.mark.parametrize("then", ["launch", "from_numpy", "to_numpy"])
def test_later_steps_wait_for_a_pass_on_the_server(remote, jax64, then):
    """A jitted call's pass runs on XLA's thread after the call returned, sending its
    requests to the server: the program's next steps (queued on the same connection) wait
    for it, so they happen after the pass, as written (docs/interop.md)."""
    import threading
    import time

    jax, jnp = jax64, jax64.numpy
    from difftape.interop.jax import function

    def program():
        x = ti.field(ti.f64, N, needs_grad=True)
        y = ti.field(ti.f64, N, needs_grad=True)
        passes = []

        @ti.kernel
        def square():
            for i in x:
                y[i] = x[i] * x[i]

        @ti.kernel
        def set_y(v: ti.f64):
            for i in y:
                y[i] = v

        def fn():
            passes.append(threading.get_ident())
            time.sleep(0.25)  # a slow pass: the caller's next step comes first
            square()

        f = function(fn, [x], [y])
        m = jnp.ones((200, 200))
        run = jax.jit(lambda a, m: f(a + 0.0 * jnp.sum(m @ m)))  # (run on XLA's thread)
        a = jnp.linspace(0.5, 1.5, N)
        jax.block_until_ready(run(a, m))
        passes.clear()
        r = run(a, m)
        if then == "to_numpy":
            seen = y.to_numpy()
        else:
            if then == "launch":
                set_y(7.0)
            else:
                y.from_numpy(np.full(N, 7.0))
            jax.block_until_ready(r)
            seen = y.to_numpy()
        assert passes and threading.get_ident() not in passes
        return np.asarray(r), seen

    r, seen = remote(program)
    a = np.linspace(0.5, 1.5, N)
    np.testing.assert_allclose(r, a * a, rtol=1e-15)
    np.testing.assert_allclose(seen, a * a if then == "to_numpy" else np.full(N, 7.0),
                               rtol=1e-15)


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
