"""Fields must be placed before kernels run (Taichi's materialization checks): a field
declared without a shape and never placed, or a field made with ``needs_grad=True`` /
``needs_dual=True`` whose ``.grad`` / ``.dual`` was not placed, makes the next kernel launch
raise a ``RuntimeError`` naming where the field was declared, until it is placed."""

import numpy as np
import pytest

NOT_PLACED = r"These field\(s\) are not placed"


def _grad_not_placed(role: str) -> str:
    return (rf"These field\(s\) requrie `needs_{role}=True`, however their {role} field\(s\) "
            r"are not placed")


def _noop(ti):
    @ti.kernel
    def foo():
        pass

    return foo


def test_a_field_never_placed_is_refused_at_the_next_launch(ti):
    a = ti.field(ti.i32)  # the line the message names
    foo = _noop(ti)
    with pytest.raises(RuntimeError, match=NOT_PLACED) as e:
        foo()
    assert "test_placement.py" in str(e.value)
    with pytest.raises(RuntimeError, match=NOT_PLACED):  # still, until it is placed
        foo()
    ti.root.dense(ti.i, 4).place(a)
    foo()

    @ti.kernel
    def fill():
        for i in a:
            a[i] = i * 3

    fill()
    np.testing.assert_array_equal(a.to_numpy(), np.arange(4) * 3)


def test_a_field_declared_after_the_first_launch_is_checked_too(ti):
    x = ti.field(ti.f32, shape=3)
    foo = _noop(ti)
    foo()
    y = ti.field(ti.f32)
    with pytest.raises(RuntimeError, match=NOT_PLACED):
        foo()
    ti.root.dense(ti.i, 3).place(y)
    foo()
    assert x.shape == y.shape == (3,)


def _struct(ti, flag: str):
    return ti.Struct.field({"pos": ti.types.vector(3, float), "mass": ti.f32}, **{flag: True})


@pytest.mark.parametrize("role", ["grad", "dual"])
@pytest.mark.parametrize("kind", ["scalar", "vector", "matrix", "struct"])
def test_a_needed_grad_or_dual_not_placed_is_refused(ti, kind, role):
    flag = f"needs_{role}"
    make = {"scalar": lambda: ti.field(ti.f32, **{flag: True}),
            "vector": lambda: ti.Vector.field(3, ti.f32, **{flag: True}),
            "matrix": lambda: ti.Matrix.field(2, 3, ti.f32, **{flag: True}),
            "struct": lambda: _struct(ti, flag)}[kind]
    f = make()
    ti.root.dense(ti.i, 1).place(f)
    foo = _noop(ti)
    with pytest.raises(RuntimeError, match=_grad_not_placed(role)):
        foo()


@pytest.mark.difftape_only  # Taichi names the line for a .grad, not for a .dual
@pytest.mark.parametrize("role", ["grad", "dual"])
def test_the_refusal_names_the_declaration_and_the_fix(ti, role):
    import inspect

    x = ti.field(ti.f32, **{f"needs_{role}": True}); line = inspect.currentframe().f_lineno  # noqa: E702
    ti.root.dense(ti.i, 2).place(x)
    with pytest.raises(ti.DifftapeError, match=_grad_not_placed(role)) as e:
        _noop(ti)()
    msg = str(e.value)
    assert f"test_placement.py:{line}" in msg, msg
    assert f"place(x.{role})" in msg and "{" not in msg, msg  # (Taichi's: x.{gradient_type})


def test_a_grad_placed_apart_later_lets_kernels_run_and_differentiate(ti):
    """The refusal lasts until the .grad is placed (in an SNode of its own); then the Tape
    gives the analytic gradient."""
    x = ti.field(ti.f32, needs_grad=True)
    loss = ti.field(ti.f32, shape=(), needs_grad=True)
    ti.root.dense(ti.i, 4).place(x)

    @ti.kernel
    def total():
        for i in x:
            loss[None] += x[i] * x[i]

    with pytest.raises(RuntimeError, match=_grad_not_placed("grad")):
        total()
    ti.root.dense(ti.i, 4).place(x.grad)
    x.from_numpy(np.array([1.0, -2.0, 0.5, 3.0], np.float32))
    with ti.ad.Tape(loss):
        total()
    np.testing.assert_allclose(x.grad.to_numpy(), 2 * x.to_numpy(), rtol=1e-6)
    assert loss[None] == pytest.approx(1 + 4 + 0.25 + 9)


def test_grad_and_dual_placed_beside_their_field(ti):
    x = ti.field(ti.f32, needs_grad=True, needs_dual=True)
    y = ti.field(ti.f32, shape=(), needs_grad=True, needs_dual=True)
    ti.root.dense(ti.i, 3).place(x, x.grad, x.dual)

    @ti.kernel
    def cube():
        for i in x:
            y[None] += x[i] ** 3

    x.from_numpy(np.array([1.0, 2.0, -1.0], np.float32))
    with ti.ad.Tape(y):
        cube()
    np.testing.assert_allclose(x.grad.to_numpy(), 3 * x.to_numpy() ** 2, rtol=1e-6)
    with ti.ad.FwdMode(loss=y, param=x, seed=[1.0, 0.0, 0.0]):
        cube()
    assert y.dual[None] == pytest.approx(3.0)


def test_the_grad_kernel_is_refused_too(ti):
    x = ti.field(ti.f32, needs_grad=True)
    ti.root.dense(ti.i, 2).place(x)

    @ti.kernel
    def double():
        for i in x:
            x[i] *= 2

    with pytest.raises(RuntimeError, match=_grad_not_placed("grad")):
        double.grad()


def test_one_size_for_several_axes_is_used_for_each(ti):
    # Taichi's test_oop.py: ti.root.dense(ti.ij, (n,)) is dense(ti.ij, (n, n)).
    val = ti.field(ti.f32)
    ti.root.dense(ti.ij, (5,)).place(val)
    assert val.shape == (5, 5)

    @ti.kernel
    def fill():
        for i, j in val:
            val[i, j] = i * 10 + j

    fill()
    np.testing.assert_array_equal(val.to_numpy(), np.add.outer(np.arange(5) * 10, np.arange(5)))
