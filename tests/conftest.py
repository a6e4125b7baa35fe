"""Fixtures shared by the test-suite.

The backend under test is ``difftape`` by default. With ``DIFFTAPE_TEST_PEER=taichi`` the very
same tests run against real Taichi 1.7.4, which is how they are validated: difftape's public API
is a copy of Taichi's, so a test that passes on Taichi states behaviour difftape must match.

Fixtures:

``backend``  the imported module (session-wide), not initialised.
``fp``       parametrises a test over ``f32`` and ``f64``; the value is the module's dtype object.
``ti``       the module after ``ti.init(arch=ti.cpu, default_fp=...)``; ``ti.reset()`` afterwards.
             When the test also asks for ``fp`` it runs once per precision with that default_fp,
             otherwise it runs once with Taichi's default (f32).
``npfp``     the NumPy dtype matching ``fp``.
``rtol``     a relative tolerance suitable for ``fp`` (see :func:`tol`).

Tests that check difftape-only behaviour carry the ``difftape_only`` marker; they are skipped
when the peer is Taichi.

Simulated GPU grid (``DIFFTAPE_SIMULATE_GPU=1`` or ``=blocks,threads``): every kernel of the
local programs the tests make is compiled as the CUDA target's code for the host and launched
over that grid (difftape/runtime/simgrid.py); tests/core/test_simulated_grid_suite.py runs a
subset of tests/lang and tests/ad this way. Storage is then simulated device memory
(difftape/runtime/storage.py): tests marked ``host_memory`` (they share a field's or
ndarray's host memory, which device storage refuses) are skipped.

PTX check (``DIFFTAPE_CHECK_PTX``): every kernel the tests compile is also compiled for the CUDA
target and assembled by ``ptxas`` (difftape/codegen/ptx_check.py), also one whose CPU code comes
from the compile cache, so every run checks every kernel; a kernel that cannot be fails the
run, listed with the reason at the end (the summary line counts kernels, cache hits among them,
distinct modules and failures). On by default where ``ptxas`` and libdevice
are found (CI, the development machines); ``DIFFTAPE_CHECK_PTX=0`` turns it off, ``=1``
insists (an error where it cannot run). ``DIFFTAPE_PTX_ARCH`` picks the architecture (default
sm_75) and ``DIFFTAPE_PTX_DIR`` keeps the PTX there (default: a temporary directory).
Modules this same toolchain (ptxas, arch, libdevice, llvmlite) accepted in an earlier run are
not assembled again (their verdicts live in the compile cache's ``ptx-verdicts``; any change in
the CUDA lowering makes new module text, checked anew); ``DIFFTAPE_PTX_VERDICTS=0`` assembles
everything.
"""

import importlib
import os

import numpy as np
import pytest

# Run difftape's IR verifier between compiler passes in every test.
os.environ.setdefault("DIFFTAPE_VERIFY_IR", "1")

PEER = os.environ.get("DIFFTAPE_TEST_PEER", "difftape").strip().lower() or "difftape"
_BACKENDS = ("difftape", "taichi")
FP_NAMES = ("f32", "f64")
_RTOL = {"f32": 1e-5, "f64": 1e-12}


def fp_name(fp):
    """'f32' or 'f64' for a dtype object of the backend (or those names as strings)."""
    if isinstance(fp, str):
        name = fp
    else:
        module = _load_backend()
        matches = [n for n in FP_NAMES if fp == getattr(module, n)]
        name = matches[0] if matches else None
    if name not in FP_NAMES:
        raise ValueError(f"not a floating-point dtype: {fp!r}")
    return name


def tol(fp):
    """Relative tolerance for comparing results computed in ``fp`` against NumPy in float64."""
    return _RTOL[fp_name(fp)]


def _load_backend():
    return importlib.import_module(PEER)


def pytest_configure(config):
    if PEER not in _BACKENDS:
        raise pytest.UsageError(
            f"DIFFTAPE_TEST_PEER={PEER!r}: expected one of {', '.join(_BACKENDS)}"
        )
    config._difftape_ptx = _start_ptx_check()
    config.addinivalue_line(
        "markers", "difftape_only: checks difftape-specific behaviour; skipped against Taichi"
    )


def pytest_report_header(config):
    lines = [f"language backend under test: {PEER}"]
    check = getattr(config, "_difftape_ptx", None)
    if check is not None:
        lines.append(f"PTX check: every kernel also through ptxas -arch={check.arch} "
                     f"(DIFFTAPE_CHECK_PTX=0 to skip), PTX in {check.directory}")
    grid = os.environ.get("DIFFTAPE_SIMULATE_GPU", "").strip()
    if PEER == "difftape" and grid not in ("", "0"):
        lines.append(f"simulated GPU grid (DIFFTAPE_SIMULATE_GPU={grid}): kernels run as the "
                     "CUDA target's code, thread by thread (difftape/runtime/simgrid.py)")
    return lines


def _start_ptx_check():
    want = os.environ.get("DIFFTAPE_CHECK_PTX", "").strip()
    if PEER != "difftape" or want == "0":
        return None
    from difftape.codegen import ptx_check

    why = ptx_check.available()
    if why is not None:
        if want == "1":
            raise pytest.UsageError(f"DIFFTAPE_CHECK_PTX=1 but {why}")
        return None
    directory = os.environ.get("DIFFTAPE_PTX_DIR") or None
    if directory:
        os.makedirs(directory, exist_ok=True)
    # Acceptances by this same toolchain are kept beside the compiled-code cache (see
    # ptx_check's docstring); DIFFTAPE_PTX_VERDICTS=0 assembles every module again.
    verdicts = None
    if os.environ.get("DIFFTAPE_PTX_VERDICTS", "1") != "0":
        from difftape.runtime import cache

        verdicts = str(cache.cache_dir() / "ptx-verdicts")
    return ptx_check.install(arch=os.environ.get("DIFFTAPE_PTX_ARCH") or ptx_check.DEFAULT_ARCH,
                             directory=directory, verdicts=verdicts)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    check = getattr(session.config, "_difftape_ptx", None)
    if check is not None and check.finish() and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    check = getattr(config, "_difftape_ptx", None)
    if check is None:
        return
    tr = terminalreporter
    ok = check.modules - sum(f.stage != "lowering" for f in check.failures)
    tr.write_line(f"PTX check ({check.arch}): {check.kernels} kernels compiled "
                  f"({check.cached} of them from the cache), checked as "
                  f"{check.modules} distinct CUDA modules, {ok} accepted by ptxas "
                  f"({check.known} of them in an earlier run), "
                  f"{len(check.failures)} failed ({check.worker_s:.0f} s in workers)")
    for f in check.failures:
        tr.write_line(f"  PTX FAILED {f}", red=True)


def simulated_grid() -> bool:
    """Whether ``DIFFTAPE_SIMULATE_GPU`` puts this run's programs on the simulated grid."""
    return PEER == "difftape" and os.environ.get("DIFFTAPE_SIMULATE_GPU", "").strip() not in (
        "", "0")


def pytest_collection_modifyitems(config, items):
    if simulated_grid():
        skip = pytest.mark.skip(reason="shares host memory with storage, which is simulated "
                                       "device memory under DIFFTAPE_SIMULATE_GPU (refused "
                                       "there, see tests/core/test_storage.py)")
        for item in items:
            if "host_memory" in item.keywords:
                item.add_marker(skip)
    if PEER == "difftape":
        return
    skip = pytest.mark.skip(reason="difftape-specific error types (peer is taichi)")
    for item in items:
        if "difftape_only" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def backend():
    return _load_backend()


@pytest.fixture(params=FP_NAMES)
def fp(request, backend):
    return getattr(backend, request.param)


@pytest.fixture
def npfp(fp):
    return {"f32": np.float32, "f64": np.float64}[fp_name(fp)]


@pytest.fixture
def rtol(fp):
    return tol(fp)


@pytest.fixture
def ti(request, backend):
    default_fp = request.getfixturevalue("fp") if "fp" in request.fixturenames else backend.f32
    backend.init(arch=backend.cpu, default_fp=default_fp)
    yield backend
    reset = getattr(backend, "reset", None)
    if reset is not None:
        reset()


def start_spinner(cpu: int | None = None):
    """A process spinning in a Python loop, pinned to ``cpu`` (default: the second CPU this
    process may use, else the only one): a core shared with a busy neighbour, as on a loaded
    machine. ``taskset`` pins it when installed, else the child pins itself. Returns the
    ``Popen``; stop it with ``stop_spinner``."""
    import shutil
    import subprocess
    import sys

    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    cpu = cpus[min(1, len(cpus) - 1)] if cpu is None else cpu
    loop = "while True: pass"
    if shutil.which("taskset"):
        cmd = ["taskset", "-c", str(cpu), sys.executable, "-c", loop]
    elif hasattr(os, "sched_setaffinity"):
        cmd = [sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{cpu}}})\n{loop}"]
    else:
        cmd = [sys.executable, "-c", loop]
    return subprocess.Popen(cmd)


def stop_spinner(proc) -> None:
    proc.kill()
    proc.wait()


@pytest.fixture
def spinner():
    """A busy process pinned to the second core for the duration of the test."""
    proc = start_spinner()
    yield proc
    stop_spinner(proc)
