"""Host directories in the configuration: what may be mounted, and the spec every container gets."""

from __future__ import annotations

import os
import site
import sys
import tempfile
from pathlib import Path
from typing import Any

import anyio
import pytest
from _fake_agent import FakeAgent

from mcp_code_exec.config.settings import Config, load_config
from mcp_code_exec.errors import ConfigError
from mcp_code_exec.mcp_server.descriptions import instructions, tool_descriptions
from mcp_code_exec.runtime.base import BindMount
from mcp_code_exec.runtime.memory import MemoryEngine
from mcp_code_exec.sandbox.spec import container_spec
from mcp_code_exec.service.facade import SandboxService

PACKAGE = Path(__file__).resolve().parents[2] / "mcp_code_exec"


def with_mounts(*mounts: dict[str, Any], environ: dict[str, str] | None = None, **top: Any) -> Config:
    return load_config(environ=environ or {}, overrides={"mounts": list(mounts), **top})


def refusal(*mounts: dict[str, Any], environ: dict[str, str] | None = None, **top: Any) -> str:
    with pytest.raises(ConfigError) as caught:
        with_mounts(*mounts, environ=environ, **top)
    return str(caught.value)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A home directory of the test's own, so ``~`` and ~/.ssh are known."""
    home = tmp_path / "home"
    (home / "data").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    return home


def test_a_mount_is_read_only_by_default_and_its_path_is_resolved(home: Path, tmp_path: Path) -> None:
    (tmp_path / "link").symlink_to(home / "data")
    config = with_mounts({"name": "data", "path": "~/data"})
    assert [(m.name, m.path, m.writable) for m in config.mounts] == [("data", home / "data", False)]
    linked = with_mounts({"name": "via-link", "path": str(tmp_path / "link")})
    assert linked.mounts[0].path == home / "data"  # the symlink followed once, at load
    assert with_mounts().mounts == []


def test_a_writable_mount_says_so(home: Path) -> None:
    assert with_mounts({"name": "out", "path": str(home / "data"), "writable": True}).mounts[0].writable


def test_the_path_must_be_an_absolute_existing_directory(home: Path) -> None:
    (home / "notes.txt").write_text("x")
    assert "mounts[0].path: 'data' is not an absolute path" in refusal({"name": "d", "path": "data"})
    assert "mounts[0].path: '~/missing' does not exist" in refusal({"name": "d", "path": "~/missing"})
    assert "'~/notes.txt' is not a directory" in refusal({"name": "d", "path": "~/notes.txt"})
    assert "mounts[0].path: must be a path" in refusal({"name": "d", "path": 3})


@pytest.mark.parametrize("path", ["/", "/etc", "/proc", "/sys/kernel", "/dev", "/run"])
def test_the_root_and_the_systems_own_trees_are_refused(home: Path, path: str) -> None:
    message = refusal({"name": "d", "path": path})
    assert message.startswith("configuration: mounts[0].path: ")
    assert "sandboxes must never see" in message or "is the root directory" in message


def test_a_directory_above_the_engines_data_is_refused(home: Path) -> None:
    assert "contains /var/lib/docker, which sandboxes must never see" in refusal({"name": "d", "path": "/var/lib"})


def test_the_home_directory_and_its_credentials_are_refused(home: Path) -> None:
    (home / ".ssh").mkdir()
    assert f"contains {home / '.docker'}" in refusal({"name": "d", "path": "~"})
    assert "is a place sandboxes must never see" in refusal({"name": "d", "path": "~/.ssh"})


def test_a_symlink_to_a_protected_place_is_refused_by_where_it_leads(home: Path) -> None:
    (home / "data" / "innocent").symlink_to("/etc")
    message = refusal({"name": "d", "path": "~/data/innocent"})
    assert "(resolved: /etc) is a place sandboxes must never see" in message


def test_the_engines_socket_directory_is_refused(home: Path) -> None:
    socket = f"unix://{home / 'data' / 'engine' / 'docker.sock'}"
    assert "mounts[0].path: " in refusal({"name": "d", "path": "~/data"}, environ={"DOCKER_HOST": socket})
    assert "would show the engine's socket" in refusal({"name": "d", "path": "~/data"}, docker_host=socket)


def test_the_configuration_file_itself_is_refused(home: Path) -> None:
    config_file = home / "data" / "config.toml"
    config_file.write_text(f'[[mounts]]\nname = "data"\npath = "{home / "data"}"\n')
    with pytest.raises(ConfigError, match=r"config.toml: mounts\[0\].path: .* contains .*config.toml"):
        load_config(config_file, environ={})


def test_the_servers_code_cannot_be_writable(home: Path) -> None:
    assert with_mounts({"name": "code", "path": str(PACKAGE)}).mounts[0].path == PACKAGE  # reading it is harmless
    message = refusal({"name": "code", "path": str(PACKAGE.parent), "writable": True})
    assert "mounts[0].writable: " in message and "server's own code" in message


@pytest.mark.parametrize("name", ["", "Data", "-data", "a/b", "..", "a" * 33, "dätä"])
def test_a_name_is_short_lowercase_and_plain(home: Path, name: str) -> None:
    assert "mounts[0].name: " in refusal({"name": name, "path": "~/data"})


def test_names_are_unique_and_directories_do_not_overlap(home: Path) -> None:
    (home / "data" / "inner").mkdir()
    (home / "other").mkdir()
    twice = refusal({"name": "a", "path": "~/data"}, {"name": "a", "path": "~/other"})
    assert twice == "configuration: mounts: two mounts are named 'a'"
    nested = refusal({"name": "outer", "path": "~/data", "writable": True}, {"name": "inner", "path": "~/data/inner"})
    assert "'inner'" in nested and "'outer'" in nested and "overlap" in nested
    assert "overlap" in refusal({"name": "a", "path": "~/data"}, {"name": "b", "path": "~/data"})


def test_unknown_keys_in_a_mount_are_refused(home: Path) -> None:
    assert refusal({"name": "d", "path": "~/data", "mode": "rw"}).endswith("mounts[0].mode: unknown key")


def test_sessions_and_stateless_containers_get_the_mounts_read_only_unless_writable(home: Path) -> None:
    (home / "out").mkdir()
    config = with_mounts({"name": "data", "path": "~/data"}, {"name": "out", "path": "~/out", "writable": True})
    expected = (
        BindMount(source=str(home / "data"), target="/mnt/host/data", read_only=True),
        BindMount(source=str(home / "out"), target="/mnt/host/out", read_only=False),
    )
    assert container_spec(config.sandbox, {}).binds == expected
    assert container_spec(config.sandbox, {}, volume="v1").binds == expected
    assert container_spec(with_mounts().sandbox, {}).binds == ()


@pytest.mark.anyio
async def test_a_host_directory_gone_since_the_start_is_left_out_and_the_rest_mounted(home: Path) -> None:
    (home / "gone").mkdir()
    config = with_mounts(
        {"name": "data", "path": "~/data"}, {"name": "gone", "path": "~/gone"}, pool={"size": 1, "session_spares": 0}
    )
    os.rmdir(home / "gone")  # a drive unplugged: the containers must still start
    with anyio.fail_after(30):
        async with MemoryEngine(FakeAgent()) as engine, SandboxService.start(config, engine=engine) as service:
            await service.wait_ready(10)
            assert (await service.run("me", "1")).status == "ok"
            (spec, _), *_ = engine.running.values()
            assert [bind.target for bind in spec.binds] == ["/mnt/host/data"]


def test_the_tool_descriptions_tell_the_model_where_the_mounts_are_only_when_there_are_some(home: Path) -> None:
    (home / "out").mkdir()
    config = with_mounts({"name": "data", "path": "~/data"}, {"name": "out", "path": "~/out", "writable": True})
    texts = tool_descriptions(config)
    for tool in ("run_python", "new_session"):
        assert f"/mnt/host/data is {home / 'data'} on the user's machine (read-only)" in texts[tool]
        assert f"/mnt/host/out is {home / 'out'} on the user's machine (writable)" in texts[tool]
    assert "/mnt/host/data" in instructions(config)
    plain = with_mounts()
    assert not any("/mnt/host" in text for text in [*tool_descriptions(plain).values(), instructions(plain)])


def test_pips_configuration_and_credentials_are_never_mounted(home: Path, tmp_path: Path) -> None:
    """docs/security.md#code-planted-for-the-hosts-pip: a sandbox that could write pip's
    configuration would choose the index every other sandbox's wheels come from (and could read
    its credentials)."""
    (home / ".config" / "pip").mkdir(parents=True)
    assert f"contains {home / '.config' / 'pip'}" in refusal({"name": "c", "path": "~/.config"})
    (home / ".pip").mkdir()
    assert "is a place sandboxes must never see" in refusal({"name": "c", "path": "~/.pip"})
    named = tmp_path / "named"
    (named / "xdg" / "pip").mkdir(parents=True)
    (named / "conf").mkdir()
    for environ in (
        {"XDG_CONFIG_HOME": str(named / "xdg")},
        {"XDG_CONFIG_DIRS": f"/nowhere:{named / 'xdg'}"},
        {"PIP_CONFIG_FILE": str(named / "conf" / "pip.conf")},
        {"NETRC": str(named / "conf" / ".netrc")},
    ):
        assert "sandboxes must never see" in refusal({"name": "c", "path": str(named)}, environ=environ), environ
    assert with_mounts({"name": "c", "path": str(named)}).mounts[0].path == named.resolve()


def test_a_writable_mount_never_holds_the_servers_python(home: Path) -> None:
    """docs/security.md#code-planted-for-the-hosts-pip: a `.pth` file planted in the interpreter's
    site directory runs in every Python the host starts, the isolated pip included."""
    prefix = Path(sys.prefix).resolve()
    assert with_mounts({"name": "py", "path": str(prefix)}).mounts[0].path == prefix  # reading it is harmless
    site_packages = Path(site.getsitepackages()[0]).resolve()
    for path in (prefix, site_packages, site_packages.parent):
        message = refusal({"name": "py", "path": str(path), "writable": True})
        assert "mounts[0].writable: " in message and "server's own code or its Python" in message


def test_a_writable_mount_never_holds_the_wheel_cache_or_pips_working_place(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/security.md#code-planted-for-the-hosts-pip: a wheel swapped in the shared cache (its
    hash is remembered by size and time, which the sandbox can set) would go into other sandboxes."""
    (home / "data" / "wheels").mkdir()
    cache = {"packages": {"cache_dir": str(home / "data" / "wheels")}}
    assert "overlaps the wheel cache" in refusal({"name": "d", "path": "~/data", "writable": True}, **cache)
    assert with_mounts({"name": "d", "path": "~/data"}, **cache).mounts[0].writable is False
    (home / ".cache").mkdir()
    assert "overlaps the wheel cache" in refusal({"name": "d", "path": "~/.cache", "writable": True})
    xdg = {"XDG_CACHE_HOME": str(home / "data")}
    assert "overlaps the wheel cache" in refusal({"name": "d", "path": "~/data", "writable": True}, environ=xdg)
    monkeypatch.setattr(tempfile, "tempdir", str(home / "data" / "wheels"))
    message = refusal({"name": "d", "path": "~/data", "writable": True})
    assert "where the host's pip works" in message


def test_an_engine_socket_directly_in_the_root_leaves_other_directories_mountable(home: Path) -> None:
    """An engine socket at ``/docker.sock``: its directory is the root, inside which every directory
    lies; what a mount must not show is the socket, and only the root (refused anyway) holds it."""
    root_socket = "unix:///docker.sock"
    for config in (
        with_mounts({"name": "d", "path": "~/data", "writable": True}, environ={"DOCKER_HOST": root_socket}),
        with_mounts({"name": "d", "path": "~/data", "writable": True}, docker_host=root_socket),
    ):
        assert config.mounts[0].path == (home / "data").resolve()
    assert "is the root directory" in refusal({"name": "d", "path": "/"}, environ={"DOCKER_HOST": root_socket})


def test_a_writable_mount_never_holds_the_directory_the_server_was_started_in(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/security.md#code-planted-for-the-hosts-python: ``python -m`` imports from the directory
    it was started in before anything else, and hosts start stdio servers in the user's project."""
    project = home / "data" / "project"
    (project / "out").mkdir(parents=True)
    monkeypatch.chdir(project)
    for path in (project, home / "data"):
        message = refusal({"name": "p", "path": str(path), "writable": True})
        assert "mounts[0].writable: " in message and f"holds {project.resolve()}, the directory the server" in message
        assert with_mounts({"name": "p", "path": str(path)}).mounts[0].writable is False  # reading it is harmless
    inside = with_mounts({"name": "out", "path": str(project / "out"), "writable": True})
    assert inside.mounts[0].writable  # a mount inside it only adds names under its own


def test_a_writable_mount_never_holds_a_directory_the_servers_python_imports_from(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/security.md#code-planted-for-the-hosts-python: ``PYTHONPATH``, a console script's
    directory, a source checkout on the path, the user's site directory (used by a front that the
    isolated service does not share)."""
    (home / "data" / "lib").mkdir()
    monkeypatch.syspath_prepend(str(home / "data" / "lib"))
    message = refusal({"name": "d", "path": "~/data", "writable": True})
    assert f"holds {(home / 'data' / 'lib').resolve()}, a directory the server's Python imports modules from" in message
    assert with_mounts({"name": "d", "path": "~/data"}).mounts[0].writable is False
    (home / "other" / "site").mkdir(parents=True)
    monkeypatch.setattr(site, "getusersitepackages", lambda: str(home / "other" / "site"))
    message = refusal({"name": "o", "path": "~/other", "writable": True})
    assert "server's own code or its Python" in message
