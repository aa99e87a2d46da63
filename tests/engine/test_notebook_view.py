"""The notebook view (MCP Apps) in a real browser, against the real server over streamable HTTP.

A small host page on loopback puts the view's HTML (read with ``resources/read``) into a sandboxed
iframe with the spec's default CSP, and bridges it (a minimal hand-written bridge) to the real
server: the iframe's ``tools/call`` requests go to a real ``mcp.Client`` with a token, and only for
tools whose ``_meta.ui.visibility`` includes ``"app"``, as the spec requires of hosts. Debian's
chromium runs headless under Playwright. A screenshot per theme (and one narrow) is kept under
``.artifacts/`` for a person to look at.
"""

from __future__ import annotations

import base64
import http.server
import json
import os
import shutil
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, ClassVar

import anyio
import httpx2
import pytest
from _support import ServerProcess, png_size
from mcp import Client
from mcp.client.extension import advertise
from mcp.client.streamable_http import streamable_http_client
from mcp.server.apps import APP_MIME_TYPE, EXTENSION_ID

pytestmark = [pytest.mark.anyio, pytest.mark.skipif(shutil.which("chromium") is None, reason="needs chromium")]
TOKEN = "notebook-token-3b1e"
VIEW_URI = "ui://mcp-code-exec/notebook.html"
ARTIFACTS = Path(os.environ.get("MCP_CODE_EXEC_ARTIFACTS", Path(__file__).resolve().parents[2] / ".artifacts"))
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
DEFAULT_CSP = (
    "default-src 'none'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; media-src 'self' data:; connect-src 'none'"
)
CELLS = [
    "print('hello from the sandbox')\n21 * 2",
    "import matplotlib.pyplot as plt\nfig = plt.figure(figsize=(10, 5), dpi=100)\nplt.plot([1, 3, 2])\nplt.show()",
    "import pandas as pd\nx = [(i * 37) % 120 for i in range(120)]\ndf = pd.DataFrame({'x': x, 'name': [f'r{i}' for i in range(120)]})\ndf",
    "1 / 0",
]
HOST_PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>test host</title>
<style>body{margin:0;background:#888} iframe{border:0;width:100%;height:600px;display:block}</style></head>
<body><script>
window.hits = 0;
window.refusals = [];
window.calls = [];  // [name, arguments] of each call the view made, in order
window.inFlight = 0;
window.maxInFlight = 0;
window.callBudget = Infinity;  // calls past it are refused here, not sent (a test of an eager view)
window.start = (html, csp, toolResult, theme, appTools, fixedHeight) => {
  const frame = document.createElement("iframe");
  if (fixedHeight) frame.style.height = fixedHeight + "px";
  frame.setAttribute("sandbox", "allow-scripts");
  frame.srcdoc = html.replace("<head>", '<head><meta http-equiv="Content-Security-Policy" content="' + csp + '">');
  const reply = (m) => frame.contentWindow.postMessage(m, "*");
  window.addEventListener("message", async (event) => {
    if (event.source !== frame.contentWindow) return;
    const m = event.data;
    if (m.method === "ui/initialize") {
      reply({jsonrpc: "2.0", id: m.id, result: {protocolVersion: "2026-01-26", hostInfo: {name: "test", version: "1"},
             hostCapabilities: {}, hostContext: {theme}}});
    } else if (m.method === "ui/notifications/size-changed") {
      if (!fixedHeight) frame.style.height = Math.min(20000, m.params.height) + "px";
    } else if (m.method === "ui/notifications/initialized") {
      reply({jsonrpc: "2.0", method: "ui/notifications/tool-input", params: {arguments: {}}});
      reply({jsonrpc: "2.0", method: "ui/notifications/tool-result", params: toolResult});
    } else if (m.method === "tools/call") {
      if (!appTools.includes(m.params.name)) {
        window.refusals.push(m.params.name);
        reply({jsonrpc: "2.0", id: m.id, error: {code: -32600, message: "refused: not visible to apps"}});
        return;
      }
      window.calls.push([m.params.name, m.params.arguments]);
      if (window.calls.length > window.callBudget) {
        reply({jsonrpc: "2.0", id: m.id, error: {code: -32603, message: "over the test's budget"}});
        return;
      }
      window.maxInFlight = Math.max(window.maxInFlight, ++window.inFlight);
      try { reply({jsonrpc: "2.0", id: m.id, result: await window.mcpCall(m.params.name, m.params.arguments)}); }
      catch (e) { reply({jsonrpc: "2.0", id: m.id, error: {code: -32603, message: String(e)}}); }
      finally { window.inFlight--; }
    }
  });
  document.body.append(frame);
};
</script></body></html>"""


class HostPage(http.server.BaseHTTPRequestHandler):
    hits: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        HostPage.hits.append(self.path)
        body = HOST_PAGE.encode() if self.path == "/" else b"reached"
        self.send_response(200)
        self.send_header("Content-Type", "text/html" if self.path == "/" else "text/plain")
        self.send_header("Access-Control-Allow-Origin", "*")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def host_page() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), HostPage)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@pytest.fixture(scope="module")
async def server() -> AsyncIterator[ServerProcess]:
    async with ServerProcess("streamable-http", env={"MCP_CODE_EXEC_TOKEN": TOKEN}) as running:
        yield running


def client(server: ServerProcess, *, apps: bool, http: httpx2.AsyncClient) -> Client:
    extensions = [advertise(EXTENSION_ID, {"mimeTypes": [APP_MIME_TYPE]})] if apps else []
    return Client(streamable_http_client(f"{server.url}/mcp", http_client=http), extensions=extensions)


def visibility(tool: Any) -> list[str]:
    ui = (tool.meta or {}).get("ui") or {}
    return list(ui.get("visibility") or ["model", "app"])


async def test_app_only_tools_are_listed_only_to_clients_that_declare_apps(server: ServerProcess) -> None:
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
    async with http, client(server, apps=True, http=http) as host, client(server, apps=False, http=http) as plain:
        for_host = {tool.name: visibility(tool) for tool in (await host.list_tools()).tools}
        for_plain = {tool.name: visibility(tool) for tool in (await plain.list_tools()).tools}
    assert for_host["notebook_table_page"] == for_host["notebook_figure"] == ["app"]
    assert for_host["view_session"] == ["model", "app"] and for_host["run_python"] == ["model"]
    assert "notebook_table_page" not in for_plain and "notebook_figure" not in for_plain
    assert set(for_host) - set(for_plain) == {"notebook_table_page", "notebook_figure"}
    assert "view_session" in for_plain and "view_run" in for_plain


async def test_a_stateless_run_is_viewed_as_one_cell_with_its_code_and_output(server: ServerProcess) -> None:
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
    async with http, client(server, apps=False, http=http) as plain:
        ran = (await plain.call_tool("run_python", {"code": "print('once')\n7 * 6"})).structured_content or {}
        viewed = await plain.call_tool("view_run", {"run_id": ran["run_id"]})
    cells = (viewed.structured_content or {})["cells"]
    assert [(c["code"], c["stdout"], c["result"], c["status"]) for c in cells] == [
        ("print('once')\n7 * 6", "once\n", "42", "ok")
    ]
    assert "1 cell" in viewed.content[0].text  # type: ignore[union-attr]


async def test_the_view_renders_a_session_pages_and_sorts_its_table_in_a_real_browser(
    server: ServerProcess, host_page: str
) -> None:
    from playwright.async_api import async_playwright

    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120)
    async with http, client(server, apps=True, http=http) as mcp:
        session = (await mcp.call_tool("new_session", {})).structured_content
        assert session is not None
        session_id = session["session_id"]
        answers = [await mcp.call_tool("run_python", {"code": code, "session_id": session_id}) for code in CELLS]
        drawn = png_size(base64.b64decode(answers[1].content[1].data))  # type: ignore[union-attr]
        result = await mcp.call_tool("view_session", {"session_id": session_id})
        view = result.structured_content
        assert view is not None and [cell["status"] for cell in view["cells"]] == ["ok", "ok", "ok", "error"]
        summary = result.content[0].text  # type: ignore[union-attr]
        assert "table" in summary and "120 rows" in summary and "1 figure" in summary
        read = await mcp.read_resource(VIEW_URI)
        assert read.contents[0].mime_type == APP_MIME_TYPE
        html = read.contents[0].text  # type: ignore[union-attr]
        tools = (await mcp.list_tools()).tools
        app_tools = [tool.name for tool in tools if "app" in visibility(tool)]
        called: list[str] = []

        async def mcp_call(name: str, arguments: dict[str, Any]) -> Any:
            called.append(name)
            answer = await mcp.call_tool(name, arguments)
            return answer.model_dump(mode="json", by_alias=True, exclude_none=True)

        tool_result = result.model_dump(mode="json", by_alias=True, exclude_none=True)
        await anyio.Path(ARTIFACTS).mkdir(parents=True, exist_ok=True)
        async with async_playwright() as playwright:
            browser = await playwright.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_FLAGS)
            try:
                for theme, width in (("light", 900), ("dark", 900), ("dark", 400)):
                    page = await browser.new_page(viewport={"width": width, "height": 900})
                    await page.expose_function("mcpCall", mcp_call)
                    await page.goto(host_page)
                    start = "([h, c, r, t, a]) => window.start(h, c, r, t, a)"
                    await page.evaluate(start, [html, DEFAULT_CSP, tool_result, theme, app_tools])
                    view_frame = page.frame_locator("iframe")
                    await check_view(view_frame, theme, drawn)
                    shot = ARTIFACTS / f"notebook-{theme}-{width}.png"
                    height = await page.frames[1].evaluate("Math.ceil(document.body.getBoundingClientRect().height)")
                    await page.wait_for_function(f"document.querySelector('iframe').offsetHeight === {height}")
                    await page.set_viewport_size({"width": width, "height": height})  # the whole view, composited
                    await page.screenshot(path=str(shot))
                    if width == 900 and theme == "light":
                        await check_refusal_and_csp(page, host_page, called)
                    await page.close()
            finally:
                await browser.close()
        await mcp.call_tool("close_session", {"session_id": session_id})
    assert "notebook_figure" in called and "notebook_table_page" in called and "run_python" not in called


async def check_view(frame: Any, theme: str, drawn: tuple[int, int]) -> None:
    cells = frame.locator("section.cell")
    await cells.nth(3).wait_for(timeout=30_000)
    assert await cells.count() == 4
    assert await frame.locator("html").get_attribute("data-theme") == theme
    assert "hello from the sandbox" in await cells.nth(0).inner_text()
    assert "42" in await cells.nth(0).inner_text()
    assert "ZeroDivisionError" in await cells.nth(3).inner_text()
    # The figure, loaded through the app-only tool, at the size it was drawn.
    image = cells.nth(1).locator("img")
    await cells.nth(1).locator("figure").scroll_into_view_if_needed()  # figures and tables load once in view
    await image.wait_for(timeout=30_000)
    await frame.locator("figcaption", has_text=f"{drawn[0]} × {drawn[1]} px").wait_for(timeout=30_000)
    assert await image.evaluate("img => [img.naturalWidth, img.naturalHeight]") == list(drawn)
    assert drawn[0] > 800  # a 10-inch figure at 100 dpi, cut to its tight box
    # The table: its first page, then "next" fetches rows 50-99 from the session.
    table = cells.nth(2)
    where = table.locator(".where")
    await table.locator(".table-wrap").scroll_into_view_if_needed()
    await table.locator(".where", has_text="rows 1–50 of 120").wait_for(timeout=30_000)
    first_cells = table.locator("tbody tr:first-child td")
    assert await first_cells.nth(0).inner_text() == "0"
    await table.locator("button[data-action=next]").click()
    await table.locator(".where", has_text="rows 51–100 of 120").wait_for(timeout=30_000)
    assert [await first_cells.nth(i).inner_text() for i in range(3)] == ["50", str((50 * 37) % 120), "r50"]
    assert await table.locator("tbody tr").count() == 50
    # Sorting on x, ascending then descending, from the first row.
    await table.locator('th button[title="sort on x"]').click()
    await table.locator(".where", has_text="sorted on x ↑").wait_for(timeout=30_000)
    assert await first_cells.nth(1).inner_text() == "0"
    await table.locator('th button[title="sort on x"]').click()
    await table.locator(".where", has_text="sorted on x ↓").wait_for(timeout=30_000)
    assert await first_cells.nth(1).inner_text() == "119"
    assert "rows 1–50" in await where.inner_text()


async def check_refusal_and_csp(page: Any, host_page: str, called: list[str]) -> None:
    frame = page.frames[1]
    refused = await frame.evaluate(
        """() => new Promise((resolve) => {
             addEventListener("message", (e) => { if (e.data && e.data.id === 999001) resolve(e.data.error); });
             parent.postMessage({jsonrpc: "2.0", id: 999001, method: "tools/call",
                                 params: {name: "run_python", arguments: {code: "print(1)"}}}, "*");
           })"""
    )
    assert refused is not None and "refused" in refused["message"]
    assert "run_python" in await page.evaluate("window.refusals") and "run_python" not in called
    HostPage.hits.clear()
    fetched = await frame.evaluate(
        "(url) => fetch(url).then(() => 'fetched', (e) => 'blocked: ' + e.message)", f"{host_page}/exfiltrate"
    )
    assert fetched.startswith("blocked") and HostPage.hits == []
    assert json.dumps(fetched)  # what the browser said, for the log when it fails
