"""``export_notebook``: the session's history as a Jupyter notebook (nbformat 4.5), built and written
by the supervisor, a run at a time.

Each run is a code cell with its outputs: stdout and stderr as streams, displays as
``display_data``, images as ``image/png`` (or jpeg), the value as ``execute_result`` and the error
with ``ename``, ``evalue`` and its traceback. A first markdown cell says where older outputs or runs
were dropped to keep the history within its cap, or left out of the export.

The history is the session's to rewrite (a million one-line runs, one image named by every run, a
run of 16 MiB), and the whole sandbox shares one memory limit (under gVisor, going over it ends the
sandbox, the session's variables with it). So the export takes no process of its own (a worker
forked for it cost about 30 MiB under gVisor, where a fork copies memory in large pieces, and
importing ``nbformat`` more: at 256 MiB, past the limit), and it never holds the history: a first
pass reads the file from its end a block at a time, parses one line at a time and keeps where each
of the newest runs lies (at most ``read_max`` bytes from the end, ``MAX_LINES`` lines looked at,
``MAX_CELLS`` runs, ``MAX_IMAGES`` images named and ``read_max`` bytes of images, every copy of a
figure counted); a second reads each kept run again (refused if its bytes changed meanwhile), and
writes its cell as it is encoded, long texts and images a slice at a time. What it holds at once is
one run's line, parsed. The notebook is built from checked values in nbformat 4.5's shape (numbers
finite, execution counts positive; a unit test validates it with ``nbformat``).

Acting as the sandbox user, the history's directory and /mnt/data/.mcpx are opened through the file
tools' no-symlink walk and every file in them without following a symlink; the notebook is written
to a temporary file in /mnt/data/.mcpx, where the caller checks the quota and puts it at the user's path.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from collections.abc import Iterator
from typing import Any

from .. import history_format
from ..identity import as_sandbox_user
from . import files
from .notebook_writer import Image, Plan, Planned, Writer, open_file
from .transfer import EXPORT_TEMP
from .tree import RESERVED

READ_MAX = 17 << 20  # the default history cap (16 MiB) and 1 MiB, when the request names no bound
MAX_LINES = 20_000  # looked at, whatever they hold
MAX_CELLS = 5_000  # the newest runs; older ones are said to be left out
MAX_IMAGES = 2_000  # images named by the runs kept (a line may name a thousand); the rest are left out
HEADER_BYTES = 4096  # the header is the file's first line, and short
BLOCK = 1 << 16  # read from the end of the history this much at a time
CREATE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def export_notebook(read_max: object) -> dict[str, Any]:
    """``{"size": ..., "error": None}`` once the notebook is in ``EXPORT_TEMP``, else the error (the
    history is the user's to break). ``read_max``: the host's bound on what is read of the history
    (anything but an int: the agent's own)."""
    bound = max(0, read_max) if isinstance(read_max, int) else READ_MAX
    with as_sandbox_user():
        try:
            reserved = files.open_dir([RESERVED], create=True)
        except (OSError, files.FileError) as exc:
            return {"size": 0, "error": str(exc)[:500]}
        history_fd = None
        with contextlib.suppress(OSError, files.FileError):  # none (nothing run yet): an empty notebook
            history_fd = files.open_dir([RESERVED, "history"])
        try:
            return {"size": export(history_fd, reserved, bound), "error": None}
        except Exception as exc:  # noqa: BLE001 - said to the model; the history is the user's to break
            return {"size": 0, "error": f"{type(exc).__name__}: {exc}"[:500]}
        finally:
            for fd in (reserved, history_fd):
                if fd is not None:
                    os.close(fd)


def export(history_fd: int | None, reserved_fd: int, read_max: int) -> int:
    """Write the notebook to ``EXPORT_TEMP`` in ``reserved_fd``; its size."""
    source = open_file(history_fd, history_format.FILE)
    try:
        plan = read_plan(history_fd, source, read_max)
        out = os.open(EXPORT_TEMP, CREATE, 0o644, dir_fd=reserved_fd)
        try:
            if not stat.S_ISREG(os.fstat(out).st_mode):
                raise OSError("the export's temporary file is not a regular file")
            size = Writer(out, history_fd, source).notebook(plan)
            os.fsync(out)
        finally:
            os.close(out)
    finally:
        if source is not None:
            os.close(source)
    return size


# -- the first pass: which runs, from the end ---------------------------------------------------------
def lines_from_end(fd: int, start: int, end: int) -> Iterator[tuple[int, bytes]]:
    """(offset, bytes) of each line of the file between ``start`` and ``end``, newest first, read a
    block at a time; the first line only when ``start`` is the file's beginning (else the bound cut it)."""
    pieces: list[bytes] = []  # of the line being read, newest first
    at = end
    while at > start:
        size = min(BLOCK, at - start)
        block = os.pread(fd, size, at - size)
        if len(block) != size:
            return  # the file shrank meanwhile: what is left is not the history that was measured
        at -= size
        cut = len(block)
        while (newline := block.rfind(b"\n", 0, cut)) >= 0:
            line = b"".join([block[newline + 1 : cut], *reversed(pieces)])
            pieces, cut = [], newline
            yield at + newline + 1, line
        pieces.append(block[:cut])
    if start == 0:
        line = b"".join(reversed(pieces))
        pieces = []
        yield 0, line


def read_plan(history_fd: int | None, fd: int | None, read_max: int) -> Plan:
    """The runs to export from the newest ``read_max`` bytes of the history (``fd``), and what was
    left out; one line parsed at a time, none kept but where it lies."""
    if history_fd is None or fd is None:
        return Plan([], 0, False, 0)
    size = os.fstat(fd).st_size
    start = max(0, size - read_max)
    kept: list[Planned] = []
    looked, named, budget, images_left_out = 0, 0, read_max, 0
    left_out = start > 0
    for offset, raw in lines_from_end(fd, start, size):
        if len(kept) >= MAX_CELLS or looked >= MAX_LINES:
            left_out = True
            break
        looked += 1
        entry = history_format.parse_line(raw) if raw.strip() else None
        if entry is None or entry["kind"] != "run":
            continue
        images = []
        for image in entry["images"]:
            named += 1
            length = _image_size(history_fd, image["file"]) if named <= MAX_IMAGES else budget + 1
            if length is None:  # missing, or not a file of its own: not embedded, as before
                continue
            if length > budget:
                images_left_out += 1
                continue
            budget -= length
            images.append(Image(image["file"], image["mime"], length))
        digest = hashlib.blake2b(raw, digest_size=16).digest()
        kept.append(Planned(offset, len(raw), digest, tuple(images), entry["outputs_dropped"]))
    return Plan(kept[::-1], _dropped(fd), left_out, images_left_out)


def _dropped(fd: int) -> int:
    """The runs the history's header (its first line) says were dropped."""
    first = os.pread(fd, HEADER_BYTES, 0).split(b"\n", 1)
    header = history_format.parse_line(first[0]) if len(first) == 2 else None
    return max(0, header["runs_dropped"]) if header is not None and header["kind"] == "header" else 0


def _image_size(history_fd: int, name: str) -> int | None:
    """The size of an image of the history; None when it is missing or not a file of its own."""
    fd = open_file(history_fd, name)
    if fd is None:
        return None
    try:
        st = os.fstat(fd)
        return st.st_size if history_format.servable(st) else None
    finally:
        os.close(fd)
