"""A session's /mnt/data lives on the host disk, so it has a quota of bytes and entries."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from _support import make_test_config

from mcp_code_exec.errors import FileOperationError
from mcp_code_exec.service import SandboxService

pytestmark = pytest.mark.anyio
OWNER = "quota"


@pytest.fixture(scope="module")
async def small_quota() -> AsyncIterator[SandboxService]:
    config = make_test_config(
        limits={"session_data_mb": 16, "session_max_files": 50}, pool={"size": 1, "session_spares": 1}
    )
    async with SandboxService.start(config) as service:
        yield service


async def test_a_run_that_fills_the_quota_is_stopped_and_the_session_keeps_working(small_quota: SandboxService) -> None:
    service = small_quota
    sid = (await service.new_session(OWNER)).session_id
    try:
        await service.run(OWNER, "keep = 'me'", session_id=sid)
        filler = "import itertools\nfor i in itertools.count():\n    open(f'blob{i}', 'wb').write(b'x' * 2**20)"
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
