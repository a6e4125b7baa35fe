"""PyTorch operators (difftape.interop.torch) on CUDA tensors of a grid program, and a Tape's
reverse launches over CUDA tensors, without a GPU.

PyTorch here is a CPU build, so the bridge's device-specific calls (its one seam,
``difftape.interop.torch.cuda``: which tensors are CUDA arrays, how PyTorch allocates on their
device, its current stream) are replaced by :class:`SimulatedCudaTorch`: "CUDA tensors" are
real PyTorch tensors over device memory of the pycuda stand-in or of the simulated grid (host
memory the simulation allocated), exporting DLPack as a CUDA producer does, and PyTorch's
current stream is a deferred stream of the simulation. Everything else is the real code path:
argument binding, the stream joins, adjoint buffers, the caller's ``.grad``. Because the
streams are deferred, nothing our kernels write is in memory until someone synchronises, so a
missing stream dependency (or a host wait we should not make) fails a test. The results are
checked against the same operator on CPU tensors (bit for bit: the same kernels on the same
simulated device) and against the analytic derivatives.
"""

import ctypes

import numpy as np
import pytest
from cuda_standin import FakeDriver, use
from interop_programs import sin_roll_program

import difftape as ti
from difftape.runtime import dlpack, program
from difftape.runtime.storage import SimulatedStream

torch = pytest.importorskip("torch", reason="the [torch] extra (PyTorch) is not installed")
interop = pytest.importorskip("difftape.interop.torch")

pytestmark = pytest.mark.difftape_only

N = 6


class _Export:
    """A tensor's memory exported by DLPack as a CUDA producer does: the consumer's stream
    waits for the producer's (PyTorch's current stream)."""

    def __init__(self, t, stream: SimulatedStream) -> None:
        self.t, self.stream = t, stream

    def __dlpack_device__(self):
        return (dlpack.CUDA, 0)

    def __dlpack__(self, stream=None, max_version=None):
        if stream is not None and stream != -1:
            SimulatedStream.resolve(stream).wait_for_event(self.stream.record())
        t = self.t
        capsule = dlpack.make_capsule(t.data_ptr(), tuple(t.shape), np.dtype(
            str(t.dtype).removeprefix("torch.")), (dlpack.CUDA, 0), t,
            max_version is not None)
        if not t.is_contiguous():
            name = b"dltensor_versioned" if max_version is not None else b"dltensor"
            cls = dlpack.DLManagedTensorVersioned if max_version is not None else \
                dlpack.DLManagedTensor
            dl = cls.from_address(dlpack._get_pointer(capsule, name)).dl_tensor
            for k, s in enumerate(t.stride()):
                dl.strides[k] = s
        return capsule


class SimulatedCudaTorch(interop.CudaTensors):
    """The bridge's seam over the simulation: tensors over memory it allocated on the
    (simulated) device are CUDA tensors; ``current`` is PyTorch's current stream."""

    def __init__(self, drv) -> None:
        self.drv = drv
        self.current = SimulatedStream()
        self.blocks: list[tuple[int, int]] = []
        self.computes_on_device = False  # (program_device: PyTorch computes on the host)

    def device_array(self, t):
        address = t.data_ptr()
        if any(a <= address < a + n for a, n in self.blocks):
            return _Export(t, self.current)
        return None

    def empty(self, shape, dtype, device):
        n = max(1, int(np.prod(shape)) * dtype.itemsize)
        if self.drv is not None:
            address = int(self.drv.mem_alloc(n))
        else:
            allocator = program.get().allocator
            address = allocator.memory.alloc(n) if not allocator.host else \
                np.empty(n, np.uint8).ctypes.data  # (a CPU program: never read)
        self.blocks.append((address, n))
        view = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(address))
        view = view[:int(np.prod(shape)) * dtype.itemsize].view(dtype).reshape(shape)
        view.fill(np.nan)  # what PyTorch's empty leaves: never mistaken for a result
        t = torch.from_numpy(view)
        return t, self.device_array(t)

    def stream(self, device):
        return self.current.handle

    def program_device(self):
        return torch.device("cpu") if self.computes_on_device else None

    def adopt(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` copied into a new CUDA tensor (differentiably): what PyTorch computes on the
        device lives in device memory."""
        out, _ = self.empty(tuple(t.shape), np.dtype(str(t.dtype).removeprefix("torch.")),
                            None)
        return out.copy_(t)

    def tensor(self, values) -> torch.Tensor:
        """A CUDA tensor holding ``values`` (written now, as a finished copy)."""
        values = np.asarray(values, np.float64)
        t, _ = self.empty(values.shape, values.dtype, None)
        t.numpy()[...] = values
        return t

    def sync(self) -> None:
        """What PyTorch's next op on its stream would see: the stream run to here."""
        self.current.synchronize()


@pytest.fixture(params=["cuda-standin", "simulated-grid"])
def cuda(request, monkeypatch):
    """A grid program in f64 with the bridge's seam over its device."""
    if request.param == "cuda-standin":
        drv = use(monkeypatch, FakeDriver())
        ti.init(arch=ti.cuda, default_fp=ti.f64)
    else:
        drv = None
        ti.init(arch=ti.cpu, simulate_grid=(2, 32), default_fp=ti.f64)
    seam = SimulatedCudaTorch(drv)
    monkeypatch.setattr(interop, "cuda", seam)
    yield seam
    ti.reset()


@ti.kernel
def cube(a: ti.types.ndarray(), b: ti.types.ndarray()):
    for i in a:
        b[i] = a[i] * a[i] * a[i]


def _ndarray_op():
    a = ti.ndarray(ti.f64, N, needs_grad=True)
    b = ti.ndarray(ti.f64, N, needs_grad=True)
    return interop.operator(lambda: cube(a, b), inputs=[a], outputs=[b]), a, b


def _field_op():
    """y[i] = sin(x[i]) * w[i]^2 + x[(i+1) % n] * w[i];  s = sum(y^2)"""
    run, inputs, outputs = sin_roll_program(ti, N)
    return interop.operator(run, inputs=inputs, outputs=outputs)


def _values(seed, n=N):
    return np.random.default_rng(seed).uniform(0.5, 1.5, n)


def test_ndarray_operator_runs_in_place_on_the_callers_stream(cuda):
    op, a, b = _ndarray_op()
    xv, uv = _values(0), _values(1)
    x = cuda.tensor(xv).requires_grad_()
    u = cuda.tensor(uv)
    y = op(x)
    assert cuda.device_array(y) is not None  # allocated by the framework, on the device
    assert a.storage.address == x.data_ptr()  # the input read in place
    assert b.storage.address == y.data_ptr()  # the kernel wrote the caller's tensor itself
    assert np.isnan(y.detach().numpy()).all()  # nobody waited on the host...
    cuda.sync()  # ...PyTorch's next op on its stream sees the result
    np.testing.assert_array_equal(y.detach().numpy(), xv * xv * xv)
    x.grad = torch.full((N,), 7.0, dtype=torch.float64)
    (g,) = torch.autograd.grad(y, x, grad_outputs=u)
    assert cuda.device_array(g) is not None
    assert g.data_ptr() != u.data_ptr()
    cuda.sync()
    np.testing.assert_allclose(g.numpy(), 3 * xv ** 2 * uv, rtol=1e-15)
    np.testing.assert_array_equal(u.numpy(), uv)  # the cotangent is not our adjoint buffer
    np.testing.assert_array_equal(x.grad.numpy(), np.full(N, 7.0))  # never written by us
    # the same operator on CPU tensors: the same kernels, bit for bit
    xc = torch.tensor(xv, requires_grad=True)
    yc = op(xc)
    (gc,) = torch.autograd.grad(yc, xc, grad_outputs=torch.tensor(uv))
    np.testing.assert_array_equal(y.detach().numpy(), yc.detach().numpy())
    np.testing.assert_array_equal(g.numpy(), gc.numpy())
    assert not np.isnan(g.numpy()).any()


def test_the_callers_earlier_and_later_work_is_ordered_with_ours(cuda):
    op, _, _ = _ndarray_op()
    x = cuda.tensor(np.zeros(N)).requires_grad_()
    cuda.current.enqueue(lambda: x.detach().numpy().fill(2.0))  # PyTorch's pending write
    y = op(x)
    seen = []
    cuda.current.enqueue(lambda: seen.append(y.detach().numpy().copy()))  # its next read
    u = cuda.tensor(np.ones(N))
    cuda.current.enqueue(lambda: u.numpy().fill(3.0))  # a cotangent PyTorch is computing
    (g,) = torch.autograd.grad(y, x, grad_outputs=u)
    cuda.current.enqueue(lambda: seen.append(g.numpy().copy()))
    assert seen == []
    cuda.sync()
    np.testing.assert_array_equal(seen[0], np.full(N, 8.0))
    np.testing.assert_array_equal(seen[1], np.full(N, 3 * 4.0 * 3.0))


def test_field_operator_backward_double_backward_and_forward_mode(cuda):
    op = _field_op()
    xv, wv, uv, sv = _values(2), _values(3), _values(4), 0.75
    results = {}
    for where in ("cuda", "cpu"):
        new = cuda.tensor if where == "cuda" else torch.tensor
        x, w = new(xv).requires_grad_(), new(wv).requires_grad_()
        y, s = op(x, w)
        cot = (new(uv), new(np.array(sv)))
        gx, gw = torch.autograd.grad((y, s), (x, w), grad_outputs=cot, create_graph=True)
        # double backward: the Hessian-vector product of <cot, f> with (1, ..., 1) on x
        # (every cotangent given: PyTorch would make the missing ones zeros on the CPU)
        (hx, hw) = torch.autograd.grad((gx, gw), (x, w),
                                       grad_outputs=(new(np.ones(N)), new(np.zeros(N))))
        import torch.autograd.forward_ad as fwAD

        with fwAD.dual_level():
            xd = fwAD.make_dual(x.detach(), new(np.ones(N)))
            wd = fwAD.make_dual(w.detach(), new(np.zeros(N)))
            yd, sd = op(xd, wd)
            ty, ts = fwAD.unpack_dual(yd).tangent, fwAD.unpack_dual(sd).tangent
        if where == "cuda":
            for t in (y, s, gx, gw, hx, hw, ty, ts):
                assert cuda.device_array(t) is not None
            cuda.sync()
        results[where] = [t.detach().numpy().copy() for t in (y, s, gx, gw, hx, hw, ty, ts)]
    for a, b in zip(results["cuda"], results["cpu"], strict=True):
        np.testing.assert_array_equal(a, b)  # bit for bit
    # and against the analytic derivatives
    y, s, gx, gw, hx, hw, ty, ts = results["cuda"]
    roll = np.roll(xv, -1)
    np.testing.assert_allclose(y, np.sin(xv) * wv ** 2 + roll * wv, rtol=1e-14)
    ubar = uv + 2 * sv * y  # d<cot, (y, s)>/dy
    np.testing.assert_allclose(gx, np.cos(xv) * wv ** 2 * ubar + np.roll(wv * ubar, 1),
                               rtol=1e-13)
    np.testing.assert_allclose(ty, np.cos(xv) * wv ** 2 + wv, rtol=1e-14)
    np.testing.assert_allclose(ts, 2 * np.sum(y * ty), rtol=1e-13)
    def grad_x(xs, ws):  # gx as a function of the inputs, in NumPy
        ys = np.sin(xs) * ws ** 2 + np.roll(xs, -1) * ws
        ub = uv + 2 * sv * ys
        return np.cos(xs) * ws ** 2 * ub + np.roll(ws * ub, 1)

    h = 1e-6
    for k in range(N):  # (hx, hw) = d<1, gx>/d(x, w), by central differences
        e = np.zeros(N)
        e[k] = h
        np.testing.assert_allclose(hx[k], (grad_x(xv + e, wv) - grad_x(xv - e, wv)).sum()
                                   / (2 * h), rtol=1e-6)
        np.testing.assert_allclose(hw[k], (grad_x(xv, wv + e) - grad_x(xv, wv - e)).sum()
                                   / (2 * h), rtol=1e-6)


def test_mixed_devices_and_host_programs_are_refused(cuda):
    op, _, _ = _ndarray_op()
    fop = _field_op()
    x = cuda.tensor(_values(0))
    with pytest.raises(ti.DifftapeError, match="input 0 is on .* but input 1 is on .*one "
                                               "device"):
        fop(x, torch.tensor(_values(1)))
    strided = cuda.tensor(_values(0, 2 * N))[::2]
    with pytest.raises(ti.DifftapeError, match="strided .*contiguous"):
        op(strided)
    with pytest.raises(ti.DifftapeError, match=r"shape \(4,\)"):
        op(cuda.tensor(_values(0, 4)))


def test_cuda_tensors_on_a_host_program_are_refused(monkeypatch):
    ti.init(arch=ti.cpu, default_fp=ti.f64)
    seam = SimulatedCudaTorch(None)
    monkeypatch.setattr(interop, "cuda", seam)
    op, _, _ = _ndarray_op()
    with pytest.raises(ti.DifftapeError, match=r"storage is host memory: pass tensor.cpu\(\)"
                                               r".*ti.init\(arch=ti.cuda\)"):
        op(seam.tensor(_values(0)))
    ti.reset()


def test_a_pytorch_call_inside_a_tape_computes_on_the_device(cuda):
    """interop.torch.call on a grid program whose device PyTorch uses: the module gets CUDA
    tensors (copies made on the device), its results and gradients are copied and added into
    the storage on the device, ordered with PyTorch's stream; gradients as in pure PyTorch."""
    cuda.computes_on_device = True
    x = ti.field(ti.f64, N, needs_grad=True)
    h = ti.field(ti.f64, N, needs_grad=True)
    loss = ti.field(ti.f64, (), needs_grad=True)
    torch.manual_seed(0)
    lin = torch.nn.Linear(N, N, dtype=torch.float64)
    ref = torch.nn.Linear(N, N, dtype=torch.float64)
    ref.load_state_dict(lin.state_dict())
    on_device = []

    def model(t):
        on_device.append(cuda.device_array(t) is not None)
        cuda.sync()  # (PyTorch's kernels run in its stream's order: the fake runs it here)
        t.register_hook(cuda.adopt)  # its gradients are computed on the device
        out = cuda.adopt(torch.tanh(lin(t)))
        out.register_hook(lambda g: (cuda.sync(), g)[1])  # (the cotangent, in stream order)
        return out

    @ti.kernel
    def square():
        for i in h:
            loss[None] += h[i] * h[i] * (i + 1)

    xv = _values(5)
    x.from_numpy(xv)
    with ti.ad.Tape(loss):
        interop.call(model, [x], [h])
        square()
    assert on_device == [True]
    xr = torch.tensor(xv, requires_grad=True)
    hr = torch.tanh(ref(xr))
    lr = (hr * hr * torch.arange(1, N + 1)).sum()
    lr.backward()
    assert loss[None] == pytest.approx(lr.item(), rel=1e-14)
    np.testing.assert_allclose(x.grad.to_numpy(), xr.grad.numpy(), rtol=1e-13)
    for p, q in zip(lin.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-13, atol=0)
    np.testing.assert_array_equal(h.grad.to_numpy(), np.zeros(N))  # overwritten by the call


def test_a_pytorch_call_under_forward_mode_computes_on_the_device(cuda):
    cuda.computes_on_device = True
    x = ti.field(ti.f64, N, needs_dual=True)
    h = ti.field(ti.f64, N, needs_dual=True)
    loss = ti.field(ti.f64, (), needs_dual=True)
    torch.manual_seed(1)
    lin = torch.nn.Linear(N, N, dtype=torch.float64)
    on_device = []

    def model(t):
        on_device.append(cuda.device_array(t) is not None)
        cuda.sync()  # (PyTorch's kernels run in its stream's order: the fake runs it here)
        return cuda.adopt(torch.tanh(lin(t)))

    @ti.kernel
    def square():
        for i in h:
            loss[None] += h[i] * h[i] * (i + 1)

    xv, tv = _values(6), _values(7)
    x.from_numpy(xv)
    with ti.ad.FwdMode(loss=loss, param=x, seed=tv.tolist()):
        interop.call(model, [x], [h])
        square()
    assert on_device == [True]
    weights = torch.arange(1, N + 1)
    value, tangent = torch.func.jvp(lambda xr: (torch.tanh(lin(xr)) ** 2 * weights).sum(),
                                    (torch.tensor(xv),), (torch.tensor(tv),))
    assert loss[None] == pytest.approx(value.item(), rel=1e-14)
    assert loss.dual[None] == pytest.approx(tangent.item(), rel=1e-13)
