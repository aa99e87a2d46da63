"""Several engines as one (``runtime.cluster``), with in-memory engines as members: placement by
capacity, sessions that stay on their engine, an engine that goes away and comes back."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import pytest
from _fake_agent import FakeAgent

from mcp_code_exec.config.settings import Config, load_config
from mcp_code_exec.errors import EngineDown, EngineError, ImageMissing
from mcp_code_exec.mcp_server.answers import run_content
from mcp_code_exec.runtime.base import ContainerEngine
from mcp_code_exec.runtime.cluster import ClusterEngine
from mcp_code_exec.runtime.members import Member
from mcp_code_exec.runtime.memory import MemoryEngine
from mcp_code_exec.service.execution import MOVED_NOTE
from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio


def settings(**pool: Any) -> Config:
    pool = {"size": 2, "session_spares": 0, "acquire_timeout_s": 5, **pool}
    return load_config(environ={}, overrides={"pool": pool, "sessions": {"durable": False}})


def connecting(engine: MemoryEngine) -> Any:
    async def connect() -> ContainerEngine:
        return engine

    return connect


@dataclass
class Cluster:
    service: SandboxService
    cluster: ClusterEngine
    engines: list[MemoryEngine]
    agents: list[FakeAgent]

    def where(self, container_ids: Sequence[str] | set[str]) -> Counter[int]:
        """How many of these containers each engine (by index) holds."""
        return Counter(int(container_id.split("-")[0][1:]) for container_id in container_ids)

    def stateless(self) -> Counter[int]:
        return self.where(self.service.stateless_pool.container_ids())

    async def came_in(self, index: int, timeout_s: float = 10.0) -> None:
        """Until an engine is admitted (again)."""
        await self.cluster.health.wait_for(lambda: self.cluster.members[index].up, timeout_s)


@asynccontextmanager
async def cluster_of(
    capacities: Sequence[float], config: Config, agents: Sequence[FakeAgent] | None = None, *, interval_s: float = 0.05
) -> AsyncIterator[Cluster]:
    agents = list(agents or [FakeAgent() for _ in capacities])
    with anyio.fail_after(60):
        async with AsyncExitStack() as stack:
            engines = [
                await stack.enter_async_context(MemoryEngine(agent, prefix=f"e{index}-"))
                for index, agent in enumerate(agents)
            ]
            members = [
                Member(name=f"engine-{index + 1}", connect=connecting(engine), capacity=capacity)
                for index, (engine, capacity) in enumerate(zip(engines, capacities, strict=True))
            ]
            cluster = ClusterEngine(members, interval_s=interval_s, timeout_s=1.0)
            await cluster.health.connect()
            async with SandboxService.start(config, engine=cluster) as service:
                await service.wait_ready(10)
                yield Cluster(service, cluster, engines, agents)
            for engine in engines:
                engine.recover()  # what an engine still out at the end holds is checked too
                assert engine.running == {} and engine.volume_labels == {}  # nothing left on any engine


def held_cell(gate: anyio.Event, reached: anyio.Event, where: list[int], index: int) -> Any:
    """A cell that says which engine it reached, and holds ``wait`` until the gate opens."""

    async def cell(code: str, request: dict[str, Any]) -> dict[str, Any]:
        if code == "wait":
            where.append(index)
            reached.set()
            await gate.wait()
        return {"stdout": f"ran {code}\n"}

    return cell


async def test_the_stateless_pool_is_shared_out_by_capacity() -> None:
    async with cluster_of([2, 1, 1], settings(size=4)) as c:
        await c.service.stateless_pool.wait_for(lambda pool: pool.idle == 4, 10)
        assert c.stateless() == {0: 2, 1: 1, 2: 1}


async def test_new_sessions_go_where_there_is_room_and_each_stays_on_its_engine() -> None:
    async with cluster_of([1, 1], settings(size=1, session_spares=1)) as c:
        opened = [await c.service.new_session("me") for _ in range(4)]
        homes = Counter(c.cluster.volume_home(session.volume or "") for session in c.service.sessions.all())
        assert homes == {"engine-1": 2, "engine-2": 2}
        first = c.service.sessions.all()[0]
        assert first.sandbox is not None and first.volume is not None
        home = c.cluster.volume_home(first.volume)
        assert home is not None
        await first.sandbox.destroy()  # its container dies: the next run starts one on the same volume
        assert (await c.service.run("me", "again", session_id=first.id)).session_restarted
        assert first.sandbox is not None and c.cluster.volume_home(first.volume) == home
        assert c.where([first.sandbox.container_id]) == {int(home[-1]) - 1: 1}
        for info in opened:
            await c.service.close_session("me", info.session_id)


async def test_a_start_refused_by_an_engine_that_stopped_answering_goes_to_another() -> None:
    async with cluster_of([1, 3], settings(size=2), interval_s=3600) as c:  # no health check comes
        await c.service.stateless_pool.wait_for(lambda pool: pool.idle == 2, 10)
        assert c.stateless() == {0: 1, 1: 1}
        c.engines[1].answering = False
        container_id, stream = await c.cluster.start(c.service.spec("stateless"))  # engine 2 has room, and is out
        assert not c.cluster.members[1].up and c.where([container_id]) == {0: 1}
        await stream.aclose()
        await c.cluster.remove(container_id)
        c.engines[1].recover()


async def test_an_engine_that_refuses_containers_is_passed_over_for_stateless_ones() -> None:
    async with cluster_of([1, 1], settings(size=1), interval_s=3600) as c:
        c.engines[1].fail_starts = EngineError("the Docker engine refused: no such runtime")
        for _ in range(3):
            container_id, stream = await c.cluster.start(c.service.spec("stateless"))
            assert c.where([container_id]) == {0: 1} and c.cluster.members[1].up  # refused, not out
            await stream.aclose()
            await c.cluster.remove(container_id)
        c.engines[0].fail_starts = EngineError("the Docker engine refused: full")
        with pytest.raises(EngineError, match=r"refused: (full|no such runtime)"):
            await c.cluster.start(c.service.spec("stateless"))
        c.engines[0].fail_starts = c.engines[1].fail_starts = None


async def test_a_stateless_run_lost_with_its_engine_runs_again_on_another() -> None:
    gate, reached, where = anyio.Event(), anyio.Event(), list[int]()
    agents = [FakeAgent(cell=held_cell(gate, reached, where, index)) for index in range(2)]
    async with cluster_of([1, 1], settings(size=2), agents) as c:
        await c.service.stateless_pool.wait_for(lambda pool: pool.idle == 2, 10)
        run = await c.service.start_run("me", "wait")
        with anyio.fail_after(10):
            await reached.wait()
        (lost,) = where
        c.engines[lost].crash()
        gate.set()
        with anyio.fail_after(10):
            await run.finished.wait()
        result = c.service.run_registry.deliver(run)
        assert result.status == "ok" and result.stdout == "ran wait\n"
        assert result.notes == [f"{MOVED_NOTE} (engine-{lost + 1})"]
        c.engines[lost].recover()
        await c.came_in(lost)


async def test_a_session_on_an_engine_that_is_out_says_so_and_comes_back_with_its_engine() -> None:
    async with cluster_of([1, 1], settings(size=2)) as c:
        sid = (await c.service.new_session("me")).session_id
        (session,) = c.service.sessions.all()
        home = int((c.cluster.volume_home(session.volume or "") or "")[-1]) - 1
        await c.service.write_file("me", sid, "kept.txt", b"on the volume")
        c.engines[home].crash()
        down = await c.service.run("me", "1", session_id=sid)
        assert down.status == "crashed" and down.error is not None
        assert down.error.type == "EngineDown" and "engine unavailable" in down.error.message
        assert run_content(down, links=False).is_error  # the tool failed, not the user's code
        with pytest.raises(EngineDown, match="engine unavailable"):
            await c.service.list_files("me", sid)
        assert (await c.service.run("me", "stateless")).status == "ok"  # the other engine serves these
        c.engines[home].recover()
        await c.came_in(home)
        back = await c.service.run("me", "again", session_id=sid)
        assert back.status == "ok" and back.session_restarted
        assert (await c.service.read_file("me", sid, "kept.txt")).data == b"on the volume"
        await c.service.close_session("me", sid)


async def test_an_engine_that_comes_back_gets_its_share_of_the_pool_again() -> None:
    async with cluster_of([1, 1, 1], settings(size=3)) as c:
        await c.service.stateless_pool.wait_for(lambda pool: pool.idle == 3, 10)
        assert c.stateless() == {0: 1, 1: 1, 2: 1}
        c.engines[1].crash()
        await c.service.stateless_pool.wait_for(lambda pool: pool.idle == 3 and 1 not in c.stateless(), 10)
        c.engines[1].recover()
        await c.service.stateless_pool.wait_for(lambda pool: pool.idle == 3 and c.stateless() == {0: 1, 1: 1, 2: 1}, 10)
        figures = {engine["name"]: engine for engine in c.service.engine_figures() or []}
        assert figures["engine-2"]["up"] and figures["engine-2"]["stateless"] == 1


async def test_an_engine_without_the_sandbox_image_is_kept_out_and_said_why() -> None:
    async with AsyncExitStack() as stack:
        engines = [await stack.enter_async_context(MemoryEngine(FakeAgent(), prefix=f"e{i}-")) for i in range(2)]

        async def admit(engine: ContainerEngine) -> None:
            if engine is engines[1]:
                raise ImageMissing("the sandbox image is not present")

        members = [Member(name=f"engine-{i + 1}", connect=connecting(e)) for i, e in enumerate(engines)]
        cluster = ClusterEngine(members, admit=admit)
        await cluster.health.connect()
        assert [member.up for member in cluster.members] == [True, False]
        assert "image is not present" in cluster.members[1].reason
        lonely = ClusterEngine([Member(name="engine-2", connect=connecting(engines[1]))], admit=admit)
        with pytest.raises(ImageMissing, match="no engine of the cluster can run sandboxes"):
            await lonely.health.connect()
