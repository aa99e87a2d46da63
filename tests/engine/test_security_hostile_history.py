"""A session's own history, rewritten by its code, viewed in a loop: other clients never wait on it,
and the server does not grow; figures a session forged in its history are refused when they would make
the view read more than the session holds, or are not images (docs/security.md#hostile-histories).

The real server runs as a subprocess over streamable HTTP with two tokens. Mallory's session writes a
history of more than a million one-line runs (about 16 MiB) into its own history file, then views
it again and again, several views at once; meanwhile Alice runs ``print(1)`` in her own session in a
loop. Alice's slowest call is held against a bound (``STALL_BOUND_S``, or a multiple of her slowest
call before the views, whichever is larger): a bound far above a run's round trip (tens of
milliseconds) and far below what one unbounded view blocked every client for (14-16 s), so that a
busy machine does not fail it while an event loop held for seconds does. The server's peak resident
memory (``VmHWM`` in ``/proc/PID/status``) is read before and after the views.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from _security import OWNER, runsc_available
from _support import ServerProcess, client_with_token, make_test_config, png_size, structured_call

from mcp_code_exec.errors import FileOperationError, QuotaExceeded
from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio
TOKENS = {"mallory": "mallory-token-8c1d", "alice": "alice-token-40be"}
CONFIG = """
image = "{image}"
[limits]
memory_mb = 512
default_timeout_s = 60
max_run_s = 120
[pool]
size = 1
session_spares = 1
[sessions]
max_sessions = 6
durable = false
[http.tokens]
mallory = "{mallory}"
alice = "{alice}"
"""
HISTORY = ".mcpx/history/runs.jsonl"
LINES = 1_150_000
LINE = b'{"kind":"run"}\n'
# Written in place a moment after the run ends: the run's own history line is written first (once
# the session is idle), so what the view reads is the forged file alone.
FORGE = (
    "import os, threading\n"
    "os.makedirs('/mnt/data/.mcpx/history', exist_ok=True)\n"
    "with open('/mnt/data/forged.jsonl', 'wb') as out:\n"
    "    out.write({line!r} * {lines})\n"
    "threading.Timer(2.0, os.replace, ('/mnt/data/forged.jsonl', '/mnt/data/{history}')).start()\n"
)
VIEWS = 6  # three rounds of two views at once
STALL_BOUND_S = 2.0
GROWTH_BOUND_MIB = 160


@pytest.fixture(scope="module")
async def server(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ServerProcess]:
    path = tmp_path_factory.mktemp("hostile-history") / "config.toml"
    path.write_text(CONFIG.format(image=make_test_config().image, **TOKENS))
    async with ServerProcess("streamable-http", args=["--config", str(path)]) as running:
        yield running


def memory_kib(pid: int) -> dict[str, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    return {key: int(value) for key, value in re.findall(r"^(VmRSS|VmHWM):\s+(\d+) kB", status, re.M)}


async def history_size(client: Any, session_id: str) -> int:
    """The forged history's size, from the read cap's refusal (nothing else tells a .mcpx file's size)."""
    answer = await client.call_tool("read_file", {"session_id": session_id, "path": HISTORY})
    found = re.search(r"(\d+) bytes is over", str(answer.content[0].text))
    return int(found[1]) if found else 0


async def forge_history(client: Any, session_id: str) -> None:
    forge = FORGE.format(line=LINE, lines=LINES, history=HISTORY)
    assert (await structured_call(client, "run_python", code=forge, session_id=session_id))["status"] == "ok"
    with anyio.fail_after(60):
        while await history_size(client, session_id) != len(LINE) * LINES:  # noqa: ASYNC110 - a file the sandbox moves
            await anyio.sleep(0.2)  # pacing of the poll: the sandbox's timer moves the file in


async def timed_runs(client: Any, session_id: str, count: int) -> list[float]:
    took = []
    for _ in range(count):
        start = time.monotonic()
        ran = await structured_call(client, "run_python", code="print(1)", session_id=session_id)
        took.append(time.monotonic() - start)
        assert ran["stdout"] == "1\n", ran
    return took


async def views_beside_runs(
    viewer: Any, viewed_id: str, runner: Any, run_id: str
) -> tuple[list[dict[str, Any]], list[float], list[float]]:
    """``VIEWS`` views, two at a time, while ``runner`` runs ``print(1)`` in a loop: the views, their
    times, and the runs' times."""
    viewed: list[dict[str, Any]] = []
    view_times: list[float] = []
    during: list[float] = []
    done = anyio.Event()

    async def runs() -> None:
        while not done.is_set():
            during.extend(await timed_runs(runner, run_id, 1))

    async def view() -> None:
        start = time.monotonic()
        result = await viewer.call_tool("view_session", {"session_id": viewed_id})
        view_times.append(time.monotonic() - start)
        viewed.append(dict(result.structured_content or {}))

    with anyio.fail_after(600):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(runs)
            for _ in range(VIEWS // 2):
                async with anyio.create_task_group() as views:
                    views.start_soon(view)
                    views.start_soon(view)
            done.set()
    return viewed, view_times, during


async def test_a_history_of_a_million_runs_viewed_in_a_loop_stalls_no_client_and_keeps_the_server_small(
    server: ServerProcess,
) -> None:
    pid = server.process.pid
    async with (
        client_with_token(server, TOKENS["mallory"]) as mallory,
        client_with_token(server, TOKENS["alice"]) as alice,
    ):
        hers = (await structured_call(alice, "new_session"))["session_id"]
        his = (await structured_call(mallory, "new_session"))["session_id"]
        await forge_history(mallory, his)
        baseline = await timed_runs(alice, hers, 20)
        before = memory_kib(pid)
        viewed, view_times, during = await views_beside_runs(mallory, his, alice, hers)
        after = memory_kib(pid)
        await structured_call(mallory, "close_session", session_id=his)
        await structured_call(alice, "close_session", session_id=hers)
    grown_mib = (after["VmHWM"] - before["VmHWM"]) / 1024
    bound = max(STALL_BOUND_S, 5 * max(baseline))
    print(
        f"\nviews: {', '.join(f'{t:.2f}' for t in view_times)} s; alice's print(1): baseline max "
        f"{max(baseline) * 1000:.0f} ms, during the views max {max(during) * 1000:.0f} ms over {len(during)} calls; "
        f"server VmHWM {before['VmHWM'] / 1024:.0f} -> {after['VmHWM'] / 1024:.0f} MiB (+{grown_mib:.0f}), "
        f"VmRSS {before['VmRSS'] / 1024:.0f} -> {after['VmRSS'] / 1024:.0f} MiB"
    )
    assert len(viewed) == VIEWS and all(len(v.get("cells", [])) <= 200 for v in viewed)
    assert during, "alice made no call while the views ran"
    assert max(during) < bound, f"alice waited {max(during):.1f} s behind another identity's views"
    assert grown_mib < GROWTH_BOUND_MIB, f"the server grew by {grown_mib:.0f} MiB viewing a hostile history"


# -- figures that would amplify what the view reads ------------------------------------------------------
DRAW = "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()"
# Run 1 drew img-1-0.png. Then: a hard link of it (both names refused), a sparse file that starts as
# that PNG (1 MiB claimed, a few blocks held), and bytes that are not an image under an image's name.
FORGE_FIGURES = (
    "import os\n"
    "h = '/mnt/data/.mcpx/history'\n"
    "os.link(f'{h}/img-1-0.png', f'{h}/img-1-1.png')\n"
    "head = open(f'{h}/img-1-0.png', 'rb').read()[:4096]\n"
    "with open(f'{h}/img-1-2.png', 'wb') as out:\n"
    "    out.write(head)\n"
    "    out.truncate(1 << 20)\n"
    "open(f'{h}/img-1-3.png', 'wb').write(b'not an image' * 1000)\n"
)


@pytest.fixture(params=["runc", "runsc"])
async def figures_service(request: pytest.FixtureRequest, service: SandboxService) -> AsyncIterator[SandboxService]:
    if request.param == "runc":
        yield service
        return
    if not runsc_available():
        pytest.skip("gVisor is not installed: `docker info` lists no runsc runtime")
    # (The export's fresh interpreter loads nbformat: past 256 MiB under gVisor, which then ends the sandbox.)
    settings = make_test_config(runtime="runsc", limits={"memory_mb": 1024}, pool={"size": 1, "session_spares": 1})
    async with SandboxService.start(settings) as gvisor:
        yield gvisor


async def test_hard_linked_sparse_and_non_image_history_figures_are_refused_and_a_drawn_one_served(
    figures_service: SandboxService,
) -> None:
    service = figures_service
    sid = (await service.new_session(OWNER)).session_id
    try:
        assert (await service.run(OWNER, DRAW, session_id=sid)).status == "ok"
        await service.notebook.session_view(OWNER, sid)  # the history (and run 1's image) is written first
        assert (await service.run(OWNER, FORGE_FIGURES, session_id=sid)).status == "ok"
        assert (await service.run(OWNER, DRAW, session_id=sid)).status == "ok"  # run 3: a figure of its own
        view = await service.notebook.session_view(OWNER, sid)
        refusals = []
        for index in range(4):
            try:
                await service.notebook.figure(OWNER, sid, 1, index, 1 << 21)
            except FileOperationError as exc:
                refusals.append(str(exc))
            else:
                refusals.append("served")
        data, mime = await service.notebook.figure(OWNER, sid, 3, 0, 1 << 21)
        try:
            exported = await service.export_notebook(OWNER, sid, "out.ipynb")
        except QuotaExceeded:  # the spare the export orders may still be taking its uid (quota.HIDDEN_RETRIES)
            exported = await service.export_notebook(OWNER, sid, "out.ipynb")
        notebook = json.loads((await service.read_file(OWNER, sid, exported.path)).data)
    finally:
        await service.close_session(OWNER, sid)
    assert [cell.n for cell in view.cells] == [1, 2, 3] and len(view.cells[2].figures) == 1
    assert all("hard-linked or sparse" in why for why in refusals[:2]), refusals
    # gVisor reports a sparse file's blocks as its whole size: its quota counts them all, so there the
    # sparse file is no amplification, and it is served.
    assert "hard-linked or sparse" in refusals[2] or (service.config.runtime == "runsc" and refusals[2] == "served")
    assert "not a image/png image" in refusals[3], refusals
    assert mime == "image/png" and png_size(data)[0] > 100
    images = [[o for o in cell["outputs"] if "image/png" in o.get("data", {})] for cell in notebook["cells"]]
    assert [len(found) for found in images] == [0, 0, 1]  # the hard-linked one is left out of the export too
