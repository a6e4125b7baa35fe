"""Run DiffTaichi's examples on difftape and on Taichi 1.7.4, headless, and compare their output.

    .venv/bin/python bench/difftaichi.py --checkout /work/difftaichi --output /tmp/difftaichi

For each example in ``examples/*.py`` of a taichi-dev/difftaichi checkout it makes a temporary
copy of the examples directory, cuts the optimisation to a few iterations by rewriting the
example's known iteration constant (``EXAMPLES`` below: each rewrite must match exactly once,
so a changed example is reported instead of silently run in full), and runs it twice in fresh
processes: with Taichi (``--taichi-python``) and with difftape through the ``taichi`` ->
difftape alias (``bench/taichi_compat/alias.py``). Both runs are headless: ``ti.GUI`` is a
no-op object (``taichi_compat/headless/_noop.py``; with ``ti.rgb_to_hex``, its colour helper,
where the backend has none), ``ti.init`` runs on the CPU whatever arch
the example asks for (there is no GPU here, and Taichi 1.7.4 crashes while falling back from
``arch=ti.gpu``), matplotlib uses the Agg backend (or a
no-op stand-in where it is not installed), OpenCV / imageio are stand-ins that read PNGs and
write nothing; Python's ``random`` and NumPy's generator are seeded with 0.

The numbers each run prints (losses, gradient norms), minus timing lines, are compared in order:
relative tolerance ``F32_RTOL`` for f32 scenes; scenes marked chaotic in ``EXAMPLES`` (contacts
make tiny rounding differences grow) are run in f64 (``real = ti.f32`` rewritten to ``ti.f64``
in the copy) with ``ti.init(fast_math=False)`` on both backends (``STRICT``: the same IEEE
evaluation, so that what is compared is the program, not two compilers' rounding choices;
``--fast-math`` keeps the defaults) and compared with ``F64_RTOL``. Per example the verdict is:
agrees, differs (the first differing value), agrees within chaos (a chaotic scene that differs,
but only from the first value that Taichi itself cannot reproduce when every random number the
example draws is one ulp larger, and there by at most ``CHAOS_FACTOR`` times Taichi's own move:
a third run, on Taichi, made only in that case; later values are not judged), refused (difftape
raised one of its errors), error (any other exception), crash (a signal), hang (``--timeout``),
or baseline-fails (Taichi itself cannot run it headless here), with both wall times. difftape
runs first; where it stops with an error, Taichi is not run (its output could not change the
verdict) unless ``--always-baseline``. Writes OUTPUT.json and OUTPUT.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
COMPAT = BENCH / "taichi_compat"

F32_RTOL = 1e-3
F64_RTOL = 1e-7
ATOL = 1e-9
#: A chaotic scene whose values differ beyond ``F64_RTOL`` still agrees *within chaos* when every
#: value's difference is at most this many times the distance between two Taichi runs whose
#: random inputs differ by one ulp (see ``within_chaos``).
CHAOS_FACTOR = 10
#: What ``ti.init`` gets in a chaotic scene, on both backends: IEEE evaluation as written. By
#: default the two round differently (Taichi lets LLVM reassociate, difftape fuses
#: multiply-adds and takes transcendentals from libmvec), and a contact scene amplifies a last
#: bit into 1e-4 (rigid_body.py); with this, difftape's forward pass of rigid_body.py is bit for
#: bit Taichi's. ``--fast-math`` compares the defaults instead.
STRICT = {"fast_math": False}


@dataclass
class Example:
    """How to run one example briefly: ``argv``, source ``rewrites`` (old, new) applied to the
    temporary copy (``{iters}`` is the iteration count), whether it is ``chaotic`` (run in
    f64), and line filters for output that is not a result (``ignore``: regexes)."""

    argv: list[str] = field(default_factory=list)
    rewrites: list[tuple[str, str]] = field(default_factory=list)
    chaotic: bool = False
    ignore: list[str] = field(default_factory=list)


#: The examples this harness knows how to cut short. Iteration counts come from ``--iters``.
EXAMPLES: dict[str, Example] = {
    "billiards.py": Example(rewrites=[("for iter in range(200):", "for iter in range({iters}):")],
                            chaotic=True),
    "diffmpm.py": Example(argv=["--iters", "{iters}"], chaotic=True),
    "diffmpm3d.py": Example(argv=["--iters", "{iters}"], chaotic=True),
    "diffmpm_benchmark.py": Example(
        rewrites=[("iters = 100000", "iters = 2"), ("for i in range(30):",
                                                    "for i in range({iters}):")],
        chaotic=True),
    "diffmpm_checkpointing.py": Example(argv=["--iters", "{iters}"], chaotic=True),
    "diffmpm_simple.py": Example(rewrites=[("for i in range(30):", "for i in range({iters}):")],
                                 chaotic=True),
    "electric.py": Example(rewrites=[
        ("for iter in range(200000):", "for iter in range({iters}):"),
        ('# print(iter, "loss", loss[None])', 'print(iter, "loss", loss[None])')]),
    # liquid.py calls ti.clear_all_gradients(), which Taichi 1.7.4 has only as
    # ti.ad.clear_all_gradients() (the same rename diffmpm3d.py already has).
    "liquid.py": Example(rewrites=[("for iter in range(501):", "for iter in range({iters}):"),
                                   ("ti.clear_all_gradients()", "ti.ad.clear_all_gradients()")],
                         chaotic=True),
    "mass_spring.py": Example(argv=["0", "train", "--iters", "{iters}"], chaotic=True),
    "mass_spring_interactive.py": Example(argv=["0", "--iters", "{iters}"], chaotic=True,
                                          ignore=[r"^\S+\s+[12]$"]),
    "mass_spring_simple.py": Example(
        rewrites=[("for iter in range(25):", "for iter in range({iters}):")], chaotic=True),
    "rigid_body.py": Example(argv=["0", "train"],
                             rewrites=[("for iter in range(20):", "for iter in range({iters}):")],
                             chaotic=True),
    "smoke_taichi.py": Example(argv=["--iters", "{iters}"]),
    "smoke_taichi_cpu.py": Example(argv=["--iters", "{iters}"]),
    "smoke_taichi_gpu.py": Example(argv=["--iters", "{iters}"]),
    "wave.py": Example(argv=["--iters", "{iters}"]),
}

#: Files in examples/ that are not Taichi examples runnable here, and why.
NOT_RUN = {
    "adversarial.py": "PyTorch/torchvision program, no Taichi",
    "smoke_autograd.py": "autograd (NumPy AD) version of smoke, no Taichi",
    "smoke_jax.py": "JAX version of smoke, no Taichi",
    "smoke_pytorch.py": "PyTorch version of smoke, no Taichi",
    "plot_losses.py": "plots saved losses, no Taichi",
    "robot_config.py": "configuration module imported by rigid_body.py",
    "mass_spring_robot_config.py": "configuration module imported by mass_spring*.py",
    "volume_renderer.py": "downloads its data set over the network",
    "water_renderer.py": "imports adversarial.py (PyTorch, VGG weights)",
}

#: Output lines that are timings or progress, not results.
TIMING = re.compile(r"time|\bms\b|per iter|\[Taichi\]|^\s*\[[IWE] |Kernel Profiler",
                    re.IGNORECASE)
NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?|[-+]?(?:nan|inf)\b")

RUNNER = """\
import os, random, runpy, sys
sys.path.append({headless!r})
random.seed(0)
import numpy as np
np.random.seed(0)
if os.environ.get("DIFFTAICHI_NUDGE"):
    def _nudged(draw):
        def nudged(*args, **kwargs):
            r = draw(*args, **kwargs)
            up = np.nextafter(r, np.inf)
            return float(up) if isinstance(r, float) else up
        return nudged
    for _name in ("randn", "rand", "random", "random_sample", "uniform", "normal"):
        setattr(np.random, _name, _nudged(getattr(np.random, _name)))
    random.random = _nudged(random.random)
    random.uniform = _nudged(random.uniform)
import taichi as ti
import _noop
ti.GUI = _noop.NoGUI
if not hasattr(ti, "rgb_to_hex"):
    ti.rgb_to_hex = _noop.rgb_to_hex
_init = ti.init
def _cpu_init(arch=None, **kwargs):
    kwargs.update({init!r})
    return _init(arch=ti.cpu, **kwargs)
ti.init = _cpu_init
script = {script!r}
sys.path.insert(0, os.path.dirname(script))
sys.argv = [script, *{argv!r}]
runpy.run_path(script, run_name="__main__")
"""


@dataclass
class Run:
    rc: int | None
    seconds: float
    stdout: str
    stderr_tail: str
    timed_out: bool = False


def prepare(checkout: Path, root: Path, backend: str, name: str, spec: Example,
            iters: int, strict: bool = True) -> tuple[Path, list[str]]:
    """A temporary copy of examples/ with the rewrites applied to ``name``; the argv.
    ``strict``: a chaotic scene's ``ti.init`` gets ``fast_math=False`` (see ``STRICT``)."""
    work = root / backend / name[:-3]
    shutil.copytree(checkout / "examples", work)
    script = work / name
    src = script.read_text()
    rewrites = [(a, b.format(iters=iters)) for a, b in spec.rewrites]
    if spec.chaotic:
        rewrites.append(("real = ti.f32", "real = ti.f64"))
    for old, new in rewrites:
        count = src.count(old)
        if count != 1:
            raise RuntimeError(f"{name}: expected {old!r} once, found it {count} times; "
                               "update EXAMPLES in bench/difftaichi.py")
        src = src.replace(old, new)
    script.write_text(src)
    if backend == "difftape":
        (work / "_alias" / "taichi").mkdir(parents=True)
        shutil.copy(COMPAT / "alias.py", work / "_alias" / "taichi" / "__init__.py")
    argv = [a.format(iters=iters) for a in spec.argv]
    init = STRICT if spec.chaotic and strict else {}
    (work / "_run_example.py").write_text(RUNNER.format(
        headless=str(COMPAT / "headless"), script=str(script), argv=argv, init=init))
    return work, argv


def run_one(python: str, work: Path, backend: str, timeout: float, nudge: bool = False) -> Run:
    """Run the prepared copy; ``nudge``: every float NumPy/``random`` draws is one ulp up."""
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONDONTWRITEBYTECODE="1",
               DIFFTAPE_CACHE_DIR=str(work / "_cache"),
               TI_OFFLINE_CACHE_FILE_PATH=str(work / "_cache"))
    if nudge:
        env["DIFFTAICHI_NUDGE"] = "1"
    if backend == "difftape":
        env["PYTHONPATH"] = str(work / "_alias")
    t0 = time.perf_counter()
    try:
        p = subprocess.run([python, "_run_example.py"], cwd=work, env=env, capture_output=True,
                           text=True, timeout=timeout)
        return Run(p.returncode, time.perf_counter() - t0, p.stdout, p.stderr[-4000:])
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
        return Run(None, time.perf_counter() - t0, out or "", (err or "")[-4000:], True)


def result_lines(stdout: str, spec: Example) -> list[tuple[str, list[float]]]:
    """The printed lines that carry results, with their numbers."""
    ignore = [re.compile(p) for p in spec.ignore]
    out = []
    for line in stdout.splitlines():
        if TIMING.search(line) or any(p.search(line) for p in ignore):
            continue
        nums = [float(x) for x in NUMBER.findall(line)]
        if nums:
            out.append((line.strip(), nums))
    return out


def compare(a: list, b: list, rtol: float) -> tuple[bool, str, float]:
    """(agree, first difference, largest relative difference) of two runs' result lines."""
    worst = 0.0
    for i, ((la, na), (lb, nb)) in enumerate(zip(a, b, strict=False)):
        if len(na) != len(nb):
            return False, f"line {i + 1}: Taichi `{la}` / difftape `{lb}`", math.inf
        for x, y in zip(na, nb, strict=True):
            if math.isnan(x) or math.isnan(y):
                same = math.isnan(x) and math.isnan(y)
                rel = 0.0 if same else math.inf
            else:
                rel = abs(x - y) / max(abs(x), abs(y), ATOL) if x != y else 0.0
            worst = max(worst, rel)
            if rel > rtol and abs(x - y) > ATOL:
                return False, (f"line {i + 1}: Taichi {x!r} / difftape {y!r} (rel {rel:.2e}); "
                               f"Taichi `{la}` / difftape `{lb}`"), worst
    if len(a) != len(b):
        return False, f"Taichi printed {len(a)} result lines, difftape {len(b)}", worst
    return True, "", worst


@dataclass
class Chaos:
    """How difftape's output compares with Taichi's where Taichi's own output is unstable.

    ``horizon``: the first value (1-based, over all result values in order) that Taichi's run
    with its random inputs one ulp up moves beyond ``rtol``, or None; ``agree``: every value
    before the horizon within ``rtol`` and the value at it within ``CHAOS_FACTOR`` times Taichi's
    own move; ``outside``: the first value that is not; ``spread``: the largest relative move of
    Taichi's own values; ``unjudged``: values after the horizon (Taichi cannot reproduce them
    itself, so neither is difftape held to them)."""

    agree: bool
    outside: str = ""
    horizon: int | None = None
    spread: float = 0.0
    unjudged: int = 0


def within_chaos(a: list, b: list, nudged: list, rtol: float) -> Chaos:
    """Compare Taichi's (``a``) and difftape's (``b``) result lines up to Taichi's own
    predictability horizon, found from ``nudged`` (Taichi's output when every random input is one
    ulp larger); see :class:`Chaos`."""
    if not (len(a) == len(b) == len(nudged)):
        return Chaos(False, "the runs printed different numbers of result lines")
    out = Chaos(True)
    k = 0
    for i, ((la, na), (_, nb), (_, nn)) in enumerate(zip(a, b, nudged, strict=True)):
        if not (len(na) == len(nb) == len(nn)):
            return Chaos(False, f"line {i + 1}: the runs printed different numbers of values")
        for x, y, z in zip(na, nb, nn, strict=True):
            k += 1
            if out.horizon is not None:
                out.unjudged += 1
                continue
            if any(map(math.isnan, (x, y, z))):
                if math.isnan(x) and math.isnan(y) and math.isnan(z):
                    continue
                return Chaos(False, f"line {i + 1}: NaN in one run (`{la}`)")
            scale = max(abs(x), abs(y), ATOL)
            move = abs(x - z)
            out.spread = max(out.spread, move / scale)
            tol = max(rtol * scale, ATOL)
            if move > tol:
                out.horizon = k
                tol = CHAOS_FACTOR * move
            if abs(x - y) > tol:
                where = "before" if out.horizon is None else "at"
                return Chaos(False, f"line {i + 1}, {where} Taichi's horizon: Taichi {x!r} / "
                             f"difftape {y!r} / Taichi with inputs one ulp up {z!r}",
                             out.horizon, out.spread)
    if out.horizon is None:
        out.agree = False
        out.outside = "Taichi's output did not move with its inputs one ulp up"
    return out


def _last_error(stderr: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.match(r"^[\w.]+(Error|Exception|Unavailable|Used)\b", ln.strip()):
            return ln.strip()[:300]
    return (lines[-1].strip() if lines else "")[:300]


def _failed_fast(d: Run) -> bool:
    """difftape ended with an error (not a hang): the verdict does not depend on Taichi."""
    return not d.timed_out and d.rc != 0


def verdict(t: Run | None, d: Run, spec: Example, rtol: float) -> dict:
    out: dict = {"taichi_seconds": round(t.seconds, 1) if t else None,
                 "difftape_seconds": round(d.seconds, 1)}
    if t is not None and (t.timed_out or t.rc != 0):
        out.update(verdict="baseline-fails", detail="Taichi: " + (
            "timed out" if t.timed_out else _last_error(t.stderr_tail)))
        return out
    if d.timed_out:
        out.update(verdict="hang", detail="difftape: no exit within the time limit")
        return out
    if d.rc is not None and (d.rc < 0 or d.rc > 128):
        sig = -d.rc if d.rc < 0 else d.rc - 128
        out.update(verdict="crash", detail=f"difftape killed by signal {sig}; "
                   + _last_error(d.stderr_tail))
        return out
    if d.rc != 0:
        err = _last_error(d.stderr_tail)
        refused = "difftape.errors." in err or re.match(
            r"^(CompileError|GradientRuleError|ArgumentError|DifftapeError|ShapeError|"
            r"KernelAssertionError)\b", err)
        out.update(verdict="refused" if refused else "error", detail=err)
        return out
    ta, da = result_lines(t.stdout, spec), result_lines(d.stdout, spec)
    agree, first, worst = compare(ta, da, rtol)
    out.update(verdict="agrees" if agree else "differs", detail=first,
               values_compared=sum(len(n) for _, n in ta), max_rel_diff=worst)
    return out


def markdown(report: dict) -> str:
    meta = report["meta"]
    out = [f"# DiffTaichi examples on difftape vs Taichi {meta['taichi_version']}", "",
           f"difftape `{meta['difftape_rev']}`, {meta['date']}, {meta['iters']} optimisation "
           f"iterations, f32 scenes compared at rtol {F32_RTOL:g}, chaotic scenes run in f64 "
           f"at rtol {F64_RTOL:g}"
           + ("." if meta.get("fast_math") else " with ti.init(fast_math=False) on both "
              "(*f64 strict*)."), "",
           "| example | precision | verdict | values | max rel diff | Taichi s | difftape s "
           "| detail |", "|---|---|---|---|---|---|---|---|"]
    for name, r in report["examples"].items():
        detail = (r.get("detail") or "").replace("|", "\\|")[:300]
        mrd = r.get("max_rel_diff")
        out.append(f"| {name} | {r.get('precision', '')} | {r['verdict']} | "
                   f"{r.get('values_compared', '')} | "
                   f"{'' if mrd is None else f'{mrd:.1e}'} | {r.get('taichi_seconds', '')} | "
                   f"{r.get('difftape_seconds', '')} | {detail} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkout", type=Path, required=True,
                    help="a taichi-dev/difftaichi checkout (outside this repository)")
    ap.add_argument("--output", type=Path, required=True,
                    help="report path; OUTPUT.json and OUTPUT.md are written")
    ap.add_argument("--only", nargs="*", help="example file names (default: all)")
    ap.add_argument("--iters", type=int, default=3, help="optimisation iterations (default 3)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per run (default 600)")
    ap.add_argument("--difftape-python", default=str(REPO / ".venv" / "bin" / "python"))
    ap.add_argument("--taichi-python", default="/work/tivenv/bin/python")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copies")
    ap.add_argument("--fast-math", action="store_true",
                    help="run chaotic scenes with each backend's default floating-point "
                         "evaluation, not fast_math=False")
    ap.add_argument("--always-baseline", action="store_true",
                    help="run Taichi even where difftape already failed with an error")
    args = ap.parse_args(argv)

    checkout = args.checkout.resolve()
    names = sorted(p.name for p in (checkout / "examples").glob("*.py"))
    if args.only:
        names = [n for n in names if n in args.only]
    output = args.output.with_suffix("") if args.output.suffix in (".json", ".md") else args.output
    output.parent.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="difftaichi_"))
    examples: dict[str, dict] = {}
    try:
        for name in names:
            if name in NOT_RUN or name not in EXAMPLES:
                examples[name] = {"verdict": "not run",
                                  "detail": NOT_RUN.get(name, "not listed in EXAMPLES")}
                continue
            spec = EXAMPLES[name]
            runs: dict[str, Run] = {}
            for backend, python in (("difftape", args.difftape_python),
                                    ("taichi", args.taichi_python)):
                if backend == "taichi" and not args.always_baseline and _failed_fast(
                        runs["difftape"]):
                    continue  # difftape stopped with an error: Taichi's output is not needed
                work, _ = prepare(checkout, root, backend, name, spec, args.iters,
                                  not args.fast_math)
                runs[backend] = run_one(python, work, backend, args.timeout)
            rtol = F64_RTOL if spec.chaotic else F32_RTOL
            r = verdict(runs.get("taichi"), runs["difftape"], spec, rtol)
            if spec.chaotic and r["verdict"] == "differs":
                # Is the difference more than rounding amplified by the scene? Ask Taichi how
                # far its own output moves when its random inputs move by one ulp.
                work, _ = prepare(checkout, root, "taichi_nudged", name, spec, args.iters,
                                  not args.fast_math)
                nudged = run_one(args.taichi_python, work, "taichi", args.timeout, nudge=True)
                r["taichi_nudged_seconds"] = round(nudged.seconds, 1)
                if nudged.rc == 0 and not nudged.timed_out:
                    ta, da, na = (result_lines(x.stdout, spec)
                                  for x in (runs["taichi"], runs["difftape"], nudged))
                    c = within_chaos(ta, da, na, rtol)
                    r["taichi_1ulp_rel_spread"] = c.spread
                    if c.agree:
                        r["verdict"] = "agrees within chaos"
                        r["detail"] = (
                            f"equal to rtol up to value {c.horizon}, where a 1-ulp nudge of "
                            f"Taichi's random inputs moves Taichi itself; {c.unjudged} values "
                            f"after it not judged (Taichi's own 1-ulp spread {c.spread:.1e}, "
                            f"difftape vs Taichi {r['max_rel_diff']:.1e})")
                    else:
                        r["detail"] += f"; against Taichi's own 1-ulp spread: {c.outside}"
            r["precision"] = ("f64" + ("" if args.fast_math else " strict")) if spec.chaotic \
                else "f32"
            if "taichi" not in runs:
                r["detail"] += " (Taichi not run: difftape stopped with an error)"
            r["output"] = {b: run.stdout[-3000:] for b, run in runs.items()}
            r["stderr_tail"] = {b: run.stderr_tail[-1500:] for b, run in runs.items()}
            examples[name] = r
            print(f"{name}: {r['verdict']} ({r['taichi_seconds']}s / {r['difftape_seconds']}s) "
                  f"{r.get('detail', '')[:160]}", flush=True)
    finally:
        if args.keep:
            print(f"temporary copies kept: {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)

    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()

    tver = subprocess.run(
        [args.taichi_python, "-c", "import taichi; print('.'.join(map(str, taichi.__version__)))"],
        capture_output=True, text=True).stdout.strip().splitlines()
    report = {"meta": {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                       "difftape_rev": git("rev-parse", "--short", "HEAD")
                       + ("+dirty" if git("status", "--porcelain", "kernels") else ""),
                       "taichi_version": tver[-1] if tver else "?", "iters": args.iters,
                       "fast_math": args.fast_math,
                       "checkout": str(checkout)},
              "examples": examples}
    output.with_suffix(".json").write_text(json.dumps(report, indent=1))
    md = markdown(report)
    output.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
