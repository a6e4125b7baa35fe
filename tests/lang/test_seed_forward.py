"""The primal (forward, no gradient) part of every code example in the seed documents.

/work/shared/seeds: Taichi's differentiable-programming guide (two renderings) and the
forward-mode autodiff design issue. Each example is kept as close to the document as possible;
where the document calls ti.Tape / kernel.grad only the forward kernels are run here, and where
it prints or asserts values those values are checked against NumPy.
"""

import math

import numpy as np


def test_compute_y_and_hand_written_dy_dx(ti, fp, rtol):
    x = ti.field(float, ())
    y = ti.field(float, ())

    @ti.kernel
    def compute_y():
        y[None] = ti.sin(x[None])

    dy_dx = ti.field(dtype=ti.f32, shape=())

    @ti.kernel
    def compute_dy_dx():
        dy_dx[None] = ti.cos(x[None])

    x[None] = 0.5
    compute_y()
    compute_dy_dx()
    np.testing.assert_allclose(y[None], np.sin(0.5), rtol=rtol)
    np.testing.assert_allclose(dy_dx[None], np.cos(0.5), rtol=1e-6)


def _gravity_setup(ti):
    """The ad_gravity example, verbatim apart from the GUI loop."""
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

    @ti.kernel
    def init():
        for i in x:
            x[i] = [ti.random(), ti.random()]

    return N, dt, x, v, U, compute_U, advance, init


def _gravity_energy(pos):
    r = pos[:, None, :] - pos[None, :, :]
    return np.sum(-1.0 / np.sqrt(np.sum(r * r, axis=-1) + 1e-3))


def test_gravity_init_and_energy(ti):
    N, dt, x, v, U, compute_U, advance, init = _gravity_setup(ti)
    init()
    pos = x.to_numpy().astype(np.float64)
    assert pos.shape == (N, 2)
    assert np.all(pos >= 0.0) and np.all(pos < 1.0)
    assert len(np.unique(pos)) == 2 * N  # every coordinate drawn separately

    U[None] = 0  # ti.Tape(U) would do this on entry
    compute_U()
    np.testing.assert_allclose(U[None], _gravity_energy(pos), rtol=1e-5)
    # the diagonal terms alone contribute N * -1/sqrt(1e-3)
    assert U[None] < -N / math.sqrt(1e-3)


def test_gravity_advance_with_zero_and_given_grad(ti):
    N, dt, x, v, U, compute_U, advance, init = _gravity_setup(ti)
    init()
    pos = x.to_numpy()

    advance()  # x.grad is still zero: nothing moves
    np.testing.assert_array_equal(v.to_numpy(), np.zeros((N, 2)))
    np.testing.assert_array_equal(x.to_numpy(), pos)

    grad = np.random.default_rng(0).standard_normal((N, 2)).astype(np.float32)
    x.grad.from_numpy(grad)
    advance()
    want_v = dt * -grad.astype(np.float64)
    np.testing.assert_allclose(v.to_numpy(), want_v, rtol=1e-6)
    np.testing.assert_allclose(x.to_numpy(), pos + dt * want_v, rtol=1e-6, atol=1e-7)


def test_gravity_substeps_without_tape_keep_particles_still(ti):
    N, dt, x, v, U, compute_U, advance, init = _gravity_setup(ti)
    init()
    pos = x.to_numpy()
    for _ in range(5):
        U[None] = 0
        compute_U()
        advance()
    np.testing.assert_array_equal(x.to_numpy(), pos)
    np.testing.assert_allclose(U[None], _gravity_energy(pos.astype(np.float64)), rtol=1e-5)


def test_kernel_grad_example_forward_losses(ti):
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

    func()
    assert loss[None] == sum(i * i for i in range(N)) == 1240
    assert loss2[None] == sum(range(N)) == 120
    func()  # accumulates
    assert (loss[None], loss2[None]) == (2480, 240)


def test_global_data_access_rule_1_example_forward(ti):
    N = 16

    x = ti.field(dtype=ti.f32, shape=N, needs_grad=True)
    loss = ti.field(dtype=ti.f32, shape=(), needs_grad=True)
    b = ti.field(dtype=ti.f32, shape=(), needs_grad=True)

    @ti.kernel
    def func_broke_rule_1():
        # BAD: broke global data access rule #1, reading global field and before mutation is done.
        loss[None] = x[1] * b[None]
        b[None] += 100

    @ti.kernel
    def func_equivalent():
        loss[None] = x[1] * 10

    for i in range(N):
        x[i] = i
    b[None] = 10

    func_broke_rule_1()
    assert loss[None] == 10.0 and b[None] == 110.0
    loss[None] = 0
    func_equivalent()
    assert loss[None] == 10.0


def test_global_data_access_rule_2_example_forward(ti):
    N = 16

    x = ti.field(dtype=ti.f32, shape=N, needs_grad=True)
    loss = ti.field(dtype=ti.f32, shape=(), needs_grad=True)

    @ti.kernel
    def func_break_rule_2():
        loss[None] += x[1] ** 2
        # Bad: broke global data access rule #2, it's not an atomic_add.
        loss[None] *= x[2]

    @ti.kernel
    def func_equivalent():
        loss[None] = (2 + x[1] ** 2) * x[2]

    for i in range(N):
        x[i] = i
    loss[None] = 2

    func_break_rule_2()
    assert loss[None] == (2 + 1**2) * 2 == 6.0
    loss[None] = 0
    func_equivalent()
    assert loss[None] == 6.0


def test_kernel_simplicity_rule_examples_forward(ti):
    x = ti.field(ti.f32, shape=10)
    y = ti.field(ti.f32, shape=10)
    acc = ti.field(ti.f32, shape=10)
    loss = ti.field(ti.f32, shape=())

    @ti.kernel
    def differentiable_task1():
        # Good: simple for loop
        for i in x:
            x[i] = y[i]

    @ti.kernel
    def differentiable_task2():
        # Good: one nested for loop
        for i in range(10):
            for j in range(20):
                for k in range(30):
                    acc[i] += x[i] * 0.001 + j * k * 0.0

    @ti.kernel
    def differentiable_task3():
        # Good: ti.static unrolls the inner loops so that it now only has one simple for loop.
        for i in range(10):
            for _ in ti.static(range(20)):
                acc[i] += 1.0
            for j in ti.static(range(20)):
                acc[i] -= j

    @ti.kernel
    def differentiable_task4():
        # mixed usage of for-loop and a statement without looping (fine in a forward run)
        loss[None] += x[0]
        for i in range(10):
            loss[None] += x[i]

    y.from_numpy(np.arange(10, dtype=np.float32) * 2)
    differentiable_task1()
    np.testing.assert_array_equal(x.to_numpy(), np.arange(10) * 2)
    differentiable_task2()
    np.testing.assert_allclose(acc.to_numpy(), np.arange(10) * 2 * 0.001 * 600, rtol=1e-4)
    acc.fill(0)
    differentiable_task3()
    np.testing.assert_array_equal(acc.to_numpy(), np.full(10, 20.0 - sum(range(20))))
    differentiable_task4()
    assert loss[None] == 0 + sum(range(0, 20, 2))


def test_python_scope_and_kernel_contributions_example(ti, fp, rtol):
    x = ti.field(dtype=float, shape=(), needs_grad=True)
    loss = ti.field(dtype=float, shape=(), needs_grad=True)

    @ti.kernel
    def differentiable_task():
        for _ in range(3):
            loss[None] += ti.sin(x[None]) + 1.0

    @ti.kernel
    def manipulation_in_kernel():
        loss[None] += ti.sin(x[None]) + 1.0

    x[None] = 0.0
    loss[None] = 0.0  # ti.Tape(loss=loss) would reset it
    loss[None] += ti.sin(x[None]) + 1.0  # Python scope
    manipulation_in_kernel()
    differentiable_task()
    assert loss[None] == 5.0  # "The outputs are 5.0 and 4.0": 5.0 is the forward value

    x[None] = 0.3
    loss[None] = 0.0
    manipulation_in_kernel()
    differentiable_task()
    np.testing.assert_allclose(loss[None], 4 * (np.sin(0.3) + 1.0), rtol=rtol)


def test_customized_gradient_example_forward(ti):
    x = ti.field(ti.f32)
    total = ti.field(ti.f32)
    n = 128
    ti.root.dense(ti.i, n).place(x)
    ti.root.place(total)

    @ti.kernel
    def func(mul: ti.f32):
        for i in range(n):
            ti.atomic_add(total[None], x[i] * mul)

    def forward(mul):  # decorated with @ti.ad.grad_replaced in the document
        func(mul)
        func(mul)

    forward(4)
    assert total[None] == 0.0  # x is still zero
    x.from_numpy(np.arange(n, dtype=np.float32) * 0.5)
    forward(4)
    assert total[None] == 2 * 4 * 0.5 * sum(range(n))


def test_forward_mode_issue_polynomial(ti, fp, rtol):
    @ti.func
    def f(x):
        return x**3 + 2 * x**2 - 3 * x + 1

    @ti.kernel
    def k(v: float) -> float:
        return f(v)

    assert k(1.0) == 1.0
    for v in (-2.0, 0.5, 3.0):
        np.testing.assert_allclose(k(v), v**3 + 2 * v**2 - 3 * v + 1, rtol=rtol)

    x = ti.field(float, shape=(), needs_grad=True)
    y = ti.field(float, shape=(), needs_grad=True)

    @ti.kernel
    def f_field():
        y[None] += x[None] ** 3 + 2 * x[None] ** 2 - 3 * x[None] + 1

    x[None] = 1.0
    f_field()
    assert y[None] == 1.0


def test_forward_mode_issue_three_inputs(ti, fp):
    x1 = ti.field(float, shape=(), needs_grad=True)
    x2 = ti.field(float, shape=(), needs_grad=True)
    x3 = ti.field(float, shape=(), needs_grad=True)
    y = ti.field(float, shape=(), needs_grad=True)

    @ti.kernel
    def f():
        y[None] += x1[None] ** 3 + 2 * x2[None] ** 2 - 3 * x3[None] + 1

    inputs = [1.0, 2.0, 3.0]
    for field, value in zip([x1, x2, x3], inputs, strict=True):
        field.from_numpy(np.array(value))  # 0-D field from a 0-D array, as in the issue
    f()
    assert y[None] == 1.0 + 8.0 - 9.0 + 1.0
    assert [x1[None], x2[None], x3[None]] == inputs
