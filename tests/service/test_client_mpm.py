"""The MPM benchmark program (``bench/diffmpm.py``, unchanged) run through the client,
against the same program run locally: loss, gradient and the finite-difference check agree
bit for bit. Both sides run on one thread (a server of its own with one worker thread, and
``cpu_max_num_threads=1`` locally): the particle-to-grid transfer adds floats atomically,
and with several threads the order of those additions, so the last bits, vary from run to
run even locally. The module's sizes are shrunk to keep the test fast; the program text is
the benchmark's own."""

import argparse
import sys
from pathlib import Path

import pytest

import difftape as ti

from .conftest import start_server

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


@pytest.fixture(scope="module")
def one_thread_server(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("one-thread"), users=("alice",),
                          worker_threads=1, spare_workers=0)
    yield server
    server.stop()


def test_mpm_iteration_remote_matches_local(small_mpm, one_thread_server):
    service = one_thread_server
    ti.init(arch=ti.cpu, check_out_of_bound=True, cpu_max_num_threads=1)
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
