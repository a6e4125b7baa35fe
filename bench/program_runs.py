"""What the harnesses that run whole Taichi programs share (``bench/difftaichi.py``,
``bench/taichi_examples.py``, ``bench/gui_frames.py``).

A program is prepared in a temporary working copy (with the ``taichi`` -> difftape alias there
for a difftape run) and run in a fresh process by ``_run_example.py``, which hands it to
``taichi_compat/headless/_launch.py`` (seeded random inputs, ``ti.init`` on the CPU, headless
``ti.GUI``). Here: writing that runner, running it with a time limit, the numbers a run printed
(minus timings), comparing two runs' numbers, the verdict for a run that did not finish, and the
report's header facts.
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
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
COMPAT = BENCH / "taichi_compat"
HEADLESS = COMPAT / "headless"

ATOL = 1e-9

#: Output lines that are timings or progress, not results.
TIMING = re.compile(r"time|\bms\b|per iter|\[Taichi\]|^\s*\[[IWE] |Kernel Profiler|fps\b",
                    re.IGNORECASE)
NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?|[-+]?(?:nan|inf)\b")

#: The script a prepared copy runs: ``headless`` on the path, then ``_launch.run``.
RUNNER = """\
import sys
sys.path.append({headless!r})
import _launch
_launch.run({script!r}, {argv!r}, {init!r}{extra})
"""


@dataclass
class Run:
    """One process: exit status (None: timed out), wall seconds, stdout, the end of stderr."""

    rc: int | None
    seconds: float
    stdout: str
    stderr_tail: str
    timed_out: bool = False


def write_runner(work: Path, backend: str, script: Path, argv: list[str], init: dict,
                 **launch: object) -> None:
    """``work/_run_example.py`` for ``script``; for difftape, the alias as ``work/_alias/taichi``.
    ``launch``: further keyword arguments of ``_launch.run`` (``gui``, ``frames``, ``record``)."""
    if backend == "difftape":
        (work / "_alias" / "taichi").mkdir(parents=True, exist_ok=True)
        shutil.copy(COMPAT / "alias.py", work / "_alias" / "taichi" / "__init__.py")
    extra = "".join(f", {k}={v!r}" for k, v in launch.items())
    (work / "_run_example.py").write_text(RUNNER.format(
        headless=str(HEADLESS), script=str(script), argv=argv, init=init, extra=extra))


def run_one(python: str, work: Path, backend: str, timeout: float, nudge: bool = False,
            cwd: Path | None = None) -> Run:
    """Run the prepared copy's ``_run_example.py`` (in ``cwd``, default ``work``); ``nudge``:
    every float NumPy/``random`` draws is one ulp up."""
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONDONTWRITEBYTECODE="1",
               DIFFTAPE_CACHE_DIR=str(work / "_cache"),
               TI_OFFLINE_CACHE_FILE_PATH=str(work / "_cache"))
    if nudge:
        env["DIFFTAICHI_NUDGE"] = "1"
    if backend == "difftape":
        env["PYTHONPATH"] = str(work / "_alias")
    t0 = time.perf_counter()
    try:
        p = subprocess.run([python, str(work / "_run_example.py")], cwd=cwd or work, env=env,
                           capture_output=True, text=True, timeout=timeout)
        return Run(p.returncode, time.perf_counter() - t0, p.stdout, p.stderr[-4000:])
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
        return Run(None, time.perf_counter() - t0, out or "", (err or "")[-4000:], True)


def result_lines(stdout: str, ignore: list[str] = ()) -> list[tuple[str, list[float]]]:
    """The printed lines that carry results, with their numbers (``ignore``: more regexes of
    lines that are not results)."""
    skip = [re.compile(p) for p in ignore]
    out = []
    for line in stdout.splitlines():
        if TIMING.search(line) or any(p.search(line) for p in skip):
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


def last_error(stderr: str) -> str:
    """The line of a traceback that names the exception, with the message lines after it
    (else the last line)."""
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    for i in range(len(lines) - 1, -1, -1):
        if re.match(r"^[\w.]+(Error|Exception|Unavailable|Used)\b", lines[i]):
            # the message's own lines, without the file names and carets of a quoted source
            rest = [ln for ln in lines[i + 1:]
                    if not ln.startswith("File ") and not re.fullmatch(r"[\^~]+", ln)]
            return " ".join([lines[i], *rest])[:300]
    return (lines[-1] if lines else "")[:300]


def failed_fast(d: Run) -> bool:
    """difftape ended with an error (not a hang): the verdict does not depend on Taichi."""
    return not d.timed_out and d.rc != 0


def unfinished(t: Run | None, d: Run) -> dict:
    """The wall times, and the verdict where a run did not finish cleanly: baseline-fails
    (Taichi's run), hang, crash (a signal), refused (a difftape error) or error (any other
    exception). No ``verdict`` key: both finished, and their output is to be compared."""
    out: dict = {"taichi_seconds": round(t.seconds, 1) if t else None,
                 "difftape_seconds": round(d.seconds, 1)}
    if t is not None and (t.timed_out or t.rc != 0):
        out.update(verdict="baseline-fails", detail="Taichi: " + (
            "timed out" if t.timed_out else last_error(t.stderr_tail)))
    elif d.timed_out:
        out.update(verdict="hang", detail="difftape: no exit within the time limit")
    elif d.rc is not None and (d.rc < 0 or d.rc > 128):
        sig = -d.rc if d.rc < 0 else d.rc - 128
        out.update(verdict="crash", detail=f"difftape killed by signal {sig}; "
                   + last_error(d.stderr_tail))
    elif d.rc != 0:
        err = last_error(d.stderr_tail)
        refused = "difftape.errors." in err or re.match(
            r"^(CompileError|GradientRuleError|ArgumentError|DifftapeError|ShapeError|"
            r"KernelAssertionError)\b", err)
        out.update(verdict="refused" if refused else "error", detail=err)
    return out


def meta(taichi_python: str) -> dict:
    """Date, difftape revision (``+dirty`` with uncommitted changes to kernels/) and the
    Taichi version, for a report's header."""
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()

    tver = subprocess.run(
        [taichi_python, "-c", "import taichi; print('.'.join(map(str, taichi.__version__)))"],
        capture_output=True, text=True).stdout.strip().splitlines()
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "difftape_rev": git("rev-parse", "--short", "HEAD")
            + ("+dirty" if git("status", "--porcelain", "kernels") else ""),
            "taichi_version": tver[-1] if tver else "?"}


def add_arguments(ap: argparse.ArgumentParser, timeout: float) -> None:
    """The options every program harness takes (besides its own)."""
    ap.add_argument("--output", type=Path, required=True,
                    help="report path; OUTPUT.json and OUTPUT.md are written")
    ap.add_argument("--only", nargs="*", help="example file names (default: all)")
    ap.add_argument("--timeout", type=float, default=timeout,
                    help=f"seconds per run (default {timeout:g})")
    ap.add_argument("--difftape-python", default=str(REPO / ".venv" / "bin" / "python"))
    ap.add_argument("--taichi-python", default="/work/tivenv/bin/python")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copies")
    ap.add_argument("--fast-math", action="store_true",
                    help="each backend's default floating-point evaluation, not "
                         "ti.init(fast_math=False) (where the harness asks for it)")


def report_markdown(report: dict, what: str, settings: str, strict: str,
                    columns: list[tuple[str, str]], summary: bool = False) -> str:
    """A report in Markdown: ``what`` ran on which revisions, with what ``settings``, and
    ``strict`` (how ``fast_math=False`` was used) unless ``--fast-math``; with ``summary``, how
    many examples got each verdict; then a row per example (see :func:`verdict_table`)."""
    meta = report["meta"]
    out = [f"# {what} on difftape vs Taichi {meta['taichi_version']}", "",
           f"difftape `{meta['difftape_rev']}`, {meta['date']}, {settings}"
           + ("." if meta.get("fast_math") else strict + "."), ""]
    if summary:
        counts: dict[str, int] = {}
        for r in report["examples"].values():
            counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
        out += ["| verdict | examples |", "|---|---|"]
        out += [f"| {v} | {n} |" for v, n in sorted(counts.items(), key=lambda kv: -kv[1])]
        out.append("")
    out += verdict_table(report["examples"], columns)
    return "\n".join(out) + "\n"


def _cell(key: str, v: object) -> str:
    if v is None:
        return ""
    if key == "max_rel_diff":
        return f"{v:.1e}"
    return str(v).replace("|", "\\|").replace("\n", " ")[:300]


def verdict_table(examples: dict[str, dict], columns: list[tuple[str, str]]) -> list[str]:
    """Markdown lines: a row per example, ``columns`` (heading, key of the example's dict)."""
    out = ["| example | " + " | ".join(h for h, _ in columns) + " |",
           "|---|" + "---|" * len(columns)]
    for name, r in examples.items():
        out.append(f"| {name} | " + " | ".join(_cell(k, r.get(k)) for _, k in columns) + " |")
    return out


def run_all(args: argparse.Namespace, names: list[str], one: Callable[[str, Path], dict],
            header: dict, markdown: Callable[[dict], str], prefix: str) -> int:
    """Run ``one(name, scratch directory)`` for each name (a verdict dict each, printed as it
    comes), then write ``args.output`` .json and .md (``markdown`` of the report, whose
    ``meta`` is :func:`meta` with ``header``)."""
    output = args.output.with_suffix("") if args.output.suffix in (".json", ".md") else args.output
    output.parent.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix=prefix))
    examples: dict[str, dict] = {}
    try:
        for name in names:
            r = examples[name] = one(name, root)
            print(f"{name}: {r['verdict']} ({r.get('taichi_seconds')}s / "
                  f"{r.get('difftape_seconds')}s) {r.get('detail', '')[:200]}", flush=True)
    finally:
        if args.keep:
            print(f"temporary copies kept: {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    report = {"meta": {**meta(args.taichi_python), **header}, "examples": examples}
    output.with_suffix(".json").write_text(json.dumps(report, indent=1))
    md = markdown(report)
    output.with_suffix(".md").write_text(md)
    print(md)
    return 0
