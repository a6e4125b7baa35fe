"""@ti.kernel / @ti.func: argument kinds, return values, inlined and nested funcs."""

import numpy as np
import pytest


def test_kernel_writes_field_from_index(ti, fp, npfp, rtol):
    n = 16
    x = ti.field(float, shape=n)

    @ti.kernel
    def fill():
        for i in range(n):
            x[i] = ti.sin(i * 0.25) + i * 0.5

    fill()
    i = np.arange(n, dtype=np.float64)
    np.testing.assert_allclose(x.to_numpy(), np.sin(i * 0.25) + i * 0.5, rtol=rtol, atol=rtol)
    assert x.to_numpy().dtype == npfp


def test_func_is_inlined_and_returns_value(ti, fp, rtol):
    @ti.func
    def square(v):
        return v * v

    @ti.func
    def poly(v):
        # funcs calling funcs, several levels deep
        return square(v) + 2.0 * v + 1.0

    @ti.func
    def poly_of_poly(v):
        return poly(poly(v)) - square(v)

    n = 10
    x = ti.field(float, shape=n)
    y = ti.field(float, shape=n)

    @ti.kernel
    def run():
        for i in x:
            y[i] = poly_of_poly(x[i])

    xs = np.linspace(-2.0, 2.0, n)
    x.from_numpy(xs)
    run()
    p = xs**2 + 2 * xs + 1
    np.testing.assert_allclose(y.to_numpy(), p**2 + 2 * p + 1 - xs**2, rtol=10 * rtol, atol=rtol)


def test_func_with_several_arguments_and_local_state(ti):
    @ti.func
    def clamp_sum(a, b, hi):
        s = a + b
        if s > hi:
            s = hi
        return s

    @ti.kernel
    def run(a: ti.i32, b: ti.i32) -> ti.i32:
        return clamp_sum(a, b, 10) * 100 + clamp_sum(b, a, 1000)

    assert run(3, 4) == 7 * 100 + 7
    assert run(30, 4) == 10 * 100 + 34


def test_func_without_return_mutates_field(ti):
    x = ti.field(ti.i32, shape=5)

    @ti.func
    def bump(i, amount):
        x[i] += amount

    @ti.kernel
    def run():
        for i in range(5):
            bump(i, i * i)
            bump(i, 1)

    run()
    np.testing.assert_array_equal(x.to_numpy(), np.arange(5) ** 2 + 1)


def test_scalar_argument_types_keep_their_precision(ti):
    @ti.kernel
    def combine(a: ti.i32, b: ti.i64, c: ti.f32, d: ti.f64) -> ti.f64:
        return ti.cast(a, ti.f64) + ti.cast(b, ti.f64) + ti.cast(c, ti.f64) + d

    big = 3 * 2**40
    got = combine(-7, big, 0.1, 1e-9)
    assert got == -7 + big + float(np.float32(0.1)) + 1e-9

    @ti.kernel
    def echo_i64(b: ti.i64) -> ti.i64:
        return b + 1

    assert echo_i64(2**40) == 2**40 + 1

    @ti.kernel
    def echo_f64(d: ti.f64) -> ti.f64:
        return d

    assert echo_f64(1.0 + 1e-15) == 1.0 + 1e-15

    @ti.kernel
    def echo_f32(c: ti.f32) -> ti.f64:
        return c

    assert echo_f32(0.1) == float(np.float32(0.1))


def test_python_float_and_int_annotations_follow_default_types(ti, fp, npfp):
    @ti.kernel
    def echo_float(a: float) -> float:
        return a

    @ti.kernel
    def echo_int(a: int) -> int:
        return a * 3

    assert echo_float(0.1) == float(npfp(0.1))
    assert echo_int(-41) == -123


def test_kernel_return_types(ti):
    @ti.kernel
    def ret_f32(a: ti.f32) -> ti.f32:
        return a * 0.5

    @ti.kernel
    def ret_float(a: ti.f32) -> float:
        return a + 0.25

    @ti.kernel
    def ret_i32(a: ti.i32, b: ti.i32) -> ti.i32:
        return a * b - 1

    r = ret_f32(3.0)
    assert r == 1.5 and isinstance(r, float)
    assert ret_float(1.0) == 1.25
    r = ret_i32(6, 7)
    assert r == 41 and isinstance(r, int)


def test_return_value_is_converted_to_declared_type(ti):
    @ti.kernel
    def float_to_int(a: ti.f32) -> ti.i32:
        return a  # truncated toward zero

    @ti.kernel
    def int_to_float(a: ti.i32) -> ti.f32:
        return a

    assert float_to_int(2.7) == 2
    assert float_to_int(-2.7) == -2
    r = int_to_float(7)
    assert r == 7.0 and isinstance(r, float)


def test_kernel_with_serial_top_level_code_and_return(ti, fp, rtol):
    @ti.kernel
    def harmonic(n: ti.i32) -> float:
        s = 0.0
        k = 1
        while k <= n:
            s += 1.0 / k
            k += 1
        return s

    for n in (1, 10, 100):
        want = sum(1.0 / k for k in range(1, n + 1))
        np.testing.assert_allclose(harmonic(n), want, rtol=10 * rtol)


def test_template_argument_accepts_different_fields(ti, fp, npfp, rtol):
    a = ti.field(float, shape=8)
    b = ti.field(float, shape=(3, 4))

    @ti.kernel
    def scale(f: ti.template(), s: float):
        for idx in ti.grouped(f):
            f[idx] = f[idx] * s + 1.0

    a_np = np.linspace(0, 1, 8)
    b_np = np.arange(12, dtype=np.float64).reshape(3, 4)
    a.from_numpy(a_np)
    b.from_numpy(b_np)
    scale(a, 2.0)
    scale(b, -0.5)
    scale(a, 3.0)
    np.testing.assert_allclose(a.to_numpy(), (a_np * 2 + 1) * 3 + 1, rtol=rtol)
    np.testing.assert_allclose(b.to_numpy(), b_np * -0.5 + 1.0, rtol=rtol)


def test_template_argument_in_func(ti):
    x = ti.field(ti.i32, shape=4)
    y = ti.field(ti.i32, shape=4)

    @ti.func
    def total(f: ti.template()) -> ti.i32:
        s = 0
        for i in range(4):
            s += f[i]
        return s

    @ti.kernel
    def run() -> ti.i32:
        return total(x) * 10 + total(y)

    x.from_numpy(np.array([1, 2, 3, 4], dtype=np.int32))
    y.from_numpy(np.array([5, 0, 0, 1], dtype=np.int32))
    assert run() == 106


def test_ndarray_argument_is_modified_in_place(ti, fp, npfp, rtol):
    @ti.kernel
    def axpy(a: float, x: ti.types.ndarray(), y: ti.types.ndarray()):
        for i in range(x.shape[0]):
            y[i] += a * x[i]

    x = np.linspace(-1, 1, 7).astype(npfp)
    y = np.arange(7).astype(npfp)
    y_before = y.copy()
    y_id = id(y)
    axpy(2.5, x, y)
    assert id(y) == y_id
    np.testing.assert_allclose(y, y_before + 2.5 * x.astype(np.float64), rtol=rtol)
    np.testing.assert_array_equal(x, np.linspace(-1, 1, 7).astype(npfp))


def test_ndarray_argument_2d_int_and_shape(ti):
    @ti.kernel
    def mark(a: ti.types.ndarray()) -> ti.i32:
        count = 0
        for i, j in ti.ndrange(a.shape[0], a.shape[1]):
            a[i, j] = i * 100 + j
            count += 1
        return count

    arr = np.zeros((3, 5), dtype=np.int32)
    assert mark(arr) == 15
    i, j = np.meshgrid(np.arange(3), np.arange(5), indexing="ij")
    np.testing.assert_array_equal(arr, i * 100 + j)


def test_ndarray_argument_with_dtype_and_ndim(ti):
    @ti.kernel
    def double(a: ti.types.ndarray(dtype=ti.f32, ndim=1)):
        for i in a:
            a[i] *= 2.0

    arr = np.array([1.5, -2.0, 3.25], dtype=np.float32)
    double(arr)
    np.testing.assert_array_equal(arr, np.array([3.0, -4.0, 6.5], dtype=np.float32))


def test_same_kernel_called_repeatedly_with_new_arguments(ti):
    acc = ti.field(ti.i32, shape=())

    @ti.kernel
    def add(v: ti.i32):
        acc[None] += v

    for v in range(1, 11):
        add(v)
    assert acc[None] == 55


def test_scalar_arguments_of_the_wrong_kind_are_refused(ti):
    """An integer parameter takes integers only (a float would be truncated silently); no
    parameter takes a string (NumPy would parse it)."""

    @ti.kernel
    def echo_int(n: ti.i32) -> ti.i32:
        return n

    @ti.kernel
    def echo_float(x: ti.f32) -> ti.f32:
        return x

    assert echo_int(np.int64(7)) == 7 and echo_int(True) == 1
    assert echo_float(3) == 3.0 and echo_float(np.float32(0.5)) == 0.5
    for bad in (2.7, 3.0, "3"):
        with pytest.raises(TypeError):
            echo_int(bad)
    with pytest.raises(TypeError):
        echo_float(np.array([2.0]))


@pytest.mark.difftape_only
def test_vector_and_matrix_arguments_must_have_the_parameters_shape(ti):
    @ti.kernel
    def weigh(v: ti.math.vec3) -> ti.f32:
        return v[0] + 10 * v[1] + 100 * v[2]

    @ti.kernel
    def corner(m: ti.math.mat2) -> ti.f32:
        return m[0, 1] + 10 * m[1, 0]

    assert weigh([1, 2, 3]) == 321 and weigh(np.array([1.0, 2.0, 3.0])) == 321
    assert corner(ti.Matrix([[1, 2], [3, 4]])) == 32 and corner([[1, 2], [3, 4]]) == 32
    for bad in ([1, 2, 3, 4], [1, 2], ti.Vector([1, 2, 3, 4]), 1.0, [[1], [2], [3]]):
        with pytest.raises(ti.ArgumentError, match=r"argument 1 must be a vector/matrix"):
            weigh(bad)
    # A 3x3 matrix used to be read as a flat list of entries (giving 2, not 32).
    for bad in (ti.Matrix([[1, 2, 0], [3, 4, 0], [0, 0, 0]]), [1, 2, 3, 4]):
        with pytest.raises(ti.ArgumentError, match=r"shape \(2, 2\)"):
            corner(bad)
    with pytest.raises(ti.ArgumentError, match="must be a number"):
        weigh(["a", "b", "c"])


def test_data_oriented_class_kernels_and_funcs(ti, fp, npfp, rtol):
    @ti.data_oriented
    class Springs:
        def __init__(self, n, k):
            self.n, self.k = n, k
            self.x = ti.field(float, shape=n, needs_grad=True)
            self.energy = ti.field(float, shape=(), needs_grad=True)

        @ti.func
        def stretch(self, i):
            return self.x[i + 1] - self.x[i]

        @ti.func
        def spring(self, i):  # a func calling a func on self
            return 0.5 * self.k * self.stretch(i) ** 2

        @ti.kernel
        def place(self, scale: float):
            for i in self.x:
                self.x[i] = scale * i * i

        @ti.kernel
        def compute(self):
            for i in range(self.n - 1):
                self.energy[None] += self.spring(i)

        @ti.kernel
        def total(self) -> float:
            t = 0.0
            for i in self.x:
                t += self.x[i]
            return t

        @staticmethod
        @ti.kernel
        def twice(a: float) -> float:
            return a * 2

    a, b = Springs(5, 2.0), Springs(3, 3.0)
    a.place(0.5)
    b.place(1.0)
    xa, xb = 0.5 * np.arange(5.0) ** 2, np.arange(3.0) ** 2
    np.testing.assert_allclose(a.x.to_numpy(), xa, rtol=rtol)
    np.testing.assert_allclose([a.total(), b.total()], [xa.sum(), xb.sum()], rtol=rtol)
    assert a.twice(1.5) == 3.0
    with ti.ad.Tape(a.energy):
        a.compute()
    d = np.diff(xa)
    np.testing.assert_allclose(a.energy[None], (0.5 * 2.0 * d ** 2).sum(), rtol=rtol)
    expect = np.zeros(5)
    expect[1:] += 2.0 * d
    expect[:-1] -= 2.0 * d
    np.testing.assert_allclose(a.x.grad.to_numpy(), expect, rtol=rtol)
    # kernel.grad of a bound kernel is bound too
    b.energy.grad[None] = 1.0
    b.compute()
    b.compute.grad()
    db = np.diff(xb)
    expect = np.zeros(3)
    expect[1:] += 3.0 * db
    expect[:-1] -= 3.0 * db
    np.testing.assert_allclose(b.x.grad.to_numpy(), expect, rtol=rtol)


def test_data_oriented_object_as_template_argument(ti):
    @ti.data_oriented
    class Inner:
        def __init__(self):
            self.v = ti.field(ti.i32, shape=4)

    @ti.data_oriented
    class Outer:
        def __init__(self):
            self.inner = Inner()
            self.offset = 10

        @ti.kernel
        def fill(self, step: ti.i32):
            for i in self.inner.v:
                self.inner.v[i] = self.offset + step * i

    @ti.kernel
    def bump(o: ti.template()):
        for i in o.inner.v:
            o.inner.v[i] += 1

    o = Outer()
    o.fill(3)
    bump(o)
    np.testing.assert_array_equal(o.inner.v.to_numpy(), 11 + 3 * np.arange(4))


def test_kernel_method_of_an_undecorated_class_is_refused(ti):
    class Plain:
        def __init__(self):
            self.x = ti.field(ti.f32, shape=2)

        @ti.kernel
        def run(self):
            for i in self.x:
                self.x[i] = 1

    with pytest.raises(ti.TaichiSyntaxError, match="data_oriented"):
        Plain().run()


def test_ti_ref_parameters_write_the_callers_variable(ti):
    @ti.real_func
    def set7(a: ti.ref(ti.f32)):
        a = 7  # noqa: F841 - writes the caller's variable

    @ti.real_func
    def double(a: ti.ref(ti.f32)):
        a += a

    @ti.kernel
    def run() -> ti.f32:
        a = 5.0
        set7(a)
        b = 5.0
        double(b)
        return a * 100 + b

    assert run() == 710.0


@pytest.mark.difftape_only
def test_ti_ref_beyond_taichi(ti):
    # Taichi 1.7.4 copies a ti.ref argument of an inlined @ti.func and aborts on a field
    # element; difftape binds the place in both cases. A value is refused.
    x = ti.field(ti.f32, shape=3)

    @ti.func
    def inc(a: ti.ref(ti.f32)):
        a += 1

    @ti.kernel
    def run() -> ti.f32:
        c = 5.0
        inc(c)
        inc(x[1])
        return c

    assert run() == 6.0 and x[1] == 1.0

    @ti.kernel
    def by_value():
        inc(3.0)

    with pytest.raises(ti.CompileError, match="pass a variable or a field element"):
        by_value()

    @ti.kernel
    def wrong_type():
        n = 1
        inc(n)

    with pytest.raises(ti.TaichiTypeError, match=r"ti.ref\(f32\) but the variable holds i32"):
        wrong_type()


@pytest.mark.difftape_only
def test_shapeless_vector_annotations(ti):
    # Taichi 1.7.4 refuses both; difftape takes any size in funcs and refuses kernels clearly.
    @ti.func
    def total(v: ti.types.vector(), m: ti.types.matrix()):
        return v.sum() + m.sum()

    @ti.kernel
    def run() -> ti.f32:
        return total(ti.Vector([1.0, 2.0]), ti.Matrix([[1.0, 2.0], [3.0, 4.0]])) + \
            total(ti.Vector([1.0, 2.0, 3.0]), ti.Matrix([[1.0]]))

    assert run() == 20.0

    @ti.kernel
    def k(v: ti.types.vector()) -> ti.f32:
        return v.sum()

    with pytest.raises(ti.CompileError, match="without its size"):
        k(ti.Vector([1.0, 2.0]))


def test_kernel_calls_that_do_not_fit_the_parameters_are_refused_by_name(ti):
    """Too many, missing, unknown and repeated arguments: a syntax error naming the problem in
    Taichi's words (a missing keyword was passed on as None and reported as a bad value)."""
    @ti.kernel
    def foo(a: ti.i32, b: ti.i32) -> ti.i32:
        return a + b * 10

    cases = [
        (lambda: foo(b=2), r"Parameter `a : i32` missing"),
        (lambda: foo(1), r"Parameter `b : i32` missing"),
        (lambda: foo(1, 2, c=2), r"Unexpected argument 'c'"),
        (lambda: foo(1, 2, 3), r"Too many arguments"),
    ]
    for call, msg in cases:
        with pytest.raises(ti.TaichiSyntaxError, match=msg):
            call()
    assert foo(1, b=5) == 51 and foo(b=2, a=3) == 23


def test_func_calls_that_do_not_fit_the_parameters_are_refused_by_name(ti):
    @ti.func
    def foo(a, b, c=0):
        return a + b * 10 + c * 100

    @ti.kernel
    def missing() -> ti.i32:
        return foo(1, c=3)

    @ti.kernel
    def not_found() -> ti.i32:
        return foo(1, 2, 3, d=3)

    @ti.kernel
    def many() -> ti.i32:
        return foo(1, 2, 3, 4)

    @ti.kernel
    def duplicate() -> ti.i32:
        return foo(1, a=3, b=3)

    @ti.kernel
    def fits() -> ti.i32:
        return foo(1, c=3, b=2)

    for k, msg in ((missing, r"Parameter `b` missing"), (not_found, r"Unexpected argument 'd'"),
                   (many, r"Too many arguments"),
                   (duplicate, r"Multiple values for argument 'a'")):
        with pytest.raises(ti.TaichiSyntaxError, match=msg):
            k()
    assert fits() == 321


def test_real_func_needs_annotations(ti):
    """@ti.real_func, as Taichi checks it: every parameter annotated (when defined), a return
    annotation when it returns a value (when compiled); annotated, it computes as a func."""
    with pytest.raises(ti.TaichiSyntaxError, match="parameter `a` must be type annotated"):
        @ti.real_func
        def untyped(a, b: ti.i32) -> ti.i32:
            return a + b

    @ti.real_func
    def no_return_type(a: ti.i32, b: ti.i32):
        return a + b

    @ti.real_func
    def add(a: ti.i32, b: ti.f32) -> ti.f32:
        return a + b

    @ti.kernel
    def run_untyped_return():
        no_return_type(30, 2)

    @ti.kernel
    def run() -> ti.f32:
        return add(30, 2.5)

    with pytest.raises(ti.TaichiSyntaxError, match="return value must be annotated"):
        run_untyped_return()
    assert run() == 32.5


def test_func_annotation_is_checked_when_the_func_is_defined(ti):
    """An annotation that names nothing (or is no type) is refused at the `def`, as Taichi
    does, not at the first call."""
    with pytest.raises(ti.TaichiSyntaxError, match="Invalid type annotation"):
        @ti.func
        def func(x: "foo"):  # noqa: F821
            print(x)

    with pytest.raises(ti.TaichiSyntaxError, match="Invalid type annotation"):
        @ti.func
        def func2(x: 3):
            print(x)

    with pytest.raises(ti.TaichiSyntaxError, match="annotation"):
        @ti.kernel
        def kernel(x: "bar"):  # noqa: F821
            print(x)


def test_func_recursion_on_compile_time_arguments(ti):
    @ti.func
    def power(x, n: ti.template()):
        r = 1.0
        if ti.static(n > 0):
            r = x * power(x, n - 1)
        return r

    @ti.kernel
    def run(x: ti.f32) -> ti.f32:
        return power(x, 10)

    np.testing.assert_allclose(run(1.5), 1.5**10, rtol=1e-6)


@pytest.mark.difftape_only  # Taichi compiles a real func as a function that calls itself
def test_real_func_recursion_is_refused(ti):
    # Taichi's test_function.py::test_recursion/test_deep_recursion: difftape inlines funcs.
    @ti.real_func
    def sum_to(n: ti.i32) -> ti.i32:
        if n == 0:
            return 0
        return sum_to(n - 1) + n

    @ti.kernel
    def run(n: ti.i32) -> ti.i32:
        return sum_to(n)

    with pytest.raises(ti.TaichiSyntaxError, match="'sum_to' calls itself: recursion is not "
                                                   "supported"):
        run(100)


@pytest.mark.difftape_only  # Taichi: Python's RecursionError
def test_endless_func_recursion_is_refused(ti):
    @ti.func
    def down(n):
        return down(n - 1) + 1

    @ti.kernel
    def run(n: ti.i32) -> ti.i32:
        return down(n)

    with pytest.raises(ti.TaichiSyntaxError, match="funcs are nested more than"):
        run(3)
def test_assignment_expression_binds_and_gives_its_value(ti):
    # Taichi's poisson_disk_sampling.py: samples[0] = (p0 := mouse[None])
    mouse = ti.Vector.field(2, ti.f32, shape=())
    samples = ti.Vector.field(2, ti.f32, shape=2)
    mouse[None] = [0.25, 0.5]

    @ti.kernel
    def start() -> ti.f32:
        samples[0] = (p0 := mouse[None])
        samples[1] = p0 * 2
        if (n := 3) > 2:
            n += 1
        return n + p0.x

    assert start() == 4.25
    np.testing.assert_array_equal(samples.to_numpy(), [[0.25, 0.5], [0.5, 1.0]])
