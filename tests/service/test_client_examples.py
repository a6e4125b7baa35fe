"""An examples/ program run with its ``--remote`` flag against a real server: the same design
as a local run (to rounding: the server compiles with bounds checks, which may change the last
bit of a float, see test_client_programs.py), its pictures drawn here, and few round trips.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

import difftape as ti


def _example_tests():
    """tests/examples/test_examples.py (its helpers: the example loader, image checks)."""
    path = Path(__file__).resolve().parents[1] / "examples" / "test_examples.py"
    spec = importlib.util.spec_from_file_location("example_tests", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_hanging_arch_runs_with_remote_flag(service, tmp_path, monkeypatch):
    helpers = _example_tests()
    argv = ["--iters", "4", "--beads", "7", "--res", "160"]
    arch = helpers.example("hanging_arch")
    try:
        local = arch.main([*argv, "--out", str(tmp_path / "local")])
    finally:
        ti.reset()
    monkeypatch.setenv("DIFFTAPE_SERVER", service.url)
    monkeypatch.setenv("DIFFTAPE_TOKEN", service.tokens["alice"])
    try:
        remote = arch.main([*argv, "--remote", "--out", str(tmp_path / "remote")])
        trips = ti.remote_stats()["round_trips"]
    finally:
        ti.reset()
    np.testing.assert_allclose(remote, local, rtol=1e-6)
    assert remote[-1] < 1e-2 * remote[0], remote
    # per iteration: the misfit, the Jacobian (one request), the loads, a line-search misfit
    # or two, and the frame's two reads; plus opening the session
    assert 0 < trips <= 8 * len(remote) + 2, trips
    helpers.check_gif(tmp_path / "remote" / "hanging_arch.gif", (160, 160), 5 + 2)  # repeats merge
    helpers.check_png(tmp_path / "remote" / "hanging_arch_loss.png")


def test_tape_graph_draws_the_same_graph_remotely(service, tmp_path, monkeypatch):
    """examples/tape_graph.py under DIFFTAPE_ARCH=remote: ``tape.visualize`` reads what each
    recorded launch loads and stores from its IR, which the client builds (the fields live
    on the server), and draws the graph a local run draws."""
    graph = _example_tests().example("tape_graph")
    try:
        graph.main(["--out", str(tmp_path / "local.dot")])
    finally:
        ti.reset()
    monkeypatch.setenv("DIFFTAPE_ARCH", "remote")
    monkeypatch.setenv("DIFFTAPE_SERVER", service.url)
    monkeypatch.setenv("DIFFTAPE_TOKEN", service.tokens["alice"])
    try:
        graph.main(["--out", str(tmp_path / "remote.dot")])
    finally:
        ti.reset()
    local = (tmp_path / "local.dot").read_text()
    assert '"launch 0"' in local and "->" in local, local
    assert (tmp_path / "remote.dot").read_text() == local
