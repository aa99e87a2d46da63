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
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
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
# The largest header of each event (the models' caps, escaped): parsing a header holds the event loop
# (1.6 s for 8 MiB of nested lists), so each kind is refused past its own size from the header's
# first bytes, before the rest is buffered. What one worker frame carries (at most
# MAX_WORKER_HEADER, as the agent's protocol states) fits WORKER_SIZED; only an answer (one a
# request) may be larger. Which events a request may get is the request's (``messages.Request``).
SMALL_HEADER = 64 << 10
WORKER_SIZED = (1 << 20) + SMALL_HEADER
EVENT_HEADER_LIMITS = {
    "output": 52 << 10,  # 8 KiB of text and a marker, each character escaped to at most 6 bytes: 49.3 KB
    "display": WORKER_SIZED,
    "table": WORKER_SIZED,
    "clean": WORKER_SIZED,  # ten problems, each an OSError naming a path
    "error": WORKER_SIZED,
    "restored": WORKER_SIZED,
    "variables": WORKER_SIZED,
    "done": MAX_EVENT_HEADER,
    "history_page": MAX_EVENT_HEADER,
    "listing": MAX_EVENT_HEADER,
}


@dataclass(frozen=True)
class Pace:
    """How fast one request may get events of a kind: ``at_first`` at once, then ``per_s`` a second,
    saved up for at most ``most_s`` seconds (so a quiet run cannot save a flood for later)."""

    at_first: int
    per_s: float
    most_s: float


# The agent streams a run's output at most every 0.1 s, one event per stream (``mcpx_agent/output.py``):
# 20 a second. Twice that, and a host that fell half a minute behind still finds a burst within it.
EVENT_PACES = {"output": Pace(at_first=32, per_s=40.0, most_s=30.0)}

# json.loads spends its time on what lies outside a header's strings (punctuation, numbers, literals:
# 165 ms a MiB of nested lists, against 2-4 ms a MiB of strings, escapes and all), and taking the
# strings out on each string (0.2 us: 0.4 s for 8 MiB of short ones). So each event is held to so many bytes outside its
# strings, and so many strings: the events a request may get without end (a run's output, displays,
# tables, images and calls; a read's chunks) to very few, the answers to what their caps allow.
Structure = tuple[int, int]  # bytes outside strings, strings
STRUCTURE_CHECKED_ABOVE = 1024  # bytes of header: a smaller one parses in 0.2 ms whatever it holds
EVENT_STRUCTURE_LIMITS: dict[str, Structure] = {
    "output": (256, 16),
    "display": (256, 16),
    "table": (4096, 512),  # two lists of up to 200 names
    "image": (512, 16),
    "tool_call": (512, 16),
    "chunk": (512, 32),
    "clean": (1024, 32),  # ten problems
    "error": (1024, 32),
    "ready": (256, 16),
    "pong": (256, 16),
    "staged": (256, 16),
    "dropped": (256, 16),
    "written": (512, 16),
    "snapshot": (256, 16),
    "restored": (16 << 10, 2048),  # a thousand names skipped
    "variables": (256 << 10, 16_384),  # the service asks for 200: 32 numbers of shape and 9 strings each
    # An answer's files or entries (a done's: what changed between two surveys of at most 2000
    # files; a listing's: at most LIST_MAX; each about 80 bytes outside its strings, and ten
    # strings) and a history page (at most 2 MiB in all, as the notebook view asks for it, of which
    # its tables' 200 names each, the most structure a page can hold, about a third).
    "done": (512 << 10, 65_536),
    "listing": (1 << 20, 100_000),  # LIST_MAX entries take about 470 KB
    "history_page": (1 << 20, 1_000_000),  # a page of tables with 200 columns each: about 700 KB
}
# Every header the agent writes begins with its kind, then its request's id (json.dumps keeps the
# builders' order); the decoded header must say the same (JSON allows a key twice: the last wins).
HEADER_START = re.compile(rb'\{"ev":"([a-z_]{1,20})"(?:(,"id":)(?:(null|[0-9]{1,18})[,}])?|[,}])')
HEADER_START_BYTES = 64

IMAGE_MAGIC = {"image/png": b"\x89PNG\r\n\x1a\n", "image/jpeg": b"\xff\xd8\xff"}

Frame = tuple[dict[str, Any], bytes]


def encode(header: Mapping[str, Any], payload: bytes = b"") -> bytes:
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass")
    if len(raw) > MAX_REQUEST_HEADER or len(payload) > MAX_REQUEST_PAYLOAD:
        raise ValueError(f"request too large for the protocol ({len(raw)} + {len(payload)} bytes)")
    return PREFIX.pack(len(raw), len(payload)) + raw + payload


# A string once its escaped backslashes and quotes are gone (``strings_out``), or an unclosed one to
# the end of the text: a pattern that can fail would be retried from every later quote, in time
# quadratic in the text (a minute for 64 KiB of quotes and backslashes).
PLAIN_STRING = re.compile(rb'"[^"]*(?:"|\Z)')
ONE_KIND_OF_BRACKET = bytes.maketrans(b"{}", b"[]")
NOT_BRACKETS = bytes(byte for byte in range(256) if byte not in b"[]{}")


def strings_out(raw: bytes, count: int = 0) -> bytes:
    """JSON text without its strings (the first ``count`` of them; 0: all). The escaped backslashes
    and quotes go first, at C speed (inside a string they pair from the left; outside one, JSON has
    none): a pattern that stepped over each escape took 40-55 ms a MiB of them, the rest 5."""
    return PLAIN_STRING.sub(b"", raw.replace(b"\\\\", b"").replace(b'\\"', b""), count=count)


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
    return _structure_nests_within(strings_out(raw), limit)


def _structure_nests_within(structure: bytes, limit: int) -> bool:
    """``nesting_within`` for JSON text whose strings were taken out."""
    brackets = structure.translate(ONE_KIND_OF_BRACKET, NOT_BRACKETS)
    for _ in range(limit):
        shorter = brackets.replace(b"[]", b"")
        if len(shorter) == len(brackets):
            break
        brackets = shorter
    return not brackets


def decode_header(raw: bytes, structure_limit: Structure | None = None) -> dict[str, Any]:
    """A frame's header, parsed once it is known to be UTF-8, at most ``MAX_DEPTH`` deep and, with
    ``structure_limit``, to hold at most so many bytes outside its strings, and so many strings."""
    try:
        # Decoded first, strictly (lone surrogates as the agent encodes them): given bytes,
        # json.loads would also read UTF-16 and UTF-32, which the nesting check cannot judge.
        text = raw.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError as exc:
        raise ProtocolViolation("a frame header is not UTF-8") from exc
    if structure_limit is not None and len(raw) > STRUCTURE_CHECKED_ABOVE:
        # Strings counted as they are taken out: past the limit, the rest are left in and refused.
        most_bytes, most_strings = structure_limit
        structure = strings_out(raw, most_strings)
        if len(structure) > most_bytes or b'"' in structure:
            raise ProtocolViolation(
                f"a frame header holds more than {most_bytes} bytes outside its strings, or {most_strings} strings"
            )
        nests_within = _structure_nests_within(structure, MAX_DEPTH)
    else:
        nests_within = nesting_within(raw, MAX_DEPTH)
    if not nests_within:
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
    ``header_limit``: the header cap of an event, from its kind and request id (``header_start``),
    checked from the header's first bytes; where it says None, the frame is skipped unread (its bytes
    dropped as they come, never buffered). Without one: ``max_header`` for every frame, whatever it
    begins with.
    """

    def __init__(
        self,
        *,
        max_header: int = MAX_EVENT_HEADER,
        max_payload: int = MAX_EVENT_PAYLOAD,
        payload_limit: Callable[[dict[str, Any]], int] | None = None,
        header_limit: Callable[[str, int | None], int | None] | None = None,
    ) -> None:
        self.max_header = max_header
        self.max_payload = max_payload
        self.payload_limit = payload_limit
        self.header_limit = header_limit
        self._buffer = bytearray()
        self._start: tuple[str, int | None] | None = None  # the current frame's kind and id, once read
        self._skipping = 0  # bytes of a skipped frame still to drop
        self._header: dict[str, Any] | None = None  # the current frame's, once it is in

    def feed(self, data: bytes) -> Iterator[Frame]:
        """The frames ``data`` completes, each decoded only as it is taken: parsing a header holds
        the event loop, and a reader that yields between frames holds it for one at a time. Take
        them all before feeding more."""
        self._buffer += data
        while self._skipping and self._buffer:
            dropped = min(self._skipping, len(self._buffer))
            del self._buffer[:dropped]
            self._skipping -= dropped
        while len(self._buffer) >= PREFIX.size:
            header_len, payload_len = PREFIX.unpack_from(self._buffer)
            if header_len > self.max_header or payload_len > self.max_payload:
                raise ProtocolViolation(f"a frame is over the size limits ({header_len} + {payload_len} bytes)")
            if self._header is None:
                if self.header_limit is not None and self._start is None:
                    start = bytes(self._buffer[PREFIX.size : PREFIX.size + min(header_len, HEADER_START_BYTES)])
                    if len(start) < min(header_len, HEADER_START_BYTES):
                        break
                    self._start = header_start(start)
                    header_cap = self.header_limit(*self._start)
                    if header_cap is None:
                        self._start = None
                        dropped = min(PREFIX.size + header_len + payload_len, len(self._buffer))
                        self._skipping = PREFIX.size + header_len + payload_len - dropped
                        del self._buffer[:dropped]
                        continue
                    if header_len > header_cap:
                        kind = self._start[0]
                        raise ProtocolViolation(
                            f"a {kind!r} frame's header is over its size limit ({header_len} bytes)"
                        )
                if len(self._buffer) < PREFIX.size + header_len:
                    break
                structure_limit = None if self._start is None else EVENT_STRUCTURE_LIMITS.get(self._start[0])
                raw = bytes(self._buffer[PREFIX.size : PREFIX.size + header_len])
                self._header = decode_header(raw, structure_limit)
                if self._start is not None and not _says(self._header, *self._start):
                    raise ProtocolViolation("a frame header's kind or request is not what it begins with")
                limit = self.max_payload if self.payload_limit is None else self.payload_limit(self._header)
                if payload_len > limit:
                    kind = str(self._header.get("ev"))[:20]
                    raise ProtocolViolation(f"a {kind!r} frame is over its size limit ({payload_len} bytes)")
            end = PREFIX.size + header_len + payload_len
            if len(self._buffer) < end:
                break
            payload = bytes(self._buffer[PREFIX.size + header_len : end])
            del self._buffer[:end]
            header, self._header, self._start = self._header, None, None
            yield header, payload


def header_start(start: bytes) -> tuple[str, int | None]:
    """An event's kind and request id (None: it names none), from its header's first bytes."""
    match = HEADER_START.match(start)
    if match is None:
        raise ProtocolViolation("a frame header does not begin with its kind")
    kind, names_id, rid = match.group(1).decode("ascii"), match.group(2), match.group(3)
    if names_id and rid is None:
        raise ProtocolViolation("a frame header's request id is not a number")
    return kind, None if rid in (None, b"null") else int(rid)


def _says(header: dict[str, Any], kind: str, rid: int | None) -> bool:
    said = header.get("id")
    said_id = said if isinstance(said, int) and not isinstance(said, bool) else None
    return header.get("ev") == kind and said_id == rid and (rid is not None or said is None)


def event_header_limit(kind: str) -> int:
    """The largest header an event of this kind may have, for a request the host waits on."""
    return EVENT_HEADER_LIMITS.get(kind, SMALL_HEADER)


def event_payload_limit(header: dict[str, Any]) -> int:
    """The most an event of this kind may carry (none, for most)."""
    kind = header.get("ev")
    return EVENT_PAYLOAD_LIMITS.get(kind, 0) if isinstance(kind, str) else 0


def event_decoder(
    payload_limit: Callable[[dict[str, Any]], int] = event_payload_limit,
    header_limit: Callable[[str, int | None], int | None] = lambda kind, rid: event_header_limit(kind),
) -> FrameDecoder:
    """The decoder of the agent's events: each header and payload within its kind's caps (only the
    events that carry a payload may)."""
    return FrameDecoder(payload_limit=payload_limit, header_limit=header_limit)


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
