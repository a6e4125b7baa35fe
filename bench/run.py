"""Run the benchmark suite on two backends and print a Markdown table of time ratios.

Each (benchmark, backend) runs in its own fresh interpreter, so one backend's JIT caches,
thread pools and memory cannot influence the other's figures. The first backend is the
subject and the second the peer; the ratio column is subject time / peer time (below 1 means
the subject is faster). Without Taichi installed the peer falls back to NumPy where a NumPy
version of the benchmark exists.

    python bench/run.py [--only NAME ...] [--backends difftape,taichi] [--repeat N]
"""

import argparse
import datetime as dt
import importlib.util
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

#: Benchmarks in the order they are run and printed.
BENCHMARKS = (
    "elementwise",
    "reduction",
    "nbody",
    "launch",
    "compile",
    "ad_elementwise",
    "ad_reduction",
    "ad_nbody",
    "ad_forward",
    "diffmpm",
    "graph",
    "busy",
    "service_mpm",
    "service_ray",
)
#: Benchmarks that run as cold/warm process pairs over a fresh on-disk cache directory.
CACHE_BENCHMARKS = frozenset({"compile"})

RESULTS_PATH = common.BENCH_DIR / "results" / "latest.json"
MAX_CELL = 120
MAX_NOTES = 400


#: Where the development machines keep Taichi 1.7.4, apart from difftape's environment.
TAICHI_VENV_PYTHON = Path("/work/tivenv/bin/python")


def taichi_python(requested: str | None) -> str | None:
    """The interpreter that runs the taichi backend: ``requested``, else this one when it has
    Taichi, else the separate Taichi environment when present (None: no Taichi)."""
    if requested:
        return requested
    if importlib.util.find_spec("taichi") is not None:
        return sys.executable
    return str(TAICHI_VENV_PYTHON) if TAICHI_VENV_PYTHON.exists() else None


def resolve_backends(requested: list[str],
                     taichi: str | None) -> tuple[list[str], dict[str, str]]:
    """Swap an uninstalled Taichi (``taichi``: its interpreter, None when there is none) for
    the NumPy peer; return backends and substitutions made."""
    out: list[str] = []
    substituted: dict[str, str] = {}
    for name in requested:
        if name == "taichi" and taichi is None:
            substituted["numpy"] = "taichi"
            name = "numpy"
        if name not in out:
            out.append(name)
    return out, substituted


def run_one(name: str, backend: str, repeat: int | None, timeout: float,
            python: str | None = None) -> dict[str, Any]:
    """One benchmark on one backend, in fresh process(es) of ``python``; never raises."""
    if name in CACHE_BENCHMARKS:
        pairs = repeat if repeat is not None else 3
        return common.run_cache_pairs(name, backend, pairs=pairs, timeout=timeout,
                                      python=python)
    extra = ["--repeat", str(repeat)] if repeat is not None else []
    return common.run_script(name, backend, extra, timeout=timeout, python=python)


def _cell(text: str, limit: int = MAX_CELL) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _fmt(value: float, unit: str) -> str:
    return f"{value:.3g} {unit}"


def _row_values(res: dict[str, Any]) -> dict[str, tuple[float, str]]:
    return {r["label"]: (float(r["value"]), r["unit"]) for r in res.get("rows", [])}


def _status(res: dict[str, Any]) -> str | None:
    """Cell text for a result that has no figures (skipped or failed), else None."""
    if res.get("skipped"):
        return f"n/a ({res.get('error', 'skipped')})"
    if "error" in res:
        return f"error: {res['error']}"
    return None


def header_name(backend: str, substituted: dict[str, str]) -> str:
    """Column header, marking NumPy when it stands in for an uninstalled Taichi."""
    if backend in substituted:
        return f"{backend} (peer; {substituted[backend]} not installed)"
    return backend


def make_table(
    results: dict[str, dict[str, dict[str, Any]]],
    backends: list[str],
    substituted: dict[str, str],
) -> str:
    """Markdown table: benchmark | each backend | ratio (first/second) | notes."""
    heads = [header_name(b, substituted) for b in backends]
    ratio_head = f"ratio ({backends[0]}/{backends[1]})" if len(backends) >= 2 else "ratio"
    lines = [
        "| benchmark | " + " | ".join(heads) + f" | {ratio_head} | notes |",
        "|---" * (len(backends) + 3) + "|",
    ]
    for name, per_backend in results.items():
        labels: list[str] = []
        for b in backends:
            for label in _row_values(per_backend.get(b, {})):
                if label not in labels:
                    labels.append(label)
        if not labels:
            labels = [name]
        notes = "; ".join(
            f"{b}: {per_backend[b]['notes']}"
            for b in backends
            if per_backend.get(b, {}).get("notes") and "error" not in per_backend[b]
        )
        for k, label in enumerate(labels):
            cells: list[str] = []
            values: list[float | None] = []
            for b in backends:
                res = per_backend.get(b, {"error": "not run"})
                status = _status(res)
                got = _row_values(res).get(label)
                if got is not None:
                    cells.append(_fmt(*got))
                    values.append(got[0])
                elif status is not None:
                    cells.append(status if k == 0 else "")  # say it once per benchmark
                    values.append(None)
                else:
                    cells.append("missing")
                    values.append(None)
            a, b_ = (values + [None, None])[:2]
            ratio = f"{a / b_:.2f}x" if a is not None and b_ else ""
            row = [_cell(c) for c in (label, *cells, ratio)]
            row.append(_cell(notes, MAX_NOTES) if k == 0 else "")
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the selected benchmarks, print the table, and save bench/results/latest.json."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--only",
        nargs="+",
        choices=BENCHMARKS,
        metavar="NAME",
        help=f"benchmarks to run (default: all of {', '.join(BENCHMARKS)})",
    )
    p.add_argument(
        "--backends",
        default="difftape,taichi",
        help="comma-separated; first is the subject, second the peer",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=None,
        help="timed repetitions per benchmark (compile: cold/warm pairs)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per process")
    p.add_argument(
        "--taichi-python",
        default=None,
        help="interpreter for the taichi backend (default: this one when it has Taichi, "
        f"else {TAICHI_VENV_PYTHON} when present)",
    )
    p.add_argument("--output", type=Path, default=RESULTS_PATH, help="JSON results file")
    args = p.parse_args(argv)

    requested = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in requested if b not in common.ALL_BACKENDS]
    if not requested or unknown:
        p.error(f"unknown backend(s) {unknown}; choose from {', '.join(common.ALL_BACKENDS)}")
    taichi = taichi_python(args.taichi_python)
    backends, substituted = resolve_backends(requested, taichi)
    names = list(args.only) if args.only else list(BENCHMARKS)

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load > 0.5:
        print(
            f"warning: 1-minute load average is {load:.2f}; other work on this machine "
            "will make the figures noisy",
            file=sys.stderr,
        )
    results: dict[str, dict[str, dict[str, Any]]] = {}
    started = time.perf_counter()
    for name in names:
        results[name] = {}
        for backend in backends:
            print(f"running {name} [{backend}] ...", end=" ", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            python = taichi if backend == "taichi" else None
            res = run_one(name, backend, args.repeat, args.timeout, python)
            results[name][backend] = res
            state = _status(res) or "ok"
            print(f"{state} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)

    table = make_table(results, backends, substituted)
    preface = []
    for peer, missing in substituted.items():
        preface.append(
            f"Note: {missing} is not installed; {peer} is used as the peer where a "
            f"{peer} version of the benchmark exists."
        )
    print("\n".join([*preface, "", table]) if preface else table)

    record = {
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "load_average_at_start": load,
        "backends": backends,
        "substituted": substituted,
        "taichi_python": taichi,
        "argv": sys.argv[1:] if argv is None else argv,
        "wall_s": time.perf_counter() - started,
        "results": results,
        "table": table,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    print(f"\nresults written to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
