"""print() in kernels on a GPU grid (the simulated grid here; CUDA runs the same lowering).

A kernel appends a binary record per line (the line's number and its operands' words) to the
program's print buffer in device memory; the host takes the records at each sync point and
formats them with C's snprintf (runtime/printsink.py's PrintRecords, codegen/cuda.py's
print_call). So the text is the CPU's byte for byte, it reaches ``sys.stdout`` in order with
the program's own prints (a printing launch is a sync point), lines that do not fit are
counted and said, and an attempt rerun after a stack overflow prints once
(test_simgrid_runtime.py)."""

import contextlib
import io

import numpy as np
import pytest

import difftape as ti
from difftape.runtime import grid

pytestmark = pytest.mark.difftape_only


def _program():
    m = ti.Matrix.field(2, 2, ti.f64, shape=())
    x = ti.field(ti.f32, shape=6)

    @ti.kernel
    def show(a: ti.i32, b: ti.f32, big: ti.u64):
        print("a =", a, "b =", b, ti.Vector([a, a + 1]), sep=" | ", end=" <\n")
        print(f"{a:08d} {b:.2f} {b:e} {a=} {b:g}")
        print("{} and {:x}".format(b, ti.u32(a)))  # noqa: UP032 - str.format in a kernel
        print("matrix", m[None], "i8", ti.i8(-7), "u8", ti.u8(200), "u64", big, True,
              ti.cast(b, ti.u1), ti.i64(-(2**40)), ti.f64(b) / 3)
        print("100% sure", end="")
        print("")

    @ti.kernel
    def fill():
        for i in x:
            x[i] = i * 0.5
        for _ in range(1):
            print("sum", x[0] + x[1] + x[2] + x[3] + x[4] + x[5])

    m[None] = [[1.0 / 3.0, 2.0], [-0.0, 1e20]]
    print("python before")
    show(42, 0.1, 2**63 + 5)
    fill()  # asynchronous task, then a printing one
    print("python between")
    show(-3, float("inf"), 0)
    print("python after")


def _cpu_output(capfd) -> str:
    """The program's stdout (its prints and its kernels' printf on fd 1) on the CPU."""
    ti.init(arch=ti.cpu)
    try:
        capfd.readouterr()
        _program()
        return capfd.readouterr().out
    finally:
        ti.reset()


def test_grid_lines_equal_the_cpus_and_go_to_sys_stdout(capfd):
    """Ints of every width, u1, floats in %f/%e/%g and f64's %.12f, vectors, matrices,
    sep/end and a literal '%': the grid's text is the CPU's, in order with the program's own
    prints, and written to ``sys.stdout`` (a redirect catches it: nothing on fd 1)."""
    cpu = _cpu_output(capfd)
    ti.init(arch=ti.cpu, simulate_grid=(3, 7))
    try:
        capfd.readouterr()
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            _program()
        on_grid, fd = buf.getvalue(), capfd.readouterr().out
    finally:
        ti.reset()
    assert cpu.startswith("python before\na = | 42 | b = | 0.100000 | [42, 43] <\n"
                          "00000042 0.10 1.000000e-01 a=42 0.1\n")
    assert "sum 7.500000\n" in cpu and "100% sure\n" in cpu
    assert on_grid == cpu and fd == ""


def test_a_parallel_loops_lines_are_whole(capsys):
    ti.init(arch=ti.cpu, simulate_grid=(2, 5))
    try:
        x = ti.field(ti.i32, shape=300)

        @ti.kernel
        def fill():
            for i in x:
                x[i] = i * 3
                print("cell", i, "value", x[i], ti.Vector([i, -i]))

        fill()
        print("done")
    finally:
        ti.reset()
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "done"
    assert sorted(out[:-1]) == sorted(f"cell {i} value {3 * i} [{i}, {-i}]" for i in range(300))


def test_lines_past_the_buffer_are_counted_and_said(capsys, monkeypatch):
    """A launch that prints more records than the buffer holds: the first lines, in order,
    then one line saying how many were dropped (shown + dropped == printed)."""
    monkeypatch.setattr(grid, "RECORD_BYTES", 1024)  # 64 records of "line", i: 16 bytes
    ti.init(arch=ti.cpu, simulate_grid=(2, 4))
    try:
        @ti.kernel
        def chatter(n: ti.i32):
            for _ in range(1):
                for i in range(n):
                    print("line", i)

        chatter(100)
        chatter(3)  # the buffer is empty again after each launch
    finally:
        ti.reset()
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"line {i}" for i in range(64)] + [
        "[difftape: 36 more lines printed by kernels were dropped: the grid's print buffer "
        "holds 1024 bytes of lines per launch]", "line 0", "line 1", "line 2"]


def test_lines_printed_before_a_failed_check_come_before_the_error(capsys):
    ti.init(arch=ti.cpu, simulate_grid=(2, 4), debug=True)
    try:
        x = ti.field(ti.f32, shape=4)

        @ti.kernel
        def bad(i: ti.i32):
            for _ in range(1):
                print("reading", i)
                x[i] += 1.0

        bad(1)
        with pytest.raises(ti.DifftapeError, match="Out of bound|out of range"):
            bad(7)
        print("after the error")
        np.testing.assert_array_equal(x.to_numpy(), [0, 1, 0, 0])
    finally:
        ti.reset()
    assert capsys.readouterr().out == "reading 1\nreading 7\nafter the error\n"


def test_a_cuda_program_prints_through_the_buffer(monkeypatch, capsys):
    """``ti.init(arch=ti.cuda)`` (the pycuda stand-in running the simulated grid's code):
    the CUDA launcher's launches print the same way."""
    from cuda_standin import FakeDriver, use

    use(monkeypatch, FakeDriver())
    ti.init(arch=ti.cuda)
    try:
        x = ti.field(ti.f64, shape=5)

        @ti.kernel
        def go(s: ti.f64):
            for i in x:
                x[i] = s * i
            for _ in range(1):
                print("last", x[4], f"{x[1]:.3e}")

        print("first")
        go(0.25)
        go(1.0)
    finally:
        ti.reset()
    assert capsys.readouterr().out == ("first\nlast 1.000000000000 2.500e-01\n"
                                       "last 4.000000000000 1.000e+00\n")
