"""``mcp-code-exec bench``: run every measurement, print the table, write the JSON."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import secrets
import sys
import time

import anyio

from ...config.cluster import EngineSettings
from ...config.settings import Config
from ...errors import SandboxError
from ...runtime.docker.engine import DockerEngine
from ...sandbox import ledgers
from ...service.facade import SandboxService
from .calls import PRINT, SCIENCE
from .code_mode import broker_overhead, with_code_mode
from .egress import egress
from .measure import Bench, Plan
from .outside import baselines, stdio
from .report import config_for_subprocess, cpu_times, ratios, steal_percent, table
from .scale import ScalePlan, one_engine, scale
from .sessions import durable_scope, durable_sessions


async def bench(config: Config, quick: bool, json_path: str | None, scale_out: bool = False) -> int:
    """The usual figures on one engine (the first of several); with ``scale_out``, the scale-out
    figures instead (see ``scale``)."""
    plan = Plan.make(quick)
    config = config if scale_out else with_code_mode(one_engine(config))
    # The bench's own sessions end with it, and it takes over no one's; its quota counts (where the
    # config has quotas) are its scope's, never a user's, and go with it.
    scope = f"bench-{secrets.token_hex(6)}"
    sessions = config.sessions.model_copy(update={"durable": False, "scope": scope})
    config = config.model_copy(update={"sessions": sessions})
    runner = Bench(config, plan)
    load_before = os.getloadavg()
    cpu_before = cpu_times()
    began = time.perf_counter()
    kind = ("quick" if quick else "full") + (", scale-out" if scale_out else "")
    print(f"mcp-code-exec bench ({kind}): {os.cpu_count()} cores, load {load_before[0]:.2f}", flush=True)
    try:
        if scale_out:
            await scale(runner, ScalePlan.make(quick))
        else:
            await _usual(runner)
    finally:
        with anyio.CancelScope(shield=True):
            await _remove_quota_ledgers(config, scope)
    load_after = os.getloadavg()
    steal = steal_percent(cpu_before, cpu_times())
    print()
    print(table(runner.metrics, with_ratios=not scale_out))
    print(f"\nwall time {time.perf_counter() - began:.1f} s; load average {load_before[0]:.2f} -> {load_after[0]:.2f}")
    if steal is not None:
        print(f"CPU time taken by the hypervisor for other guests (steal): {steal:.1f}% of the run")
    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cores": os.cpu_count(),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "load_average": {"before": load_before, "after": load_after},
        "cpu_steal_percent": steal,
        "quick": quick,
        "scale": scale_out,
        "plan": dataclasses.asdict(plan),
        "config": config_for_subprocess(config),
        "metrics": {key: metric.as_json() for key, metric in runner.metrics.items()},
        "ratios": ratios(runner.metrics),
        "code": {"print": PRINT, "science": SCIENCE},
    }
    if json_path:
        await anyio.Path(json_path).write_text(json.dumps(report, indent=2))
        print(f"JSON written to {json_path}")
    failures = sum(metric.failures for metric in runner.metrics.values())
    if failures:
        print(f"mcp-code-exec: {failures} benchmark calls failed", file=sys.stderr)
        return 1
    return 0


async def _connect(config: Config, engine: EngineSettings | None) -> DockerEngine:
    """``engine`` of the config's ``[cluster]`` (a tcp:// engine with TLS), or its one engine (None)."""
    url = config.docker_host if engine is None else engine.url
    cert_path = None if engine is None or engine.cert_path is None else str(engine.cert_path)
    return await DockerEngine.connect(url, cert_path=cert_path, disk_image=config.image)


async def _remove_quota_ledgers(config: Config, scope: str) -> None:
    """The quota ledgers the bench's services kept (its scope's, and its durable service's)."""
    engines: list[EngineSettings | None] = [*config.cluster.engines] or [None]
    for engine_settings in engines:
        try:
            engine = await _connect(config, engine_settings)
            try:
                await ledgers.remove_scopes(engine, (scope, durable_scope(scope)))
            finally:
                await engine.aclose()
        except SandboxError as exc:
            print(f"mcp-code-exec: the bench's quota ledgers were left: {exc}", file=sys.stderr)


async def _usual(runner: Bench) -> None:
    config = runner.config
    engine = await _connect(config, config.cluster.engines[0] if config.cluster.engines else None)
    async with SandboxService.start(config, engine=engine) as service:  # closes the engine at the end
        await service.wait_ready()
        await runner.in_memory(service)
        await runner.memory(service, engine)
        await baselines(runner, service, engine)
        await broker_overhead(runner, service)
        await durable_sessions(runner, engine, runner.plan.paused_sessions)  # a durable service of its own
    await egress(runner)  # a service of its own, with [egress] on
    await stdio(runner)
