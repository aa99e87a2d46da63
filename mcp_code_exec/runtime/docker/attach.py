"""The attach connection of a container as a plain bidirectional byte stream: the runtime port
carries bytes, so Docker's multiplexing stays here."""

from __future__ import annotations

import logging
import os
import socket
import ssl
import struct
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import anyio
import anyio.abc
from anyio.abc import ByteStream
from anyio.streams.buffered import BufferedByteReceiveStream

from ...errors import EngineError

log = logging.getLogger(__name__)


async def socket_stream(raw: Any) -> ByteStream:
    """The socket under the SDK's attach response, as an anyio stream."""
    sock = getattr(raw, "_sock", raw)
    if isinstance(sock, socket.socket) and not hasattr(sock, "do_handshake"):
        return await anyio.abc.SocketStream.from_socket(sock)
    raise EngineError("attaching over this Docker endpoint (TLS or SSH) is not supported; use a unix or tcp socket")


Connect = Callable[[], Awaitable[ByteStream]]
ATTACH = (
    "POST /containers/{id}/attach?stream=1&stdin=1&stdout=1&stderr=1 HTTP/1.1\r\n"
    "Host: docker\r\nConnection: Upgrade\r\nUpgrade: tcp\r\nContent-Length: 0\r\n\r\n"
)


def tls_connector(url: str, cert_path: str) -> Connect:
    """Connections to a tcp:// engine over mutual TLS, made with anyio (blocking: it reads the
    files). The SDK's TLS attach socket is a blocking ``ssl.SSLSocket`` an event loop cannot drive,
    so a TLS engine's attach streams are connections of our own (``upgraded_attach``)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port or 2376
    context = ssl.create_default_context(cafile=os.path.join(cert_path, "ca.pem"))  # that CA alone
    context.load_cert_chain(os.path.join(cert_path, "cert.pem"), os.path.join(cert_path, "key.pem"))

    async def connect() -> ByteStream:
        return await anyio.connect_tcp(host, port, ssl_context=context, tls_standard_compatible=False)

    return connect


async def upgraded_attach(connect: Connect, container_id: str) -> ByteStream:
    """Attach to a container over a new connection: the HTTP request Docker's clients send (an
    upgrade to a raw stream), then the connection itself is the container's stdin and output."""
    stream = await connect()
    try:
        await stream.send(ATTACH.format(id=container_id).encode())
        reader = BufferedByteReceiveStream(stream)
        head = await reader.receive_until(b"\r\n\r\n", 16384)
        status = head.split(b"\r\n", 1)[0].decode("latin-1")
        if status.split(" ")[1:2] not in (["101"], ["200"]):
            raise EngineError(f"the Docker engine refused to attach: {status[:200]}")
        return _Prefixed(stream, reader.buffer)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await stream.aclose()
        raise


class _Wrapper(ByteStream):
    """A stream that changes only what ``receive`` gives; sending and closing go to the one it wraps."""

    def __init__(self, inner: ByteStream) -> None:
        self._inner = inner

    async def send(self, item: bytes) -> None:
        await self._inner.send(item)

    async def send_eof(self) -> None:
        await self._inner.send_eof()

    async def aclose(self) -> None:
        await self._inner.aclose()


class _Prefixed(_Wrapper):
    """A stream whose first bytes were already read (past the HTTP response's head)."""

    def __init__(self, stream: ByteStream, first: bytes) -> None:
        super().__init__(stream)
        self._first = bytes(first)

    async def receive(self, max_bytes: int = 65536) -> bytes:
        if self._first:
            data, self._first = self._first, b""
            return data
        return await self._inner.receive(max_bytes)


MUX = struct.Struct(">BxxxI")
MUX_STDOUT = 1


class DemuxedStream(_Wrapper):
    """The attach stream as plain stdout bytes: Docker's 8-byte multiplexing headers (stream type,
    then the frame's length) are stripped as the bytes arrive; stderr goes to the debug log."""

    def __init__(self, raw: ByteStream, name: str) -> None:
        super().__init__(raw)
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
            data = self._demux(await self._inner.receive(max_bytes))
            if data:
                return data
