"""Real-world Taichi programs (outside the Taichi organisation's tests) on Taichi 1.7.4 and on
difftape, compared field by field (brief h80; bench/README.md, "Real programs").

    .venv/bin/python bench/realprogs/realprogs.py [--only NAME ...] [--work /tmp/realprogs]

Each case runs ``run_program.py`` twice in fresh processes, with Taichi's Python
(``--taichi-python``) and with ours through the ``taichi`` alias (``../taichi_compat/
alias.py``), and compares the saved fields (``FIELDS``) or the ``.npz`` files the program wrote
(``FILES``: GeoTaichi's outputs) at the case's tolerance, relative to the largest magnitude of
Taichi's array; integers exactly. Checkouts live under ``--checkouts`` (default
``/work/realprogs``); a case whose checkout or extra packages are missing is skipped, saying
why. GeoTaichi needs psutil, trimesh, scipy and shapely on ``--geo-lib`` (a ``pip install
--target`` directory; both Pythons are 3.11) and a full source tree (``--geo-tree``, e.g.
``git --git-dir=/work/.mirror/Yihao-Shi+GeoTaichi/repo archive HEAD src geotaichi
third_party example | tar -x -C DIR``). No network is used.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ALIAS = HERE.parent / "taichi_compat" / "alias.py"
HEADLESS = HERE.parent / "taichi_compat" / "headless"
BENCH = "taichi-dev+taichi_benchmark"
GEO = "Yihao-Shi+GeoTaichi"


@dataclass
class Case:
    name: str
    checkout: str
    program: str  # relative to the checkout (GeoTaichi: to --geo-tree)
    func: str = "__main__"
    args: dict = field(default_factory=dict)
    rtol: float = 0.0  # 0: bit for bit
    why: str = ""  # why the tolerance, or what is known to differ
    steps: int = 0  # GeoTaichi: time steps (the example is shortened, geo_shorten.py)
    headless: bool = False  # cv2/imageio stand-ins on the path (images read, none written)


CASES = [
    Case("benchmark/mpm-2d", BENCH, "suites/mpm/taichi/mpm.py", "CLASS:MPM",
         {"n_grid": 32, "dim": 2}),
    Case("benchmark/mpm-3d", BENCH, "suites/mpm/taichi/mpm.py", "CLASS:MPM",
         {"n_grid": 16, "dim": 3}),
    Case("benchmark/saxpy", BENCH, "suites/saxpy/taichi/saxpy.py", "CLASS:SAXPY",
         {"n": 256, "len_coeff": 32}),
    Case("benchmark/stencil", BENCH, "suites/stencil/taichi/stencil.py", "CLASS:Stencil",
         {"N": 64}),
    Case("benchmark/nbody", BENCH, "suites/n_body/taichi/nbody.py", "CLASS:NBodyNaive",
         {"n": 256}),
    Case("benchmark/poisson", BENCH, "suites/poisson/src/taichi/poisson_disk.py", "run_poisson",
         {"desired_samples": 300}),
    Case("benchmark/svd-aos", BENCH, "suites/svd3/src/taichi/svd_aos.py", "SVD",
         {"N": 1000, "nIter": 1}),
    Case("benchmark/p2g", BENCH, "suites/p2g/src/taichi/p2g.py", "run_p2g", {"n_grid": 32},
         rtol=5e-3, why="32 x 1025 f32 scatters into the same grid: difftape's scatter "
         "privatization (ir/passes/scatter.py) groups each chunk's sum before adding it; the "
         "first launch (grid from zero) is bit for bit"),
    Case("benchmark/diff-smoke", BENCH, "suites/diff-smoke/src/taichi/smoke_taichi_cpu.py",
         "run_smoke", {"steps": 6, "num_iterations": 3}, rtol=5e-5, headless=True,
         why="f32 loss summed over 12100 cells with atomics (the order differs), then 3 steps "
         "of gradient descent through ti.Tape"),
    Case("learning-taichi/mpm88", "SevanBrodjian+learning-taichi", "mpm88.py"),
    Case("geotaichi/dem-particle-sliding", GEO, "example/dem/ParticleSliding/particle_sliding.py",
         steps=100),
    Case("geotaichi/mpm-column-collapse-2d", GEO, "example/mpm/ColumnCollapse/DPmaterial2D.py",
         steps=200),
    Case("geotaichi/mpm-elastic-bar", GEO, "example/mpm/ElasticBar/ULBar.py", steps=300),
]


def compare(t: dict, d: dict, rtol: float) -> tuple[bool, str]:
    """Every array of ``t`` (Taichi) against ``d`` (difftape): the verdict and the worst."""
    worst, problems = 0.0, []
    for k in sorted(set(t) | set(d)):
        if k not in t or k not in d:
            problems.append(f"{k}: only in {'Taichi' if k in t else 'difftape'}")
            continue
        a, b = t[k], d[k]
        if a.shape != b.shape:
            problems.append(f"{k}: shape {a.shape} vs {b.shape}")
        elif a.dtype.kind in "iub":
            if not np.array_equal(a, b):
                problems.append(f"{k}: {int((a != b).sum())} integers differ")
        elif a.dtype.kind in "fc" and a.size:
            a64, b64 = a.astype(np.float64), b.astype(np.float64)
            finite = np.isfinite(a64)
            if not (np.array_equal(finite, np.isfinite(b64))
                    and np.array_equal(a64[~finite], b64[~finite], equal_nan=True)):
                problems.append(f"{k}: NaNs or infinities differ")
                continue
            if not finite.any():
                continue
            fa, fb = a64[finite], b64[finite]
            err = np.abs(fa - fb).max() / (np.abs(fa).max() or 1.0)
            worst = max(worst, float(err))
            if err > rtol:
                problems.append(f"{k}: relative difference {err:.2e}")
    if problems:
        return False, "; ".join(problems[:3]) + (" ..." if len(problems) > 3 else "")
    return True, f"{len(t)} arrays, worst relative difference {worst:.1e}"


def load_files(root: Path) -> dict:
    """The ``.npz`` files a program wrote under ``root``, array by array."""
    out = {}
    for f in sorted(root.rglob("*.npz")):
        # (GeoTaichi also saves object arrays, its own bookkeeping: only numbers are compared;
        # these are files the run just wrote here)
        with np.load(f, allow_pickle=True) as z:
            for k in z.files:
                if z[k].dtype != object:
                    out[f"{f.relative_to(root)}:{k}"] = z[k]
    return out


def run_case(case: Case, opts) -> tuple[str, str]:
    checkout = Path(opts.checkouts) / case.checkout
    geo = case.checkout == GEO
    tree = Path(opts.geo_tree) if geo else checkout
    if not checkout.is_dir():
        return "skipped", f"no checkout at {checkout}"
    if geo and not (tree / "src").is_dir():
        return "skipped", f"GeoTaichi's source tree is not at {tree} (--geo-tree)"
    if geo and not (Path(opts.geo_lib) / "shapely").is_dir():
        return "skipped", f"GeoTaichi's packages are not in {opts.geo_lib} (--geo-lib)"
    work = Path(opts.work) / case.name.replace("/", "_")
    shutil.rmtree(work, ignore_errors=True)
    results = {}
    for side in ("taichi", "difftape"):
        d = work / side
        d.mkdir(parents=True)
        program = tree / case.program
        path = [str(HERE)]
        if geo:  # (its output files are what is compared: a directory of their own)
            (d / "run").mkdir()
            program = d / "run" / "program.py"
            subprocess.run([sys.executable, str(HERE / "geo_shorten.py"),
                            str(tree / case.program), str(program), str(case.steps)], check=True)
            path += [opts.geo_lib, str(tree), str(HERE / "geostub")]
        if case.headless:
            path.append(str(HEADLESS))
        python = opts.taichi_python
        if side == "difftape":
            alias = d / "alias" / "taichi"
            alias.mkdir(parents=True)
            shutil.copy(ALIAS, alias / "__init__.py")
            path.insert(0, str(alias.parent))
            python = sys.executable
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
        t0 = time.perf_counter()
        proc = subprocess.run(
            ["timeout", str(opts.timeout), python, str(HERE / "run_program.py"),
             str(d / "fields.npz"), str(program), case.func, _json(case.args)],
            env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        saved = any((d / "run").rglob("*.npz")) if geo else (d / "fields.npz").exists()
        if not saved:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
            return ("refused" if side == "difftape" else "baseline-fails"), \
                f"{side} (rc {proc.returncode}): {tail[0][:200]}"
        results[side] = (load_files(d / "run") if geo else dict(np.load(d / "fields.npz")),
                         wall)
    ok, detail = compare(results["taichi"][0], results["difftape"][0], case.rtol)
    times = f"(Taichi {results['taichi'][1]:.0f} s, difftape {results['difftape'][1]:.0f} s)"
    return ("agrees" if ok else "differs"), f"{detail} {times}"


def _json(args: dict) -> str:
    import json

    return json.dumps(args)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkouts", default="/work/realprogs")
    ap.add_argument("--taichi-python", default="/work/tivenv/bin/python")
    ap.add_argument("--geo-tree", default="/tmp/geotaichi")
    ap.add_argument("--geo-lib", default="/tmp/geotaichi-lib")
    ap.add_argument("--work", default="/tmp/realprogs-work")
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--only", nargs="*", default=None)
    opts = ap.parse_args()
    if not Path(opts.taichi_python).exists():
        print(f"skipped: no Taichi at {opts.taichi_python} (--taichi-python)")
        return 0
    failed = 0
    for case in CASES:
        if opts.only and case.name not in opts.only:
            continue
        verdict, detail = run_case(case, opts)
        failed += verdict in ("differs", "refused")
        note = f" [{case.why}]" if case.why and verdict == "agrees" else ""
        print(f"{case.name:40s} {verdict:14s} {detail}{note}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
