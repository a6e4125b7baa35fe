"""Compile time of real programs: the first-launch compilation of every kernel of Taichi's
example programs and of DiffTaichi's, on difftape and on Taichi, per kernel and per program.

    .venv/bin/python bench/compile_times.py --output /tmp/compile_times \\
        [--difftaichi /work/difftaichi] [--only taichi_bitmasked.py ...]

Each program runs as ``bench/taichi_examples.py`` (one recorded frame) and ``bench/difftaichi.py``
(one iteration) run it, in fresh processes, with ``ti.init(offline_cache=False)`` on both
backends, so neither backend's disk cache hides a compilation (difftape's in-memory cache only
serves a second compilation of the same IR in one process, as Taichi's online cache does).
What is timed, per compiled kernel instance (``taichi_compat/headless/_launch.py``,
``_log_compiles``): on difftape ``Kernel._compile`` (frontend, passes, LLVM optimisation and
object emission, loading); on Taichi ``Kernel.materialize`` plus ``compile_kernel`` of its first
launch. Kernels are matched by name and variant (primal, grad, fwd), instances summed; a
program's totals are over the kernels both logged (Taichi also logs its library's own kernels,
as ``to_numpy``'s ``tensor_to_ext_arr``, which in difftape are no kernels; and Taichi compiles
the kernels of a ``ti.graph`` through the graph, not a launch, so those are difftape's alone).

The report lists the kernels with the largest ratio difftape / Taichi (of those that take at
least ``--min-seconds`` on difftape) and each program's total. Not a test: the figures depend on
the machine and its load (give ``uptime`` with them).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import difftaichi  # noqa: E402
import taichi_examples  # noqa: E402
from program_runs import add_arguments, run_all, run_one, write_runner  # noqa: E402

INIT = {"offline_cache": False}


def read_log(path: Path) -> dict[str, float]:
    """``kernel[:variant]`` -> seconds, instances summed (empty when the run logged nothing)."""
    out: dict[str, float] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        r = json.loads(line)
        key = r["kernel"] + ("" if r["variant"] == "primal" else f":{r['variant']}")
        out[key] = out.get(key, 0.0) + r["seconds"]
    return out


def prepare(name: str, root: Path, backend: str, args: argparse.Namespace) -> Path | None:
    """A copy of the program with a runner that logs compilations to ``work/_compiles.jsonl``;
    the working directory to run in (None: not run by its harness)."""
    if name.startswith("difftaichi/"):
        prog = name.split("/", 1)[1]
        spec = difftaichi.EXAMPLES.get(prog)
        if spec is None:
            return None
        work, argv = difftaichi.prepare(args.difftaichi, root, backend, prog, spec, 1, False)
        write_runner(work, backend, work / prog, argv, INIT, gui="noop",
                     compile_log=str(work / "_compiles.jsonl"))
        return work
    spec = taichi_examples.SPECS.get(name, taichi_examples.Spec())
    if spec.not_run:
        return None
    work, cwd = taichi_examples.prepare(args.examples, root, backend, name, spec, 1, INIT)
    write_runner(work, backend, work / name, spec.argv, {**INIT, **spec.init}, gui="record",
                 frames=1, record=str(work / "_frames.pkl"), examples=str(work),
                 compile_log=str(work / "_compiles.jsonl"))
    return cwd


def markdown(report: dict) -> str:
    meta = report["meta"]
    rows = []
    for prog, r in report["examples"].items():
        for k, d in r.get("difftape", {}).items():
            t = r.get("taichi", {}).get(k)
            if d >= meta["min_seconds"] and t:
                rows.append((d / t, prog, k, d, t))
    rows.sort(reverse=True)
    out = [f"# Kernel compile time, difftape vs Taichi {meta['taichi_version']}", "",
           f"difftape `{meta['difftape_rev']}`, {meta['date']}, `ti.init(offline_cache=False)`, "
           f"load at start: {meta['uptime']}", "",
           f"## Kernels by ratio (difftape >= {meta['min_seconds']} s)", "",
           "| ratio | program | kernel | difftape s | Taichi s |", "|---|---|---|---|---|"]
    out += [f"| {q:.1f} | {p} | {k} | {d:.3f} | {t:.3f} |" for q, p, k, d, t in rows]
    out += ["", "## Programs", "", "| program | kernels | difftape s | Taichi s | ratio | note |",
            "|---|---|---|---|---|---|"]
    for prog, r in report["examples"].items():
        ours, theirs = r.get("difftape", {}), r.get("taichi", {})
        both = set(ours) & set(theirs)
        d, t = sum(ours[k] for k in both), sum(theirs[k] for k in both)
        out.append(f"| {prog} | {len(both)} | {d:.2f} | {t:.2f} | "
                   f"{d / t if t else float('nan'):.1f} | {r.get('detail', '')[:120]} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    import subprocess

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=Path, default=taichi_examples.EXAMPLES)
    ap.add_argument("--difftaichi", type=Path, default=Path("/work/difftaichi"),
                    help="a taichi-dev/difftaichi checkout ('' for none)")
    ap.add_argument("--min-seconds", type=float, default=0.05,
                    help="kernels faster than this on difftape are not ranked")
    add_arguments(ap, timeout=300)
    args = ap.parse_args(argv)
    args.examples = args.examples.resolve()
    names = sorted(str(p.relative_to(args.examples)) for p in args.examples.rglob("*.py")
                   if p.name != "__init__.py" and "__pycache__" not in p.parts)
    if str(args.difftaichi):
        names += [f"difftaichi/{n}" for n in sorted(difftaichi.EXAMPLES)]
    if args.only:
        names = [n for n in names if n in args.only or Path(n).name in args.only]

    def one(name: str, root: Path) -> dict:
        r: dict = {"verdict": "measured"}
        seconds = {}
        for backend, python in (("difftape", args.difftape_python),
                                ("taichi", args.taichi_python)):
            cwd = prepare(name, root, backend, args)
            if cwd is None:
                return {"verdict": "not run"}
            work = cwd if name.startswith("difftaichi/") else root / backend / name.replace(
                "/", "__")[:-3]
            run = run_one(python, work, backend, args.timeout, cwd=cwd)
            seconds[backend] = round(run.seconds, 1)
            r[backend] = read_log(work / "_compiles.jsonl")
            if run.timed_out or run.rc != 0:
                r["detail"] = r.get("detail", "") + f"{backend}: " + (
                    "timed out" if run.timed_out else run.stderr_tail.strip()[-100:]) + "; "
        r["taichi_seconds"], r["difftape_seconds"] = seconds["taichi"], seconds["difftape"]
        return r

    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return run_all(args, names, one, {"min_seconds": args.min_seconds, "uptime": uptime},
                   markdown, "compile_times_")


if __name__ == "__main__":
    sys.exit(main())
