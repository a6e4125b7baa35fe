"""One socket write per small response: uvicorn's HTTP protocols write a response's status
line and headers when the app sends ``http.response.start`` and the body when it sends
``http.response.body``, two writes that reach the client as two TCP segments. A client
blocked on the answer then wakes for the headers, parses them, and sleeps again until the
body comes: per request one more wake-up of the client and one more system call on each
side, on the path of every step a remote program takes (a replayed graph's one request, a
read). Measured on a 2-core VM, the client woke twice for about half the batch answers.

:func:`protocol` makes the gateway's protocol class (the one uvicorn would pick) with the
connection's transport wrapped in :class:`WriteCombining`: writes made while one callback of
the event loop runs are joined and written once, when the loop comes round (``call_soon``),
so a response sent without waiting in between (the batch fast path's start and body, every
small JSON answer) leaves in one write. Streams are unaffected: a write that would make the
pending bytes larger than :data:`COMBINE_BYTES` goes out at once, after what is pending, and
closing the connection sends what is pending first.
"""

from __future__ import annotations

import asyncio
from typing import Any

#: Writes are held for joining only while the pending bytes stay below this size.
COMBINE_BYTES = 64 << 10


class WriteCombining:
    """A transport whose small writes within one event-loop callback go out as one write;
    every other call goes to the wrapped transport."""

    __slots__ = ("_transport", "_loop", "_pending", "_size")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []
        self._size = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        n = len(data)
        if not n:
            return
        if self._size + n >= COMBINE_BYTES:  # large: in order, at once
            self.flush()
            self._transport.write(data)
            return
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.append(bytes(data))
        self._size += n

    def writelines(self, lines) -> None:
        for data in lines:
            self.write(data)

    def flush(self) -> None:
        """Write what is pending (called by the loop, and before a large write or a close)."""
        if not self._pending:
            return
        data = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
        self._pending.clear()
        self._size = 0
        if not self._transport.is_closing():
            self._transport.write(data)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + self._size

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._pending.clear()
        self._size = 0
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def protocol(base: type | None = None) -> type:
    """``base`` (by default the HTTP protocol uvicorn picks: httptools', else h11's) with
    its connections' transports wrapped in :class:`WriteCombining`; give it to
    ``uvicorn.Config(http=...)``."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        base = AutoHTTPProtocol

    class Combining(base):  # type: ignore[misc, valid-type]
        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(WriteCombining(transport, asyncio.get_running_loop()))

    Combining.__name__ = Combining.__qualname__ = f"WriteCombining{base.__name__}"
    return Combining
