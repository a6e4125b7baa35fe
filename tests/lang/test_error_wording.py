"""Error messages contain the phrases Taichi's own messages have.

Programs (and Taichi's test-suite) match Taichi's messages with ``pytest.raises(...,
match=...)`` or in logs; difftape's messages say more (where, why, how to fix it) but contain
Taichi's phrase, and the exception is of the class Taichi raises. These tests run on Taichi too.
"""

import numpy as np
import pytest


def test_unknown_name(ti):
    @ti.kernel
    def foo():
        a + 1  # noqa: F821

    with pytest.raises(ti.TaichiNameError, match='Name "a" is not defined'):
        foo()


def test_unsupported_statement_and_nested_function_definitions(ti):
    @ti.kernel
    def raises():
        raise Exception()

    with pytest.raises(ti.TaichiSyntaxError, match='Unsupported node "Raise"'):
        raises()

    @ti.kernel
    def defines():
        def bar():
            pass

    with pytest.raises(ti.TaichiSyntaxError, match="Function definition is not allowed in "
                                                   "'ti.kernel'"):
        defines()

    @ti.func
    def func_defines():
        def bar():
            pass

    @ti.kernel
    def calls():
        func_defines()

    with pytest.raises(ti.TaichiSyntaxError, match="Function definition is not allowed in "
                                                   "'ti.func'"):
        calls()


def test_range_with_a_step_and_static_of_a_runtime_value(ti):
    @ti.kernel
    def stepped():
        for i in range(3, 7, 2):
            print(i)

    with pytest.raises(ti.TaichiCompilationError,
                       match="Range should have 1 or 2 arguments, found 3"):
        stepped()

    @ti.kernel
    def static_if(val: ti.f32):
        if ti.static(val > 0.5):
            print(val)

    with pytest.raises(ti.TaichiCompilationError, match="must be compile-time constants"):
        static_if(0.7)


def test_leaving_a_static_loop_under_a_runtime_if(ti):
    @ti.kernel
    def leave(a: ti.i32):
        for i in ti.static(range(3)):
            if a > i:
                break

    with pytest.raises(ti.TaichiSyntaxError, match="You are trying to `break` a static `for` "
                                                   "loop"):
        leave(1)


def test_returns(ti):
    @ti.kernel
    def no_return() -> ti.i32:
        pass

    with pytest.raises(ti.TaichiSyntaxError, match="Kernel has a return type but does not "
                                                   "have a return statement"):
        no_return()

    @ti.func
    def bar() -> ti.i32:
        pass

    @ti.kernel
    def calls_bar() -> ti.i32:
        return bar()

    with pytest.raises(ti.TaichiCompilationError, match="Function has a return type but does "
                                                        "not have a return statement"):
        calls_bar()

    @ti.kernel
    def returns_in_loop() -> ti.i32:
        for i in range(3):
            return i
        return 0

    with pytest.raises(ti.TaichiCompilationError,
                       match="Return inside non-static if/for is not supported"):
        returns_in_loop()


def test_operand_types(ti):
    @ti.kernel
    def bitwise_float(a: ti.f32, b: ti.f32):
        print(a & b)

    with pytest.raises(ti.TaichiTypeError, match=r"unsupported operand type\(s\) for '&'"):
        bitwise_float(1.0, 2.0)

    @ti.kernel
    def invert_float(x: ti.f32) -> ti.f32:
        return ~x

    with pytest.raises(ti.TaichiTypeError, match="takes integral inputs only"):
        invert_float(1.0)

    @ti.kernel
    def not_float(x: ti.f32) -> ti.i32:
        return not x

    with pytest.raises(ti.TaichiTypeError, match="takes integral inputs only"):
        not_float(1.0)

    @ti.kernel
    def select(b: ti.i32):
        a = ti.Vector([1, 2, 3])
        c = ti.Vector([1, 2])
        print(a if b else c)

    with pytest.raises(ti.TaichiCompilationError, match="Cannot broadcast tensor to tensor"):
        select(1)


def test_out_of_bound_access_under_debug(ti):
    ti.init(arch=ti.cpu, debug=True)

    @ti.kernel
    def read(a: ti.types.ndarray(dtype=ti.f32, ndim=1), i: ti.i32) -> ti.f32:
        return a[i]

    arr = np.arange(4, dtype=np.float32)
    assert read(arr, 3) == 3.0
    with pytest.raises(AssertionError, match="Out of bound access"):
        read(arr, 4)

    @ti.kernel
    def entry(i: ti.i32, j: ti.i32) -> ti.i32:
        m = ti.Matrix([[1, 2], [3, 4]])
        return m[i, j]

    assert entry(1, 0) == 3
    with pytest.raises(AssertionError, match="Out of bound access"):
        entry(2, 0)


def test_ndarray_argument_mismatches(ti):
    @ti.kernel
    def ints(x: ti.types.ndarray(dtype=ti.i32, ndim=1)):
        pass

    with pytest.raises(ValueError, match="Invalid value for argument x - required array has "
                                         "dtype="):
        ints(np.zeros(3, dtype=np.int64))
    with pytest.raises(ValueError, match="Non contiguous numpy arrays are not supported"):
        ints(np.zeros(6, dtype=np.int32)[::2])
    with pytest.raises(ValueError, match=r"Invalid value for argument x - required ndim=1, but "
                                         r"2d ndarray with shape \(2, 3\) is provided"):
        ints(ti.ndarray(ti.i32, shape=(2, 3)))
    with pytest.raises(ValueError, match="Invalid value for argument x - required array has "
                                         "ndim=1, array with 2 dimensions is provided"):
        ints(np.zeros((2, 3), dtype=np.int32))
    with pytest.raises(TypeError, match="Invalid type for argument x, got 1.2"):
        ints(1.2)

    @ti.kernel
    def mats(m: ti.types.ndarray(dtype=ti.math.mat3, ndim=1)):
        pass

    with pytest.raises(ValueError, match=r"Invalid value for argument m - required "
                                         r"element_shape=\(3, 3\), array with element shape of "
                                         r"\(2, 3\)"):
        mats(np.zeros((4, 2, 3), dtype=np.float32))

    @ti.kernel
    def template(t: ti.template()):
        pass

    with pytest.raises(ti.TaichiRuntimeTypeError, match="Ndarray shouldn't be passed in via"):
        template(ti.ndarray(ti.f32, shape=3))


def test_identity_and_membership_operators(ti):
    """``is`` has no meaning for kernel values; ``in`` is decided at compile time, so only
    inside ti.static(...)."""
    b = ti.field(ti.i32, shape=())
    c = ti.field(ti.i32, shape=())

    @ti.kernel
    def identity():
        print(b is c)

    with pytest.raises(ti.TaichiSyntaxError, match='Operator "is" in Taichi scope is not '
                                                   'supported'):
        identity()

    @ti.kernel
    def membership():
        print(1 in [1, 2])

    with pytest.raises(ti.TaichiSyntaxError, match='"In" is only supported inside `ti.static`'):
        membership()

    @ti.kernel
    def static_membership(k: ti.template()) -> ti.i32:
        r = 0
        if ti.static(k in (1, 2)):
            r = 10
        if ti.static(k not in (1, 2)):
            r += 1
        return r

    assert static_membership(1) == 10 and static_membership(3) == 1


def test_kernel_arguments_are_immutable(ti):
    @ti.kernel
    def assign(a: ti.i32):
        a = 1  # noqa: F841

    @ti.kernel
    def augassign(a: ti.i32):
        a += 1

    @ti.kernel
    def annassign(a: ti.i32):
        a: ti.i32 = 1  # noqa: F841

    @ti.kernel
    def template(a: ti.template()):
        a = 5  # noqa: F841

    for k in (assign, augassign, annassign, template):
        with pytest.raises(ti.TaichiSyntaxError,
                           match='Kernel argument "a" is immutable in the kernel'):
            k(5)

    @ti.kernel
    def copies(a: ti.i32) -> ti.i32:
        b = a
        b += 1
        return b

    assert copies(5) == 6


def _frame(line_no: int, name: str, carets: str) -> str:
    """Taichi's layout of one location of this file: its line as written, carets under it."""
    import linecache

    text = linecache.getline(__file__, line_no).rstrip("\n")
    col = len(text) - len(text.lstrip())
    return f'File "{__file__}", line {line_no}, in {name}:\n{text}\n{" " * col}{carets}\n'


def test_compile_errors_are_laid_out_as_taichis(ti):
    """As Taichi: the kernel's line, then each func call down to the failing expression, each
    with carets under the expression, then the message."""
    import inspect

    @ti.func
    def baz():
        t()  # noqa: F821

    @ti.func
    def bar():
        baz()

    @ti.kernel
    def foo():
        bar()

    @ti.kernel
    def stepped():
        for _i in range(1, 2, 3):
            pass

    with pytest.raises(ti.TaichiNameError) as e:
        foo()
    first = inspect.getsourcelines(baz)[1]
    want = "\n" + (_frame(first + 10, "foo", "^" * 5) + _frame(first + 6, "bar", "^" * 5) +
                   _frame(first + 2, "baz", "^")) + 'Name "t" is not defined'
    assert e.value.args[0][:len(want)] == want
    with pytest.raises(ti.TaichiCompilationError) as e:
        stepped()
    line = inspect.getsourcelines(stepped)[1] + 2
    want = "\n" + _frame(line, "stepped", "^" * len("for _i in range(1, 2, 3):")) + \
        "Range should have 1 or 2 arguments, found 3"
    assert e.value.args[0][:len(want)] == want


def test_conditional_expression_with_a_vector_condition(ti):
    # Taichi's test_if.py::test_ifexpr_vector.
    v = ti.Vector.field(3, float, shape=4)

    @ti.kernel
    def clamp_negative():
        for i in v:
            v[i] = 0 if v[i] < 0 else v[i]

    with pytest.raises(ti.TaichiSyntaxError, match='Please use "ti.select" instead.'):
        clamp_negative()


def test_assigning_a_vector_of_another_size(ti):
    # Taichi's test_type_check.py::test_assign and test_ndarray.py's vector assignment.
    f = ti.Vector.field(4, dtype=ti.i32, shape=())

    @ti.kernel
    def to_field():
        f[None] = ti.Vector([1, 2, 3])

    with pytest.raises(ti.TaichiTypeError,
                       match=r"cannot assign '\[Tensor \(3\) i32\]' to '\[Tensor \(4\) i32\]'"):
        to_field()

    a = ti.ndarray(ti.types.vector(3, ti.i32), shape=(2,))

    @ti.kernel
    def to_ndarray(arr: ti.types.ndarray(dtype=ti.types.vector(3, ti.i32), ndim=1)):
        for i in arr:
            arr[i] = [1, 2]

    with pytest.raises(ti.TaichiTypeError,
                       match=r"cannot assign '\[Tensor \(2\) i32\]' to '\[Tensor \(3\) i32\]'"):
        to_ndarray(a)


def test_kernel_argument_of_the_wrong_type(ti):
    # Taichi's test_kernel_arg_errors.py::test_pass_float_as_i32.
    @ti.kernel
    def foo(a: ti.i32):
        pass

    with pytest.raises(ti.TaichiRuntimeTypeError,
                       match=r"Argument \(0,\) \(type=<class 'float'>\) cannot be converted "
                             r"into required type i32"):
        foo(1.2)


def test_ndarray_argument_with_other_elements(ti):
    # Taichi's test_ndarray.py::test_arg_not_match and test_ndarray_wrong_dtype.
    @ti.kernel
    def vec2(a: ti.types.ndarray(dtype=ti.types.vector(2, ti.i32))):
        pass

    @ti.kernel
    def mat22(a: ti.types.ndarray(dtype=ti.types.matrix(2, 2, ti.i32))):
        pass

    @ti.kernel
    def scalar(arr: ti.types.ndarray(dtype=ti.f32)):
        pass

    with pytest.raises(ValueError, match=r"Invalid value for argument a - required element "
                                         r"type: VectorType\[2, i32\], but .* is provided"):
        vec2(ti.Matrix.ndarray(2, 3, ti.i32, shape=(4, 7)))
    with pytest.raises(ValueError, match=r"Invalid value for argument a - required element "
                                         r"type: MatrixType\[2,2, i32\], but .* is provided"):
        mat22(ti.Vector.ndarray(2, ti.i32, shape=(4, 7)))
    with pytest.raises(TypeError, match=r"Expect element type f32 for argument arr, but get "
                                        r"\[Tensor \(3\) i32\]"):
        scalar(ti.ndarray(ti.types.vector(3, ti.i32), shape=(12, 4)))
    with pytest.raises(TypeError, match=r"Expect element type f32 for argument arr, but get "
                                        r"i32"):
        scalar(ti.ndarray(ti.i32, shape=(12, 4)))


def test_loop_with_another_number_of_variables(ti):
    # Taichi's test_ndrange.py::test_dimension_error; a struct-for over a field likewise.
    x = ti.field(ti.i32, shape=(4, 4))

    @ti.kernel
    def over_ndrange():
        for i in ti.ndrange(4, 4):  # noqa: B007 (the mismatch is the point)
            pass

    @ti.kernel
    def over_field():
        for i in x:
            x[i, 0] = 1

    with pytest.raises(ti.TaichiSyntaxError,
                       match="Ndrange for loop with number of the loop variables not equal to "
                             "the dimension of the ndrange is not supported"):
        over_ndrange()
    with pytest.raises(ti.TaichiCompilationError,  # Taichi: an IndexError inside one
                       match=r"Number of struct-for indices does not match loop variable "
                             r"dimensionality \(1 != 2\)"):
        over_field()


def test_func_vector_argument_of_another_size(ti):
    # Taichi's test_function.py::test_func_matrix_arg_with_error.
    vec3 = ti.types.vector(3, ti.f32)

    @ti.func
    def test(a: vec3):
        a[0] = 100

    @ti.kernel
    def test_error():
        x = ti.Matrix([3, 4])
        test(x)

    with pytest.raises(ti.TaichiSyntaxError,
                       match="is expected to be a Matrix with n 3, but got 2"):
        test_error()


def test_atomic_of_a_value_that_is_not_a_place(ti):
    """As Taichi (its test_atomic_min_rvalue_as_frist_op): a syntax error naming the atomic
    (it was a type error)."""
    @ti.kernel
    def func():
        y = ti.Vector([1, 2, 3])
        ti.atomic_min([3, 2, 1], y)

    with pytest.raises(ti.TaichiSyntaxError, match="cannot use a non-writable target as the "
                                                   "first operand of") as info:
        func()
    assert "atomic_min" in str(info.value)
