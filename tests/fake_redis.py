"""A stand-in Redis that answers in shapes no Redis gives: the picker must start, serve and keep retrying.

Speaks just enough RESP3 for redis-py's asyncio client (HELLO 3, CLIENT SETINFO, TIME, XREAD, XADD, scripts,
GET/SET);
`time` and `xread` choose what those two commands answer, and can be switched while it runs.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

GOOD_TIME = b"*2\r\n$10\r\n1700000000\r\n$1\r\n0\r\n"
BAD_TIME = b"*1\r\n:5\r\n"  # one element where TIME gives two
EMPTY_XREAD = b"_\r\n"  # null: nothing new before the block timed out
BAD_XREAD = b"*1\r\n:7\r\n"  # an integer where a (stream, entries) pair belongs


@dataclass
class FakeRedis:
    time: bytes = BAD_TIME
    xread: bytes = BAD_XREAD
    commands: list[str] = field(default_factory=list)
    server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    async def start(self) -> FakeRedis:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                command = await _read_command(reader)
                if command is None:
                    return
                name = command[0].upper()
                self.commands.append(name)
                if name == "XREAD" and "BLOCK" in (c.upper() for c in command):
                    await asyncio.sleep(0.05)  # as a blocking read would, briefly
                writer.write(self._answer(name))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()

    def _answer(self, name: str) -> bytes:
        if name == "HELLO":
            return (b"%7\r\n+server\r\n+redis\r\n+version\r\n+7.2.0\r\n+proto\r\n:3\r\n+id\r\n:1\r\n"
                    b"+mode\r\n+standalone\r\n+role\r\n+master\r\n+modules\r\n*0\r\n")
        if name == "TIME":
            return self.time
        if name == "XREAD":
            return self.xread
        if name == "XADD":
            return b"$3\r\n1-0\r\n"
        if name in ("EVALSHA", "EVAL"):
            return b":1\r\n"
        if name == "SCRIPT":
            return b"$40\r\n" + b"0" * 40 + b"\r\n"
        if name == "GET":
            return b"_\r\n"
        return b"+OK\r\n"


async def _read_command(reader: asyncio.StreamReader) -> list[str] | None:
    header = await reader.readline()
    if not header:
        return None
    if not header.startswith(b"*"):
        return header.decode(errors="replace").split()  # an inline command
    parts = []
    for _ in range(int(header[1:])):
        size = int((await reader.readline())[1:])
        parts.append((await reader.readexactly(size + 2))[:-2].decode(errors="replace"))
    return parts
