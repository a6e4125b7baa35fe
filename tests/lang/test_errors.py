"""difftape's own error types (Taichi raises different classes, so these are difftape-only).

Every error difftape raises derives from ``difftape.DifftapeError``. Compile-time problems are
``difftape.CompileError`` and say where they are: the kernel's name, the file, the line number
and the offending source line. Out-of-range indices under ``ti.init(debug=True)`` raise
``difftape.KernelAssertionError``.
"""

import os
import re

import numpy as np
import pytest

pytestmark = pytest.mark.difftape_only

with open(__file__, encoding="utf-8") as _source:
    _LINES = _source.read().splitlines()


def _line_of(key):
    """1-based number of the only line in this file that ends with ``# marker: <key>``."""
    tag = f"# marker: {key}"
    hits = [n for n, text in enumerate(_LINES, 1) if text.rstrip().endswith(tag)]
    assert len(hits) == 1, f"{tag!r} must end exactly one line: {hits}"
    return hits[0]


def _assert_points_at(error, kernel_name, key):
    """The message names the kernel, this file and line, and quotes the offending line."""
    message = str(error)
    line = _line_of(key)
    assert kernel_name in message, message
    assert os.path.basename(__file__) in message, message
    assert re.search(rf"\b{line}\b", message), f"line {line} missing from: {message}"
    assert _LINES[line - 1].strip() in message, message


def test_error_hierarchy(ti):
    expected = {
        # class: the builtins it must also be
        "CompileError": (),
        "KernelSyntaxError": (SyntaxError,),
        "KernelNameError": (NameError,),
        "KernelTypeError": (TypeError,),
        "KernelIndexError": (IndexError,),
        "ArgumentError": (TypeError,),
        "GradientRuleError": (),
        "KernelRuntimeError": (RuntimeError,),
        "KernelAssertionError": (RuntimeError, AssertionError),
        "IndexOutOfRangeError": (RuntimeError, AssertionError, IndexError),
        "ShapeError": (ValueError,),
        "OptionError": (ValueError,),
        "UnknownOptionError": (KeyError,),
    }
    for name, builtins in expected.items():
        cls = getattr(ti, name)
        assert issubclass(cls, ti.DifftapeError), name
        for b in builtins:
            assert issubclass(cls, b), (name, b)
    for name in ("KernelSyntaxError", "KernelNameError", "KernelTypeError", "KernelIndexError",
                 "ArgumentError", "GradientRuleError"):
        assert issubclass(getattr(ti, name), ti.CompileError), name
    assert issubclass(ti.IndexOutOfRangeError, ti.KernelAssertionError)
    assert issubclass(ti.DifftapeError, Exception)
    # Taichi's names are aliases of the classes with the same meaning
    assert ti.TaichiCompilationError is ti.CompileError
    assert ti.TaichiTypeError is ti.KernelTypeError
    assert ti.TaichiIndexError is ti.KernelIndexError
    assert ti.TaichiAssertionError is ti.KernelAssertionError


def test_lambda_in_kernel_is_a_compile_error(ti):
    @ti.kernel
    def uses_lambda() -> ti.i32:
        f = lambda a: a + 1  # marker: lambda
        return f(1)

    with pytest.raises(ti.KernelSyntaxError) as info:
        uses_lambda()
    _assert_points_at(info.value, "uses_lambda", "lambda")


def test_try_in_kernel_is_a_compile_error(ti):
    x = ti.field(ti.i32, shape=2)

    @ti.kernel
    def uses_try():
        try:  # marker: try
            x[0] = 1
        except IndexError:
            x[1] = 1

    with pytest.raises(ti.CompileError) as info:
        uses_try()
    _assert_points_at(info.value, "uses_try", "try")


def test_with_in_kernel_is_a_compile_error(ti):
    x = ti.field(ti.i32, shape=2)

    @ti.kernel
    def uses_with():
        with open(__file__):  # marker: with
            x[0] = 1

    with pytest.raises(ti.CompileError) as info:
        uses_with()
    _assert_points_at(info.value, "uses_with", "with")


def test_error_inside_a_func_points_at_the_func_line(ti):
    @ti.func
    def helper(v):
        return (lambda a: a)(v)  # marker: lambda in func

    @ti.kernel
    def calls_helper() -> ti.i32:
        return helper(3)

    with pytest.raises(ti.CompileError) as info:
        calls_helper()
    message = str(info.value)
    assert "helper" in message, message
    assert re.search(rf"\b{_line_of('lambda in func')}\b", message), message


def test_float_index_is_a_compile_error(ti):
    x = ti.field(ti.f32, shape=4)

    @ti.kernel
    def float_index(i: ti.f32):
        x[i] = 1.0  # marker: float index

    with pytest.raises(ti.KernelTypeError) as info:
        float_index(1.5)
    _assert_points_at(info.value, "float_index", "float index")


def test_unknown_function_is_a_compile_error(ti):
    x = ti.field(ti.f32, shape=4)

    @ti.kernel
    def calls_unknown():
        x[0] = no_such_function(1.0)  # noqa: F821 # marker: unknown

    with pytest.raises(ti.KernelNameError) as info:
        calls_unknown()
    _assert_points_at(info.value, "calls_unknown", "unknown")
    assert "no_such_function" in str(info.value)


def test_assigning_to_a_kernel_argument_is_a_compile_error(ti):
    @ti.kernel
    def mutates_arg(n: ti.i32) -> ti.i32:
        n = n + 1  # marker: arg assignment
        return n

    with pytest.raises(ti.CompileError) as info:
        mutates_arg(1)
    _assert_points_at(info.value, "mutates_arg", "arg assignment")


def test_wrong_number_of_kernel_arguments(ti):
    x = ti.field(ti.f32, shape=())

    @ti.kernel
    def two_args(a: ti.i32, b: ti.f32):
        x[None] = a + b

    with pytest.raises(ti.DifftapeError) as info:
        two_args(1)
    assert "two_args" in str(info.value) and "b" in str(info.value)
    with pytest.raises(ti.DifftapeError) as info:
        two_args(1, 2.0, 3)
    assert "two_args" in str(info.value)
    two_args(1, 2.0)  # the kernel itself is fine
    assert x[None] == 3.0


def test_wrong_kernel_argument_type(ti):
    @ti.kernel
    def takes_int(a: ti.i32) -> ti.i32:
        return a

    with pytest.raises(ti.DifftapeError) as info:
        takes_int("three")
    message = str(info.value)
    assert "takes_int" in message and "a" in message and "str" in message, message


def test_from_numpy_shape_mismatch(ti):
    x = ti.field(ti.f32, shape=(2, 3))
    with pytest.raises(ti.DifftapeError) as info:
        x.from_numpy(np.zeros((3, 2), dtype=np.float32))
    message = str(info.value)
    assert "(2, 3)" in message and "(3, 2)" in message, message


def test_debug_mode_out_of_range_index(ti):
    ti.init(arch=ti.cpu, debug=True)
    x = ti.field(ti.f32, shape=4)

    @ti.kernel
    def store(i: ti.i32):
        x[i] = 1.0  # marker: out of range

    store(3)
    assert x[3] == 1.0
    for bad in (4, -1):
        with pytest.raises(ti.IndexOutOfRangeError) as info:
            store(bad)
        _assert_points_at(info.value, "store", "out of range")
        assert str(bad) in str(info.value)


def test_out_of_range_names_the_field_as_the_failing_kernel_does(ti):
    """An unnamed field passed to a template parameter is named in a message by that
    parameter, in that kernel only: another kernel that took it as `src` does not rename it
    (its out-of-range error named the field 'src' in a kernel that calls it 'vf')."""
    ti.init(arch=ti.cpu, debug=True)
    a = ti.field(ti.f32, shape=4)
    b = ti.field(ti.f32, shape=4)

    @ti.kernel
    def copy(src: ti.template(), dst: ti.template()):
        for i in src:
            dst[i] = src[i]

    @ti.kernel
    def shift(vf: ti.template()):
        for i in vf:
            vf[i] = vf[i - 1]

    copy(a, b)
    copy(b, a)
    with pytest.raises(ti.IndexOutOfRangeError,
                       match=r"index -1 out of range for axis 0 of 'vf' with shape \(4,\)"):
        shift(a)
    with pytest.raises(ti.IndexOutOfRangeError, match="of 'vf' "):
        shift(b)

    @ti.kernel
    def shift_global():
        for i in b:
            b[i] = b[i - 1]

    with pytest.raises(ti.IndexOutOfRangeError, match="of 'b' "):  # a global: its own name
        shift_global()


def test_conditional_expression_with_a_vector_condition_is_a_compile_error(ti):
    # Taichi (since 1.5) refuses it too and points to ti.select.
    @ti.kernel
    def runtime_vector(c: ti.i32) -> ti.i32:
        v = ti.Vector([c, 0])
        return 0 if v else 1  # marker: vector condition

    @ti.kernel
    def constant_matrix() -> ti.i32:
        return 0 if ti.Matrix([[0, 0], [0, 0]]) else 1  # marker: constant condition

    for kernel, name, key, args in [
            (runtime_vector, "runtime_vector", "vector condition", (1,)),
            (constant_matrix, "constant_matrix", "constant condition", ())]:
        with pytest.raises(ti.CompileError) as info:
            kernel(*args)
        _assert_points_at(info.value, name, key)
        assert "ti.select" in str(info.value)


def test_and_or_on_floats_is_a_compile_error(ti):
    # Taichi refuses float operands of `and`/`or` ("unsupported operand type(s) for '&&'").
    @ti.kernel
    def scalars(a: ti.f32, b: ti.f32) -> ti.f32:
        return a and b  # marker: float and

    @ti.kernel
    def vectors(a: ti.f32) -> ti.i32:
        v = ti.Vector([a, 1.0]) or ti.Vector([0.0, a])  # marker: float or
        return v[0]

    for kernel, name, key, args in [(scalars, "scalars", "float and", (1.5, 1.0)),
                                    (vectors, "vectors", "float or", (1.5,))]:
        with pytest.raises(ti.CompileError) as info:
            kernel(*args)
        _assert_points_at(info.value, name, key)
        assert "x != 0" in str(info.value)


def test_user_assert_is_not_an_index_error(ti):
    ti.init(arch=ti.cpu, debug=True)

    @ti.kernel
    def check(a: ti.i32):
        assert a > 0, "a must be positive"

    with pytest.raises(ti.KernelAssertionError) as info:
        check(-1)
    assert not isinstance(info.value, IndexError)
    assert "a must be positive" in str(info.value)


def test_a_failed_assert_names_the_kernel_and_the_line(ti):
    """As a bounds check does (Taichi's message is the assert's text alone)."""
    ti.init(arch=ti.cpu, debug=True)
    x = ti.field(ti.f32, shape=4)

    @ti.kernel
    def check():
        for i in x:
            assert x[i] >= 0, "x must not be negative"  # marker: kernel assert

    x[2] = -1.0
    with pytest.raises(ti.KernelAssertionError) as info:
        check()
    assert str(info.value).startswith("x must not be negative\n")
    _assert_points_at(info.value, "check", "kernel assert")


def test_an_assert_known_false_fails_where_it_is_reached(ti):
    """``assert 0`` (or ``False``) is checked at run time where the kernel reaches it, as in
    Taichi: in a branch not taken it costs nothing; it used to be refused at compile time,
    which refused correct programs."""
    ti.init(arch=ti.cpu, debug=True)
    x = ti.field(ti.f32, shape=4)

    @ti.kernel
    def step():
        for i in x:
            if x[i] < 0:
                assert 0, "negative entry"
            x[i] += 1

    @ti.kernel
    def unreachable():
        assert False  # noqa: B011 - a kernel assert, compiled (what is tested)

    step()
    assert x.to_numpy().tolist() == [1, 1, 1, 1]
    x[2] = -5
    with pytest.raises(AssertionError, match="negative entry"):
        step()
    with pytest.raises(AssertionError):
        unreachable()


def test_static_of_a_runtime_value_points_at_the_line(ti):
    @ti.kernel
    def static_branch(a: ti.i32) -> ti.i32:
        r = 0
        if ti.static(a > 0):  # marker: static runtime
            r = 1
        return r

    with pytest.raises(ti.KernelTypeError) as info:
        static_branch(1)
    _assert_points_at(info.value, "static_branch", "static runtime")
    assert "compile-time" in str(info.value)
