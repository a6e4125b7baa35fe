"""The wire schema of graphs, and of what kernels print, on a difftape server: the one
module the client (``difftape.client``), the gateway (``server/models.py``, its routes and
job runner) and the engine (``server/engine.py``) import, so they agree on names, encodings
and limits.

A graph captured under ``arch=ti.remote`` (or a saved graph loaded there) travels once, as
the saved-graph document of :mod:`.saved` (kernels as frontend IR, launch records over
storage named by id, named inputs), in a ``graph_create`` op; the server validates and
compiles it (``saved.build``: every kernel's IR through ``ir.validate.decode_untrusted``,
every field and ndarray checked against the session's own, bounds checks on) and keeps the
native graph under its content hash. Each replay is then one ``graph_replay`` op naming the
graph by that hash and carrying the inputs:

- a scalar: a JSON number (``"NaN"``, ``"Infinity"``, ``"-Infinity"`` for the non-finite);
- a vector/matrix: its entries, row-major, as a flat list of such numbers;
- a field: ``{"field": id}`` (a field of the session);
- an array: ``{"ndarray": id}`` (a ``ti.ndarray`` of the session), with ``"b64"``: the
  array's raw C-order bytes (base64, never a list of numbers) when a NumPy array is given:
  they are written into that ndarray (the input's own, made by the client) before the
  replay, and the replay answers ``{"arrays": {name: b64}}`` with the bytes of those the
  graph writes (``"written"`` lists the names of all it writes), which the client copies
  back into the caller's array, as a local replay writes the caller's memory.

What kernels print (``print()`` in a kernel) travels as data: the engine's program has a
print sink (``runtime/printsink.py``) that its kernels print into, and a response whose
request printed carries ``"output": {"b64": the bytes, base64; "dropped": lines}`` (a
batch's body, a job's result, the problem body of an error: the lines printed before it),
at most :data:`MAX_OUTPUT_BYTES` of text per request (per job), the lines past it counted.
The client writes it to its ``sys.stdout`` as the response arrives (:func:`show_output`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import sys
from typing import Any

#: Engine op names.
GRAPH_CREATE = "graph_create"
GRAPH_REPLAY = "graph_replay"
#: A graph's id: the SHA-256 (hex) of its document, canonically serialised (``graph_id``).
GRAPH_ID_PATTERN = r"^[0-9a-f]{64}$"
#: Graphs a session may hold (the ``graphs`` quota of a session, a 429 past it).
MAX_GRAPHS = 64
#: Named inputs of one graph.
MAX_INPUTS = 1024
#: Array inputs up to this many bytes travel inside the replay request (base64); a larger
#: one is uploaded (and, when the graph writes it, downloaded) as a body of its own.
INLINE_BYTES = 64 << 10


def graph_id(doc: Any) -> str:
    """The content hash that names a graph document (keys sorted, no spaces). Kernel IR may
    hold infinite and NaN constants (``ti.math.inf``, ``isinf``): written as JSON's
    ``Infinity``/``NaN`` tokens, as the wire carries them (Python's json reads them back)."""
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()


def encode_bytes(data: bytes | memoryview) -> str:
    return base64.b64encode(data).decode("ascii")


def decode_bytes(text: Any, what: str) -> bytes:
    """Raw bytes sent as base64; a ``ValueError`` naming ``what`` otherwise."""
    if not isinstance(text, str):
        raise ValueError(f"{what}: base64 text expected")
    try:
        return base64.b64decode(text, validate=True)
    except ValueError:
        raise ValueError(f"{what}: not valid base64") from None


_NONFINITE = {"NaN": float("nan"), "-NaN": float("nan"), "Infinity": float("inf"),
              "-Infinity": float("-inf")}


def number(v: Any, what: str) -> int | float:
    """A scalar input as it travels (a number, or a non-finite one's name) as a number."""
    if isinstance(v, str) and v in _NONFINITE:
        return _NONFINITE[v]
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ValueError(f"{what}: a number expected, got {v!r:.40}")
    return v


def encode_number(v: int | float) -> int | float | str:
    if isinstance(v, float) and v != v:
        return "NaN"
    if isinstance(v, float) and v in (float("inf"), float("-inf")):
        return "Infinity" if v > 0 else "-Infinity"
    return v


#: The key of printed output in a response (see the module's docstring).
OUTPUT = "output"
#: Bytes of printed text one request (one job) carries at most; later lines are counted.
MAX_OUTPUT_BYTES = 1 << 20


def output_document(text: bytes, dropped: int) -> dict:
    """``{"b64", "dropped"}``: printed text as it travels."""
    return {"b64": encode_bytes(text), "dropped": int(dropped)}


def output_parts(doc: Any) -> tuple[bytes, int]:
    """(text, lines dropped) of an ``output`` document; (b"", 0) for none."""
    if not isinstance(doc, dict):
        return b"", 0
    try:
        text = decode_bytes(doc.get("b64", ""), "printed output")
    except ValueError:
        text = b""
    dropped = doc.get("dropped", 0)
    return text, dropped if isinstance(dropped, int) and dropped > 0 else 0


def merge_output(first: dict | None, then: dict | None) -> dict | None:
    """Two requests' output as one (a job's ops), still at most :data:`MAX_OUTPUT_BYTES`:
    what does not fit is dropped whole, its lines counted."""
    if first is None:
        return then
    if then is None:
        return first
    (a, da), (b, db) = output_parts(first), output_parts(then)
    if da or len(a) + len(b) > MAX_OUTPUT_BYTES:
        return output_document(a, da + b.count(b"\n") + db)
    return output_document(a + b, db)


def show_output(doc: Any, stream: Any = None) -> None:
    """Write printed output to ``stream`` (the caller's ``sys.stdout``) as a local run
    prints it, then, if lines were dropped, a line saying how many."""
    text, dropped = output_parts(doc)
    if not text and not dropped:
        return
    stream = sys.stdout if stream is None else stream
    out = text.decode("utf-8", "replace")
    if dropped:
        if out and not out.endswith("\n"):
            out += "\n"
        out += (f"[difftape: {dropped} more lines printed by kernels were dropped: one "
                f"request carries at most {MAX_OUTPUT_BYTES} bytes of printed output]\n")
    stream.write(out)
