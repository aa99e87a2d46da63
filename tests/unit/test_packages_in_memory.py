"""The service's side of `pip install` over the in-memory engine: the wheels go in before the code,
a refusal runs nothing, and a request seen before is not resolved again. pip itself is played here
(``wheels.resolve_with``); tests/engine/test_packages.py runs the real one."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from _fake_agent import FakeAgent
from test_service_in_memory import running, settings

from mcp_code_exec.errors import NoDistribution
from mcp_code_exec.service.packages import wheels

pytestmark = pytest.mark.anyio
WHEEL = "humanize-4.17.0-py3-none-any.whl"


@pytest.fixture
def index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[list[str]]]:
    """A wheel already in the cache, and a resolver that knows only it; yields the resolver's calls."""
    cache = tmp_path / "wheels" / "x86_64"
    cache.mkdir(parents=True)
    (cache / WHEEL).write_bytes(b"PK wheel bytes")
    digest = hashlib.sha256(b"PK wheel bytes").hexdigest()
    calls: list[list[str]] = []

    async def resolve(run: Any, requirements: list[str], arch: str, **_: Any) -> list[wheels.Pin]:
        calls.append(list(requirements))
        if list(requirements) != ["humanize"]:
            raise NoDistribution("no", requirements[0])
        return [wheels.Pin("humanize", "4.17.0", (digest,)), wheels.Pin("numpy", "2.4.6", ("0" * 64,))]

    async def no_versions(run: Any, name: str) -> None:
        return None

    monkeypatch.setattr(wheels, "resolve_with", resolve)
    monkeypatch.setattr(wheels, "index_versions_with", no_versions)
    yield calls


def config(tmp_path: Path, **packages: Any) -> Any:
    return settings(packages={"cache_dir": str(tmp_path / "wheels"), **packages}, pool={"session_spares": 0})


def ops(agent: FakeAgent) -> list[str]:
    return [f"{r['op']} {r.get('path', '')}".strip() for r in agent.requests if r["op"] in ("exec", "write_chunk")]


async def test_the_wheels_go_in_before_the_code_and_a_second_session_reuses_the_resolution(
    tmp_path: Path, index: list[list[str]]
) -> None:
    agent = FakeAgent()
    async with running(agent, config(tmp_path)) as (service, _):
        for _ in range(2):
            sid = (await service.new_session("me")).session_id
            result = await service.run("me", "%pip install humanize\nimport humanize", session_id=sid)
            assert result.status == "ok", result.error
            await service.close_session("me", sid)
        # numpy is in the image's lock at that version: resolved, never copied in
        assert ops(agent) == [f"write_chunk .wheelhouse/{WHEEL}", "exec", f"write_chunk .wheelhouse/{WHEEL}", "exec"]
        assert index == [["humanize"]]
        stats = service.packages.stats
        assert (stats.resolutions, stats.resolution_hits, stats.downloaded, stats.shipped) == (1, 1, 0, 2)


async def test_a_denied_package_runs_nothing_of_the_cell(tmp_path: Path, index: list[list[str]]) -> None:
    agent = FakeAgent()
    async with running(agent, config(tmp_path, deny=["humanize"])) as (service, _):
        sid = (await service.new_session("me")).session_id
        result = await service.run("me", "print('ran')\n!pip install humanize", session_id=sid)
        assert result.status == "error" and result.error is not None
        assert result.error.type == "PackageError"
        assert result.error.message.endswith(
            "denied by this server's policy ([packages] deny). Nothing of the cell was run."
        )
        assert result.session_id == sid
        assert ops(agent) == [] and index == []


async def test_a_package_the_index_lacks_runs_nothing_and_says_so(tmp_path: Path, index: list[list[str]]) -> None:
    agent = FakeAgent()
    async with running(agent, config(tmp_path)) as (service, _):
        result = await service.run("me", "print('ran')\npip install nosuch")
        assert result.status == "error" and result.error is not None
        assert "no such package on the server's index: nosuch" in result.error.message
        assert ops(agent) == []
        assert (await service.run("me", "print(2)")).stdout == "ran print(2)\n"  # the container is still fine


async def test_packages_of_a_stateless_run_are_copied_in_and_installed_before_its_code(
    tmp_path: Path, index: list[list[str]]
) -> None:
    agent = FakeAgent()
    async with running(agent, config(tmp_path)) as (service, _):
        result = await service.run("me", "import humanize", packages=["humanize"])
        assert result.status == "ok"
        assert ops(agent) == [f"write_chunk .wheelhouse/{WHEEL}", "exec"]
        executed = next(r for r in agent.requests if r["op"] == "exec")
        assert executed["options"]["install"] == ["humanize"]
        plain = await service.run("me", "print(1)")
        assert plain.status == "ok"
        assert "install" not in [r for r in agent.requests if r["op"] == "exec"][-1]["options"]


async def test_installs_turned_off_refuse_the_cell(tmp_path: Path, index: list[list[str]]) -> None:
    agent = FakeAgent()
    async with running(agent, config(tmp_path, enabled=False)) as (service, _):
        result = await service.run("me", "%pip install humanize")
        assert result.error is not None and "package installs are disabled" in result.error.message
        assert (await service.run("me", "print(1)")).status == "ok"  # code without pip lines is not affected


async def test_getting_the_packages_counts_against_the_runs_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def slow_resolve(run: Any, requirements: list[str], arch: str, **_: Any) -> list[wheels.Pin]:
        await anyio.sleep_forever()  # an index that does not answer
        raise AssertionError("unreachable")

    monkeypatch.setattr(wheels, "resolve_with", slow_resolve)
    agent = FakeAgent()
    async with running(agent, config(tmp_path)) as (service, _):
        result = await service.run("me", "%pip install humanize", timeout=0.5)
        assert result.status == "error" and result.error is not None
        assert "took longer than the run's timeout (0.5 s)" in result.error.message
        assert ops(agent) == []
