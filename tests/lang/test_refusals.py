"""Programs Taichi refuses whose meaning difftape would otherwise get wrong: each is refused
(the classes are Taichi's names, so the tests also run on Taichi 1.7.4).

Programs Taichi refuses that difftape accepts because their result is well defined are listed
in the README ("Accepted where Taichi refuses")."""

import pytest


def test_reannotating_a_variable_with_another_type_is_refused(ti):
    @ti.kernel
    def over() -> ti.f32:
        d: ti.i32 = 2
        d: ti.f32 = 2.5
        return d

    with pytest.raises(ti.TaichiCompilationError):
        over()

    @ti.kernel
    def same() -> ti.f32:
        d: ti.f32 = 2.0
        d: ti.f32 = 2.5  # the same type: an assignment
        return d

    assert same() == 2.5


def test_loop_variable_naming_an_outer_variable_is_refused(ti):
    x = ti.field(ti.i32, shape=4)

    @ti.kernel
    def last_index() -> ti.i32:
        i = 0
        for i in range(10):  # noqa: B007 (the loop variable is the point)
            pass
        return i

    with pytest.raises(ti.TaichiCompilationError,
                       match="already declared in the outer scope"):
        last_index()

    @ti.kernel
    def struct_for() -> ti.i32:
        j = 5
        for j in x:
            x[j] = j
        return j

    with pytest.raises(ti.TaichiCompilationError,
                       match="already declared in the outer scope"):
        struct_for()


@pytest.mark.parametrize("bounds", [((1.1, 10.5),), (2.5,), ((0, 3), 4.0)])
def test_float_ndrange_bounds_are_refused(ti, bounds):
    @ti.kernel
    def count() -> ti.i32:
        n = 0
        for _idx in ti.grouped(ti.ndrange(*bounds)):
            n += 1
        return n

    with pytest.raises(ti.TaichiTypeError, match="Every argument of ndrange should be an "
                                                 "integer scalar"):
        count()


def test_float_static_ndrange_bounds_are_refused(ti):
    @ti.kernel
    def unrolled() -> ti.i32:
        n = 0
        for _idx in ti.static(ti.ndrange(0.1, 0.2)):
            n += 1
        return n

    with pytest.raises(ti.TaichiTypeError, match="Every argument of ndrange should be an "
                                                 "integer scalar"):
        unrolled()


def test_integer_ndrange_bounds_still_work(ti):
    import numpy as np

    @ti.kernel
    def area(n: ti.i32) -> ti.i32:
        s = 0
        for i, j in ti.ndrange((1, n), np.int64(3)):
            s += i * 10 + j
        return s

    assert area(4) == sum(i * 10 + j for i in range(1, 4) for j in range(3))
