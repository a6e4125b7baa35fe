"""The layering (README, "Architecture") as a contract that CI checks.

* ``.importlinter``'s contracts, run with import-linter's ``lint-imports``: the layers, the core
  not knowing the service, nothing below the API importing the package root, no cycles;
* no module of ``kernels/`` in an import cycle (any strongly connected component of the whole
  module graph, function-level imports included);
* few function-level imports of our own modules in ``kernels/``, each with its reason.

import-linter reads a package from one directory, while the distribution maps three folders
onto ``difftape`` (pyproject's ``package-dir``): the checks run on a copy laid out as installed.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / ".importlinter"
#: The issue's bar: function-level imports of our own modules in kernels/ stay below this.
MAX_FUNCTION_LEVEL_IMPORTS = 20
REASON = "Function-level:"


def _stage(dest: Path) -> Path:
    """``difftape`` as installed (kernels/ with server/ and client/ inside) under ``dest``."""
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    pkg = dest / "difftape"
    shutil.copytree(ROOT / "kernels", pkg, ignore=skip)
    shutil.copytree(ROOT / "server", pkg / "server", ignore=skip)
    shutil.copytree(ROOT / "client", pkg / "client", ignore=skip)
    return dest


def _python(tree: Path, *args: str) -> subprocess.CompletedProcess:
    """Run Python with the staged ``tree`` first on the path (the venv's editable install of
    difftape must not be what the tools read)."""
    env = {"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, *args], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=300)


def _lint(tree: Path) -> subprocess.CompletedProcess:
    return _python(tree, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                   "sys.exit(lint_imports_command())",
                   "--config", str(CONFIG), "--no-cache")


@pytest.fixture
def staged(tmp_path: Path) -> Path:
    pytest.importorskip("importlinter", reason="import-linter (and grimp) are in the `test` extra:"
                        " pip install -e '.[test]'")
    return _stage(tmp_path)


def test_contracts_hold(staged: Path):
    r = _lint(staged)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout


@pytest.mark.parametrize(("module", "line", "broken"), [
    # the IR reaching up into the frontend
    ("ir/printer.py", "from difftape.frontend import kernel as _up",
     "difftape.ir is not allowed to import difftape.frontend"),
    # the runtime knowing the HTTP client
    ("runtime/cache.py", "from difftape.client import runtime as _up",
     "difftape.runtime is not allowed to import difftape.client"),
    # the frontend importing the whole API through the package root
    ("frontend/builder.py", "import difftape as _up",
     "difftape.frontend is not allowed to import difftape.ad"),
    # a cycle inside one layer
    ("ir/nodes.py", "from difftape.ir import printer as _up",
     "No cycles are allowed in difftape.ir"),
])
def test_an_upward_import_breaks_the_contract(staged: Path, module: str, line: str,
                                              broken: str):
    path = staged / "difftape" / module
    path.write_text(path.read_text() + f"\n{line}  # noqa\n")
    r = _lint(staged)
    assert r.returncode != 0, r.stdout
    assert broken in r.stdout, r.stdout


CYCLES = textwrap.dedent("""
    import sys
    import grimp

    g = grimp.build_graph("difftape", cache_dir=None, exclude_type_checking_imports=True)
    mods = sorted(g.modules)
    edges = {m: sorted(g.find_modules_directly_imported_by(m)) for m in mods}
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in edges[v]:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for m in mods:
        if m not in index:
            visit(m)
    for comp in out:
        print(" ".join(comp))
""")


def test_no_module_in_an_import_cycle(staged: Path):
    r = _python(staged, "-c", CYCLES)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "", f"import cycles (strongly connected modules):\n{r.stdout}"


def _function_level_imports(root: Path) -> list[tuple[str, int, bool]]:
    """(file, line, has its reason) for each import of a difftape module made inside a
    function of ``root``. The reason is a comment starting ``# Function-level:`` just above the
    import, or above the block of imports it belongs to."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        src = path.read_text()
        lines = src.splitlines()
        tree = ast.parse(src)
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom):
                    ours = node.level > 0 or (node.module or "").split(".")[0] == "difftape"
                elif isinstance(node, ast.Import):
                    ours = any(a.name.split(".")[0] == "difftape" for a in node.names)
                else:
                    continue
                if not ours:
                    continue
                k = node.lineno - 2
                reason = False
                while k >= 0 and lines[k].strip().startswith(("#", "from ", "import ")):
                    reason = reason or REASON in lines[k]  # one reason for a block of imports
                    k -= 1
                name = str(path.relative_to(root))
                found[name, node.lineno] = (name, node.lineno, reason)  # nested defs: once
    return list(found.values())


def test_function_level_imports_are_few_and_give_their_reason():
    found = _function_level_imports(ROOT / "kernels")
    unexplained = [f"{f}:{n}" for f, n, ok in found if not ok]
    assert not unexplained, f"function-level imports without a '# {REASON} ...' comment above " \
                            f"them: {unexplained}"
    assert len(found) < MAX_FUNCTION_LEVEL_IMPORTS, [f"{f}:{n}" for f, n, _ in found]


def test_the_count_sees_function_level_imports(tmp_path: Path):
    """The counter itself: a function-level import without a reason is found and flagged."""
    (tmp_path / "m.py").write_text("def f():\n    from . import x\n\n\ndef g():\n"
                                   "    # Function-level: a reason\n    import difftape.y\n")
    found = _function_level_imports(tmp_path)
    assert [(n, ok) for _, n, ok in found] == [(2, False), (7, True)]
