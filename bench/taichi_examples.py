"""Run the example programs that ship with Taichi 1.7.4 on difftape and on Taichi, headless, and
compare what they draw and print.

    .venv/bin/python bench/taichi_examples.py --output /tmp/examples [--only mpm88.py ...]

Each ``*.py`` under ``taichi/examples/`` of the Taichi wheel (``--examples``) is run twice, in
fresh processes with a time limit (``--timeout``): with Taichi (``--taichi-python``) and with
difftape through the ``taichi`` -> difftape alias (``taichi_compat/alias.py``), each in its own
temporary copy of the examples tree, from the example's directory, as ``bench/difftaichi.py``
runs DiffTaichi's (``bench/program_runs.py``: seeded ``random``/NumPy, ``ti.init`` on the CPU,
and with ``fast_math=False`` on both, ``difftaichi.STRICT``: the same IEEE evaluation, so that
what is compared is the program, not two compilers' rounding choices, which an iterated map
such as a fractal's turns into different pixels; ``--fast-math`` keeps the defaults).
Both runs draw into the same recording stand-ins (``taichi_compat/headless/_record.py``):
``ti.GUI`` and ``ti.ui`` (GGUI: Window, Canvas, Scene, Camera; Taichi's own needs Vulkan),
which keep every array handed to them per frame (fields and ndarrays through ``to_numpy``) and
end the program after ``--frames`` frames (``FRAMES``, or the example's ``Spec``).

What is compared, per example:

* *exact* (the default): every frame, every drawing call, every argument; arrays element by
  element with ``|taichi - difftape| <= RTOL * max(|taichi|, |difftape|) + RTOL * scale``
  (``scale``: the largest magnitude in Taichi's array, so that a value near zero in a field of
  large values is held to that field's precision; f32 programs on two compilers), bytes (uint8
  images) within 1, other integers and strings exactly; then the numbers printed, in order, at
  ``RTOL`` (timing lines dropped).
* *structure* (``Spec.judged`` 0): a scene animated by the wall clock; *first K frames*
  (``Spec.judged``): a chaotic scene, where rounding differences between two
  compilers grow to the size of the picture within a few frames: frames after the K-th are
  compared by structure only (the same calls with arrays of the same shapes), prints are not
  compared.
* *distribution*: the program fills fields with ``ti.random``/``ti.randn`` in a kernel (found in
  its source), whose streams differ between the backends: the first frame's float arrays are
  compared by per-column mean and standard deviation (within ``SIGMAS`` standard errors of the
  two samples; the standard deviation also within ``STD_RTOL``), later frames by structure
  only, prints not at all.

Verdicts: agrees (to the tolerance above; *first K frames*, *in distribution* say which
comparison), differs (the first differing frame, call, argument, index and the two values),
no output (neither drew nor printed anything: nothing to compare), refused (a difftape error),
error, crash, hang, baseline-fails (Taichi itself cannot run it headless here: why), with both
wall times. Files an example writes (PLY meshes, images, videos) are compared too: the same
names; in an *exact* comparison the same bytes, or the same pixels (PNG) or numbers (text).
Writes OUTPUT.json and OUTPUT.md.
"""

from __future__ import annotations

import argparse
import math
import pickle
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from difftaichi import STRICT  # noqa: E402
from program_runs import HEADLESS  # noqa: E402

sys.path.append(str(HEADLESS))
from _noop import read_png  # noqa: E402  (the headless stand-ins' PNG reader)
from program_runs import (  # noqa: E402  (bench/program_runs.py: what the harnesses share)
    Run,
    add_arguments,
    compare,
    report_markdown,
    result_lines,
    run_all,
    run_one,
    unfinished,
    write_runner,
)

EXAMPLES = Path("/work/tivenv/lib/python3.11/site-packages/taichi/examples")
FRAMES = 3
RTOL = 1e-3
SIGMAS = 6.0
#: A standard deviation may also differ by this fraction: the samples of a picture (pixels)
#: are not independent draws, its spread is mostly the picture's own, and the Monte Carlo
#: noise on top moves it by about a percent (cornell_box.py).
STD_RTOL = 0.05
RANDOM = re.compile(r"\bti\.(random|randn)\s*\(")


@dataclass
class Spec:
    """How to run and judge one example: ``argv``; ``init``: more ``ti.init`` options (on
    both backends); ``frames`` to run (default ``--frames``);
    ``judged``: only the first this many frames are compared value by value (chaotic scenes),
    with ``why``; ``ignore``: regexes of printed lines that are not results; ``not_run``: why
    it is not run at all; ``unordered``: the program's parallel loops append what it draws in
    whatever order the threads run (``ti.atomic_add`` on a counter), so the rows of a call's
    arrays are compared in sorted order (rows of equal-length arrays kept together);
    ``unordered_prints``: it prints from parallel loops, in whatever order the threads run
    (Taichi's own runs differ), so its printed lines are compared in sorted order."""

    argv: list[str] = field(default_factory=list)
    init: dict = field(default_factory=dict)
    frames: int | None = None
    judged: int | None = None
    why: str = ""
    ignore: list[str] = field(default_factory=list)
    not_run: str = ""
    unordered: bool = False
    unordered_prints: bool = False


#: Examples that need more than the defaults (keyed by path under examples/).
#: Why a scene animated by the wall clock is compared by structure only.
CLOCK = "animated by the wall clock (the two runs draw different moments): structure only"

SPECS: dict[str, Spec] = {
    "algorithm/marching_squares.py": Spec(judged=0, why=CLOCK),
    "real_func/algorithm/marching_squares.py": Spec(judged=0, why=CLOCK),
    "simulation/initial_value_problem.py": Spec(judged=0, why=CLOCK),
    "algorithm/mciso_advanced.py": Spec(unordered=True, why="triangles in sorted order "
                                        "(appended by a parallel loop)"),
    "features/sparse/tutorial.py": Spec(
        unordered_prints=True, why="lines printed by parallel struct-fors compared in sorted "
                                   "order (Taichi's own runs print the blocks in either order)"),
    "simulation/eulerfluid2d.py": Spec(
        init={"debug": True},
        why="reads outside its fields (curl, divergence and pressure_iteration read vf[i - 1, "
            "j] ... at the border, e.g. index (-1, 0) of a (512, 512) field): without checks "
            "Taichi reads neighbouring memory and, depending on its layout, crashes (SIGSEGV "
            "in pressure_iteration), so both run with ti.init(debug=True), where both refuse"),
    "ggui_examples/mass_spring_3d_ggui.py": Spec(
        judged=0, why="one ti.random() offset moves the whole cloth: no sample to compare "
                      "statistics of; structure only"),
    "rendering/sdf_renderer.py": Spec(frames=1, why="one frame (its first shows 11 samples "
                                      "of a 1280x720 path tracer)"),
    "machine_learning/differential_evolution.py": Spec(
        init={"debug": True},
        why="reads and writes outside its fields (clip_only reads _ub[j] for j up to 19 of a "
            "field of shape (2,); DE writes best_fit[50] and all_pop[50, ...], one past the "
            "end): without checks Taichi reads and writes neighbouring memory and difftape's "
            "stray writes crash it, so both run with ti.init(debug=True), where both refuse"),
}


def mode(spec: Spec, source: str) -> str:
    """How the example's output is compared: ``exact``, ``first K frames``, ``distribution``."""
    if spec.judged == 0:
        return "structure"
    if RANDOM.search(source):
        return "distribution"
    if spec.judged is not None:
        return f"first {spec.judged} frames"
    return "exact"


@dataclass
class Diff:
    """The first difference between two recordings, or none (``where`` empty)."""

    where: str = ""
    values: int = 0
    worst: float = 0.0


def _label(frame: int, k: int, call: str, arg: str) -> str:
    return f"frame {frame}, call {k} {call}, argument {arg}"


def compare_value(a, b, where: str, out: Diff) -> None:
    """Element-wise comparison (see the module's docstring); the first difference into ``out``."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            out.where = f"{where}: shape {a.shape} (Taichi) vs {b.shape} (difftape)"
            return
        if a.dtype.kind in "biu" and b.dtype.kind in "biu":
            tol = 1 if a.dtype == np.uint8 else 0
            d = np.abs(a.astype(np.int64) - b.astype(np.int64))
            bad = d > tol
            scale = 1.0
        else:
            x, y = a.astype(np.float64), b.astype(np.float64)
            finite = np.isfinite(x)
            scale = float(np.abs(x[finite]).max()) if finite.any() else 1.0
            d = np.abs(x - y)
            bad = ~(d <= RTOL * np.maximum(np.abs(x), np.abs(y)) + RTOL * scale)
            bad &= ~(np.isnan(x) & np.isnan(y)) & ~(x == y)
        out.values += a.size
        if a.size:
            worst = float(np.nanmax(np.where(np.isfinite(d), d, np.inf))) / max(scale, 1e-30)
            out.worst = max(out.worst, worst)
        if bad.any():
            i = tuple(int(v) for v in np.argwhere(bad)[0])
            out.where = (f"{where}, index {list(i)}: Taichi {a[i]!r} / difftape {b[i]!r} "
                         f"({int(bad.sum())} of {a.size} elements differ)")
        return
    if isinstance(a, float) and isinstance(b, float | int) or isinstance(b, float) and \
            isinstance(a, int):
        compare_value(np.float64(a)[None], np.float64(b)[None], where, out)
    elif a != b:
        out.where = f"{where}: Taichi {a!r} / difftape {b!r}"


def _columns(a: np.ndarray) -> np.ndarray:
    """(samples, components): the last axis as components when it is a short vector."""
    if a.ndim >= 2 and a.shape[-1] <= 4:
        return a.reshape(-1, a.shape[-1]).astype(np.float64)
    return a.reshape(-1, 1).astype(np.float64)


def compare_statistics(a, b, where: str, out: Diff) -> None:
    """Per-column mean and standard deviation of two arrays drawn from the same distribution
    by different random streams, within ``SIGMAS`` standard errors."""
    if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)) or a.dtype.kind not in "fc":
        return
    if a.shape != b.shape:
        out.where = f"{where}: shape {a.shape} (Taichi) vs {b.shape} (difftape)"
        return
    x, y = _columns(a), _columns(b)
    n = x.shape[0]
    if n < 2 or not (np.isfinite(x).all() and np.isfinite(y).all()):
        if np.isfinite(x).all() != np.isfinite(y).all():
            out.where = f"{where}: non-finite values in one run only"
        return
    out.values += a.size
    scale = max(float(np.abs(x).max()), 1e-30)
    for c in range(x.shape[1]):
        sa, sb = x[:, c].std(), y[:, c].std()
        checks = (("mean", x[:, c].mean(), y[:, c].mean(), math.sqrt((sa**2 + sb**2) / n), 0),
                  ("std", sa, sb, (sa + sb) / 2 / math.sqrt(2 * n), STD_RTOL * max(sa, sb)))
        for what, u, v, se, slack in checks:
            out.worst = max(out.worst, abs(u - v) / scale)
            if abs(u - v) > SIGMAS * se + slack + 1e-6 * scale:
                out.where = (f"{where}, component {c}: {what} Taichi {u:.6g} / difftape {v:.6g}"
                             f" (allowed {SIGMAS:g} standard errors, {SIGMAS * se:.3g})")
                return


def in_order(values: dict) -> dict:
    """A drawing call's arguments with the rows of its arrays sorted: the arrays as long as
    its first array are permuted together, by their rows read side by side."""
    arrays = {k: v for k, v in values.items() if isinstance(v, np.ndarray) and v.ndim}
    if not arrays:
        return values
    n = len(next(iter(arrays.values())))
    rows = {k: v.reshape(n, -1) for k, v in arrays.items() if len(v) == n}
    order = np.lexsort(np.concatenate(list(rows.values()), 1).T[::-1])
    return {**values, **{k: values[k][order] for k in rows}}


def compare_frames(ta: list, da: list, how: str, judged: int | None,
                   unordered: bool = False) -> Diff:
    """Compare two recordings (lists of frames of ``(call, {argument: value})``): structure
    everywhere, values as ``how`` says (``exact``, ``distribution``) in the first ``judged``
    frames (all when None)."""
    out = Diff()
    if len(ta) != len(da):
        out.where = f"Taichi showed {len(ta)} frames, difftape {len(da)}"
        return out
    for f, (fa, fb) in enumerate(zip(ta, da, strict=True)):
        names_a, names_b = [c for c, _ in fa], [c for c, _ in fb]
        if names_a != names_b:
            k = next((i for i, (x, y) in enumerate(zip(names_a, names_b, strict=False))
                      if x != y),
                     min(len(names_a), len(names_b)))
            out.where = (f"frame {f}: drawing call {k} is "
                         f"{names_a[k] if k < len(names_a) else 'missing'} (Taichi) / "
                         f"{names_b[k] if k < len(names_b) else 'missing'} (difftape)")
            return out
        for k, ((call, va), (_, vb)) in enumerate(zip(fa, fb, strict=True)):
            if unordered:
                va, vb = in_order(va), in_order(vb)
            if sorted(va) != sorted(vb):
                out.where = f"frame {f}, call {k} {call}: arguments {sorted(va)} / {sorted(vb)}"
                return out
            for arg in va:
                where = _label(f, k, call, arg)
                a, b = va[arg], vb[arg]
                values = judged is None or f < judged
                if how == "distribution":
                    if f == 0:
                        compare_statistics(a, b, where, out)
                    values = False
                if values:
                    compare_value(a, b, where, out)
                elif np.shape(a) != np.shape(b) or type(a) is not type(b):
                    out.where = (f"{where}: {type(a).__name__} {np.shape(a)} (Taichi) vs "
                                 f"{type(b).__name__} {np.shape(b)} (difftape)")
                if out.where:
                    return out
    return out


def prepare(examples: Path, root: Path, backend: str, rel: str, spec: Spec, frames: int,
            init: dict) -> tuple[Path, Path]:
    """A temporary copy of the examples tree with the runner for ``rel`` (``init``: added to
    ``ti.init``'s options); (the copy, the example's directory in it)."""
    work = root / backend / rel.replace("/", "__")[:-3]
    shutil.copytree(examples, work, ignore=shutil.ignore_patterns("__pycache__"))
    script = work / rel
    write_runner(work, backend, script, spec.argv, {**init, **spec.init}, gui="record",
                 frames=spec.frames or frames, record=str(work / "_frames.pkl"),
                 examples=str(work))
    return work, script.parent


def load_frames(work: Path) -> list:
    """The frames a run recorded (none where it wrote none, or they cannot be read back)."""
    path = work / "_frames.pkl"
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except (OSError, pickle.UnpicklingError, ImportError, EOFError):
        return []


#: Files a run writes that are the harness's, not the program's.
HARNESS_FILES = ("_frames.pkl", "_run_example.py")
MAX_FILE = 64 << 20


def written_files(work: Path, examples: Path) -> dict[str, bytes]:
    """The files a run wrote into its copy of the examples tree, by path (those of the tree
    itself, the harness's and caches left out; a file over ``MAX_FILE`` bytes by its size)."""
    out = {}
    for p in sorted(work.rglob("*")):
        rel = p.relative_to(work)
        if (not p.is_file() or rel.parts[0] in ("_cache", "_alias") or "__pycache__" in rel.parts
                or rel.name in HARNESS_FILES or (examples / rel).exists()):
            continue
        size = p.stat().st_size
        out[str(rel)] = p.read_bytes() if size <= MAX_FILE else f"{size} bytes".encode()
    return out


def compare_files(ta: dict[str, bytes], da: dict[str, bytes], how: str, out: Diff) -> None:
    """The files both runs wrote: the same names; in an *exact* comparison the same bytes,
    or, where they differ, the same pixels (PNG, as images are compared) or the same numbers
    at ``RTOL`` (text); the first difference into ``out``."""
    if sorted(ta) != sorted(da):
        out.where = f"files written: Taichi {sorted(ta)} / difftape {sorted(da)}"
        return
    for name in ta if how == "exact" else ():
        a, b = ta[name], da[name]
        if a == b:
            out.values += len(a)
            continue
        where = f"file {name}"
        if name.endswith(".png"):
            compare_value(read_png(a), read_png(b), where, out)
        else:
            try:
                la, lb = (result_lines(x.decode()) for x in (a, b))
            except UnicodeDecodeError:
                k = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                         min(len(a), len(b)))
                out.where = (f"{where}: byte {k} differs ({len(a)} bytes from Taichi, "
                             f"{len(b)} from difftape)")
                return
            agree, first, worst = compare(la, lb, RTOL)
            out.values += sum(len(n) for _, n in la)
            out.worst = max(out.worst, worst)
            if not agree:
                out.where = f"{where}: {first}"
        if out.where:
            return


def judge(t: Run, d: Run, tf: list, df: list, spec: Spec, how: str,
          files: tuple[dict, dict] = ({}, {})) -> dict:
    """The verdict for two runs that both finished (``files``: what each wrote)."""
    out: dict = {}
    diff = compare_frames(tf, df, how, spec.judged, spec.unordered)
    if not diff.where:
        compare_files(*files, how, diff)
    out.update(frames=len(tf), values_compared=diff.values, max_rel_diff=diff.worst)
    if files[0]:
        out["files"] = len(files[0])
    if diff.where:
        out.update(verdict="differs", detail=diff.where)
        return out
    ta, da = result_lines(t.stdout, spec.ignore), result_lines(d.stdout, spec.ignore)
    if spec.unordered_prints:
        ta, da = sorted(ta), sorted(da)
    note = ""
    if how == "exact":
        agree, first, worst = compare(ta, da, RTOL)
        out["values_compared"] += sum(len(n) for _, n in ta)
        out["max_rel_diff"] = max(diff.worst, worst)
        if not agree:
            out.update(verdict="differs", detail="printed: " + first)
            return out
    elif ta or da:
        note = "; prints not compared"
    if not tf and not ta and not files[0]:
        out.update(verdict="no output", detail="neither run drew, printed or wrote anything")
        return out
    label = {"exact": "agrees", "distribution": "agrees in distribution"}.get(
        how, f"agrees ({how})")
    out.update(verdict=label, detail=(spec.why + note).lstrip("; "))
    return out


def markdown(report: dict) -> str:
    return report_markdown(
        report, "Taichi's examples",
        f"{report['meta']['frames']} frames per example unless noted; arrays and prints at "
        f"rtol {RTOL:g} (see bench/taichi_examples.py)", ", ti.init(fast_math=False) on both",
        [("compared", "mode"), ("verdict", "verdict"), ("frames", "frames"),
         ("values", "values_compared"), ("files", "files"), ("max rel diff", "max_rel_diff"),
         ("Taichi s", "taichi_seconds"), ("difftape s", "difftape_seconds"),
         ("detail", "detail")], summary=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=Path, default=EXAMPLES,
                    help="taichi/examples of a Taichi 1.7.4 installation")
    ap.add_argument("--frames", type=int, default=FRAMES, help=f"frames shown (default {FRAMES})")
    add_arguments(ap, timeout=300)
    args = ap.parse_args(argv)

    examples_dir = args.examples.resolve()
    names = sorted(str(p.relative_to(examples_dir)) for p in examples_dir.rglob("*.py")
                   if p.name != "__init__.py" and "__pycache__" not in p.parts)
    if args.only:
        names = [n for n in names if n in args.only or Path(n).name in args.only]

    def one(name: str, root: Path) -> dict:
        spec = SPECS.get(name, Spec())
        if spec.not_run:
            return {"verdict": "not run", "detail": spec.not_run}
        how = mode(spec, (examples_dir / name).read_text())
        runs: dict[str, Run] = {}
        frames: dict[str, list] = {}
        files: dict[str, dict] = {}
        for backend, python in (("difftape", args.difftape_python),
                                ("taichi", args.taichi_python)):
            work, cwd = prepare(examples_dir, root, backend, name, spec, args.frames,
                                {} if args.fast_math else STRICT)
            runs[backend] = run_one(python, work, backend, args.timeout, cwd=cwd)
            frames[backend] = load_frames(work)
            files[backend] = written_files(work, examples_dir)
            if not args.keep:
                shutil.rmtree(work, ignore_errors=True)
        r = {"mode": how, **unfinished(runs["taichi"], runs["difftape"])}
        if "verdict" not in r:
            r.update(judge(runs["taichi"], runs["difftape"], frames["taichi"],
                           frames["difftape"], spec, how, (files["taichi"], files["difftape"])))
        elif spec.why:
            r["detail"] += f" ({spec.why})"
        r["output"] = {b: run.stdout[-2000:] for b, run in runs.items()}
        r["stderr_tail"] = {b: run.stderr_tail[-1500:] for b, run in runs.items()}
        return r

    return run_all(args, names, one, {"frames": args.frames, "fast_math": args.fast_math,
                                      "examples": str(examples_dir)}, markdown,
                   "taichi_examples_")


if __name__ == "__main__":
    sys.exit(main())
