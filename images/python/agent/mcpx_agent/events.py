"""Everything the agent says, one builder each: the events the supervisor sends the host, the frames
a worker sends the supervisor, and the requests the supervisor sends a worker.

The host parses each event into its model (``mcp_code_exec/protocol/messages.py``, one per ``ev``)
and refuses anything else; the supervisor checks each worker frame (``protocol.worker_frame``). A
unit test sends every builder's output through both, and the unit tier's fake agent answers with
these same builders, so a field changed on one side fails there. Builders shape; they do not bound:
what comes from user code is checked and capped by whoever builds the event from it.

Every event to the host begins with ``ev`` and then ``id`` (the host reads them from a header's first
bytes, to skip an event nobody waits for and hold each kind to its header cap before parsing it).

Stdlib only: it runs inside the sandbox image, in the supervisor and in every worker.
"""

from __future__ import annotations

from typing import Any

Event = dict[str, Any]


# -- supervisor -> host (the host's ``Event`` models) -----------------------------------------------
def ready(agent_version: int, python: str) -> Event:
    return {"ev": "ready", "agent_version": agent_version, "python": python}


def pong(rid: Any, oom_kills: int | None) -> Event:
    return {"ev": "pong", "id": rid, "oom_kills": oom_kills}


def output(rid: Any, stream: str, text: str) -> Event:
    """New output of a running cell (``stream``: stdout or stderr)."""
    return {"ev": "output", "id": rid, "stream": stream, "text": text}


def image(rid: Any, mime: str, width: int, height: int, note: str | None) -> Event:
    """An image the running cell showed; its bytes are the payload."""
    return {"ev": "image", "id": rid, "mime": mime, "width": width, "height": height, "note": note}


def display(rid: Any, text: str) -> Event:
    return {"ev": "display", "id": rid, "text": text}


def table(
    rid: Any, table: str, columns: list[str], dtypes: list[str], rows: int, total_rows: int, sorted_columns: int
) -> Event:
    """A DataFrame or Series the running cell showed, kept under /mnt/data/.mcpx/tables/<table>/."""
    return {"ev": "table", "id": rid, "table": table, "columns": columns, "dtypes": dtypes, "rows": rows,
            "total_rows": total_rows, "sorted_columns": sorted_columns}  # fmt: skip


def tool_call(rid: Any, call: int, server: str, tool: str, raw: bool) -> Event:
    """The running cell called an upstream tool; its JSON arguments are the payload."""
    return {"ev": "tool_call", "id": rid, "call": call, "server": server, "tool": tool, "raw": raw}


def run_error(type: str, message: str, traceback: str = "") -> dict[str, Any]:
    """A ``done`` event's error."""
    return {"type": type, "message": message, "traceback": traceback}


def run_usage(
    cpu_user_s: float,
    cpu_system_s: float,
    peak_memory_bytes: int | None,
    data_written_bytes: int,
    packages_installed: int,
    tool_calls: int,
) -> dict[str, Any]:
    """A ``done`` event's usage: what the run cost, as the agent measured it (``meter.RunMeter``)."""
    return {"cpu_user_s": cpu_user_s, "cpu_system_s": cpu_system_s, "peak_memory_bytes": peak_memory_bytes,
            "data_written_bytes": data_written_bytes, "packages_installed": packages_installed,
            "tool_calls": tool_calls}  # fmt: skip


def done(
    rid: Any,
    *,
    status: str,
    result: str | None,
    error: dict[str, Any] | None,
    stdout: str,
    stderr: str,
    truncated: list[str],
    session_restarted: bool,
    duration_ms: float,
    notes: list[str],
    recycle: bool,
    files: list[dict[str, Any]],
    usage: dict[str, Any] | None,
) -> Event:
    """How a run ended and what it cost (``run_usage``); a stateless run's kept files' bytes are the
    payload (``files``' offsets)."""
    return {"ev": "done", "id": rid, "status": status, "result": result, "error": error, "stdout": stdout,
            "stderr": stderr, "truncated": truncated, "session_restarted": session_restarted,
            "duration_ms": duration_ms, "notes": notes, "recycle": recycle, "files": files,
            "usage": usage}  # fmt: skip


def clean(rid: Any, ok: bool, problems: list[str]) -> Event:
    """After a stateless run: whether every process of the sandbox user is gone and everything wiped."""
    return {"ev": "clean", "id": rid, "ok": ok, "problems": problems}


def listing(rid: Any, entries: list[dict[str, Any]], truncated: bool) -> Event:
    return {"ev": "listing", "id": rid, "entries": entries, "truncated": truncated}


def chunk(rid: Any, path: str, offset: int, size: int, modified: float, mtime_ns: int) -> Event:
    """Part of a file; its bytes are the payload."""
    return {"ev": "chunk", "id": rid, "path": path, "offset": offset, "size": size, "modified": modified,
            "mtime_ns": mtime_ns}  # fmt: skip


def staged(rid: Any, upload: str, size: int) -> Event:
    return {"ev": "staged", "id": rid, "upload": upload, "size": size}


def dropped(rid: Any, upload: str) -> Event:
    return {"ev": "dropped", "id": rid, "upload": upload}


def written(rid: Any, path: str, size: int, modified: float) -> Event:
    return {"ev": "written", "id": rid, "path": path, "size": size, "modified": modified}


def restored(rid: Any, outcome: str, restored: int, skipped: list[str], note: str, taken_at: float | None) -> Event:
    """How a restore went: ``outcome`` is one of ``protocol.RESTORE_OUTCOMES``."""
    return {"ev": "restored", "id": rid, "outcome": outcome, "restored": restored, "skipped": skipped, "note": note,
            "taken_at": taken_at}  # fmt: skip


def snapshot(rid: Any, complete: bool, taken_at: float | None, size: int | None) -> Event:
    return {"ev": "snapshot", "id": rid, "complete": complete, "taken_at": taken_at, "size": size}


def variables(rid: Any, variables: list[dict[str, Any]], truncated: bool) -> Event:
    return {"ev": "variables", "id": rid, "variables": variables, "truncated": truncated}


def history_page(rid: Any, cells: list[dict[str, Any]], runs_dropped: int, more: bool, missing: bool) -> Event:
    return {"ev": "history_page", "id": rid, "cells": cells, "runs_dropped": runs_dropped, "more": more,
            "missing": missing}  # fmt: skip


def failure(rid: Any, message: str, kind: str | None = None) -> Event:
    """A refused request (``ev: error``); ``kind`` names the refusals the host tells apart."""
    event = {"ev": "error", "id": rid, "message": message}
    if kind is not None:
        event["kind"] = kind
    return event


# -- worker -> supervisor (``protocol.WORKER_FRAMES``) ------------------------------------------------
def worker_done(
    status: str,
    result: str | None,
    error: dict[str, Any] | None,
    exec_ms: float,
    truncated: list[str],
    peak_kib: int = 0,
    children_peak_kib: int = 0,
) -> Event:
    """``peak_kib``: the worker's high-water mark of resident memory during the cell;
    ``children_peak_kib``: the largest of the children it started and waited for (0: none)."""
    return {"kind": "done", "status": status, "result": result, "error": error, "exec_ms": exec_ms,
            "truncated": truncated, "peak_kib": peak_kib, "children_peak_kib": children_peak_kib}  # fmt: skip


def worker_note(text: str) -> Event:
    """A sentence for the next run's notes (what the last snapshot could not do)."""
    return {"kind": "note", "text": text}


def worker_display(text: str) -> Event:
    return {"kind": "display", "text": text}


def worker_image(mime: str, width: int, height: int, note: str | None = None) -> Event:
    """An image; its bytes are the payload."""
    frame: Event = {"kind": "image", "mime": mime, "width": width, "height": height}
    if note:
        frame["note"] = note
    return frame


def worker_table(
    table: str, columns: list[str], dtypes: list[str], rows: int, total_rows: int, sorted_columns: int
) -> Event:
    return {"kind": "table", "table": table, "columns": columns, "dtypes": dtypes, "rows": rows,
            "total_rows": total_rows, "sorted_columns": sorted_columns}  # fmt: skip


def worker_call(call: int, server: str, tool: str, raw: bool) -> Event:
    """A tool call of the running cell; its JSON arguments are the payload."""
    return {"kind": "call", "call": call, "server": server, "tool": tool, "raw": raw}


def worker_restored(outcome: str, restored: int, skipped: list[str], note: str, taken_at: float | None) -> Event:
    return {"kind": "restored", "outcome": outcome, "restored": restored, "skipped": skipped, "note": note,
            "taken_at": taken_at}  # fmt: skip


def worker_snapshot_synced(complete: bool, taken_at: float | None, size: int | None) -> Event:
    return {"kind": "snapshot_synced", "complete": complete, "taken_at": taken_at, "size": size}


def worker_variables(variables: list[dict[str, Any]], truncated: bool) -> Event:
    return {"kind": "variables", "variables": variables, "truncated": truncated}


# -- supervisor -> worker (its control pipe; ``worker.serve_forever``) ------------------------------
def cell_request(options: dict[str, Any], once: bool) -> Event:
    """A cell: its code is the payload; ``once``: the worker ends after it (a stateless run)."""
    return {"options": options, "once": once}


def tool_reply(call: Any, ok: bool, error: Any) -> Event:
    """The host's answer to a tool call; the value (or the error's message) is the payload."""
    return {"kind": "tool_result", "call": call, "ok": ok, "error": error}


def snapshot_order(max_bytes: int) -> Event:
    """Take a snapshot of the namespace in the background (``Snapshots.snapshot_order``)."""
    return {"op": "snapshot_order", "max_bytes": max_bytes}


def snapshot_sync_request(timeout: float) -> Event:
    """Answer once the snapshot being written is finished (``Snapshots.snapshot_sync``)."""
    return {"op": "snapshot_sync", "timeout": timeout}


def restore_request() -> Event:
    return {"op": "restore"}


def variables_request(limit: int, repr_chars: int) -> Event:
    return {"op": "variables", "limit": limit, "repr_chars": repr_chars}
