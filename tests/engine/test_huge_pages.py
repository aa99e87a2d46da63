"""The zygote's heap sits on huge pages where the kernel can collapse them (fewer page-table
entries for every fork to copy and every worker's exit to tear down; see ``mcpx_agent.zygote.hugepages``)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import anyio
import docker
import pytest

from mcp_code_exec.sandbox.ownership import SANDBOX_UIDS
from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio
OWNER = "huge-pages"
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def kernel_collapses() -> bool:
    """MADV_COLLAPSE (Linux 6.1) and transparent huge pages not switched off."""
    found = re.match(r"(\d+)\.(\d+)", os.uname().release)
    if found is None or (int(found[1]), int(found[2])) < (6, 1):
        return False
    return THP.exists() and "[never]" not in THP.read_text()


def full_zygote_huge_kib(container_id: str) -> int:
    """AnonHugePages of the container's full zygote: of the two (their real uid is the sandbox uid
    + 1, an odd one), the one with the larger heap. The lean one's heap (see
    ``mcpx_agent.zygote.lean``) is too small and scattered for whole 2 MiB ranges."""
    client = docker.from_env()
    try:
        top = client.containers.get(container_id).top(ps_args="-eo pid,ruid")
    finally:
        client.close()
    zygotes = [pid for pid, ruid in top["Processes"] if int(ruid) % 2 and int(ruid) - 1 in SANDBOX_UIDS]
    assert len(zygotes) == 2, top
    rollups = [Path(f"/proc/{pid}/smaps_rollup").read_text() for pid in zygotes]
    full = max(rollups, key=lambda rollup: kib(rollup, "Anonymous"))
    return kib(full, "AnonHugePages")


def kib(rollup: str, field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+) kB", rollup, re.MULTILINE)[1])  # type: ignore[index]


async def test_the_zygotes_heap_is_on_huge_pages_where_the_kernel_can(service: SandboxService) -> None:
    if not kernel_collapses() or service.config.runtime not in (None, "runc"):
        pytest.skip("the kernel cannot collapse huge pages here (Linux 6.1+, THP not 'never', runc)")
    result = await service.run(OWNER, "print(6 * 7)")  # a run has forked the zygote since it collapsed
    assert result.stdout == "42\n"
    container_id = sorted(service.stateless_pool.container_ids())[0]
    huge = await anyio.to_thread.run_sync(full_zygote_huge_kib, container_id)
    assert huge >= 2048, f"the zygote has {huge} KiB on huge pages"
