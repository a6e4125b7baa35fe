"""PyTorch CUDA tensors in and out of ``ti.init(arch=ti.cuda)`` programs on a real device
(runtime/devicearrays.py): zero-copy both ways, ordered with PyTorch's current stream.

Skipped, with the reason, without a device (conftest.py's ``cuda`` fixture) or without a CUDA
build of PyTorch. tests/core/test_device_interop.py checks the same paths on the pycuda
stand-in and the simulated grid, where a missing stream dependency shows deterministically.
"""

import numpy as np
import pytest

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
