"""The documentation site (docs/, mkdocs.yml) builds strictly and every code block in it runs.

``test_site_builds_strictly``: ``mkdocs build --strict`` into a temporary folder, so a broken
link or anchor, a page missing from the navigation, an API reference entry that names no
object and an included file that is gone all fail the suite.

``test_page_code_blocks``: for each page, its Python blocks run in order in one fresh
process (tests/docs/run_page.py), ``ti.init`` as written there. A block that raises fails the
test, unless the ``output`` block that follows it shows the exception (its last line then
reads ``ExceptionName: message``). An ``output`` block (a fence whose language is
``output``) right after a Python block is compared with what that block printed, as doctest
does with ``ELLIPSIS``: ``...`` stands for any text (a file path, a line number, the last
digits of a float).

Annotations, an HTML comment on the line before a block's fence (it does not show on the site):

- ``<!-- docs-test: server -->``: the block runs against a difftape server started for the
  test (tests/service/conftest.py's ``start_server``): the placeholders ``http://127.0.0.1:8000``
  and ``dt_...`` in it become the test server's address and a user's token, and
  ``DIFFTAPE_SERVER``/``DIFFTAPE_TOKEN`` are set for the page. Such a block must use the
  server (``ti.remote`` or ``difftape.client``); a block that uses one without the annotation
  fails the test.

There is no annotation that skips a block: every Python block runs.
"""

from __future__ import annotations

import doctest
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
RUNNER = Path(__file__).with_name("run_page.py")
PAGES = sorted(p.relative_to(REPO).as_posix() for p in DOCS.rglob("*.md"))

PYTHON = {"python", "py", "python3"}
ANNOTATION = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<what>.*?)\s*-->\s*$")
KNOWN_ANNOTATIONS = {"server"}
SERVER_PLACEHOLDERS = ("http://127.0.0.1:8000", "dt_...")
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")

pytestmark = pytest.mark.difftape_only  # builds and runs difftape's own documentation


@dataclass
class Block:
    """One fenced block of a page."""

    lang: str
    line: int  # the first line of its content, 1-based
    source: str
    annotation: str | None
    output: Block | None = None  # the ``output`` block that follows a Python block


def parse(path: Path) -> list[Block]:
    """The page's fenced blocks, with their annotations, outputs attached to their blocks."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    previous_end = -1  # index of the last line of the previous block's closing fence
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = m["indent"], m["fence"]
        info = m["info"].strip().lstrip("{").lstrip(".")
        lang = re.split(r"[\s}]", info, maxsplit=1)[0].lower() if info else ""
        close = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        j = i + 1
        while j < len(lines) and not close.match(lines[j]):
            j += 1
        assert j < len(lines), f"{path}:{i + 1}: unclosed code fence"
        body = [ln[len(indent):] if ln.startswith(indent) else ln.lstrip()
                for ln in lines[i + 1:j]]
        above = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        a = ANNOTATION.match(above)
        block = Block(lang, i + 2, "\n".join(body) + "\n", a["what"] if a else None)
        between = lines[previous_end + 1:i]
        if lang == "output":
            assert blocks and blocks[-1].lang in PYTHON and not any(s.strip() for s in between), (
                f"{path}:{i + 1}: an output block must follow a Python block directly")
            blocks[-1].output = block
        blocks.append(block)
        previous_end = j
        i = j + 1
    return blocks


def python_blocks(path: Path) -> list[Block]:
    return [b for b in parse(path) if b.lang in PYTHON]


def uses_server(b: Block) -> bool:
    return "ti.remote" in b.source or "difftape.client" in b.source


def check_annotations(name: str, blocks: list[Block]) -> bool:
    """Whether the page needs the test server; fails on unknown or unwarranted annotations."""
    needs_server = False
    for b in blocks:
        where = f"{name}:{b.line - 1}"
        if b.annotation is None:
            assert not (b.lang in PYTHON and uses_server(b)), (
                f"{where}: the block uses a server: annotate it <!-- docs-test: server -->")
            continue
        assert b.lang in PYTHON, f"{where}: only Python blocks take docs-test annotations"
        assert b.annotation in KNOWN_ANNOTATIONS, (
            f"{where}: unknown annotation {b.annotation!r} (known: {sorted(KNOWN_ANNOTATIONS)})")
        assert uses_server(b), f"{where}: annotated 'server' but uses no server"
        needs_server = True
    return needs_server


@pytest.fixture(scope="module")
def docs_server(tmp_path_factory):
    """A difftape server for the pages' ``server`` blocks (started on first use)."""
    # tests/ is on sys.path (tests/conftest.py's folder), so the service tests' helpers are
    # importable; a module of our own would copy them.
    from service.conftest import start_server

    server = start_server(tmp_path_factory.mktemp("docs-server"), users=("alice",),
                          max_body_bytes=64 * 2**20)
    yield server
    server.stop()


def run_blocks(name: str, path: Path, blocks: list[Block], tmp_path: Path,
               server=None) -> list[dict]:
    """Run the blocks in one fresh process (tests/docs/run_page.py); their results."""
    env = dict(os.environ)
    for k in ("DIFFTAPE_ARCH", "TI_ARCH", "DIFFTAPE_SERVER", "DIFFTAPE_TOKEN"):
        env.pop(k, None)
    sent = []
    for b in blocks:
        source = b.source
        if b.annotation == "server":
            url, token = server.url, server.tokens["alice"]
            source = source.replace(SERVER_PLACEHOLDERS[0], url).replace(SERVER_PLACEHOLDERS[1],
                                                                        token)
            env.update(DIFFTAPE_SERVER=url, DIFFTAPE_TOKEN=token)
        sent.append({"line": b.line, "source": source})
    spec = tmp_path / "blocks.json"
    results = tmp_path / "results.json"
    n_lines = len(path.read_text().splitlines()) + 1
    spec.write_text(json.dumps({"file": name, "lines": n_lines, "blocks": sent}))
    out = subprocess.run([sys.executable, str(RUNNER), str(spec), str(results)], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"{name}: the block runner failed:\n{out.stdout}\n{out.stderr}"
    return json.loads(results.read_text())


def matches(want: str, got: str) -> bool:
    """doctest's comparison with ELLIPSIS, trailing spaces and blank edges ignored."""
    def norm(s: str) -> str:
        return "\n".join(ln.rstrip() for ln in s.strip("\n").splitlines()) + "\n"

    return doctest.OutputChecker().check_output(norm(want), norm(got), doctest.ELLIPSIS)


def page_failures(name: str, path: Path, tmp_path: Path, request) -> list[str]:
    """What is wrong with a page's code blocks: raised, or printed other than shown."""
    blocks = python_blocks(path)
    server = (request.getfixturevalue("docs_server") if check_annotations(name, parse(path))
              else None)
    results = run_blocks(name, path, blocks, tmp_path, server)
    failures = []
    for b, r in zip(blocks, results, strict=True):
        got = r["stdout"]
        if r["error"]:
            got += f"{r['error']['type']}: {r['error']['message']}\n"
            if b.output is None:
                failures.append(f"{name}:{b.line - 1}: the block raised\n"
                                f"{r['error']['traceback']}")
                continue
        if b.output is not None and not matches(b.output.source, got):
            failures.append(f"{name}:{b.output.line - 1}: the output differs\n--- expected\n"
                            f"{b.output.source}--- got\n{got}"
                            + (r["error"]["traceback"] if r["error"] else ""))
    return failures


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(REPO / p)])
def test_page_code_blocks(page, tmp_path, request):
    failures = page_failures(page, REPO / page, tmp_path, request)
    assert not failures, "\n\n".join(failures)


PAGE_WITH_MISTAKES = """# A page

```python
print(1 + 1)
```

```output
3
```

```python
raise ValueError("no output block shows this")
```

```python
import difftape as ti
ti.init(arch=ti.cpu)
x = ti.field(ti.f32, shape=2)

@ti.kernel
def bad(i: ti.f32):
    x[i] = 1.0

bad(0.5)
```

```output
KernelTypeError:
File "...", line 22, in bad:
    x[i] = 1.0
    ^^^^^^^^^^
index into 'x' must be an integer, ...
```
"""


def test_checker_catches_wrong_outputs_and_errors(tmp_path, request):
    """The checks above can fail: a wrong output and an unshown exception are reported, and
    an exception shown in its output block (with the page's line quoted) is not."""
    page = tmp_path / "page.md"
    page.write_text(PAGE_WITH_MISTAKES)
    failures = page_failures(str(page), page, tmp_path, request)
    assert len(failures) == 2, failures
    assert "the output differs" in failures[0] and "--- got\n2\n" in failures[0]
    assert "the block raised" in failures[1] and "no output block shows this" in failures[1]


def test_unannotated_server_block_is_refused(tmp_path):
    page = tmp_path / "page.md"
    page.write_text('```python\nti.init(arch=ti.remote, server="http://127.0.0.1:8000")\n```\n')
    with pytest.raises(AssertionError, match="annotate it"):
        check_annotations("page.md", parse(page))
    page.write_text("<!-- docs-test: server -->\n```python\nprint(1)\n```\n")
    with pytest.raises(AssertionError, match="uses no server"):
        check_annotations("page.md", parse(page))
    page.write_text("<!-- docs-test: skip -->\n```python\nprint(1)\n```\n")
    with pytest.raises(AssertionError, match="unknown annotation"):
        check_annotations("page.md", parse(page))


def test_every_output_block_follows_a_python_block():
    """An ``output`` block anywhere else could not be checked (the parser refuses it)."""
    for page in PAGES:
        parse(REPO / page)


def test_site_builds_strictly(tmp_path):
    site = tmp_path / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                          str(REPO / "mkdocs.yml"), "--site-dir", str(site)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    assert time.monotonic() - start < 120, "the docs build got slow"
    # The API reference is rendered from the docstrings (an empty page would also build).
    api = (site / "api" / "ad" / "index.html").read_text()
    assert "record kernel launches, then back-propagate" in api
    # The HTTP API page includes server/PROTOCOL.md itself.
    protocol = (site / "protocol" / "index.html").read_text()
    assert "difftape service protocol" in protocol
