"""``mcp-code-exec bench --scale``: the service over one engine, then over every configured engine.

For the first engine of ``[cluster] engines`` alone (on the one-engine path, as a server without a
``[cluster]`` section runs), then for all of them: stateless throughput with 8 and with 32
in-memory clients, ``new_session`` with no other session open and with ``idle_sessions`` open,
and the idle memory of a session's container. Pools are per engine: each set gets the configured
pool size (and spares) times its number of engines, so a set of three has three times the warm
containers; one client identity may run any number of runs at once (``max_runs_per_client = 0``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import anyio
from mcp import Client

from ...config.settings import Config
from ...config.units import MIB
from ...mcp_server import build_server
from ...runtime.base import ContainerEngine
from ...runtime.cluster import ClusterEngine
from ...runtime.docker.engine import DockerEngine
from ...service.facade import SandboxService
from .calls import timed_new_sessions
from .measure import Bench
from .report import Metric, percentile

IDLE_OWNER = "bench-idle"


@dataclass(frozen=True)
class ScalePlan:
    """How much of each (the throughput runs last as long as the bench's plan says)."""

    idle_sessions: int  # sessions open during the second new_session measurement
    new_sessions: int  # samples of new_session at each level
    memory_samples: int  # session containers whose memory is read

    @classmethod
    def make(cls, quick: bool) -> ScalePlan:
        return cls(10, 3, 5) if quick else cls(100, 15, 20)


def one_engine(config: Config) -> Config:
    """The config on its first engine alone: the one-engine path (``docker_host``) for a local or ssh
    engine, a cluster of one for a tcp:// engine (its TLS files)."""
    if not config.cluster.engines:
        return config
    first = config.cluster.engines[0]
    if first.cert_path is not None:
        return config.model_copy(update={"cluster": config.cluster.model_copy(update={"engines": [first]})})
    alone = config.cluster.model_copy(update={"engines": []})
    return config.model_copy(update={"docker_host": first.url, "cluster": alone})


def engine_sets(config: Config, plan: ScalePlan) -> list[tuple[int, Config]]:
    """(number of engines, config): the first engine alone, then all of them (when there are several)."""
    sets = [(1, one_engine(config))]
    if len(config.cluster.engines) > 1:
        sets.append((len(config.cluster.engines), config))
    sessions = plan.idle_sessions + plan.new_sessions + 4
    found = []
    for count, each in sets:
        pool = each.pool.model_copy(
            update={
                "size": each.pool.size * count,
                "max_size": each.pool.max_size * count,
                "session_spares": max(1, each.pool.session_spares) * count,
                "max_runs_per_client": 0,
            }
        )
        disk = sessions * each.limits.session_data_mb  # one identity opens them all
        limits = each.sessions.model_copy(update={"max_sessions": sessions, "max_per_client": sessions})
        quotas = each.quotas.model_copy(update={"default": each.quotas.default.model_copy(update={"stored_mb": disk})})
        found.append((count, each.model_copy(update={"pool": pool, "sessions": limits, "quotas": quotas})))
    return found


async def scale(bench: Bench, plan: ScalePlan) -> None:
    for count, config in engine_sets(bench.config, plan):
        await _one_set(bench, count, config, plan)


async def _one_set(bench: Bench, count: int, config: Config, plan: ScalePlan) -> None:
    label = f"{count} engine{'s' if count > 1 else ''}: "
    print(f"scale: {label}starting", flush=True)
    async with SandboxService.start(config) as service:
        await service.wait_ready()
        server = build_server(service)
        for clients in (8, 32):
            await bench.throughput(service, server, clients, key=f"scale{count}_throughput_{clients}", label=label)
        opened = bench.metric(f"scale{count}_new_session_0", f"{label}new_session, 0 open")
        await _new_sessions(opened, service, server, plan)
        idle = await _open_idle(service, plan.idle_sessions)
        try:
            key, name = f"scale{count}_new_session_{plan.idle_sessions}", f"{label}new_session, {len(idle)} open"
            await _new_sessions(bench.metric(key, name), service, server, plan)
            memory = bench.metric(f"scale{count}_session_memory", f"{label}idle memory per session", "MiB")
            await _session_memory(memory, service, idle, plan)
        finally:
            await _close_all(service, IDLE_OWNER, idle)


async def _new_sessions(metric: Metric, service: SandboxService, server: Any, plan: ScalePlan) -> None:
    """``new_session`` through an MCP client, each with a warm spare ready (the wait is not timed)."""
    async with Client(server) as client:
        samples, failures = await timed_new_sessions(client, service, plan.new_sessions)
    metric.samples += samples
    metric.failures += failures
    metric.note = _placement(service)


async def _open_idle(service: SandboxService, count: int) -> list[str]:
    """``count`` sessions, opened four at a time (each is a container start: about a second of CPU)."""
    opened: list[str] = []
    limit = anyio.Semaphore(4)

    async def one() -> None:
        async with limit:
            opened.append((await service.new_session(IDLE_OWNER)).session_id)

    with anyio.fail_after(60 + 30 * count):
        async with anyio.create_task_group() as tg:
            for _ in range(count):
                tg.start_soon(one)
    return opened


async def _close_all(service: SandboxService, owner: str, session_ids: list[str]) -> None:
    limit = anyio.Semaphore(8)

    async def one(session_id: str) -> None:
        async with limit:
            await service.close_session(owner, session_id)

    with anyio.CancelScope(shield=True), anyio.move_on_after(300):
        async with anyio.create_task_group() as tg:
            for session_id in session_ids:
                tg.start_soon(one, session_id)


async def _session_memory(metric: Metric, service: SandboxService, idle: list[str], plan: ScalePlan) -> None:
    """Memory of idle sessions' containers, as ``docker stats`` shows it (usage less page cache)."""
    raw: list[float] = []
    for session_id in idle[: plan.memory_samples]:
        sandbox = service.sessions.get(session_id, IDLE_OWNER).sandbox
        engine = None if sandbox is None else _docker_engine(service.engine, sandbox.container_id)
        if sandbox is None or engine is None:
            metric.failures += 1
            continue
        memory = await engine.memory_usage(sandbox.container_id)
        metric.samples.append(memory.docker_stats / MIB)
        raw.append(memory.usage / MIB)
    metric.note = f"raw cgroup usage p50 {percentile(raw, 50) or 0:.1f} MiB; {_placement(service)}"


def _docker_engine(engine: ContainerEngine, container_id: str) -> DockerEngine | None:
    if isinstance(engine, ClusterEngine):
        member = engine.member_engine(container_id)
        return member if isinstance(member, DockerEngine) else None
    return engine if isinstance(engine, DockerEngine) else None


def _placement(service: SandboxService) -> str:
    """Where the sessions and warm containers are, per engine (several engines only)."""
    figures = service.engine_figures()
    if figures is None:
        return f"{len(service.sessions)} sessions open"
    return "sessions/stateless per engine: " + ", ".join(
        f"{each['name']} {each['sessions']}/{each['stateless']}" for each in figures
    )
