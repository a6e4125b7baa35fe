"""What a user sees when a kernel fails to compile: the traceback of a compile error.

Taichi cuts its compiler's frames from the traceback of its errors (the message already
lays out the kernel and func lines down to the failing expression), and keeps them all under
``ti.init(print_full_traceback=True)`` or ``TI_PRINT_FULL_TRACEBACK=1``. difftape does the
same, and shows none of its own frames at all (Taichi keeps the one that re-raises).
"""

import os
import subprocess
import sys
import textwrap
import traceback

import pytest


def _package_frames(backend, exc: BaseException) -> list[str]:
    """The frames of ``exc``'s traceback (and of the exceptions chained to it, as printed)
    that are in the backend's own package."""
    package = os.path.dirname(os.path.abspath(backend.__file__)) + os.sep
    out = []
    for line in traceback.format_exception(exc):
        for part in line.splitlines():
            if part.strip().startswith("File ") and package in part:
                out.append(part.strip())
    return out


def _nested_name_error(ti):
    """A kernel calling a func calling a func that uses an undefined name; returns the
    exception its call raises."""
    x = ti.field(ti.f32, shape=4)

    @ti.func
    def inner(i):
        return x[i] + undefined_name  # noqa: F821

    @ti.func
    def outer(i):
        return inner(i) * 2

    @ti.kernel
    def k():
        for i in x:
            x[i] = outer(i)

    with pytest.raises(ti.TaichiNameError) as info:
        k()
    return info.value


def _chain(exc: BaseException) -> list[str]:
    text = str(exc).strip()
    return [line.strip() for line in text.splitlines() if line.strip().startswith("File ")]


def test_compile_error_traceback_leaves_out_the_compiler(ti, backend):
    """The printed traceback of a compile error in a nested func: the user's frames, the
    message naming the kernel -> func -> func lines; not the compiler's (~50) frames."""
    e = _nested_name_error(ti)
    assert len(_package_frames(backend, e)) <= 1  # Taichi keeps the frame that re-raises
    assert 'Name "undefined_name" is not defined' in str(e)
    chain = _chain(e)
    assert [c.split(", in ")[-1] for c in chain] == ["k:", "outer:", "inner:"]
    assert all(__file__ in c for c in chain)


@pytest.mark.difftape_only
def test_compile_error_traceback_has_no_difftape_frames(ti, backend):
    """difftape re-raises with a bare ``raise``: not even the kernel call's frame is left."""
    e = _nested_name_error(ti)
    assert _package_frames(backend, e) == []
    frames = traceback.extract_tb(e.__traceback__)
    assert [f.name for f in frames] == ["_nested_name_error"]  # where it was caught


def test_print_full_traceback_keeps_the_compiler_frames(backend, monkeypatch):
    """ti.init(print_full_traceback=True), or TI_PRINT_FULL_TRACEBACK=1, keeps every frame;
    the exception's class is the same either way (Taichi's message then leaves out the
    kernel and func lines; difftape's is the same, see below)."""
    ti = backend
    monkeypatch.delenv("TI_PRINT_FULL_TRACEBACK", raising=False)
    try:
        ti.init(arch=ti.cpu)
        short = _nested_name_error(ti)
        ti.init(arch=ti.cpu, print_full_traceback=True)
        full = _nested_name_error(ti)
        assert len(_package_frames(backend, full)) > 10
        assert type(full) is type(short)
        assert 'Name "undefined_name" is not defined' in str(full)
        monkeypatch.setenv("TI_PRINT_FULL_TRACEBACK", "1")
        ti.init(arch=ti.cpu)
        assert len(_package_frames(backend, _nested_name_error(ti))) > 10
    finally:
        ti.reset()


@pytest.mark.difftape_only
def test_print_full_traceback_keeps_the_message(backend, monkeypatch):
    """difftape's message names the kernel and func lines with the full traceback too."""
    ti = backend
    monkeypatch.delenv("TI_PRINT_FULL_TRACEBACK", raising=False)
    try:
        ti.init(arch=ti.cpu)
        short = _nested_name_error(ti)
        ti.init(arch=ti.cpu, print_full_traceback=True)
        assert str(_nested_name_error(ti)) == str(short)
    finally:
        ti.reset()


@pytest.mark.difftape_only
def test_user_helper_failing_at_compile_time_keeps_its_own_frames(ti, backend):
    """A user's Python helper run while the kernel compiles (in ti.static) raises: the
    compile error names the kernel line, and its cause shows the helper's frame, not the
    compiler's between them."""
    def helper(n):
        raise ValueError(f"helper refuses {n}")

    @ti.kernel
    def k() -> ti.i32:
        return ti.static(helper(3))

    with pytest.raises(ti.TaichiCompilationError, match="helper refuses 3") as info:
        k()
    e = info.value
    assert isinstance(e.__cause__, ValueError)
    assert [f.name for f in traceback.extract_tb(e.__cause__.__traceback__)] == ["helper"]
    assert _package_frames(backend, e) == []


@pytest.mark.difftape_only
def test_gradient_error_of_a_tape_and_of_a_method_kernel(ti, backend):
    """Errors leaving a Tape (a kernel's gradient refused while recording, a launch's on
    exit) and a @ti.data_oriented object's kernel show no difftape frame either."""
    x = ti.field(ti.f32, shape=(), needs_grad=True)
    y = ti.field(ti.f32, shape=(), needs_grad=True)
    v = ti.field(ti.f32, shape=())

    @ti.kernel
    def through_v():
        v[None] = x[None] * 2
        y[None] = v[None] * 3

    with pytest.raises(ti.ad.GradientRuleError) as info:
        with ti.ad.Tape(loss=y):
            through_v()
    assert _package_frames(backend, info.value) == []

    @ti.data_oriented
    class Sim:
        @ti.kernel
        def step(self, n: ti.i32):
            for _i in range(n):
                x[None] += undefined  # noqa: F821

    with pytest.raises(ti.TaichiNameError) as info:
        Sim().step(2)
    assert _package_frames(backend, info.value) == []


@pytest.mark.difftape_only
def test_printed_traceback_and_pytest_view(tmp_path):
    """The program's printed traceback, and pytest's report of a failing test, show the
    user's lines and the message, no compiler frame."""
    program = textwrap.dedent("""
        import difftape as ti
        ti.init(arch=ti.cpu)
        x = ti.field(ti.f32, shape=4)

        @ti.func
        def inner(i):
            return x[i] + undefined_name

        @ti.kernel
        def k():
            for i in x:
                x[i] = inner(i)

        def test_k():
            k()

        if __name__ == "__main__":
            test_k()
    """)
    path = tmp_path / "prog_test.py"
    path.write_text(program)
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("TI_PRINT_FULL_TRACEBACK", None)
    run = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=env,
                         timeout=120)
    assert run.returncode == 1
    files = [line for line in run.stderr.splitlines() if line.strip().startswith("File ")]
    assert files and all(str(path) in line for line in files), run.stderr
    assert 'Name "undefined_name" is not defined' in run.stderr
    assert "difftape.errors.KernelNameError" in run.stderr
    report = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             str(path)], capture_output=True, text=True, env=env, timeout=120,
                            cwd=tmp_path)
    assert report.returncode == 1
    assert 'Name "undefined_name" is not defined' in report.stdout
    assert "transformer.py" not in report.stdout and "kernel.py" not in report.stdout, \
        report.stdout


@pytest.mark.difftape_only
def test_grid_launch_failure_shows_no_difftape_frames(backend):
    """A bounds check that failed in a launch on the (simulated) grid: the user's frames
    only, as on the CPU."""
    ti = backend
    try:
        ti.init(arch=ti.cpu, debug=True, simulate_grid=(2, 4))
        x = ti.field(ti.f32, shape=4)

        @ti.kernel
        def poke(i: ti.i32):
            x[i] = 1.0

        with pytest.raises(ti.IndexOutOfRangeError) as info:
            poke(7)
            ti.sync()  # (where a real device's asynchronous launch would report it)
        assert _package_frames(backend, info.value) == []
    finally:
        ti.reset()
