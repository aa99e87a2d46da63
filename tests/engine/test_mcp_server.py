"""The six tools, resources and notifications, driven through mcp.Client in memory (both eras)."""

from __future__ import annotations

import base64
import json
from typing import Any

import anyio
import pytest
from mcp import Client

from mcp_code_exec.mcp_server import build_server
from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio
PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
)


async def new_session(client: Client) -> str:
    result = await client.call_tool("new_session", {})
    assert not result.is_error, result
    assert result.structured_content is not None
    return str(result.structured_content["session_id"])


# The notebook view's app-only tools are listed only to clients that declare MCP Apps.
TOOLS = {
    "run_python", "get_run", "cancel_run", "new_session", "close_session", "fork_session", "list_variables",
    "export_notebook", "list_files", "read_file", "write_file", "file_url", "view_session", "view_run",
}  # fmt: skip


async def test_the_tools_are_listed_with_closed_schemas_descriptions_and_annotations(client: Client) -> None:
    tools = {t.name: t for t in (await client.list_tools()).tools}
    assert set(tools) == TOOLS
    for tool in tools.values():
        # OpenAI's strict mode: closed objects, and nullable (not defaulted) optional arguments
        assert tool.input_schema.get("additionalProperties") is False, tool.name
        for name, prop in tool.input_schema["properties"].items():
            if name not in tool.input_schema.get("required", []):
                assert prop.get("default") is None, (tool.name, name)
        description = tool.description or ""
        assert description and not description.startswith(" ") and "\n    " not in description, tool.name
    text = tools["run_python"].description or ""
    for needed in ("/mnt/data", "default 20", "at most 60", "64 KiB", "get_run", "read_file(run_id=...)"):
        assert needed in text, needed
    run = tools["run_python"]
    assert run.output_schema is not None
    assert {
        "status",
        "stdout",
        "stderr",
        "result",
        "error",
        "files",
        "duration_ms",
        "truncated",
        "session_id",
        "session_restarted",
    } <= set(run.output_schema["properties"])
    assert "numpy" in (run.description or "") and "network" in (run.description or "")
    assert run.annotations is not None and run.annotations.open_world_hint is False
    assert tools["list_files"].annotations is not None and tools["list_files"].annotations.read_only_hint


async def test_run_python_returns_stdout_as_text_and_structured_content(client: Client) -> None:
    result = await client.call_tool("run_python", {"code": "print(6*7)"})
    assert not result.is_error
    assert result.structured_content is not None
    assert result.structured_content["stdout"] == "42\n"
    assert result.structured_content["status"] == "ok"
    assert "42" in result.content[0].text  # type: ignore[union-attr]


async def test_two_figures_come_back_as_two_png_images_and_no_base64_in_the_structure(client: Client) -> None:
    code = "import matplotlib.pyplot as plt; plt.plot([1,2]); plt.figure(); plt.plot([2,1])"
    result = await client.call_tool("run_python", {"code": code})
    images = [block for block in result.content if block.type == "image"]
    assert len(images) == 2
    for image in images:
        assert base64.b64decode(image.data).startswith(b"\x89PNG\r\n\x1a\n")
        assert image.mime_type == "image/png"
    structured = json.dumps(result.structured_content)
    assert "iVBOR" not in structured and len(structured) < 5000
    assert result.structured_content is not None and result.structured_content["image_count"] == 2


async def test_a_large_dataframe_renders_as_a_truncated_text_table(client: Client) -> None:
    result = await client.call_tool("run_python", {"code": "import pandas as pd; pd.DataFrame({'a': range(1000)})"})
    assert result.structured_content is not None
    table = result.structured_content["result"]
    assert "[1000 rows x 1 columns]" in table
    assert "..." in table and len(table.splitlines()) < 30


async def test_an_exception_returns_its_type_and_a_traceback_without_agent_frames(client: Client) -> None:
    result = await client.call_tool("run_python", {"code": "def f():\n    return 1/0\nf()"})
    assert not result.is_error  # the tool worked: the code is what the model must fix (see mcp_server/answers.py)
    assert result.structured_content is not None
    error = result.structured_content["error"]
    assert result.structured_content["status"] == "error"
    assert error["type"] == "ZeroDivisionError"
    assert "return 1/0" in error["traceback"]
    for internal in ("mcpx_agent", "interactiveshell.py", "site-packages", "dist-packages"):
        assert internal not in error["traceback"]


async def test_a_syntax_error_points_at_its_line(client: Client) -> None:
    result = await client.call_tool("run_python", {"code": "x = 1\ndef f(:\n    pass"})
    assert result.structured_content is not None
    error = result.structured_content["error"]
    assert error["type"] == "SyntaxError"
    assert error["line"] == 2


async def test_a_stateless_file_comes_back_as_a_resource_with_the_same_bytes(client: Client) -> None:
    code = "open('/mnt/data/out.csv', 'w').write('a,b\\n1,2\\n')"
    result = await client.call_tool("run_python", {"code": code})
    # No resource_link blocks by default (frameworks turn them into file parts model APIs refuse):
    # the file's URI is in the structured result and the text, and read_file(run_id=...) reads it.
    assert [block for block in result.content if block.type == "resource_link"] == []
    assert result.structured_content is not None
    (listed,) = result.structured_content["files"]
    run_id = result.structured_content["run_id"]
    assert listed["uri"] in result.content[0].text  # type: ignore[union-attr]
    by_tool = await client.call_tool("read_file", {"run_id": run_id, "path": "out.csv"})
    assert by_tool.content[0].text == "a,b\n1,2\n"  # type: ignore[union-attr]
    read = await client.read_resource(listed["uri"])
    assert read.contents[0].text == "a,b\n1,2\n"  # type: ignore[union-attr]
    assert read.contents[0].mime_type == "text/csv"
    embedded = [block for block in result.content if block.type == "resource"]
    assert [block.resource.text for block in embedded] == ["a,b\n1,2\n"]  # type: ignore[union-attr]


async def test_write_list_read_round_trip_of_text_and_png_also_as_resources(client: Client) -> None:
    sid = await new_session(client)
    try:
        wrote = await client.call_tool("write_file", {"session_id": sid, "path": "docs/note.txt", "content": "héllo"})
        assert not wrote.is_error and wrote.structured_content is not None
        png = base64.b64encode(PNG).decode()
        wrote_png = await client.call_tool(
            "write_file", {"session_id": sid, "path": "/mnt/data/pic.png", "content": png, "encoding": "base64"}
        )
        assert wrote_png.structured_content is not None and wrote_png.structured_content["size"] == len(PNG)
        listing = await client.call_tool("list_files", {"session_id": sid})
        assert listing.structured_content is not None
        paths = {e["path"]: e for e in listing.structured_content["entries"]}
        assert {"docs", "docs/note.txt", "pic.png"} <= set(paths)
        text = await client.call_tool("read_file", {"session_id": sid, "path": "docs/note.txt"})
        assert text.content[0].type == "text" and text.content[0].text == "héllo"
        image = await client.call_tool("read_file", {"session_id": sid, "path": "pic.png"})
        assert image.content[0].type == "image"
        assert base64.b64decode(image.content[0].data) == PNG
        as_text = await client.read_resource(paths["docs/note.txt"]["uri"])
        assert as_text.contents[0].text == "héllo"  # type: ignore[union-attr]
        as_blob = await client.read_resource(paths["pic.png"]["uri"])
        assert as_blob.contents[0].mime_type == "image/png"
        assert base64.b64decode(as_blob.contents[0].blob) == PNG  # type: ignore[union-attr]
        seen_by_code = await client.call_tool("run_python", {"code": "open('docs/note.txt').read()", "session_id": sid})
        assert seen_by_code.structured_content is not None and seen_by_code.structured_content["result"] == "'héllo'"
    finally:
        await client.call_tool("close_session", {"session_id": sid})


async def test_resources_are_listed_and_templates_advertised(client: Client) -> None:
    sid = await new_session(client)
    try:
        await client.call_tool("write_file", {"session_id": sid, "path": "listed.txt", "content": "x"})
        uris = [str(r.uri) for r in (await client.list_resources()).resources]
        assert f"sandbox://sessions/{sid}/files/listed.txt" in uris
        templates = [t.uri_template for t in (await client.list_resource_templates()).resource_templates]
        assert "sandbox://sessions/{session_id}/files/{+path}" in templates
    finally:
        await client.call_tool("close_session", {"session_id": sid})


async def test_resources_are_listed_at_once_while_a_session_is_running_code(client: Client) -> None:
    sid = await new_session(client)
    try:
        await client.call_tool("write_file", {"session_id": sid, "path": "before.txt", "content": "x"})
        started = anyio.Event()

        async def on_progress(progress: float, total: float | None, message: str | None) -> None:
            started.set()

        async with anyio.create_task_group() as tg:

            async def long_run() -> None:
                code = "import time\nprint('going', flush=True)\ntime.sleep(120)"
                await client.call_tool("run_python", {"code": code, "session_id": sid}, progress_callback=on_progress)

            tg.start_soon(long_run)
            with anyio.fail_after(30):
                await started.wait()
            # The run holds the session for two minutes; the listing does not wait for it.
            with anyio.fail_after(10):
                uris = [str(r.uri) for r in (await client.list_resources()).resources]
            assert f"sandbox://sessions/{sid}/files/before.txt" in uris
            tg.cancel_scope.cancel()
    finally:
        with anyio.fail_after(30):
            await client.call_tool("close_session", {"session_id": sid})


async def test_close_session_removes_it_and_later_calls_say_no_such_session(client: Client) -> None:
    sid = await new_session(client)
    closed = await client.call_tool("close_session", {"session_id": sid})
    assert closed.structured_content == {"session_id": sid, "closed": True}
    again = await client.call_tool("run_python", {"code": "1", "session_id": sid})
    assert again.is_error
    assert "no such session" in again.content[0].text  # type: ignore[union-attr]


async def test_bad_input_comes_back_as_tool_errors_with_reasons(client: Client) -> None:
    sid = await new_session(client)
    try:
        cases: list[tuple[str, dict[str, Any], str]] = [
            ("read_file", {"session_id": sid, "path": "../etc/passwd"}, "'..' is not allowed"),
            ("read_file", {"session_id": sid, "path": "/etc/passwd"}, "must be under /mnt/data"),
            ("read_file", {"session_id": sid, "path": "missing.txt"}, "no such file"),
            (
                "write_file",
                {"session_id": sid, "path": "x.bin", "content": "%%%", "encoding": "base64"},
                "not valid base64",
            ),
            ("list_files", {"session_id": "s_nope"}, "no such session"),
            ("run_python", {"code": "1", "timeout": -1}, "greater than 0"),
        ]
        for tool, arguments, reason in cases:
            result = await client.call_tool(tool, arguments)
            assert result.is_error, (tool, arguments)
            assert reason in result.content[0].text, result.content[0].text  # type: ignore[union-attr]
    finally:
        await client.call_tool("close_session", {"session_id": sid})


async def test_progress_notifications_stream_output_and_cancelling_keeps_session_state(client: Client) -> None:
    sid = await new_session(client)
    try:
        await client.call_tool("run_python", {"code": "kept = 7", "session_id": sid})
        first_progress = anyio.Event()
        messages: list[str] = []

        async def on_progress(progress: float, total: float | None, message: str | None) -> None:
            messages.append(message or "")
            first_progress.set()

        code = "import time\nfor i in range(30):\n    print('tick', i, flush=True)\n    time.sleep(0.1)"
        async with anyio.create_task_group() as tg:

            async def call() -> None:
                await client.call_tool("run_python", {"code": code, "session_id": sid}, progress_callback=on_progress)

            tg.start_soon(call)
            with anyio.fail_after(10):
                await first_progress.wait()  # output arrived while the run is still going
            tg.cancel_scope.cancel()
        assert any("tick" in m for m in messages)
        with anyio.fail_after(5):  # cancelled within a second or two; the session answers at once
            after = await client.call_tool("run_python", {"code": "kept", "session_id": sid})
        assert after.structured_content is not None and after.structured_content["result"] == "7"
        leftovers = await client.call_tool(
            "run_python",
            {
                "code": "import os; sum(1 for p in os.listdir('/proc') if p.isdigit() and f'Uid:\\t{os.getuid()}\\t' in open(f'/proc/{p}/status').read())",
                "session_id": sid,
            },
        )
        assert leftovers.structured_content is not None and leftovers.structured_content["result"] == "1"
    finally:
        await client.call_tool("close_session", {"session_id": sid})


async def test_a_run_that_changes_files_notifies_listeners_in_the_modern_era(service: SandboxService) -> None:
    server = build_server(service)
    async with Client(server) as client:
        sid = await new_session(client)
        try:
            async with client.listen(resources_list_changed=True) as events:
                await client.call_tool("run_python", {"code": "open('n.txt','w').write('1')", "session_id": sid})
                with anyio.fail_after(5):
                    async for event in events:
                        assert "list_changed" in type(event).__name__.lower() or "ListChanged" in type(event).__name__
                        break
        finally:
            await client.call_tool("close_session", {"session_id": sid})


async def test_a_run_that_changes_files_notifies_2025_era_clients(service: SandboxService) -> None:
    server = build_server(service)
    received: list[str] = []
    got = anyio.Event()

    async def handler(message: Any) -> None:
        name = type(getattr(message, "root", message)).__name__
        received.append(name)
        if any("ResourceListChanged" in n for n in received) and any("ResourceUpdated" in n for n in received):
            got.set()

    async with Client(server, mode="legacy", message_handler=handler) as client:
        sid = await new_session(client)
        try:
            uri = f"sandbox://sessions/{sid}/files/n.txt"
            with pytest.warns(UserWarning, match="resources/subscribe"):  # removed in 2026-07-28 only
                await client.subscribe_resource(uri)
            await client.call_tool("run_python", {"code": "open('n.txt','w').write('1')", "session_id": sid})
            with anyio.fail_after(5):
                await got.wait()
        finally:
            await client.call_tool("close_session", {"session_id": sid})
    assert any("ResourceListChanged" in name for name in received)
    assert any("ResourceUpdated" in name for name in received)
