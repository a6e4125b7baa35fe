"""Run one documentation page's Python blocks, in order, in this one process.

``python tests/docs/run_page.py BLOCKS.json RESULTS.json``, started by tests/docs/test_docs.py
once per page, so each page starts from a fresh interpreter and calls ``ti.init`` as it is
written there. The blocks share one namespace, as they would for a reader who pastes them
into one session. For each block the results list what it printed (captured at the file
descriptor, so a kernel's ``print``, which writes through C's stdio, is caught too) and the
exception it raised, if any; a raising block does not stop the page.

The blocks are compiled under the page's own path with their line numbers in the page, and
the page's code is registered in ``linecache`` under that name, so difftape reads a kernel's
source (and a ``CompileError`` quotes its line) exactly as from a ``.py`` file.
"""

from __future__ import annotations

import ctypes
import json
import linecache
import os
import sys
import tempfile
import traceback
import types


def main(argv: list[str]) -> int:
    with open(argv[1]) as f:
        spec = json.load(f)
    file, blocks = spec["file"], spec["blocks"]
    lines = ["\n"] * spec["lines"]
    for b in blocks:
        for k, text in enumerate(b["source"].splitlines(keepends=True)):
            lines[b["line"] - 1 + k] = text
    linecache.cache[file] = (sum(map(len, lines)), None, lines, file)
    libc = ctypes.CDLL(None)
    # The blocks run as the main module does in a script (decorators that look up their
    # class's module, such as @ti.dataclass, find the blocks' names there).
    main_module = types.ModuleType("__main__")
    main_module.__file__ = file
    sys.modules["__main__"] = main_module
    namespace = main_module.__dict__
    results = []
    for b in blocks:
        code = compile("\n" * (b["line"] - 1) + b["source"], file, "exec")
        error = None
        with tempfile.TemporaryFile() as out:
            sys.stdout.flush()
            libc.fflush(None)
            saved = os.dup(1)
            os.dup2(out.fileno(), 1)
            try:
                exec(code, namespace)
            except Exception as e:  # reported to the test, which decides
                error = {"type": type(e).__name__, "message": str(e),
                         "traceback": traceback.format_exc()}
            finally:
                sys.stdout.flush()
                libc.fflush(None)
                os.dup2(saved, 1)
                os.close(saved)
            out.seek(0)
            printed = out.read().decode(errors="replace")
        results.append({"stdout": printed, "error": error})
    with open(argv[2], "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
