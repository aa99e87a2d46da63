"""The host's pip (issue 23), without the engine: isolated from the working directory and the server's
environment, ended with its caller, held to a share per identity; and the wheel cache's bound."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import anyio
import pytest

from mcp_code_exec.errors import PackageError, PipTimeout
from mcp_code_exec.service.packages import hostpip
from mcp_code_exec.service.packages.hostpip import HostPip, Slots
from mcp_code_exec.service.packages.pipcall import Place, pip_command
from mcp_code_exec.service.packages.requirements import pip_form, requirement
from mcp_code_exec.service.packages.wheelcache import WheelCache

pytestmark = pytest.mark.anyio


def test_pip_gets_only_what_it_needs_of_the_environment() -> None:
    environ = {
        "PATH": "/usr/bin",
        "HOME": "/home/u",
        "PIP_INDEX_URL": "https://mirror/simple",
        "https_proxy": "http://proxy:3128",
        "SSL_CERT_FILE": "/etc/ca.pem",
        "MCP_CODE_EXEC_TOKEN": "secret",
        "GITHUB_TOKEN": "secret",
        "PYTHONPATH": "/work",
        "LD_PRELOAD": "/work/evil.so",
    }
    with Place.made() as place:
        env = place.environment(environ)
        assert set(env) == {
            "PATH",
            "HOME",
            "PIP_INDEX_URL",
            "https_proxy",
            "SSL_CERT_FILE",
            "TMPDIR",
            "TEMP",
            "TMP",
            "PWD",
        }
        assert env["TMPDIR"].startswith(str(place.root)) and os.listdir(place.cwd) == []
        assert oct(place.root.stat().st_mode & 0o777) == "0o700"
    assert not place.root.exists()
    assert pip_command(["index"])[:4] == [sys.executable, "-I", "-m", "pip"]


async def test_a_pip_package_planted_in_the_working_directory_is_not_what_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "pip").mkdir()
    for name in ("__init__.py", "__main__.py"):
        (tmp_path / "pip" / name).write_text(f"open({str(tmp_path / 'ran')!r}, 'w').write('ran')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with Place.made() as place:
        out = await HostPip(1, 1, 60).run("me", ["--version"], "asking pip its version", place)
    assert out.startswith("pip ") and not (tmp_path / "ran").exists()


@pytest.mark.parametrize(
    "text", ["x.tar", "x.ZIP", "x.tbz", "x.Tar.Gz", "x[a].whl", "x==1.0+a.zip", "file:x", "./x", "x/y", "~/x"]
)
def test_what_pip_would_take_for_a_file_or_a_url_is_refused(text: str) -> None:
    with pytest.raises(PackageError, match="not supported"):
        requirement(text)


def test_pip_gets_requirements_as_names_only() -> None:
    assert pip_form("Foo_Bar.baz [Extra] (>= 1.0, <2) ; python_version >= '3.8'") == (
        "foo-bar-baz[extra]>=1.0,<2; python_version >= '3.8'"
    )


async def test_one_owner_holds_at_most_its_share_and_others_go_on() -> None:
    slots = Slots(total=2, per_owner=1)
    order: list[str] = []

    async def hold(owner: str, seconds: float) -> None:
        async with slots.hold(owner):
            order.append(owner)
            await anyio.sleep(seconds)

    async with anyio.create_task_group() as tg:
        tg.start_soon(hold, "a", 0.3)
        await anyio.sleep(0.01)
        tg.start_soon(hold, "a", 0)  # waits for the first
        await anyio.sleep(0.01)
        tg.start_soon(hold, "b", 0)  # does not
        await anyio.sleep(0.1)
        assert order == ["a", "b"]
    assert order == ["a", "b", "a"] and slots.held == {}


@pytest.mark.parametrize("how", ["cancelled", "pip's own timeout"])
async def test_pip_is_killed_and_reaped_when_its_caller_goes(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    monkeypatch.setattr(hostpip, "pip_command", lambda args: [sys.executable, "-c", "import time; time.sleep(60)"])
    host = HostPip(2, 1, 0.5 if how == "pip's own timeout" else 60)
    with Place.made() as place:
        if how == "cancelled":
            with anyio.move_on_after(0.5):
                await host.run("me", [], "sleeping", place)
        else:
            with pytest.raises(PipTimeout, match=r"pip took longer than 0.5 s"):
                await host.run("me", [], "sleeping", place)
    assert host.started == 1 and host.running == {}  # reaped before run() returned


def test_the_cache_drops_the_least_recently_used_and_never_what_an_install_holds(tmp_path: Path) -> None:
    cache = WheelCache(tmp_path / "cache", max_bytes=1 << 20)
    arch = cache.root / "x86_64"
    arch.mkdir(parents=True)
    old, held, new = (arch / f"{name}-1.0-py3-none-any.whl" for name in ("old", "held", "new"))
    for age, path in enumerate((held, old)):
        path.write_bytes(b"x" * 400_000)
        os.utime(path, (time.time() - 100 + age, time.time() - 100))
    cache.hold([held])
    staged = tmp_path / "staged" / new.name
    staged.parent.mkdir()
    staged.write_bytes(b"y" * 400_000)
    assert cache.put([staged], "x86_64", 400_000) == [new]
    assert sorted(path.name for path in arch.iterdir()) == sorted([held.name, new.name])  # held stayed, old went
    assert cache.size() <= 1024 * 1024 and cache.evicted == 1
    more = tmp_path / "staged" / "more-1.0-py3-none-any.whl"
    more.write_bytes(b"z" * 400_000)
    with pytest.raises(PackageError, match="full of wheels other runs are installing"):
        cache.put([more], "x86_64", 400_000)  # both held (new by the install that brought it)
