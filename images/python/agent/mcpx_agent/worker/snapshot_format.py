"""A session's namespace on its volume: written record by record, read back inside the sandbox.

``/mnt/data/.mcpx/snapshot/ns.pkl`` is one file, replaced atomically (a temporary file, fsync,
rename): the magic line, then a record per user variable (its name, its cloudpickle bytes and the
protocol-5 out-of-band buffers, so a DataFrame's columns are written from their own memory, never
copied into one big bytes object), then the manifest (JSON: when, what was kept, what was not and
why, the working directory, the Python and agent versions) and a fixed trailer that says where the
manifest starts. ``manifest.json`` beside it is a copy for reading without the pickle.

Pickles are code, and the session's own code can write this file: it is only ever read here, in
the session's own worker, as the sandbox user. Every length is checked against what is left of
the file before anything is read; a damaged or forged file loads as far as it can, and the answer
says where it stopped.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import struct
import sys
import time
from collections.abc import Iterator
from io import BufferedReader
from typing import Any

ROOT = "/mnt/data/.mcpx"
DIR = f"{ROOT}/snapshot"
FILE = "ns.pkl"
MANIFEST = "manifest.json"
MAGIC = b"MCPX-SNAPSHOT 1\n"
RECORD = struct.Struct(">4sHQI")  # b"REC1", name length, pickle length, number of out-of-band buffers
RECORD_TAG = b"REC1"
MANIFEST_HEAD = struct.Struct(">4sI")  # b"MANI", manifest length
TRAILER = struct.Struct(">8sQ")  # b"MCPX-END", offset of the manifest's head
TRAILER_TAG = b"MCPX-END"
LENGTH = struct.Struct(">Q")
MAX_NAME = 1024
MAX_BUFFERS = 1 << 16
MAX_MANIFEST = 4 << 20
FORMAT = 1
# What a user calls the things that cannot be pickled: by the type's qualified name.
WORDS = {
    "generator": "generator",
    "coroutine": "coroutine",
    "async_generator": "async generator",
    "TextIOWrapper": "open file",
    "BufferedReader": "open file",
    "BufferedWriter": "open file",
    "BufferedRandom": "open file",
    "FileIO": "open file",
    "lock": "lock",
    "RLock": "lock",
    "Condition": "condition variable",
    "Thread": "thread",
    "socket": "socket",
    "DuckDBPyConnection": "duckdb connection",
    "Connection": "database connection",
    "Cursor": "database cursor",
    "Popen": "running process",
    "Process": "process",
    "Pool": "process pool",
    "ThreadPoolExecutor": "thread pool",
    "ProcessPoolExecutor": "process pool",
    "frame": "stack frame",
    "mmap": "memory map",
}


class Damaged(Exception):
    """The file is not a whole snapshot from here on; the message says how."""


def describe(name: str, value: Any, exc: BaseException) -> str:
    """``name (what it is)`` for a value that could not be kept, in words a user knows."""
    kind = type(value)
    words = WORDS.get(kind.__qualname__)
    if words is None:
        reason = str(exc).splitlines()[0][:100] if str(exc) else type(exc).__name__
        words = f"{kind.__module__}.{kind.__qualname__}: {reason}"
    return f"{name} ({words})"[:300]


def pickled(value: Any) -> tuple[bytes, list[memoryview]]:
    """The value's pickle and its out-of-band buffers (views of the value's own memory)."""
    import cloudpickle

    buffers: list[pickle.PickleBuffer] = []
    data = cloudpickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    try:
        return data, [buffer.raw() for buffer in buffers]
    except BufferError:  # a non-contiguous buffer: this value goes in-band
        return cloudpickle.dumps(value, protocol=5), []


def write(namespace: dict[str, Any], names: list[str], max_bytes: int, context: dict[str, Any]) -> dict[str, Any]:
    """Write the snapshot of ``names``; the outcome for the worker (``taken_at``/``size``, or ``over``).

    Over ``max_bytes`` nothing replaces the last snapshot, and ``largest`` says what weighed most.
    """
    os.makedirs(DIR, 0o700, exist_ok=True)
    for stale in os.listdir(DIR):  # a writer that died half way
        if stale.startswith(f"{FILE}.tmp-"):
            with contextlib.suppress(OSError):
                os.unlink(f"{DIR}/{stale}")
    temp = f"{DIR}/{FILE}.tmp-{os.getpid()}"
    sizes: dict[str, int] = {}
    kept: list[str] = []
    skipped: list[str] = []
    total = len(MAGIC)
    with open(temp, "xb", buffering=1 << 20) as out:
        out.write(MAGIC)
        for name in names:
            value = namespace[name]
            try:
                data, buffers = pickled(value)
            except BaseException as exc:  # noqa: BLE001 - user code (__reduce__) may raise anything
                skipped.append(describe(name, value, exc))
                continue
            raw_name = name.encode("utf-8", "surrogatepass")[:MAX_NAME]
            size = RECORD.size + len(raw_name) + len(data) + sum(LENGTH.size + b.nbytes for b in buffers)
            sizes[name] = size
            if total + size > max_bytes:
                continue  # keep measuring what is cheap to measure: the note names the largest
            total += size
            out.write(RECORD.pack(RECORD_TAG, len(raw_name), len(data), len(buffers)) + raw_name + data)
            out.write(b"".join(LENGTH.pack(b.nbytes) for b in buffers))
            for buffer in buffers:
                out.write(buffer)
            kept.append(name)
        if len(kept) < len(sizes):
            out.close()
            os.unlink(temp)
            largest = sorted(sizes.items(), key=lambda item: -item[1])[:5]
            return {"over": True, "largest": [f"{name} ({size / 2**20:.1f} MB)" for name, size in largest]}
        taken_at = time.time()
        manifest = {"format": FORMAT, "taken_at": taken_at, "names": kept, "skipped": skipped, **context}
        raw = json.dumps(manifest, ensure_ascii=False).encode("utf-8", "replace")
        out.write(MANIFEST_HEAD.pack(b"MANI", len(raw)) + raw + TRAILER.pack(TRAILER_TAG, total))
        out.flush()
        os.fsync(out.fileno())
        size = out.tell()
    os.rename(temp, f"{DIR}/{FILE}")
    _fsync_dir(DIR)
    with contextlib.suppress(OSError):  # the readable copy: best effort, the pickle's own is the truth
        with open(f"{temp}.json", "wb") as copy:
            copy.write(raw)
        os.rename(f"{temp}.json", f"{DIR}/{MANIFEST}")
    return {"over": False, "taken_at": taken_at, "size": size, "skipped": skipped}


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- reading ----------------------------------------------------------------------------------------
def read_manifest(raw: bytes) -> dict[str, Any]:
    """The manifest's fields this agent uses, each checked; hostile bytes give ``Damaged``."""
    from ..protocol import ProtocolError, decode_header

    try:
        found = decode_header(raw) if len(raw) <= MAX_MANIFEST else None
    except ProtocolError:
        found = None
    if found is None or found.get("format") != FORMAT:
        raise Damaged("its manifest is not one this agent wrote")
    taken_at = found.get("taken_at")
    names, skipped = found.get("names"), found.get("skipped")
    cwd = found.get("cwd")
    return {
        "taken_at": float(taken_at) if isinstance(taken_at, int | float) and not isinstance(taken_at, bool) else None,
        "names": [n for n in names if isinstance(n, str)][:100_000] if isinstance(names, list) else [],
        "skipped": [s[:300] for s in skipped if isinstance(s, str)][:1000] if isinstance(skipped, list) else [],
        "cwd": cwd if isinstance(cwd, str) and len(cwd) < 4096 else None,
        "python": str(found.get("python", ""))[:40],
    }


def manifest_of(stream: BufferedReader, size: int) -> tuple[dict[str, Any], int]:
    """(manifest, where the records end) read from the trailer; ``Damaged`` if it is not whole."""
    if size < len(MAGIC) + MANIFEST_HEAD.size + TRAILER.size:
        raise Damaged("it is truncated")
    stream.seek(size - TRAILER.size)
    tag, offset = TRAILER.unpack(stream.read(TRAILER.size))
    if tag != TRAILER_TAG or not len(MAGIC) <= offset <= size - TRAILER.size - MANIFEST_HEAD.size:
        raise Damaged("it is truncated (no end marker)")
    stream.seek(offset)
    head, length = MANIFEST_HEAD.unpack(stream.read(MANIFEST_HEAD.size))
    if head != b"MANI" or offset + MANIFEST_HEAD.size + length + TRAILER.size != size:
        raise Damaged("its manifest is damaged")
    return read_manifest(stream.read(length)), offset


def records(stream: BufferedReader, end: int) -> Iterator[tuple[str, bytes, list[bytearray]]]:
    """(name, pickle, buffers) of each record before ``end``, checked; ``Damaged`` where one is not whole."""
    stream.seek(0)
    if stream.read(len(MAGIC)) != MAGIC:
        raise Damaged("it is not a snapshot this agent wrote")
    position = len(MAGIC)
    while position < end:
        head = stream.read(RECORD.size)
        if len(head) < RECORD.size:
            raise Damaged("it is truncated")
        tag, name_len, data_len, count = RECORD.unpack(head)
        position += RECORD.size
        if tag != RECORD_TAG or name_len > MAX_NAME or count > MAX_BUFFERS or position + name_len + data_len > end:
            raise Damaged("a record is damaged")
        name = stream.read(name_len).decode("utf-8", "replace")
        data = stream.read(data_len)
        lengths = [LENGTH.unpack(stream.read(LENGTH.size))[0] for _ in range(count)] if count else []
        position += name_len + data_len + count * LENGTH.size
        if len(data) != data_len or position + sum(lengths) > end:
            raise Damaged("it is truncated")
        buffers = []
        for length in lengths:
            buffer = bytearray(length)
            if stream.readinto(buffer) != length:
                raise Damaged("it is truncated")
            buffers.append(buffer)
        position += sum(lengths)
        yield name, data, buffers


class LoadTimeout(BaseException):
    """A record took too long to load (a BaseException: library code's ``except Exception`` lets it by)."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise LoadTimeout


def load_record(data: bytes, buffers: list[bytearray], limit_s: float) -> Any:
    """Unpickle one record within ``limit_s`` of wall time (SIGALRM; the supervisor bounds the rest)."""
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, limit_s)
    try:
        return pickle.loads(data, buffers=buffers)  # noqa: S301 - the session's own pickle, in its own sandbox
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def python_version() -> str:
    return ".".join(str(part) for part in sys.version_info[:3])
