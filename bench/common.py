"""Shared plumbing for the difftape-vs-Taichi benchmarks.

Every benchmark file is a small script that runs one program, written purely in the Taichi
API, on one backend chosen by name. Keeping the backend choice, initialisation, timing and
JSON output here means the benchmark files differ only in the program they measure, so the
two backends are always measured in exactly the same way.
"""

import argparse
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent

#: Backends a benchmark may be asked to run on. ``numpy`` is the fallback peer used when
#: Taichi is not installed; it only makes sense for some benchmarks.
KERNEL_BACKENDS = ("difftape", "taichi")
ALL_BACKENDS = (*KERNEL_BACKENDS, "numpy")

#: Environment variable difftape reads for its on-disk kernel cache directory.
DIFFTAPE_CACHE_ENV = "DIFFTAPE_CACHE_DIR"

# File descriptor the JSON result is written to. With ``--json`` the real stdout is moved
# here and fd 1 is pointed at stderr, so banners and C++ log lines printed by a backend
# (Taichi prints "[Taichi] version ..." on import) cannot corrupt the JSON stream.
_json_fd: int | None = None


class Unsupported(Exception):
    """Raised by a benchmark asked to run on a backend it has no version for."""


@dataclass
class Timing:
    """Wall-clock samples of one measured operation, in seconds."""

    samples: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def max(self) -> float:
        return max(self.samples)

    def as_dict(self) -> dict[str, Any]:
        """Summary for the JSON output (all in seconds)."""
        return {
            "median_s": self.median,
            "min_s": self.min,
            "max_s": self.max,
            "repeat": len(self.samples),
        }


def parser(description: str, *, repeat: int, warmup: int = 2) -> argparse.ArgumentParser:
    """Command-line parser shared by all benchmark files, so the runner can drive them alike."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--backend", choices=ALL_BACKENDS, default="taichi")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--repeat", type=int, default=repeat, help="timed repetitions (median)")
    p.add_argument("--warmup", type=int, default=warmup, help="untimed repetitions first")
    return p


def capture_stdout_for_json(enabled: bool) -> None:
    """Reserve the real stdout for the JSON result; everything else goes to stderr.

    Works at the file-descriptor level so that output from native code is redirected too.
    Must be called before the backend is imported.
    """
    global _json_fd
    if not enabled or _json_fd is not None:
        return
    sys.stdout.flush()
    _json_fd = os.dup(1)
    os.dup2(2, 1)


def load_backend(name: str) -> ModuleType:
    """Import the backend module by name: ``difftape``/``taichi`` (used as ``ti``) or numpy."""
    if name not in ALL_BACKENDS:
        raise ValueError(f"unknown backend {name!r}; expected one of {ALL_BACKENDS}")
    return importlib.import_module(name)


def init(ti: ModuleType, **kwargs: Any) -> None:
    """``ti.init`` on the CPU with identical options for both kernel backends."""
    ti.init(arch=ti.cpu, **kwargs)


def offline_cache_kwargs(backend: str, cache_dir: str) -> dict[str, Any]:
    """``ti.init`` options that point the backend's offline cache at ``cache_dir``.

    Taichi takes the directory as an init argument; difftape reads ``DIFFTAPE_CACHE_DIR``
    (set here as well, for standalone runs) and accepts ``offline_cache=True``.
    """
    if backend == "taichi":
        return {"offline_cache": True, "offline_cache_file_path": cache_dir}
    os.environ[DIFFTAPE_CACHE_ENV] = cache_dir
    return {"offline_cache": True}


def sync_of(ti: ModuleType | None) -> Callable[[], None]:
    """The function that waits for outstanding kernel launches (a no-op for numpy)."""
    if ti is None or not hasattr(ti, "sync"):
        return lambda: None
    return ti.sync


def time_it(
    fn: Callable[[], Any],
    *,
    repeat: int,
    warmup: int,
    sync: Callable[[], None],
    setup: Callable[[], Any] | None = None,
) -> Timing:
    """Median-of-N timing with warm-up.

    ``setup`` runs before each repetition outside the timed region (e.g. resetting an
    accumulator); ``sync`` is called after ``setup`` and again after ``fn`` before the clock
    stops, so asynchronous launches are fully accounted for.
    """
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
        sync()
    timing = Timing()
    for _ in range(max(1, repeat)):
        if setup is not None:
            setup()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        timing.samples.append(time.perf_counter() - t0)
    return timing


def result(
    name: str,
    backend: str,
    *,
    seconds: float | None = None,
    us: float | None = None,
    notes: str = "",
    rows: list[dict[str, Any]] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """Build the JSON object a benchmark reports.

    ``rows`` are the table lines the runner prints (``label``, ``value``, ``unit``); when
    omitted a single row is derived from ``seconds`` (shown in ms) or ``us``.
    """
    out: dict[str, Any] = {"name": name, "backend": backend}
    if seconds is not None:
        out["seconds"] = seconds
        out["unit"] = "s"
    if us is not None:
        out["us"] = us
        out["unit"] = "us"
    if rows is None:
        if us is not None:
            rows = [{"label": name, "value": us, "unit": "us"}]
        elif seconds is not None:
            rows = [{"label": name, "value": seconds * 1e3, "unit": "ms"}]
        else:
            rows = []
    out["rows"] = rows
    out["notes"] = notes
    out.update(extra)
    return out


def scalar_result(
    name: str,
    backend: str,
    args: argparse.Namespace,
    step: Callable[[], Any],
    value: Callable[[], float],
    *,
    exact: float,
    label: str,
    reference: str,
    sync: Callable[[], None],
    setup: Callable[[], Any] | None = None,
    n: int,
) -> dict[str, Any]:
    """Time ``step`` (an accumulation into one scalar) and report ``value()`` against the
    exact result, for the reduction-style benchmarks: what they compare is both the time and
    how accurate the accumulated sum is (``label``/``reference`` name them in the note)."""
    t = time_it(step, repeat=args.repeat, warmup=args.warmup, sync=sync, setup=setup)
    got = float(value())
    rel = abs(got - exact) / abs(exact)
    notes = f"{label}={got:.7g}, rel err vs {reference} {rel:.1e}"
    return result(name, backend, seconds=t.median, notes=notes, timing=t.as_dict(),
                  rel_err=rel, value=got, exact=exact, n=n)


def emit(obj: dict[str, Any], as_json: bool) -> None:
    """Print the result: one JSON line for the runner, or a readable summary for humans."""
    if as_json:
        line = (json.dumps(obj, sort_keys=True) + "\n").encode()
        if _json_fd is not None:
            os.write(_json_fd, line)
        else:
            sys.stdout.buffer.write(line)
            sys.stdout.flush()
        return
    head = f"{obj.get('name')} [{obj.get('backend')}]"
    if "error" in obj:
        print(f"{head}: ERROR {obj['error']}")
        return
    for row in obj.get("rows", []):
        print(f"{head} {row['label']}: {row['value']:.4g} {row['unit']}")
    if obj.get("notes"):
        print(f"{head} notes: {obj['notes']}")


def main(
    name: str, run: Callable[[argparse.Namespace], dict[str, Any]], args: argparse.Namespace
) -> int:
    """Run one benchmark, turning any failure into a JSON error record instead of a crash.

    A backend that lacks a feature should show up as an error cell in the table, not abort
    the whole suite.
    """
    capture_stdout_for_json(args.json)
    try:
        out = run(args)
    except Unsupported as exc:
        emit(result(name, args.backend, error=str(exc), skipped=True), args.json)
        return 0
    except (Exception, SystemExit) as exc:
        tb = traceback.format_exc()
        if not args.json:
            print(tb, file=sys.stderr)
        err = f"{type(exc).__name__}: {exc}".strip()
        emit(result(name, args.backend, error=err, traceback=tb), args.json)
        return 1
    out.setdefault("python", platform.python_version())
    emit(out, args.json)
    return 0


def parse_json_line(stdout: str) -> dict[str, Any] | None:
    """The last line of ``stdout`` that is a JSON object, if any."""
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                return obj
    return None


def run_script(
    script: str,
    backend: str,
    extra_args: list[str] | None = None,
    *,
    env: dict[str, str] | None = None,
    timeout: float = 600.0,
    python: str | None = None,
) -> dict[str, Any]:
    """Run ``bench/<script>.py --backend X --json`` in a fresh interpreter and return its JSON.

    A fresh process per (benchmark, backend) keeps JIT caches, thread pools and allocators
    of one run from leaking into the next. Failures come back as ``{"error": ...}``.
    ``python``: the interpreter (default: this one).
    """
    cmd = [python or sys.executable, str(BENCH_DIR / f"{script}.py"), "--backend", backend,
           "--json"]
    cmd += extra_args or []
    full_env = dict(os.environ)
    full_env.update(env or {})
    name = script
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env=full_env, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return {"name": name, "backend": backend, "error": f"timed out after {timeout:.0f} s"}
    obj = parse_json_line(proc.stdout)
    if obj is None:
        tail = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        msg = tail[-1] if tail else f"exit status {proc.returncode}, no output"
        return {"name": name, "backend": backend, "error": msg, "returncode": proc.returncode}
    obj["returncode"] = proc.returncode
    return obj


def run_cache_pairs(
    script: str,
    backend: str,
    pairs: int = 1,
    extra_args: list[str] | None = None,
    *,
    timeout: float = 600.0,
    python: str | None = None,
) -> dict[str, Any]:
    """Run ``script`` as cold/warm process pairs, each pair on its own fresh cache directory.

    The first process of a pair sees an empty cache directory (a guaranteed cold compile);
    the second is a new interpreter that can only be fast by loading what the first stored.
    Figures are medians over the pairs.
    """
    runs: list[dict[str, dict[str, Any]]] = []
    for _ in range(max(1, pairs)):
        with tempfile.TemporaryDirectory(prefix=f"bench-cache-{backend}-") as cache_dir:
            env = {DIFFTAPE_CACHE_ENV: cache_dir}
            phases: dict[str, dict[str, Any]] = {}
            for phase in ("cold", "warm"):
                args = [*(extra_args or []), "--cache-dir", cache_dir, "--phase", phase]
                phases[phase] = run_script(script, backend, args, env=env, timeout=timeout,
                                           python=python)
                if "error" in phases[phase]:
                    break
                phases[phase]["cache_files"] = sum(len(f) for _, _, f in os.walk(cache_dir))
        runs.append(phases)
        if any("error" in p for p in phases.values()):
            break
    return phases_to_result(script, backend, runs)


def phases_to_result(
    name: str, backend: str, runs: list[dict[str, dict[str, Any]]]
) -> dict[str, Any]:
    """Merge the cold and warm runs of a cache benchmark into one result (medians)."""
    for phases in runs:
        for phase, obj in phases.items():
            if obj.get("skipped"):
                return obj
            if "error" in obj:
                return {"name": name, "backend": backend, "error": f"{phase} run: {obj['error']}"}

    def med(phase: str, key: str) -> float:
        return statistics.median(r[phase][key] for r in runs)

    rows = [
        {"label": f"{name}: {label}", "value": med(phase, key) * 1e3, "unit": "ms"}
        for label, phase, key in (
            ("cold first call", "cold", "first_s"),
            ("cold second call", "cold", "second_s"),
            ("cached first call", "warm", "first_s"),
        )
    ]
    files = runs[-1]["cold"].get("cache_files", "?")
    notes = (
        f"median of {len(runs)} fresh-cache pair(s); excluded: init "
        f"{med('cold', 'init_s') * 1e3:.0f} ms, field alloc {med('cold', 'alloc_s') * 1e3:.0f} ms;"
        f" {files} file(s) in cache after cold run"
    )
    return result(
        name,
        backend,
        seconds=med("cold", "first_s"),
        rows=rows,
        notes=notes,
        cold_first_s=med("cold", "first_s"),
        cold_second_s=med("cold", "second_s"),
        warm_first_s=med("warm", "first_s"),
        warm_second_s=med("warm", "second_s"),
        runs=runs,
    )
