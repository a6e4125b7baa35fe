"""Python values captured by kernels at compile time, and ti.static."""

import numpy as np
import pytest

SCALE = 3.0
OFFSETS = (1, 10, 100)
WEIGHTS = (0.5, 0.25, 2.0)
ENABLE_BONUS = True
_global_field = None  # assigned by a test, read by a kernel as a module-level global


def triple_plus_one(v):
    return v * SCALE + 1


triple_plus_one_func = None  # wrapped with ti.func by the test that needs it


def test_module_level_numbers_and_tuples(ti):
    @ti.kernel
    def run() -> ti.f32:
        s = SCALE * OFFSETS[2]
        for k in ti.static(range(3)):
            s += WEIGHTS[k] * OFFSETS[k]
        return s

    want = 3.0 * 100 + 0.5 * 1 + 0.25 * 10 + 2.0 * 100
    assert run() == want


def test_global_number_is_frozen_at_first_compile(ti):
    global SCALE

    @ti.kernel
    def run() -> ti.f32:
        return SCALE * 2

    old = SCALE
    try:
        assert run() == 6.0
        SCALE = 100.0
        assert run() == 6.0  # already compiled: the captured constant does not change
    finally:
        SCALE = old


def test_module_level_field(ti):
    global _global_field
    _global_field = ti.field(ti.i32, shape=6)

    @ti.kernel
    def fill():
        for i in _global_field:
            _global_field[i] = i * OFFSETS[1]

    try:
        fill()
        np.testing.assert_array_equal(_global_field.to_numpy(), np.arange(6) * 10)
    finally:
        _global_field = None


def test_module_level_func(ti):
    global triple_plus_one_func
    triple_plus_one_func = ti.func(triple_plus_one)

    @ti.kernel
    def run(v: ti.f32) -> ti.f32:
        return triple_plus_one_func(v)

    try:
        assert run(2.0) == 7.0
    finally:
        triple_plus_one_func = None


def test_closure_variables_of_kernels_made_in_a_function(ti):
    def make(coefficient, field):
        @ti.kernel
        def k(v: ti.i32) -> ti.i32:
            field[None] += v
            return coefficient * v + field[None]

        return k

    a = ti.field(ti.i32, shape=())
    b = ti.field(ti.i32, shape=())
    twice = make(2, a)
    tenfold = make(10, b)
    assert twice(5) == 15
    assert tenfold(5) == 55
    assert twice(1) == 2 + 6
    assert (a[None], b[None]) == (6, 5)


def test_closure_func_and_tuple(ti):
    offsets = (3, -1)

    @ti.func
    def shifted(v):
        return v + offsets[0] + offsets[1]

    @ti.kernel
    def run(v: ti.i32) -> ti.i32:
        return shifted(shifted(v))

    assert run(1) == 5


def test_static_if_selects_branch_at_compile_time(ti):
    def make(flag):
        @ti.kernel
        def k() -> ti.i32:
            r = 0
            if ti.static(flag):
                r = 1
            else:
                r = 2
            return r

        return k

    assert make(True)() == 1
    assert make(False)() == 2


def test_static_if_does_not_compile_the_dead_branch(ti):
    @ti.kernel
    def k() -> ti.i32:
        r = 7
        if ti.static(not ENABLE_BONUS):
            r = this_name_does_not_exist(r)  # noqa: F821 - never compiled
        elif ti.static(ENABLE_BONUS):
            r += 1
        return r

    assert k() == 8


def test_static_range_is_unrolled_with_constant_index(ti, fp, rtol):
    v = ti.Vector.field(4, float, shape=())

    @ti.kernel
    def run() -> float:
        s = 0.0
        for i in ti.static(range(4)):
            v[None][i] = i * i + 0.5
            s += v[None][i] * (i + 1)
        return s

    got = run()
    want = sum((i * i + 0.5) * (i + 1) for i in range(4))
    np.testing.assert_allclose(got, want, rtol=rtol)
    np.testing.assert_allclose(v[None].to_numpy(), [0.5, 1.5, 4.5, 9.5], rtol=rtol)


def test_static_loop_over_tuple_of_fields(ti):
    a = ti.field(ti.i32, shape=4)
    b = ti.field(ti.i32, shape=4)
    c = ti.field(ti.i32, shape=4)

    @ti.kernel
    def run():
        for i in range(4):
            for f in ti.static((a, b, c)):
                f[i] += i
        for k, f in ti.static(enumerate((a, b, c))):
            for i in range(4):
                f[i] *= k + 1

    run()
    base = np.arange(4)
    np.testing.assert_array_equal(a.to_numpy(), base)
    np.testing.assert_array_equal(b.to_numpy(), base * 2)
    np.testing.assert_array_equal(c.to_numpy(), base * 3)


def test_break_and_continue_of_static_loops_act_while_unrolling(ti):
    x = ti.field(ti.i32, shape=(4, 6))

    @ti.kernel
    def run():
        for i in range(4):  # a parallel loop around unrolled ones
            for j in ti.static(range(6)):
                if ti.static(j == 1):
                    continue  # skips this unrolled iteration only
                if ti.static(j == 4):
                    break  # stops unrolling; the runtime loop goes on
                x[i, j] += 1
            for j in ti.static(range(6)):
                for k in range(2):  # `continue` of a runtime loop inside a static one
                    if k == 0:
                        continue
                    x[i, j] += 10 * k
            while True:
                for j in ti.static(range(3)):
                    if ti.static(j == 2):
                        break
                    x[i, j] += 100
                break

    run()
    row = np.array([111, 110, 11, 11, 10, 10])
    np.testing.assert_array_equal(x.to_numpy(), np.tile(row, (4, 1)))


def test_break_of_a_static_loop_under_a_runtime_if_is_refused(ti):
    x = ti.field(ti.i32, shape=4)

    @ti.kernel
    def breaks():
        for i in range(4):
            for j in ti.static(range(4)):
                if i == j:
                    break
                x[j] += 1

    @ti.kernel
    def continues():
        for i in range(4):
            for j in ti.static(range(4)):
                if i == j:
                    continue
                x[j] += 1

    for k in (breaks, continues):
        with pytest.raises(ti.TaichiSyntaxError):
            k()


def test_template_int_argument_drives_static_range(ti):
    @ti.kernel
    def power_sum(n: ti.template(), base: ti.i32) -> ti.i32:
        s = 0
        p = 1
        for _ in ti.static(range(n)):
            p *= base
            s += p
        return s

    assert power_sum(3, 2) == 2 + 4 + 8
    assert power_sum(5, 3) == 3 + 9 + 27 + 81 + 243


def test_list_comprehension_is_unrolled_at_compile_time(ti, fp, rtol):
    x = ti.field(float, shape=4)

    @ti.kernel
    def run(a: float) -> float:
        v = ti.Vector([a * i for i in range(3)])
        s = v[0] + v[1] * 10 + v[2] * 100
        for j in range(4):
            w = ti.Vector([x[(j + i) % 4] for i in range(2)])
            s += w[0] * 1000 + w[1]
        return s

    xs = np.array([0.5, 1.0, 2.0, 4.0])
    x.from_numpy(xs)
    want = 2.0 * 10 + 4.0 * 100 + sum(xs[j] * 1000 + xs[(j + 1) % 4] for j in range(4))
    np.testing.assert_allclose(run(2.0), want, rtol=rtol)


def test_comprehensions_over_matrices_and_dict_comprehensions(ti):
    """A comprehension iterates a vector's entries and a matrix's rows (as a ti.static loop);
    dict comprehensions and ``**`` in dict displays build compile-time dicts."""
    @ti.kernel
    def run(a: ti.i32) -> ti.i32:
        m = ti.Matrix([[a, 2 * a, 3], [4, 5, 6]])
        firsts = [row[0] for row in m]
        flat = [e for row in m for e in row]
        odd = {i: i * i for i in range(7) if i % 2 if i != 3}
        both = {0: 100, **odd}
        return firsts[0] * 10000 + firsts[1] * 1000 + flat[1] * 100 + flat[5] + \
            both[0] + both[5] + both[1] + len(both)

    # a*10000 + 4*1000 + 2a*100 + 6 + 100 + 25 + 1 + len({0, 1, 5})
    assert run(1) == 10000 + 4000 + 200 + 6 + 100 + 25 + 1 + 3
    assert run(3) == 30000 + 4000 + 600 + 6 + 100 + 25 + 1 + 3

    @ti.kernel
    def missing(k: ti.template()) -> ti.i32:
        d = {i: i for i in range(3)}
        return d[k]

    assert missing(2) == 2
    with pytest.raises(ti.TaichiCompilationError):
        missing(5)


def test_static_assert_and_static_print_run_at_compile_time(ti, capsys):
    x = ti.field(ti.i32, shape=4)

    @ti.kernel
    def fill(n: ti.template()):
        ti.static_print("compiling fill for n =", n)
        ti.static_assert(n <= x.shape[0], "n must fit the field")
        for i in range(n):
            x[i] = i + 1

    fill(3)
    fill(3)  # cached: no second compile, no second print
    np.testing.assert_array_equal(x.to_numpy(), [1, 2, 3, 0])
    assert capsys.readouterr().out.count("compiling fill for n = 3") == 1
    error = getattr(ti, "CompileError", None) or ti.TaichiCompilationError
    with pytest.raises(error, match="n must fit the field"):
        fill(5)


def test_static_assert_refuses_a_runtime_condition(ti):
    @ti.kernel
    def check(a: ti.i32):
        ti.static_assert(a > 0)

    with pytest.raises(ti.TaichiTypeError, match="Static assert with non-static condition"):
        check(1)

    @ti.kernel
    def local_variable():  # Taichi's test_assert.py::test_static_assert_nonstatic_condition
        value = False
        ti.static_assert(value, "Oh, no!")

    with pytest.raises(ti.TaichiTypeError, match="Static assert with non-static condition"):
        local_variable()


def test_numpy_arithmetic_on_compile_time_arrays(ti):
    # A global NumPy array in arithmetic inside a kernel is evaluated at compile time, as in
    # Taichi (Taichi's implicit FEM test loops over ti.ndrange(*(n_cube - 1))).
    n_cube = np.array([3, 4, 2])
    out = ti.field(ti.i32, shape=())

    @ti.kernel
    def count():
        for p in ti.grouped(ti.ndrange(*(n_cube - 1))):
            out[None] += p.x * (n_cube * 2)[1] + p.y

    count()
    want = sum(i * 8 + j for i in range(2) for j in range(3))
    assert out[None] == want


def test_arithmetic_on_a_global_numpy_array_is_numpys(ti):
    """`n_cube - 1` of a global NumPy array inside a kernel (test_implicit_fem): evaluated at
    compile time as NumPy evaluates it, then used as loop bounds and constants."""
    n_cube = np.array([3, 4, 2])
    out = ti.field(ti.i32, shape=(2, 3, 1))

    @ti.kernel
    def cells():
        for idx in ti.grouped(ti.ndrange(*(n_cube - 1))):
            out[idx] = (idx.x * (n_cube[1] - 1) + idx.y) * (n_cube[2] - 1) + idx.z + (n_cube * 2)[0]

    cells()
    i, j, k = np.indices((2, 3, 1))
    np.testing.assert_array_equal(out.to_numpy(), (i * 3 + j) * 1 + k + 6)


def test_static_assignment_binds_a_compile_time_name(ti):
    """`n = ti.static(v)` names v itself (no kernel variable), as in Taichi: it drives
    ti.static loops, indexes a NumPy array at compile time, and can name a field."""
    table = (5, 7, 11)
    x = ti.field(ti.i32, shape=4)

    @ti.kernel
    def fill():
        n = ti.static(3)
        arr = ti.static(table)
        f = ti.static(x)
        a, b = ti.static(100, 1000)
        for k in ti.static(range(n)):
            f[k] = arr[k] * a + b
        f[n] = n

    fill()
    np.testing.assert_array_equal(x.to_numpy(), [*(np.array(table) * 100 + 1000), 3])


@pytest.mark.parametrize("body, message", [
    ("a = 1\n    a = ti.static(2)", "Recreating variables is not allowed"),
    ("a = ti.static([1, 2, 3])\n    a[0] = ti.static(2)",
     "Static assign cannot be used on elements in arrays"),
    ("for i in ti.static(ti.static(range(1))):\n        pass", "'ti.static' cannot be nested"),
])
def test_static_assignment_misuse_is_refused(ti, tmp_path, body, message):
    """As Taichi refuses them: a static binding of a name the block already has, of an
    element, and ti.static inside ti.static."""
    path = tmp_path / "static_misuse.py"
    path.write_text(f"@ti.kernel\ndef k():\n    {body}\n")
    namespace = {"ti": ti}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    with pytest.raises(ti.TaichiSyntaxError, match=message):
        namespace["k"]()


def test_names_made_in_a_compile_time_if_end_with_it(ti):
    """Every if body is a block (as in Taichi): a name it makes is gone after it, with a
    Python-constant or ti.static condition as with a runtime one."""
    @ti.kernel
    def plain():
        if True:
            a = 0
        else:
            a = 1
        print(a)

    @ti.kernel
    def static_if():
        if ti.static(True):
            b = 2
        print(b)

    for kernel in (plain, static_if):
        with pytest.raises(ti.TaichiNameError, match="is not defined"):
            kernel()


def test_assigning_a_compile_time_name_of_an_enclosing_block_is_refused(ti):
    """`a = ti.static(2)` then `a = 5` inside a runtime if: a new binding there would end with
    the if (after it `a` would be 2 again): refused, as Taichi refuses it."""
    x = ti.field(ti.i32, shape=())

    @ti.kernel
    def k():
        a = ti.static(2)
        if x[None] > 0:
            a = 5
        x[None] = a

    with pytest.raises(ti.TaichiSyntaxError, match="cannot be assigned"):
        k()


def test_numpy_array_as_a_kernel_variable_is_refused(ti):
    """`a = np.array([1])` in a kernel: not a kernel value (Taichi refuses it too); a 0-d array
    is a number."""
    out = ti.field(ti.f64, shape=())

    @ti.kernel
    def bad():
        a = np.array([1])  # noqa: F841

    @ti.kernel
    def zero_d():
        a = np.array(2.5)
        out[None] = a

    with pytest.raises(ti.TaichiTypeError, match="Only 0-dimensional numpy array"):
        bad()
    zero_d()
    assert out[None] == 2.5
