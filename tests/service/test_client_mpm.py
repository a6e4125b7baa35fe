"""The MPM benchmark program (``bench/diffmpm.py``, unchanged) run through the client,
against the same program run locally: loss, gradient and the finite-difference check agree
bit for bit. The module's sizes are shrunk so that every loop runs on one thread (float
atomics of the particle-to-grid transfer then add in the same order on both sides) and the
test stays fast; the program text is the benchmark's own."""

import argparse
import sys
from pathlib import Path

import pytest

import difftape as ti

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import diffmpm  # noqa: E402 - the benchmark's module, from bench/


@pytest.fixture
def small_mpm(monkeypatch):
    side, n_grid = 6, 32
    for name, value in {"STEPS": 6, "SIDE": side, "N_PARTICLES": side * side,
                        "N_GRID": n_grid, "DX": 1.0 / n_grid, "INV_DX": float(n_grid),
                        "SPACING": 0.5 / n_grid}.items():
        monkeypatch.setattr(diffmpm, name, value)
    return argparse.Namespace(repeat=1, warmup=0, backend="difftape")


def test_mpm_iteration_remote_matches_local(small_mpm, service):
    ti.init(arch=ti.cpu, debug=True)
    try:
        local = diffmpm.measure(ti, small_mpm)
    finally:
        ti.reset()
    ti.init(arch=ti.remote, server=service.url, token=service.tokens["alice"])
    try:
        remote = diffmpm.measure(ti, small_mpm)
    finally:
        ti.reset()
    assert local["finite"] and remote["finite"]
    for key in ("loss", "grad", "grad_fd", "grad_fd_rel_diff"):
        assert remote[key] == local[key], key
    assert any(g != 0 for g in local["grad"])
