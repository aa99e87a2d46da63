"""``mcp-code-exec install HOST`` / ``uninstall HOST`` on temporary homes laid out as macOS, Windows
and Linux ones (the platform and the environment are given, never the real home's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mcp_code_exec import __version__
from mcp_code_exec.commands.cli import main
from mcp_code_exec.commands.hosts import HOSTS, InstallRefused, Place, entry, entry_env, server_command
from mcp_code_exec.commands.install import BACKUP_SUFFIX, install, uninstall

PLATFORMS = ("darwin", "win32", "linux")
# Where each host keeps its servers, under the home: written out, not computed as the code does.
FILES = {
    ("claude-desktop", "darwin"): "Library/Application Support/Claude/claude_desktop_config.json",
    ("claude-desktop", "win32"): "AppData/Roaming/Claude/claude_desktop_config.json",
    ("claude-desktop", "linux"): ".config/Claude/claude_desktop_config.json",
    **{("claude-code", platform): ".claude.json" for platform in PLATFORMS},
    ("vscode", "darwin"): "Library/Application Support/Code/User/mcp.json",
    ("vscode", "win32"): "AppData/Roaming/Code/User/mcp.json",
    ("vscode", "linux"): ".config/Code/User/mcp.json",
    **{("cursor", platform): ".cursor/mcp.json" for platform in PLATFORMS},
}
COMMAND = ["/opt/venv/bin/mcp-code-exec", "serve"]


def ours(host: str) -> dict[str, object]:
    return entry(HOSTS[host], COMMAND, {})


def leftovers(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir() if path.name.endswith((".tmp", BACKUP_SUFFIX)))


@pytest.mark.parametrize(("host", "platform"), sorted(FILES))
def test_install_merges_into_each_hosts_file_and_keeps_the_other_servers(
    host: str, platform: str, tmp_path: Path
) -> None:
    place = Place(platform, tmp_path, {})
    path = HOSTS[host].locate(place)
    assert path == tmp_path / FILES[host, platform]
    key = HOSTS[host].servers_key
    before: dict[str, Any] = {
        "theme": "dark",
        key: {"other": {"command": "npx", "args": ["-y", "other"]}},
        "numbers": [1, 2.5],
    }
    raw = json.dumps(before, indent=4).encode() + b"\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(raw)
    path.chmod(0o640)

    said = install(path, key, "python", ours(host))

    after = json.loads(path.read_text())
    assert after == {**before, key: {**before[key], "python": ours(host)}}
    assert after[key]["python"].get("type") == ("stdio" if host in ("claude-code", "vscode") else None)
    backup = path.with_name(path.name + BACKUP_SUFFIX)
    assert backup.read_bytes() == raw and str(backup) in said
    assert (path.stat().st_mode & 0o777) == 0o640 and (backup.stat().st_mode & 0o777) == 0o640
    assert path.read_text().startswith('{\n    "theme"')  # its indent, 4 spaces, kept

    installed = path.read_bytes()
    uninstall(path, key, "python")
    assert json.loads(path.read_text()) == before
    assert backup.read_bytes() == installed
    assert leftovers(path.parent) == [backup.name]


BROKEN = {
    "a broken edit": b'{"mcpServers": {,}',
    "a comment": b'{\n  // mine\n  "servers": {}\n}\n',
    "a trailing comma": b'{"mcpServers": {"a": {"command": "x"},}}',
    "not an object": b'[{"mcpServers": {}}]',
    "servers not an object": b'{"mcpServers": [], "servers": []}',
    "not UTF-8": b'{"mcpServers": {"caf\xe9": {}}}',
}


@pytest.mark.parametrize("content", BROKEN.values(), ids=BROKEN.keys())
@pytest.mark.parametrize("host", sorted(HOSTS))
def test_a_file_that_is_not_plain_json_is_refused_and_left_untouched(host: str, content: bytes, tmp_path: Path) -> None:
    path = HOSTS[host].locate(Place("linux", tmp_path, {}))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    for uninstalling in (False, True):
        with pytest.raises(InstallRefused, match="left untouched") as refused:
            if uninstalling:
                uninstall(path, HOSTS[host].servers_key, "python")
            else:
                install(path, HOSTS[host].servers_key, "python", ours(host))
        assert str(path) in str(refused.value) and "\n" not in str(refused.value)
        assert path.read_bytes() == content
    assert leftovers(path.parent) == []


def test_a_comment_is_named_as_the_reason(tmp_path: Path) -> None:
    path = tmp_path / "mcp.json"
    path.write_bytes(BROKEN["a comment"])
    with pytest.raises(InstallRefused, match=r"line 2 column 3 \(a comment: JSON with comments is not plain JSON\)"):
        install(path, "servers", "python", ours("vscode"))


def test_a_new_file_is_made_with_its_directories_and_readable_only_by_its_owner(tmp_path: Path) -> None:
    path = HOSTS["claude-desktop"].locate(Place("darwin", tmp_path, {}))
    assert install(path, "mcpServers", "python", ours("claude-desktop")) == f'wrote {path} with "python"'
    assert json.loads(path.read_text()) == {"mcpServers": {"python": ours("claude-desktop")}}
    assert (path.stat().st_mode & 0o777) == 0o600 and leftovers(path.parent) == []


def test_installing_the_same_entry_again_touches_nothing(tmp_path: Path) -> None:
    path = tmp_path / "mcp.json"
    install(path, "mcpServers", "python", ours("cursor"))
    written = path.stat().st_mtime_ns, path.read_bytes()
    assert "nothing changed" in install(path, "mcpServers", "python", ours("cursor"))
    assert (path.stat().st_mtime_ns, path.read_bytes()) == written and leftovers(tmp_path) == []


def test_another_programs_server_under_our_name_is_neither_replaced_nor_removed(tmp_path: Path) -> None:
    path = tmp_path / "claude_desktop_config.json"
    raw = b'{"mcpServers": {"python": {"command": "uvx", "args": ["some-python-server"]}}}'
    path.write_bytes(raw)
    with pytest.raises(InstallRefused, match="not mcp-code-exec; it was left untouched"):
        install(path, "mcpServers", "python", ours("claude-desktop"))
    with pytest.raises(InstallRefused, match="not mcp-code-exec"):
        uninstall(path, "mcpServers", "python")
    install(path, "mcpServers", "sandbox", ours("claude-desktop"))  # --name
    assert json.loads(path.read_text())["mcpServers"]["python"]["command"] == "uvx"


def test_an_older_entry_of_ours_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "mcp.json"
    old = {"command": "/old/python", "args": ["-m", "mcp_code_exec", "serve"]}
    path.write_text(json.dumps({"mcpServers": {"python": old}}))
    install(path, "mcpServers", "python", ours("cursor"))
    assert json.loads(path.read_text())["mcpServers"]["python"] == ours("cursor")


def test_the_files_layout_is_kept_tabs_crlf_and_a_bom(tmp_path: Path) -> None:
    path = tmp_path / "mcp.json"
    path.write_bytes(b'\xef\xbb\xbf{\r\n\t"servers": {}\r\n}')
    install(path, "servers", "python", ours("vscode"))
    written = path.read_bytes()
    assert written.startswith(b'\xef\xbb\xbf{\r\n\t"servers": {\r\n\t\t"python": {') and not written.endswith(b"\n")
    assert b"\n" not in written.replace(b"\r\n", b"")


def test_a_linked_file_stays_a_link_and_its_target_is_rewritten(tmp_path: Path) -> None:
    target = tmp_path / "dotfiles" / "claude.json"
    target.parent.mkdir()
    target.write_text('{"numStartups": 3}')
    link = tmp_path / ".claude.json"
    link.symlink_to(target)
    install(link, "mcpServers", "python", ours("claude-code"))
    assert link.is_symlink() and json.loads(target.read_text())["mcpServers"]["python"] == ours("claude-code")
    assert (target.parent / f"claude.json{BACKUP_SUFFIX}").read_text() == '{"numStartups": 3}'


def test_the_environment_moves_the_files_as_the_hosts_read_it(tmp_path: Path) -> None:
    environ = {"XDG_CONFIG_HOME": str(tmp_path / "xdg"), "CLAUDE_CONFIG_DIR": "~/.claude-work"}
    linux = Place("linux", tmp_path, environ)
    assert HOSTS["claude-desktop"].locate(linux) == tmp_path / "xdg" / "Claude" / "claude_desktop_config.json"
    assert HOSTS["vscode"].locate(linux) == tmp_path / "xdg" / "Code" / "User" / "mcp.json"
    assert HOSTS["claude-code"].locate(linux) == tmp_path / ".claude-work" / ".claude.json"
    roaming = Place("win32", tmp_path, {"APPDATA": str(tmp_path / "Roaming")})
    assert HOSTS["vscode"].locate(roaming) == tmp_path / "Roaming" / "Code" / "User" / "mcp.json"
    assert HOSTS["claude-desktop"].locate(Place("linux", tmp_path, {"XDG_CONFIG_HOME": "relative"})) == (
        tmp_path / ".config" / "Claude" / "claude_desktop_config.json"
    )


def test_claude_desktop_installed_as_a_windows_package_reads_the_packages_own_copy(tmp_path: Path) -> None:
    place = Place("win32", tmp_path, {"LOCALAPPDATA": str(tmp_path / "Local")})
    first = tmp_path / "Local" / "Packages" / "Claude_pzs8sxrjxfjjc" / "LocalCache" / "Roaming" / "Claude"
    first.mkdir(parents=True)
    assert HOSTS["claude-desktop"].locate(place) == first / "claude_desktop_config.json"
    second = tmp_path / "Local" / "Packages" / "Claude_other" / "LocalCache" / "Roaming" / "Claude"
    second.mkdir(parents=True)
    with pytest.raises(InstallRefused, match="several Claude Desktop packages"):
        HOSTS["claude-desktop"].locate(place)
    (second / "claude_desktop_config.json").write_text("{}")
    assert HOSTS["claude-desktop"].locate(place) == second / "claude_desktop_config.json"


def test_the_entry_carries_the_config_and_the_engine_only_when_they_are_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert entry_env(None, {"PATH": "/usr/bin", "MCP_CODE_EXEC_CONFIG": ""}) == {}
    assert "env" not in entry(HOSTS["cursor"], COMMAND, {})
    (tmp_path / "config.toml").write_text("engine_wait_s = 120\n")
    monkeypatch.chdir(tmp_path)
    assert entry_env("config.toml", {"DOCKER_HOST": "unix:///run/colima.sock", "DOCKER_CONFIG": "docker"}) == {
        "MCP_CODE_EXEC_CONFIG": str(tmp_path / "config.toml"),
        "DOCKER_HOST": "unix:///run/colima.sock",
        "DOCKER_CONFIG": str(tmp_path / "docker"),
    }
    assert entry_env(None, {"MCP_CODE_EXEC_CONFIG": "config.toml"}) == {
        "MCP_CODE_EXEC_CONFIG": str(tmp_path / "config.toml")
    }
    (tmp_path / "broken.toml").write_text("engine_wait_s = \n")
    for missing in ("broken.toml", "absent.toml"):
        with pytest.raises(InstallRefused, match=f"the configuration {tmp_path / missing} cannot be used"):
            entry_env(missing, {})


def test_the_entry_starts_this_installation_as_a_desktop_host_would() -> None:
    command = server_command({})
    assert os.path.isabs(command[0]) and command[-1] == "serve"
    assert server_command({}, scripts=[]) == [sys.executable, "-I", "-m", "mcp_code_exec", "serve"]
    with pytest.raises(InstallRefused, match=r"no command starts this installation .*/nowhere/python"):
        server_command({}, scripts=[], python="/nowhere/python")


def test_the_entry_never_imports_a_module_planted_in_the_hosts_working_directory(tmp_path: Path) -> None:
    """A host starts its servers in a directory of its choosing, which a writable mount may share
    with sandboxes: neither form of the entry may look for a module there."""
    marker = tmp_path / "planted-code-ran"
    planted = f"open({str(marker)!r}, 'a').write(__name__)\n"
    (tmp_path / "mcp_code_exec").mkdir()
    (tmp_path / "mcp_code_exec" / "__init__.py").write_text(planted)
    (tmp_path / "argparse.py").write_text(planted)
    for command in (server_command({}), server_command({}, scripts=[])):
        done = subprocess.run([*command[:-1], "--version"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert done.stdout.split() == ["mcp-code-exec", __version__] and not marker.exists(), done.stderr
    # The plant is one that works: plain `python -m`, as entries were once written by hand, runs it.
    subprocess.run([sys.executable, "-m", "mcp_code_exec", "--version"], cwd=tmp_path, capture_output=True, timeout=60)
    assert marker.exists()


def test_the_command_line_prints_writes_and_removes_the_entry_in_the_users_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("XDG_CONFIG_HOME", "CLAUDE_CONFIG_DIR", "MCP_CODE_EXEC_CONFIG", "DOCKER_HOST", "DOCKER_CONTEXT"):
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / ".claude.json"
    path.write_text('{"mcpServers": {"other": {"command": "x"}}}')

    assert main(["install", "claude-code", "--print"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["type"] == "stdio" and printed["args"] == ["serve"]
    assert json.loads(path.read_text()) == {"mcpServers": {"other": {"command": "x"}}}  # --print wrote nothing

    assert main(["install", "claude-code", "--name", "sandbox"]) == 0
    assert "restart Claude Code" in capsys.readouterr().err
    assert json.loads(path.read_text())["mcpServers"] == {"other": {"command": "x"}, "sandbox": printed}
    assert main(["uninstall", "claude-code", "--name", "sandbox"]) == 0
    assert capsys.readouterr().err.startswith(f'mcp-code-exec: removed "sandbox" from {path}')
    assert json.loads(path.read_text())["mcpServers"] == {"other": {"command": "x"}}

    path.write_text("{'mcpServers': {}}")
    assert main(["install", "claude-code"]) == 1
    assert capsys.readouterr().err == (
        f"mcp-code-exec: {path} is not plain JSON (Expecting property name enclosed in double quotes at line 1 "
        "column 2); it was left untouched: fix it, or add the entry by hand (`--print` prints it)\n"
    )
