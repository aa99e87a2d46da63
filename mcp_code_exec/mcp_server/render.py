"""The one compact text block a model reads for a run (most frameworks show the model nothing else)."""

from __future__ import annotations

from ..models import FileInfo, RunResult

STATUS_LINES = {
    "ok": "ok",
    "error": "error: the code raised an exception (see below); fix it and run again",
    "timeout": "timeout: the run was stopped at its time limit",
    "memory_limit": "memory_limit: the run exceeded the sandbox's memory limit and was killed",
    "crashed": "crashed: the Python process died",
    "cancelled": "cancelled",
    "running": "running: the run goes on after this answer",
}


def render_run(result: RunResult) -> str:
    parts = [f"status: {STATUS_LINES.get(result.status, result.status)} ({result.duration_ms:.0f} ms)"]
    if result.status == "running" and result.run_id:
        parts.append(
            f"note: call get_run(run_id='{result.run_id}') for its new output and, once it ends, its result; "
            f"cancel_run(run_id='{result.run_id}') stops it"
        )
    if result.session_restarted:
        parts.append(
            "note: the session's interpreter was restarted; variables were lost (files in /mnt/data were kept)"
        )
    if result.stdout:
        parts.append("--- stdout ---\n" + result.stdout.rstrip("\n"))
    if result.stderr:
        parts.append("--- stderr ---\n" + result.stderr.rstrip("\n"))
    for text in result.displays:
        parts.append("--- display ---\n" + text)
    if result.result is not None:
        parts.append("--- result ---\n" + result.result)
    if result.error is not None:
        error = result.error
        body = error.traceback.strip() or f"{error.type}: {error.message}"
        parts.append(f"--- error: {error.type} ---\n{body}")
    if result.image_count:
        parts.append(f"--- {result.image_count} image(s) attached ---")
        for number, image in enumerate(result.images, 1):
            if image.note:
                parts.append(f"image {number}: {image.note}")
    if result.files:
        lines = [_file_line(f, result) for f in result.files]
        if result.files_omitted:
            lines.append(f"... and {result.files_omitted} more (list_files shows them all)")
        parts.append("--- files in /mnt/data ---\n" + "\n".join(lines))
    if result.truncated:
        parts.append(f"note: {', '.join(result.truncated)} cut at the output cap")
    parts += [f"note: {note}" for note in result.notes]
    return "\n".join(parts)


def _file_line(info: FileInfo, result: RunResult) -> str:
    line = f"{info.path} ({info.size} bytes)"
    if info.uri and result.session_id:
        line += f" read_file(session_id='{result.session_id}', path='{info.path}') or {info.uri}"
    elif info.uri and result.run_id:
        line += f" read_file(run_id='{result.run_id}', path='{info.path}') or {info.uri}"
    if info.note:
        line += f" - {info.note}"
    return line
