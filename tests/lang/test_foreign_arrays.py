"""PyTorch tensors, JAX arrays and DLPack/array-interface objects as ndarray arguments, and
DLPack export of fields and ndarrays: shared memory (pointer equality, writes seen on the
other side), strided inputs (one staged copy, written back), refusals that say what to do."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the [torch] extra (PyTorch) is not installed")

pytestmark = pytest.mark.difftape_only


def _double(ti):
    @ti.kernel
    def double(x: ti.types.ndarray(), y: ti.types.ndarray()):
        for i in x:
            y[i] = 2 * x[i]

    return double


def test_torch_tensors_are_passed_without_copy(ti):
    from difftape.runtime.foreign import as_numpy

    @ti.kernel
    def addr(x: ti.types.ndarray()):
        for i in x:
            x[i] = x[i] + 1

    x = torch.arange(5, dtype=torch.float32)
    addr(x)
    assert x.tolist() == [1, 2, 3, 4, 5]  # the kernel's write is seen by the tensor
    assert as_numpy(x).ctypes.data == x.data_ptr()


def test_torch_tensor_that_requires_grad_is_read_in_place(ti):
    x = torch.arange(4, dtype=torch.float32, requires_grad=True)
    y = torch.zeros(4)
    _double(ti)(x, y)
    assert y.tolist() == [0, 2, 4, 6]
    assert x.grad is None


def test_strided_tensors_are_staged_and_written_back(ti):
    base = torch.zeros(12)
    y = base[::3]  # 4 elements, stride 3
    _double(ti)(torch.arange(4, dtype=torch.float32), y)
    assert base.tolist() == [0, 0, 0, 2, 0, 0, 4, 0, 0, 6, 0, 0]
    src = torch.arange(8, dtype=torch.float32)[1::2]  # strided input: read, not written
    out = torch.zeros(4)
    _double(ti)(src, out)
    assert out.tolist() == [2, 6, 10, 14]


def test_wrong_dtype_and_device_are_refused(ti):
    @ti.kernel
    def f(x: ti.types.ndarray(dtype=ti.f32)):
        for i in x:
            x[i] = 1

    x = torch.zeros(3, dtype=torch.float64)
    with pytest.raises(ti.ArgumentError, match="f32"):
        f(x)
    assert not x.any()
    with pytest.raises(ValueError, match="must be an array"):
        f([1.0, 2.0])
    with pytest.raises(ValueError, match="bfloat16|DLPack|dtype"):
        f(torch.zeros(3, dtype=torch.bfloat16))


def test_meta_device_tensor_is_refused(ti):
    x = torch.empty(3, device="meta")
    with pytest.raises(ValueError, match="device|DLPack"):
        _double(ti)(x, x)


@pytest.mark.host_memory
def test_field_and_ndarray_export_dlpack_without_copy(ti):
    f = ti.field(ti.f32, shape=4)
    t = torch.from_dlpack(f)
    t[2] = 7
    assert f[2] == 7
    f[1] = 3
    assert t[1].item() == 3
    nd = ti.ndarray(ti.f32, shape=(2, 3))
    tn = torch.from_dlpack(nd)
    assert tn.data_ptr() == nd.storage.address
    nd[1, 2] = 5
    assert tn[1, 2].item() == 5


@pytest.mark.host_memory
def test_from_dlpack_shares_memory_and_element_shape(ti):
    t = torch.zeros(3, 2)
    nd = ti.from_dlpack(t, element_shape=(2,))
    assert isinstance(nd, ti.VectorNdarray) and nd.shape == (3,) and nd.n == 2
    assert nd.storage.address == t.data_ptr()

    @ti.kernel
    def fill(v: ti.types.ndarray(dtype=ti.math.vec2)):
        for i in v:
            v[i] = ti.Vector([i, 10 * i])

    fill(nd)
    assert t.tolist() == [[0, 0], [1, 10], [2, 20]]
    with pytest.raises(ti.DifftapeError, match="contiguous"):
        ti.from_dlpack(t.t())
    with pytest.raises(ti.DifftapeError, match="element_shape"):
        ti.from_dlpack(t, element_shape=(3,))


def test_to_torch_and_from_torch_copy(ti):
    f = ti.Vector.field(2, ti.f32, shape=3)
    f.from_torch(torch.arange(6, dtype=torch.float32).reshape(3, 2))
    t = f.to_torch()
    assert t.tolist() == [[0, 1], [2, 3], [4, 5]]
    t[0, 0] = 9  # a copy, as in Taichi
    assert f[0][0] == 0


def test_array_interface_objects_are_accepted(ti):
    class Wrapped:
        def __init__(self, a):
            self.a = a
            self.__array_interface__ = a.__array_interface__

    a = np.zeros(3, np.float32)
    _double(ti)(np.arange(3, dtype=np.float32), Wrapped(a))
    assert a.tolist() == [0, 2, 4]


def test_jax_arrays_are_read_in_place_and_never_written(ti):
    jnp = pytest.importorskip("jax.numpy", reason="the [jax] extra (JAX) is not installed")
    x = jnp.arange(4, dtype=jnp.float32)
    y = torch.zeros(4)
    _double(ti)(x, y)
    assert y.tolist() == [0, 2, 4, 6]
    from difftape.runtime.foreign import as_numpy

    assert as_numpy(x).ctypes.data == x.unsafe_buffer_pointer()
    with pytest.raises(ValueError, match="read-only"):
        _double(ti)(y, jnp.zeros(4, dtype=jnp.float32))
    f = ti.field(ti.f32, shape=4)
    f.from_jax(x)
    assert np.asarray(f.to_jax()).tolist() == [0, 1, 2, 3]


def test_adjoint_kernel_takes_tensors(ti):
    @ti.kernel
    def sq(x: ti.types.ndarray(), y: ti.types.ndarray()):
        for i in x:
            y[i] = x[i] * x[i]

    x = ti.ndarray(ti.f32, 3, needs_grad=True)
    x.from_numpy(np.array([1, 2, 3], np.float32))
    y = ti.ndarray(ti.f32, 3, needs_grad=True)
    y.grad.fill(1)
    sq(x, y)
    sq.grad(x, y)
    assert x.grad.to_numpy().tolist() == [2, 4, 6]
    # a tensor argument has no gradient storage of ours: its values are read in place
    yt = torch.zeros(3)
    sq(torch.tensor([1.0, 2.0, 3.0]), yt)
    assert yt.tolist() == [1, 4, 9]


class _DLPackOnly:
    """An array known only through DLPack (no ``__array__``, no array interface)."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, *args, **kwargs):
        return self._a.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_from_numpy_takes_foreign_arrays(ti):
    """``from_numpy`` of fields and ndarrays takes what kernels take: a tensor that autograd
    tracks, a JAX array, a DLPack-only object (values checked against NumPy)."""
    want = np.array([[1.5, -2.0], [0.25, 3.0], [7.0, -0.5]], np.float32)
    sources = [torch.tensor(want, requires_grad=True), _DLPackOnly(torch.tensor(want))]
    jnp = pytest.importorskip("jax.numpy", reason="the [jax] extra (JAX) is not installed")
    sources.append(jnp.asarray(want))
    for src in sources:
        f = ti.Vector.field(2, ti.f32, shape=3)
        f.from_numpy(src)
        assert f.to_numpy().tobytes() == want.tobytes()
        nd = ti.ndarray(ti.f32, (3, 2))
        nd.from_numpy(src)
        assert nd.to_numpy().tobytes() == want.tobytes()
    with pytest.raises(ti.DifftapeError, match="meta"):
        ti.field(ti.f32, shape=2).from_numpy(torch.zeros(2, device="meta"))
