"""Sessions that survive, measured: a snapshot of a 100 MB DataFrame, its restore into a new
container, a fork of a session holding it and 100 MB of files, the resume of a paused session, and
the containers many paused sessions hold.

These need durable sessions, which the rest of the bench runs without: a service of their own is
started with them on, in a scope of its own (so it serves again no one else's sessions), and every
session it made is closed before it stops (so no volume and no record outlives the bench).
"""

from __future__ import annotations

import time
from typing import Any

import anyio
from mcp import Client

from ...config.settings import Config
from ...config.units import MIB
from ...mcp_server import build_server
from ...runtime.base import LABEL_INSTANCE, LABEL_KIND
from ...runtime.docker.engine import DockerEngine
from ...sandbox.container import Sandbox
from ...service.facade import SandboxService
from ...service.sessions import Session
from .calls import new_session, wait_for_spares
from .measure import Bench
from .report import Metric

# 100 MiB of float64 (13,107,200 values), in 8 columns
FRAME = (
    "import numpy as np, pandas as pd\n"
    "df = pd.DataFrame(np.random.rand(1_638_400, 8), columns=list('abcdefgh'))\n"
    "int(df.memory_usage(index=False).sum() // 2**20)"
)
FILES = (
    "import os\n"
    "os.makedirs('/mnt/data/set', exist_ok=True)\n"
    "for i in range(10):\n"
    "    with open(f'/mnt/data/set/part{i}.bin', 'wb') as out:\n"
    "        out.write(os.urandom(10 * 2**20))\n"
)
# The first line takes the time the run began (the host's clock: the container shares it)
FIRST_LINE = "began = __import__('time').time()\nprint(began, df.shape)"
SHAPE = "(1638400, 8)"
CALL_S = 120.0


def durable_scope(scope: str) -> str:
    """The durable service's scope, beside the bench's own (``command``): it serves no one's sessions."""
    return f"{scope}-durable"


def durable_config(config: Config, paused: int) -> Config:
    """The bench's config with durable sessions, room for ``paused`` paused ones, and a container
    that holds the 100 MB frame while a snapshot child pickles it (and a volume for it and its files)."""
    limits = config.limits.model_copy(
        update={
            "memory_mb": max(config.limits.memory_mb, 1024),
            "session_data_mb": max(config.limits.session_data_mb, 512),
            "fsize_mb": max(config.limits.fsize_mb, 256),
        }
    )
    sessions = config.sessions.model_copy(
        update={
            "durable": True,
            "scope": durable_scope(config.sessions.scope),
            "max_paused": paused + 10,
            "max_paused_per_client": paused + 10,  # the bench's one identity holds them all
            "snapshot_max_mb": max(config.sessions.snapshot_max_mb, 256),
        }
    )
    pool = config.pool.model_copy(update={"size": 1, "session_spares": 1})
    stored = {"stored_mb": (paused + 20) * limits.session_data_mb}  # the bench's one identity holds them all
    quotas = config.quotas.model_copy(update={"default": config.quotas.default.model_copy(update=stored)})
    return config.model_copy(update={"sessions": sessions, "limits": limits, "pool": pool, "quotas": quotas})


async def durable_sessions(bench: Bench, engine: DockerEngine, paused: int) -> None:
    """``engine``: a connection to the engine the service runs on, to kill a session's container
    and count containers as ``docker`` does."""
    config = durable_config(bench.config, paused)
    async with SandboxService.start(config) as service:
        await service.wait_ready()
        try:
            async with Client(build_server(service)) as client:
                await _measure(bench, service, engine, client, paused)
        finally:
            for session in list(service.sessions.all()):  # durable: kept by the stop unless closed
                await service.close_session(session.owner, session.id)


async def _measure(bench: Bench, service: SandboxService, engine: DockerEngine, client: Client, paused: int) -> None:
    snapshot = bench.metric("snapshot_100mb", "snapshot of a 100 MB DataFrame (background)", target=1000.0)
    restore = bench.metric("restore_100mb", "restore into a new container, to first line", target=2000.0)
    fork = bench.metric("fork_100mb", "fork_session: 100 MB of files + that frame", target=3000.0)
    resume = bench.metric("resume_paused", "resume of a paused session, to first line")
    held = bench.metric(
        "paused_containers", f"{paused} paused sessions: containers held", unit="containers", target=0.0
    )
    session_id = await new_session(client)
    session = _session(service, session_id)
    await wait_for_spares(service)
    result = await _run(client, FRAME, session_id)
    ended = time.perf_counter()
    state = await service.keeper.snapshot_sync(_sandbox(session))
    if state is None or not state.complete or state.taken_at is None:
        snapshot.failures += 1
        snapshot.note = f"no complete snapshot: {state}"
    else:
        snapshot.samples.append((time.perf_counter() - ended) * 1000)
        snapshot.note = f"frame of {result.get('result')} MiB, snapshot of {(state.size or 0) / MIB:.0f} MiB"

    await engine.call(engine.client.api.kill, _sandbox(session).container_id)
    await _to_first_line(client, session_id, restore)

    await _run(client, FILES, session_id)
    began = time.perf_counter()
    forked = await client.call_tool("fork_session", {"session_id": session_id})
    elapsed = (time.perf_counter() - began) * 1000
    forks = (forked.structured_content or {}).get("forks") or []
    if forked.is_error or len(forks) != 1:
        fork.failures += 1
        fork.note = str(forked.content)[:300]
    else:
        fork.samples.append(elapsed)
        await _to_first_line(client, str(forks[0]), None)  # the fork holds the frame
        fork.note = "the fork's first run found the frame"
        await client.call_tool("close_session", {"session_id": str(forks[0])})

    if not await service.keeper.pause(session):
        resume.failures += 1
    else:
        await _to_first_line(client, session_id, resume)
    restored = restore.percentile(50)
    resume.target = None if restored is None else 1000.0 + restored
    resume.note = "target: 1 s more than the restore's p50 (a resume is a restore into a new container)"
    await client.call_tool("close_session", {"session_id": session_id})

    await _paused_sessions(service, engine, client, held, paused)


async def _paused_sessions(
    service: SandboxService, engine: DockerEngine, client: Client, held: Metric, count: int
) -> None:
    """``count`` paused sessions (forks of a small one, which start paused, and that one paused):
    the session containers still running, less the warm spares (no session's yet)."""
    source = await new_session(client)
    await _run(client, "open('/mnt/data/seed.txt', 'w').write('seed')", source)
    made = 0
    began = time.perf_counter()
    while made < count - 1:
        forked = await client.call_tool("fork_session", {"session_id": source, "count": min(8, count - 1 - made)})
        if forked.is_error:
            raise RuntimeError(f"fork_session failed: {forked.content}")
        made += len((forked.structured_content or {}).get("forks") or [])
    if not await service.keeper.pause(_session(service, source)):
        raise RuntimeError("the source of the paused sessions could not be paused")
    spares = set(service.session_spares.container_ids())
    running = [
        record
        for record in await engine.containers(f"{LABEL_INSTANCE}={service.instance}")
        if record.labels.get(LABEL_KIND) == "session" and record.state == "running" and record.id not in spares
    ]
    held.value = float(len(running))
    paused = len(service.sessions.paused())
    held.note = f"{paused} paused (made in {time.perf_counter() - began:.1f} s); warm spares not counted"


async def _to_first_line(client: Client, session_id: str, metric: Metric | None) -> None:
    """A run whose first line takes the time: from the call to that line (ms) into ``metric``;
    a failure when ``df`` did not come back."""
    called = time.time()
    result = await _run(client, FIRST_LINE, session_id, check=False)
    stdout = str(result.get("stdout", ""))
    if result.get("status") != "ok" or SHAPE not in stdout:
        if metric is None:
            raise RuntimeError(f"the frame did not come back: {result}")
        metric.failures += 1
        metric.note = str(result)[:300]
        return
    if metric is not None:
        metric.samples.append((float(stdout.split()[0]) - called) * 1000)
        notes = "; ".join(str(note) for note in result.get("notes") or [])
        metric.note = notes[:300]


async def _run(client: Client, code: str, session_id: str, *, check: bool = True) -> dict[str, Any]:
    with anyio.fail_after(CALL_S):
        result = await client.call_tool("run_python", {"code": code, "session_id": session_id})
    structured = dict(result.structured_content or {})
    if check and (result.is_error or structured.get("status") != "ok"):
        raise RuntimeError(f"a session run failed: {structured or result.content}")
    return structured


def _session(service: SandboxService, session_id: str) -> Session:
    return next(session for session in service.sessions.all() if session.id == session_id)


def _sandbox(session: Session) -> Sandbox:
    if session.sandbox is None:
        raise RuntimeError(f"session {session.id} has no container")
    return session.sandbox
