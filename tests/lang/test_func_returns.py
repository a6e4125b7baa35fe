"""``return`` in funcs and kernels: early returns anywhere in a func, annotated return and
parameter types, kernels whose annotation promises a value.

Taichi 1.7.4 inlines ``@ti.func`` and refuses a ``return`` inside non-static ``if``/``for``/
``while`` ("Return inside non-static if/for is not supported"); difftape supports it (a func with
such a return that yields a value needs a return annotation, as Taichi's real funcs do). Those
tests are difftape-only; the truth is the same function run as plain Python.
"""

import numpy as np
import pytest

difftape_only = pytest.mark.difftape_only


# ------------------------------------------------------------------ returns in control flow


@difftape_only
def test_return_inside_while_loop_leaves_the_loop(ti):
    @ti.func
    def forever(i: ti.i32) -> ti.i32:
        while i:
            return 42
        return -1

    @ti.kernel
    def run(i: ti.i32) -> ti.i32:
        return forever(i)

    assert run(1) == 42
    assert run(0) == -1


def _first_above(xs, t):
    for i, v in enumerate(xs):
        if v > t:
            return i
    return -1


@difftape_only
def test_return_inside_range_for_in_a_parallel_loop(ti):
    n, m = 37, 12
    rng = np.random.default_rng(3)
    data = rng.random((n, m)).astype(np.float32)
    thresholds = np.linspace(0.5, 1.05, n).astype(np.float32)
    x = ti.field(ti.f32, shape=(n, m))
    t = ti.field(ti.f32, shape=n)
    out = ti.field(ti.i32, shape=n)
    x.from_numpy(data)
    t.from_numpy(thresholds)

    @ti.func
    def first_above(i, thr) -> ti.i32:
        for j in range(m):
            if x[i, j] > thr:
                return j
        return -1

    @ti.kernel
    def run():
        for i in range(n):
            out[i] = first_above(i, t[i])

    run()
    want = [_first_above(data[i], thresholds[i]) for i in range(n)]
    assert -1 in want and any(w > 0 for w in want)
    np.testing.assert_array_equal(out.to_numpy(), want)


def _nested(a, b):
    s = 0
    for i in range(a):
        k = 0
        while k < b:
            s += i * k
            if s > 40:
                return s * 10 + i
            k += 1
        s += 1
    return -s


@difftape_only
def test_return_from_nested_loops(ti):
    @ti.func
    def nested(a: ti.i32, b: ti.i32) -> ti.i32:
        s = 0
        for i in range(a):
            k = 0
            while k < b:
                s += i * k
                if s > 40:
                    return s * 10 + i
                k += 1
            s += 1  # skipped once the inner loop returned
        return -s

    @ti.kernel
    def run(a: ti.i32, b: ti.i32) -> ti.i32:
        return nested(a, b)

    for a, b in [(0, 3), (2, 2), (3, 4), (5, 5), (9, 7), (4, 30)]:
        assert run(a, b) == _nested(a, b), (a, b)


def _sign_name(v):
    if v > 0:
        return 1.5
    elif v < 0:
        return -2.5
    else:
        return 0.25


@difftape_only
def test_return_in_every_branch_without_a_final_return(ti):
    @ti.func
    def sign_name(v) -> ti.f32:
        if v > 0:
            return 1.5
        elif v < 0:
            return -2.5
        else:
            return 0.25

    @ti.kernel
    def run(v: ti.f32) -> ti.f32:
        return sign_name(v)

    for v in (3.0, -1.0, 0.0):
        assert run(v) == _sign_name(v)


@difftape_only
def test_return_inside_a_static_loop_stops_the_unrolled_iterations(ti):
    @ti.func
    def first_multiple(a: ti.i32) -> ti.i32:
        for k in ti.static(range(2, 6)):
            if a % k == 0:
                return k
        return 0

    @ti.kernel
    def run(a: ti.i32) -> ti.i32:
        return first_multiple(a)

    for a in (1, 4, 9, 15, 25, 49):
        want = next((k for k in range(2, 6) if a % k == 0), 0)
        assert run(a) == want, a


@difftape_only
def test_bare_return_leaves_a_void_func_early(ti):
    x = ti.field(ti.i32, shape=8)

    @ti.func
    def fill(i: ti.i32):
        x[i] = 1
        if i % 3 == 0:
            return
        x[i] = 2
        for k in range(i):
            if k == 4:
                return
        x[i] = 3

    @ti.kernel
    def run():
        for i in range(8):
            fill(i)

    run()
    want = [1 if i % 3 == 0 else (2 if i > 4 else 3) for i in range(8)]
    np.testing.assert_array_equal(x.to_numpy(), want)


@difftape_only
def test_return_value_of_vectors_and_tuples_from_branches(ti):
    @ti.func
    def pick(v: ti.f32) -> ti.types.vector(2, ti.f32):
        if v > 0:
            return ti.Vector([v, 2 * v])
        return ti.Vector([-v, 0.5])

    @ti.func
    def divmod_(a: ti.i32, b: ti.i32) -> (ti.i32, ti.i32):
        if b == 0:
            return 0, 0
        return a // b, a % b

    @ti.kernel
    def run(v: ti.f32, a: ti.i32, b: ti.i32) -> ti.types.vector(4, ti.f32):
        p = pick(v)
        q, r = divmod_(a, b)
        return ti.Vector([p[0], p[1], q, r])

    np.testing.assert_array_equal(run(1.5, 17, 5).to_numpy(), [1.5, 3.0, 3, 2])
    np.testing.assert_array_equal(run(-2.0, 17, 0).to_numpy(), [2.0, 0.5, 0, 0])


def test_return_inside_a_static_if(ti):
    # what Taichi allows: the branch is chosen at compile time and the rest is not compiled
    @ti.func
    def f(v, flag: ti.template()):
        if ti.static(flag):
            return v * 2
        return v + 100

    @ti.kernel
    def run(v: ti.i32) -> ti.i32:
        return f(v, True) + f(v, False)

    assert run(3) == 3 * 2 + 3 + 100


def test_bare_return_in_a_kernel(ti):
    x = ti.field(ti.i32, shape=2)

    @ti.kernel
    def run():
        x[0] = 1
        if ti.static(True):
            return
        x[1] = 2

    run()
    np.testing.assert_array_equal(x.to_numpy(), [1, 0])


@difftape_only
def test_runtime_return_needs_a_return_annotation(ti):
    @ti.func
    def f(v):
        if v > 0:
            return v
        return -v

    @ti.kernel
    def run(v: ti.f32) -> ti.f32:
        return f(v)

    with pytest.raises(ti.CompileError, match="annotat"):
        run(1.0)


@difftape_only
def test_func_that_does_not_return_on_every_path_is_checked_where_it_runs(ti):
    # Whether a return inside a runtime branch or loop runs is known only at run time: a
    # call that takes the path with the return gets its value; one that falls off the end is
    # a runtime error (Taichi gives whatever its return slot held), not a made-up value.
    @ti.func
    def f(v) -> ti.f32:
        if v > 0:
            return v

    @ti.kernel
    def run(v: ti.f32) -> ti.f32:
        return f(v)

    assert run(1.5) == 1.5
    with pytest.raises(ti.KernelAssertionError, match="reached the end of its body"):
        run(-1.0)


def test_real_func_returning_from_inside_a_loop(ti):
    # Taichi's test_function.py::test_return_in_for / test_return_in_while.
    @ti.real_func
    def first_square_above(n: ti.i32) -> ti.i32:
        for i in range(10):
            if i * i > n:
                return i * i

    @ti.real_func
    def forty_two() -> ti.i32:
        i = 1
        while i:
            return 42

    @ti.kernel
    def run(n: ti.i32) -> ti.i32:
        return first_square_above(n) + forty_two()

    for n in (0, 5, 80):
        assert run(n) == next(i * i for i in range(10) if i * i > n) + 42


@difftape_only
def test_real_func_whose_loop_returns_nothing_is_a_runtime_error(ti):
    @ti.real_func
    def first_square_above(n: ti.i32) -> ti.i32:
        for i in range(10):
            if i * i > n:
                return i * i

    @ti.kernel
    def run(n: ti.i32) -> ti.i32:
        return first_square_above(n)

    assert run(50) == 64
    with pytest.raises(ti.KernelAssertionError, match="first_square_above"):
        run(81)


@difftape_only
def test_return_in_a_kernel_loop_or_branch_is_an_error(ti):
    @ti.kernel
    def in_branch(v: ti.i32) -> ti.i32:
        if v > 0:
            return 1
        return 0

    @ti.kernel
    def in_loop() -> ti.i32:
        for i in range(3):
            return i
        return 0

    for k in (lambda: in_branch(1), in_loop):
        with pytest.raises(ti.CompileError, match="return"):
            k()


# ------------------------------------------------------------------ annotations


def test_func_return_annotation_casts(ti):
    @ti.func
    def half() -> ti.i32:
        return 1.5

    @ti.func
    def third(a: ti.f32) -> ti.f32:
        return a / 3

    @ti.kernel
    def run() -> ti.f32:
        return half() + third(2)

    np.testing.assert_allclose(run(), 1 + 2 / 3, rtol=1e-6)


def test_func_parameter_annotation_casts(ti):
    @ti.func
    def ident(a: ti.i32):
        return a

    @ti.func
    def bump(a: ti.i32):
        a = a + 0.5  # stays an i32 variable
        return a

    @ti.kernel
    def run(v: ti.f32) -> ti.f32:
        return ident(v) * 10 + bump(1)

    assert run(3.7) == 31.0


@difftape_only
def test_func_vector_annotations_cast_and_check_the_shape(ti):
    # Taichi 1.7.4 checks the shape of a vector parameter but not its dtype
    @ti.func
    def ints(a: ti.types.vector(2, ti.i32)) -> ti.types.vector(2, ti.i32):
        return a * 1.5

    @ti.kernel
    def run() -> ti.f32:
        r = ints(ti.Vector([1.5, 2.5]))
        return r[0] * 10 + r[1]

    assert run() == 13  # [1, 2] * 1.5 = [1.5, 3.0] -> [1, 3]

    @ti.kernel
    def wrong_shape() -> ti.f32:
        r = ints(ti.Vector([1.0, 2.0, 3.0]))
        return r[0]

    with pytest.raises(ti.CompileError, match="vector"):
        wrong_shape()

    @ti.kernel
    def scalar_for_vector() -> ti.f32:
        r = ints(1.0)
        return r[0]

    with pytest.raises(ti.CompileError):
        scalar_for_vector()


@difftape_only
def test_func_ndarray_parameter_needs_an_ndarray(ti):
    x = ti.field(ti.f32, shape=4)

    @ti.func
    def first(a: ti.types.ndarray()):
        return a[0]

    @ti.kernel
    def with_ndarray(a: ti.types.ndarray()) -> ti.f32:
        return first(a)

    @ti.kernel
    def with_field() -> ti.f32:
        return first(x)

    arr = ti.ndarray(ti.f32, shape=4)
    arr[0] = 2.5
    assert with_ndarray(arr) == 2.5
    with pytest.raises(ti.CompileError, match="ndarray"):
        with_field()


def test_real_func_given_an_ndarray_that_is_no_kernel_argument(ti):
    # Taichi's test_ndarray.py::test_pass_ndarray_outside_kernel_to_real_func.
    weight = ti.ndarray(dtype=ti.f32, shape=(2, 2, 2))

    @ti.real_func
    def bar(weight: ti.types.ndarray(ti.f32, ndim=3)) -> ti.f32:
        return weight[1, 1, 1]

    @ti.kernel
    def foo() -> ti.f32:
        return bar(weight)

    weight.fill(42.0)
    with pytest.raises(ti.TaichiTypeError,
                       match=r"Expected ndarray in the kernel argument for argument weight"):
        foo()


@difftape_only
def test_kernel_annotated_without_return_is_an_error(ti):
    @ti.kernel
    def no_return() -> ti.f32:
        x = 1.0  # noqa: F841

    @ti.kernel
    def static_path(v: ti.i32) -> ti.f32:
        if ti.static(False):
            return 1.0

    for k in (no_return, lambda: static_path(1)):
        with pytest.raises(ti.CompileError, match="return"):
            k()


def test_kernel_returning_bool(ti):
    # `-> bool` is Taichi's u1: the kernel returns 1 or 0 (Taichi's matrix-free CG tests
    # check their solutions this way).
    x = ti.field(ti.f32, shape=4)

    @ti.kernel
    def all_small(tol: ti.f32) -> bool:
        ok = True
        for i in x:
            if ti.abs(x[i]) >= tol:
                ok = False
        return ok

    x.from_numpy(np.array([0.1, -0.2, 0.05, 0.0], np.float32))
    assert all_small(0.5) == 1
    assert all_small(0.15) == 0


@pytest.mark.parametrize("spelling", ["literal", "builtin", "typing"])
def test_real_func_and_kernel_return_a_tuple(ti, spelling):
    # Taichi's test_return.py::test_real_func_tuple_ret, _39 and _typing_tuple.
    import typing

    s0 = ti.types.struct(a=ti.math.vec3, b=ti.i16)
    ret = {"literal": (ti.f32, s0, ti.math.ivec2), "builtin": tuple[ti.f32, s0, ti.math.ivec2],
           "typing": typing.Tuple[ti.f32, s0, ti.math.ivec2]}[spelling]  # noqa: UP006

    @ti.real_func
    def foo(x: ti.f32) -> ret:
        return x * 2, s0(a=ti.math.vec3([100, x, 3]), b=65537), ti.math.ivec2(7, -x)

    @ti.kernel
    def bar(x: ti.f32) -> ret:
        return foo(x)

    a, b, c = bar(0.25)
    assert a == 0.5
    np.testing.assert_allclose(np.array(b.a), np.float32([100, 0.25, 3]))
    assert b.b == 65537 - 65536  # i16 wraps, as a cast in C
    assert list(c) == [7, 0]
@pytest.mark.parametrize("decorator", [
    pytest.param("func", marks=difftape_only),  # Taichi 1.7.4's ti.func fails on the tuple
    "real_func"])
def test_typing_tuple_and_bool_return_annotations(ti, decorator):
    # Taichi's real_func examples: poisson_disk_sampling.py's find_nearest_point ->
    # typing.Tuple[float, vec2], cornell_box.py's raycast -> bool
    import typing

    deco = getattr(ti, decorator)

    @deco
    def nearest(p: ti.math.vec2) -> typing.Tuple[float, ti.math.vec2]:  # noqa: UP006
        return p.norm(), p * 2

    @deco
    def positive(x: ti.f32) -> bool:
        return x > 0

    @ti.kernel
    def run(x: ti.f32) -> ti.f32:
        d, q = nearest(ti.math.vec2(3, 4))
        r = d + q.y
        if positive(x):
            r += 100
        return r

    assert run(1.0) == 113.0
    assert run(-1.0) == 13.0


def test_a_scalar_dtype_annotation_casts_a_returned_vector(ti):
    # As in Taichi, a @ti.func's scalar return annotation is the dtype its value is cast to,
    # element by element for a vector (eulerfluid2d.py: vel_with_boundary(...) -> ti.f32
    # returns vf[i, j], a 2-vector).
    @ti.func
    def as_int(v) -> ti.i32:
        return v

    @ti.kernel
    def run() -> ti.f32:
        w = as_int(ti.Vector([1.5, 2.5]))
        return w[1] + w[0] * 10

    assert run() == 12.0


def test_experimental_real_func_is_real_func_with_a_deprecation_warning(ti):
    # Taichi's test_deprecation.py::test_deprecate_experimental_real_func
    with pytest.warns(DeprecationWarning, match=r"ti.experimental.real_func is deprecated .* "
                                                r"Use ti.real_func instead"):
        @ti.experimental.real_func
        def first_above(a: ti.i32) -> ti.i32:
            s = 0
            for i in range(100):
                if i == a + 1:
                    return s
                s = s + i
            return s

    @ti.kernel
    def run(a: ti.i32) -> ti.i32:
        return first_above(a)

    assert run(3) == 0 + 1 + 2 + 3


def test_a_template_return_annotation_returns_the_value_as_it_is(ti):
    # taichi-splatting's taichi_lib/generic.py: `def split_rt(rt: mat4) -> ti.template():
    # return rt[:3, :3], rt[:3, 3]`. Taichi casts an inlined func's value only to a dtype
    # annotation; any other is no conversion (this was refused: "unsupported return
    # annotation").
    mat4 = ti.types.matrix(4, 4, ti.f32)

    @ti.func
    def split_rt(rt: mat4) -> ti.template():
        return rt[:3, :3], rt[:3, 3]

    @ti.kernel
    def run() -> ti.f32:
        m = mat4([[i * 4 + j for j in range(4)] for i in range(4)])
        r, t = split_rt(m)
        return r[2, 1] * 100 + t[1] + r.sum() * 0.5

    want = 9 * 100 + 7 + (0 + 1 + 2 + 4 + 5 + 6 + 8 + 9 + 10) * 0.5
    assert run() == want


@difftape_only
def test_a_real_func_cannot_return_a_template(ti):
    # a real func is compiled apart: its value needs a type (Taichi: "The return type is not
    # supported now!")
    with pytest.raises(ti.CompileError, match="unsupported return annotation"):
        @ti.real_func
        def f(x: ti.f32) -> ti.template():
            return x
