"""The second pass of ``export_notebook`` (see ``supervisor.notebook``): the notebook written as
``nbformat`` writes it (sorted keys, indent 1), a run's cell at a time, from the plan the first pass
made; and the plan's shape.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import os
import re
import stat
import sys
import uuid
from collections.abc import Iterator
from typing import Any, NamedTuple

from .. import history_format

MAX_TRACEBACK_LINES = 1_000  # a traceback's list of lines; the rest stays in its last line
MAX_COUNT = 2**31 - 1  # an execution count nbformat takes
SLICE = 3 << 16  # long texts are encoded, and images read and encoded, this much at a time
WRITE_BYTES = 1 << 20
OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class Image(NamedTuple):
    name: str
    mime: str
    size: int  # read at most this much of it


class Planned(NamedTuple):
    """A run kept for the export: where its line lies, what it held, and its images to embed."""

    offset: int
    length: int
    digest: bytes
    images: tuple[Image, ...]
    outputs_dropped: bool


class Plan(NamedTuple):
    runs: list[Planned]  # oldest first
    dropped: int  # the runs the history's header says its cap dropped
    left_out: bool  # older lines than these were not read
    images_left_out: int


def open_file(dir_fd: int | None, name: str) -> int | None:
    """A regular file of the history, not followed through a symlink; None when there is none."""
    if dir_fd is None:
        return None
    try:
        fd = os.open(name, OPEN, dir_fd=dir_fd)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


def _count(value: int) -> int | None:
    return value if 0 < value <= MAX_COUNT else None


def _finite(value: float) -> float:
    return value if math.isfinite(value) else 0.0


def said(plan: Plan) -> str | None:
    """The first cell's sentence: what the history's cap dropped and the export left out."""
    parts = []
    if plan.dropped:
        parts.append(f"the {plan.dropped} oldest runs were dropped")
    without = sum(1 for run in plan.runs if run.outputs_dropped)
    if without:
        parts.append(f"the outputs of the {without} oldest runs shown here were dropped")
    if plan.left_out:
        parts.append(f"runs older than these {len(plan.runs)} were left out of this export")
    if plan.images_left_out:
        parts.append(f"{plan.images_left_out} images past the export's size were left out")
    return f"*History kept within its size cap: {' and '.join(parts)}.*" if parts else None


class Writer:
    """The notebook written to ``out`` as ``nbformat`` writes it (sorted keys, indent 1), a cell at
    a time. A long text or an image stands in the cell as a marker no history can forge (a fresh
    random token), and is written in its place a slice at a time."""

    def __init__(self, out: int, history_fd: int | None, source: int | None) -> None:
        self.out, self.history_fd, self.source = out, history_fd, source
        self.encoder = json.JSONEncoder(indent=1, sort_keys=True, ensure_ascii=False, separators=(",", ": "))
        self.token = uuid.uuid4().hex
        self.marker = re.compile(r'"\\u0000' + self.token + r':([0-9]+)"')
        self.slices: list[str | Image] = []  # what each marker of the cell at hand stands for
        self.pending = bytearray()
        self.size = 0

    def notebook(self, plan: Plan) -> int:
        self.put('{\n "cells": [')
        first = True
        text = said(plan)
        if text is not None:
            self.cell({"cell_type": "markdown", "id": _cell_id(), "metadata": {}, "source": text}, first)
            first = False
        for run in plan.runs:
            cell = self.run_cell(run)
            if cell is not None:
                self.cell(cell, first)
                first = False
        self.put("]" if first else "\n ]")
        version = ".".join(str(part) for part in sys.version_info[:3])
        metadata = {
            "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
            "language_info": {"name": "python", "version": version},
        }
        self.put(',\n "metadata": ' + self.encoder.encode(metadata).replace("\n", "\n "))
        self.put(',\n "nbformat": 4,\n "nbformat_minor": 5\n}\n')
        self.flush()
        return self.size

    def run_cell(self, run: Planned) -> dict[str, Any] | None:
        """A run's cell from its line read again; None when the line is no longer the one planned."""
        assert self.source is not None
        raw = os.pread(self.source, run.length, run.offset)
        if hashlib.blake2b(raw, digest_size=16).digest() != run.digest:
            return None
        entry = history_format.parse_line(raw)
        del raw
        if entry is None or entry["kind"] != "run":
            return None
        mcpx: dict[str, Any] = {"status": entry["status"], "duration_ms": _finite(entry["duration_ms"]),
                                "at": _finite(entry["at"])}  # fmt: skip
        if entry["outputs_dropped"]:
            mcpx["outputs_dropped"] = True
        if entry["usage"] is not None:
            mcpx["usage"] = entry["usage"]
        return {"cell_type": "code", "id": _cell_id(), "metadata": {"mcpx": mcpx}, "source": self.text(entry["code"]),
                "execution_count": _count(entry["n"]), "outputs": self.outputs(entry, run.images)}  # fmt: skip

    def outputs(self, run: dict[str, Any], images: tuple[Image, ...]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for name in ("stdout", "stderr"):
            if run[name]:
                out.append({"output_type": "stream", "name": name, "text": self.text(run[name])})
        for text in run["displays"]:
            out.append({"output_type": "display_data", "data": {"text/plain": self.text(text)}, "metadata": {}})
        for image in images:
            out.append({"output_type": "display_data", "data": {image.mime: self.stand_in(image)}, "metadata": {}})
        if run["result"] is not None:
            out.append({"output_type": "execute_result", "execution_count": _count(run["n"]),
                        "data": {"text/plain": self.text(run["result"])}, "metadata": {}})  # fmt: skip
        error = run["error"]
        if error is not None:
            traceback = error["traceback"] or f"{error['type']}: {error['message']}"
            lines = [self.text(line) for line in traceback.split("\n", MAX_TRACEBACK_LINES)]
            out.append({"output_type": "error", "ename": self.text(error["type"]),
                        "evalue": self.text(error["message"]), "traceback": lines})  # fmt: skip
        return out

    def text(self, value: str) -> str:
        """``value``, or a marker for it when it is long (encoded a slice at a time)."""
        return value if len(value) <= SLICE else self.stand_in(value)

    def stand_in(self, what: str | Image) -> str:
        self.slices.append(what)
        return f"\0{self.token}:{len(self.slices) - 1}"

    def cell(self, cell: dict[str, Any], first: bool) -> None:
        self.put("\n  " if first else ",\n  ")
        for chunk in self.encoder.iterencode(cell):
            parts = self.marker.split(chunk.replace("\n", "\n  "))
            for index, part in enumerate(parts):  # text, marker's index, text, ...
                if index % 2 == 0:
                    self.put(part)
                else:
                    self.put_slices(self.slices[int(part)])
        self.slices = []

    def put_slices(self, what: str | Image) -> None:
        self.put('"')
        if isinstance(what, str):
            for at in range(0, len(what), SLICE):
                self.put(self.encoder.encode(what[at : at + SLICE])[1:-1])
        else:
            for data in self.image_slices(what):
                self.put(base64.b64encode(data).decode("ascii"))
        self.put('"')

    def image_slices(self, image: Image) -> Iterator[bytes]:
        """At most the planned size of an image, a slice at a time (a multiple of 3 bytes, so that
        the base64 of the slices is the base64 of the whole); nothing when it is no longer servable."""
        fd = open_file(self.history_fd, image.name)
        if fd is None:
            return
        try:
            if not history_format.servable(os.fstat(fd)):
                return
            at = 0
            while at < image.size and (data := os.pread(fd, min(SLICE, image.size - at), at)):
                at += len(data)
                yield data
                if len(data) % 3:
                    return  # the file ended (or shrank) here
        finally:
            os.close(fd)

    def put(self, text: str) -> None:
        self.pending += text.encode("utf-8", "replace")  # a lone surrogate a history held becomes "?"
        if len(self.pending) >= WRITE_BYTES:
            self.flush()

    def flush(self) -> None:
        view = memoryview(self.pending)
        while view:
            view = view[os.write(self.out, view) :]
        self.size += len(self.pending)
        self.pending = bytearray()


def _cell_id() -> str:
    return uuid.uuid4().hex[:8]
