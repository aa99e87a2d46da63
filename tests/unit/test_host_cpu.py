"""A local engine's container CPU read from its cgroup on this host (no wait for the stats collector)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mcp_code_exec.runtime.docker.stats import HostCpuCounters

pytestmark = pytest.mark.anyio
ID = "ab" * 32


async def test_the_cgroup_v1_counter_of_either_driver_is_read_in_seconds(tmp_path: Path) -> None:
    for where in (f"cpuacct/docker/{ID}", f"cpuacct/system.slice/docker-{ID}.scope"):
        root = tmp_path / where.replace("/", "_")
        (root / where).mkdir(parents=True)
        (root / where / "cpuacct.usage").write_text("2500000000\n")
        assert await HostCpuCounters(root).figure(ID) == 2.5


async def test_the_cgroup_v2_usage_is_read_in_seconds(tmp_path: Path) -> None:
    where = tmp_path / f"system.slice/docker-{ID}.scope"
    where.mkdir(parents=True)
    (where / "cpu.stat").write_text("usage_usec 1500000\nuser_usec 1000000\nsystem_usec 500000\n")
    assert await HostCpuCounters(tmp_path).figure(ID) == 1.5


async def test_no_cgroup_here_or_a_name_that_is_no_container_id_leaves_it_to_the_engine(tmp_path: Path) -> None:
    counters = HostCpuCounters(tmp_path)
    assert await counters.figure(ID) is None
    (tmp_path / "cpuacct/docker/x").mkdir(parents=True)
    (tmp_path / "cpuacct/docker/x/cpuacct.usage").write_text("1\n")
    assert await counters.figure("x") is None  # only a full id names a path (no ../ from anyone)
    assert await counters.figure("../" + ID) is None


async def test_a_counter_opened_once_reads_what_it_says_now_and_few_stay_open(tmp_path: Path) -> None:
    counters = HostCpuCounters(tmp_path, keep=2)
    ids = [c * 64 for c in "abc"]
    for container_id in ids:
        (tmp_path / f"cpuacct/docker/{container_id}").mkdir(parents=True)
        (tmp_path / f"cpuacct/docker/{container_id}/cpuacct.usage").write_text("1000000000\n")
    assert await counters.figure(ids[0]) == 1.0
    (tmp_path / f"cpuacct/docker/{ids[0]}/cpuacct.usage").write_text("3000000000\n")  # the same file, rewritten
    assert counters.read(ids[0]) == 3.0  # held: read again without opening
    assert await counters.figure(ids[1]) == 1.0 and await counters.figure(ids[2]) == 1.0
    assert counters.read(ids[0]) is None  # the least recently read was let go
    counters.forget(ids[1])
    assert counters.read(ids[1]) is None and counters.read(ids[2]) == 1.0
    counters.close()
    assert await counters.figure(ids[2]) is None  # closed: nothing is opened again


async def test_a_counter_that_cannot_be_read_is_let_go_without_trying_again(tmp_path: Path) -> None:
    where = tmp_path / f"cpuacct/docker/{ID}/cpuacct.usage"
    where.mkdir(parents=True)  # opens (a directory), but every read fails
    counters = HostCpuCounters(tmp_path)
    assert await counters.figure(ID) is None
    assert counters.read(ID) is None
