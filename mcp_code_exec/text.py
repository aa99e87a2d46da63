"""The one compact text block a model reads for a run."""

from __future__ import annotations

from .models import RunResult

STATUS_LINES = {
    "ok": "ok",
    "error": "error",
    "timeout": "timeout: the run was stopped at its time limit",
    "memory_limit": "memory_limit: the run exceeded the sandbox's memory limit and was killed",
    "crashed": "crashed: the Python process died",
    "cancelled": "cancelled",
}


def render_run(result: RunResult) -> str:
    parts = [f"status: {STATUS_LINES.get(result.status, result.status)} ({result.duration_ms:.0f} ms)"]
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
        lines = [
            f"{f.path} ({f.size} bytes){' ' + f.uri if f.uri else ''}{' - ' + f.note if f.note else ''}"
            for f in result.files
        ]
        parts.append("--- files in /mnt/data ---\n" + "\n".join(lines))
    if result.truncated:
        parts.append(f"note: {', '.join(result.truncated)} cut at the output cap")
    parts += [f"note: {note}" for note in result.notes]
    return "\n".join(parts)
