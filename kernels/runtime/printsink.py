"""A print sink: a program's kernels print into memory instead of to C's ``stdout``.

A program that runs kernels for someone else (the service's engine: the kernel runs in a
worker process whose stdout is the server's) sets ``Program.print_sink``; every kernel it
compiles then gets the sink's address in its launch context, and ``print`` appends its line
there, formatted by the same C library as a local printf (``codegen/cpu.py``'s
``print_call``), so the text is what a local run prints. The owner takes the text after each
request (:meth:`PrintSink.take`) and sends it to whoever launched the kernels.

Bounded: the sink holds ``capacity`` bytes. A line that does not fit is dropped and counted,
and so is every line after it (the cursor only grows), so what is kept is the first lines,
in the order they were reserved (program order for serial code; a parallel loop's lines in
the order its threads got to them, each line whole).
"""

from __future__ import annotations

import numpy as np

from ..codegen.layout import PRINT_SINK_HEADER

_WORDS = PRINT_SINK_HEADER // 8  # cursor, capacity, dropped


class PrintSink:
    """Memory the kernels of one program print into: a header of three i64 words (cursor,
    capacity, lines dropped) and ``capacity`` bytes of text, each line NUL-terminated."""

    def __init__(self, capacity: int) -> None:
        self.capacity = int(capacity)
        self._words = np.zeros(_WORDS + -(-self.capacity // 8), dtype=np.int64)
        self._words[1] = self.capacity
        self._text = self._words[_WORDS:].view(np.uint8)[:self.capacity]
        self.address = self._words.ctypes.data

    def pending(self) -> bool:
        """Did a kernel print since the last :meth:`take`? (Two loads: cheap per request.)"""
        return bool(self._words[0] or self._words[2])

    def take(self) -> tuple[bytes, int]:
        """The text printed since the last call and how many lines were dropped; empties the
        sink. Called between launches (no kernel runs meanwhile)."""
        used = min(int(self._words[0]), self.capacity)
        dropped = int(self._words[2])
        raw = self._text[:used].tobytes()
        # A line reserved past the end was never written: its bytes were zero, and stay so
        # for the next request; the NULs that end every line go.
        self._text[:used] = 0
        self._words[0] = 0
        self._words[2] = 0
        return raw.replace(b"\0", b""), dropped
