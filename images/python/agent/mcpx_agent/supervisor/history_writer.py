"""The supervisor writes a session's history (``mcpx_agent.history_format``): it sees every run's
outcome, timeouts, crashes and kills included, and only checked values (what it sent the host).

A run's line is held until the session is idle or something reads or copies the session's state,
not while an agent's loop sends its next run; then the held runs are appended together. What is
held is bounded: when the held runs reach the history's cap (their code, outputs and images) or
``MAX_HELD_RUNS``, they are written at once.

Appends are cheap; when the history would pass its cap (``history_max_bytes``, the lines and the
image files together) it is rewritten (a temporary file, then rename): the oldest runs' outputs go
first, marked ``outputs_dropped``, then, if the code alone is still too much, the oldest runs whole,
counted in the header. The file is the user's to break: it is read back bounded and parsed line by
line as hostile, and a history that cannot be read is started again rather than failing a run.
Everything happens as the sandbox user, through the same no-symlink walk as the file tools.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import sys
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .. import history_format
from ..identity import as_sandbox_user
from . import files
from .tree import RESERVED

PARTS = [RESERVED, "history"]
FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC
# No run's line is shorter (its keys alone): a history within its cap holds at most cap // MIN_LINE
# lines, and one with more was written by someone else; only its newest that many are parsed.
MIN_LINE = 150
MAX_HELD_RUNS = 256  # enough to spread the file's opening over a loop's runs, few enough to write in one go
LINE_OVERHEAD = 256  # the keys and numbers of a run's line, beyond its texts


@dataclass
class HeldRun:
    """A run's history line without its number (given when it is written), and its images' bytes."""

    entry: dict[str, Any]
    images: list[tuple[str, bytes]]  # (extension, bytes), in the order the run displayed them
    cap: int  # the history's cap the run was made with


@dataclass
class HeldRuns:
    """The runs whose lines are not written yet, oldest first, and about the bytes they will take."""

    held: list[HeldRun] = field(default_factory=list)
    held_bytes: int = 0

    def add(self, run: HeldRun) -> bool:
        """Hold a run; True when what is held must be written now (at its bound)."""
        self.held.append(run)
        self.held_bytes += held_size(run)
        return self.held_bytes >= run.cap or len(self.held) >= MAX_HELD_RUNS

    def take(self) -> list[HeldRun]:
        """The held runs, oldest first; none are held after."""
        taken, self.held, self.held_bytes = self.held, [], 0
        return taken


def held_size(run: HeldRun) -> int:
    """About the bytes the run's line and images will take (the texts counted as characters)."""
    entry = run.entry
    error = entry["error"] or {}
    texts = [entry["code"], entry["stdout"], entry["stderr"], str(entry["result"] or ""), *entry["displays"]]
    texts += [str(error.get(key, "")) for key in ("type", "message", "traceback")]
    size = LINE_OVERHEAD + sum(len(text) for text in texts) + sum(len(blob) for _, blob in run.images)
    if entry["tables"]:
        size += len(json.dumps(entry["tables"], ensure_ascii=False))
    return size


def newest_start(data: bytes, count: int) -> int:
    """Where the last ``count`` lines of ``data`` begin (0 when it has fewer)."""
    at = len(data.rstrip(b"\n"))
    for _ in range(count):
        at = data.rfind(b"\n", 0, at)
        if at < 0:
            return 0
    return at + 1


def held_run(code: bytes, header: dict[str, Any], kept: list[tuple[str, Any, bytes]], cap: int) -> HeldRun:
    """The history line of a run, from its ``done`` event and what it displayed (checked values); its
    number and its images' names are given when it is written."""
    displays = [text for kind, text, _ in kept if kind == "display"]
    images = [("png" if mime == "image/png" else "jpeg", blob) for kind, mime, blob in kept if kind == "image"]
    error = header.get("error")
    entry = {
        "kind": "run",
        "n": 0,
        "at": time.time(),
        "code": code[: max(1024, cap // 2)].decode("utf-8", "replace"),
        "status": header["status"],
        "duration_ms": header["duration_ms"],
        "stdout": header["stdout"],
        "stderr": header["stderr"],
        "result": header["result"],
        "displays": displays,
        "images": [],
        "error": {key: error.get(key, "") for key in ("type", "message", "traceback")} if error else None,
        "tables": [table for kind, table, _ in kept if kind == "table"],
        "usage": header.get("usage"),
    }
    return HeldRun(entry, images, cap)


def line(entry: dict[str, Any]) -> bytes:
    return json.dumps(entry, ensure_ascii=False).encode("utf-8", "replace") + b"\n"


class HistoryWriter:
    """Appends runs to the history, within its cap."""

    def __init__(self) -> None:
        self.expected: tuple[int, int] | None = None  # (size, mtime_ns) of the file after our last write
        self.used = 0  # bytes of the history, images included, at that write
        self.next_n = 1
        self.held = HeldRuns()

    def hold(self, code: bytes, header: dict[str, Any], kept: list[tuple[str, Any, bytes]], cap: int) -> bool:
        """Hold one run for the next ``flush`` (called after its result went out). True when the held
        runs reached their bound: they are to be written now."""
        return self.held.add(held_run(code, header, kept, cap))

    @property
    def holding(self) -> bool:
        """Whether runs wait for the next ``flush``."""
        return bool(self.held.held)

    def flush(self) -> None:
        """Write the held runs, oldest first. Never raises: history is not worth a run."""
        runs = self.held.take()
        if not runs:
            return
        try:
            with as_sandbox_user():
                dir_fd = files.open_dir(PARTS, create=True)
                try:
                    self._record(dir_fd, runs)
                finally:
                    os.close(dir_fd)
        except (OSError, files.FileError, ValueError):
            self.expected = None

    def _record(self, dir_fd: int, runs: list[HeldRun]) -> None:
        cap = runs[-1].cap
        known = None
        if self.expected is None or self._stat(dir_fd) != self.expected:
            known = self._read(dir_fd, cap)
            # The file as it is: junk the session wrote between or before the lines kept counts too,
            # so that a history past its cap is rewritten within it.
            size = (self._stat(dir_fd) or (0, 0))[0]
            self.used = size + sum(_image_bytes(dir_fd, kept.images) for kept in known[1])
            self.next_n = max((kept.n for kept in known[1]), default=0) + 1
        lines = []
        added = 0
        for run in runs:
            n = run.entry["n"] = self.next_n
            self.next_n += 1
            run.entry["images"] = [{"file": f"img-{n}-{k}.{ext}"} for k, (ext, _) in enumerate(run.images)]
            for image, (_, blob) in zip(run.entry["images"], run.images, strict=True):
                _write(dir_fd, image["file"], blob, os.O_TRUNC)
            lines.append(line(run.entry))
            added += len(lines[-1]) + sum(len(blob) for _, blob in run.images)
        if self.used + added <= cap:
            _write(dir_fd, history_format.FILE, b"".join(lines), os.O_APPEND)
            self.used += added
        else:
            dropped, kept = known or self._read(dir_fd, cap)
            new = [
                Kept(raw[:-1], run.entry["n"], tuple(i["file"] for i in run.entry["images"]))
                for raw, run in zip(lines, runs, strict=True)
            ]
            self._compact(dir_fd, dropped, [*kept, *new], cap)
        self.expected = self._stat(dir_fd)

    def _stat(self, dir_fd: int) -> tuple[int, int] | None:
        try:
            st = os.stat(history_format.FILE, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        return (st.st_size, st.st_mtime_ns) if stat.S_ISREG(st.st_mode) else None

    def _read(self, dir_fd: int, cap: int) -> tuple[int, list[Kept]]:
        """(the runs the header says were dropped, the history's well-formed run lines); none when it
        is missing, not a file, or far past its cap. Each line is checked, and kept as its bytes: a
        parsed line holds a kilobyte of objects, and a history within its cap can hold a hundred
        thousand lines (the supervisor's memory is the sandbox's, and past it the sandbox is lost)."""
        try:
            fd = os.open(history_format.FILE, os.O_RDONLY | os.O_NONBLOCK | FLAGS, dir_fd=dir_fd)
        except OSError:
            return 0, []
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return 0, []
            limit = 2 * cap + (1 << 20)
            data = os.read(fd, limit + 1)
            while len(data) <= limit and (more := os.read(fd, limit + 1 - len(data))):
                data += more
        finally:
            os.close(fd)
        if len(data) > limit:
            return 0, []
        dropped, kept = 0, []
        at = newest_start(data, cap // MIN_LINE + 1)
        while at < len(data):  # a line at a time: no list of every line beside the bytes
            end = data.find(b"\n", at)
            end = len(data) if end < 0 else end
            raw, at = data[at:end], end + 1
            entry = history_format.parse_line(raw) if raw.strip() else None
            if entry is not None and entry["kind"] == "header":
                dropped += max(0, entry["runs_dropped"])
            elif entry is not None:
                names = tuple(sys.intern(image["file"]) for image in entry["images"])  # one name, one string
                kept.append(Kept(raw, entry["n"], names))
        return dropped, kept

    def _compact(self, dir_fd: int, dropped: int, runs: list[Kept], cap: int) -> None:
        """Rewrite the history within ``cap``: the oldest runs' outputs first (the newest keeps its
        own), then the oldest runs whole, counted in the header. Linear in the runs, one parsed at a time."""
        sizes = [len(run.raw) + 1 + _image_bytes(dir_fd, run.images) for run in runs]
        used = sum(sizes)
        for index in range(len(runs) - 1):
            if used <= cap:
                break
            run = runs[index]
            entry = history_format.parse_line(run.raw)
            if entry is None:
                continue
            for name in run.images:
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=dir_fd)
            entry.update(stdout="", stderr="", result=None, displays=[], images=[], tables=[], outputs_dropped=True)
            if entry["error"]:
                entry["error"] = {**entry["error"], "traceback": ""}
            runs[index] = Kept(line(entry)[:-1], run.n, ())
            used += len(runs[index].raw) + 1 - sizes[index]
            sizes[index] = len(runs[index].raw) + 1
        first = 0
        while first < len(runs) - 1 and used > cap:  # then whole runs, oldest first
            used -= sizes[first]
            first += 1
        runs = runs[first:]
        data = line({"kind": "header", "runs_dropped": dropped + first}) + b"".join(run.raw + b"\n" for run in runs)
        temp = f"{history_format.FILE}.tmp"
        _write(dir_fd, temp, data, os.O_TRUNC)
        os.rename(temp, history_format.FILE, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        kept_images = {name for run in runs for name in run.images}
        for name in os.listdir(dir_fd):  # images of runs no longer in the history
            if history_format.IMAGE_NAME.fullmatch(name) and name not in kept_images:
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=dir_fd)
        self.used = len(data) + sum(_image_bytes(dir_fd, run.images) for run in runs)


class Kept(NamedTuple):
    """A history line as the writer keeps it between reading and rewriting: its bytes (checked),
    its run number and its images' names."""

    raw: bytes
    n: int
    images: tuple[str, ...]


def _image_bytes(dir_fd: int, names: tuple[str, ...]) -> int:
    total = 0
    for name in names:
        with contextlib.suppress(OSError):
            total += os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_size
    return total


def _write(dir_fd: int, name: str, data: bytes, mode: int) -> None:
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | mode | FLAGS, 0o600, dir_fd=dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError("not a regular file")
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
