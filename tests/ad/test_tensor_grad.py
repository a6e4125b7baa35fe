"""``kernel.grad`` with PyTorch tensors as ``ti.types.ndarray()`` arguments: as in Taichi, the
adjoint kernel reads the output's gradient from ``out.grad`` and adds the inputs' gradients into
``x.grad`` (zeros are allocated for a tensor that requires grad and has no ``.grad``). PyTorch
autograd functions written for Taichi (uc-vision/taichi-splatting's spherical harmonics:
``out.grad = grad_output; kernel.grad(params, ..., out); return params.grad``) depend on it;
before, the gradient went nowhere and every ``x.grad`` stayed zero. Truth: the analytic
gradient, and torch.autograd.gradcheck (f64 finite differences)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the [torch] extra (PyTorch) is not installed")

pytestmark = pytest.mark.host_memory


@pytest.fixture
def ti64(backend):
    backend.init(arch=backend.cpu, default_fp=backend.f64)
    yield backend
    backend.reset()


def _gather_dot(ti, dtype):
    """out[i][d] = c . params[idx[i]][d, :] with c = (1, 2, 3): a matrix-element ndarray read
    through an i64 gather index, as the splatting code does."""
    mat = ti.types.matrix(2, 3, dtype)
    vec = ti.types.vector(2, dtype)

    @ti.kernel
    def gather_dot(params: ti.types.ndarray(mat, ndim=1), idxs: ti.types.ndarray(ti.i64, ndim=1),
                   out: ti.types.ndarray(vec, ndim=1)):
        for i in range(idxs.shape[0]):
            c = ti.Vector([1.0, 2.0, 3.0], dt=dtype)
            p = params[idxs[i]]
            for d in ti.static(range(2)):
                out[i][d] = c.dot(p[d, :])

    return gather_dot


def test_gradients_land_in_the_tensors_grad(ti64):
    gather_dot = _gather_dot(ti64, ti64.f64)
    params = torch.rand(4, 2, 3, dtype=torch.float64, requires_grad=True)
    idxs = torch.tensor([2, 0, 3, 2], dtype=torch.int64)
    out = torch.empty(4, 2, dtype=torch.float64)
    gather_dot(params, idxs, out)
    np.testing.assert_allclose(out.numpy(), (params.detach()[idxs] @ torch.tensor(
        [1.0, 2.0, 3.0], dtype=torch.float64)).numpy(), rtol=1e-15)

    assert params.grad is None  # requires grad, no .grad: allocated (zeros) by the adjoint
    out.grad = torch.tensor([[1.0, 0.5], [2.0, 0.0], [0.0, 1.0], [1.0, 1.0]],
                            dtype=torch.float64)
    want = np.zeros((4, 2, 3))
    for i, k in enumerate(idxs.tolist()):
        want[k] += out.grad[i].numpy()[:, None] * np.array([1.0, 2.0, 3.0])
    cotangent = out.grad.clone()
    gather_dot.grad(params, idxs, out)
    np.testing.assert_allclose(params.grad.numpy(), want, rtol=1e-15)
    assert idxs.grad is None  # an integer tensor without a gradient is left alone

    out.grad = cotangent  # (the adjoint consumed the assigned output's gradient)
    gather_dot.grad(params, idxs, out)  # accumulated, as into any .grad
    np.testing.assert_allclose(params.grad.numpy(), 2 * want, rtol=1e-15)


def test_a_taichi_style_autograd_function_passes_gradcheck(ti64):
    ti = ti64

    @ti.kernel
    def shade(x: ti.types.ndarray(ti.f64, ndim=1), w: ti.types.ndarray(ti.f64, ndim=1),
              out: ti.types.ndarray(ti.f64, ndim=1)):
        for i in range(x.shape[0]):
            out[i] = ti.math.clamp(ti.sin(x[i]) * w[i] + 0.5, 0, 1)

    class Shade(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            out = torch.empty_like(x)
            shade(x, w, out)
            ctx.save_for_backward(x, w, out)
            return out

        @staticmethod
        def backward(ctx, grad_out):
            x, w, out = ctx.saved_tensors
            saved = [t.grad for t in (x, w, out)]
            try:
                for t in (x, w):
                    t.grad = torch.zeros_like(t)
                out.grad = grad_out.contiguous()
                shade.grad(x, w, out)
                return x.grad, w.grad
            finally:
                for t, g in zip((x, w, out), saved, strict=True):
                    t.grad = g

    g = torch.Generator().manual_seed(3)
    x = (torch.rand(7, dtype=torch.float64, generator=g) - 0.5).requires_grad_()
    w = torch.rand(7, dtype=torch.float64, generator=g).requires_grad_()
    assert torch.autograd.gradcheck(Shade.apply, (x, w), eps=1e-6, atol=1e-9)


def test_a_strided_gradient_is_refused(ti64):
    # written in place by the adjoint, so it cannot be staged through a contiguous copy
    gather_dot = _gather_dot(ti64, ti64.f64)
    params = torch.rand(4, 2, 3, dtype=torch.float64)
    params.grad = torch.zeros(3, 2, 4, dtype=torch.float64).permute(2, 1, 0)
    idxs = torch.tensor([1], dtype=torch.int64)
    out = torch.zeros(1, 2, dtype=torch.float64)
    out.grad = torch.ones(1, 2, dtype=torch.float64)
    with pytest.raises(ti64.DifftapeError, match=r"kernel 'gather_dot': argument 'params' or "
                                                 r"its gradient \(\.grad\) is not contiguous"):
        gather_dot.grad(params, idxs, out)
