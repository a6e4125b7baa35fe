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
    config.addinivalue_line(
        "markers", "difftape_only: checks difftape-specific behaviour; skipped against Taichi"
    )


def pytest_report_header(config):
    return f"language backend under test: {PEER}"


def pytest_collection_modifyitems(config, items):
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
