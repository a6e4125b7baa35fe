"""Random programs captured and replayed (issue 20): bench/fuzz_graph.py, bounded for CI.

For a few seeds of each generator (bench/fuzz_gen.py and bench/fuzz_features.py: primal
programs, and gradient programs under ``ti.ad.Tape``, ``kernel.grad()`` and ``ti.ad.FwdMode``)
the program runs eagerly and with its statements captured into graphs and replayed (also with
other scalar arguments, other ndarrays and NumPy arrays of the same shape, and new field
values between replays); every field (primal, .grad, .dual) and ndarray must be bit for bit
the eager run's after every step. What cannot be captured must be refused with a documented
``ti.GraphCaptureError`` naming the program's line. Locally on the CPU, on the simulated GPU
grid (CUDA graphs) and under ``arch=ti.remote`` (an in-process engine).
``bench/fuzz_graph.py --seeds 0:500`` runs the same checks for hundreds of programs.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import difftape as ti

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import fuzz_graph  # noqa: E402

pytestmark = pytest.mark.difftape_only

CASES = [("program", 3), ("gradient", 1), ("features", 0), ("features_gradient", 1)]


def _check(kind: str, seed: int, tmp_path, init=None) -> dict:
    try:
        got = fuzz_graph.check_program(kind, seed, tmp_path, init)
    except fuzz_graph.Finding as e:
        raise AssertionError(f"{kind} seed {seed}: {e}") from None
    assert got["error"] is None, got
    assert got["captured"] > 0 and got["launches"] > 0, got
    return got


@pytest.mark.parametrize(("kind", "seed"), CASES)
def test_replay_equals_eager_bit_for_bit(kind, seed, tmp_path):
    got = _check(kind, seed, tmp_path)
    assert got["refusals"].get("host_read"), got  # every program reads on the host
    if kind == "program":  # k2 returns a value; k1 is replayed with other scalars and
        # ndarrays and new field values in later rounds, its second launch's arguments are
        # computed from scalar inputs (refused: frozen instead)
        assert got["refusals"].get("kernel_return") == 1, got
        assert got["rounds"] >= 2 and got["refusals"].get("input_arith"), got


def test_remote_replay_equals_eager_bit_for_bit(tmp_path):
    from difftape.client import LocalTransport

    _check("features_gradient", 1, tmp_path, {"arch": ti.remote, "transport": LocalTransport})


GRID = """
import json, sys
sys.path.insert(0, "bench")
import fuzz_graph
from pathlib import Path
print(json.dumps([fuzz_graph.check_program(k, s, Path(sys.argv[1]))
                  for k, s in (("program", 3), ("features_gradient", 4))]))
"""


def test_grid_replay_equals_eager_bit_for_bit(tmp_path):
    """On the simulated GPU grid (a subprocess: the variable applies at ti.init).
    features_gradient 4 replays a Tape step with a field input bound to another field, whose
    adjoint launch is a host step (runtime/gridgraph.py run_packed)."""
    env = dict(os.environ, DIFFTAPE_SIMULATE_GPU="3,7", DIFFTAPE_CHECK_PTX="0")
    env.pop("DIFFTAPE_TEST_PEER", None)
    r = subprocess.run([sys.executable, "-c", GRID, str(tmp_path)], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = json.loads(r.stdout.splitlines()[-1])
    for rec in recs:
        assert rec["error"] is None and rec["captured"] > 0 and rec["launches"] > 0, rec
    # the grid refuses NumPy arrays as inputs (documented), and the harness saw it
    assert recs[1]["refusals"].get("numpy_input_on_grid"), recs[1]
