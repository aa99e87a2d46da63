"""The session's history as a Jupyter notebook (nbformat 4.5), built in a fresh worker.

Each run is a code cell with its outputs: stdout and stderr as streams, displays as
``display_data``, images as ``image/png`` (or jpeg), the value as ``execute_result`` and the error
with ``ename``, ``evalue`` and its traceback. A markdown cell says where older outputs or runs
were dropped to keep the history within its cap. The notebook is validated with
``nbformat.validate`` and written to a temporary file under /mnt/data/.mcpx; the supervisor checks
the quota and puts it at the user's path.
"""

from __future__ import annotations

import base64
import os
import stat
import sys
import uuid
from typing import Any

from .. import events, history_format

EXPORT_TEMP = "/mnt/data/.mcpx/export.ipynb.tmp"
READ_MAX = 512 << 20


def read_history() -> list[dict[str, Any]]:
    try:
        with open(f"{history_format.DIR}/{history_format.FILE}", "rb") as stream:
            return history_format.parse(stream.read(READ_MAX))
    except OSError:
        return []


def _image(name: str) -> str | None:
    """An image of the history, base64; None when it is missing or not a file of its own."""
    try:
        fd = os.open(f"{history_format.DIR}/{name}", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or not history_format.servable(st):
            return None
        with os.fdopen(os.dup(fd), "rb") as stream:
            return base64.b64encode(stream.read(64 << 20)).decode("ascii")
    except OSError:
        return None
    finally:
        os.close(fd)


def _cell_id() -> str:
    return uuid.uuid4().hex[:8]


def outputs(run: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for name in ("stdout", "stderr"):
        if run[name]:
            out.append({"output_type": "stream", "name": name, "text": run[name]})
    for text in run["displays"]:
        out.append({"output_type": "display_data", "data": {"text/plain": text}, "metadata": {}})
    for image in run["images"]:
        encoded = _image(image["file"])
        if encoded is not None:
            out.append({"output_type": "display_data", "data": {image["mime"]: encoded}, "metadata": {}})
    if run["result"] is not None:
        out.append({"output_type": "execute_result", "execution_count": run["n"] or None,
                    "data": {"text/plain": run["result"]}, "metadata": {}})  # fmt: skip
    error = run["error"]
    if error is not None:
        lines = error["traceback"].splitlines() or [f"{error['type']}: {error['message']}"]
        out.append({"output_type": "error", "ename": error["type"], "evalue": error["message"], "traceback": lines})
    return out


def build(entries: list[dict[str, Any]]) -> dict[str, Any]:
    cells: list[dict[str, Any]] = []
    dropped_runs = sum(e["runs_dropped"] for e in entries if e["kind"] == "header")
    runs = [e for e in entries if e["kind"] == "run"]
    without = sum(1 for run in runs if run["outputs_dropped"])
    said = []
    if dropped_runs:
        said.append(f"the {dropped_runs} oldest runs were dropped")
    if without:
        said.append(f"the outputs of the {without} oldest runs shown here were dropped")
    if said:
        text = f"*History kept within its size cap: {' and '.join(said)}.*"
        cells.append({"cell_type": "markdown", "id": _cell_id(), "metadata": {}, "source": text})
    for run in runs:
        meta = {"mcpx": {"status": run["status"], "duration_ms": run["duration_ms"], "at": run["at"]}}
        if run["outputs_dropped"]:
            meta["mcpx"]["outputs_dropped"] = True
        cells.append({"cell_type": "code", "id": _cell_id(), "metadata": meta, "source": run["code"],
                      "execution_count": run["n"] or None, "outputs": outputs(run)})  # fmt: skip
    version = ".".join(str(part) for part in sys.version_info[:3])
    return {
        "nbformat": 4,
        "nbformat_minor": 5,
        "metadata": {
            "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
            "language_info": {"name": "python", "version": version},
        },
        "cells": cells,
    }


def export() -> dict[str, Any]:
    """The ``exported`` frame: the notebook validated and written to ``EXPORT_TEMP``, or the error."""
    import nbformat

    try:
        notebook = nbformat.from_dict(build(read_history()))
        nbformat.validate(notebook)
        data = nbformat.writes(notebook).encode("utf-8")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK
        os.makedirs(os.path.dirname(EXPORT_TEMP), 0o700, exist_ok=True)
        fd = os.open(EXPORT_TEMP, flags, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
    except Exception as exc:  # noqa: BLE001 - said to the model; the history is the user's to break
        return events.worker_exported(0, f"{type(exc).__name__}: {exc}"[:500])
    return events.worker_exported(len(data), None)
