"""Service results as MCP content: what every agent framework can pass on to a model, and the one
compact text block a model reads for a run (most frameworks show the model nothing else).

- A run's outcome, whatever the user's code did (an exception, a timeout, a crash), is a
  *successful* tool call whose text and ``structuredContent.status`` say what happened: agent
  frameworks count ``isError`` results against a retry budget (pydantic-ai ends an agent run
  after two in a row) when the code is the thing to fix, not the tool. ``isError`` is for the
  tool itself failing: an unknown session, a busy one, no container, the engine down, a sandbox
  lost under the run.
- Images travel only as image blocks, never inside the structured content.
- ``resource_link`` blocks only when configured: LangChain turns them into "file" parts that
  OpenAI's chat API refuses; the URIs are in the text anyway, and ``read_file`` reads them.
"""

from __future__ import annotations

import base64
from typing import Any

from mcp.types import (
    BlobResourceContents,
    CallToolResult,
    EmbeddedResource,
    ImageContent,
    ResourceLink,
    TextContent,
    TextResourceContents,
)

from ..models import FileContent, FileInfo, RunResult
from ..service.uris import as_text

IMAGE_MIMES = ("image/png", "image/jpeg", "image/gif", "image/webp")
STATUS_LINES = {
    "ok": "ok",
    "error": "error: the code raised an exception (see below); fix it and run again",
    "timeout": "timeout: the run was stopped at its time limit",
    "memory_limit": "memory_limit: the run exceeded the sandbox's memory limit and was killed",
    "crashed": "crashed: the Python process died",
    "cancelled": "cancelled",
    "running": "running: the run goes on after this answer",
}


def run_content(result: RunResult, *, links: bool) -> CallToolResult:
    """Text first, then one image block per image, then small text files (and links, if wanted)."""
    content: list[Any] = [TextContent(text=render_run(result))]
    for image in result.images:
        content.append(ImageContent(data=base64.b64encode(image.data).decode(), mime_type=image.mime_type))
    for info in result.files:
        if info.uri is None:
            continue
        if info.text is not None:  # a stateless run's small text file, marked when it was kept
            resource = TextResourceContents(uri=info.uri, mime_type=info.mime_type, text=info.text)
            content.append(EmbeddedResource(resource=resource))
        if links:
            content.append(ResourceLink(uri=info.uri, name=info.path, mime_type=info.mime_type, size=info.size))
    failed = result.error is not None and result.error.tool_failure
    return CallToolResult(content=content, structured_content=result.model_dump(mode="json"), is_error=failed)


def file_content(found: FileContent, *, uri: str, mime: str, links: bool) -> CallToolResult:
    """A file as a model can take it: text as text, images as images, anything else as a blob."""
    block: Any
    if mime in IMAGE_MIMES:
        block = ImageContent(data=base64.b64encode(found.data).decode(), mime_type=mime)
    elif (text := as_text(found.data, mime)) is not None:
        block = TextContent(text=text)
    else:
        blob = BlobResourceContents(uri=uri, mime_type=mime, blob=base64.b64encode(found.data).decode())
        block = EmbeddedResource(resource=blob)
    content: list[Any] = [block]
    if links:
        content.append(ResourceLink(uri=uri, name=found.path, mime_type=mime, size=found.size))
    return CallToolResult(content=content)


def render_run(result: RunResult) -> str:
    parts = [f"status: {STATUS_LINES.get(result.status, result.status)} ({result.duration_ms:.0f} ms)"]
    if result.status == "running" and result.run_id:
        parts.append(
            f"note: call get_run(run_id='{result.run_id}') for its new output and, once it ends, its result; "
            f"cancel_run(run_id='{result.run_id}') stops it"
        )
    if result.session_restarted:
        parts.append(restart_line(result))
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


RESTARTS = {
    "restored": "its variables were restored from its last snapshot (the notes below say which), any changed "
    "after it were lost",
    "none": "it had no snapshot, so its variables were lost",
    "failed": "its snapshot could not be loaded (the notes below say why), so its variables were lost",
    None: "its variables were lost",
}


def restart_line(result: RunResult) -> str:
    """What a restart cost the session, worded by what its variables came back from (``RunResult.restore``)."""
    return f"note: the session's interpreter was restarted (files in /mnt/data were kept); {RESTARTS[result.restore]}"


def _file_line(info: FileInfo, result: RunResult) -> str:
    line = f"{info.path} ({info.size} bytes)"
    if info.uri and result.session_id:
        line += f" read_file(session_id='{result.session_id}', path='{info.path}') or {info.uri}"
    elif info.uri and result.run_id:
        line += f" read_file(run_id='{result.run_id}', path='{info.path}') or {info.uri}"
    if info.note:
        line += f" - {info.note}"
    return line
