"""What the server keeps per session and per finished run stays bounded, whatever the runs do.

A run may change thousands of files with long names; the result names at most a hundred (and
counts the rest), the session remembers a bounded number of its files, and every kept result
weighs all it holds against ``runs.max_kept_mb``.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import AsyncIterator

import anyio
import pytest
from _security import OWNER
from _support import make_test_config

from mcp_code_exec.mcp_server.answers import render_run
from mcp_code_exec.service import SandboxService
from mcp_code_exec.service.outcomes import RESULT_FILES_MAX
from mcp_code_exec.service.sessions import KNOWN_FILES_MAX

pytestmark = pytest.mark.anyio

FILES = 2000
RUNS = 8
# Each run removes the last one's tree and makes 2000 empty files under a new one, each path
# about 960 bytes long: within every quota (files, bytes, path length).
NEW_TREE = (
    "import os, shutil\n"
    "for old in os.listdir('.'):\n"
    "    shutil.rmtree(old)\n"
    "top = os.path.join('{tag}' + 'd' * 240, 'e' * 250, 'f' * 250)\n"
    "os.makedirs(top)\n"
    "for n in range({files}):\n"
    "    open(os.path.join(top, 'g' * 200 + str(n)), 'w').close()\n"
)
KEPT_MB = 4


@pytest.fixture(scope="module")
async def tight() -> AsyncIterator[SandboxService]:
    config = make_test_config(runs={"max_kept_mb": KEPT_MB}, pool={"size": 1, "session_spares": 0})
    async with SandboxService.start(config) as service:
        yield service


async def test_runs_that_change_thousands_of_long_named_files_keep_server_memory_bounded(
    tight: SandboxService,
) -> None:
    session = await tight.new_session(OWNER)
    sid = session.session_id
    try:
        warm = await tight.run(OWNER, NEW_TREE.format(tag="warm", files=FILES), session_id=sid)
        assert warm.status == "ok", warm
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for run in range(RUNS):
                with anyio.fail_after(120):
                    result = await tight.run(OWNER, NEW_TREE.format(tag=run, files=FILES), session_id=sid)
                assert result.status == "ok", result
            tight.run_registry.get(result.run_id or "", OWNER)  # a look at the registry settles its books
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        held = tight.sessions.get(sid, OWNER).known_files
    finally:
        await tight.close_session(OWNER, sid)
    # What stays: kept results within max_kept_mb, and the session's remembered files (500 of
    # about 3 KB each); unbounded, the eight runs held over 100 MiB.
    assert grown < (KEPT_MB + 8) << 20, f"the server grew by {grown / (1 << 20):.1f} MiB"
    assert len(held) <= KNOWN_FILES_MAX
    assert tight.run_registry.kept_bytes <= KEPT_MB << 20


async def test_a_result_names_a_hundred_changed_files_and_counts_the_rest(tight: SandboxService) -> None:
    session = await tight.new_session(OWNER)
    try:
        result = await tight.run(OWNER, NEW_TREE.format(tag="x", files=FILES), session_id=session.session_id)
    finally:
        await tight.close_session(OWNER, session.session_id)
    assert result.status == "ok", result
    assert len(result.files) == RESULT_FILES_MAX
    assert result.files_omitted == FILES - RESULT_FILES_MAX
    assert f"... and {FILES - RESULT_FILES_MAX} more (list_files shows them all)" in render_run(result)
