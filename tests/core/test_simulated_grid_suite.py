"""The language and autodiff suites on the simulated GPU grid (CI's share of them).

``DIFFTAPE_SIMULATE_GPU=blocks,threads`` makes every local program's kernels compile as the
CUDA target's code for the host and launch over that grid (runtime/simgrid.py): grid-stride
loops, serial and deterministic tasks on thread 0, per-thread stacks from a pool with its
overflow rerun, the error word, per-thread random states; fields and ndarrays live in
simulated device memory (runtime/storage.py), reached from Python scope only through explicit
copies. All of tests/lang and tests/ad pass that way (README, *Status*); CI runs a
representative subset here, on an uneven grid (3 blocks of 7 threads), in a subprocess so the
variable applies from the first ``ti.init``.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.difftape_only

ROOT = Path(__file__).resolve().parents[2]
#: control flow and loops (stacks in the adjoints), atomics and random numbers, scatter
#: privatization, the Tape, sparse activity written by kernels and by Python scope (storage
#: synced both ways), PyTorch and JAX arrays in and out of device storage; ~70 s on a busy
#: 2-core machine with a cold cache
SUBSET = ["tests/lang/test_loops.py", "tests/lang/test_random_atomics.py",
          "tests/lang/test_scatter.py", "tests/lang/test_sparse.py", "tests/ad/test_control.py",
          "tests/ad/test_tape.py", "tests/lang/test_graph.py", "tests/ad/test_graph_ad.py",
          "tests/lang/test_foreign_arrays.py"]
GRID = "3,7"


def _env() -> dict:
    env = dict(os.environ, DIFFTAPE_SIMULATE_GPU=GRID, DIFFTAPE_CHECK_PTX="0")
    env.pop("DIFFTAPE_TEST_PEER", None)
    return env


def test_the_variable_puts_kernels_on_the_grid(tmp_path):
    code = ("import difftape as ti\n"
            "ti.init(arch=ti.cpu)\n"
            "x = ti.field(ti.f32, shape=10)\n"
            "@ti.kernel\n"
            "def k():\n"
            "    for i in x:\n"
            "        x[i] = i\n"
            "k()\n"
            "g = k._fast.grid\n"
            "print(g.blocks, g.threads, x.to_numpy().sum())\n")
    script = tmp_path / "prog.py"
    script.write_text(code)
    r = subprocess.run([sys.executable, str(script)], env=_env(), cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["3", "7", "45.0"]


def test_language_and_autodiff_subset_on_the_simulated_grid():
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *SUBSET],
                       env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=600)
    tail = r.stdout[-3000:]
    assert "simulated GPU grid (DIFFTAPE_SIMULATE_GPU=3,7)" in r.stdout, tail
    assert r.returncode == 0, tail
    assert " passed" in tail and "failed" not in tail and "error" not in tail.lower(), tail
