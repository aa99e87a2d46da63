"""The agent's half of the host-agent protocol (the host's half is ``mcp_code_exec.protocol``).

A frame is: 4-byte big-endian header length, 4-byte big-endian payload length, a UTF-8 JSON
object (the header), then the raw payload bytes. Binary data (code, images, file contents)
travels in the payload, never inflated by base64 or JSON escaping.

Three byte streams carry frames: the host channel (the supervisor's stdin/stdout), each worker's
result pipe (worker to supervisor) and each worker's control pipe (supervisor to worker). The
result pipe is written by user code's own process, so everything read from it is hostile:
``FrameReader`` bounds sizes and nesting before parsing, and ``worker_frame`` accepts only the
known kinds with the known fields and types. What each frame holds is built in ``events``. A unit
test runs frames, path rules and every event through this module and the host's, so the two halves
cannot drift.

Stdlib only: it runs inside the sandbox image.
"""

from __future__ import annotations

import json
import os
import re
import struct
import threading
from typing import Any

PREFIX = struct.Struct(">II")
# said in "ready"; 4: snapshots, restore, variables, history and notebook export; 5: history_page; 6: usage;
# 7: the egress relay and a run's egress_proxy; 8: a restore's outcome (restored, none, failed) for its found;
# 9: the relay sends its container's key (a run's egress_key)
AGENT_VERSION = 9

# Sizes, in bytes, of what each side accepts. The host's module states the same numbers.
MAX_REQUEST_HEADER = 1 << 20  # host -> agent: requests carry code and file bytes in the payload
MAX_REQUEST_PAYLOAD = 64 << 20
MAX_EVENT_HEADER = 8 << 20  # agent -> host: a done event holds capped stdout, stderr, result, traceback
MAX_EVENT_PAYLOAD = 256 << 20
MAX_WORKER_HEADER = 1 << 20  # worker -> supervisor: hostile, and capped by the worker before sending
MAX_CALL_PAYLOAD = 256 << 10  # a tool call's JSON arguments (worker -> supervisor -> host; the host parses them)
MAX_CALL_NAME = 256  # a tool's or a server's name in a call frame
MAX_DEPTH = 16  # JSON nesting; ours never goes past 4, and deep nesting is how json.loads is made to recurse

STREAMS = ("stdout", "stderr")
IMAGE_MIMES = ("image/png", "image/jpeg")
IMAGE_MAGIC = {"image/png": b"\x89PNG\r\n\x1a\n", "image/jpeg": b"\xff\xd8\xff"}
WORKER_STATUSES = ("ok", "error", "interrupted", "memory_limit")
# How a restore went: a snapshot was loaded (perhaps in part, the note says what), there was none, or
# there was one and it could not be loaded (the session's variables are gone either way but the first).
RESTORE_OUTCOMES = ("restored", "none", "failed")


class ProtocolError(Exception):
    """The peer sent bytes that are not a valid frame, or a frame this protocol does not allow."""


def encode(header: dict[str, Any], payload: bytes = b"") -> bytes:
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "replace")
    return PREFIX.pack(len(raw), len(payload)) + raw + payload


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


WRITE_LOCK = threading.Lock()  # a frame longer than PIPE_BUF is several writes: one thread's at a time


def send(fd: int, header: dict[str, Any], payload: bytes = b"") -> None:
    frame = encode(header, payload)
    with WRITE_LOCK:
        write_all(fd, frame)


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
        # Decoded first, strictly (lone surrogates as they are encoded): given bytes, json.loads
        # would also read UTF-16 and UTF-32, which the nesting check cannot judge.
        text = raw.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError as exc:
        raise ProtocolError("header is not UTF-8") from exc
    if not nesting_within(raw, MAX_DEPTH):
        raise ProtocolError(f"header nests deeper than {MAX_DEPTH} levels")
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError("header is not JSON") from exc
    if not isinstance(header, dict):
        raise ProtocolError("header is not an object")
    return header


class FrameReader:
    """Accumulates bytes from a non-blocking fd and yields complete, size-checked frames."""

    def __init__(self, fd: int, *, max_header: int, max_payload: int) -> None:
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
                raise ProtocolError(f"frame too large ({header_len} + {payload_len} bytes)")
            end = PREFIX.size + header_len + payload_len
            if len(self.buffer) < end:
                break
            raw = bytes(self.buffer[PREFIX.size : PREFIX.size + header_len])
            payload = bytes(self.buffer[PREFIX.size + header_len : end])
            del self.buffer[:end]
            out.append((decode_header(raw), payload))
        return out


# -- what a worker may send ---------------------------------------------------------------------
# kind -> {field: (types, required)}. Anything else is a violation: the frame comes from user code.
_STR = (str,)
_OPT_STR = (str, type(None))
_INT = (int,)
_NUM = (int, float)
_OPT_NUM = (int, float, type(None))
_BOOL = (bool,)
_LIST = (list,)
WORKER_FRAMES: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {
    "image": {"kind": (_STR, True), "mime": (_STR, True), "width": (_INT, True), "height": (_INT, True),
              "note": (_OPT_STR, False)},
    "display": {"kind": (_STR, True), "text": (_STR, True)},
    # A DataFrame or Series the cell showed, kept under /mnt/data/.mcpx/tables/<table>/ (worker/tables.py).
    "table": {"kind": (_STR, True), "table": (_STR, True), "columns": (_LIST, True), "dtypes": (_LIST, True),
              "rows": (_INT, True), "total_rows": (_INT, True), "sorted_columns": (_INT, True)},
    "call": {"kind": (_STR, True), "call": (_INT, True), "server": (_STR, True), "tool": (_STR, True),
             "raw": ((bool,), False)},
    "done": {"kind": (_STR, True), "status": (_STR, True), "result": (_OPT_STR, True),
             "error": ((dict, type(None)), True), "exec_ms": (_NUM, True), "truncated": ((list,), False),
             "peak_kib": (_INT, False), "children_peak_kib": (_INT, False)},
    # Sessions (see worker/snapshots.py): a sentence for the next run's notes; the answers to the
    # supervisor's restore, snapshot_sync and variables requests.
    "note": {"kind": (_STR, True), "text": (_STR, True)},
    "restored": {"kind": (_STR, True), "outcome": (_STR, True), "restored": (_INT, True), "skipped": (_LIST, True),
                 "note": (_STR, True), "taken_at": (_OPT_NUM, True)},
    "snapshot_synced": {"kind": (_STR, True), "complete": (_BOOL, True), "taken_at": (_OPT_NUM, True),
                 "size": ((int, type(None)), True)},
    "variables": {"kind": (_STR, True), "variables": (_LIST, True), "truncated": (_BOOL, True)},
}  # fmt: skip
VARIABLE_FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    "name": (_STR, True),
    "type": (_STR, True),
    "repr": (_STR, True),
    "size": ((int, type(None)), False),
    "shape": ((list, type(None)), False),
}
MAX_LISTED = 10_000  # names in a restore's skipped list or a variables answer (the host's LIST_MAX)
ERROR_FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    "type": (_STR, True),
    "message": (_STR, True),
    "traceback": (_STR, True),
    "line": ((int, type(None)), False),
    "column": ((int, type(None)), False),
}
TRUNCATABLE = ("result", "displays", "images", "traceback")


def _check_fields(obj: dict[str, Any], schema: dict[str, tuple[tuple[type, ...], bool]], what: str) -> None:
    for key, value in obj.items():
        if key not in schema:
            raise ProtocolError(f"{what}: unknown field {key[:40]!r}")
        types, _ = schema[key]
        if isinstance(value, bool) and bool not in types:  # bool is an int to isinstance
            raise ProtocolError(f"{what}: field {key!r} has the wrong type")
        if not isinstance(value, types):
            raise ProtocolError(f"{what}: field {key!r} has the wrong type")
    for key, (_, required) in schema.items():
        if required and key not in obj:
            raise ProtocolError(f"{what}: field {key!r} is missing")


def worker_frame(header: dict[str, Any], payload: bytes, max_image_bytes: int) -> dict[str, Any]:
    """The frame if it is one a worker may send, else ``ProtocolError``."""
    kind = header.get("kind")
    schema = WORKER_FRAMES.get(kind) if isinstance(kind, str) else None
    if schema is None:
        raise ProtocolError("unknown frame kind")
    _check_fields(header, schema, str(kind))
    if kind == "image":
        mime = header["mime"]
        if mime not in IMAGE_MIMES:
            raise ProtocolError("image: unsupported type")
        if not payload.startswith(IMAGE_MAGIC[mime]) or len(payload) > max_image_bytes:
            raise ProtocolError("image: not an image of that type, or over the size cap")
        if not (0 <= header["width"] <= 1 << 16 and 0 <= header["height"] <= 1 << 16):
            raise ProtocolError("image: implausible size")
    elif kind == "call":
        check_call(header, payload)
    elif payload:
        raise ProtocolError(f"{kind}: unexpected payload")
    if kind == "done":
        if header["status"] not in WORKER_STATUSES:
            raise ProtocolError("done: unknown status")
        if header["error"] is not None:
            _check_fields(header["error"], ERROR_FIELDS, "done.error")
        truncated = header.get("truncated", [])
        if not all(isinstance(item, str) and item in TRUNCATABLE for item in truncated):
            raise ProtocolError("done: bad truncated list")
    elif kind == "restored":
        if header["outcome"] not in RESTORE_OUTCOMES:
            raise ProtocolError("restored: unknown outcome")
        skipped = header["skipped"]
        if len(skipped) > MAX_LISTED or not all(isinstance(item, str) for item in skipped):
            raise ProtocolError("restored: bad skipped list")
        if header["restored"] < 0:
            raise ProtocolError("restored: negative count")
    elif kind == "variables":
        _check_variables(header["variables"])
    elif kind == "table":
        check_table(header)
    elif kind == "snapshot_synced" and (header["size"] or 0) < 0:
        raise ProtocolError(f"{kind}: negative size")
    return header


def check_call(header: dict[str, Any], payload: bytes) -> None:
    """A tool call's bounds (its names and arguments are judged by the host's policy, not here)."""
    if not 0 <= header["call"] < 1 << 31:
        raise ProtocolError("call: bad call number")
    if len(header["server"]) > MAX_CALL_NAME or len(header["tool"]) > MAX_CALL_NAME:
        raise ProtocolError("call: name too long")
    if len(payload) > MAX_CALL_PAYLOAD:
        raise ProtocolError(f"call: arguments over {MAX_CALL_PAYLOAD} bytes")


TABLE_ID = re.compile(r"[0-9a-f]{16}")
MAX_TABLE_COLUMNS = 200
MAX_TABLE_ROWS = 10_000  # the worker's cap (worker/tables.py); the host checks the same
MAX_TABLE_NAME = 200


def check_table(header: dict[str, Any]) -> None:
    """A table reference's bounds: its id names a folder, its names are short strings."""
    if not TABLE_ID.fullmatch(header["table"]):
        raise ProtocolError("table: bad id")
    columns, dtypes = header["columns"], header["dtypes"]
    if len(columns) != len(dtypes) or len(columns) > MAX_TABLE_COLUMNS:
        raise ProtocolError("table: bad columns")
    if not all(isinstance(n, str) and len(n) <= MAX_TABLE_NAME for n in (*columns, *dtypes)):
        raise ProtocolError("table: bad column name or type")
    if not 0 <= header["rows"] <= min(MAX_TABLE_ROWS, max(0, header["total_rows"])):
        raise ProtocolError("table: bad row count")
    if not 0 <= header["sorted_columns"] <= len(columns):
        raise ProtocolError("table: bad sorted column count")


def _check_variables(items: list[Any]) -> None:
    if len(items) > MAX_LISTED:
        raise ProtocolError("variables: too many")
    for item in items:
        if not isinstance(item, dict):
            raise ProtocolError("variables: not an object")
        _check_fields(item, VARIABLE_FIELDS, "variables.item")
        size, shape = item.get("size"), item.get("shape")
        if size is not None and size < 0:
            raise ProtocolError("variables: negative size")
        if shape is not None and (
            len(shape) > 32 or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)
        ):
            raise ProtocolError("variables: bad shape")


def image_size(mime: str, data: bytes) -> tuple[int, int] | None:
    """(width, height) read from a PNG's IHDR or a JPEG's frame header; None if it is neither.

    Only headers are parsed (never pixels), so nothing hostile is decoded outside the worker.
    """
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
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:  # markers without a length
            index += 2
            continue
        (length,) = struct.unpack(">H", data[index + 2 : index + 4])
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):  # a start of frame
            height, width = struct.unpack(">HH", data[index + 5 : index + 9])
            return (width, height) if width and height else None
        if length < 2:
            return None
        index += 2 + length
    return None
