"""The wire schema of graphs on a difftape server: the one module the client
(``difftape.client``), the gateway's request models (``server/models.py``) and the engine
(``server/engine.py``) import, so the three agree on names, encodings and limits.

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
"""

from __future__ import annotations

import base64
import hashlib
import json
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
    """The content hash that names a graph document (keys sorted, no spaces)."""
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False)
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
