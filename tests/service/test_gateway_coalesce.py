"""The gateway writes a small response in one piece (``server/coalesce.py``): uvicorn wrote
the status line and headers and then the body, two TCP segments, so that a client waiting
for a batch's answer woke twice. Checked on the wire (the segments a client socket
received, from the kernel's TCP_INFO) against a real server, and the transport wrapper on
its own: order kept, large writes at once, nothing lost on close."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import sys

import pytest

from difftape.server.coalesce import JOIN_BYTES, WriteCombining

# struct tcp_info (linux/tcp.h): tcpi_data_segs_in, the segments with data received.
_DATA_SEGS_IN = 152


def _data_segments(sock: socket.socket) -> int:
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    return struct.unpack_from("I", info, _DATA_SEGS_IN)[0]


def _response(sock: socket.socket) -> tuple[bytes, bytes]:
    buf = b""
    while b"\r\n\r\n" not in buf:
        buf += sock.recv(65536)
    head, _, body = buf.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(65536)
    return head, body


@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="counts segments with Linux's TCP_INFO")
def test_batch_answer_is_one_segment(service):
    with service.client() as c:
        sid = c.post("/v1/sessions", json={}).json()["session_id"]
    body = json.dumps({"ops": [{"op": "create_field", "id": 1, "dtype": "f32", "shape": [2],
                                "element_shape": []}]}).encode()
    read = json.dumps({"ops": [{"op": "get_bytes", "id": 1, "role": "primal"}]}).encode()
    sock = socket.create_connection(("127.0.0.1", service.port))
    try:
        for k, payload in enumerate([body, read, read, read]):
            request = (f"POST /v1/sessions/{sid}/batch HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                       f"Authorization: Bearer {service.tokens['alice']}\r\n"
                       f"Content-Type: application/json\r\nContent-Length: {len(payload)}"
                       "\r\n\r\n").encode() + payload
            before = _data_segments(sock)
            sock.sendall(request)
            head, answer = _response(sock)
            assert head.startswith(b"HTTP/1.1 200"), head
            assert "results" in json.loads(answer)
            assert _data_segments(sock) - before == 1, f"request {k + 1}"
    finally:
        sock.close()
        with service.client() as c:
            c.delete(f"/v1/sessions/{sid}")


class _Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = self.aborted = False

    def write(self, data) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str):
        return f"info:{name}"


def test_write_combining():
    """A response's head waits for its body and leaves with it; a head alone leaves when the
    loop comes round; a large body is not copied; a close sends what is held first."""
    head = b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\n"

    async def main() -> None:
        t = _Transport()
        w = WriteCombining(t, asyncio.get_running_loop())
        w.write(head)
        assert t.writes == [] and w.get_write_buffer_size() == len(head)
        w.write(b"body")
        assert t.writes == [head + b"body"]  # at once, as one write
        w.write(b"more")  # not a head: straight through
        assert t.writes[-1] == b"more"
        w.write(head)
        await asyncio.sleep(0)
        assert t.writes[-1] == head  # alone, once the loop came round
        big = b"x" * (JOIN_BYTES + 1)
        w.write(head)
        w.write(big)
        assert t.writes[-2:] == [head, big]
        w.write(head)
        w.close()  # the held head goes before the close
        assert t.writes[-1] == head and t.closed
        w.write(head)
        await asyncio.sleep(0)
        assert t.writes[-1] == head and len(t.writes) == 6  # none on a closing transport
        assert w.get_extra_info("peername") == "info:peername"

        t2 = _Transport()
        w2 = WriteCombining(t2, asyncio.get_running_loop())
        w2.write(head)
        w2.abort()
        await asyncio.sleep(0)
        assert t2.writes == [] and t2.aborted

    asyncio.run(main())
