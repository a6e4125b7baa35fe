"""Errors derive from the builtin exceptions a Python (and Taichi) program catches.

Taichi's exceptions (taichi/lang/exception.py) derive from Python's: a type error in a kernel
is a ``TypeError``, an unknown name a ``NameError``, a failed runtime check an
``AssertionError`` and a ``RuntimeError``. difftape's classes do the same (and stay under
``DifftapeError``); Taichi's names are aliases. These tests run on Taichi too.
"""

import pytest

TAICHI_NAMES = ("TaichiCompilationError", "TaichiSyntaxError", "TaichiNameError",
                "TaichiTypeError", "TaichiRuntimeError", "TaichiAssertionError",
                "TaichiRuntimeTypeError")


def test_taichi_exception_names_are_exported(ti):
    for name in TAICHI_NAMES:
        assert issubclass(getattr(ti, name), Exception), name
    assert issubclass(ti.TaichiTypeError, TypeError)
    assert issubclass(ti.TaichiTypeError, ti.TaichiCompilationError)
    assert issubclass(ti.TaichiSyntaxError, SyntaxError)
    assert issubclass(ti.TaichiNameError, NameError)
    assert issubclass(ti.TaichiRuntimeError, RuntimeError)
    assert issubclass(ti.TaichiAssertionError, AssertionError)
    assert issubclass(ti.TaichiAssertionError, ti.TaichiRuntimeError)


def test_float_index_is_a_type_error(ti):
    x = ti.field(ti.f32, shape=4)

    @ti.kernel
    def float_index(i: ti.f32):
        x[i] = 1.0

    with pytest.raises(TypeError):
        float_index(1.5)
    with pytest.raises(ti.TaichiTypeError):
        float_index(1.5)


def test_not_of_a_float_is_a_type_error(ti):
    @ti.kernel
    def negate(a: ti.f32) -> ti.i32:
        return not a

    @ti.kernel
    def negate_int(a: ti.i32) -> ti.i32:
        return not a

    with pytest.raises(ti.TaichiTypeError):
        negate(0.5)
    assert negate_int(0) == 1 and negate_int(3) == 0


def test_unknown_name_is_a_name_error(ti):
    x = ti.field(ti.f32, shape=4)

    @ti.kernel
    def unknown():
        x[0] = no_such_name  # noqa: F821

    with pytest.raises(NameError):
        unknown()
    with pytest.raises(ti.TaichiCompilationError):
        unknown()


def test_wrong_number_of_indices_is_an_index_error(ti):
    x = ti.field(ti.f32, shape=4)

    @ti.kernel
    def two_indices():
        x[0, 1] = 1.0

    with pytest.raises(IndexError):
        two_indices()
    with pytest.raises(ti.TaichiCompilationError):
        two_indices()


def test_static_of_a_runtime_value_is_refused(ti):
    x = ti.field(ti.i32, shape=2)

    @ti.kernel
    def static_branch(a: ti.i32):
        if ti.static(a > 0):
            x[0] = 1

    with pytest.raises(ti.TaichiCompilationError):
        static_branch(1)
    assert x[0] == 0


def test_failed_checks_at_run_time_are_assertion_errors(ti):
    ti.init(arch=ti.cpu, debug=True)
    x = ti.field(ti.f32, shape=4)

    @ti.kernel
    def store(i: ti.i32):
        x[i] = 1.0

    @ti.kernel
    def check(a: ti.i32):
        assert a > 0, "a must be positive"

    for cls in (AssertionError, RuntimeError, ti.TaichiAssertionError, ti.TaichiRuntimeError):
        with pytest.raises(cls):
            store(4)
        with pytest.raises(cls):
            check(-1)
    check(1)
