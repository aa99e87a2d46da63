"""docs/security.md: log lines carry no session or run id. A durable session's whole life over the
in-memory engine (made, run in, paused, resumed, expired; another kept at a stop and removed past
its lifetime by the next start), with every line at INFO and above captured and searched for them."""

from __future__ import annotations

import logging

import anyio
import pytest
from _fake_agent import FakeAgent

from mcp_code_exec.config.settings import Config, load_config
from mcp_code_exec.observability.logs import JsonFormatter, logged_id
from mcp_code_exec.runtime.memory import MemoryEngine
from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio


class Heard(logging.Handler):
    """Sets ``event`` when a line saying ``words`` is logged."""

    def __init__(self, words: str, event: anyio.Event) -> None:
        super().__init__()
        self.words, self.event = words, event

    def emit(self, record: logging.LogRecord) -> None:
        if self.words in record.getMessage():
            self.event.set()


async def live_a_sessions_life(config: Config, expired: anyio.Event) -> list[str]:
    """The ids of the sessions and runs of one session's life, and of one kept at a stop."""
    short_lived = config.model_copy(update={"sessions": config.sessions.model_copy(update={"max_lifetime_s": 0.2})})
    async with MemoryEngine(FakeAgent()) as engine:
        async with SandboxService.start(config, engine=engine) as service:
            await service.wait_ready(10)
            made = await service.new_session("me")
            first = await service.run("me", "1", session_id=made.session_id)
            assert await service.keeper.pause(service.sessions.get(made.session_id, "me"))
            resumed = await service.run("me", "2", session_id=made.session_id)
            stateless = await service.run("me", "3")
            await expired.wait()  # the reaper's timer expires it
        async with SandboxService.start(short_lived, engine=engine) as service:
            kept = await service.new_session("me")  # kept at the stop: durable
        await anyio.sleep(0.3)  # a timer, not synchronisation: its lifetime passes while no server runs
        async with SandboxService.start(short_lived, engine=engine) as service:
            await service.wait_ready(10)  # past its lifetime: removed at this start
    ids = [made.session_id, first.run_id, resumed.run_id, stateless.run_id, kept.session_id]
    return [value for value in ids if value]


async def test_no_session_or_run_id_appears_in_a_log_line_of_a_sessions_life(caplog: pytest.LogCaptureFixture) -> None:
    sessions = {"idle_timeout_s": 1.0, "max_lifetime_s": 60}
    config = load_config(
        environ={}, overrides={"pool": {"size": 1, "session_spares": 0, "acquire_timeout_s": 5}, "sessions": sessions}
    )
    expired = anyio.Event()
    facade_log, heard = logging.getLogger("mcp_code_exec.service.keeper"), Heard("expired", expired)
    facade_log.addHandler(heard)
    try:
        with caplog.at_level(logging.INFO), anyio.fail_after(60):
            ids = await live_a_sessions_life(config, expired)
    finally:
        facade_log.removeHandler(heard)
    assert len(ids) == 5
    said = "\n".join(record.getMessage() + JsonFormatter().format(record) for record in caplog.records)
    assert "expired" in said and "paused" in said and "removed session" in said  # the lines that name a session
    assert [value for value in ids if value in said] == [], said
    assert logged_id(ids[0]) in said  # ... by its hash, which an operator who knows the id can look for
