"""Errors of kernels run on the server name the line, as local ones do.

The client sends a kernel as IR with its statements' source locations (file, line and the
line's text, ``difftape.ir.serialize``); the server quotes them, never reading a file. So a
bounds error, a failed ``assert``, a gradient rule the server finds while compiling a
derivative, a derivative lost through storage, and an error in a captured graph's replay come
back from ``arch=ti.remote`` with the very message the local runtime gives: kernel, file, line
and source text. Each program runs locally and remotely (over HTTP to a real server, and
in-process) and the exception's class and text are compared whole.
"""


import numpy as np
import pytest

import difftape as ti
from difftape.runtime import program as program_state

from .conftest import init_remote

HERE = __file__


def run_local(program, **options):
    ti.init(arch=ti.cpu, check_out_of_bound=True, **options)
    try:
        return program()
    finally:
        ti.reset()


def failure(program):
    """A program whose last step raises: (exception class name, message)."""

    def run():
        with pytest.raises(ti.DifftapeError) as info:
            program()
            ti.sync()
        return type(info.value).__name__, str(info.value)

    return run


def line_of(marker: str) -> int:
    """The line of this file that ends with the comment ``# marker: <marker>``."""
    with open(HERE) as f:
        lines = [n for n, text in enumerate(f, 1) if text.rstrip().endswith(f"# marker: {marker}")]
    assert len(lines) == 1, marker
    return lines[0]


def assert_names_the_line(message: str, kernel: str, marker: str) -> None:
    assert f"in kernel '{kernel}', {HERE}:{line_of(marker)}\n" in message, message
    assert message.endswith(f"# marker: {marker}"), message  # the quoted source line


# ---------------------------------------------------------------------------- programs

def bounds_error():
    x = ti.field(ti.f32, shape=4)

    @ti.kernel
    def fill(n: ti.i32):
        for i in range(n):
            x[i] = 1.0  # marker: the write out of bounds

    fill(4)
    fill(6)


def failed_assert():
    x = ti.field(ti.f32, shape=4)

    @ti.kernel
    def check(limit: ti.f32):
        for i in x:
            assert x[i] < limit, "x is too large"  # marker: the assert

    x.fill(2.0)
    check(3.0)
    check(1.0)


def failed_formatted_assert():
    """A message with run-time values: the failing thread's values come back in the error
    report; the server formats them with the IR's template (data, checked by the validator,
    never evaluated)."""
    x = ti.field(ti.f64, shape=4)
    fmt = "x[%d]=%.3f, %s >= %f (n=%x)"

    @ti.kernel
    def check(limit: ti.f32, n: ti.u64):
        for i in x:
            assert x[i] < limit, fmt % (i, x[i], x[i], limit, n)  # marker: the formatted assert

    x.from_numpy(np.array([0.125, 0.25, 2.0 / 3.0, 0.0]))
    check(3.0, 1)
    check(0.4, 2 ** 64 - 1)


def gradient_rule():
    """A derivative the server derives while compiling it (``kernel.grad()``)."""
    x = ti.field(ti.f32, shape=4, needs_grad=True)
    y = ti.field(ti.f32, shape=(), needs_grad=True)

    @ti.kernel
    def overwrite():
        for i in x:
            y[None] += x[i] * x[i]
            x[i] = 2.0  # marker: the overwrite after the read

    overwrite.grad()


def lost_derivative():
    """What a recorded kernel's gradient would lose, from its IR (the client's check)."""
    x = ti.field(ti.f64, 4, needs_grad=True)
    y = ti.field(ti.f64, 4)
    z = ti.field(ti.f64, (), needs_grad=True)

    @ti.kernel
    def square():
        for i in x:
            y[i] = x[i] * x[i]

    @ti.kernel
    def total():
        for i in y:
            z[None] += ti.sin(y[i])  # marker: the read of y without .grad

    with ti.ad.Tape(loss=z):
        square()
        total()


def lost_derivative_forward():
    """The same in forward mode (``FwdMode``)."""
    x = ti.field(ti.f64, 4, needs_dual=True)
    y = ti.field(ti.f64, 4)
    z = ti.field(ti.f64, (), needs_dual=True)

    @ti.kernel
    def square():
        for i in x:
            y[i] = x[i] * x[i]

    @ti.kernel
    def total():
        for i in y:
            z[None] += ti.sin(y[i])  # marker: the read of y without .dual

    with ti.ad.FwdMode(loss=z, param=x, seed=[1.0] * 4):
        square()
        total()


def replayed_bounds_error():
    """An error in a launch of a captured graph, replayed (on the server, remotely)."""
    x = ti.field(ti.f32, shape=4)

    @ti.kernel
    def poke(i: ti.i32):
        x[i] = 1.0  # marker: the poke out of bounds

    with ti.graph.capture() as g:
        poke(g.input("i", 0))
    g.replay(i=3)
    g.replay(i=7)


CASES = [
    (bounds_error, {}, "IndexOutOfRangeError", "fill", "the write out of bounds"),
    (failed_assert, {"debug": True}, "KernelAssertionError", "check", "the assert"),
    (failed_formatted_assert, {"debug": True}, "KernelAssertionError", "check",
     "the formatted assert"),
    (gradient_rule, {}, "GradientRuleError", "overwrite", "the overwrite after the read"),
    (lost_derivative, {}, "GradientRuleError", "total", "the read of y without .grad"),
    (lost_derivative_forward, {}, "GradientRuleError", "total", "the read of y without .dual"),
    (replayed_bounds_error, {}, "IndexOutOfRangeError", "poke", "the poke out of bounds"),
]


@pytest.mark.parametrize("program, options, error, kernel, marker", CASES,
                         ids=[c[0].__name__ for c in CASES])
def test_a_remote_error_is_the_local_error_line_included(remote, program, options, error,
                                                         kernel, marker):
    local = run_local(failure(program), **options)
    assert local[0] == error
    assert_names_the_line(local[1], kernel, marker)
    if program is failed_formatted_assert:
        assert local[1].startswith(f"x[2]=0.667, {2 / 3!r} >= 0.4 (n={2 ** 64 - 1:x})\n")
    got = remote(failure(program), **options)
    assert got == local


def test_an_error_names_the_line_of_the_func_it_comes_from(remote):
    """A statement inlined from a ``ti.func`` keeps the func's line."""

    def program():
        x = ti.field(ti.f32, shape=4)

        @ti.func
        def put(i):
            x[i] = 3.0  # marker: the func's write

        @ti.kernel
        def caller(n: ti.i32):
            for i in range(n):
                put(i + 1)

        caller(4)

    local = run_local(failure(program))
    assert_names_the_line(local[1], "caller", "the func's write")
    assert remote(failure(program)) == local


def test_a_kernel_the_server_refuses_to_compile_names_the_line(remote):
    """The server's compile errors (here: reverse mode through a kernel whose gradient
    cannot be computed, its adjoint's launch queued as a client that does not derive it first
    would) carry the location that the IR carried; the exception's fields, not only its
    text, match the local ones."""

    def program():
        x = ti.field(ti.f32, shape=4, needs_grad=True)
        y = ti.field(ti.f32, shape=(), needs_grad=True)

        @ti.kernel
        def overwrite():
            for i in x:
                y[None] += ti.sin(x[i])
                x[i] = 0.5  # marker: refused by the compiler

        rt = program_state.get().remote
        with pytest.raises(ti.GradientRuleError) as info:
            if rt is None:
                overwrite.grad()
            else:  # past the client's own check (below): the server refuses it
                rt.queue({"op": "launch", "kernel_id": rt._kernel(overwrite, ()).kid,
                          "variant": "grad", "args": []})
            ti.sync()
        e = info.value
        return str(e), e.kernel, e.file, e.line, e.source_line

    local = run_local(program)
    assert local[1:4] == ("overwrite", HERE, line_of("refused by the compiler"))
    assert remote(program) == local


def test_a_derivative_is_refused_by_the_call_that_asks_for_it(remote):
    """``kernel.grad()`` of a kernel whose adjoint cannot be built raises at that call, as
    locally (Taichi's test_ad_ndarray.py::test_grad_tensor_in_kernel expects it there), and
    the program goes on. Before, the refused launch was queued and its error came from the
    next call that flushed the queue (here the read of ``b``), or from ti.reset()."""

    def program():
        a = ti.ndarray(ti.f32, shape=4, needs_grad=True)
        b = ti.ndarray(ti.f32, shape=(), needs_grad=True)

        @ti.kernel
        def total(x: ti.types.ndarray(), y: ti.types.ndarray()):
            for i in x:
                y[None] += x.grad[i]  # marker: the read of its own gradient

        a.grad.fill(2.0)
        total(a, b)
        with pytest.raises(ti.GradientRuleError) as info:
            total.grad(a, b)
        return str(info.value), b[None]

    local = run_local(program)
    assert_names_the_line(local[0], "total", "the read of its own gradient")
    assert local[1] == 8.0
    assert remote(program) == local


def test_under_debug_a_failed_check_raises_at_its_launch(remote):
    """With ``debug=True`` a launch whose check fails raises at that launch, as locally and
    as Taichi (which checks after every launch in debug mode; its test_matrix.py::
    test_matrix_oob expects it there). Before, the launch was queued and its error came from
    the next call that flushed, or from ti.reset()."""

    def program():
        x = ti.field(ti.f32, shape=4)

        @ti.kernel
        def poke(i: ti.i32):
            x[i] = 1.0  # marker: the poke under debug

        poke(1)
        with pytest.raises(ti.IndexOutOfRangeError) as info:
            poke(9)
        return str(info.value), x.to_numpy().tolist()

    local = run_local(program, debug=True)
    assert_names_the_line(local[0], "poke", "the poke under debug")
    assert local[1] == [0.0, 1.0, 0.0, 0.0]
    assert remote(program, debug=True) == local


def _queue_a_bad_write():
    x = ti.field(ti.f32, shape=4)

    @ti.kernel
    def poke(k: ti.i32):
        x[k] = 1.0  # the bad write

    poke(1)
    poke(7)  # queued: nothing reads afterwards


@pytest.mark.parametrize("how", ["http", "inproc"])
def test_a_failure_still_queued_is_raised_at_reset(request, how):
    """A launch queued when the program ends is sent then, and its failure raised (as a local
    grid program raises a queued launch's failure at ti.reset()), not dropped."""
    init_remote(request, how)
    try:
        _queue_a_bad_write()
    except BaseException:
        ti.reset()
        raise
    with pytest.raises(ti.IndexOutOfRangeError, match=r"(?s)poke.*the bad write"):
        ti.reset()
    ti.init(arch=ti.cpu)  # the session was released: a new program starts cleanly
    ti.reset()


def test_a_failure_still_queued_at_exit_is_reported(tmp_path):
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent("""
        import difftape as ti
        from difftape.client import LocalTransport

        ti.init(arch=ti.remote, transport=LocalTransport())
        x = ti.field(ti.f32, shape=4)

        @ti.kernel
        def poke(k: ti.i32):
            x[k] = 1.0  # the bad write

        poke(7)
        print("program ended")
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300)
    assert "program ended" in out.stdout
    assert "IndexOutOfRangeError" in out.stderr and "the bad write" in out.stderr, out.stderr
