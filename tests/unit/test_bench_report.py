"""The benchmark's arithmetic and its hand-off of the config to a stdio server (no engine needed)."""

from __future__ import annotations

from pathlib import Path

from mcp_code_exec.commands.bench.report import Metric, config_for_subprocess, percentile, steal_percent, table, to_toml
from mcp_code_exec.config.settings import load_config


def test_percentiles_interpolate_between_samples() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([float(n) for n in range(101)], 90) == 90.0


def test_steal_is_the_share_of_elapsed_cpu_time_given_to_other_guests() -> None:
    before = [100, 0, 50, 800, 0, 0, 0, 50]
    after = [150, 0, 70, 900, 0, 0, 0, 80]  # 200 ticks elapsed, 30 of them stolen
    assert steal_percent(before, after) == 15.0
    assert steal_percent(None, after) is None
    assert steal_percent(after, after) is None


def test_the_config_round_trips_through_the_toml_given_to_the_stdio_server(tmp_path: Path) -> None:
    config = load_config(environ={}, overrides={"pool": {"size": 3}, "limits": {"memory_mb": 384}})
    path = tmp_path / "config.toml"
    path.write_text(to_toml(config_for_subprocess(config)))
    again = load_config(path, environ={})
    assert again.image == config.image
    assert again.limits == config.limits
    assert again.pool == config.pool


def test_several_engines_round_trip_through_that_toml_too(tmp_path: Path) -> None:
    engines = ["unix:///var/run/docker.sock", {"url": "ssh://deploy@host2", "name": "host2", "capacity": 2.5}]
    config = load_config(environ={}, overrides={"cluster": {"engines": engines, "health_interval_s": 1}})
    path = tmp_path / "config.toml"
    path.write_text(to_toml(config_for_subprocess(config)))
    assert load_config(path, environ={}).cluster == config.cluster


def test_the_table_marks_targets_and_gives_the_ratios_to_the_warm_print() -> None:
    metrics = {
        "print": Metric("stateless print(1+1)", "ms", samples=[4.0, 6.0], target=5.0),
        "throughput": Metric("throughput", "runs/s", value=200.0, target=150.0, better="higher"),
        "docker_run": Metric("docker run", "ms", samples=[250.0]),
    }
    lines = table(metrics).splitlines()
    assert any(line.startswith("stateless print(1+1) [ms]") and line.endswith("pass") for line in lines)
    assert any(line.startswith("throughput [runs/s]") and "200.0" in line and line.endswith("pass") for line in lines)
    ratio = next(line for line in lines if line.startswith("docker run p50 / warm print p50"))
    assert "50.0x" in ratio and ratio.endswith("pass")
    assert "-x" in next(line for line in lines if line.startswith("docker exec p50"))  # not measured


def test_the_scale_section_measures_the_first_engine_alone_then_all_with_pools_per_engine() -> None:
    from mcp_code_exec.commands.bench.scale import ScalePlan, engine_sets

    engines = ["unix:///var/run/docker.sock", "unix:///run/b.sock", "ssh://host3"]
    config = load_config(environ={}, overrides={"cluster": {"engines": engines}, "pool": {"size": 2, "max_size": 5}})
    (one, alone), (three, everyone) = engine_sets(config, ScalePlan.make(quick=False))
    assert (one, alone.docker_host, alone.cluster.engines) == (1, "unix:///var/run/docker.sock", [])
    assert (three, everyone.cluster) == (3, config.cluster)
    assert (alone.pool.size, alone.pool.max_size, everyone.pool.size, everyone.pool.max_size) == (2, 5, 6, 15)
    assert everyone.pool.max_runs_per_client == 0 and everyone.sessions.max_sessions > 100
    ((single, same),) = engine_sets(load_config(environ={}), ScalePlan.make(quick=True))
    assert single == 1 and same.cluster.engines == [] and same.docker_host is None
