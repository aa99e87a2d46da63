"""The notebook view in Chromium against a history its own session forged
(docs/security.md#hostile-histories), through the host page of ``test_notebook_view``.

The session draws a figure and shows a table whose 50-row pages are cut at 64 KiB; then it rewrites
its history: that run and 199 forged ones naming 50 figures and 8 tables each (an unbounded view
sent 9,950 figure and 1,592 table calls within about two seconds), with a hard-linked figure, one that
is not an image (refused by the host) and one with a PNG's header and junk after it (which only the
browser can tell). The view is shown in a 900-pixel frame: it may only load what is scrolled into view,
at most four calls at once, and every figure must end loaded or in an error state.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx2
import pytest
from _support import ServerProcess
from test_notebook_view import ARTIFACTS, CHROMIUM_FLAGS, DEFAULT_CSP, TOKEN, VIEW_URI, client, host_page, visibility

pytestmark = [pytest.mark.anyio, pytest.mark.skipif(shutil.which("chromium") is None, reason="needs chromium")]
__all__ = ["host_page"]  # the host page's fixture, shared with test_notebook_view
MAX_IN_FLIGHT = 4
FORGED = 199
FIRST = (
    "import matplotlib.pyplot as plt, pandas as pd\n"
    "plt.plot([1, 3, 2])\n"
    "plt.show()\n"
    "pd.DataFrame({'i': range(120), 'wide': ['w' * 1000] * 120, 'more': ['m' * 500] * 120})"
)
FORGE = (
    f"count = {FORGED}\n"
    + """
import json, os, shutil, threading
h = '/mnt/data/.mcpx/history'
lines = open(f'{h}/runs.jsonl', 'rb').read().splitlines()[:1]
table = json.loads(lines[0])['tables'][0]
shutil.copy(f'{h}/img-1-0.png', f'{h}/img-1000-0.png')
os.link(f'{h}/img-1000-0.png', f'{h}/img-1000-1.png')
open(f'{h}/img-1001-0.png', 'wb').write(b'not an image' * 100)
open(f'{h}/img-1001-1.png', 'wb').write(open(f'{h}/img-1-0.png', 'rb').read()[:33] + b'junk' * 1000)
images = [{'file': f'img-0-{k}.png'} for k in range(50)]
for n in range(1000, 1000 + count):
    run = {'kind': 'run', 'n': n, 'code': f'# forged {n}', 'status': 'ok', 'duration_ms': 1,
           'images': images, 'tables': [table] * 8}
    lines.append(json.dumps(run).encode())
open('/mnt/data/forged.jsonl', 'wb').write(b'\\n'.join(lines) + b'\\n')
threading.Timer(2.0, os.replace, ('/mnt/data/forged.jsonl', f'{h}/runs.jsonl')).start()
"""
)


@pytest.fixture(scope="module")
async def server() -> AsyncIterator[ServerProcess]:
    async with ServerProcess("streamable-http", env={"MCP_CODE_EXEC_TOKEN": TOKEN}) as running:
        yield running


async def forged_view(mcp: Any, session_id: str) -> Any:
    ran = await mcp.call_tool("run_python", {"code": FIRST, "session_id": session_id})
    assert (ran.structured_content or {}).get("status") == "ok", ran
    await mcp.call_tool("view_session", {"session_id": session_id})  # run 1 is written first
    ran = await mcp.call_tool("run_python", {"code": FORGE, "session_id": session_id})
    assert (ran.structured_content or {}).get("status") == "ok", ran
    with anyio.fail_after(60):
        while True:
            result = await mcp.call_tool("view_session", {"session_id": session_id})
            if len((result.structured_content or {}).get("cells", [])) == 1 + FORGED:
                return result
            await anyio.sleep(0.2)  # pacing of the poll: the sandbox's timer moves the forged history in


async def test_a_forged_history_loads_lazily_a_few_calls_at_a_time_and_every_figure_ends_shown_or_refused(
    server: ServerProcess, host_page: str
) -> None:
    from playwright.async_api import async_playwright

    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120)
    async with http, client(server, apps=True, http=http) as mcp:
        session_id = (await mcp.call_tool("new_session", {})).structured_content["session_id"]
        result = await forged_view(mcp, session_id)
        html = (await mcp.read_resource(VIEW_URI)).contents[0].text  # type: ignore[union-attr]
        app_tools = [tool.name for tool in (await mcp.list_tools()).tools if "app" in visibility(tool)]

        async def mcp_call(name: str, arguments: dict[str, Any]) -> Any:
            answer = await mcp.call_tool(name, arguments)
            return answer.model_dump(mode="json", by_alias=True, exclude_none=True)

        tool_result = result.model_dump(mode="json", by_alias=True, exclude_none=True)
        async with async_playwright() as playwright:
            browser = await playwright.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_FLAGS)
            try:
                page = await browser.new_page(viewport={"width": 900, "height": 900})
                await page.expose_function("mcpCall", mcp_call)
                await page.goto(host_page)
                await page.evaluate("window.callBudget = 300")  # what an eager view sends past it is not sent on
                start = "([h, c, r, t, a, f]) => window.start(h, c, r, t, a, f)"
                await page.evaluate(start, [html, DEFAULT_CSP, tool_result, "light", app_tools, 900])
                await check_only_what_is_in_view_loads(page)
                await check_refused_figures_show_an_error(page)
                await anyio.Path(ARTIFACTS).mkdir(parents=True, exist_ok=True)
                await page.screenshot(path=str(ARTIFACTS / "notebook-hostile.png"))  # for a person to look at
                await check_the_cut_pages_show_every_row(page)
                await check_the_last_cell_loads_when_scrolled_to(page)
            finally:
                await browser.close()
        await mcp.call_tool("close_session", {"session_id": session_id})


async def calls(page: Any) -> list[tuple[str, dict[str, Any]]]:
    await page.wait_for_function("window.inFlight === 0", timeout=30_000)
    return [(name, args) for name, args in await page.evaluate("window.calls")]


async def check_only_what_is_in_view_loads(page: Any) -> None:
    frame = page.frame_locator("iframe")
    await frame.locator("section[data-cell='1'] .where", has_text="rows 1–").wait_for(timeout=30_000)
    assert await page.evaluate("window.maxInFlight") <= MAX_IN_FLIGHT  # (an eager view: its whole budget at once)
    await frame.locator("section[data-cell='1'] figcaption", has_text=" px").wait_for(timeout=30_000)
    made = await calls(page)
    cells = {args["cell"] for name, args in made if name == "notebook_figure"}
    print(f"\nin view: {len(made)} calls, {await page.evaluate('window.maxInFlight')} at most in flight")
    assert await page.evaluate("window.maxInFlight") <= MAX_IN_FLIGHT
    assert len(made) <= 12 and cells <= {1, 1000}, made


async def check_refused_figures_show_an_error(page: Any) -> None:
    frame = page.frame_locator("iframe")
    for cell, index, why in ((1000, 0, "hard-linked"), (1000, 1, "hard-linked"), (1001, 0, "not a image/png"),
                             (1001, 1, "not an image")):  # fmt: skip
        figure = frame.locator(f"section[data-cell='{cell}'] figure").nth(index)
        await figure.scroll_into_view_if_needed()
        caption = figure.locator("figcaption", has_text="figure unavailable")
        await caption.wait_for(timeout=30_000)
        assert why in await caption.inner_text()
    assert await page.evaluate("window.maxInFlight") <= MAX_IN_FLIGHT


async def check_the_cut_pages_show_every_row(page: Any) -> None:
    table = page.frame_locator("iframe").locator("section[data-cell='1'] .table-wrap")
    await table.scroll_into_view_if_needed()
    seen: list[int] = []
    wheres: list[str] = []
    while True:
        wheres.append(await table.locator(".where").inner_text())
        seen += [int(text) for text in await table.locator("tbody tr td:nth-child(2)").all_inner_texts()]
        if await table.locator("button[data-action=next]").is_disabled():
            break
        await table.locator("button[data-action=next]").click()
        await table.locator(".where", has_text=f"rows {len(seen) + 1}–").wait_for(timeout=30_000)
    assert seen == list(range(120)), json.dumps(wheres, ensure_ascii=False)
    # Pages cut at 64 KiB (rows of about 1.5 KB): fewer than 50 rows each, so three pages.
    assert "page cut at its size cap" in wheres[0] and len(wheres) == 3, wheres
    await table.locator("button[data-action=prev]").click()
    await table.locator(".where", has_text=wheres[-2]).wait_for(timeout=30_000)


async def check_the_last_cell_loads_when_scrolled_to(page: Any) -> None:
    from playwright.async_api import TimeoutError as PlaywrightTimeout

    last = page.frame_locator("iframe").locator(f"section[data-cell='{999 + FORGED}'] .table-wrap").last
    loaded = last.locator(".where", has_text="rows 1–")
    for _ in range(10):  # what loads above it moves it (tables fill in, failed figures shrink)
        await last.scroll_into_view_if_needed()
        try:
            await loaded.wait_for(timeout=5_000)
            break
        except PlaywrightTimeout:
            continue
    made = await calls(page)
    print(f"after scrolling to the end: {len(made)} calls, {await page.evaluate('window.maxInFlight')} at most")
    assert await loaded.count() == 1
    assert await page.evaluate("window.maxInFlight") <= MAX_IN_FLIGHT
    assert len(made) < 100  # an eager view made 11,542
