"""The attach connection of a container as a plain bidirectional byte stream: the runtime port
carries bytes, so Docker's multiplexing stays here."""

from __future__ import annotations

import logging
import socket
import struct
from typing import Any

import anyio.abc
from anyio.abc import ByteStream

from ..errors import EngineError

log = logging.getLogger(__name__)


async def socket_stream(raw: Any) -> ByteStream:
    """The socket under the SDK's attach response, as an anyio stream."""
    sock = getattr(raw, "_sock", raw)
    if isinstance(sock, socket.socket) and not hasattr(sock, "do_handshake"):
        return await anyio.abc.SocketStream.from_socket(sock)
    raise EngineError("attaching over this Docker endpoint (TLS or SSH) is not supported; use a unix or tcp socket")


MUX = struct.Struct(">BxxxI")
MUX_STDOUT = 1


class DemuxedStream(ByteStream):
    """The attach stream as plain stdout bytes: Docker's 8-byte multiplexing headers (stream type,
    then the frame's length) are stripped as the bytes arrive; stderr goes to the debug log."""

    def __init__(self, raw: ByteStream, name: str) -> None:
        self._raw = raw
        self._name = name
        self._header = bytearray()
        self._kind = 0
        self._left = 0  # bytes of the current multiplexed frame still to come

    def _demux(self, data: bytes) -> bytes:
        stdout = bytearray()
        stderr = bytearray()
        view = memoryview(data)
        while view:
            if self._left == 0:
                need = MUX.size - len(self._header)
                self._header += view[:need]
                view = view[need:]
                if len(self._header) == MUX.size:
                    self._kind, self._left = MUX.unpack(self._header)
                    self._header.clear()
                continue
            chunk, view = view[: self._left], view[self._left :]
            self._left -= len(chunk)
            (stdout if self._kind == MUX_STDOUT else stderr).extend(chunk)
        if stderr:
            log.debug("agent %s stderr: %s", self._name, bytes(stderr[:2000]).decode("utf-8", "replace").rstrip())
        return bytes(stdout)

    async def receive(self, max_bytes: int = 65536) -> bytes:
        while True:
            data = self._demux(await self._raw.receive(max_bytes))
            if data:
                return data

    async def send(self, item: bytes) -> None:
        await self._raw.send(item)

    async def send_eof(self) -> None:
        await self._raw.send_eof()

    async def aclose(self) -> None:
        await self._raw.aclose()
