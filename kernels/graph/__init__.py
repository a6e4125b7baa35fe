"""``ti.graph``: capture a step of launches once and replay it natively (:mod:`.core`), and
Taichi's ``GraphBuilder`` API on the same graphs (:mod:`.builder`)."""

from __future__ import annotations

from .builder import Arg, ArgKind, GraphBuilder, Sequential
from .core import Graph, Placeholder, capture

__all__ = ["Arg", "ArgKind", "Graph", "GraphBuilder", "Placeholder", "Sequential", "capture"]
