"""The benchmark command runs end to end on the real engine (its timings are not asserted here)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import anyio
import pytest
from _local_service import live_service_pids

from mcp_code_exec.commands.bench.report import config_for_subprocess, to_toml
from mcp_code_exec.config.settings import Config
from mcp_code_exec.runtime.base import LABEL_KIND
from mcp_code_exec.sandbox.ownership import LEDGER_KIND

pytestmark = pytest.mark.anyio
PROFILER = Path(__file__).resolve().parents[2] / "bench" / "profile_agent.py"
STDIO_STEPS = Path(__file__).resolve().parents[2] / "bench" / "stdio_steps.py"

METRICS = {
    "print",
    "print_spaced",
    "science",
    "session",
    "new_session",
    "files",
    "write_file",
    "read_file",
    "throughput",
    "memory",
    "memory_own",
    "docker_run",
    "docker_exec",
    "stdio_print",
    "stdio_handshake",
    "stdio_first_call",
    "stdio_warm_handshake",
    "stdio_warm_first_call",
    "code_mode_direct",  # mcp-server-time is a dev dependency: code mode's broker overhead is measured
    "code_mode_call",
    "code_mode_overhead",
    "code_mode_cell",
    "snapshot_100mb",
    "restore_100mb",
    "fork_100mb",
    "resume_paused",
    "paused_containers",
}


async def quota_ledgers() -> set[str]:
    listed = await anyio.run_process(["docker", "volume", "ls", "-q", "--filter", f"label={LABEL_KIND}={LEDGER_KIND}"])
    return set(listed.stdout.decode().split())


async def test_bench_quick_prints_a_table_and_writes_every_metric_as_json(tmp_path: Path, config: Config) -> None:
    # With quotas and an audit log on, as an operator's config may have them: the bench's counts are
    # its own, and go with it.
    limits = {"runs_per_minute": 100_000, "cpu_s_per_hour": 100_000.0, "package_installs_per_day": 1000}
    quotas = config.quotas.model_copy(update={"default": config.quotas.default.model_copy(update=limits)})
    audit = config.audit.model_copy(update={"path": str(tmp_path / "audit.log")})
    config = config.model_copy(update={"quotas": quotas, "audit": audit})
    config_path = tmp_path / "config.toml"
    config_path.write_text(to_toml(config_for_subprocess(config)))
    ledgers_before = await quota_ledgers()
    json_path = tmp_path / "bench.json"
    command = [sys.executable, "-m", "mcp_code_exec", "bench", "--quick", "--json", str(json_path)]
    command += ["--config", str(config_path)]
    with anyio.fail_after(240):
        done = await anyio.run_process(command, check=False)
    stdout = done.stdout.decode()
    assert done.returncode == 0, (stdout, done.stderr.decode()[-3000:])
    for row in (
        "metric",
        "p50",
        "p90",
        "p99",
        "stateless print(1+1)",
        "docker run",
        "docker exec",
        "throughput",
        "mcp_tools",
    ):
        assert row in stdout
    report = json.loads(json_path.read_text())
    assert report["cores"] >= 1 and report["date"] and report["quick"] is True
    assert report["cpu_steal_percent"] is None or 0 <= report["cpu_steal_percent"] <= 100
    assert report["config"]["image"] == config.image
    assert set(report["metrics"]) >= METRICS
    for key, metric in report["metrics"].items():
        assert metric["failures"] == 0, key
        if key in ("throughput",):
            assert metric["value"] > 0
        elif key == "paused_containers":  # a count, not a time: the paused sessions' containers
            assert metric["value"] == 0, metric
        elif key == "code_mode_overhead":
            assert metric["value"] is not None and metric["target"] == 5.0
        elif "value" in metric:  # a single figure (memory, CPU per run), measured once
            assert metric["value"] > 0, (key, metric)
        else:
            assert metric.get("n", 0) >= 1 and metric["p50"] is not None and metric["p99"] is not None, (key, metric)
    for ratio in ("docker_run_over_warm_p50", "docker_exec_over_warm_p50"):
        assert report["ratios"][ratio]["value"] is not None
    assert await quota_ledgers() <= ledgers_before
    assert '"tool":"run_python"' in (tmp_path / "audit.log").read_text()


async def run_script(script: Path, tmp_path: Path, config: Config, *args: str, bound_s: float) -> str:
    """A script of bench/ run on the test configuration, to its successful end; its output."""
    config_path = tmp_path / "config.toml"
    config_path.write_text(to_toml(config_for_subprocess(config)))
    with anyio.fail_after(bound_s):
        done = await anyio.run_process([sys.executable, str(script), "--config", str(config_path), *args], check=False)
    stdout = done.stdout.decode()
    assert done.returncode == 0, (stdout, done.stderr.decode()[-3000:])
    return stdout


async def test_the_agent_profiler_reports_the_page_faults_of_a_stateless_run(tmp_path: Path, config: Config) -> None:
    stdout = await run_script(PROFILER, tmp_path, config, "--runs", "3", "--pause", "0", bound_s=120)
    cell_faults = next(line for line in stdout.splitlines() if "while running the cell" in line)
    assert float(cell_faults.split()[-3]) > 0  # p50 of a real count: a forked run always copies pages
    memory = next(line for line in stdout.splitlines() if "docker stats' figure" in line)
    assert float(memory.split()[-1]) > 0  # the idle container's memory, read as the bench reads it


async def test_the_stdio_steps_script_stamps_every_step_of_each_call_in_the_local_service(
    tmp_path: Path, config: Config
) -> None:
    # Five seconds of warm-up calls fill the pools; then every measured call must have been stamped
    # at every place, or the script fails.
    stdout = await run_script(STDIO_STEPS, tmp_path, config, "--calls", "5", "--rounds", "1", bound_s=180)
    assert "5 calls after" in stdout, stdout
    steps = [line for line in stdout.splitlines() if ": p50 " in line]
    assert len(steps) == 6, stdout
    assert all(float(line.split("p50 ")[1].split(" ms")[0]) > 0 for line in steps), stdout
    assert live_service_pids(Path(os.environ["MCP_CODE_EXEC_RUNTIME_DIR"])) == []  # it stopped its service
