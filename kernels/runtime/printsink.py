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

On a GPU grid (CUDA, the simulated grid) a kernel has no snprintf: it appends binary records
to :class:`PrintRecords`, a buffer in device memory with the same header and the same
dropping rule, which the launch protocol (``runtime/grid.py``) takes at each sync point and
formats here with C's snprintf (:func:`format_line`): the text is the CPU's, byte for byte.
The lines then go to the program's :class:`PrintSink` where it has one (:meth:`PrintSink.append`,
the engine's), else to ``sys.stdout``.
"""

from __future__ import annotations

import ctypes
import struct

import numpy as np

from ..codegen.layout import PRINT_SINK_HEADER

_WORDS = PRINT_SINK_HEADER // 8  # cursor, capacity, dropped


class PrintSink:
    """Memory the kernels of one program print into: a header of three i64 words (cursor,
    capacity, lines dropped) and ``capacity`` bytes of text, each line NUL-terminated.
    Allocated when first needed (:meth:`allocate`: the first kernel that prints), so a
    program that never prints does not hold it."""

    def __init__(self, capacity: int) -> None:
        self.capacity = int(capacity)
        self._words: np.ndarray | None = None

    @property
    def allocated(self) -> bool:
        return self._words is not None

    def allocate(self) -> None:
        """Take the sink's memory (the header words and the text), if not yet."""
        if self._words is None:
            words = np.zeros(_WORDS + -(-self.capacity // 8), dtype=np.int64)
            words[1] = self.capacity
            self._text = words[_WORDS:].view(np.uint8)[:self.capacity]
            self._words = words

    @property
    def footprint(self) -> int:
        """Bytes it holds once allocated (the header and the text), for a quota's check
        before :meth:`allocate`."""
        return 8 * (_WORDS + -(-self.capacity // 8))

    @property
    def nbytes(self) -> int:
        """Bytes it holds (0 until allocated)."""
        return 0 if self._words is None else self._words.nbytes

    @property
    def address(self) -> int:
        """Where kernels append (the launch context's ``print_sink``); allocates."""
        self.allocate()
        return self._words.ctypes.data

    def pending(self) -> bool:
        """Did a kernel print since the last :meth:`take`? (Two loads: cheap per request.)"""
        w = self._words
        return w is not None and bool(w[0] or w[2])

    def take(self) -> tuple[bytes, int]:
        """The text printed since the last call and how many lines were dropped; empties the
        sink. Called between launches (no kernel runs meanwhile)."""
        if self._words is None:
            return b"", 0
        used = min(int(self._words[0]), self.capacity)
        dropped = int(self._words[2])
        raw = self._text[:used].tobytes()
        # A line reserved past the end was never written: its bytes were zero, and stay so
        # for the next request; the NULs that end every line go.
        self._text[:used] = 0
        self._words[0] = 0
        self._words[2] = 0
        return raw.replace(b"\0", b""), dropped

    def room(self) -> int:
        """Bytes left for lines (each with its NUL)."""
        if self._words is None:
            return self.capacity
        return max(0, self.capacity - int(self._words[0]))

    def append(self, lines: list[bytes], dropped: int = 0) -> None:
        """Lines printed elsewhere (a grid program's records, formatted by
        :class:`PrintRecords`) appended as a kernel appends its own: each whole or, once one
        does not fit, it and every later one counted as dropped; ``dropped`` more lines
        counted as such."""
        self.allocate()
        words, cap = self._words, self.capacity
        for line in lines:
            cursor = int(words[0])
            if cursor >= cap:
                words[2] += 1
                continue
            end = cursor + len(line) + 1
            words[0] = end
            if end <= cap:
                self._text[cursor:end - 1] = np.frombuffer(line, np.uint8)
            else:
                words[2] += 1
        words[2] += dropped


#: bytes of print records a grid program's buffer holds: what its kernels print between two
#: sync points (a printing launch is one). 4 MiB (CUDA's printf FIFO holds 1 MiB), so that
#: a server's engine fills its response's 1 MiB of text first (a line of text is shorter
#: than its record: 8 bytes of key and 8 per operand).
RECORD_BYTES = 4 << 20

_libc = ctypes.CDLL(None)
_snprintf = _libc.snprintf
_snprintf.restype = ctypes.c_int


def format_line(fmt: bytes, kinds: tuple[str, ...], words: np.ndarray) -> bytes:
    """One line as C's ``snprintf`` makes it from ``fmt`` and the operands' 64-bit words
    (``kinds``: ``ir.printf.vararg_kind`` of each): what the CPU's printf prints."""
    args = []
    for kind, w in zip(kinds, words.tolist(), strict=True):
        if kind == "double":
            args.append(ctypes.c_double(struct.unpack("<d", struct.pack("<q", w))[0]))
        elif kind == "i32":
            args.append(ctypes.c_int32(w & 0xFFFFFFFF))
        else:
            args.append(ctypes.c_int64(w))
    buf = ctypes.create_string_buffer(256)
    n = _snprintf(buf, 256, fmt, *args)
    if n >= 256:
        buf = ctypes.create_string_buffer(n + 1)
        n = _snprintf(buf, n + 1, fmt, *args)
    return buf.raw[:max(n, 0)]


class PrintRecords:
    """A grid program's print buffer, in device memory: ``print`` in a kernel appends a
    record (``codegen/cuda.py``'s ``print_call``: a key word, the kernel's tag << 32 | the
    line's number in ``ir.printf.print_formats``, then one word per operand), reserved by one
    atomic add on the cursor; the host takes them after a sync point and formats each with
    C's snprintf, so the text is byte for byte what the CPU prints. Records, not text, as a
    GPU thread has no snprintf (and formatting on the host costs the kernel nothing). The
    header is a print sink's (cursor, capacity, lines dropped: ``codegen/layout.py``), and a
    record that does not fit is dropped and counted, as is every one after it.

    ``address``: a zeroed block of ``PRINT_SINK_HEADER + capacity`` bytes (the launch queue's,
    ``runtime/grid.py``); ``memory``: the device memory it is in."""

    def __init__(self, memory, address: int, capacity: int) -> None:
        self.memory, self.address = memory, address
        self.capacity = capacity - capacity % 8
        self._header = np.array([0, self.capacity, 0], np.int64)
        memory.upload(address, self._header)  # stream-ordered: before any launch

    def take(self, formats: dict[int, list[tuple[bytes, tuple[str, ...]]]],
             room: int | None = None) -> tuple[list[bytes], int]:
        """The lines printed since the last call, formatted, and how many were dropped;
        empties the buffer. Called at a sync point (the stream drained). ``formats``: the
        print lines (``ir.printf.print_formats``, format strings encoded) of each kernel tag
        that may have printed; ``room``: bytes the destination still holds (a
        :class:`PrintSink`'s, each line with its NUL), past which lines are counted as
        dropped without being formatted, as the sink would drop them."""
        header = self._header
        self.memory.download(header, self.address)
        cursor, dropped = int(header[0]), int(header[2])
        if not cursor and not dropped:
            return [], 0
        used = min(cursor, self.capacity)
        words = np.empty(_WORDS + used // 8, np.int64)
        self.memory.download(words, self.address)
        self.discard(used)
        lines = []
        at, end = _WORDS, words.size
        while at < end:
            key = int(words[at])
            if key == 0:  # reserved past the end, never written
                break
            fmt, kinds = formats[key >> 32][key & 0xFFFFFFFF]
            if room is not None and room <= 0:
                dropped += 1
            else:
                line = format_line(fmt, kinds, words[at + 1:at + 1 + len(kinds)])
                if room is not None:
                    room -= len(line) + 1
                if room is None or room >= 0:
                    lines.append(line)
                else:
                    dropped += 1
            at += 1 + len(kinds)
        return lines, dropped

    def discard(self, used: int | None = None) -> None:
        """Empty the buffer (the records of an attempt that overflowed its stacks and runs
        again are never shown): its used bytes zeroed, so a record reserved but never
        written reads as the end, and the header reset. ``used``: bytes of records, if
        known (else read)."""
        if used is None:
            self.memory.download(self._header, self.address)
            used = min(int(self._header[0]), self.capacity)
        self.memory.memset(self.address, 0, PRINT_SINK_HEADER + used)
        self._header[:] = (0, self.capacity, 0)
        self.memory.upload(self.address, self._header)
