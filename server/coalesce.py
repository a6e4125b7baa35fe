"""One socket write per small response: uvicorn's HTTP protocols write a response's status
line and headers when the app sends ``http.response.start`` and the body when it sends
``http.response.body``, two writes that reach the client as two TCP segments. A client
blocked on the answer then wakes for the headers, parses them, and sleeps again until the
body comes: per request one more wake-up of the client and one more system call on each
side, on the path of every step a remote program takes (a replayed graph's one request, a
read). Measured on a 2-core VM, the client woke twice for about half the batch answers.

:func:`protocol` makes the gateway's protocol class (the one uvicorn would pick) with the
connection's transport wrapped in :class:`WriteCombining`, which holds a response's head
(status line and headers, one write ending in a blank line) until the next write, the body,
and writes the two as one, at once; a head with no write after it in the same callback of
the event loop (a response without a body, a stream that has not sent yet) goes out when
the loop comes round (``call_soon``). Every other write goes straight through, so nothing
waits for what runs after the response is sent (the access log) and streams are as before.
"""

from __future__ import annotations

import asyncio
from typing import Any

#: A write is held as a response's head only up to this size.
HEAD_BYTES = 16 << 10
#: A body is joined to its head (copied) only up to this size; a larger one follows it.
JOIN_BYTES = 256 << 10


class WriteCombining:
    """A transport that writes a response's head together with the write that follows it;
    every other call goes to the wrapped transport."""

    __slots__ = ("_transport", "_loop", "_head")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._head: bytes | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not len(data):
            return
        head = self._head
        if head is not None:
            self._head = None
            if len(data) <= JOIN_BYTES:
                self._transport.write(head + bytes(data))
                return
            self._transport.write(head)  # a large body: not copied to join them
            self._transport.write(data)
        elif (len(data) <= HEAD_BYTES and bytes(data[:7]) == b"HTTP/1."
              and bytes(data[-4:]) == b"\r\n\r\n"):
            self._head = bytes(data)
            self._loop.call_soon(self.flush)
        else:
            self._transport.write(data)

    def writelines(self, lines) -> None:
        for data in lines:
            self.write(data)

    def flush(self) -> None:
        """Write a held head (called by the loop, and before a close)."""
        head = self._head
        if head is not None:
            self._head = None
            if not self._transport.is_closing():
                self._transport.write(head)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + len(self._head or b"")

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._head = None
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
