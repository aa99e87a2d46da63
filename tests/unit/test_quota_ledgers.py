"""The quota counts kept on the engine (``sandbox/ledgers``), over the in-memory engine: one ledger
per identity, a stopped server's taken over once (never counted twice), a live server's left
alone, another scope's and spent ones handled as records are. The same on Docker, through the
service: ``tests/engine/test_quotas.py``."""

from __future__ import annotations

import socket
import time
from collections.abc import AsyncIterator

import pytest
from _fake_agent import FakeAgent

from mcp_code_exec.config.accounting import QuotaLimits, QuotaSettings
from mcp_code_exec.errors import OverQuota
from mcp_code_exec.ledger.quotas import QuotaBook
from mcp_code_exec.observability.logs import identity_hash
from mcp_code_exec.runtime.base import LABEL_CREATED, LABEL_KIND, LABEL_OWNER, LABEL_SCOPE
from mcp_code_exec.runtime.memory import MemoryEngine
from mcp_code_exec.sandbox.ledgers import LABEL_HOLDER, LABEL_STATE, QuotaLedgers, remove_scopes
from mcp_code_exec.sandbox.ownership import LEDGER_KIND
from mcp_code_exec.sandbox.records import RUNNING_HERE

pytestmark = pytest.mark.anyio
GONE = f"{socket.gethostname()}:999999999:1"  # a server process that is not there
ALICE = identity_hash("token:alice")


@pytest.fixture
async def engine() -> AsyncIterator[MemoryEngine]:
    async with MemoryEngine(FakeAgent()) as engine:
        yield engine


def ledgers(engine: MemoryEngine) -> dict[str, dict[str, str]]:
    return {name: labels for name, labels in engine.volume_labels.items() if labels.get(LABEL_KIND) == LEDGER_KIND}


def books(engine: MemoryEngine, instance: str, scope: str = "s") -> tuple[QuotaBook, QuotaLedgers]:
    RUNNING_HERE.add(instance)
    store = QuotaLedgers(engine, instance, scope)
    return QuotaBook(QuotaSettings(default=QuotaLimits(runs_per_minute=3)), store=store), store


async def test_a_save_leaves_one_ledger_per_identity_and_an_empty_state_none(engine: MemoryEngine) -> None:
    store = QuotaLedgers(engine, "i1", "s")
    for state in ("runs_per_minute=1:1", "runs_per_minute=1:2", "runs_per_minute=1:3"):
        await store.save(ALICE, state)
    (labels,) = ledgers(engine).values()
    assert labels[LABEL_STATE] == "runs_per_minute=1:3" and labels[LABEL_HOLDER] == "i1"
    await store.save(ALICE, "")
    assert ledgers(engine) == {}


async def test_a_stopped_servers_counts_are_taken_over_once_and_a_live_ones_left_alone(engine: MemoryEngine) -> None:
    first, _ = books(engine, "first")
    for _ in range(2):
        await first.admit_run("token:alice")
    await first.save()
    RUNNING_HERE.discard("first")  # that server stops
    second, _ = books(engine, "second")
    await second.admit_run("token:alice")  # its third run: the first server's two still count
    with pytest.raises(OverQuota):
        await second.admit_run("token:alice")
    await second.save()
    (labels,) = ledgers(engine).values()  # taken over: written again as the second's, the first's gone
    assert labels[LABEL_HOLDER] == "second"
    third, _ = books(engine, "third")  # a server beside a live one does not count the live one's runs
    for _ in range(3):
        await third.admit_run("token:alice")
    RUNNING_HERE.discard("second")
    RUNNING_HERE.discard("third")


async def test_two_ledgers_of_one_server_count_once_and_another_scopes_not_at_all(engine: MemoryEngine) -> None:
    now = time.time()
    state = f"runs_per_minute={int(now // 5)}:2"
    common = {LABEL_OWNER: GONE, LABEL_HOLDER: "gone", LABEL_KIND: LEDGER_KIND, "org.mcp-code-exec.identity": ALICE}
    for name, saved in (
        ("mcp-code-exec-quota-aaaaaaaaaaaaaaaa", now - 2),
        ("mcp-code-exec-quota-bbbbbbbbbbbbbbbb", now - 1),
    ):
        await engine.create_volume(
            name, {**common, "org.mcp-code-exec.scope": "s", LABEL_CREATED: str(saved), LABEL_STATE: state}
        )  # a save whose old ledger was not removed (the server died between the two)
    await engine.create_volume(
        "mcp-code-exec-quota-cccccccccccccccc",
        {**common, "org.mcp-code-exec.scope": "other", LABEL_CREATED: str(now), LABEL_STATE: state},
    )
    book, _ = books(engine, "fourth")
    await book.admit_run("token:alice")  # 2 + 1
    with pytest.raises(OverQuota):
        await book.admit_run("token:alice")
    kept = ledgers(engine)  # its scope's two made one of its own; the other scope's left alone
    assert len(kept) == 2 and "mcp-code-exec-quota-cccccccccccccccc" in kept
    RUNNING_HERE.discard("fourth")


async def test_spent_and_malformed_ledgers_are_swept_at_start(engine: MemoryEngine) -> None:
    store = QuotaLedgers(engine, "i5", "s")
    await store.save(ALICE, "runs_per_minute=1:1")
    old = {LABEL_KIND: LEDGER_KIND, LABEL_CREATED: str(time.time() - 2 * 86400), LABEL_STATE: "x"}
    await engine.create_volume("mcp-code-exec-quota-dddddddddddddddd", old)
    await engine.create_volume("not-ours", {LABEL_KIND: LEDGER_KIND, LABEL_CREATED: str(time.time())})
    assert await store.sweep() == 2
    assert len(ledgers(engine)) == 1


async def test_the_ledgers_of_the_scopes_named_go_and_no_other_scope_s(engine: MemoryEngine) -> None:
    for scope in ("bench-1", "bench-1-durable", "bench-10", "s"):
        await QuotaLedgers(engine, f"i-{scope}", scope).save(ALICE, "runs_per_minute=1:1")
    assert await remove_scopes(engine, ("bench-1", "bench-1-durable")) == 2
    assert sorted(labels[LABEL_SCOPE] for labels in ledgers(engine).values()) == ["bench-10", "s"]
