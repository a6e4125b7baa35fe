"""Run a DiffTaichi example that draws with ``ti.GUI`` on Taichi 1.7.4 and on difftape, and
compare the frames they write, pixel by pixel.

    .venv/bin/python bench/gui_frames.py --checkout /work/difftaichi --output /tmp/gui_frames

The example is prepared as ``bench/difftaichi.py`` prepares it (a temporary copy cut to
``--iters`` iterations, f64 with ``fast_math=False`` for chaotic scenes, seeded random inputs,
the ``taichi`` -> difftape alias), but with the real ``ti.GUI``: it runs unchanged with
``TI_GUI_SHOW=0`` in the environment (the examples construct ``ti.GUI`` with Taichi's default
``show_gui=True``; both Taichi and difftape read the variable), and writes its frames as it would
on a desktop. Each frame that both runs wrote is compared: the pixels that differ and the largest
channel difference.

Where frames differ, the question is whether the drawing differs or the simulations do. A third
run, Taichi again with every random input one ulp larger (``DIFFTAICHI_NUDGE``, as in
``bench/difftaichi.py``), answers it: a chaotic simulation's own rounding sensitivity shows up as
Taichi-vs-nudged-Taichi frame differences; difftape's frames agree "within rounding" when each
frame differs from Taichi's no more than the nudged Taichi run's frame does (or not at all).
Writes OUTPUT/report.md and OUTPUT/report.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import difftaichi  # noqa: E402  (bench/difftaichi.py: preparing and running the examples)


def frames(root: Path) -> dict[str, Path]:
    """The PNG files the example wrote under its working copy, by relative path."""
    skip = {"_cache", "_alias"}
    out = {}
    for p in sorted(root.rglob("*.png")):
        rel = p.relative_to(root)
        if rel.parts[0] in skip or len(rel.parts) == 1:  # inputs shipped with the examples
            continue
        out[str(rel)] = p
    return out


def load(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"), np.int16)


def diff(a: Path, b: Path) -> tuple[int, int]:
    """(pixels that differ, largest channel difference) of two frames."""
    x, y = load(a), load(b)
    if x.shape != y.shape:
        return -1, -1
    d = np.abs(x - y).max(axis=2)
    return int((d > 0).sum()), int(d.max())


def run(python: str, checkout: Path, root: Path, backend: str, name: str, iters: int,
        timeout: float, nudge: bool = False) -> tuple[Path, difftaichi.Run]:
    spec = difftaichi.EXAMPLES[name]
    label = backend + ("-nudged" if nudge else "")
    work, _ = difftaichi.prepare(checkout, root / label, backend, name, spec, iters, gui="real")
    result = difftaichi.run_one(python, work, backend, timeout, nudge=nudge)
    if result.rc != 0:
        raise RuntimeError(f"{label} run of {name} failed ({result.rc}):\n{result.stderr_tail}")
    return work, result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkout", type=Path, required=True, help="a taichi-dev/difftaichi checkout")
    ap.add_argument("--output", type=Path, required=True)
    ap.add_argument("--example", default="mass_spring.py", choices=sorted(difftaichi.EXAMPLES))
    ap.add_argument("--iters", type=int, default=1)
    ap.add_argument("--taichi-python", default="/work/tivenv/bin/python")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--no-nudge", action="store_true", help="skip the nudged Taichi run")
    args = ap.parse_args()

    os.environ["TI_GUI_SHOW"] = "0"
    root = args.output / "runs"
    shutil.rmtree(root, ignore_errors=True)
    runs = {}
    for backend, python, nudge in [("difftape", sys.executable, False),
                                   ("taichi", args.taichi_python, False),
                                   ("taichi", args.taichi_python, True)]:
        if nudge and args.no_nudge:
            continue
        work, result = run(python, args.checkout.resolve(), root, backend, args.example,
                           args.iters, args.timeout, nudge)
        runs[backend + ("-nudged" if nudge else "")] = (frames(work), result.seconds)
        print(f"{backend}{' (nudged)' if nudge else ''}: {len(runs[list(runs)[-1]][0])} frames "
              f"in {result.seconds:.0f} s", flush=True)

    ti_frames, dt_frames = runs["taichi"][0], runs["difftape"][0]
    nudged = runs.get("taichi-nudged", ({}, 0))[0]
    names = sorted(set(ti_frames) | set(dt_frames))
    rows = []
    for n in names:
        if n not in ti_frames or n not in dt_frames:
            rows.append({"frame": n, "missing": "taichi" if n not in ti_frames else "difftape"})
            continue
        px, mx = diff(ti_frames[n], dt_frames[n])
        row = {"frame": n, "pixels": px, "max": mx}
        if n in nudged:
            row["nudged_pixels"], row["nudged_max"] = diff(ti_frames[n], nudged[n])
        rows.append(row)
    compared = [r for r in rows if "pixels" in r]
    identical = sum(r["pixels"] == 0 for r in compared)
    within = [r for r in compared
              if r["pixels"] == 0 or ("nudged_pixels" in r and r["pixels"] <= r["nudged_pixels"])]
    first = next((r["frame"] for r in compared if r["pixels"]), None)
    summary = {
        "example": args.example, "iters": args.iters, "frames": len(names),
        "compared": len(compared), "identical": identical,
        "within_rounding": len(within) if nudged else None,
        "missing": [r for r in rows if "missing" in r], "first_differing": first,
        "seconds": {k: v[1] for k, v in runs.items()},
    }
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "report.json").write_text(json.dumps({"summary": summary, "frames": rows},
                                                        indent=1))
    lines = [f"# {args.example}: frames written by Taichi 1.7.4 and by difftape", "",
             f"{len(compared)} frames compared, {identical} identical; first differing: "
             f"{first or 'none'}; frames differing no more than a 1-ulp-nudged Taichi run's: "
             f"{len(within) if nudged else 'not run'} of {len(compared)}.", "",
             "| frame | pixels differing (difftape vs Taichi) | max channel diff "
             "| pixels differing (nudged Taichi vs Taichi) | max |",
             "| --- | --- | --- | --- | --- |"]
    for r in rows:
        if "missing" in r:
            lines.append(f"| {r['frame']} | missing in {r['missing']} | | | |")
        else:
            lines.append(f"| {r['frame']} | {r['pixels']} | {r['max']} | "
                         f"{r.get('nudged_pixels', '')} | {r.get('nudged_max', '')} |")
    (args.output / "report.md").write_text("\n".join(lines) + "\n")
    print(lines[2])


if __name__ == "__main__":
    main()
