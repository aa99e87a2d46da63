"""Service results as MCP content: what every agent framework can pass on to a model.

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

from ..models import FileContent, RunResult
from ..service.outcomes import as_text
from .render import render_run

IMAGE_MIMES = ("image/png", "image/jpeg", "image/gif", "image/webp")


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
