"""Durable sessions over the in-memory engine: kept at a stop and served again, taken over only
from servers that are gone, removed when their owner or lifetime is, paused and resumed, forked."""

from __future__ import annotations

from collections.abc import AsyncIterator, Collection
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from _fake_agent import FakeAgent

from mcp_code_exec.config.settings import Config, load_config
from mcp_code_exec.errors import SandboxError, SessionLimit, SessionNotFound
from mcp_code_exec.runtime.base import LABEL_KIND, LABEL_SESSION
from mcp_code_exec.runtime.memory import MemoryEngine
from mcp_code_exec.sandbox.ownership import RECORD_KIND
from mcp_code_exec.sandbox.records import SessionRecords, known_to, oauth_identity, realm_hash
from mcp_code_exec.service.facade import SandboxService
from mcp_code_exec.service.sessions import Session

pytestmark = pytest.mark.anyio


def settings(**sessions: Any) -> Config:
    overrides = {"pool": {"size": 1, "session_spares": 0, "acquire_timeout_s": 5}, "sessions": sessions}
    return load_config(environ={}, overrides=overrides)


@asynccontextmanager
async def serving(
    engine: MemoryEngine, config: Config, identities: Collection[str] | None = None, realms: Collection[str] = ()
) -> AsyncIterator[SandboxService]:
    async with SandboxService.start(config, engine=engine, identities=identities, realms=realms) as service:
        await service.wait_ready(10)
        yield service


def records(engine: MemoryEngine) -> dict[str, dict[str, str]]:
    return {name: labels for name, labels in engine.volume_labels.items() if labels.get(LABEL_KIND) == RECORD_KIND}


async def close_all(service: SandboxService, owner: str) -> None:
    for session in service.sessions.owned_by(owner):
        await service.close_session(owner, session.id)


def on_pause(service: SandboxService) -> anyio.Event:
    """An event set once the reaper has paused a session."""
    paused = anyio.Event()
    pause = service.keeper.pause

    async def pause_and_tell(session: Session) -> bool:
        done = await pause(session)
        if done:
            paused.set()
        return done

    service.keeper.pause = pause_and_tell  # type: ignore[method-assign]
    return paused


async def test_a_stopped_service_keeps_its_sessions_and_the_next_serves_them_to_their_owner_only() -> None:
    agent = FakeAgent()
    async with MemoryEngine(agent) as engine:
        async with serving(engine, settings()) as first:
            made = await first.new_session("token:a")
        assert not engine.running  # no container outlives its service
        assert [labels[LABEL_SESSION] for labels in records(engine).values()] == [made.session_id]
        async with serving(engine, settings(), identities={"token:a", "token:b"}) as second:
            with pytest.raises(SessionNotFound):
                await second.run("token:b", "1", session_id=made.session_id)
            result = await second.run("token:a", "1", session_id=made.session_id)
            assert result.status == "ok" and any("resumed" in note for note in result.notes)
            assert "restore" in [request["op"] for request in agent.requests]
            await close_all(second, "token:a")
        assert engine.volume_labels == {} and not engine.running  # closing is the end of it


async def test_a_session_whose_owner_is_no_longer_configured_is_removed_at_start() -> None:
    async with MemoryEngine(FakeAgent()) as engine:
        async with serving(engine, settings()) as first:
            await first.new_session("token:gone")
        async with serving(engine, settings(), identities={"token:other"}) as second:
            assert len(second.sessions) == 0
        assert engine.volume_labels == {}


async def test_an_oauth_identitys_session_comes_back_to_its_subject_while_its_issuer_and_claim_are_configured() -> None:
    """OAuth identities are an open set: a server knows them by their realm (issuer and claim)."""
    alice, bob = (
        oauth_identity("https://a.example/", "sub", "alice"),
        oauth_identity("https://a.example/", "sub", "bob"),
    )
    realm = realm_hash("https://a.example/", "sub")
    async with MemoryEngine(FakeAgent()) as engine:
        async with serving(engine, settings()) as first:
            made = await first.new_session(alice)
        async with serving(engine, settings(), identities={"token:a"}, realms={realm}) as second:
            with pytest.raises(SessionNotFound):
                await second.run(bob, "1", session_id=made.session_id)
            assert (await second.run(alice, "1", session_id=made.session_id)).status == "ok"
        for other in (realm_hash("https://b.example/", "sub"), realm_hash("https://a.example/", "email")):
            async with serving(engine, settings(), identities=set(), realms={realm, other}) as third:
                assert len(third.sessions) == 1  # kept while its realm is configured...
        async with serving(engine, settings(), identities={"token:a"}, realms={other}) as fourth:
            assert len(fourth.sessions) == 0  # ...and removed by a server of another issuer or claim
        assert engine.volume_labels == {}


async def test_a_session_past_its_lifetime_is_removed_at_start_with_its_volume() -> None:
    async with MemoryEngine(FakeAgent()) as engine:
        async with serving(engine, settings()) as first:
            made = await first.new_session("me")
            volume = first.sessions.get(made.session_id, "me").volume
        found = await SessionRecords(engine, "later").adopt(None, take=True, now=1e12)  # far past its lifetime
        assert found.adopted == [] and found.removed == 1
        assert volume not in engine.volume_labels and records(engine) == {}


async def test_a_service_never_takes_over_sessions_a_running_service_holds() -> None:
    async with MemoryEngine(FakeAgent()) as engine, serving(engine, settings()) as first:
        made = await first.new_session("me")
        async with serving(engine, settings()) as second:
            assert len(second.sessions) == 0
        assert (await first.run("me", "1", session_id=made.session_id)).status == "ok"
        await close_all(first, "me")


async def test_an_idle_session_gives_its_container_back_and_resumes_at_its_next_run() -> None:
    agent = FakeAgent()
    async with MemoryEngine(agent) as engine, serving(engine, settings(pause_after_s=0.05)) as service:
        paused = on_pause(service)
        made = await service.new_session("me")
        session = service.sessions.get(made.session_id, "me")
        container = session.sandbox.container_id if session.sandbox else ""
        with anyio.fail_after(10):
            await paused.wait()
        assert session.paused
        assert container not in engine.running
        assert "snapshot_sync" in [request["op"] for request in agent.requests]  # the snapshot finished first
        result = await service.run("me", "1", session_id=made.session_id)
        assert result.status == "ok" and any("resumed" in note for note in result.notes)
        assert not result.session_restarted  # its snapshot came back
        await close_all(service, "me")


async def test_resuming_past_the_live_cap_pauses_the_longest_idle_session_of_that_client() -> None:
    config = settings(max_per_client=1, pause_after_s=1000)
    async with MemoryEngine(FakeAgent()) as engine, serving(engine, config) as service:
        first = await service.new_session("me")
        await service.keeper.pause(service.sessions.get(first.session_id, "me"))
        second = await service.new_session("me")
        assert (await service.run("me", "1", session_id=first.session_id)).status == "ok"
        assert service.sessions.get(second.session_id, "me").paused
        await close_all(service, "me")


async def test_a_fork_copies_the_volume_into_new_paused_sessions_of_the_same_owner() -> None:
    agent = FakeAgent()
    async with MemoryEngine(agent) as engine, serving(engine, settings()) as service:
        made = await service.new_session("me")
        source = service.sessions.get(made.session_id, "me").volume
        forks = await service.fork_session("me", made.session_id, 2)
        assert len(set(forks)) == 2 and made.session_id not in forks
        assert [copy[0] for copy in engine.copies] == [source, source]
        assert all(service.sessions.get(fork, "me").paused for fork in forks)
        with pytest.raises(SessionNotFound):
            await service.fork_session("other", made.session_id)
        with pytest.raises(SandboxError, match="1 to 8"):
            await service.fork_session("me", made.session_id, 9)
        assert len(records(engine)) == 3
        agent.requests.clear()
        assert (await service.run("me", "1", session_id=forks[0])).status == "ok"
        assert [request["op"] for request in agent.requests][:1] == ["restore"]  # before its first run
        await close_all(service, "me")
        assert engine.volume_labels == {}


async def test_forks_are_refused_past_the_cap_on_paused_sessions() -> None:
    async with MemoryEngine(FakeAgent()) as engine, serving(engine, settings(max_paused=1)) as service:
        made = await service.new_session("me")
        with pytest.raises(SessionLimit):
            await service.fork_session("me", made.session_id, 2)
        await close_all(service, "me")


async def test_an_agent_without_snapshots_resumes_sessions_empty_and_says_they_restarted() -> None:
    agent = FakeAgent(snapshots=False)
    async with MemoryEngine(agent) as engine, serving(engine, settings()) as service:
        made = await service.new_session("me")
        await service.keeper.pause(service.sessions.get(made.session_id, "me"))
        result = await service.run("me", "1", session_id=made.session_id)
        assert result.status == "ok" and result.session_restarted
        with pytest.raises(SandboxError, match="cannot list variables"):
            await service.list_variables("me", made.session_id)
        await close_all(service, "me")


async def test_session_runs_carry_the_snapshot_and_history_caps() -> None:
    agent = FakeAgent()
    config = settings(snapshot_max_mb=3, history_max_mb=0)
    async with MemoryEngine(agent) as engine, serving(engine, config) as service:
        made = await service.new_session("me")
        await service.run("me", "1", session_id=made.session_id)
        options = [r["options"] for r in agent.requests if r["op"] == "exec" and r["mode"] == "session"][-1]
        assert (options.get("snapshot_max_bytes"), options.get("history_max_bytes")) == (3 << 20, None)
        variables = await service.list_variables("me", made.session_id)
        assert [v.name for v in variables.variables] == ["x"]
        written = await service.export_notebook("me", made.session_id)
        assert written.path == "session.ipynb" and written.uri.endswith("session.ipynb")
        await close_all(service, "me")


async def test_a_run_id_given_as_a_session_id_is_told_to_go_as_run_id() -> None:
    async with MemoryEngine(FakeAgent()) as engine, serving(engine, settings(durable=False)) as service:
        with pytest.raises(SessionNotFound, match="pass it as run_id"):
            await service.read_file("me", "r_abcdefghijkl", "x.txt")


async def test_a_server_of_another_scope_neither_takes_over_nor_removes_a_stopped_servers_sessions() -> None:
    async with MemoryEngine(FakeAgent()) as engine:
        async with SandboxService.start(settings(), engine=engine, scope="http:127.0.0.1:8000") as first:
            made = await first.new_session("token:alice")
        for other in ({"token:carol"}, None):  # another deployment's tokens; a stdio server
            async with SandboxService.start(settings(), engine=engine, identities=other, scope="elsewhere") as second:
                assert len(second.sessions) == 0
        assert len(records(engine)) == 1
        async with SandboxService.start(
            settings(), engine=engine, identities={"token:alice"}, scope="http:127.0.0.1:8000"
        ) as again:
            assert (await again.run("token:alice", "1", session_id=made.session_id)).status == "ok"
            await close_all(again, "token:alice")
        assert engine.volume_labels == {}


async def test_a_session_past_its_lifetime_is_removed_by_a_server_of_any_scope() -> None:
    async with MemoryEngine(FakeAgent()) as engine:
        async with serving(engine, settings()) as first:
            await first.new_session("me")
        found = await SessionRecords(engine, "later", "elsewhere").adopt(known_to({"x"}), take=True, now=1e12)
        assert found.adopted == [] and found.removed == 1
        assert engine.volume_labels == {}
