"""Tables a cell shows, kept for the notebook view: a pandas or polars DataFrame (or Series) that is a
cell's value or is passed to ``display()`` is written, capped, under ``/mnt/data/.mcpx/tables/<id>/``.

The files are made to be read in bounded pieces by the host, which never parses anything but short
JSON lines and fixed-width numbers, and never sorts:

- ``rows.jsonl``: one JSON array a row (cells as JSON numbers, booleans, null or strings, each string
  cut at ``MAX_CELL_CHARS``);
- ``index``: one fixed-width record a row, ``"<offset:12> <length:8>\\n"``, where that row lies in
  ``rows.jsonl``;
- ``sort-<c>``: the same records in the order of column ``c`` ascending (missing values last), for
  the first ``MAX_SORTED_COLUMNS`` columns, so a sorted page is a slice of one file.

At most ``MAX_ROWS`` rows and ``MAX_BYTES`` bytes of rows are kept (the reference says how many
rows the table had); at most ``MAX_TABLES`` tables stay, the oldest removed first. The reference sent
on the result pipe (a ``table`` frame) names the directory, the columns and their types. Everything
here is best effort: a table that cannot be written (the quota, an odd type) is simply not kept.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import shutil
import sys
from typing import Any

from .. import events

ROOT = "/mnt/data/.mcpx/tables"
MAX_ROWS = 10_000
MAX_BYTES = 8 << 20
MAX_COLUMNS = 200
MAX_SORTED_COLUMNS = 16
MAX_CELL_CHARS = 1000
MAX_NAME_CHARS = 200
MAX_TABLES = 32
MAX_PER_RUN = 8
RECORD = "{:012d} {:08d}\n"  # 22 bytes: the host's notebook module reads the same width


def is_table(obj: Any) -> bool:
    """A pandas or polars DataFrame or Series (checked without importing either)."""
    module = type(obj).__module__ or ""
    if not module.startswith(("pandas", "polars")):
        return False
    pandas, polars = sys.modules.get("pandas"), sys.modules.get("polars")
    kinds = [getattr(pandas, "DataFrame", None), getattr(pandas, "Series", None)]
    kinds += [getattr(polars, "DataFrame", None), getattr(polars, "Series", None)]
    return any(isinstance(kind, type) and isinstance(obj, kind) for kind in kinds)


def _cell(value: Any) -> Any:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value if abs(value) < 1 << 53 else str(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else None if math.isnan(value) else str(value)
    item = getattr(value, "item", None)  # numpy scalars
    if callable(item) and type(value).__module__ == "numpy":
        with contextlib.suppress(Exception):
            return _cell(item())
    text = str(value)
    return text if len(text) <= MAX_CELL_CHARS else text[: MAX_CELL_CHARS - 1] + "…"


def _columns(obj: Any) -> tuple[list[str], list[str], list[list[Any]], int]:
    """Names, dtypes, the first ``MAX_ROWS`` rows as lists, and the total row count."""
    module = type(obj).__module__
    if module.startswith("polars"):
        frame = obj.to_frame() if hasattr(obj, "to_frame") and not hasattr(obj, "columns") else obj
        names = [str(name) for name in frame.columns][:MAX_COLUMNS]
        dtypes = [str(dtype) for dtype in frame.dtypes][:MAX_COLUMNS]
        total = int(frame.height)
        head = frame.head(MAX_ROWS).select(frame.columns[:MAX_COLUMNS])
        return names, dtypes, [list(row) for row in head.iter_rows()], total
    frame = obj.to_frame() if not hasattr(obj, "columns") else obj
    total = len(frame)
    head = frame.iloc[:MAX_ROWS, :MAX_COLUMNS]
    index_name = str(head.index.name) if head.index.name is not None else ""
    names = [index_name] + [str(name) for name in head.columns]
    dtypes = [str(head.index.dtype)] + [str(dtype) for dtype in head.dtypes]
    rows = [[key, *values] for key, values in zip(head.index.tolist(), head.itertuples(index=False), strict=True)]
    return names, dtypes, rows, total


def _sort_key(value: Any) -> tuple[int, Any]:
    if value is None:
        return (2, 0)
    if isinstance(value, bool | int | float):
        return (0, value)
    return (1, str(value))


def write_table(obj: Any) -> dict[str, Any] | None:
    """Write ``obj`` and return its reference (a ``table`` frame's fields), or None."""
    names, dtypes, rows, total = _columns(obj)
    names = [name[:MAX_NAME_CHARS] for name in names]
    dtypes = [dtype[:MAX_NAME_CHARS] for dtype in dtypes]
    lines: list[bytes] = []
    size = 0
    for row in rows:
        line = json.dumps([_cell(v) for v in row], ensure_ascii=False, allow_nan=False).encode() + b"\n"
        if size + len(line) > MAX_BYTES:
            break
        lines.append(line)
        size += len(line)
    cells = [json.loads(line) for line in lines]
    records, offset = [], 0
    for line in lines:
        records.append(RECORD.format(offset, len(line)))
        offset += len(line)
    table_id = secrets.token_hex(8)
    os.makedirs(ROOT, mode=0o700, exist_ok=True)
    _prune()
    folder = os.path.join(ROOT, table_id)
    os.mkdir(folder, 0o700)
    try:
        with open(os.path.join(folder, "rows.jsonl"), "wb") as out:
            out.writelines(lines)
        with open(os.path.join(folder, "index"), "w", encoding="ascii") as out:
            out.writelines(records)
        sorted_columns = min(len(names), MAX_SORTED_COLUMNS)
        for column in range(sorted_columns):
            order = sorted(range(len(cells)), key=lambda i: _sort_key(cells[i][column]))
            with open(os.path.join(folder, f"sort-{column}"), "w", encoding="ascii") as out:
                out.writelines(records[i] for i in order)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return events.worker_table(table_id, names, dtypes, len(lines), total, sorted_columns)


def _prune() -> None:
    """Keep at most ``MAX_TABLES - 1`` tables before a new one (the oldest go first)."""
    with os.scandir(ROOT) as found:
        folders = [entry for entry in found if entry.is_dir(follow_symlinks=False)]
    folders.sort(key=lambda entry: entry.stat(follow_symlinks=False).st_mtime_ns)
    for entry in folders[: max(0, len(folders) - MAX_TABLES + 1)]:
        shutil.rmtree(entry.path, ignore_errors=True)
