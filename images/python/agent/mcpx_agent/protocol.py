"""Frames on the agent's byte streams (host channel and worker result pipes).

A frame is: 4-byte big-endian header length, 4-byte big-endian payload length, a UTF-8 JSON
header, then the raw payload bytes. Binary data (images, file contents) travels in the payload so
it is never inflated by base64. The host side has its own decoder in ``mcp_code_exec.channel``.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

PREFIX = struct.Struct(">II")
MAX_HEADER = 16 * 1024 * 1024
MAX_PAYLOAD = 256 * 1024 * 1024


class ProtocolError(Exception):
    """The peer sent bytes that are not a valid frame."""


def encode(header: dict[str, Any], payload: bytes = b"") -> bytes:
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "replace")
    return PREFIX.pack(len(raw), len(payload)) + raw + payload


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def send(fd: int, header: dict[str, Any], payload: bytes = b"") -> None:
    write_all(fd, encode(header, payload))


class FrameReader:
    """Accumulates bytes from a non-blocking fd and yields complete frames."""

    def __init__(self, fd: int, *, max_header: int = MAX_HEADER, max_payload: int = MAX_PAYLOAD):
        self.fd = fd
        self.buffer = bytearray()
        self.eof = False
        self.max_header = max_header
        self.max_payload = max_payload

    def fill(self, limit: int = 1 << 20) -> None:
        """Read what is available now; sets ``eof`` when the writer is gone."""
        try:
            chunk = os.read(self.fd, limit)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self.eof = True
        self.buffer += chunk

    def frames(self) -> list[tuple[dict[str, Any], bytes]]:
        out: list[tuple[dict[str, Any], bytes]] = []
        while len(self.buffer) >= PREFIX.size:
            header_len, payload_len = PREFIX.unpack_from(self.buffer)
            if header_len > self.max_header or payload_len > self.max_payload:
                raise ProtocolError(f"frame too large ({header_len}, {payload_len})")
            end = PREFIX.size + header_len + payload_len
            if len(self.buffer) < end:
                break
            raw = bytes(self.buffer[PREFIX.size : PREFIX.size + header_len])
            payload = bytes(self.buffer[PREFIX.size + header_len : end])
            del self.buffer[:end]
            try:
                header = json.loads(raw)
            except ValueError as exc:
                raise ProtocolError("header is not JSON") from exc
            if not isinstance(header, dict):
                raise ProtocolError("header is not an object")
            out.append((header, payload))
        return out
