"""PyTorch CUDA tensors in and out of ``ti.init(arch=ti.cuda)`` programs on a real device
(runtime/devicearrays.py): zero-copy both ways, ordered with PyTorch's current stream.

Skipped, with the reason, without a device (conftest.py's ``cuda`` fixture) or without a CUDA
build of PyTorch. tests/core/test_device_interop.py checks the same paths on the pycuda
stand-in and the simulated grid, where a missing stream dependency shows deterministically.
"""

import numpy as np
import pytest
from interop_programs import sin_roll_program

import difftape as ti
from difftape.runtime import program

pytestmark = pytest.mark.difftape_only


@pytest.fixture
def torch_cuda(cuda, monkeypatch):
    torch = pytest.importorskip("torch", reason="the [torch] extra (PyTorch) is not installed")
    if not torch.cuda.is_available():
        pytest.skip("this PyTorch build cannot use the device (torch.cuda.is_available())")
    for var in ("TI_ARCH", "DIFFTAPE_ARCH", "DIFFTAPE_SIMULATE_GPU"):
        monkeypatch.delenv(var, raising=False)
    ti.init(arch=ti.cuda)
    yield torch
    ti.reset()


@ti.kernel
def affine(a: ti.types.ndarray(), s: ti.f32):
    for i in a:
        a[i] = a[i] * s + 1.0


def test_a_cuda_tensor_is_written_in_place(torch_cuda):
    torch = torch_cuda
    t = torch.arange(1 << 16, dtype=torch.float32, device="cuda")
    memory = program.get().allocator.memory
    seen = []
    original = memory.borrow
    memory.borrow = lambda address, n: (seen.append(address), original(address, n))[1]
    affine(t, 2.0)
    assert seen == [t.data_ptr()]
    expected = torch.arange(1 << 16, dtype=torch.float32, device="cuda") * 2 + 1
    assert torch.equal(t, expected)  # (ordered on PyTorch's stream: no ti.sync needed)


def test_work_on_a_side_stream_is_ordered_without_waiting(torch_cuda):
    torch = torch_cuda
    s = torch.cuda.Stream()
    t = torch.zeros(1 << 20, device="cuda")
    with torch.cuda.stream(s):
        torch.cuda._sleep(1 << 24)  # a long producer on the caller's stream...
        t.fill_(3.0)  # ...then its write
        affine(t, 2.0)  # our kernel waits for it on the device
        out = t * 1.0  # and PyTorch's next op waits for our kernel
    s.synchronize()
    assert torch.all(out == 7.0)


def test_a_field_exports_device_memory_to_torch(torch_cuda):
    torch = torch_cuda
    x = ti.field(ti.f32, shape=1024)
    x.fill(2.0)
    t = torch.from_dlpack(x)
    assert t.device.type == "cuda" and t.data_ptr() == x.storage.address
    assert torch.all(t == 2.0)
    t.add_(1.0)
    torch.cuda.synchronize()
    np.testing.assert_array_equal(x.to_numpy(), np.full(1024, 3.0, np.float32))
    c = x.to_torch(device="cuda")
    assert c.device.type == "cuda" and c.data_ptr() != x.storage.address
    assert torch.all(c == 3.0)


# ------------------------------------------------------------------ operators on CUDA tensors
# (tests/core/test_device_operators.py runs the same paths over the stand-in and the simulated
# grid, where PyTorch is a CPU build)

@pytest.fixture
def torch_f64(torch_cuda):
    ti.reset()
    ti.init(arch=ti.cuda, default_fp=ti.f64)
    yield torch_cuda


def _field_operator(n: int):
    from difftape.interop.torch import operator

    run, inputs, outputs = sin_roll_program(ti, n)
    return operator(run, inputs=inputs, outputs=outputs)


def test_a_cuda_operator_passes_gradcheck_in_f64(torch_f64):
    torch = torch_f64
    op = _field_operator(5)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.rand(5, dtype=torch.float64, device="cuda", generator=g, requires_grad=True)
    w = torch.rand(5, dtype=torch.float64, device="cuda", generator=g, requires_grad=True)
    y, s = op(x, w)
    assert y.device == x.device and s.device == x.device  # PyTorch's tensors, on the device
    ref = torch.sin(x) * w * w + torch.roll(x, -1) * w
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(s, (ref * ref).sum())
    assert torch.autograd.gradcheck(op, (x, w))
    assert torch.autograd.gradgradcheck(op, (x, w))
    assert torch.autograd.gradcheck(op, (x, w), check_forward_ad=True, check_backward_ad=False,
                                    check_undefined_grad=False, check_batched_grad=False)
    x.grad = torch.full_like(x, 7.0)
    torch.autograd.grad(s, x)
    assert torch.all(x.grad == 7.0)  # the caller's .grad is never written by difftape


def test_a_cuda_operator_runs_on_a_side_stream_without_waiting(torch_cuda):
    from difftape.interop.torch import operator

    torch = torch_cuda
    n = 1 << 20
    a = ti.ndarray(ti.f32, n, needs_grad=True)
    b = ti.ndarray(ti.f32, n, needs_grad=True)

    @ti.kernel
    def cube(a: ti.types.ndarray(), b: ti.types.ndarray()):
        for i in a:
            b[i] = a[i] * a[i] * a[i]

    op = operator(lambda: cube(a, b), inputs=[a], outputs=[b])
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = torch.zeros(n, device="cuda")
        torch.cuda._sleep(1 << 24)  # a long producer on the caller's stream...
        x.fill_(2.0)  # ...then its write, which our forward must wait for
        x.requires_grad_()
        y = op(x)
        out = y * 1.0  # PyTorch's next op waits for our kernel
        (g,) = torch.autograd.grad(y, x, grad_outputs=torch.full_like(y, 0.5))
        g2 = g * 1.0  # (the backward pass runs on the forward's stream)
    side.synchronize()
    assert torch.all(out == 8.0)
    assert torch.all(g2 == 6.0)
