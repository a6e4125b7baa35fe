"""A TCP relay that adds a fixed delay to each direction: the stand-in for ``tc netem`` on
kernels without it (see netns.py). Every chunk read on one side is written to the other
``--delay`` seconds after it arrived, in order; an end of stream is passed on the same way.

``python delay_relay.py --listen HOST:PORT --to HOST:PORT --delay SECONDS`` prints "ready"
once it listens.
"""

import argparse
import asyncio
import contextlib


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                delay: float) -> None:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    async def read() -> None:
        while True:
            try:
                data = await reader.read(1 << 16)
            except ConnectionError:
                data = b""
            queue.put_nowait((loop.time() + delay, data))
            if not data:
                return

    async def write() -> None:
        while True:
            due, data = await queue.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                with contextlib.suppress(OSError):
                    writer.write_eof()
                return
            writer.write(data)
            with contextlib.suppress(ConnectionError):
                await writer.drain()

    await asyncio.gather(read(), write())


async def _serve(listen: tuple[str, int], to: tuple[str, int], delay: float) -> None:
    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            sr, sw = await asyncio.open_connection(*to)
        except OSError:
            cw.close()
            return
        try:
            await asyncio.gather(_pipe(cr, sw, delay), _pipe(sr, cw, delay))
        finally:
            for w in (cw, sw):
                w.close()

    server = await asyncio.start_server(handle, *listen)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


def _addr(s: str) -> tuple[str, int]:
    host, _, port = s.rpartition(":")
    return host, int(port)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--listen", required=True, help="HOST:PORT to accept connections on")
    p.add_argument("--to", required=True, help="HOST:PORT to forward them to")
    p.add_argument("--delay", type=float, required=True, help="seconds added each way")
    a = p.parse_args()
    asyncio.run(_serve(_addr(a.listen), _addr(a.to), a.delay))
