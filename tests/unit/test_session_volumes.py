"""Session volumes over the in-memory engine: who enforces the quota, and that a sized volume's
filesystem goes with it, through failures and sweeps."""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from _fake_agent import FakeAgent

from mcp_code_exec.commands.doctor import Report, _probe_session_disk
from mcp_code_exec.config.settings import Config, load_config
from mcp_code_exec.errors import EngineError, VolumeSizeUnsupported
from mcp_code_exec.runtime.base import VolumeSize
from mcp_code_exec.runtime.docker.disks import MKFS, plan
from mcp_code_exec.runtime.memory import MemoryEngine
from mcp_code_exec.sandbox.ownership import new_volume_name
from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio
MIB = 1024 * 1024


def settings(session_disk: str = "auto") -> Config:
    overrides: dict[str, Any] = {
        "pool": {"size": 1, "session_spares": 1, "acquire_timeout_s": 5},
        "limits": {"session_data_mb": 64, "session_max_files": 100, "session_disk": session_disk},
    }
    return load_config(environ={}, overrides=overrides)


@asynccontextmanager
async def running(config: Config, engine: MemoryEngine) -> AsyncIterator[SandboxService]:
    with anyio.fail_after(30):
        async with SandboxService.start(config, engine=engine) as service:
            await service.wait_ready(10)
            yield service


def session_spec_nocopy(engine: MemoryEngine, volume: str | None) -> bool:
    return next(spec.volume_nocopy for spec, _ in engine.running.values() if spec.volume == volume)


async def test_a_session_volume_is_a_filesystem_of_the_quota_and_goes_with_the_session() -> None:
    async with MemoryEngine(FakeAgent()) as engine:
        async with running(settings(), engine) as service:
            info = await service.new_session("me")
            volume = service.sessions.get(info.session_id, "me").volume
            assert service.volumes.enforced_by == "filesystem"
            assert engine.disks[volume or ""] == VolumeSize(bytes=64 * MIB, entries=100)
            assert session_spec_nocopy(engine, volume)  # its top is root:1000 0775 as made
            await service.close_session("me", info.session_id)
            assert volume not in engine.disks and volume not in engine.volume_labels
        assert engine.disks == {} and engine.volume_labels == {}  # the spare's went at shutdown


async def test_where_the_engine_cannot_size_volumes_auto_falls_back_to_the_agent_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with MemoryEngine(FakeAgent()) as engine:
        engine.size_support = "no loop devices"
        with caplog.at_level(logging.WARNING):
            async with running(settings(), engine) as service:
                info = await service.new_session("me")
                volume = service.sessions.get(info.session_id, "me").volume
                assert service.volumes.enforced_by == "agent" and service.volumes.why_not == "no loop devices"
                assert engine.disks == {} and volume in engine.volume_labels
                assert not session_spec_nocopy(engine, volume)  # the image's /mnt/data owner, as before
                await service.close_session("me", info.session_id)
        assert any("only by the sandbox's own count (no loop devices)" in r.getMessage() for r in caplog.records)


async def test_the_doctor_fails_the_session_disk_check_when_auto_fell_back_and_says_how_to_accept_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = settings()
    async with MemoryEngine(FakeAgent()) as engine:
        engine.size_support = "no loop devices"
        async with running(config, engine) as service:
            report = Report()
            await _probe_session_disk(service, config, report)
    out = capsys.readouterr().out
    assert report.failed and out.startswith(
        "FAIL  session disk: the engine cannot make sized volumes (no loop devices)"
    )
    assert 'limits.session_disk = "agent"' in out


async def test_with_session_disk_filesystem_a_server_whose_engine_cannot_size_volumes_does_not_start() -> None:
    async with MemoryEngine(FakeAgent()) as engine:
        engine.size_support = "no loop devices"
        with anyio.fail_after(30), pytest.raises(VolumeSizeUnsupported, match=r"no loop devices.*'agent'"):
            async with SandboxService.start(settings("filesystem"), engine=engine):
                pass
        assert engine.running == {} and engine.volume_labels == {}


async def test_with_session_disk_agent_volumes_are_plain_even_where_the_engine_could_size_them() -> None:
    async with MemoryEngine(FakeAgent()) as engine, running(settings("agent"), engine) as service:
        info = await service.new_session("me")
        assert engine.disks == {} and service.volumes.enforced_by == "agent"
        await service.close_session("me", info.session_id)


async def test_a_filesystem_whose_removal_failed_is_removed_by_the_end_of_service_sweep() -> None:
    async with MemoryEngine(FakeAgent()) as engine:
        async with running(settings(), engine) as service:
            info = await service.new_session("me")
            volume = service.sessions.get(info.session_id, "me").volume or ""
            engine.fail_disk_removal = EngineError("the helper failed")
            await service.close_session("me", info.session_id)  # logged, not raised: the session is closed
            assert volume not in engine.volume_labels and volume in engine.disks
            assert volume in service.volumes.names  # not seen removed: the end-of-service sweep's
            engine.fail_disk_removal = None
        assert engine.disks == {} and engine.volume_labels == {}


async def test_the_start_up_sweep_removes_filesystems_whose_volume_is_gone_and_keeps_the_others() -> None:
    async with MemoryEngine(FakeAgent()) as engine:
        orphan, live = new_volume_name(), new_volume_name()
        size = VolumeSize(bytes=MIB, entries=10)
        engine.disks.update({orphan: size, live: size})
        engine.volume_labels[live] = {"another": "server's"}
        async with running(settings("agent"), engine):
            assert orphan not in engine.disks and live in engine.disks
        engine.volume_labels.pop(live)
        engine.disks.pop(live)


@pytest.mark.skipif(shutil.which("mke2fs") is None, reason="e2fsprogs is not installed on this machine")
@pytest.mark.parametrize("quota_mb", [8, 64, 1024, 16384])
def test_an_image_made_by_the_plan_has_room_for_the_whole_quota(quota_mb: int, tmp_path: Path) -> None:
    # Free blocks less what ext4 keeps back from users (2% of the blocks, at most 4096): statvfs's
    # f_bavail, which the engine tests measure in a real session too.
    disk = plan(VolumeSize(bytes=quota_mb * MIB, entries=10000))
    image = tmp_path / "disk.img"
    with open(image, "wb") as handle:
        handle.truncate(disk.image_bytes)  # sparse here; the helper preallocates
    args = [*MKFS.split(), "-N", str(disk.inodes), "-J", f"size={disk.journal_mb}", str(image)]
    subprocess.run(args, check=True, capture_output=True)
    header = subprocess.run(["dumpe2fs", "-h", str(image)], check=True, capture_output=True, text=True).stdout
    blocks, free, inodes = (
        int(re.search(rf"^{key}:\s+(\d+)", header, re.M).group(1))  # type: ignore[union-attr]
        for key in ("Block count", "Free blocks", "Inode count")
    )
    usable = (free - min(blocks // 50, 4096)) * 4096
    assert quota_mb * MIB <= usable <= quota_mb * MIB * 1.01 + 8 * MIB
    assert inodes >= 2 * 10000
