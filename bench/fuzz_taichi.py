"""Differential fuzzing: random programs (bench/fuzz_gen.py) on difftape and on Taichi 1.7.4.

    .venv/bin/python bench/fuzz_taichi.py --out /tmp/fuzz --seeds 0:1000 [--batch 40]
    .venv/bin/python bench/fuzz_taichi.py --out /tmp/fuzz --hours 2          # from --seeds' start

Programs are written to files (both implementations read kernel source) in batches; each batch
runs in one fresh process per implementation (start-up paid once per batch, a crash or hang
costs one batch), one batch at a time (``--jobs 1`` is the only mode: the machine is shared).
The results are compared: integers exactly, floats to ``RTOL`` relative to the array's
magnitude (f32 fields: ``RTOL32``); an error on one side only is a disagreement too.
``--kind features`` and ``--kind features_gradient`` run bench/fuzz_features.py (the API
features fuzz_gen's grammar does not reach: funcs returning matrices and structs, matrix
algebra, atomics' return values, unsigned and f16 types, ndrange bounds, sparse deactivation,
ti.math edges; a second kernel under the Tape, ``kernel.grad()`` in reverse order and FwdMode,
whose dual is checked against a directional central difference). ``--kind areas`` and
``--kind areas_gradient`` run bench/fuzz_areas.py (bit_cast, casts, shifts, atomics on every
type, field copies; sparse, ndarray, struct and matrix-field intermediates in gradients).
``--kind gradient`` runs ``fuzz_gen.gradient_program``: the Tape's and ``kernel.grad()``'s
gradients are compared between the two and, on each, with central finite differences
(``FD_RTOL``; a kink of ti.max inside the stencil can show up there). Each
disagreement is written to ``OUT/disagree/<seed>.txt`` (the source, both results) and counted
in ``OUT/summary.json``.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import pickle
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
TAICHI_PYTHON = "/work/tivenv/bin/python"
RTOL = 1e-9
RTOL32 = 2e-4
RTOL16 = 2e-3  # f16 fields (half an f16 ulp per store, relative to the array's magnitude)
FD_RTOL = 1e-5  # gradients vs central differences (step 1e-6, f64)


def worker(backend: str, files: list[str], out: str) -> None:
    """Run each program file with ``backend`` and append (name, result) pickles to ``out``."""
    saved = os.dup(1)
    os.dup2(2, 1)  # banners and prints go to stderr; results go to the pickle file
    ti = importlib.import_module("taichi" if backend == "taichi" else "difftape")
    with open(out, "ab") as fh:
        for f in files:
            try:
                spec = importlib.util.spec_from_file_location(Path(f).stem, f)
                mod = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(mod)
                res = mod.run(ti)
                res = {k: np.asarray(v) for k, v in res.items()}
            except BaseException as e:  # noqa: BLE001 - every failure is a result to compare
                res = {"__error__": f"{type(e).__name__}: {str(e)[:2000]}",
                       "__tb__": traceback.format_exc()[-3000:]}
            pickle.dump((f, res), fh)
            fh.flush()
            with contextlib.suppress(Exception):
                ti.reset()
    os.dup2(saved, 1)


def _read(path: Path) -> dict:
    got = {}
    if path.exists():
        with open(path, "rb") as fh:
            while True:
                try:
                    f, res = pickle.load(fh)
                except EOFError:
                    break
                except Exception:  # noqa: BLE001 - a truncated record from a crash
                    break
                got[f] = res
    return got


def compare(a: dict, b: dict, f32: bool = False) -> list[str]:
    """What differs between difftape's result ``a`` and Taichi's ``b`` (empty: agreement).

    ``f32``: the program computes in f32 (its default float), so even its f64 fields hold
    f32-rounded values: every float array is held to ``RTOL32``."""
    ea, eb = a.get("__error__"), b.get("__error__")
    if ea or eb:
        if ea and eb:
            return []
        return [f"error only on {'difftape' if ea else 'taichi'}: {ea or eb}"]
    out = []
    for name, r in (("difftape", a), ("taichi", b)):  # gradient programs: each against FD
        if "dual" in r:  # FwdMode's dual vs the directional central difference
            fd = r["_fd_dir"]
            if np.abs(r["dual"] - fd).max() > FD_RTOL * (np.abs(fd).max() + 1.0):
                out.append(f"{name} FwdMode dual vs finite differences: {r['dual']} vs {fd}")
        if "_fd" in r:
            fd = r["_fd"]
            scale = max(1.0, float(np.max(np.abs(fd))))
            for k in ("tape", "grad"):
                bad = np.abs(r[k] - fd) > FD_RTOL * (np.abs(fd) + scale)
                if bad.any():
                    out.append(f"{name} {k} vs finite differences at {np.nonzero(bad)[0]}: "
                               f"{r[k][bad][:6]} vs {fd[bad][:6]}")
    for k in b:
        if k.startswith("_"):
            continue
        x, y = np.asarray(a.get(k)), np.asarray(b[k])
        if x.shape != y.shape:
            out.append(f"{k}: shape {x.shape} vs {y.shape}")
            continue
        if y.dtype.kind in "iub" or x.dtype.kind in "iub":
            if not np.array_equal(x.astype(np.int64), y.astype(np.int64)):
                bad = np.nonzero(x.astype(np.int64) != y.astype(np.int64))
                out.append(f"{k}: ints differ at {bad}: {x[bad][:6]} vs {y[bad][:6]}")
            continue
        rtol = (FD_RTOL if k == "dual" else  # Taichi rounds FwdMode's seed to f32
                RTOL16 if np.float16 in (x.dtype, y.dtype) else
                RTOL32 if f32 or np.float32 in (x.dtype, y.dtype) else RTOL)
        xf, yf = x.astype(np.float64), y.astype(np.float64)
        nan = np.isnan(xf) & np.isnan(yf)
        scale = np.nanmax(np.abs(yf[np.isfinite(yf)]), initial=1.0)
        with np.errstate(invalid="ignore"):  # inf - inf: equal infinities pass below
            close = np.abs(xf - yf) <= rtol * (np.abs(yf) + scale)
        close |= nan | (xf == yf)
        if not close.all():
            bad = np.nonzero(~close)
            out.append(f"{k}: floats differ at {bad}: {x[bad][:6]} vs {y[bad][:6]}")
    return out


def run_batch(seeds: list[int], work: Path, gen, timeout: float) -> dict[int, tuple]:
    """Both implementations on one batch; {seed: (difftape result, taichi result)}."""
    work.mkdir(parents=True, exist_ok=True)
    files = []
    for s in seeds:
        p = work / f"prog_{s}.py"
        p.write_text(gen(s))
        files.append(str(p))
    results = {}
    for backend, py in (("difftape", sys.executable), ("taichi", TAICHI_PYTHON)):
        out = work / f"{backend}.pkl"
        out.unlink(missing_ok=True)
        todo = list(files)
        while todo:
            cmd = [py, str(Path(__file__).resolve()), "--worker", backend, "--to", str(out), *todo]
            try:
                subprocess.run(cmd, timeout=timeout, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, cwd=str(work))
            except subprocess.TimeoutExpired:
                pass
            got = _read(out)
            rest = [f for f in todo if f not in got]
            if rest:  # the first missing one crashed or hung: record it and go on after it
                with open(out, "ab") as fh:
                    pickle.dump((rest[0], {"__error__": "crash or timeout"}), fh)
                rest = rest[1:]
            todo = rest
        results[backend] = _read(out)
    return {s: (results["difftape"].get(f), results["taichi"].get(f))
            for s, f in zip(seeds, files, strict=True)}


KINDS = {  # --kind: the generator of each kind of program (imported lazily: bench/ on sys.path)
    "program": lambda: __import__("fuzz_gen").program,
    "gradient": lambda: __import__("fuzz_gen").gradient_program,
    "features": lambda: __import__("fuzz_features").program,
    "features_gradient": lambda: __import__("fuzz_features").gradient_program,
    "areas": lambda: __import__("fuzz_areas").program,
    "areas_gradient": lambda: __import__("fuzz_areas").gradient_program,
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker")
    ap.add_argument("--to")
    ap.add_argument("--out", default="/tmp/fuzz")
    ap.add_argument("--seeds", default="0:200")
    ap.add_argument("--batch", type=int, default=40)
    ap.add_argument("--hours", type=float, default=0.0)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--kind", default="program", choices=list(KINDS))
    ap.add_argument("files", nargs="*")
    a = ap.parse_args()
    if a.worker:
        return worker(a.worker, a.files, a.to)
    sys.path.insert(0, str(HERE))
    gen = KINDS[a.kind]()
    lo, hi = (int(v) for v in a.seeds.split(":"))
    out = Path(a.out)
    (out / "disagree").mkdir(parents=True, exist_ok=True)
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {
        "programs": 0, "agree": 0, "both_error": 0, "disagree": [], "seconds": 0.0}
    start = time.time()
    s = lo
    while s < hi or a.hours:
        if a.hours and time.time() - start > a.hours * 3600:
            break
        seeds = list(range(s, s + a.batch))
        s += a.batch
        t0 = time.time()
        res = run_batch(seeds, out / "work", gen, a.timeout)
        for seed, (x, y) in res.items():
            x = x or {"__error__": "missing"}
            y = y or {"__error__": "missing"}
            summary["programs"] += 1
            diff = compare(x, y, "default_fp=ti.f32" in gen(seed))
            if x.get("__error__") and y.get("__error__"):
                summary["both_error"] += 1
            if not diff:
                summary["agree"] += 1
                continue
            kind = ("difftape_error" if x.get("__error__") else "taichi_error" if
                    y.get("__error__") else "values")
            summary.setdefault(kind, []).append(seed)
            summary["disagree"].append(seed)
            text = [gen(seed), "# ---- differences", *diff]
            for name, r in (("difftape", x), ("taichi", y)):
                text.append(f"# ---- {name}")
                text += [f"{k} = {v!r}" for k, v in r.items()]
            (out / "disagree" / f"{seed}.txt").write_text("\n".join(map(str, text)))
        summary["seconds"] += time.time() - t0
        summary["next_seed"] = s
        summary_path.write_text(json.dumps(summary, indent=1))
        print(f"seeds {seeds[0]}..{seeds[-1]}: {time.time() - t0:.0f}s, total "
              f"{summary['programs']} programs, {len(summary['disagree'])} disagreements, "
              f"{summary['both_error']} errors on both", flush=True)


if __name__ == "__main__":
    main()
