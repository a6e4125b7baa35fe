# ruff: noqa: UP030, UP032, F523, F525  (kernels here test str.format itself)
"""print() inside kernels: Taichi's formats, sep/end, str.format and f-strings, every launch.

Kernels print through C's printf (file descriptor 1), so the tests read it with ``capfd``.
"""

import pytest


def test_print_scalars_strings_and_separators(ti, capfd):
    @ti.kernel
    def run(i: ti.i32, f: ti.f32, d: ti.f64, big: ti.i64, u: ti.u32):
        print(i, 1234.5, f)
        print("100% sure:", i, "and", f, sep="|", end="<\n")
        print(d, big, u, ti.i8(-5), ti.u8(200), True)
        print()
        print("a", end="")
        print("b")

    run(666, 233.3, 1.0 / 3.0, -(2**40), 4000000000)
    out, err = capfd.readouterr()
    assert out == ("666 1234.500000 233.300003\n"
                   "100% sure:|666|and|233.300003<\n"
                   "0.333333333333 -1099511627776 4000000000 -5 200 1\n"
                   "\n"
                   "ab\n")


def test_print_of_a_bool_cast(ti, capfd):
    # Taichi's test_print.py::test_print[bool]: a u1 prints as 1/0.
    @ti.kernel
    def run():
        print(ti.cast(123.4, bool), ti.cast(0.0, bool), ti.cast(-2, ti.u1))

    run()
    assert capfd.readouterr().out == "1 0 1\n"


@pytest.mark.difftape_only  # Taichi 1.7.4's LLVM lowering aborts on a runtime u1 in print
def test_print_of_a_runtime_u1(ti, capfd):
    @ti.kernel
    def run(x: ti.f32):
        b = ti.cast(x, ti.u1)
        print(b, f"[{b}]")

    run(0.0)
    run(2.5)
    assert capfd.readouterr().out == "0 [0]\n1 [1]\n"


def test_print_vectors_matrices_and_lists(ti, capfd):
    m = ti.Matrix.field(2, 2, ti.i32, shape=())

    @ti.kernel
    def run(k: ti.f32):
        m[None] = ti.Matrix([[1, 2], [3, 4]])
        v = ti.Vector([k, 2 * k])
        print("v =", v, m[None])
        print([1, k], (k, 2), [])

    run(1.5)
    out, _ = capfd.readouterr()
    assert out == ("v = [1.500000, 3.000000] [[1, 2], [3, 4]]\n"
                   "[1, 1.500000] [1.500000, 2] []\n")


def test_print_format_and_fstrings_with_specs(ti, capfd):
    n = 7  # compile-time: formatted by Python unless given a spec

    @ti.kernel
    def run(i: ti.i32, y: ti.f32):
        v = ti.Vector([y, -y])
        print("{} {:.2f} {:e} {}".format(i, y, y, n))
        print("{1} {} {k:.1f}".format(i, 3, k=y))  # `{}` counts from 0 on its own
        print(f"{i:08d} {y:.3} {v:.1f} {n} {y=}")
        print("{:x} {:.3d}".format(ti.u32(255), 5))

    run(42, 2.5)
    out, _ = capfd.readouterr()
    assert out == ("42 2.50 2.500000e+00 7\n"
                   "3 42 2.5\n"
                   "00000042 2.500 [2.5, -2.5] 7 y=2.500000\n"
                   "ff 005\n")


def test_print_runs_at_every_launch_and_in_parallel_loops(ti, capfd):
    @ti.kernel
    def run(k: ti.i32):
        for i in range(4):
            print("item", k * 10 + i)

    run(1)
    run(2)
    out, _ = capfd.readouterr()
    lines = out.splitlines()
    # Lines from a parallel loop may come in any order, but each is whole.
    assert sorted(lines) == sorted(f"item {k * 10 + i}" for k in (1, 2) for i in range(4))
    assert set(lines[:4]) == {f"item {10 + i}" for i in range(4)}  # one launch after another


def test_print_in_funcs_and_branches(ti, capfd):
    @ti.func
    def show(x):
        if x > 0:
            print("positive", x)
        else:
            print("not positive", x)

    @ti.kernel
    def run(x: ti.i32):
        show(x)

    run(3)
    run(-1)
    out, _ = capfd.readouterr()
    assert out == "positive 3\nnot positive -1\n"


def test_print_keeps_order_with_python_prints(ti, capfd):
    @ti.kernel
    def run():
        print("inside kernel")

    print("before")
    run()
    print("after")
    out, _ = capfd.readouterr()
    assert out == "before\ninside kernel\nafter\n"


def test_print_spec_of_another_kind_is_a_type_error(ti):
    @ti.kernel
    def run(f: ti.f32):
        print("{:d}".format(f))

    with pytest.raises(ti.TaichiTypeError, match=r"'d' doesn't match 'f32'"):
        run(1.0)


def test_print_format_arguments_must_all_be_used(ti):
    @ti.kernel
    def run(k: ti.f32):
        print("{0} {1}".format(k, k, k))

    with pytest.raises(ti.TaichiSyntaxError, match=r"Expected 2 positional argument"):
        run(1.0)


@pytest.mark.difftape_only
def test_print_of_a_whole_field_is_refused(ti):
    x = ti.field(ti.f32, shape=3)

    @ti.kernel
    def run():
        print(x)

    with pytest.raises(ti.CompileError, match="print"):
        run()
