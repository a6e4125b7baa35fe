"""``ti.graph``: capture a step of launches once and replay it natively (:mod:`.core`), and
Taichi's ``GraphBuilder`` API on the same graphs (:mod:`.builder`); graphs saved to a file and
loaded in another process (:mod:`.saved`)."""

from __future__ import annotations

from .builder import Arg, ArgKind, GraphBuilder, Sequential
from .core import Graph, Placeholder, capture
from .saved import load

__all__ = ["Arg", "ArgKind", "Graph", "GraphBuilder", "Placeholder", "Sequential", "capture",
           "load"]
