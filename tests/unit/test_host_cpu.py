"""A local engine's container CPU read from its cgroup on this host (no wait for the stats collector)."""

from __future__ import annotations

from pathlib import Path

from mcp_code_exec.runtime.docker.stats import host_cpu_s

ID = "ab" * 32


def test_the_cgroup_v1_counter_of_either_driver_is_read_in_seconds(tmp_path: Path) -> None:
    for where in (f"cpuacct/docker/{ID}", f"cpuacct/system.slice/docker-{ID}.scope"):
        root = tmp_path / where.replace("/", "_")
        (root / where).mkdir(parents=True)
        (root / where / "cpuacct.usage").write_text("2500000000\n")
        assert host_cpu_s(ID, root) == 2.5


def test_the_cgroup_v2_usage_is_read_in_seconds(tmp_path: Path) -> None:
    where = tmp_path / f"system.slice/docker-{ID}.scope"
    where.mkdir(parents=True)
    (where / "cpu.stat").write_text("usage_usec 1500000\nuser_usec 1000000\nsystem_usec 500000\n")
    assert host_cpu_s(ID, tmp_path) == 1.5


def test_no_cgroup_here_or_a_name_that_is_no_container_id_leaves_it_to_the_engine(tmp_path: Path) -> None:
    assert host_cpu_s(ID, tmp_path) is None
    (tmp_path / "cpuacct/docker/x").mkdir(parents=True)
    (tmp_path / "cpuacct/docker/x/cpuacct.usage").write_text("1\n")
    assert host_cpu_s("x", tmp_path) is None  # only a full id names a path (no ../ from anyone)
    assert host_cpu_s("../" + ID, tmp_path) is None
