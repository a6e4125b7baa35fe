"""ti.ad.Tape, kernel.grad and custom gradients: every reverse-mode example of the seed guide
(/work/shared/seeds/001_*.txt and 000_*.txt) with the numbers it states, and the Tape's own
semantics as Taichi 1.7.4 implements them.

The guide writes ``ti.Tape``; Taichi 1.7.4 only has ``ti.ad.Tape`` (the alias was removed), so
the ``guide_ti`` fixture supplies the alias when the backend lacks it. difftape must provide it
(test_tape_alias).
"""

import math
import os

import numpy as np
import pytest

from .helpers import (
    assert_message_quotes,
    assert_true_gradient_or_rule_error,
    close,
    weights,
)


@pytest.fixture
def guide_ti(ti, monkeypatch):
    if not hasattr(ti, "Tape"):
        monkeypatch.setattr(ti, "Tape", ti.ad.Tape, raising=False)
    return ti


@pytest.mark.difftape_only
def test_tape_alias(ti):
    # Taichi 1.7.4 has no ti.Tape; the guide (and difftape) spell it that way
    assert ti.Tape is ti.ad.Tape


# --------------------------------------------------------------------------------- the guide


@pytest.mark.parametrize("x0", [0.0, 0.5, -2.0])
def test_guide_tape_dy_dx_is_cos(guide_ti, x0):
    ti = guide_ti
    x = ti.field(dtype=ti.f32, shape=(), needs_grad=True)
    y = ti.field(dtype=ti.f32, shape=(), needs_grad=True)

    @ti.kernel
    def compute_y():
        y[None] = ti.sin(x[None])

    x[None] = x0
    with ti.Tape(y):
        compute_y()

    print("dy/dx =", x.grad[None], " at x =", x[None])
    close(y[None], math.sin(x0), rtol=1e-6)
    close(x.grad[None], math.cos(x0), rtol=1e-6)


def _gravity(ti):
    """The ad_gravity example of the guide, verbatim apart from the GUI loop."""
    N = 8
    dt = 1e-5

    x = ti.Vector.field(2, dtype=ti.f32, shape=N, needs_grad=True)  # particle positions
    v = ti.Vector.field(2, dtype=ti.f32, shape=N)  # particle velocities
    U = ti.field(dtype=ti.f32, shape=(), needs_grad=True)  # potential energy

    @ti.kernel
    def compute_U():
        for i, j in ti.ndrange(N, N):
            r = x[i] - x[j]
            # r.norm(1e-3) is equivalent to ti.sqrt(r.norm()**2 + 1e-3)
            # This is to prevent 1/0 error which can cause wrong derivative
            U[None] += -1 / r.norm(1e-3)  # U += -1 / |r|

    @ti.kernel
    def advance():
        for i in x:
            v[i] += dt * -x.grad[i]  # dv/dt = -dU/dx
        for i in x:
            x[i] += dt * v[i]  # dx/dt = v

    def substep():
        with ti.Tape(loss=U):
            # Kernel invocations in this scope will later contribute to partial derivatives of
            # U with respect to input variables such as x.
            compute_U(
            )  # The tape will automatically compute dU/dx and save the results in x.grad
        advance()

    @ti.kernel
    def init():
        for i in x:
            x[i] = [ti.random(), ti.random()]

    return dt, x, v, U, compute_U, substep, init


def _gravity_energy_and_grad(pos):
    """U = sum_{i,j} -1 / sqrt(|x_i - x_j|^2 + 1e-3) and dU/dx_k = 2 sum_j r_kj / (.)^(3/2)."""
    r = pos[:, None, :] - pos[None, :, :]
    q = np.sum(r * r, axis=-1) + 1e-3
    energy = np.sum(-1.0 / np.sqrt(q))
    grad = 2 * np.sum(r * q[..., None] ** -1.5, axis=1)
    return energy, grad


def test_guide_gravity_tape_gives_dU_dx(guide_ti):
    ti = guide_ti
    dt, x, v, U, compute_U, substep, init = _gravity(ti)
    init()
    U[None] = 123.0  # the Tape sets U[None] = 0 on entry
    with ti.Tape(loss=U):
        compute_U()
    pos = x.to_numpy().astype(np.float64)
    energy, grad = _gravity_energy_and_grad(pos)
    close(U[None], energy, rtol=1e-5)
    close(x.grad.to_numpy(), grad, rtol=1e-4)
    assert U.grad[None] == 1


def test_guide_gravity_substeps(guide_ti):
    ti = guide_ti
    dt, x, v, U, compute_U, substep, init = _gravity(ti)
    init()
    pos = x.to_numpy().astype(np.float64)
    vel = np.zeros_like(pos)
    for _ in range(5):
        substep()
        _, grad = _gravity_energy_and_grad(pos)
        vel += dt * -grad
        pos += dt * vel
        close(x.grad.to_numpy(), grad, rtol=1e-4)
    close(v.to_numpy(), vel, rtol=1e-4)
    close(x.to_numpy(), pos, rtol=1e-6)


def test_guide_kernel_grad_two_outputs(ti):
    N = 16

    x = ti.field(dtype=ti.f32, shape=N, needs_grad=True)
    loss = ti.field(dtype=ti.f32, shape=(), needs_grad=True)
    loss2 = ti.field(dtype=ti.f32, shape=(), needs_grad=True)

    @ti.kernel
    def func():
        for i in x:
            loss[None] += x[i] ** 2
            loss2[None] += x[i]

    for i in range(N):
        x[i] = i

    # Set the `grad` of the output variables to `1` before calling `func.grad()`.
    loss.grad[None] = 1
    loss2.grad[None] = 1

    func()
    func.grad()
    for i in range(N):
        assert x.grad[i] == i * 2 + 1
    assert loss[None] == sum(i * i for i in range(N))
    assert loss2[None] == sum(range(N))


def test_guide_lazy_grad(ti):
    x = ti.field(ti.f32)
    y = ti.field(ti.f32)
    ti.root.dense(ti.i, 4).place(x, y)
    ti.root.lazy_grad()

    @ti.kernel
    def run():
        for i in x:
            y[i] = 3 * x[i] ** 2

    x.from_numpy(np.arange(4, dtype=np.float32))
    y.grad.fill(1)
    run()
    run.grad()
    np.testing.assert_array_equal(x.grad.to_numpy(), 6 * np.arange(4))


def test_guide_differentiable_code_inside_kernels(guide_ti, capsys):
    ti = guide_ti
    x = ti.field(dtype=float, shape=(), needs_grad=True)
    loss = ti.field(dtype=float, shape=(), needs_grad=True)

    @ti.kernel
    def differentiable_task():
        for l in range(3):  # noqa: E741, B007 (verbatim from the guide)
            loss[None] += ti.sin(x[None]) + 1.0

    @ti.kernel
    def manipulation_in_kernel():
        loss[None] += ti.sin(x[None]) + 1.0

    x[None] = 0.0
    with ti.Tape(loss=loss):
        # The line below in python scope only contribute to the forward pass
        # but not the backward pass i.e., not auto-differentiated.
        loss[None] += ti.sin(x[None]) + 1.0

        # Code in Taichi scope i.e. inside Taichi kernels, is auto-differentiated.
        manipulation_in_kernel()
        differentiable_task()

    # The outputs are 5.0 and 4.0
    print(loss[None], x.grad[None])
    assert loss[None] == 5.0
    assert x.grad[None] == 4.0

    # You can modify the grad of a field manually in python scope, e.g., clear the grad.
    x.grad[None] = 0.0
    # The output is 0.0
    print(x.grad[None])
    assert x.grad[None] == 0.0
    assert capsys.readouterr().out.split() == ["5.0", "4.0", "0.0"]


def test_guide_custom_gradient(guide_ti):
    ti = guide_ti
    x = ti.field(ti.f32)
    total = ti.field(ti.f32)
    n = 128
    ti.root.dense(ti.i, n).place(x)
    ti.root.place(total)
    ti.root.lazy_grad()

    @ti.kernel
    def func(mul: ti.f32):
        for i in range(n):
            ti.atomic_add(total[None], x[i] * mul)

    @ti.ad.grad_replaced
    def forward(mul):
        func(mul)
        func(mul)

    @ti.ad.grad_for(forward)
    def backward(mul):
        func.grad(mul)

    with ti.Tape(loss=total):
        forward(4)

    assert x.grad[0] == 4
    # the custom gradient ran func.grad once although the forward ran func twice
    np.testing.assert_array_equal(x.grad.to_numpy(), np.full(n, 4.0))


def test_guide_static_loops_work_around_simplicity_rule(ti):
    # the older guide's differentiable_task3, rewritten with ti.static inner loops
    x = ti.field(float, (10, 20), needs_grad=True)
    y = ti.field(float, 10, needs_grad=True)

    @ti.kernel
    def differentiable_task3():
        # Good: ti.static unrolls the inner loops so that it now only has one simple for loop.
        for i in range(10):
            for j in ti.static(range(20)):
                y[i] += x[i, j] * j
            for j in ti.static(range(20)):
                y[i] += x[i, j] ** 2

    xs = np.random.default_rng(20).uniform(-1, 1, (10, 20)).astype(np.float32)
    x.from_numpy(xs)
    y.grad.fill(1)
    differentiable_task3()
    differentiable_task3.grad()
    close(x.grad.to_numpy(), np.arange(20)[None, :] + 2 * xs.astype(np.float64), rtol=1e-6)


# ------------------------------------------------------------ the guide's rule-breaking programs


@pytest.mark.difftape_only
def test_guide_rule_1_read_then_mutate(guide_ti):
    # Taichi silently gives x.grad[1] == 110 (it reads b after the += 100); the truth is 10
    ti = guide_ti
    N = 16

    x = ti.field(dtype=ti.f32, shape=N, needs_grad=True)
    loss = ti.field(dtype=ti.f32, shape=(), needs_grad=True)
    b = ti.field(dtype=ti.f32, shape=(), needs_grad=True)

    @ti.kernel
    def func_broke_rule_1():
        # BAD: broke global data access rule #1, reading global field and before mutation is done.
        loss[None] = x[1] * b[None]  # marker: rule1_read
        b[None] += 100  # marker: rule1_write

    for i in range(N):
        x[i] = i
    b[None] = 10
    loss.grad[None] = 1

    def run():
        with ti.Tape(loss):
            func_broke_rule_1()

    def check():
        assert x.grad[1] == 10.0
        assert b.grad[None] == 1.0  # d loss / d b at the value that was read: x[1]

    assert_true_gradient_or_rule_error(ti, run, check, "func_broke_rule_1", __file__,
                                       ("rule1_read", "rule1_write"))


@pytest.mark.difftape_only
def test_guide_rule_2_non_atomic_second_write(ti):
    # Taichi silently gives x.grad[2] == 6 (it reads the final loss); the truth is
    # d/dx1 = 2 x1 x2 = 4 and d/dx2 = 2 + x1^2 = 3 (loss = (2 + x1^2) * x2, loss starting at 2)
    N = 16

    x = ti.field(dtype=ti.f32, shape=N, needs_grad=True)
    loss = ti.field(dtype=ti.f32, shape=(), needs_grad=True)

    @ti.kernel
    def func_break_rule_2():
        loss[None] += x[1] ** 2  # marker: rule2_first
        # Bad: broke global data access rule #2, it's not an atomic_add.
        loss[None] *= x[2]  # marker: rule2_second

    for i in range(N):
        x[i] = i
    loss.grad[None] = 1
    loss[None] = 2

    def run():
        func_break_rule_2()
        func_break_rule_2.grad()

    def check():
        assert loss[None] == 6.0
        assert x.grad[1] == 4.0
        assert x.grad[2] == 3.0

    assert_true_gradient_or_rule_error(ti, run, check, "func_break_rule_2", __file__,
                                       ("rule2_first", "rule2_second"))


def test_guide_rule_2_equivalent_is_correct(ti):
    N = 16
    x = ti.field(dtype=ti.f32, shape=N, needs_grad=True)
    loss = ti.field(dtype=ti.f32, shape=(), needs_grad=True)

    @ti.kernel
    def func_equivalent():
        loss[None] = (2 + x[1] ** 2) * x[2]

    for i in range(N):
        x[i] = i
    loss.grad[None] = 1
    func_equivalent()
    func_equivalent.grad()
    assert x.grad[1] == 4.0
    assert x.grad[2] == 3.0


def test_guide_rule_1_equivalent_is_correct(guide_ti):
    ti = guide_ti
    N = 16
    x = ti.field(dtype=ti.f32, shape=N, needs_grad=True)
    loss = ti.field(dtype=ti.f32, shape=(), needs_grad=True)

    @ti.kernel
    def func_equivalent():
        loss[None] = x[1] * 10

    for i in range(N):
        x[i] = i
    with ti.Tape(loss):
        func_equivalent()
    assert x.grad[1] == 10.0


@pytest.mark.difftape_only
def test_tape_validation_catches_cross_kernel_violation(ti):
    x = ti.field(float, 4, needs_grad=True)
    b = ti.field(float, (), needs_grad=True)
    loss = ti.field(float, (), needs_grad=True)

    @ti.kernel
    def read_b():
        for i in x:
            loss[None] += x[i] * b[None]

    @ti.kernel
    def mutate_b():
        b[None] += 100  # marker: validation_write

    x.from_numpy(np.arange(4.0))
    b[None] = 10
    with pytest.raises(ti.GradientRuleError) as info:
        with ti.ad.Tape(loss, validation=True):
            read_b()
            mutate_b()
    message = str(info.value)
    assert "mutate_b" in message, message
    assert os.path.basename(__file__) in message, message
    assert_message_quotes(message, __file__, ("validation_write",))


@pytest.mark.difftape_only
def test_tape_validation_accepts_a_valid_program(ti):
    x = ti.field(float, 4, needs_grad=True)
    b = ti.field(float, (), needs_grad=True)
    loss = ti.field(float, (), needs_grad=True)

    @ti.kernel
    def mutate_b():
        b[None] += 100

    @ti.kernel
    def read_b():
        for i in x:
            loss[None] += x[i] * b[None]

    x.from_numpy(np.arange(4.0))
    b[None] = 10
    with ti.ad.Tape(loss, validation=True):
        mutate_b()
        read_b()
    np.testing.assert_array_equal(x.grad.to_numpy(), np.full(4, 110.0))
    assert b.grad[None] == 6.0


def test_tape_grad_check_passes_on_correct_program(ti):
    # Taichi's grad checker needs an f64 loss; it compares against finite differences
    x = ti.field(ti.f64, 5, needs_grad=True)
    loss = ti.field(ti.f64, (), needs_grad=True)

    @ti.kernel
    def run():
        for i in x:
            loss[None] += ti.sin(x[i]) * x[i] ** 2

    xs = np.linspace(-1, 1, 5)
    x.from_numpy(xs)
    with ti.ad.Tape(loss, grad_check=[x]):
        run()
    close(x.grad.to_numpy(), np.cos(xs) * xs**2 + 2 * xs * np.sin(xs), rtol=1e-12)
    close(loss[None], np.sum(np.sin(xs) * xs**2), rtol=1e-12)
    np.testing.assert_array_equal(x.to_numpy(), xs)  # the checker restores the fields


@pytest.mark.difftape_only
def test_tape_grad_check_names_the_users_index_of_an_offset_field(ti):
    """A wrong gradient is reported at the element's index as the program writes it (the
    field's offset added), not at its place in storage."""
    x = ti.Vector.field(2, ti.f64, shape=3, offset=-1, needs_grad=True)
    loss = ti.field(ti.f64, (), needs_grad=True)

    @ti.kernel
    def run():
        for i in x:
            loss[None] += x[i][0] * x[i][1] * (i + 2)

    @ti.ad.grad_replaced
    def forward():
        run()

    @ti.ad.grad_for(forward)
    def backward():  # deliberately wrong at x[1][1] (storage row 2)
        run.grad()
        g = x.grad.to_numpy()
        g[2, 1] += 1.0
        x.grad.from_numpy(g)

    x.from_numpy(np.arange(1.0, 7.0).reshape(3, 2))
    with pytest.raises(ti.ad.GradientCheckError) as info:
        with ti.ad.Tape(loss, grad_check=[x]):
            forward()
    msg = str(info.value)
    assert "x[1, 1]: gradient 16, finite difference 15" in msg, msg  # 3 * x[1][0], plus 1
    assert msg.count("gradient ") == 1, msg  # the only wrong entry


# ------------------------------------------------------------------------ Tape semantics


def _tape_fixture(ti):
    x = ti.field(float, 3, needs_grad=True)
    loss = ti.field(float, (), needs_grad=True)

    @ti.kernel
    def run():
        for i in x:
            loss[None] += x[i] * x[i] * (i + 1)

    x.from_numpy(np.array([1.0, -2.0, 0.5]))
    return x, loss, run


def test_tape_zeroes_loss_and_clears_gradients_on_entry(ti, fp):
    x, loss, run = _tape_fixture(ti)
    loss[None] = 7.0
    loss.grad[None] = 5.0
    x.grad.from_numpy(np.array([9.0, 9.0, 9.0]))
    with ti.ad.Tape(loss):
        assert loss[None] == 0.0
        assert loss.grad[None] == 0.0
        np.testing.assert_array_equal(x.grad.to_numpy(), np.zeros(3))
        run()
    assert loss[None] == 1.0 + 8.0 + 0.75
    assert loss.grad[None] == 1.0  # seeded by the Tape and left at 1
    np.testing.assert_array_equal(x.grad.to_numpy(), [2.0, -8.0, 3.0])


def test_tape_without_clearing_accumulates(ti, fp):
    x, loss, run = _tape_fixture(ti)
    loss[None] = 7.0
    x.grad.from_numpy(np.array([9.0, 9.0, 9.0]))
    with ti.ad.Tape(loss, clear_gradients=False):
        assert loss[None] == 0.0  # the loss is zeroed whether or not gradients are cleared
        np.testing.assert_array_equal(x.grad.to_numpy(), [9.0, 9.0, 9.0])
        run()
    np.testing.assert_array_equal(x.grad.to_numpy(), [11.0, 1.0, 12.0])
    with ti.ad.Tape(loss):
        run()
    np.testing.assert_array_equal(x.grad.to_numpy(), [2.0, -8.0, 3.0])


def test_tape_keyword_and_positional_loss(ti, fp):
    x, loss, run = _tape_fixture(ti)
    with ti.ad.Tape(loss=loss):
        run()
    first = x.grad.to_numpy()
    with ti.ad.Tape(loss, True):
        run()
    np.testing.assert_array_equal(x.grad.to_numpy(), first)


def test_clear_all_gradients(ti):
    a = ti.field(float, 3, needs_grad=True)
    v = ti.Vector.field(2, float, (2, 2), needs_grad=True)
    m = ti.Matrix.field(2, 2, float, 2, needs_grad=True)
    s = ti.field(float, ())
    ti.root.lazy_grad()  # places s.grad too
    a.grad.fill(1)
    v.grad.fill(2)
    m.grad.fill(3)
    s.grad[None] = 4
    a.fill(5)
    ti.ad.clear_all_gradients()
    for f in (a, v, m, s):
        assert not np.any(f.grad.to_numpy())
    np.testing.assert_array_equal(a.to_numpy(), np.full(3, 5.0))  # primal values untouched


def test_kernels_chained_through_intermediate_field(ti, fp, npfp, rtol):
    n = 6
    x = ti.field(float, n, needs_grad=True)
    y = ti.field(float, n, needs_grad=True)
    z = ti.Vector.field(2, float, n, needs_grad=True)
    loss = ti.field(float, (), needs_grad=True)

    @ti.kernel
    def first():
        for i in x:
            y[i] = ti.sin(x[i])

    @ti.kernel
    def second():
        for i in y:
            z[i] = ti.Vector([y[i] * y[i], y[i] * x[i]])

    @ti.kernel
    def third():
        for i in z:
            loss[None] += z[i][0] + 2 * z[i][1]

    xs = np.linspace(-1.5, 1.5, n)
    x.from_numpy(xs.astype(npfp))
    with ti.ad.Tape(loss):
        first()
        second()
        third()
    xv = x.to_numpy().astype(np.float64)
    s, c = np.sin(xv), np.cos(xv)
    close(loss[None], np.sum(s * s + 2 * s * xv), rtol=16 * rtol)
    close(x.grad.to_numpy(), 2 * s * c + 2 * (c * xv + s), rtol=16 * rtol)


def test_time_steps_in_fields(ti, fp, npfp, rtol):
    """x[t+1] = x[t] + dt v[t], v[t+1] = v[t] - dt k x[t], loss = x[T]^2 + v[T]^2 / 2."""
    T, dt = 20, 0.1
    x = ti.field(float, T + 1, needs_grad=True)
    v = ti.field(float, T + 1, needs_grad=True)
    k = ti.field(float, (), needs_grad=True)
    loss = ti.field(float, (), needs_grad=True)

    @ti.kernel
    def step(t: ti.i32):
        x[t + 1] = x[t] + dt * v[t]
        v[t + 1] = v[t] - dt * k[None] * x[t]

    @ti.kernel
    def compute_loss():
        loss[None] += x[T] ** 2 + 0.5 * v[T] ** 2

    x0, v0, k0 = 0.8, -0.3, 2.0
    x[0], v[0], k[None] = x0, v0, k0
    with ti.ad.Tape(loss):
        for t in range(T):
            step(t)
        compute_loss()

    def simulate(s0, stiffness):
        a = np.array([[1.0, dt], [-dt * stiffness, 1.0]])
        return np.linalg.matrix_power(a, T) @ s0, a

    s0 = np.array([x[0], v[0]], dtype=np.float64)
    kk = float(k[None])
    sT, a = simulate(s0, kk)
    close(x[T], sT[0], rtol=64 * rtol)
    close(loss[None], sT[0] ** 2 + 0.5 * sT[1] ** 2, rtol=64 * rtol)
    g0 = np.linalg.matrix_power(a, T).T @ np.array([2 * sT[0], sT[1]])
    close([x.grad[0], v.grad[0]], g0, rtol=64 * rtol)

    def loss_of_k(stiffness):
        s, _ = simulate(s0, float(stiffness))
        return s[0] ** 2 + 0.5 * s[1] ** 2

    eps = 1e-5
    dk = (loss_of_k(kk + eps) - loss_of_k(kk - eps)) / (2 * eps)  # a quadratic-ish polynomial
    close(k.grad[None], dk, rtol=max(64 * rtol, 1e-8))


def test_overwritten_output_adjoint_is_consumed(ti, fp):
    """After kernel.grad, the adjoint of an output the kernel assigned (not accumulated) is zero:
    the value before the assignment did not influence anything, so a second .grad adds nothing."""
    x = ti.field(float, 3, needs_grad=True)
    y = ti.field(float, 3, needs_grad=True)
    loss = ti.field(float, (), needs_grad=True)

    @ti.kernel
    def run():
        for i in x:
            y[i] = x[i] * x[i]
            loss[None] += x[i]

    x.from_numpy(np.array([1.0, 2.0, 3.0]))
    y.grad.from_numpy(np.array([1.0, 0.5, -1.0]))
    loss.grad[None] = 1
    run()
    run.grad()
    np.testing.assert_array_equal(x.grad.to_numpy(), [3.0, 3.0, -5.0])
    np.testing.assert_array_equal(y.grad.to_numpy(), [0.0, 0.0, 0.0])
    assert loss.grad[None] == 1.0  # an accumulated output keeps its adjoint
    run.grad()
    np.testing.assert_array_equal(x.grad.to_numpy(), [4.0, 4.0, -4.0])


def test_intermediate_time_step_adjoints_after_tape(ti):
    """Fields overwritten inside the tape keep no adjoint: only never-written inputs do."""
    x = ti.field(float, 4, needs_grad=True)
    loss = ti.field(float, (), needs_grad=True)

    @ti.kernel
    def step(t: ti.i32):
        x[t + 1] = 2 * x[t]

    @ti.kernel
    def finish():
        loss[None] += x[3]

    x[0] = 1.0
    with ti.ad.Tape(loss):
        for t in range(3):
            step(t)
        finish()
    assert x[3] == 8.0
    np.testing.assert_array_equal(x.grad.to_numpy(), [8.0, 0.0, 0.0, 0.0])


def test_kernel_arguments_are_replayed_in_the_backward_pass(ti, fp, npfp, rtol):
    x = ti.field(float, 4, needs_grad=True)
    loss = ti.field(float, (), needs_grad=True)

    @ti.kernel
    def run(p: float, q: ti.i32):
        for i in x:
            loss[None] += x[i] ** q * p

    xs = np.array([0.5, 1.0, -1.5, 2.0])
    x.from_numpy(xs.astype(npfp))
    with ti.ad.Tape(loss):
        run(2.0, 2)
        run(-1.0, 3)
        run(0.5, 1)
    xv = x.to_numpy().astype(np.float64)
    close(x.grad.to_numpy(), 4 * xv - 3 * xv**2 + 0.5, rtol=16 * rtol)


def test_repeated_kernel_grad_accumulates(ti, fp):
    x = ti.field(float, 3, needs_grad=True)
    loss = ti.field(float, (), needs_grad=True)

    @ti.kernel
    def run():
        for i in x:
            loss[None] += 3 * x[i]

    loss.grad[None] = 1
    run()
    for _ in range(3):
        run.grad()
    np.testing.assert_array_equal(x.grad.to_numpy(), np.full(3, 9.0))


# ------------------------------------------------------------------- no_grad, custom gradients


def test_no_grad_kernel_and_function_run_forward_only(ti, fp):
    x = ti.field(float, 4, needs_grad=True)
    loss = ti.field(float, (), needs_grad=True)

    @ti.kernel
    def energy():
        for i in x:
            loss[None] += x[i] ** 2

    @ti.ad.no_grad
    @ti.kernel
    def bookkeeping():
        loss[None] += 3 * x[0]

    @ti.kernel
    def more():
        loss[None] += 5 * x[1]

    @ti.ad.no_grad
    def python_bookkeeping():
        more()

    x.from_numpy(np.array([1.0, 2.0, 3.0, 4.0]))
    with ti.ad.Tape(loss):
        energy()
        bookkeeping()
        python_bookkeeping()
    assert loss[None] == 30.0 + 3.0 + 10.0
    np.testing.assert_array_equal(x.grad.to_numpy(), [2.0, 4.0, 6.0, 8.0])
    # As in Taichi, the .grad of a no_grad function (or kernel) is empty: it runs nothing.
    loss.grad[None] = 1.0
    assert python_bookkeeping.grad() is None
    assert bookkeeping.grad() is None
    np.testing.assert_array_equal(x.grad.to_numpy(), [2.0, 4.0, 6.0, 8.0])


def test_custom_gradient_called_directly(ti, fp):
    """grad_replaced / grad_for outside a Tape: calling ``forward.grad`` runs the custom one."""
    n = 4
    x = ti.field(float, n, needs_grad=True)
    y = ti.field(float, n, needs_grad=True)

    @ti.kernel
    def square():
        for i in x:
            y[i] = x[i] * x[i]

    @ti.kernel
    def square_grad_doubled():
        for i in x:
            x.grad[i] += 2 * (2 * x[i]) * y.grad[i]

    @ti.ad.grad_replaced
    def forward():
        square()

    @ti.ad.grad_for(forward)
    def backward():
        square_grad_doubled()

    x.from_numpy(np.arange(1.0, n + 1))
    forward()
    np.testing.assert_array_equal(y.to_numpy(), np.arange(1.0, n + 1) ** 2)
    y.grad.fill(1)
    forward.grad()
    np.testing.assert_array_equal(x.grad.to_numpy(), 4 * np.arange(1.0, n + 1))


def test_custom_gradient_checkpointing_in_tape(ti, fp, npfp, rtol):
    """The guide's checkpointing use: the backward recomputes an intermediate field that later
    kernels overwrote, then differentiates through it."""
    n = 5
    x = ti.field(float, n, needs_grad=True)
    tmp = ti.field(float, n, needs_grad=True)
    loss = ti.field(float, (), needs_grad=True)

    @ti.kernel
    def make_tmp(scale: float):
        for i in x:
            tmp[i] = ti.sin(x[i]) * scale

    @ti.kernel
    def use_tmp():
        for i in tmp:
            loss[None] += tmp[i] ** 2

    @ti.ad.grad_replaced
    def stage(scale):
        make_tmp(scale)
        use_tmp()

    @ti.ad.grad_for(stage)
    def stage_grad(scale):
        make_tmp(scale)  # recompute the checkpointed intermediate
        use_tmp.grad()
        make_tmp.grad(scale)

    xs = np.linspace(-1, 1, n)
    x.from_numpy(xs.astype(npfp))
    with ti.ad.Tape(loss):
        stage(2.0)
        stage(3.0)  # overwrites tmp; stage 2.0's backward recomputes it
    xv = x.to_numpy().astype(np.float64)
    s, c = np.sin(xv), np.cos(xv)
    close(loss[None], np.sum((4 + 9) * s * s), rtol=16 * rtol)
    close(x.grad.to_numpy(), (4 + 9) * 2 * s * c, rtol=16 * rtol)


def test_custom_gradient_with_kernel_grad_of_weights(ti, fp, npfp, rtol):
    """A grad_for function may replace the whole gradient of a block (here: a hand-written
    adjoint that multiplies by 2, the truth for y = 2 x)."""
    n = 3
    x = ti.field(float, n, needs_grad=True)
    y = ti.field(float, n, needs_grad=True)
    loss = ti.field(float, (), needs_grad=True)

    @ti.kernel
    def double():
        for i in x:
            y[i] = 2 * x[i]

    @ti.kernel
    def double_adjoint():
        for i in x:
            x.grad[i] += 2 * y.grad[i]

    @ti.kernel
    def reduce():
        for i in y:
            loss[None] += y[i] * (i + 1)

    @ti.ad.grad_replaced
    def double_block():
        double()

    @ti.ad.grad_for(double_block)
    def double_block_grad():
        double_adjoint()

    x.from_numpy(weights(n, seed=21).astype(npfp))
    with ti.ad.Tape(loss):
        double_block()
        reduce()
    close(x.grad.to_numpy(), 2 * np.arange(1, n + 1), rtol=rtol)


def test_placing_the_grad_of_a_field_made_without_needs_grad(ti):
    # Taichi's pattern (its grad_check tests): a float field has a .grad before it is placed;
    # ti.root...place(x, x.grad) allocates both.
    x = ti.field(ti.f32)
    y = ti.field(ti.f32)
    loss = ti.field(ti.f32)
    ti.root.dense(ti.i, 4).place(x, x.grad, y, y.grad)
    ti.root.place(loss, loss.grad)

    @ti.kernel
    def compute():
        for i in x:
            y[i] = x[i] * x[i]
            loss[None] += y[i]

    xs = np.array([0.5, -1.0, 2.0, 3.0], np.float32)
    x.from_numpy(xs)
    with ti.ad.Tape(loss=loss):
        compute()
    np.testing.assert_allclose(x.grad.to_numpy(), 2 * xs)


def _placed_apart(ti, n=3, steps=4):
    """DiffTaichi's wave.py/smoke_taichi_cpu.py pattern: fields made without needs_grad,
    ``place(p)`` and then, in another SNode of the same shape, ``place(p.grad)``; ``h`` is
    placed without its .grad."""
    p = ti.field(ti.f64, name="p")
    v = ti.Vector.field(2, ti.f64, name="v")
    h = ti.field(ti.f64, name="h")
    loss = ti.field(ti.f64, name="loss")
    ti.root.dense(ti.i, steps).dense(ti.jk, n).place(p)
    ti.root.dense(ti.i, steps).dense(ti.jk, n).place(p.grad)
    ti.root.dense(ti.ij, n).place(v)
    ti.root.dense(ti.ij, n).place(v.grad)
    ti.root.dense(ti.ij, n).place(h)
    ti.root.place(loss)
    ti.root.place(loss.grad)
    return p, v, h, loss


def test_placing_the_grad_apart_from_its_field(ti):
    steps, n = 4, 3
    p, v, h, loss = _placed_apart(ti, n, steps)

    @ti.kernel
    def step(t: ti.i32):
        for j, k in ti.ndrange(n, n):
            p[t, j, k] = ti.sin(p[t - 1, j, k]) * v[j, k][0] + v[j, k][1]

    @ti.kernel
    def total():
        for j, k in ti.ndrange(n, n):
            loss[None] += p[steps - 1, j, k] ** 2

    rng = np.random.default_rng(3)
    p0 = rng.uniform(-1, 1, (n, n))
    vs = rng.uniform(0.5, 1.5, (n, n, 2))
    start = np.zeros((steps, n, n))
    start[0] = p0
    p.from_numpy(start)
    v.from_numpy(vs)
    with ti.ad.Tape(loss=loss):
        for t in range(1, steps):
            step(t)
        total()
    # Analytic: p_t = sin(p_{t-1}) a + b, loss = sum p_last^2, by the chain rule backwards.
    a, b = vs[..., 0], vs[..., 1]
    ps = [p0]
    for _ in range(1, steps):
        ps.append(np.sin(ps[-1]) * a + b)
    g = 2 * ps[-1]
    ga, gb = np.zeros_like(a), np.zeros_like(b)
    for t in range(steps - 1, 0, -1):
        ga += g * np.sin(ps[t - 1])
        gb += g
        g = g * np.cos(ps[t - 1]) * a
    assert loss[None] == pytest.approx(float(np.sum(ps[-1] ** 2)), rel=1e-12)
    np.testing.assert_allclose(p.grad.to_numpy()[0], g, rtol=1e-12)
    np.testing.assert_allclose(v.grad.to_numpy(), np.stack([ga, gb], -1), rtol=1e-12)
    assert p.grad.shape == (steps, n, n)
    assert h.grad is not None  # a field object, as in Taichi, without storage


@pytest.mark.difftape_only  # has_grad and the refusals are difftape's
def test_a_grad_never_placed_has_no_storage_and_is_refused_by_name(ti):
    p, v, h, loss = _placed_apart(ti)
    assert p.has_grad and v.has_grad and loss.has_grad and not h.has_grad
    assert ti.field(ti.i32, 3).grad is None  # integers have none, as in Taichi
    with pytest.raises(ti.DifftapeError, match=r"h\.grad has no storage.*place\(h\.grad\)"):
        h.grad.to_numpy()

    @ti.kernel
    def through_h():
        for j, k in h:
            h[j, k] = v[j, k][0] * 2
        for j, k in h:
            loss[None] += h[j, k]

    with pytest.raises(ti.GradientRuleError, match=r"'h'.*needs_grad=True"):
        with ti.ad.Tape(loss=loss):
            through_h()

    @ti.kernel
    def reads_h_grad():
        for j, k in h:
            v.grad[j, k][0] += h.grad[j, k]

    with pytest.raises(ti.CompileError, match=r"h\.grad\[j, k\](.|\n)*h\.grad has no storage"):
        reads_h_grad()
    lone = ti.field(ti.f64)
    ti.root.place(lone)
    with pytest.raises(ti.DifftapeError, match=r"Tape\(loss\).*no gradient storage"):
        with ti.ad.Tape(loss=lone):
            pass
    ti.root.lazy_grad()  # gives h its .grad: the same object, now with storage
    g = h.grad
    assert h.has_grad and g is h.grad and g.to_numpy().shape == (3, 3)


@pytest.mark.difftape_only  # Taichi accepts these and indexes out of the gradient's bounds
def test_placing_a_grad_apart_needs_the_fields_shape_and_dense_snodes(ti):
    x = ti.field(ti.f32, name="x")
    ti.root.dense(ti.i, 4).place(x)
    with pytest.raises(ti.ShapeError, match=r"x\.grad placed with shape \(5,\).*\(4,\)"):
        ti.root.dense(ti.i, 5).place(x.grad)
    with pytest.raises(ti.DifftapeError, match="dense SNodes only"):
        ti.root.pointer(ti.i, 2).dense(ti.i, 2).place(x.grad)
    y = ti.field(ti.f32, name="y")
    with pytest.raises(ti.DifftapeError, match="place its primal field first"):
        ti.root.dense(ti.i, 4).place(y.grad)
    ti.root.dense(ti.i, 4).place(x.grad)
    with pytest.raises(ti.DifftapeError, match=r"x\.grad is already placed"):
        ti.root.dense(ti.i, 4).place(x.grad)


@pytest.mark.parametrize("primal_kind", ["kernel", "plain function"])
def test_grad_for_a_function_not_grad_replaced_is_refused(ti, primal_kind):
    """@ti.ad.grad_for(f) needs f decorated with @ti.ad.grad_replaced: a kernel or a plain
    function is refused with a RuntimeError (as Taichi), and the kernel still differentiates."""
    x = ti.field(float, 4, needs_grad=True)
    total = ti.field(float, (), needs_grad=True)

    @ti.kernel
    def func(mul: float):
        for i in x:
            total[None] += x[i] * mul

    def forward(mul):
        func(mul)

    primal = func if primal_kind == "kernel" else forward
    with pytest.raises(RuntimeError):
        @ti.ad.grad_for(primal)
        def backward(mul):
            func.grad(mul)

    with ti.ad.Tape(loss=total):
        func(4)
    np.testing.assert_array_equal(x.grad.to_numpy(), np.full(4, 4.0))


def test_reading_the_grad_of_a_field_without_needs_grad_names_the_fix(ti):
    """A kernel reading x.grad of a field made without needs_grad is refused at compile time,
    naming the gradient and needs_grad=True (Taichi's wording); nothing is written."""
    y = ti.field(shape=(), name="y", dtype=ti.f32, needs_grad=True)
    x = ti.field(shape=(), name="x", dtype=ti.f32)

    @ti.kernel
    def func(x: ti.template()):
        y[None] = x.grad[None] * x.grad[None]

    x[None] = 5.0
    with pytest.raises(ti.TaichiCompilationError,
                       match=r"Gradient x\.grad has not been placed, check whether "
                             r"`needs_grad=True`"):
        func(x)
    assert y[None] == 0.0


def test_random_in_a_differentiated_kernel_is_refused_as_a_runtime_error(ti):
    """ti.random() feeding the loss cannot be recomputed by the reverse pass: refused (Taichi
    raises a RuntimeError saying RandStmt is not supported), the loss is left as it was."""
    loss = ti.field(dtype=ti.f32, shape=(), needs_grad=True)
    x = ti.field(dtype=ti.f32, shape=(), needs_grad=True)

    @ti.kernel
    def work():
        loss[None] = x[None] * ti.random()

    x[None] = 10
    with pytest.raises(RuntimeError, match="RandStmt not supported"):
        with ti.ad.Tape(loss):
            work()
    assert x.grad[None] == 0.0


@pytest.mark.parametrize("storage", ["ndarray", "field"])
def test_a_kernel_reading_the_grad_it_accumulates_into_is_refused(ti, storage):
    """A differentiated kernel reading x.grad of an x whose gradient its reverse pass
    accumulates: refused (Taichi refuses it for ndarrays), while the primal kernel runs."""
    n = 10
    if storage == "ndarray":
        a = ti.ndarray(ti.f32, shape=n, needs_grad=True)
        b = ti.ndarray(ti.f32, shape=(), needs_grad=True)
    else:
        a = ti.field(ti.f32, shape=n, needs_grad=True)
        b = ti.field(ti.f32, shape=(), needs_grad=True)
    anno = ti.types.ndarray() if storage == "ndarray" else ti.template()

    @ti.kernel
    def test(x: anno, b: anno):
        for i in x:
            b[None] += x.grad[i] * x[i]

    a.fill(1.0)
    a.grad.fill(2.0)
    test(a, b)
    assert b[None] == n * 2.0
    if storage == "field" and ti.__name__ == "taichi":
        return  # Taichi differentiates it for fields, reading whatever the .grad holds
    with pytest.raises(RuntimeError, match=r"Cannot automatically differentiate through a grad"):
        test.grad(a, b)
    np.testing.assert_array_equal(a.grad.to_numpy(), np.full(n, 2.0))
