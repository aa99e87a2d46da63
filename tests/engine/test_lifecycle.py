"""Starting and stopping: nothing left behind, clear errors when the engine or image is missing."""

from __future__ import annotations

import os
import secrets
import subprocess

import anyio
import pytest
from _support import (
    crashing_server,
    existing_volumes,
    make_test_config,
    project_containers,
    project_volumes,
    wait_until,
)

from mcp_code_exec.config.settings import Config
from mcp_code_exec.errors import EngineUnavailable, ImageMissing
from mcp_code_exec.sandbox.ownership import new_volume_name
from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio


async def test_stopping_the_service_leaves_no_container_or_volume(config: Config) -> None:
    async with SandboxService.start(config) as service:
        await service.wait_ready()
        session = await service.new_session("me")
        await service.run("me", "open('a', 'w').write('1')", session_id=session.session_id)
        instance = service.instance
        assert project_containers(instance=instance)
        assert project_volumes(instance=instance)
    assert project_containers(instance=instance) == []
    assert project_volumes(instance=instance) == []


async def test_a_service_stopped_while_its_session_spares_are_being_made_leaves_no_volume_or_disk() -> None:
    # Stopped before wait_ready, once a spare's volume is being made (its filesystem too, where the
    # engine makes sized ones): nothing of it may be left for the next start to remove.
    config = make_test_config(pool={"size": 1, "session_spares": 2})
    async with SandboxService.start(config) as service:
        await wait_until(lambda: service.volumes.names, 120, every_s=0.01)  # a spare's volume is on its way
        assert service.session_spares.idle == 0
        made = set(service.volumes.names)
    assert project_volumes(instance=service.instance) == []
    assert existing_volumes(made | service.volumes.names) == []
    attached = attached_disks()
    assert not [name for name in made if f"/{name}.img" in attached]


def attached_disks() -> str:
    """The loop devices and the image files they hold (a sized volume's filesystem is one)."""
    return subprocess.run(["losetup", "-a"], capture_output=True, text=True, check=False).stdout


async def test_a_killed_servers_containers_are_removed(config: Config, tmp_path: os.PathLike[str]) -> None:
    script = (
        "import anyio, sys\n"
        "from mcp_code_exec.service.facade import SandboxService\n"
        "from _support import make_test_config\n"
        "from mcp_code_exec.sandbox.ownership import owner_token\n"
        "async def main():\n"
        "    async with SandboxService.start(make_test_config()) as s:\n"
        "        await s.wait_ready()\n"
        "        await s.new_session('x')\n"
        "        print(owner_token(), flush=True)\n"
        "        await anyio.sleep_forever()\n"
        "anyio.run(main)\n"
    )
    async with crashing_server(script) as dead_owner:
        assert project_containers(dead_owner)
        assert project_volumes(dead_owner)
    # Its containers exit by themselves (stdin closes); a new server's sweep removes the rest.
    async with SandboxService.start(config):
        pass
    # The engine finishes removing them; on a loaded machine that has taken over a minute.
    await wait_until(lambda: not project_containers(dead_owner), 120)
    assert project_volumes(dead_owner) == []


def docker(*args: str, check: bool = True) -> str:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=check).stdout.strip()


async def test_a_session_volume_the_engine_lost_the_labels_of_is_swept(config: Config) -> None:
    # What a dockerd killed while creating a session volume leaves: the volume, without labels.
    debris = new_volume_name()
    in_use = new_volume_name()  # unlabelled too, but a container uses it
    foreign = "mcp-code-exec-keep-" + secrets.token_hex(8)  # not a name we give
    for name in (debris, in_use, foreign):
        docker("volume", "create", name)
    holder = docker("create", "-v", f"{in_use}:/data", config.image, "true")
    try:
        async with SandboxService.start(config):  # its start-up sweep
            pass
        remaining = set(docker("volume", "ls", "-q").split())
        assert debris not in remaining
        assert in_use in remaining and foreign in remaining
    finally:
        docker("rm", "-f", holder)
        for name in (debris, in_use, foreign):
            docker("volume", "rm", "-f", name, check=False)


async def test_a_volume_the_engine_lost_the_labels_of_while_the_service_ran_is_removed_when_it_stops(
    config: Config,
) -> None:
    # A dockerd stopped while creating a session volume answers "database not open" and keeps
    # the directory, without labels; the service only knows the name it asked for.
    lost = new_volume_name()
    not_ours = new_volume_name()  # another server's, say: not this service's to judge
    try:
        async with SandboxService.start(config) as service:
            for name in (lost, not_ours):
                docker("volume", "create", name)
            service.volumes.names.add(lost)
        remaining = set(docker("volume", "ls", "-q").split())
        assert lost not in remaining
        assert not_ours in remaining
    finally:
        for name in (lost, not_ours):
            docker("volume", "rm", "-f", name, check=False)


async def test_no_engine_gives_a_message_that_says_how_to_start_one() -> None:
    config = make_test_config(docker_host="unix:///nonexistent/docker.sock")
    with pytest.raises(EngineUnavailable, match=r"tried: unix:///nonexistent/docker.sock.*start"):
        async with SandboxService.start(config):
            pass


async def test_a_missing_image_names_the_build_command() -> None:
    config = make_test_config(image="mcp-code-exec:does-not-exist")
    with pytest.raises(ImageMissing, match="mcp-code-exec image build"):
        async with SandboxService.start(config):
            pass


async def test_waiting_for_an_engine_that_never_comes_still_ends_in_a_clear_error() -> None:
    config = make_test_config(docker_host="unix:///nonexistent/docker.sock", engine_wait_s=1)
    with anyio.fail_after(30), pytest.raises(EngineUnavailable, match="no Docker engine answers"):
        async with SandboxService.start(config):
            pass
