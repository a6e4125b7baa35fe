"""difftape programs as JAX functions (difftape.interop.jax): custom_vjp (first and second
order, reverse) and custom_jvp (forward), checked with jax.test_util.check_grads in f64 and
against the same computation written in JAX, under jax.jit."""

import threading
import time

import numpy as np
import pytest
from interop_programs import sin_roll_program

jax = pytest.importorskip("jax", reason="the [jax] extra (JAX) is not installed")
jnp = pytest.importorskip("jax.numpy", reason="the [jax] extra (JAX) is not installed")
from jax.test_util import check_grads  # noqa: E402

pytestmark = pytest.mark.difftape_only

N = 5


@pytest.fixture
def ti64(backend):
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    backend.init(arch=backend.cpu, default_fp=backend.f64)
    yield backend
    backend.reset()
    jax.config.update("jax_enable_x64", previous)


def _program(ti):
    return sin_roll_program(ti, N)


def _reference(x, w):
    y = jnp.sin(x) * w * w + jnp.roll(x, -1) * w
    return y, jnp.sum(y * y)


def _args(seed=0):
    r = np.random.default_rng(seed)
    return jnp.asarray(r.random(N)), jnp.asarray(r.random(N) + 0.5)


def test_reverse_mode_first_and_second_order(ti64):
    from difftape.interop.jax import function

    f = function(*_program(ti64))
    x, w = _args()
    for a, b in zip(f(x, w), _reference(x, w), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-13)
    check_grads(f, (x, w), order=2, modes=["rev"])


def test_matches_jax_under_jit_to_second_order(ti64):
    from difftape.interop.jax import function

    f = function(*_program(ti64))
    x, w = _args(1)
    loss = lambda a, b: f(a, b)[1]
    ref = lambda a, b: _reference(a, b)[1]
    for a, b in zip(jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w),
                    jax.grad(ref, argnums=(0, 1))(x, w), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12)
    hess = jax.jit(jax.jacrev(jax.jacrev(loss)))(x, w)
    np.testing.assert_allclose(hess, jax.hessian(ref)(x, w), rtol=1e-10, atol=1e-12)


def test_forward_mode(ti64):
    from difftape.interop.jax import function

    g = function(*_program(ti64), mode="forward")
    x, w = _args(2)
    check_grads(g, (x, w), order=1, modes=["fwd"])
    jac = jax.jit(jax.jacfwd(lambda a: g(a, w)[0]))(x)
    np.testing.assert_allclose(jac, jax.jacfwd(lambda a: _reference(a, w)[0])(x), rtol=1e-12)


def test_gradient_against_finite_differences(ti64):
    from difftape.interop.jax import function

    f = function(*_program(ti64))
    x, w = _args(3)
    gx = jax.grad(lambda a: f(a, w)[1])(x)
    h = 1e-6
    for i in range(N):
        e = jnp.zeros(N).at[i].set(h)
        fd = (f(x + e, w)[1] - f(x - e, w)[1]) / (2 * h)
        assert float(gx[i]) == pytest.approx(float(fd), rel=1e-6, abs=1e-9)


def test_wrong_dtype_and_shape_are_refused(ti64):
    from difftape.interop.jax import function

    f = function(*_program(ti64))
    x, w = _args()
    with pytest.raises(ti64.DifftapeError, match="float32"):
        f(x.astype(jnp.float32), w)
    with pytest.raises(ti64.DifftapeError, match=r"\(4,\)"):
        f(x[:4], w)
    with pytest.raises(ti64.DifftapeError, match="mode"):
        function(*_program(ti64), mode="sideways")


STEPS = 3


def _init_params(seed=0):
    r = np.random.default_rng(seed)
    return {"w1": jnp.asarray(r.normal(size=(2, 8)) * 0.5), "b1": jnp.zeros(8),
            "w2": jnp.asarray(r.normal(size=(8, 2)) * 0.5), "b2": jnp.zeros(2)}


def _mlp(p, s):
    return jnp.tanh(s @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def _jax_rollout(p, s):
    for _ in range(STEPS):
        s = s + 0.1 * jnp.sin(_mlp(p, s))
    return jnp.sum(s * s)


def _rollout_program(ti):
    """A JAX network drives a difftape simulation step by step (one force field per step:
    nothing a recorded step read is overwritten later)."""
    from difftape.interop.jax import call

    state = ti.field(ti.f64, (STEPS + 1, N, 2), needs_grad=True, needs_dual=True)
    now = ti.field(ti.f64, (N, 2), needs_grad=True, needs_dual=True)
    forces = [ti.field(ti.f64, (N, 2), needs_grad=True, needs_dual=True) for _ in range(STEPS)]
    loss = ti.field(ti.f64, (), needs_grad=True, needs_dual=True)

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
            loss[None] += state[STEPS, i, j] * state[STEPS, i, j]

    def program(params):
        for t in range(STEPS):
            read(t)
            call(_mlp, [now], [forces[t]], params=params)
            advance(t, forces[t])
        total()

    return state, loss, program


def test_jax_function_inside_a_tape_takes_part_in_the_gradient(ti64):
    from difftape.interop.jax import Params

    state, loss, program = _rollout_program(ti64)
    params = Params(_init_params())
    s0 = np.random.default_rng(0).random((N, 2))
    state.from_numpy(np.concatenate([s0[None], np.zeros((STEPS, N, 2))]))
    with ti64.ad.Tape(loss):
        program(params)
    value, (gp, gs) = jax.value_and_grad(_jax_rollout, argnums=(0, 1))(params.value,
                                                                        jnp.asarray(s0))
    assert loss[None] == pytest.approx(float(value), rel=1e-13)
    np.testing.assert_allclose(state.grad.to_numpy()[0], gs, rtol=1e-11)
    for k in gp:
        np.testing.assert_allclose(params.grad[k], gp[k], rtol=1e-11, atol=1e-14)


def test_jax_function_under_forward_mode(ti64):
    from difftape.interop.jax import Params

    state, loss, program = _rollout_program(ti64)
    params = Params(_init_params(1))
    s0 = np.random.default_rng(1).random((N, 2))
    state.from_numpy(np.concatenate([s0[None], np.zeros((STEPS, N, 2))]))
    seed = np.zeros((STEPS + 1, N, 2))
    seed[0] = np.random.default_rng(2).random((N, 2))
    with ti64.ad.FwdMode(loss=loss, param=state, seed=seed.reshape(-1).tolist()):
        program(params)
    _, tangent = jax.jvp(lambda s: _jax_rollout(params.value, s), (jnp.asarray(s0),),
                         (jnp.asarray(seed[0]),))
    assert loss.dual[None] == pytest.approx(float(tangent), rel=1e-11)


# ---------------------------------------------------------------------------------------------
# The XLA FFI handler: the passes run in place on XLA's buffers


def _cube_program(ti, seen):
    a = ti.ndarray(ti.f64, N, needs_grad=True)
    b = ti.ndarray(ti.f64, N, needs_grad=True)

    @ti.kernel
    def cube(a: ti.types.ndarray(), b: ti.types.ndarray()):
        for i in a:
            b[i] = a[i] * a[i] * a[i]

    def program():
        if seen is not None:  # (where the kernels' arrays are: host storage only)
            seen.append((a.storage.array.ctypes.data, b.storage.array.ctypes.data))
        cube(a, b)

    return program, a, b


@pytest.mark.host_memory  # (device storage takes copies, see docs/interop.md)
@pytest.mark.parametrize("jit", [False, True])
def test_ffi_passes_read_and_write_xlas_buffers_in_place(ti64, jit):
    """Zero-copy: the kernels read the input array's own buffer and write the result
    buffers JAX returns (output, and the input's gradient), eagerly and under jax.jit."""
    from difftape.interop.jax import function

    seen = []
    program, a, b = _cube_program(ti64, seen)
    h = function(program, [a], [b])
    f = jax.jit(h) if jit else h
    x = jnp.asarray(_args(4)[0])
    y = f(x)
    read, written = seen[-1]
    assert read == x.unsafe_buffer_pointer()
    assert written == y.unsafe_buffer_pointer()
    np.testing.assert_array_equal(y, np.asarray(x) ** 3)
    u = jnp.asarray(_args(5)[0])
    bound = []  # where the gradient was when the pass ended
    unbind = h.program.unbind
    h.program.unbind = lambda: (bound.append(a.grad.storage.address), unbind())
    _, pullback = jax.vjp(f, x)
    (g,) = pullback(u)
    assert bound[-1] == g.unsafe_buffer_pointer()  # accumulated in the buffer JAX returns
    np.testing.assert_allclose(g, 3 * np.asarray(x) ** 2 * np.asarray(u), rtol=1e-15)
    # after the call nothing of ours points at XLA's buffers (which XLA frees)
    assert a.storage.address not in (read, written, bound[-1])
    assert a.grad.storage.address != bound[-1]


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("path", ["ffi", "pure_callback"])
def test_ffi_passes_equal_the_host_passes_bit_for_bit(ti64, jit, path, monkeypatch):
    """Forward, backward, second order and forward mode through the FFI give exactly what
    the program's passes give on NumPy arrays, and so does the host callback (the path JAX
    on a GPU takes with a CPU program)."""
    from difftape.interop import jax as bridge
    from difftape.interop.jax import function

    if path == "pure_callback":
        monkeypatch.setattr(bridge, "FFI_PLATFORMS", ())

    f = function(*_program(ti64))
    g = function(*_program(ti64), mode="forward")
    p, q = f.program, g.program
    wrap = jax.jit if jit else (lambda h: h)
    x, w = _args(6)
    u, s = jnp.asarray(_args(7)[0]), jnp.asarray(0.625)
    tx, tw = _args(8)
    xs, us = [np.asarray(x), np.asarray(w)], [np.asarray(u), np.asarray(s)]

    outs, pullback = jax.vjp(wrap(f), x, w)
    grads = pullback((u, s))
    _, want_outs = p.run([a.copy() for a in xs], record=False)
    want_grads = p.vjp(None, [a.copy() for a in xs], us)
    for got, want in zip([*outs, *grads], [*want_outs, *want_grads], strict=True):
        np.testing.assert_array_equal(got, want)

    # second order: the derivative of the backward pass, with cotangents (tx, tw)
    def pulled(a, b):
        return jax.vjp(f, a, b)[1]((u, s))

    second = jax.vjp(wrap(pulled), x, w)[1]((tx, tw))
    _, want_second = p.vjp_derivative([a.copy() for a in xs], us,
                                      [np.asarray(tx), np.asarray(tw)])
    for got, want in zip(second, want_second, strict=True):
        np.testing.assert_array_equal(got, want)

    outs_f, touts = jax.jvp(wrap(g), (x, w), (tx, tw))
    want_f, want_t = q.jvp([a.copy() for a in xs], [np.asarray(tx), np.asarray(tw)])
    for got, want in zip([*outs_f, *touts], [*want_f, *want_t], strict=True):
        np.testing.assert_array_equal(got, want)


def test_ffi_check_grads_under_jit(ti64):
    from difftape.interop.jax import function

    f = jax.jit(function(*_program(ti64)))
    g = jax.jit(function(*_program(ti64), mode="forward"))
    x, w = _args(9)
    check_grads(f, (x, w), order=2, modes=["rev"])
    check_grads(g, (x, w), order=1, modes=["fwd"])


def test_ffi_under_vmap_runs_each_element(ti64):
    """vmap runs the passes once per element (sequentially)."""
    from difftape.interop.jax import function

    f = function(*_program(ti64))
    r = np.random.default_rng(10)
    xb, wb = jnp.asarray(r.random((3, N))), jnp.asarray(r.random((3, N)) + 0.5)
    ys, ss = jax.jit(jax.vmap(f))(xb, wb)
    gb = jax.vmap(jax.grad(lambda a, b: f(a, b)[1]))(xb, wb)
    for k in range(3):
        y, s = _reference(xb[k], wb[k])
        np.testing.assert_allclose(ys[k], y, rtol=1e-13)
        np.testing.assert_allclose(ss[k], s, rtol=1e-13)
        np.testing.assert_allclose(gb[k], jax.grad(lambda a, b: _reference(a, b)[1])(xb[k],
                                                                                    wb[k]),
                                   rtol=1e-12)


def test_ffi_pass_errors_reach_jax_with_difftapes_message(ti64):
    """A pass that refuses (forward mode of ti.ndarray storage) raises in JAX, saying what
    and how to fix it."""
    from difftape.interop.jax import function

    program, a, b = _cube_program(ti64, None)
    g = function(program, [a], [b], mode="forward")
    x = jnp.asarray(_args(11)[0])
    with pytest.raises(Exception, match="ti.ndarray has no tangent"):
        jax.block_until_ready(jax.jvp(g, (x,), (x,)))


@pytest.mark.host_memory  # (device storage holds a copy of the input: writing it is allowed)
def test_ffi_program_writing_its_input_is_refused(ti64):
    """XLA's argument buffers are JAX arrays (immutable, maybe shared): a program whose
    kernel writes an input is refused, and the array is unchanged. (Where the program's
    storage is device memory the input is copied in, and the copy may be written.)"""
    from difftape.interop.jax import function

    a = ti64.ndarray(ti64.f64, N, needs_grad=True)
    b = ti64.ndarray(ti64.f64, N, needs_grad=True)

    @ti64.kernel
    def scale_in_place(a: ti64.types.ndarray(), b: ti64.types.ndarray()):
        for i in a:
            a[i] = 2 * a[i]
            b[i] = a[i]

    f = function(lambda: scale_in_place(a, b), [a], [b])
    x = jnp.asarray(_args(12)[0])
    before = np.array(x)
    with pytest.raises(Exception, match="read-only"):
        jax.block_until_ready(f(x))
    np.testing.assert_array_equal(np.asarray(x), before)


@pytest.mark.parametrize("jit", [False, True])
def test_ffi_backward_reads_ndarray_outputs_where_xla_keeps_them(ti64, jit):
    """The recording's reverse launches read an ndarray output (s = sum(b^2) needs b): the
    backward pass gets the run's outputs from XLA (its residuals), not memory the forward
    call had (which XLA may have freed or reused)."""
    from difftape.interop.jax import function

    a = ti64.ndarray(ti64.f64, N, needs_grad=True)
    b = ti64.ndarray(ti64.f64, N, needs_grad=True)
    s = ti64.ndarray(ti64.f64, 1, needs_grad=True)

    @ti64.kernel
    def square(a: ti64.types.ndarray(), b: ti64.types.ndarray()):
        for i in a:
            b[i] = a[i] * a[i]

    @ti64.kernel
    def total(b: ti64.types.ndarray(), s: ti64.types.ndarray()):
        for i in b:
            s[0] += b[i] * b[i]

    def program():
        square(a, b)
        total(b, s)

    f = function(program, [a], [b, s])
    loss = lambda x: f(x)[1][0] + jnp.sum(jnp.cos(f(x)[0]))  # noqa: E731
    step = jax.jit(jax.grad(loss)) if jit else jax.grad(loss)
    x = jnp.asarray(_args(13)[0])
    ref = lambda x: jnp.sum(x ** 4) + jnp.sum(jnp.cos(x * x))  # noqa: E731
    for k in range(3):  # (each call may get other buffers)
        xk = x + k
        np.testing.assert_allclose(step(xk), jax.grad(ref)(xk), rtol=1e-13)


# ---------------------------------------------------------------------------------------------
# Asynchronous dispatch: a pass runs on XLA's thread after the JAX call has returned; the
# program's later operations on the caller's thread wait for it (docs/interop.md)

PASS_DELAY = 0.25  # s: the pass sleeps first (a slow pass), so the caller's next step is early


def _slow_square(ti, passes):
    """y = x * x, a program that records the thread each pass runs on and sleeps before
    launching; a kernel and field accesses for the caller's later steps."""
    x = ti.field(ti.f64, N, needs_grad=True, needs_dual=True)
    y = ti.field(ti.f64, N, needs_grad=True, needs_dual=True)

    @ti.kernel
    def square():
        for i in x:
            y[i] = x[i] * x[i]

    @ti.kernel
    def set_y(v: ti.f64):
        for i in y:
            y[i] = v

    def program():
        passes.append(threading.get_ident())
        time.sleep(PASS_DELAY)
        square()

    return program, x, y, set_y


def _dispatched(ti, transform, passes, graph=False):
    """Run the difftape function under ``transform`` in a computation XLA runs on its own
    thread (a matrix product makes it too costly to run inline), returning as soon as JAX
    has dispatched it: (the un-waited results, what they must be, the program's fields and
    the kernel setting y; with ``graph`` a graph of ``set_y(7.0)`` captured before the
    call instead)."""
    from difftape.interop.jax import function

    program, x, y, set_y = _slow_square(ti, passes)
    a = jnp.asarray(_args(14)[0])
    t = jnp.asarray(_args(15)[0])
    m = jnp.ones((200, 200))
    late = lambda a, m: a + 0.0 * jnp.sum(m @ m)  # noqa: E731 (a, once the product is done)
    if transform == "jit":
        f = function(program, [x], [y])
        run = jax.jit(lambda a, m: f(late(a, m)))
        want = np.asarray(a) ** 2
    elif transform == "grad":
        f = function(program, [x], [y])
        run = jax.jit(jax.grad(lambda a, m: jnp.sum(f(late(a, m)) * t)))
        want = 2 * np.asarray(a) * np.asarray(t)
    else:  # forward mode
        g = function(program, [x], [y], mode="forward")
        run = jax.jit(lambda a, m: jax.jvp(g, (late(a, m),), (t,))[1])
        want = 2 * np.asarray(a) * np.asarray(t)
    jax.block_until_ready(run(a, m))  # (compiled, and the program's kernels too)
    passes.clear()
    if graph:
        with ti.graph.capture() as g:
            set_y(7.0)
        set_y = g
    return run(a, m), want, np.asarray(a) ** 2, x, y, set_y


@pytest.mark.parametrize("transform", ["jit", "grad", "jvp"])
@pytest.mark.parametrize("then", ["launch", "graph", "from_numpy", "setitem", "input",
                                  "to_numpy", "getitem",
                                  # (NumPy imports host memory only)
                                  pytest.param("dlpack", marks=pytest.mark.host_memory)])
def test_later_steps_of_the_program_wait_for_a_dispatched_pass(ti64, transform, then):
    """What the caller does with the program after the JAX call returns happens after the
    call's passes, in the order written, though they run later on XLA's thread: a launch
    or a write of the output is not overwritten by the pass, a read sees the pass's result,
    and an input written afterwards is not the one the pass read."""
    passes = []
    r, want, ys, x, y, set_y = _dispatched(ti64, transform, passes, graph=then == "graph")
    if then == "to_numpy":
        seen = y.to_numpy()
    elif then == "getitem":
        seen = np.array([y[i] for i in range(N)])
    elif then == "dlpack":  # (the storage itself, shared)
        seen = np.from_dlpack(y).copy()
    else:
        if then == "launch":
            set_y(7.0)
        elif then == "graph":
            set_y.replay()
        elif then == "from_numpy":
            y.from_numpy(np.full(N, 7.0))
        elif then == "setitem":
            y[1] = 7.0
        else:
            x.from_numpy(np.full(N, 3.0))
        jax.block_until_ready(r)
        seen = y.to_numpy()
    assert passes and threading.get_ident() not in passes  # (ran on XLA's thread)
    np.testing.assert_allclose(np.asarray(r), want, rtol=1e-13)
    if then in ("launch", "graph", "from_numpy"):
        np.testing.assert_array_equal(seen, np.full(N, 7.0))
    elif then == "setitem":
        np.testing.assert_array_equal(seen, np.where(np.arange(N) == 1, 7.0, ys))
    else:
        np.testing.assert_allclose(seen, ys, rtol=1e-15)
    if then == "input":
        np.testing.assert_array_equal(x.to_numpy(), np.full(N, 3.0))

