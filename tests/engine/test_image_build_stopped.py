"""An image build stopped by SIGTERM or Ctrl-C leaves nothing behind: not its build context in the temporary
directory, not the container of the step the engine was running, and never a file reached through
a mount that debootstrap left in its tree."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import anyio.abc
import docker
import pytest
from _support import _exists, wait_until

from mcp_code_exec.commands.offline_base import mounts_under, remove_without_crossing_mounts
from mcp_code_exec.config.settings import Config

TAG = "mcp-code-exec-test-stopped:latest"


async def line_matching(stream: anyio.abc.ByteReceiveStream, pattern: str, seen: list[str]) -> re.Match[str]:
    """Read lines (kept in ``seen``) until one matches ``pattern``."""
    pending = b""
    async for chunk in stream:
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            seen.append(line.decode(errors="replace"))
            found = re.search(pattern, seen[-1])
            if found is not None:
                return found
    raise AssertionError("the build ended before the line: " + "\n".join(seen[-20:]))


@pytest.mark.anyio
@pytest.mark.parametrize(("stop", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["sigterm", "ctrl-c"])
async def test_a_stopped_build_removes_its_context_and_the_engine_ends_the_running_step_untagged(
    config: Config, tmp_path: Path, stop: signal.Signals, code: int
) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    snippet = tmp_path / "snippet"
    snippet.write_text("RUN sleep 300\n")
    command = [sys.executable, "-m", "mcp_code_exec", "image", "custom", "--tag", TAG, "--from", config.image]
    seen: list[str] = []
    env = {**os.environ, "TMPDIR": str(temp)}
    process = await anyio.open_process([*command, "--dockerfile-snippet", str(snippet)], env=env, stdout=None)
    try:
        assert process.stderr is not None
        with anyio.fail_after(180):
            await line_matching(process.stderr, r"RUN sleep 300", seen)
            step = (await line_matching(process.stderr, r"Running in ([0-9a-f]{12})", seen)).group(1)
        assert [entry.name for entry in temp.iterdir()] != []  # the context, while it builds
        process.send_signal(stop)
        with anyio.fail_after(30):
            seen += [line.decode() async for line in process.stderr]
            ended = await process.wait()
    finally:
        if process.returncode is None:
            process.kill()
        await process.aclose()
    assert ended == code, seen
    assert f"mcp-code-exec: image custom stopped by {stop.name}" in "".join(seen)
    assert list(temp.iterdir()) == []
    await wait_until(lambda: not _exists(step), 60)
    client = docker.from_env()
    try:
        assert not client.images.list(name=TAG)
    finally:
        client.close()


def test_what_debootstrap_left_mounted_is_unmounted_before_its_tree_is_removed(tmp_path: Path) -> None:
    host_dev = tmp_path / "host-dev"
    host_dev.mkdir()
    (host_dev / "null").write_text("the host's own")
    work = tmp_path / "mcp-code-exec-rootfs-x"
    (work / "rootfs" / "dev").mkdir(parents=True)
    (work / "rootfs" / "etc").mkdir()
    subprocess.run(["mount", "--bind", str(host_dev), str(work / "rootfs" / "dev")], check=True)
    said: list[str] = []
    try:
        remove_without_crossing_mounts(str(work), said.append)
    finally:
        if mounts_under(str(work)):
            subprocess.run(["umount", "--lazy", str(work / "rootfs" / "dev")], check=False)
    assert (host_dev / "null").read_text() == "the host's own"
    assert not work.exists()
    assert said == []
