"""A session's /mnt/data lives on the host disk, so it has a quota of bytes and entries.

The agent's count gives the messages here, whoever enforces the limit (``limits.session_disk``):
each case runs with the filesystem as the limit and with the count alone. The floods past twice
the quota are the count's own defence (with the filesystem as the limit, no flood gets past about
the quota: ``test_session_disk.py``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager

import pytest
from _support import make_test_config

from mcp_code_exec.errors import FileOperationError
from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio
OWNER = "quota"


def quota_service(session_disk: str) -> AbstractAsyncContextManager[SandboxService]:
    limits = {"session_data_mb": 16, "session_max_files": 50, "session_disk": session_disk}
    return SandboxService.start(make_test_config(limits=limits, pool={"size": 1, "session_spares": 1}))


@pytest.fixture(scope="module", params=["filesystem", "agent"])
async def small_quota(request: pytest.FixtureRequest) -> AsyncIterator[SandboxService]:
    async with quota_service(request.param) as service:
        yield service


@pytest.fixture(scope="module")
async def counted_only() -> AsyncIterator[SandboxService]:
    async with quota_service("agent") as service:
        yield service


async def test_a_run_that_fills_the_quota_is_stopped_and_the_session_keeps_working(small_quota: SandboxService) -> None:
    service = small_quota
    sid = (await service.new_session(OWNER)).session_id
    try:
        await service.run(OWNER, "keep = 'me'", session_id=sid)
        # 24 MiB, one and a half times the quota (past twice it, the run's files would be removed).
        filler = "import time\nfor i in range(24):\n    open(f'blob{i}', 'wb').write(b'x' * 2**20)\ntime.sleep(30)"
        stopped = await service.run(OWNER, filler, session_id=sid, timeout=60)
        assert stopped.status == "error"
        assert stopped.error is not None and stopped.error.type == "DiskQuotaExceeded"
        assert "Delete files" in stopped.error.message
        after = await service.run(OWNER, "print(keep)", session_id=sid)
        assert after.status == "ok" and after.stdout == "me\n"
        with pytest.raises(FileOperationError, match="nothing was written"):
            await service.write_file(OWNER, sid, "more.bin", b"y" * 2**20)
        cleaned = await service.run(OWNER, "import glob, os\nfor f in glob.glob('blob*'): os.remove(f)", session_id=sid)
        assert cleaned.status == "ok"
        await service.write_file(OWNER, sid, "more.bin", b"y" * 2**20)
    finally:
        await service.close_session(OWNER, sid)


async def test_too_many_files_in_a_session_is_an_error_that_names_the_quota(small_quota: SandboxService) -> None:
    service = small_quota
    sid = (await service.new_session(OWNER)).session_id
    try:
        result = await service.run(OWNER, "for i in range(200): open(f'f{i}', 'w').close()", session_id=sid)
        assert result.status == "error"
        assert result.error is not None and result.error.type == "DiskQuotaExceeded"
        assert "50 entries" in result.error.message
        assert (await service.run(OWNER, "print(1)", session_id=sid)).stdout == "1\n"
    finally:
        await service.close_session(OWNER, sid)


# Each run below hides 24 MiB (one and a half times the quota) from a plain walk of the tree, then
# keeps going long enough for the checks made while it runs.
HOLDER = (
    "import os, time\nf = open('/mnt/data/gone', 'wb'); f.write(os.urandom(2**20) * 24); f.flush()\n"
    "os.unlink('/mnt/data/gone'); open('/mnt/data/held', 'w').close(); time.sleep(600)"
)
HIDDEN = {
    "an-unreadable-directory": "os.makedirs('h'); fill('h/blob'); os.chmod('h', 0)",
    "a-path-past-PATH_MAX": (
        "os.chdir('/mnt/data')\nfor _ in range(18):\n    os.mkdir('d' * 250); os.chdir('d' * 250)\n"
        "fill('blob'); os.chdir('/mnt/data')"
    ),
    "a-deleted-file-held-open-by-a-background-process": (
        f"subprocess.Popen([sys.executable, '-c', {HOLDER!r}], start_new_session=True)\n"
        "while not os.path.exists('held'): time.sleep(0.01)"
    ),
}
PRELUDE = (
    "import os, subprocess, sys, time\n"
    "def fill(path):\n    with open(path, 'wb') as f: f.write(os.urandom(2**20) * 24)\n"
)


@pytest.mark.parametrize("hiding", list(HIDDEN.values()), ids=list(HIDDEN))
async def test_usage_hidden_from_a_walk_of_the_tree_still_counts(small_quota: SandboxService, hiding: str) -> None:
    service = small_quota
    sid = (await service.new_session(OWNER)).session_id
    try:
        result = await service.run(OWNER, PRELUDE + hiding + "\ntime.sleep(30)", session_id=sid, timeout=60)
        assert result.status == "error", result
        assert result.error is not None and result.error.type == "DiskQuotaExceeded"
        assert "MiB in" in result.error.message
    finally:
        await service.close_session(OWNER, sid)


async def test_a_process_that_hides_its_open_files_counts_as_over_the_quota(small_quota: SandboxService) -> None:
    service = small_quota
    sid = (await service.new_session(OWNER)).session_id
    hide = (
        "import ctypes, time\nctypes.CDLL(None).prctl(4, 0)  # PR_SET_DUMPABLE 0: nobody may look\n"
        "open('/mnt/data/hidden', 'w').close(); time.sleep(600)"
    )
    code = PRELUDE + f"subprocess.Popen([sys.executable, '-c', {hide!r}], start_new_session=True)\n"
    code += "while not os.path.exists('hidden'): time.sleep(0.01)\ntime.sleep(30)"
    try:
        result = await service.run(OWNER, code, session_id=sid, timeout=60)
        assert result.error is not None and result.error.type == "DiskQuotaExceeded", result
        assert "cannot be measured" in result.error.message and "undumpable" in result.error.message
    finally:
        await service.close_session(OWNER, sid)


async def test_a_process_undumpable_for_a_moment_does_not_count_as_over_the_quota(small_quota: SandboxService) -> None:
    """As every worker is while it takes its uid, and as a loaded machine stretched that moment (the
    spare an export orders was still taking its uid when the export's quota was checked): a process
    undumpable for 0.4 s while the run's usage is counted is looked at again until it can be, and
    the run is not over its quota."""
    service = small_quota
    sid = (await service.new_session(OWNER)).session_id
    moment = (
        "import ctypes, time\nlibc = ctypes.CDLL(None)\nlibc.prctl(4, 0)\n"
        "open('/mnt/data/hidden', 'w').close(); time.sleep(0.4); libc.prctl(4, 1); time.sleep(60)"
    )
    code = PRELUDE + f"subprocess.Popen([sys.executable, '-c', {moment!r}], start_new_session=True)\n"
    code += "while not os.path.exists('hidden'): time.sleep(0.01)\nopen('visible', 'w').write('a file changed')"
    try:
        result = await service.run(OWNER, code, session_id=sid, timeout=60)
        assert result.status == "ok", (result.error, result.stderr)
    finally:
        await service.close_session(OWNER, sid)


async def test_bytes_a_run_puts_in_the_agents_own_directories_count_when_it_changes_a_file(
    counted_only: SandboxService,
) -> None:
    # The run ends before the quota is checked during it: only the check after it sees the bytes,
    # which walks the snapshot's and history's directories only when the user's files changed.
    sid = (await counted_only.new_session(OWNER)).session_id
    code = (
        "import os\nos.makedirs('/mnt/data/.mcpx/history', exist_ok=True)\n"
        "open('/mnt/data/.mcpx/history/mine.bin', 'wb').write(os.urandom(2**20) * 20)\n"
        "open('/mnt/data/touched.txt', 'w').write('x')"
    )
    try:
        result = await counted_only.run(OWNER, code, session_id=sid, timeout=60)
        assert result.error is not None and result.error.type == "DiskQuotaExceeded", result
        assert "MiB in" in result.error.message
    finally:
        await counted_only.close_session(OWNER, sid)


async def test_a_flood_past_twice_the_quota_loses_what_the_run_wrote_and_keeps_older_files(
    counted_only: SandboxService,
) -> None:
    service = counted_only
    sid = (await service.new_session(OWNER)).session_id
    # fallocate takes a gigabyte in microseconds, faster than any check interval.
    flood = (
        "import os, time\nfor i in range(4):\n    fd = os.open(f'big{i}', os.O_CREAT | os.O_WRONLY)\n"
        "    os.posix_fallocate(fd, 0, 60 * 2**20); os.close(fd)\ntime.sleep(30)"
    )
    measure = "import os\nnames = sorted(set(os.listdir()) - {'.mcpx'})\nnames, sum(os.stat(n).st_blocks for n in names) * 512"
    try:
        await service.write_file(OWNER, sid, "keep.txt", b"older work")
        result = await service.run(OWNER, flood, session_id=sid, timeout=60)
        assert result.error is not None and result.error.type == "DiskQuotaExceeded", result
        assert result.session_restarted
        assert any("2 times the session's disk quota" in note and "big0" in note for note in result.notes)
        left = await service.run(OWNER, measure, session_id=sid)
        assert left.session_restarted is False, left  # the flooding run said so; this one is not told again
        assert left.result is not None and left.result.startswith("(['keep.txt'], ")
        assert int(left.result.rsplit(" ", 1)[1].rstrip(")")) < 2**20
    finally:
        await service.close_session(OWNER, sid)


async def test_a_flood_that_puts_back_a_files_size_and_mtime_is_still_shed(counted_only: SandboxService) -> None:
    service = counted_only
    sid = (await service.new_session(OWNER)).session_id
    sparse = "import os\nwith open('sparse', 'wb') as f: f.truncate(64 * 2**20)\nos.utime('sparse', (1, 1))"
    # Filled in place, its size and mtime put back: a snapshot would call it untouched.
    fill = (
        "import os, time\nfd = os.open('sparse', os.O_WRONLY)\nos.posix_fallocate(fd, 0, 64 * 2**20); os.close(fd)\n"
        "os.utime('sparse', (1, 1))\ntime.sleep(30)"
    )
    try:
        assert (await service.run(OWNER, sparse, session_id=sid)).status == "ok"
        result = await service.run(OWNER, fill, session_id=sid, timeout=60)
        assert result.error is not None and result.error.type == "DiskQuotaExceeded", result
        assert any("sparse" in note for note in result.notes), result.notes
        left = await service.run(OWNER, "import os\nsorted(set(os.listdir()) - {'.mcpx'})", session_id=sid)
        assert left.result == "[]"
    finally:
        await service.close_session(OWNER, sid)


async def test_bytes_hidden_in_the_agents_own_directory_count_where_the_count_is_the_only_limit() -> None:
    # 200 MiB under /mnt/data/.mcpx against a 64 MiB quota, no visible file touched, in microseconds
    # (fallocate: no check made during the run sees it): the check after the run must count them.
    hide = (
        "import os\nos.makedirs('/mnt/data/.mcpx/mine', exist_ok=True)\n"
        "fd = os.open('/mnt/data/.mcpx/mine/held.bin', os.O_CREAT | os.O_WRONLY)\n"
        "os.posix_fallocate(fd, 0, 200 * 2**20); os.close(fd)"
    )
    limits = {"session_data_mb": 64, "session_max_files": 500, "session_disk": "agent"}
    config = make_test_config(limits=limits, pool={"size": 1, "session_spares": 0})
    async with SandboxService.start(config) as service:
        sid = (await service.new_session(OWNER)).session_id
        result = await service.run(OWNER, hide, session_id=sid, timeout=60)
        assert result.error is not None and result.error.type == "DiskQuotaExceeded", result
        assert any("held.bin" in note for note in result.notes), result.notes  # shed as a flood, like any file
        left = await service.run(OWNER, "import os\nos.path.exists('/mnt/data/.mcpx/mine/held.bin')", session_id=sid)
        assert left.result == "False", left
