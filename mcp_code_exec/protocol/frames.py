"""Frames: 4-byte big-endian header length, 4-byte payload length, a JSON object, raw payload.

Everything the agent sends is treated as hostile: sizes are bounded before anything is buffered,
and nesting before anything is parsed (deeply nested JSON makes ``json.loads`` recurse until
RecursionError). Any breach raises ``ProtocolViolation``, which the channel turns into "this
container is broken": it is replaced, and nothing escapes to the rest of the server.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import ProtocolViolation

PREFIX = struct.Struct(">II")

# The agent's protocol module states the same numbers (a unit test holds them equal).
MAX_REQUEST_HEADER = 1 << 20
MAX_REQUEST_PAYLOAD = 64 << 20
MAX_EVENT_HEADER = 8 << 20
MAX_EVENT_PAYLOAD = 256 << 20
MAX_DEPTH = 16
MAX_CHUNK = 4 << 20  # the largest file chunk either way (the agent's ``transfer`` module states it too)
MAX_CALL_PAYLOAD = 256 << 10  # a tool call's JSON arguments, from sandbox code (the agent states it too)
MAX_CALL_NAME = 256
# The events that carry a payload, and the most each may; every other event carries none. An
# image or a done is only a run's, and the channel holds it to that run's caps as well.
EVENT_PAYLOAD_LIMITS = {
    "chunk": MAX_CHUNK,
    "tool_call": MAX_CALL_PAYLOAD,
    "image": MAX_EVENT_PAYLOAD,
    "done": MAX_EVENT_PAYLOAD,
}
RUN_PAYLOADS = ("image", "done")

IMAGE_MAGIC = {"image/png": b"\x89PNG\r\n\x1a\n", "image/jpeg": b"\xff\xd8\xff"}

Frame = tuple[dict[str, Any], bytes]


def encode(header: Mapping[str, Any], payload: bytes = b"") -> bytes:
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass")
    if len(raw) > MAX_REQUEST_HEADER or len(payload) > MAX_REQUEST_PAYLOAD:
        raise ValueError(f"request too large for the protocol ({len(raw)} + {len(payload)} bytes)")
    return PREFIX.pack(len(raw), len(payload)) + raw + payload


# A string, or an unclosed one to the end of the text: a match that can fail would be retried from
# every later quote, in time quadratic in the text (a minute for 64 KiB of quotes and backslashes).
JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
ONE_KIND_OF_BRACKET = bytes.maketrans(b"{}", b"[]")
NOT_BRACKETS = bytes(byte for byte in range(256) if byte not in b"[]{}")


def nesting_within(raw: bytes, limit: int) -> bool:
    """True when the JSON text nests arrays and objects at most ``limit`` deep.

    Counting brackets bounds the depth from above; only text with more brackets than the limit is
    looked at further: its strings taken out, its brackets kept, and the innermost pairs removed
    ``limit`` times over. All of it in C: a walk byte by byte took 0.4 s over an 8 MiB header.
    Text that is not JSON (unbalanced brackets) may be judged too deep, and an unclosed string hides
    the brackets after it (``json.loads`` refuses that text anyway). ``raw`` must be UTF-8: in UTF-16
    or UTF-32 a character's bytes can hold a quote.
    """
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return True
    brackets = JSON_STRING.sub(b"", raw).translate(ONE_KIND_OF_BRACKET, NOT_BRACKETS)
    for _ in range(limit):
        shorter = brackets.replace(b"[]", b"")
        if len(shorter) == len(brackets):
            break
        brackets = shorter
    return not brackets


def decode_header(raw: bytes) -> dict[str, Any]:
    try:
        # Decoded first, strictly (lone surrogates as the agent encodes them): given bytes,
        # json.loads would also read UTF-16 and UTF-32, which the nesting check cannot judge.
        text = raw.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError as exc:
        raise ProtocolViolation("a frame header is not UTF-8") from exc
    if not nesting_within(raw, MAX_DEPTH):
        raise ProtocolViolation(f"a frame header nests deeper than {MAX_DEPTH} levels")
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ProtocolViolation("a frame header is not JSON") from exc
    if not isinstance(header, dict):
        raise ProtocolViolation("a frame header is not an object")
    return header


class FrameDecoder:
    """Turns a byte stream into frames, refusing anything over the limits before buffering it.

    ``payload_limit``: the payload cap of a frame, from its header (``max_payload`` for every frame
    when None). Checked as soon as the header is in, before any of the payload is buffered.
    """

    def __init__(
        self,
        *,
        max_header: int = MAX_EVENT_HEADER,
        max_payload: int = MAX_EVENT_PAYLOAD,
        payload_limit: Callable[[dict[str, Any]], int] | None = None,
    ) -> None:
        self.max_header = max_header
        self.max_payload = max_payload
        self.payload_limit = payload_limit
        self._buffer = bytearray()
        self._header: dict[str, Any] | None = None  # the current frame's, once it is in

    def feed(self, data: bytes) -> list[Frame]:
        self._buffer += data
        frames: list[Frame] = []
        while len(self._buffer) >= PREFIX.size:
            header_len, payload_len = PREFIX.unpack_from(self._buffer)
            if header_len > self.max_header or payload_len > self.max_payload:
                raise ProtocolViolation(f"a frame is over the size limits ({header_len} + {payload_len} bytes)")
            if self._header is None:
                if len(self._buffer) < PREFIX.size + header_len:
                    break
                self._header = decode_header(bytes(self._buffer[PREFIX.size : PREFIX.size + header_len]))
                limit = self.max_payload if self.payload_limit is None else self.payload_limit(self._header)
                if payload_len > limit:
                    kind = str(self._header.get("ev"))[:20]
                    raise ProtocolViolation(f"a {kind!r} frame is over its size limit ({payload_len} bytes)")
            end = PREFIX.size + header_len + payload_len
            if len(self._buffer) < end:
                break
            payload = bytes(self._buffer[PREFIX.size + header_len : end])
            del self._buffer[:end]
            frames.append((self._header, payload))
            self._header = None
        return frames


def event_payload_limit(header: dict[str, Any]) -> int:
    """The most an event of this kind may carry (none, for most)."""
    kind = header.get("ev")
    return EVENT_PAYLOAD_LIMITS.get(kind, 0) if isinstance(kind, str) else 0


def event_decoder(payload_limit: Callable[[dict[str, Any]], int] = event_payload_limit) -> FrameDecoder:
    """The decoder of the agent's events: only the events that carry a payload may, within their caps."""
    return FrameDecoder(payload_limit=payload_limit)


def image_size(mime: str, data: bytes) -> tuple[int, int] | None:
    """(width, height) from a PNG's IHDR or a JPEG's frame header; None if it is neither."""
    if mime == "image/png":
        if len(data) < 24 or not data.startswith(IMAGE_MAGIC[mime]) or data[12:16] != b"IHDR":
            return None
        width, height = struct.unpack(">II", data[16:24])
        return (width, height) if width and height else None
    if mime != "image/jpeg" or not data.startswith(IMAGE_MAGIC[mime]):
        return None
    index = 2
    while index + 9 <= len(data):
        if data[index] != 0xFF:
            return None
        marker = data[index + 1]
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
            index += 2
            continue
        (length,) = struct.unpack(">H", data[index + 2 : index + 4])
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            height, width = struct.unpack(">HH", data[index + 5 : index + 9])
            return (width, height) if width and height else None
        if length < 2:
            return None
        index += 2 + length
    return None
