"""pytest plugin that stands in for Taichi's ``tests/python/conftest.py`` in the suite runs.

``bench/taichi_suite.py`` runs pytest with ``--noconftest -p suite_plugin`` for both backends
(Taichi's conftest needs ``pytest_rerunfailures`` and a forked xdist). What it does:

* ``wanted_arch``: the autouse fixture Taichi's tests expect. A test decorated with
  ``@test_utils.test(...)`` is parametrized with ``req_arch, req_options``; the fixture calls
  ``ti.init(arch=req_arch, **req_options)`` before it (plus ``enable_fallback=False`` on real
  Taichi, as Taichi's conftest does) and ``ti.reset()`` after. Other tests get ``None``.
* A per-test watchdog (``SUITE_TEST_TIMEOUT`` seconds): ``faulthandler`` dumps every
  thread's stack to ``SUITE_FAULT_LOG`` and ends the process, so a hang is attributed to its
  test; ``faulthandler.enable`` does the same for a crash by a signal.
* A progress stream (``SUITE_PROGRESS``, JSON lines ``{"start"|"end": nodeid}``) from which
  the harness learns which test was running when the process died.
* ``SUITE_DESELECT``: a file of node ids not to run (tests that hung or crashed in an
  earlier attempt at the same file).
* For each failing test, junit-xml properties describing the exception: ``exc_type``
  (qualified class name), ``exc_origin`` (``backend``: raised inside difftape / Taichi;
  ``test``: in the test file; ``other``: numpy, pytest, the stdlib, the alias) and
  ``exc_stmt`` (the test file's statement that was executing).
"""

import faulthandler
import json
import os
import sys

import pytest

_BACKEND = os.environ.get("SUITE_BACKEND", "difftape")
_TIMEOUT = float(os.environ.get("SUITE_TEST_TIMEOUT", "120"))
_fault_log = open(os.environ.get("SUITE_FAULT_LOG", os.devnull), "a")  # noqa: SIM115
_progress = open(os.environ.get("SUITE_PROGRESS", os.devnull), "a", buffering=1)  # noqa: SIM115
faulthandler.enable(file=_fault_log, all_threads=True)


def _emit(event: str, nodeid: str) -> None:
    _progress.write(json.dumps({event: nodeid}) + "\n")
    _progress.flush()


def _backend_dirs() -> tuple[str, ...]:
    """Where the backend's code lives: Taichi's package, or difftape's and its client's (which
    re-raises the server's errors under ``difftape-remote``)."""
    if _BACKEND == "taichi":
        import taichi

        return (os.path.dirname(os.path.abspath(taichi.__file__)) + os.sep,)
    import difftape
    import difftape.client

    return tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                 for m in (difftape, difftape.client))


@pytest.fixture(autouse=True)
def wanted_arch(request, req_arch, req_options):
    import taichi as ti

    if req_arch is not None:
        extra = {"enable_fallback": False} if _BACKEND == "taichi" else {}
        ti.init(arch=req_arch, **extra, **req_options)
    yield
    if req_arch is not None:
        ti.reset()


def pytest_generate_tests(metafunc):
    if not getattr(metafunc.function, "__ti_test__", False):
        metafunc.parametrize("req_arch,req_options", [(None, None)], ids=["none"])


def pytest_collection_modifyitems(config, items):
    path = os.environ.get("SUITE_DESELECT")
    if not path or not os.path.exists(path):
        return
    with open(path) as f:
        drop = {line.strip() for line in f if line.strip()}
    keep = [it for it in items if it.nodeid not in drop]
    gone = [it for it in items if it.nodeid in drop]
    if gone:
        config.hook.pytest_deselected(items=gone)
        items[:] = keep


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _emit("start", item.nodeid)
    faulthandler.dump_traceback_later(_TIMEOUT, exit=True, file=_fault_log)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        _emit("end", item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.excinfo is None or report.skipped or any(
            k == "exc_type" for k, _ in item.user_properties):
        return
    exc = call.excinfo
    etype = exc.type
    item.user_properties.append(("exc_type", f"{etype.__module__}.{etype.__qualname__}"))
    item.user_properties.append(("exc_phase", call.when))
    backend = _backend_dirs()
    test_file = str(item.path)
    origin, stmt = "other", ""
    for entry in exc.traceback:
        path = str(entry.path)
        if path == test_file:
            try:
                stmt = str(entry.statement).strip().splitlines()[0]
            except Exception:  # noqa: BLE001 - the source may be unavailable
                stmt = ""
    last = str(exc.traceback[-1].path) if len(exc.traceback) else ""
    if last.startswith(backend):
        origin = "backend"
    elif last == test_file:
        origin = "test"
    item.user_properties.append(("exc_origin", origin))
    item.user_properties.append(("exc_stmt", stmt[:300]))


def pytest_unconfigure(config):
    _progress.close()
    sys.stdout.flush()
