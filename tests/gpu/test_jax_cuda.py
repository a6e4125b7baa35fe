"""JAX GPU arrays through ``difftape.interop.jax.function`` on a real device: the XLA FFI
handler registered for the CUDA platform runs the passes in place on XLA's device buffers,
ordered with XLA's stream.

Skipped, with the reason, without a device (conftest.py's ``cuda`` fixture) or without a CUDA
build of JAX. tests/core/test_jax_ffi_frames.py checks the same handler with call frames built
as XLA builds them on the pycuda stand-in and the simulated grid, where a missing stream
dependency shows deterministically.
"""

import numpy as np
import pytest

import difftape as ti

pytestmark = pytest.mark.difftape_only

N = 1 << 16


@pytest.fixture
def jax_cuda(cuda, monkeypatch):
    jax = pytest.importorskip("jax", reason="the [jax] extra (JAX) is not installed")
    try:
        gpus = jax.devices("gpu")
    except RuntimeError as e:
        pytest.skip(f"this JAX build cannot use the device ({e})")
    for var in ("TI_ARCH", "DIFFTAPE_ARCH", "DIFFTAPE_SIMULATE_GPU"):
        monkeypatch.delenv(var, raising=False)
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    ti.init(arch=ti.cuda, default_fp=ti.f64)
    with jax.default_device(gpus[0]):
        yield jax
    ti.reset()
    jax.config.update("jax_enable_x64", previous)


@ti.kernel
def cube(a: ti.types.ndarray(), b: ti.types.ndarray()):
    for i in a:
        b[i] = a[i] * a[i] * a[i]


def test_jax_gpu_arrays_are_read_and_written_in_place(jax_cuda):
    jax = jax_cuda
    import jax.numpy as jnp

    from difftape.interop.jax import function

    a = ti.ndarray(ti.f64, N, needs_grad=True)
    b = ti.ndarray(ti.f64, N, needs_grad=True)
    seen = []

    def program():
        seen.append((a.storage.address, b.storage.address))
        cube(a, b)

    f = function(program, [a], [b])
    x = jnp.linspace(0.5, 1.5, N)
    for call in (f, jax.jit(f)):
        y = call(x)
        assert seen[-1] == (x.unsafe_buffer_pointer(), y.unsafe_buffer_pointer())
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x) ** 3)
        u = jnp.cos(x)
        (g,) = jax.vjp(call, x)[1](u)  # (the backward pass runs the program again)
        np.testing.assert_allclose(np.asarray(g), 3 * np.asarray(x) ** 2 * np.asarray(u),
                                   rtol=1e-14)


def test_jax_gpu_field_program_to_second_order(jax_cuda):
    jax = jax_cuda
    import jax.numpy as jnp
    from jax.test_util import check_grads

    from difftape.interop.jax import function

    n = 8
    x = ti.field(ti.f64, n, needs_grad=True)
    s = ti.field(ti.f64, (), needs_grad=True)

    @ti.kernel
    def energy():
        for i in x:
            s[None] += ti.sin(x[i]) * x[(i + 1) % n]

    f = function(energy, [x], [s])
    x0 = jnp.linspace(0.1, 0.9, n)
    check_grads(jax.jit(f), (x0,), order=2, modes=["rev"])
    ref = lambda v: jnp.sum(jnp.sin(v) * jnp.roll(v, -1))  # noqa: E731
    np.testing.assert_allclose(jax.jit(jax.grad(f))(x0), jax.grad(ref)(x0), rtol=1e-13)
