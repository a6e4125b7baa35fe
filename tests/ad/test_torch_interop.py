"""difftape programs as PyTorch operators (difftape.interop.torch): reverse mode, forward mode
and double backward checked with gradcheck/gradgradcheck in f64 and against the same
computation written in PyTorch; zero-copy ndarray storage; the caller's .grad accumulated
exactly once; torch.compile."""

import numpy as np
import pytest
from interop_programs import sin_roll_program

torch = pytest.importorskip("torch", reason="the [torch] extra (PyTorch) is not installed")

pytestmark = pytest.mark.difftape_only

N = 5


@pytest.fixture
def ti64(backend):
    backend.init(arch=backend.cpu, default_fp=backend.f64)
    yield backend
    backend.reset()


def _field_op(ti):
    """y[i] = sin(x[i]) * w[i]^2 + x[(i+1) % n] * w[i];  s = sum(y^2)"""
    from difftape.interop.torch import operator

    program, inputs, outputs = sin_roll_program(ti, N)
    return operator(program, inputs=inputs, outputs=outputs)


def _torch_reference(x, w):
    y = torch.sin(x) * w * w + torch.roll(x, -1) * w
    return y, (y * y).sum()


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(N, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.rand(N, dtype=torch.float64, generator=g, requires_grad=True)
    return x, w


def test_gradcheck_first_second_order_and_forward_mode(ti64):
    op = _field_op(ti64)
    x, w = _inputs()
    assert torch.autograd.gradcheck(op, (x, w), check_forward_ad=True)
    assert torch.autograd.gradgradcheck(op, (x, w))


def test_matches_pure_pytorch_to_second_order(ti64):
    op = _field_op(ti64)
    x, w = _inputs(1)
    y, s = op(x, w)
    yr, sr = _torch_reference(x, w)
    torch.testing.assert_close(y, yr)
    torch.testing.assert_close(s, sr)
    g = torch.autograd.grad(s, (x, w), create_graph=True)
    gr = torch.autograd.grad(sr, (x, w), create_graph=True)
    for a, b in zip(g, gr, strict=True):
        torch.testing.assert_close(a, b)
    v = torch.linspace(-1, 1, N, dtype=torch.float64)
    hv = torch.autograd.grad((g[0] * v).sum(), (x, w))
    hvr = torch.autograd.grad((gr[0] * v).sum(), (x, w))
    for a, b in zip(hv, hvr, strict=True):
        torch.testing.assert_close(a, b)


def test_forward_mode_matches_pytorch(ti64):
    import torch.autograd.forward_ad as fwAD

    op = _field_op(ti64)
    x, w = (t.detach() for t in _inputs(2))
    tx, tw = torch.randn(N, dtype=torch.float64), torch.randn(N, dtype=torch.float64)
    with fwAD.dual_level():
        _, s = op(fwAD.make_dual(x, tx), fwAD.make_dual(w, tw))
        _, sr = _torch_reference(fwAD.make_dual(x, tx), fwAD.make_dual(w, tw))
        torch.testing.assert_close(fwAD.unpack_dual(s).tangent, fwAD.unpack_dual(sr).tangent)


def test_gradients_against_finite_differences(ti64):
    op = _field_op(ti64)
    x, w = _inputs(3)
    _, s = op(x, w)
    gx, = torch.autograd.grad(s, x)
    h = 1e-6
    for i in range(N):
        e = torch.zeros(N, dtype=torch.float64)
        e[i] = h
        fd = (op(x.detach() + e, w.detach())[1] - op(x.detach() - e, w.detach())[1]) / (2 * h)
        assert gx[i].item() == pytest.approx(fd.item(), rel=1e-6, abs=1e-9)


def test_callers_grad_is_accumulated_exactly_once(ti64):
    op = _field_op(ti64)
    x, w = _inputs(4)
    x.grad = torch.full((N,), 10.0, dtype=torch.float64)
    before = x.grad.clone()
    _, s = op(x, w)
    assert torch.equal(x.grad, before)  # the forward pass leaves it alone
    xr = x.detach().clone().requires_grad_()
    (want,) = torch.autograd.grad(_torch_reference(xr, w.detach())[1], xr)
    s.backward()
    torch.testing.assert_close(x.grad, before + want)


def test_interleaved_calls_and_repeated_backward(ti64):
    op = _field_op(ti64)
    x1, w = _inputs(5)
    x2, _ = _inputs(6)
    _, s1 = op(x1, w)
    _, s2 = op(x2, w)  # overwrites the fields: s1's backward must run the program again
    (s1 + 2 * s2).backward(retain_graph=True)
    r1, r2 = x1.detach().clone().requires_grad_(), x2.detach().clone().requires_grad_()
    wr = w.detach().clone().requires_grad_()
    (_torch_reference(r1, wr)[1] + 2 * _torch_reference(r2, wr)[1]).backward()
    torch.testing.assert_close(x1.grad, r1.grad)
    torch.testing.assert_close(x2.grad, r2.grad)
    torch.testing.assert_close(w.grad, wr.grad)
    s1.backward()  # a second backward through the same graph
    (_torch_reference(r1, wr)[1]).backward()
    torch.testing.assert_close(x1.grad, r1.grad)


def _ndarray_op(ti):
    from difftape.interop.torch import operator

    a = ti.ndarray(ti.f64, N, needs_grad=True)
    b = ti.ndarray(ti.f64, N, needs_grad=True)

    @ti.kernel
    def cube(a: ti.types.ndarray(), b: ti.types.ndarray()):
        for i in a:
            b[i] = a[i] * a[i] * a[i]

    return operator(lambda: cube(a, b), inputs=[a], outputs=[b], name="cube"), a, b


@pytest.mark.host_memory
def test_ndarray_storage_shares_the_tensors_memory(ti64):
    op, a, b = _ndarray_op(ti64)
    x = torch.rand(N, dtype=torch.float64, requires_grad=True)
    y = op(x)
    assert a.storage.address == x.data_ptr()  # the input was not copied
    assert b.storage.address == y.data_ptr()  # the kernel wrote the output tensor itself
    torch.testing.assert_close(y, x.detach() ** 3)
    assert torch.autograd.gradcheck(op, (x,))
    with pytest.raises(ti64.DifftapeError, match="ti.ndarray has no tangent"):
        torch.autograd.gradgradcheck(op, (x,))


def test_wrong_dtype_shape_and_device_are_refused(ti64):
    op = _field_op(ti64)
    x, w = _inputs()
    with pytest.raises(ti64.DifftapeError, match="dtype float32"):
        op(x.float(), w)
    with pytest.raises(ti64.DifftapeError, match=r"shape \(4,\)"):
        op(x[:4], w)
    with pytest.raises(ti64.DifftapeError, match="takes 2"):
        op(x)
    strided = torch.rand(2 * N, dtype=torch.float64)[::2]  # accepted: one documented copy
    torch.testing.assert_close(op(strided, w)[0], _torch_reference(strided, w)[0])


def test_torch_compile_keeps_the_operator_whole(ti64):
    op = _field_op(ti64)

    def model(x, w):
        y, s = op(torch.tanh(x), w)
        return s + y.sum()

    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x, w = _inputs(7)
    out = compiled(x, w)
    out.backward()
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    yr, sr = _torch_reference(torch.tanh(xr), wr)
    (sr + yr.sum()).backward()
    torch.testing.assert_close(out, sr + yr.sum())
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(w.grad, wr.grad)


def test_import_difftape_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, difftape; assert 'torch' not in sys.modules and 'jax' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_example_controller_trains_through_the_simulation(tmp_path):
    """examples/torch_controller.py: reverse mode through a 40-step rollout trains the
    PyTorch controller; its loss falls by at least 10x (the full run reaches ~1000x)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
    try:
        import torch_controller
    finally:
        sys.path.pop(0)
    try:
        losses = torch_controller.train(iters=50)
    finally:
        import difftape

        difftape.reset()
    assert losses[0] / losses[-1] >= 10, losses


def _controller_program(ti, steps=3):
    """A rollout: at each step a PyTorch network reads the state (a field row) and its output
    drives a difftape kernel that advances the state; the loss is a kernel too."""
    from difftape.interop.torch import call

    state = ti.field(ti.f64, (steps + 1, N, 2), needs_grad=True, needs_dual=True)
    # one force field per step: a kernel's adjoint reads what it read, so nothing it read may
    # be overwritten later in the recording (the Tape's rule)
    forces = [ti.field(ti.f64, (N, 2), needs_grad=True, needs_dual=True) for _ in range(steps)]
    loss = ti.field(ti.f64, (), needs_grad=True, needs_dual=True)
    now = ti.field(ti.f64, (N, 2), needs_grad=True, needs_dual=True)

    @ti.kernel
    def read(t: ti.i32):
        for i, j in now:
            now[i, j] = state[t, i, j]

    @ti.kernel
    def advance(t: ti.i32, force: ti.template()):
        for i, j in force:
            state[t + 1, i, j] = state[t, i, j] + 0.1 * ti.sin(force[i, j])

    @ti.kernel
    def total():
        for i, j in now:
            loss[None] += state[steps, i, j] * state[steps, i, j]

    def program(net):
        for t in range(steps):
            read(t)
            call(net, [now], [forces[t]])
            advance(t, forces[t])
        total()

    return state, loss, program


def _torch_rollout(net, s0, steps=3):
    s = s0
    for _ in range(steps):
        s = s + 0.1 * torch.sin(net(s))
    return (s * s).sum()


def _net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 2)).double()


def test_pytorch_module_inside_a_tape_takes_part_in_the_gradient(ti64):
    state, loss, program = _controller_program(ti64)
    net, ref = _net(), _net()
    s0 = np.random.default_rng(0).random((N, 2))
    state.from_numpy(np.concatenate([s0[None], np.zeros((3, N, 2))]))
    for p in net.parameters():
        p.grad = torch.ones_like(p)  # the caller's: PyTorch accumulates into them once
    with ti64.ad.Tape(loss):
        program(net)
    s0r = torch.tensor(s0, requires_grad=True)
    lr = _torch_rollout(ref, s0r)
    lr.backward()
    assert loss[None] == pytest.approx(lr.item(), rel=1e-13)
    np.testing.assert_allclose(state.grad.to_numpy()[0], s0r.grad.numpy(), rtol=1e-11)
    for p, q in zip(net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad + 1)


def test_pytorch_module_under_forward_mode(ti64):
    state, loss, program = _controller_program(ti64)
    net = _net(1)
    s0 = np.random.default_rng(1).random((N, 2))
    state.from_numpy(np.concatenate([s0[None], np.zeros((3, N, 2))]))
    seed = np.zeros((4, N, 2))
    seed[0] = np.random.default_rng(2).random((N, 2))
    with ti64.ad.FwdMode(loss=loss, param=state, seed=seed.reshape(-1).tolist()):
        program(net)
    _, tangent = torch.func.jvp(lambda s: _torch_rollout(net, s),
                                (torch.tensor(s0),), (torch.tensor(seed[0]),))
    assert loss.dual[None] == pytest.approx(tangent.item(), rel=1e-11)


def test_pytorch_call_refuses_mismatched_outputs(ti64):
    from difftape.interop.torch import call

    x = ti64.field(ti64.f64, (N, 2), needs_grad=True)
    y = ti64.field(ti64.f32, (N, 2), needs_grad=True)
    with pytest.raises(ti64.DifftapeError, match="no silent casts"):
        call(lambda t: t * 2, [x], [y])
    with pytest.raises(ti64.DifftapeError, match="returned 2"):
        call(lambda t: (t, t), [x], [x])


def test_operator_inside_a_difftape_tape_is_refused(ti64):
    op = _field_op(ti64)
    loss = ti64.field(ti64.f64, (), needs_grad=True)
    x, w = _inputs()
    with pytest.raises(ti64.DifftapeError, match="cannot run inside a ti.ad.Tape"):
        with ti64.ad.Tape(loss):
            op(x, w)
