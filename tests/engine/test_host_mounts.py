"""Host directories the user configured (``[[mounts]]``), on the real engine: seen at /mnt/host/<name>,
read-only unless writable, nothing beyond them reachable, and never touched by the post-run wipe."""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import anyio
import pytest
from _security import OWNER, runsc_available
from _support import make_test_config

from mcp_code_exec.commands.doctor import doctor
from mcp_code_exec.config.settings import Config
from mcp_code_exec.runtime.base import BindMount, ContainerSpec
from mcp_code_exec.sandbox.ownership import SANDBOX_UIDS
from mcp_code_exec.service.containers import ContainerFactory
from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio

READ = "import pandas as pd\ndf = pd.read_csv('/mnt/host/data/sales.csv')\nint(df.amount.sum())\n"
WRITE_READ_ONLY = (
    "import errno, json, os\n"
    "d = '/mnt/host/data'\n"
    "attempts = {\n"
    "    'create': lambda: open(f'{d}/new.txt', 'w'),\n"
    "    'append': lambda: open(f'{d}/sales.csv', 'a'),\n"
    "    'unlink': lambda: os.unlink(f'{d}/sales.csv'),\n"
    "    'rename': lambda: os.rename(f'{d}/sales.csv', f'{d}/moved.csv'),\n"
    "    'mkdir': lambda: os.mkdir(f'{d}/sub'),\n"
    "    'symlink': lambda: os.symlink('/etc/passwd', f'{d}/planted'),\n"
    "    'utime': lambda: os.utime(f'{d}/sales.csv', (0, 0)),\n"
    "}\n"
    "outcome = {}\n"
    "for name, attempt in attempts.items():\n"
    "    try:\n"
    "        attempt()\n"
    "        outcome[name] = 'done'\n"
    "    except OSError as exc:\n"
    "        outcome[name] = errno.errorcode[exc.errno]\n"
    "print(json.dumps(outcome))\n"
)
CONFINED = (
    "import json, os, socket\n"
    "def read(path):\n"
    "    try:\n"
    "        return open(path).read().strip()\n"
    "    except OSError as exc:\n"
    "        return type(exc).__name__\n"
    "print(json.dumps({\n"
    "    'above': sorted(os.listdir('/mnt/host/data/..')),\n"
    "    'above_is_ours': os.stat('/mnt/host/data/..').st_ino == os.stat('/mnt/host').st_ino,\n"
    "    'sibling': read('/mnt/host/data/../sibling.txt'),\n"
    "    'escape_abs': read('/mnt/host/data/escape_abs'),\n"
    "    'escape_rel': read('/mnt/host/data/escape_rel'),\n"
    "    'escape_rel_is': os.path.realpath('/mnt/host/data/escape_rel'),\n"
    "    'hostname_link': read('/mnt/host/data/hostname'),\n"
    "    'hostname': socket.gethostname(),\n"
    "}))\n"
)
LEAVE_LINKS = (  # a stateless run leaves ways into the writable mount in the places the wipe empties
    "import os, socket\n"
    "open('/mnt/host/out/from-stateless.txt', 'w').write('written by a stateless run')\n"
    "os.symlink('/mnt/host/out', '/mnt/data/link-to-out')\n"
    "os.symlink('/mnt/host/out/kept.txt', '/tmp/link-to-kept')\n"
    "os.makedirs('/mnt/data/deep/er')\n"
    "os.symlink('/mnt/host/out', '/mnt/data/deep/er/out')\n"
    "os.symlink('/mnt/host/out', '/dev/shm/out')\n"
    "print(socket.gethostname())\n"
)
LOOK_AFTER = (
    "import json, os, socket\n"
    "print(json.dumps({\n"
    "    'hostname': socket.gethostname(),\n"
    "    'out': sorted(os.listdir('/mnt/host/out')),\n"
    "    'leftovers': sorted(os.listdir('/mnt/data') + os.listdir('/tmp') + os.listdir('/dev/shm')),\n"
    "}))\n"
)


@dataclass(frozen=True)
class HostTree:
    shared: Path  # mounted read-only as "data"
    out: Path  # mounted writable as "out"
    sibling: Path  # beside ``shared``: never visible
    secret: str

    def mounts(self) -> list[dict[str, Any]]:
        return [
            {"name": "data", "path": str(self.shared)},
            {"name": "out", "path": str(self.out), "writable": True},
        ]


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> HostTree:
    root = tmp_path_factory.mktemp("host-mounts")
    parent, out = root / "parent", root / "out"
    shared = parent / "shared"
    shared.mkdir(parents=True)
    out.mkdir()
    secret = f"SIBLING-{secrets.token_hex(8)}"
    sibling = parent / "sibling.txt"
    sibling.write_text(secret)
    (shared / "sales.csv").write_text("region,amount\nnorth,120\nsouth,80\n")
    (shared / "escape_abs").symlink_to(sibling)  # the host's absolute path to the sibling
    (shared / "escape_rel").symlink_to("../sibling.txt")
    (shared / "hostname").symlink_to("/etc/hostname")
    (out / "kept.txt").write_text("the user's own file")
    for path in (root, parent, shared, sibling, shared / "sales.csv", out / "kept.txt"):
        path.chmod(0o755 if path.is_dir() else 0o644)  # readable by uid 1000 in the container
    out.chmod(0o777)  # writable by uid 1000 (and so the kept file could be unlinked, were it wiped)
    return HostTree(shared=shared, out=out, sibling=sibling, secret=secret)


def mounted_config(host: HostTree, **overrides: Any) -> Config:
    # grow_after_s: the one stateless container is waited for, never replaced by a new one meanwhile
    pool = {"size": 1, "session_spares": 1, "grow_after_s": 30.0, **overrides.pop("pool", {})}
    return make_test_config(mounts=host.mounts(), pool=pool, **overrides)


@pytest.fixture(scope="module")
async def mounted(service: SandboxService, host: HostTree) -> AsyncIterator[SandboxService]:
    # (Asks for the suite's shared service only so that one is set up first; see test_security_leftovers.)
    async with SandboxService.start(mounted_config(host)) as svc:
        await svc.wait_ready()
        yield svc


@pytest.fixture
async def sid(mounted: SandboxService) -> AsyncIterator[str]:
    session = await mounted.new_session(OWNER)
    try:
        yield session.session_id
    finally:
        await mounted.close_session(OWNER, session.session_id)


def hosts_own_hostname() -> str:
    return Path("/etc/hostname").read_text().strip()


def out_of(result: Any) -> Any:
    assert result.status == "ok", result
    return json.loads(result.stdout)


async def test_a_configured_host_directory_is_readable_in_a_session_at_mnt_host_name(
    mounted: SandboxService, sid: str
) -> None:
    result = await mounted.run(OWNER, READ, session_id=sid)
    assert (result.status, result.result) == ("ok", "200"), result


async def test_a_stateless_run_reads_it_too(mounted: SandboxService) -> None:
    result = await mounted.run(OWNER, READ)
    assert (result.status, result.result) == ("ok", "200"), result


async def test_writing_to_a_read_only_mount_fails_and_leaves_the_host_files_as_they_were(
    mounted: SandboxService, sid: str, host: HostTree
) -> None:
    before = sorted(os.listdir(host.shared)), (host.shared / "sales.csv").read_text()
    outcome = out_of(await mounted.run(OWNER, WRITE_READ_ONLY, session_id=sid))
    assert set(outcome) == {"create", "append", "unlink", "rename", "mkdir", "symlink", "utime"}
    assert "done" not in outcome.values(), outcome
    assert outcome["create"] == "EROFS", outcome  # refused by the mount, not just by file modes
    assert (sorted(os.listdir(host.shared)), (host.shared / "sales.csv").read_text()) == before


async def test_a_writable_mount_takes_what_a_session_writes_onto_the_host(
    mounted: SandboxService, sid: str, host: HostTree
) -> None:
    code = "import pandas as pd\npd.DataFrame({'x': [1, 2]}).to_csv('/mnt/host/out/result.csv', index=False)"
    assert (await mounted.run(OWNER, code, session_id=sid)).status == "ok"
    written = host.out / "result.csv"
    assert written.read_text() == "x\n1\n2\n"
    assert written.stat().st_uid in SANDBOX_UIDS and written.stat().st_gid == 1000  # the sandbox user's, not root's
    written.unlink()


async def test_nothing_beside_the_mounted_directory_is_reachable(mounted: SandboxService, host: HostTree) -> None:
    seen = out_of(await mounted.run(OWNER, CONFINED))
    assert seen["above"] == ["data", "out"] and seen["above_is_ours"], seen  # `..` is the container's /mnt/host
    assert seen["sibling"] == "FileNotFoundError", seen
    assert host.secret not in json.dumps(seen)


async def test_a_symlink_in_the_mount_resolves_in_the_containers_namespace_not_the_hosts(
    mounted: SandboxService, host: HostTree
) -> None:
    assert (host.shared / "escape_abs").read_text() == host.secret  # on the host, both links lead out
    assert (host.shared / "escape_rel").read_text() == host.secret
    seen = out_of(await mounted.run(OWNER, CONFINED))
    assert seen["escape_abs"] == "FileNotFoundError", seen  # the host's path does not exist in there
    assert seen["escape_rel"] == "FileNotFoundError" and seen["escape_rel_is"] == "/mnt/host/sibling.txt", seen
    # /etc/hostname through the link is the container's own file, not the host's
    assert seen["hostname_link"] == seen["hostname"] != hosts_own_hostname(), seen


async def test_a_file_in_a_writable_mount_survives_a_stateless_runs_wipe(
    mounted: SandboxService, host: HostTree
) -> None:
    first = await mounted.run(OWNER, LEAVE_LINKS)
    assert first.status == "ok", first
    after = out_of(await mounted.run(OWNER, LOOK_AFTER))
    assert after["hostname"] == first.stdout.strip(), "the wipe failed: the container was not reused"
    assert after["leftovers"] == [], after  # the wipe ran, and emptied what it empties
    assert after["out"] == ["from-stateless.txt", "kept.txt"], after
    assert (host.out / "kept.txt").read_text() == "the user's own file"
    assert (host.out / "from-stateless.txt").read_text() == "written by a stateless run"
    (host.out / "from-stateless.txt").unlink()


async def test_a_mount_point_inside_a_wiped_directory_is_never_entered_by_the_wipe(
    service: SandboxService, host: HostTree, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No configuration can put a mount there (they all live under /mnt/host): the spec is made to.
    inner = tmp_path / "inner"
    inner.mkdir()
    inner.chmod(0o777)
    (inner / "kept.txt").write_text("the user's own file")
    spec = ContainerFactory.spec  # where every container of the service is specified

    def with_inner_mounts(self: ContainerFactory, *args: Any, **kwargs: Any) -> ContainerSpec:
        binds = (BindMount(str(inner), "/mnt/data/host", read_only=False), BindMount(str(inner), "/tmp/host", False))
        made = spec(self, *args, **kwargs)
        return replace(made, binds=(*made.binds, *binds))

    monkeypatch.setattr(ContainerFactory, "spec", with_inner_mounts)
    code = "import socket\nopen('/mnt/data/host/a.txt', 'w').write('a')\nopen('/tmp/host/b.txt', 'w').write('b')\n"
    async with SandboxService.start(mounted_config(host, pool={"session_spares": 0})) as svc:
        await svc.wait_ready()
        first = await svc.run(OWNER, code + "print(socket.gethostname())")
        assert first.status == "ok", first
        second = await svc.run(OWNER, "import socket, os\nprint(socket.gethostname(), sorted(os.listdir('/tmp/host')))")
    assert second.status == "ok", second
    hostname, listed = second.stdout.split(maxsplit=1)
    assert hostname != first.stdout.strip(), "a wipe that met a mount point must not call the container clean"
    assert listed.strip() == "['a.txt', 'b.txt', 'kept.txt']"
    assert sorted(os.listdir(inner)) == ["a.txt", "b.txt", "kept.txt"]


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a filesystem on the host takes root")
async def test_a_filesystem_mounted_inside_a_host_directory_stays_out_of_the_sandbox(
    service: SandboxService, tmp_path: Path
) -> None:
    # A recursive bind would bring it in, and engines before Docker 25 leave it writable under a
    # read-only mount: the bind is not recursive, so the sandbox sees only the empty mount point.
    shared, inner = tmp_path / "shared", tmp_path / "shared" / "usb-drive"
    inner.mkdir(parents=True)
    shared.chmod(0o755)
    await anyio.run_process(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0777", "mcp-code-exec-test", str(inner)])
    try:
        (inner / "on-the-drive.txt").write_text("x")
        code = (
            "import os\n"
            "try:\n"
            "    open('/mnt/host/data/usb-drive/new.txt', 'w')\n"
            "except OSError as exc:\n"
            "    print(exc.strerror)\n"
            "print(os.listdir('/mnt/host/data/usb-drive'))\n"
        )
        settings = make_test_config(mounts=[{"name": "data", "path": str(shared)}], pool={"session_spares": 0})
        async with SandboxService.start(settings) as svc:
            await svc.wait_ready()
            result = await svc.run(OWNER, code)
    finally:
        await anyio.run_process(["umount", str(inner)])
    assert (result.status, result.stdout) == ("ok", "Read-only file system\n[]\n"), result


async def test_the_doctor_checks_each_mount_as_the_sandbox_user_sees_it(
    service: SandboxService, host: HostTree, capsys: pytest.CaptureFixture[str]
) -> None:
    assert await doctor(mounted_config(host)) == 0
    out = capsys.readouterr().out
    assert "OK    mount data: the sandbox user sees /mnt/host/data read-only" in out, out
    assert "OK    mount out: the sandbox user sees /mnt/host/out writable" in out, out


@pytest.mark.skipif(not runsc_available(), reason="gVisor is not installed: `docker info` lists no runsc runtime")
async def test_under_gvisor_mounts_are_read_only_unless_writable_confined_and_kept_by_the_wipe(
    service: SandboxService, host: HostTree
) -> None:
    async with SandboxService.start(mounted_config(host, runtime="runsc", pool={"session_spares": 0})) as gvisor:
        await gvisor.wait_ready()
        assert (await gvisor.run(OWNER, READ)).result == "200"
        refused = out_of(await gvisor.run(OWNER, WRITE_READ_ONLY))
        assert "done" not in refused.values(), refused  # gVisor says EACCES where Linux says EROFS
        seen = out_of(await gvisor.run(OWNER, CONFINED))
        assert seen["above"] == ["data", "out"] and seen["sibling"] == "FileNotFoundError", seen
        assert seen["escape_abs"] == seen["escape_rel"] == "FileNotFoundError", seen
        assert seen["hostname_link"] == seen["hostname"], seen
        first = await gvisor.run(OWNER, LEAVE_LINKS)
        assert first.status == "ok", first
        after = out_of(await gvisor.run(OWNER, LOOK_AFTER))
    assert after["hostname"] == first.stdout.strip() and after["leftovers"] == [], after
    assert after["out"] == ["from-stateless.txt", "kept.txt"], after
    assert (host.out / "kept.txt").read_text() == "the user's own file"
    (host.out / "from-stateless.txt").unlink()
