"""Run Taichi 1.7.4's own Python tests on difftape and on Taichi, and compare.

    .venv/bin/python bench/taichi_suite.py --checkout /work/taichi-1.7.4 --output /tmp/suite

runs every ``tests/python/test_*.py`` of a Taichi checkout twice: on real Taichi (with
Taichi's own ``tests/test_utils.py``, CPU only) for the baseline, and on difftape through the
``taichi`` -> difftape alias (``bench/taichi_compat/alias.py``) with our stand-in test_utils
(``bench/taichi_compat/test_utils_difftape.py``). It writes ``OUTPUT.json`` (every test's
outcome on both backends, and the analysis) and ``OUTPUT.md`` (the summary): per file and
in total, the tests Taichi passes on the CPU and how many of those pass on difftape, split
into core / autodiff / forward; difftape's failures grouped by cause; and separate lists of
wrong values (an assertion on a value failed: a silent wrong result), hangs and crashes.

Nothing of Taichi's is copied into this repository: the files are built in a temporary
directory (``tests/python`` there is a symlink into the checkout). Each test file runs in its
own pytest process (``--noconftest -p suite_plugin``; see ``taichi_compat/suite_plugin.py``)
under ``timeout``, two at a time; a test that hangs (``--test-timeout``) or kills the process
is recorded, and the file is run again without it, so one bad test does not hide the others.
Results are read from pytest's junit xml. See bench/README.md.

``--backends difftape,difftape-remote`` runs the same tests a second time on difftape with every
``ti.init`` sent to a difftape server on a loopback port (``difftape serve``, started once by the
harness with a fresh data dir and one token; the tests' processes reach it through
``DIFFTAPE_ARCH=remote``, ``DIFFTAPE_SERVER`` and ``DIFFTAPE_TOKEN``, as any unchanged program
would), and lists the tests that pass locally but not remotely.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
COMPAT = BENCH / "taichi_compat"

#: Files that test Taichi's implementation rather than its language (AOT modules, C++
#: bindings, its AST resolver and template mapper, CLI, offline-cache files, CUDA internals,
#: internal calls, and test_utils itself). Not run on difftape; counted apart. Tests elsewhere
#: that touch ``taichi.lang.*`` / ``taichi._lib`` are recognised at run time instead (the
#: alias raises ``TaichiInternalsUsed``).
INTERNAL_FILES = {
    "test_aot.py", "test_binding.py", "test_ast_resolver.py", "test_callable_template_mapper.py",
    "test_cli.py", "test_cuda_internals.py", "test_internal_func.py", "test_offline_cache.py",
    "test_test.py",
}

#: The backends that run difftape through the ``taichi`` alias: locally, and on a server.
DIFFTAPE_BACKENDS = ("difftape", "difftape-remote")

#: Per-process attempts at one file (each hang or crash costs one).
MAX_ATTEMPTS = 8


def category(file: str) -> str:
    """``forward`` (forward-mode autodiff files), ``autodiff`` (reverse mode and gradient
    machinery), or ``core`` (the language)."""
    if file.endswith("_fwd.py"):
        return "forward"
    if file.startswith("test_ad_") or "grad" in file or file == "test_torch_ad.py":
        return "autodiff"
    return "core"


# ---------------------------------------------------------------------------------------------
# Running


@dataclass
class FileRun:
    """Everything one backend did with one test file."""

    file: str
    tests: dict[str, dict] = field(default_factory=dict)  # key -> outcome record
    hangs: list[str] = field(default_factory=list)
    crashes: list[dict] = field(default_factory=list)  # {"test", "detail"}
    file_error: str | None = None  # the file could not be collected / the process died early
    attempts: int = 0
    seconds: float = 0.0
    skipped_internal: bool = False


def make_workdir(backend: str, checkout: Path, root: Path) -> Path:
    """The directory pytest runs in: ``tests/`` with the backend's test_utils and a symlink
    to the checkout's ``tests/python``, our plugin, and (difftape) the ``taichi`` alias."""
    work = root / backend
    (work / "tests").mkdir(parents=True)
    (work / "tests" / "__init__.py").write_text("")
    (work / "tests" / "python").symlink_to(checkout / "tests" / "python")
    if backend in DIFFTAPE_BACKENDS:
        shutil.copy(COMPAT / "test_utils_difftape.py", work / "tests" / "test_utils.py")
        (work / "taichi").mkdir()
        shutil.copy(COMPAT / "alias.py", work / "taichi" / "__init__.py")
    else:
        shutil.copy(checkout / "tests" / "test_utils.py", work / "tests" / "test_utils.py")
    shutil.copy(COMPAT / "suite_plugin.py", work / "suite_plugin.py")
    (work / "pytest.ini").write_text(
        "[pytest]\nmarkers =\n    run_in_serial: serial\n    sm70: compute capability 7.0\n")
    (work / "cache").mkdir()
    (work / "logs").mkdir()
    return work


def _test_key(case: ET.Element) -> str:
    """``test_x.py::[Class::]name`` from a junit (xunit1) testcase."""
    file = Path(case.get("file") or "").name
    module = "tests.python." + file[:-3]
    cls = case.get("classname") or ""
    rest = cls[len(module):].lstrip(".") if cls.startswith(module) else ""
    return "::".join(p for p in (file, rest, case.get("name")) if p)


def _first_e_line(text: str) -> str:
    for line in text.splitlines():
        if line.startswith("E   "):
            return line[4:].strip()
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""


def parse_junit(path: Path, file: str) -> tuple[dict[str, dict], str | None]:
    """Test records of one junit xml, and the file's collection error if it had one."""
    tests: dict[str, dict] = {}
    collection_error = None
    for case in ET.parse(path).getroot().iter("testcase"):
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        rec: dict = {"outcome": "passed", "time": float(case.get("time") or 0)}
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is None:
                continue
            msg = (el.get("message") or "").strip()
            text = el.text or ""
            if tag == "error" and not case.get("classname") and "collection" in msg:
                collection_error = _first_e_line(text) or msg
                break
            rec["outcome"] = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
            if tag == "skipped":
                rec["message"] = msg
            else:
                rec["message"] = msg if msg and not msg.startswith("failed on") else (
                    _first_e_line(text) or msg)
                rec["e_line"] = _first_e_line(text)
            break
        else:
            pass
        if collection_error is not None and not case.get("classname"):
            continue
        rec.update({k: v for k, v in props.items() if k.startswith("exc_")})
        tests[_test_key(case)] = rec
    return tests, collection_error


def _read_progress(path: Path) -> tuple[list[str], str | None]:
    """Tests finished, and the test that started without finishing (None if none)."""
    done, running = [], None
    if not path.exists():
        return done, None
    for line in path.read_text().splitlines():
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "start" in ev:
            running = ev["start"]
        elif "end" in ev:
            done.append(ev["end"])
            running = None
    return done, running


def _nodeid_to_key(nodeid: str) -> str:
    # tests/python/test_x.py::Cls::name -> test_x.py::Cls::name
    path, _, rest = nodeid.partition("::")
    return f"{Path(path).name}::{rest}"


_live: set[subprocess.Popen] = set()
_stopping = threading.Event()


def _call(cmd: list[str], **kwargs) -> int:
    """``subprocess.call`` in a session of its own, so that :func:`_stop_children` can end
    the pytest process and everything it started when the harness is stopped."""
    proc = subprocess.Popen(cmd, start_new_session=True, **kwargs)
    _live.add(proc)
    try:
        return proc.wait()
    finally:
        _live.discard(proc)


def _stop_children(*_args) -> None:
    _stopping.set()
    for proc in list(_live):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    raise SystemExit(130)


def run_file(backend: str, python: str, work: Path, file: str, test_timeout: float,
             file_timeout: float, backend_env: dict[str, str] | None = None) -> FileRun:
    """Run one test file on one backend, again without each test that hangs or crashes;
    ``backend_env``: variables the backend adds (the remote one's server and token)."""
    run = FileRun(file)
    if _stopping.is_set():
        run.file_error = "not run: the harness was stopped"
        return run
    if backend in DIFFTAPE_BACKENDS and file in INTERNAL_FILES:
        run.skipped_internal = True
        return run
    stem = file[:-3]
    deselect = work / "logs" / f"{stem}.deselect"
    deselect.write_text("")
    env = dict(os.environ)
    env.update({
        "PYTHONPATH": str(work), "PYTHONDONTWRITEBYTECODE": "1", "SUITE_BACKEND": backend,
        "SUITE_TEST_TIMEOUT": str(test_timeout), "SUITE_DESELECT": str(deselect),
        "TI_WANTED_ARCHS": "cpu", "DIFFTAPE_CACHE_DIR": str(work / "cache"),
        "TI_OFFLINE_CACHE_FILE_PATH": str(work / "cache"),
        "MPLBACKEND": "Agg", **(backend_env or {}),
    })
    start = time.perf_counter()
    while run.attempts < MAX_ATTEMPTS and not _stopping.is_set():
        run.attempts += 1
        tag = f"{stem}.{run.attempts}"
        junit, progress = work / "logs" / f"{tag}.xml", work / "logs" / f"{tag}.progress"
        fault, log = work / "logs" / f"{tag}.fault", work / "logs" / f"{tag}.log"
        env.update({"SUITE_PROGRESS": str(progress), "SUITE_FAULT_LOG": str(fault)})
        cmd = ["timeout", "-k", "10", str(int(file_timeout)), python, "-m", "pytest",
               "-c", str(work / "pytest.ini"), "--rootdir", str(work), "--noconftest",
               "-p", "suite_plugin", "-p", "no:cacheprovider", "-q", "-o",
               "junit_family=xunit1", f"--junitxml={junit}", f"tests/python/{file}"]
        with open(log, "w") as out:
            rc = _call(cmd, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT)
        if junit.exists():
            tests, coll_err = parse_junit(junit, file)
            run.tests.update(tests)
            if coll_err:
                run.file_error = coll_err
            break
        _, running = _read_progress(progress)
        fault_text = fault.read_text(errors="replace") if fault.exists() else ""
        timed_out = rc in (124, 137) or "Timeout (" in fault_text
        if running is None:
            tail = log.read_text(errors="replace").strip().splitlines()[-3:]
            run.file_error = (f"process ended (rc={rc}) outside any test: " + " | ".join(tail))
            break
        key = _nodeid_to_key(running)
        if timed_out:
            run.hangs.append(key)
            run.tests[key] = {"outcome": "hang", "message": f"no result after {test_timeout:g}s"
                              if "Timeout (" in fault_text else "file time limit reached"}
        else:
            sig = -rc if rc < 0 else (rc - 128 if rc > 128 else None)
            detail = (f"killed by signal {sig}" if sig else f"process exited with {rc}")
            fatal = [ln for ln in fault_text.splitlines() if ln.startswith("Fatal Python")]
            if fatal:
                detail += f" ({fatal[0]})"
            run.crashes.append({"test": key, "detail": detail})
            run.tests[key] = {"outcome": "crash", "message": detail}
        with open(deselect, "a") as f:
            f.write(running + "\n")
    run.seconds = time.perf_counter() - start
    return run


@contextmanager
def local_server(python: str, root: Path) -> Iterator[dict[str, str]]:
    """A difftape server on a free loopback port for the remote backend: a fresh data dir
    under ``root``, one token, generous session quota (a crashed test's session lingers until
    culled). Yields the variables that send every ``ti.init`` of a test process to it."""
    data = root / "server"
    data.mkdir()
    token = subprocess.run([python, "-m", "difftape", "token", "create", "suite", "--data-dir",
                            str(data)], check=True, capture_output=True, text=True,
                           timeout=120).stdout.split()[-1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, DIFFTAPE_QUOTA_SESSIONS="1000")
    with open(data / "server.log", "wb") as log:
        proc = subprocess.Popen([python, "-m", "difftape", "serve", "--port", str(port),
                                 "--data-dir", str(data)], env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    _live.add(proc)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(url + "/readyz", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the difftape server did not start: "
                                   + (data / "server.log").read_text(errors="replace")[-2000:])
            time.sleep(0.2)
        yield {"DIFFTAPE_ARCH": "remote", "DIFFTAPE_SERVER": url, "DIFFTAPE_TOKEN": token}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        _live.discard(proc)


def run_backend(backend: str, python: str, checkout: Path, files: list[str], root: Path,
                jobs: int, test_timeout: float, file_timeout: float) -> dict[str, FileRun]:
    if backend == "difftape-remote":
        with local_server(python, root) as env:
            return _run_files(backend, python, checkout, files, root, jobs, test_timeout,
                              file_timeout, env)
    return _run_files(backend, python, checkout, files, root, jobs, test_timeout, file_timeout)


def _run_files(backend: str, python: str, checkout: Path, files: list[str], root: Path,
               jobs: int, test_timeout: float, file_timeout: float,
               backend_env: dict[str, str] | None = None) -> dict[str, FileRun]:
    work = make_workdir(backend, checkout, root)
    results: dict[str, FileRun] = {}
    t0 = time.perf_counter()
    with ThreadPoolExecutor(jobs) as pool:
        futures = {pool.submit(run_file, backend, python, work, f, test_timeout,
                               file_timeout, backend_env): f for f in files}
        for i, fut in enumerate(futures, 1):
            r = fut.result()
            results[r.file] = r
            counts = Counter(t["outcome"] for t in r.tests.values())
            print(f"[{backend} {i}/{len(files)} {time.perf_counter() - t0:6.0f}s] {r.file}: "
                  + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
                  + (f"  FILE ERROR: {r.file_error[:100]}" if r.file_error else ""),
                  flush=True)
    return results


# ---------------------------------------------------------------------------------------------
# Analysis

_MSG_CHECK = re.compile(r"\be\.value\b|str\(e|\.args\b|\bmatch\b|\bwarn|excinfo|record\[")


def _normalise(msg: str) -> str:
    """A message's first line with the specifics that differ between tests of one cause
    (addresses, temporary paths, long numbers) blanked, so those tests fall into one group."""
    line = (msg or "").strip().splitlines()[0] if (msg or "").strip() else "(no message)"
    line = re.sub(r"0x[0-9a-fA-F]+", "0x…", line)
    line = re.sub(r"/\S*/taichi_suite_\w+/\w+/", "…/", line)
    line = re.sub(r"(?<![\w.])-?(\d+\.\d*|\d{3,})(e[-+]?\d+)?", "N", line)
    return line[:200]


def _strip_type(message: str, etype: str) -> str:
    """The message without the ``module.Class: `` prefix pytest puts before it."""
    for prefix in (etype, etype.rsplit(".", 1)[-1]):
        if prefix and message.startswith(prefix + ": "):
            return message[len(prefix) + 2:]
    return message


def classify(rec: dict) -> str:
    """How a test that Taichi passes fared on difftape."""
    outcome = rec.get("outcome")
    if outcome == "passed":
        return "passed"
    if outcome in ("hang", "crash"):
        return outcome
    if outcome == "skipped":
        return "skipped"
    if outcome == "internal":
        return "internal"
    etype = rec.get("exc_type", "")
    msg = rec.get("message", "") or ""
    if "TaichiInternalsUsed" in etype or "TaichiInternalsUsed" in msg:
        return "internal"
    if etype.endswith("Failed") and ("DID NOT RAISE" in msg or "DID NOT WARN" in msg):
        return "not_refused"
    if etype == "builtins.AssertionError":
        if "Regex pattern did not match" in msg or "Regex pattern did not match" in rec.get(
                "e_line", ""):
            return "message_differs"
        if rec.get("exc_origin") == "backend":
            return "error"  # an internal assert of the backend: a refusal, not a value
        if _MSG_CHECK.search(rec.get("exc_stmt", "")):
            return "message_differs"
        return "wrong_value"
    return "error"


def _summ(rec: dict) -> str:
    msg = _strip_type(rec.get("message") or "", rec.get("exc_type") or "")
    first = msg.strip().splitlines()[0] if msg.strip() else ""
    return first[:300]


def analyse(taichi: dict[str, FileRun], difftape: dict[str, FileRun]) -> dict:
    per_file, rows = [], []
    totals = defaultdict(Counter)
    for file in sorted(set(taichi) | set(difftape)):
        t_run, d_run = taichi.get(file), difftape.get(file)
        cat = category(file)
        t_tests = t_run.tests if t_run else {}
        passed_on_taichi = sorted(k for k, r in t_tests.items() if r["outcome"] == "passed")
        c = Counter()
        c["taichi_total"] = len(t_tests)
        c["taichi_passed"] = len(passed_on_taichi)
        c["taichi_skipped"] = sum(r["outcome"] == "skipped" for r in t_tests.values())
        c["taichi_failed"] = c["taichi_total"] - c["taichi_passed"] - c["taichi_skipped"]
        for key in passed_on_taichi:
            if d_run is None:
                rec = {"outcome": "not_run", "message": "not run on difftape"}
            elif d_run.skipped_internal:
                rec = {"outcome": "internal", "message": "file tests Taichi internals"}
            elif key in d_run.tests:
                rec = d_run.tests[key]
            elif d_run.file_error:
                rec = {"outcome": "error", "message": d_run.file_error,
                       "exc_type": "collection", "collection": True}
                if "TaichiInternalsUsed" in d_run.file_error:
                    rec["outcome"] = "internal"
            else:
                rec = {"outcome": "missing", "message": "no result on difftape (test id differs)"}
            kind = classify(rec) if rec["outcome"] not in ("not_run", "missing") else "missing"
            c[kind] += 1
            rows.append({"test": key, "file": file, "category": cat, "kind": kind,
                         "message": _summ(rec), "exc_type": rec.get("exc_type", ""),
                         "stmt": rec.get("exc_stmt", ""), "collection": bool(
                             rec.get("collection"))})
        per_file.append({"file": file, "category": cat, **c,
                         "taichi_seconds": round(t_run.seconds, 1) if t_run else None,
                         "difftape_seconds": round(d_run.seconds, 1) if d_run else None,
                         "difftape_file_error": d_run.file_error if d_run else None})
        totals[cat].update(c)
        totals["all"].update(c)

    groups: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        if r["kind"] in ("error", "not_refused", "message_differs"):
            label = {"not_refused": "[accepted what Taichi refuses] ",
                     "message_differs": "[error message differs] "}.get(r["kind"], "")
            if r["collection"]:
                label += "[test file fails to import] "
            etype = r["exc_type"].rsplit(".", 1)[-1] if r["exc_type"] else ""
            groups[label + (f"{etype}: " if etype and etype != "collection" else "")
                   + _normalise(r["message"])].append(r)
    group_list = sorted(({"cause": k, "count": len(v), "example": v[0]["test"],
                          "example_message": v[0]["message"],
                          "by_category": dict(Counter(x["category"] for x in v)),
                          "tests": [x["test"] for x in v]} for k, v in groups.items()),
                        key=lambda g: (-g["count"], g["cause"]))

    def pick(kind: str) -> list[dict]:
        return [{"test": r["test"], "category": r["category"], "message": r["message"],
                 "stmt": r["stmt"]} for r in rows if r["kind"] == kind]

    internal_groups = Counter(_normalise(r["message"]) for r in rows if r["kind"] == "internal")
    return {
        "totals": {k: dict(v) for k, v in totals.items()},
        "per_file": per_file,
        "failure_groups": group_list,
        "wrong_values": pick("wrong_value"),
        "hangs": pick("hang"),
        "crashes": pick("crash"),
        "skipped_on_difftape": pick("skipped"),
        "missing": pick("missing"),
        "internal": {"count": sum(internal_groups.values()),
                     "causes": internal_groups.most_common()},
    }


def compare_remote(local: dict[str, FileRun], remote: dict[str, FileRun]) -> dict:
    """The tests that pass on difftape locally and how each fared under ``arch=ti.remote``:
    a program must run there unchanged, so every such test that does not pass is a finding
    (a wrong value or a crash is a bug; an error must be a documented refusal)."""
    counts, rows = Counter(), []
    for file in sorted(set(local) & set(remote)):
        loc, rem = local[file], remote[file]
        for key, rec in sorted(loc.tests.items()):
            if rec["outcome"] != "passed":
                continue
            counts["local_passed"] += 1
            other = rem.tests.get(key) or {"outcome": "error", "message": rem.file_error or
                                           "no result remotely (test id differs)"}
            kind = classify(other)
            counts[kind] += 1
            if kind != "passed":
                rows.append({"test": key, "file": file, "kind": kind,
                             "message": _summ(other), "stmt": other.get("exc_stmt", "")})
        counts["remote_only_passed"] += sum(
            r["outcome"] == "passed" and loc.tests.get(k, {}).get("outcome") != "passed"
            for k, r in rem.tests.items())
    groups: dict[str, list[str]] = defaultdict(list)
    for r in rows:
        groups[f"{r['kind']}: {_normalise(r['message'])}"].append(r["test"])
    return {"totals": dict(counts), "differences": rows,
            "groups": sorted(({"cause": k, "count": len(v), "tests": v}
                              for k, v in groups.items()), key=lambda g: -g["count"])}


# ---------------------------------------------------------------------------------------------
# Reporting


def _pct(a: int, b: int) -> str:
    return f"{100 * a / b:.1f}%" if b else "-"


def markdown(report: dict) -> str:
    a, meta = report["analysis"], report["meta"]
    out = [f"# Taichi {meta['taichi_ref']} Python tests on difftape",
           "",
           f"difftape `{meta['difftape_rev']}`, {meta['date']}; Taichi {meta['taichi_version']} "
           f"(CPU) is the baseline. Per-test limit {meta['test_timeout']:g}s.",
           "",
           "Counted: tests Taichi **passes** on the CPU. *internal*: the test reaches into "
           "Taichi's implementation (`taichi.lang.*`, `taichi._lib`, or a file in "
           "`INTERNAL_FILES`) and is not counted against difftape; *wrong value*: an assertion "
           "on a computed value failed (a silent wrong result); *refused/error*: difftape "
           "raised; *not refused*: Taichi raises, difftape accepted the program; *message "
           "differs*: both raise, the message check failed.",
           "",
           "| part | Taichi passes | difftape passes | % | internal | wrong value | error | "
           "not refused | msg differs | hang | crash | skipped | missing |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for cat in ("core", "autodiff", "forward", "all"):
        t = Counter(a["totals"].get(cat, {}))
        base = t["taichi_passed"] - t["internal"]
        out.append(f"| {cat} | {t['taichi_passed']} | {t['passed']} | "
                   f"{_pct(t['passed'], base)} of {base} | {t['internal']} | "
                   f"{t['wrong_value']} | {t['error']} | {t['not_refused']} | "
                   f"{t['message_differs']} | {t['hang']} | {t['crash']} | {t['skipped']} | "
                   f"{t['missing']} |")
    out += ["", "## Wrong values (silent wrong results)", ""]
    out += [f"- `{w['test']}` ({w['category']}): {w['message']}"
            + (f" — at `{w['stmt']}`" if w["stmt"] else "") for w in a["wrong_values"]] or [
        "none"]
    out += ["", "## Hangs", ""]
    out += [f"- `{h['test']}`: {h['message']}" for h in a["hangs"]] or ["none"]
    out += ["", "## Crashes", ""]
    out += [f"- `{c['test']}`: {c['message']}" for c in a["crashes"]] or ["none"]
    out += ["", "## Failure groups (tests Taichi passes), by count", "",
            "| # | cause | core | autodiff | forward | example |", "|---|---|---|---|---|---|"]
    for g in a["failure_groups"]:
        bc = g["by_category"]
        cause = g["cause"].replace("|", "\\|")
        out.append(f"| {g['count']} | {cause} | {bc.get('core', 0)} | {bc.get('autodiff', 0)} "
                   f"| {bc.get('forward', 0)} | `{g['example']}` |")
    if a["internal"]["causes"]:
        out += ["", f"## Internal ({a['internal']['count']} tests, not counted)", ""]
        out += [f"- {n} × {c}" for c, n in a["internal"]["causes"]]
    if a["missing"]:
        out += ["", "## Missing on difftape (no result under the same id)", ""]
        out += [f"- `{m['test']}`" for m in a["missing"]]
    out += ["", "## Per file", "",
            "| file | part | Taichi passes | difftape passes | internal | wrong | error | hang "
            "| crash | Taichi s | difftape s | note |", "|---|---|---|---|---|---|---|---|---|---|"
            "---|---|"]
    for f in a["per_file"]:
        note = (f.get("difftape_file_error") or "")[:120].replace("|", "\\|")
        out.append(f"| {f['file']} | {f['category']} | {f.get('taichi_passed', 0)} | "
                   f"{f.get('passed', 0)} | {f.get('internal', 0)} | "
                   f"{f.get('wrong_value', 0)} | {f.get('error', 0) + f.get('not_refused', 0) + f.get('message_differs', 0)} | "  # noqa: E501
                   f"{f.get('hang', 0)} | {f.get('crash', 0)} | {f['taichi_seconds']} | "
                   f"{f['difftape_seconds']} | {note} |")
    return "\n".join(out) + "\n"


def markdown_remote(cmp: dict) -> str:
    """The local-vs-remote section of the report."""
    t = Counter(cmp["totals"])
    out = ["## difftape locally vs arch=ti.remote", "",
           f"Of {t['local_passed']} tests that pass locally, {t['passed']} pass on the server "
           f"({_pct(t['passed'], t['local_passed'])}); wrong value {t['wrong_value']}, error "
           f"{t['error']}, not refused {t['not_refused']}, message differs "
           f"{t['message_differs']}, hang {t['hang']}, crash {t['crash']}, skipped "
           f"{t['skipped']}; {t['remote_only_passed']} pass only remotely.", "",
           "| # | cause | example |", "|---|---|---|"]
    out += [f"| {g['count']} | {g['cause'].replace('|', chr(92) + '|')} | `{g['tests'][0]}` |"
            for g in cmp["groups"]]
    out += ["", "### Every difference", ""]
    out += [f"- `{r['test']}` ({r['kind']}): {r['message']}"
            + (f" — at `{r['stmt']}`" if r["stmt"] else "") for r in cmp["differences"]]
    return "\n".join(out) + "\n"


def _runs_from_json(data: dict) -> dict[str, FileRun]:
    return {f: FileRun(**r) for f, r in data.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkout", type=Path, required=True,
                    help="a Taichi checkout (tag v1.7.4) with tests/python and tests/test_utils.py")
    ap.add_argument("--output", type=Path, required=True,
                    help="report path; OUTPUT.json and OUTPUT.md are written")
    ap.add_argument("--files", nargs="*", default=["test_*.py"],
                    help="file names or globs under tests/python (default: all)")
    ap.add_argument("--backends", default="taichi,difftape")
    ap.add_argument("--baseline", type=Path,
                    help="reuse the Taichi results of an earlier report (its .json)")
    ap.add_argument("--reuse", action="append", default=[], metavar="BACKEND=JSON",
                    help="take BACKEND's results from an earlier report instead of running it "
                         "(e.g. to run the two backends as separate processes, then combine)")
    ap.add_argument("--difftape-python", default=str(REPO / ".venv" / "bin" / "python"))
    ap.add_argument("--taichi-python", default="/work/tivenv/bin/python")
    ap.add_argument("--jobs", type=int, default=2, help="files run in parallel (default 2)")
    ap.add_argument("--test-timeout", type=float, default=120.0, help="seconds per test")
    ap.add_argument("--file-timeout", type=float, default=1800.0, help="seconds per process")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    args = ap.parse_args(argv)

    checkout = args.checkout.resolve()
    pydir = checkout / "tests" / "python"
    files = sorted({p.name for pat in args.files for p in pydir.glob(pat)
                    if p.name.startswith("test_") and p.suffix == ".py"})
    if not files:
        ap.error(f"no test files match {args.files} in {pydir}")
    backends = args.backends.split(",")
    output = args.output.with_suffix("") if args.output.suffix in (".json", ".md") else args.output
    output.parent.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="taichi_suite_"))
    runs: dict[str, dict[str, FileRun]] = {}
    signal.signal(signal.SIGTERM, _stop_children)
    signal.signal(signal.SIGINT, _stop_children)
    try:
        reuse = [f"taichi={args.baseline}"] if args.baseline else []
        for item in reuse + args.reuse:
            backend, _, path = item.partition("=")
            earlier = json.loads(Path(path).read_text())["runs"][backend]
            runs[backend] = {f: r for f, r in _runs_from_json(earlier).items() if f in files}
            backends = [b for b in backends if b != backend]
        pythons = {"taichi": args.taichi_python, "difftape": args.difftape_python,
                   "difftape-remote": args.difftape_python}
        for backend in backends:
            runs[backend] = run_backend(backend, pythons[backend], checkout, files, root,
                                        args.jobs, args.test_timeout, args.file_timeout)
    finally:
        if args.keep:
            print(f"work directory kept: {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)

    def git(*a: str, cwd: Path) -> str:
        r = subprocess.run(["git", *a], cwd=cwd, capture_output=True, text=True)
        return r.stdout.strip()

    version = "import taichi; print('.'.join(map(str, taichi.__version__)))"
    tver = subprocess.run([args.taichi_python, "-c", version], capture_output=True,
                          text=True).stdout.strip().splitlines()
    rev = git("rev-parse", "--short", "HEAD", cwd=REPO) + (
        "+dirty" if git("status", "--porcelain", "kernels", cwd=REPO) else "")
    for item in args.reuse:  # difftape's results come from an earlier report: its revision
        backend, _, path = item.partition("=")
        if backend == "difftape":
            rev = json.loads(Path(path).read_text())["meta"]["difftape_rev"]
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "difftape_rev": rev,
        "taichi_ref": git("describe", "--tags", cwd=checkout) or "v1.7.4",
        "taichi_version": tver[-1] if tver else "?",
        "checkout": str(checkout), "files": files, "test_timeout": args.test_timeout,
        "internal_files": sorted(INTERNAL_FILES),
    }
    report = {"meta": meta,
              "runs": {b: {f: asdict(r) for f, r in rs.items()} for b, rs in runs.items()}}
    if "taichi" in runs and "difftape" in runs:
        report["analysis"] = analyse(runs["taichi"], runs["difftape"])
    if "difftape" in runs and "difftape-remote" in runs:
        report["remote"] = compare_remote(runs["difftape"], runs["difftape-remote"])
    output.with_suffix(".json").write_text(json.dumps(report, indent=1))
    md = (markdown(report) if "analysis" in report else "") + (
        markdown_remote(report["remote"]) if "remote" in report else "")
    if md:
        output.with_suffix(".md").write_text(md)
        print(md.split("\n## ")[0] if "analysis" in report else md.split("\n### ")[0])
    print(f"wrote {output.with_suffix('.json')}"
          + (f" and {output.with_suffix('.md')}" if md else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
