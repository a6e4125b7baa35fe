"""print() in kernels under ``arch=ti.remote``: the lines a kernel prints on the server come
back with the response (the engine's print sink, ``runtime/printsink.py``) and appear on the
client's ``sys.stdout`` as a local run prints them, in the same order relative to the
program's own prints, never on the server's stdout; bounded per request. Also from an engine
whose kernels run on a GPU grid (``remote``'s "grid"), where the lines travel from the device
as records.

Each program runs locally (its kernels' printf on file descriptor 1, captured by ``capfd``)
and remotely with ``sys.stdout`` redirected to a buffer: what a remote run writes to the fd
instead of ``sys.stdout`` (an in-process engine printing with C's printf) is a failure."""

import contextlib
import io

import numpy as np
import pytest

import difftape as ti
from difftape.client import LocalTransport, as_job
from difftape.graph import wire

from .conftest import remote_runner
from .test_client_programs import run_local


@pytest.fixture(params=["http", "inproc", "grid"])
def remote(request):
    """conftest's ``remote``, and also on a GPU grid's engine (``init_remote``'s "grid"):
    there kernels append print records to a buffer in device memory, which the engine
    formats after each launch (``runtime/printsink.py``'s ``PrintRecords``)."""
    return remote_runner(request, request.param)


def _outputs(program, remote, capfd) -> tuple[str, str]:
    """(local output, remote output): each run's stdout, program's prints included."""
    capfd.readouterr()
    run_local(program)
    local = capfd.readouterr().out
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        remote(program)
    assert capfd.readouterr().out == ""  # nothing on this process's fd 1 (in-process engine)
    return local, buf.getvalue()


def _formats():
    x = ti.field(ti.f32, shape=3)
    m = ti.Matrix.field(2, 2, ti.f64, shape=())
    small = ti.field(ti.i8, shape=())
    big = ti.field(ti.u64, shape=())

    @ti.kernel
    def show(a: ti.i32, b: ti.f32):
        print("a =", a, "b =", b, ti.Vector([a, a + 1]), sep=" | ", end=" <\n")
        print(f"{a:08d} {b:.2f} {b:e} {a=}")
        print("{} and {:x}".format(b, ti.u32(a)))  # noqa: UP032 - str.format in a kernel
        print("matrix", m[None], "i8", small[None], "u64", big[None], 1.5, 2)
        print("100% sure", end="")
        print("")

    x.from_numpy(np.array([1.0, -2.5, 3.25], np.float32))
    m[None] = [[1.0 / 3.0, 2.0], [-0.0, 1e20]]
    small[None] = -7
    big[None] = 2**63 + 5
    print("python before")
    show(42, 0.1)
    print("python between")
    show(-3, float("inf"))
    print("python after")


def test_printed_lines_equal_the_local_run(remote, capfd):
    """Floats, ints of every width, vectors and matrices, f-strings and str.format with
    specs, sep= and end=, a literal '%': the same text, in the same order relative to the
    program's own prints (a launch that prints returns after its lines are written)."""
    local, there = _outputs(_formats, remote, capfd)
    assert local.startswith("python before\na = | 42 | b = | 0.100000 | [42, 43] <\n"
                            "00000042 0.10 1.000000e-01 a=42\n")
    assert "100% sure\n" in local and "python between\n" in local
    assert there == local


def test_lines_of_a_parallel_loop_equal_the_local_ones(remote, capfd):
    """A parallel loop's lines may come in another order; each line is whole."""

    def program():
        x = ti.field(ti.i32, shape=4096)

        @ti.kernel
        def fill():
            for i in x:
                x[i] = i * 3
                print("cell", i, "value", x[i], ti.Vector([i, -i]))

        fill()
        print("done")

    local, there = _outputs(program, remote, capfd)
    assert len(local.splitlines()) == 4097
    assert sorted(there.splitlines()) == sorted(local.splitlines())
    assert there.endswith("done\n")


def _graph_program():
    x = ti.field(ti.f32, shape=4)

    @ti.kernel
    def step(dt: ti.f32, k: ti.i32):
        for _ in range(1):
            print("step dt =", dt, "k =", k)
        for i in x:
            x[i] += dt * i

    with ti.graph.capture() as g:
        dt = g.input("dt", 0.5)
        step(dt, 3)
    print("captured")
    for k in range(3):
        g.replay(dt=0.25 * k)
        print("replayed", k, x.to_numpy().tolist())


def test_a_print_inside_a_graph_replayed_remotely(remote, capfd):
    """Each replay prints its lines before the program's next print, as locally (also on a
    GPU grid's engine, where the printing launch is a host step between graph segments)."""
    local, there = _outputs(_graph_program, remote, capfd)
    assert local.count("step dt =") == 3 and "step dt = 0.500000 k = 3\n" in local
    assert there == local


def test_lines_printed_before_an_error_come_before_it(remote, capfd):
    """A kernel that prints and then fails a bounds check: its lines are written, then the
    error is raised (also from a batch whose earlier ops printed)."""

    def program():
        x = ti.field(ti.f32, shape=4)

        @ti.kernel
        def bad(i: ti.i32):
            for _ in range(1):
                print("reading", i)
                x[i] += 1.0

        @ti.kernel
        def quiet():
            for i in x:
                x[i] += 1.0

        bad(1)
        quiet()
        with pytest.raises(ti.DifftapeError, match="Out of bound|out of range"):
            bad(7)
            ti.sync()
        print("after the error")

    local, there = _outputs(program, remote, capfd)
    assert local == "reading 1\nreading 7\nafter the error\n"
    assert there == local


def test_debug_overflow_reports_are_printed_remotely(remote, capfd):
    """ti.init(debug=True)'s integer overflow reports are printed lines of the kernel: the
    server adds them where the client's program asked, and they come back."""

    def program():
        @ti.kernel
        def wrap(a: ti.i32) -> ti.i32:
            return a * 65536  # marker: overflows

        return wrap(65536)

    ti.init(arch=ti.cpu, debug=True)
    try:
        capfd.readouterr()
        assert program() == 0
        local = capfd.readouterr().out
    finally:
        ti.reset()
    assert "Multiplication overflow" in local
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert remote(program, debug=True) == 0
    assert buf.getvalue() == local


@pytest.mark.parametrize("count", [300_000, 10**8])
def test_printed_output_is_capped_per_request(remote, count):
    """A kernel printing in a long loop costs the server and the response at most
    wire.MAX_OUTPUT_BYTES of text: the first lines, in order, then one line saying how many
    were dropped (exactly: shown + dropped == printed)."""
    if count > 10**6 and remote.kind != "http":
        pytest.skip("one size of the loop is enough in-process; 10**8 through the server")

    def program():
        @ti.kernel
        def chatter(n: ti.i64):
            for _ in range(1):
                for i in range(n):
                    print("line", i)

        chatter(count)
        ti.sync()
        return ti.remote_stats()["bytes_received"]

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        received = remote(program)
    lines = buf.getvalue().splitlines()
    shown, notice = lines[:-1], lines[-1]
    assert shown == [f"line {i}" for i in range(len(shown))]
    assert sum(len(s) + 2 for s in shown) <= wire.MAX_OUTPUT_BYTES  # each line and its NUL
    assert len(shown) > wire.MAX_OUTPUT_BYTES // 16
    dropped = count - len(shown)
    assert notice == (f"[difftape: {dropped} more lines printed by kernels were dropped: one "
                      f"request carries at most {wire.MAX_OUTPUT_BYTES} bytes of printed "
                      "output]")
    assert received < 2 * wire.MAX_OUTPUT_BYTES


def test_output_goes_to_its_own_session_never_the_servers_stdout(service, capfd):
    """Two programs on the server, one after the other: each sees only its own lines; the
    server's log (its stdout and stderr) has none of them."""
    outs = []
    for marker in ("first-session-line", "second-session-line"):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            ti.init(arch=ti.remote, server=service.url, token=service.tokens["alice"])
            try:
                @ti.kernel
                def say(k: ti.i32):
                    print(marker, k)  # noqa: B023 - compiled (and run) in this iteration

                say(1)
                ti.sync()
            finally:
                ti.reset()
        outs.append(buf.getvalue())
    assert outs == ["first-session-line 1\n", "second-session-line 1\n"]
    assert "session-line" not in service.log()
    assert capfd.readouterr().out == ""


def test_a_job_prints_when_it_ends(service, capfd):
    """Launches run as a server job: their lines are written when the job is over."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        ti.init(arch=ti.remote, server=service.url, token=service.tokens["alice"])
        try:
            @ti.kernel
            def tick(k: ti.i32):
                print("tick", k)

            tick(0)
            with as_job(progress=False) as job:
                for k in range(1, 4):
                    tick(k)
            print("job", job["state"])
        finally:
            ti.reset()
    assert buf.getvalue() == "tick 0\ntick 1\ntick 2\ntick 3\njob succeeded\n"


def test_in_process_engines_keep_their_programs_output_apart(capfd):
    """Two engines in one process (two programs' sessions): a line goes to the program
    whose kernel printed it, not to the other's, and not to the process's fd 1."""
    a, b = LocalTransport(), LocalTransport()
    seen = []
    for transport, word in ((a, "alpha"), (b, "beta")):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            ti.init(arch=ti.remote, transport=transport)
            try:
                @ti.kernel
                def say():
                    print(word)  # noqa: B023 - compiled (and run) in this iteration

                say()
            finally:
                ti.reset()
        seen.append(buf.getvalue())
    assert seen == ["alpha\n", "beta\n"]
    assert capfd.readouterr().out == ""
