"""``Tape.visualize``: the recorded launches and the fields they read and write, as DOT.

Each launch is a box numbered in recording order; each field gets a new node (a *version*)
every time a launch writes it, so the graph is acyclic and shows what back-propagation walks:
gradients flow against the arrows. Reads and writes are taken from the primal IR of each
launch as the frontend builds it (the buffers its loads, stores and atomics touch).
"""

from __future__ import annotations

import os
import shutil
import subprocess

from ..errors import MediaError
from ..frontend.kernel import Kernel
from ..ir.nodes import walk
from ..runtime import program


def _accesses(kernel, args: tuple) -> tuple[list[str], list[str]]:
    # The IR as the frontend builds it, not a compiled instance: under arch=ti.remote the
    # fields live on the server and nothing is compiled here (the client builds this IR too).
    spec = () if kernel._simple else kernel._specialize(args)[1]
    ir = kernel.build_ir(program.get(), spec)
    reads: dict[str, None] = {}
    writes: dict[str, None] = {}
    for s in walk(ir.body):
        if s.op == "load":
            reads[ir.buffers[s.attr].name] = None
        elif s.op == "store":
            writes[ir.buffers[s.attr].name] = None
        elif s.op == "atomic":
            name = ir.buffers[s.attr[0]].name
            writes[name] = None
            if s.attr[1] not in ("add", "sub"):
                reads[name] = None
    return list(reads), list(writes)


def _q(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def tape_dot(tape) -> str:
    """The DOT text of a Tape's recording."""
    lines = ["digraph tape {", "  rankdir=LR;", '  node [fontname="Helvetica"];']
    version: dict[str, int] = {}
    declared: set[str] = set()

    def node(name: str) -> str:
        v = version.get(name, 0)
        ident = f"{name}@{v}"
        if ident not in declared:
            declared.add(ident)
            label = name if v == 0 else f"{name} (v{v})"
            lines.append(f"  {_q(ident)} [shape=ellipse, label={_q(label)}];")
        return ident

    for k, entry in enumerate(tape.entries):
        box = f"launch {k}"
        fn = entry.forward
        if isinstance(fn, Kernel):
            reads, writes = _accesses(fn, entry.args)
            label = f"{k}: {entry.name}"
            style = ""
        else:
            reads, writes = [], []
            label = f"{k}: {entry.name} (custom gradient)" if entry.backward else \
                f"{k}: {entry.name} (no gradient)"
            style = ", style=dashed"
        lines.append(f"  {_q(box)} [shape=box, label={_q(label)}{style}];")
        for r in reads:
            lines.append(f"  {_q(node(r))} -> {_q(box)};")
        for w in writes:
            if f"{w}@{version.get(w, 0)}" in declared:  # a write makes a new version
                version[w] = version.get(w, 0) + 1
            lines.append(f"  {_q(box)} -> {_q(node(w))};")
    loss = tape.loss
    if loss is not None and hasattr(loss, "_label"):
        name = loss._label()
        ident = f"{name}@{version.get(name, 0)}"
        if ident in declared:
            lines.append(f"  {_q(ident)} [peripheries=2];")
    lines.append("}")
    return "\n".join(lines) + "\n"


#: How to get Graphviz's ``dot``, said wherever an SVG needs it.
INSTALL_GRAPHVIZ = ("install Graphviz, whose `dot` program draws the SVG: `apt install graphviz` "
                    "(Debian/Ubuntu), `brew install graphviz` (macOS) or `conda install -c "
                    "conda-forge graphviz`")


def write_graph(dot: str, path: str) -> list[str]:
    """Write the graph; the files written. A ``path`` ending in ``.svg`` asks for the picture:
    the DOT text goes beside it (``.dot``) and Graphviz's ``dot`` program draws the SVG, or a
    :class:`MediaError` says how to install Graphviz (the DOT file is written all the same).
    Any other ``path`` gets the DOT text, and the SVG beside it (``.svg``) when ``dot`` is
    installed. ``dot`` runs as a program: no Python binding is needed."""
    stem = os.path.splitext(path)[0]
    asked = path.lower().endswith(".svg")
    dot_path = stem + ".dot" if asked else path
    svg_path = path if asked else stem + ".svg"
    with open(dot_path, "w", encoding="utf-8") as f:
        f.write(dot)
    exe = shutil.which("dot")
    if exe is None:
        if asked:
            raise MediaError(f"cannot draw {svg_path}: Graphviz's `dot` program is not on the "
                             f"PATH; {INSTALL_GRAPHVIZ} (the graph is in {dot_path})")
        return [dot_path]
    try:
        run = subprocess.run([exe, "-Tsvg", "-o", svg_path, dot_path], capture_output=True,
                             text=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise MediaError(f"Graphviz's `dot` ({exe}) could not draw {svg_path}: {e}") from None
    if run.returncode != 0:
        raise MediaError(f"Graphviz's `dot` ({exe}) could not draw {svg_path} (exit "
                         f"{run.returncode}): {run.stderr.strip()[:2000]}")
    return [dot_path, svg_path]
