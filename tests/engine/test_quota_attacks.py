"""What an identity past its quota can still make the sandbox run (found by an attack on the quotas,
issue 36): every way into a session that runs the identity's own code must count as its runs do.
docs/accounting.md#quotas."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest
from _support import wait_until
from test_quotas import BURN, Clock, refused, remove_ledgers, serving

from mcp_code_exec.errors import OverQuota
from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio

# Ten variables whose repr burns 0.4 s of CPU each: list_variables runs a value's __repr__ (0.5 s
# each, 5 s in all, namespace.REPR_S and VARIABLES_S), in the session's own interpreter.
SLOW_REPRS = (
    "import time\n"
    "class Slow:\n"
    "    def __repr__(self):\n"
    "        end = time.process_time() + 0.4\n"
    "        while time.process_time() < end:\n"
    "            pass\n"
    "        return 'slow'\n"
    "s0, s1, s2, s3, s4, s5, s6, s7, s8, s9 = (Slow() for _ in range(10))\n"
)


@pytest.fixture
async def service() -> AsyncIterator[tuple[SandboxService, Clock]]:
    made: set[str] = set()
    clock = Clock()
    try:
        async with serving(clock, made) as running:
            yield running, clock
    finally:
        remove_ledgers(made)


async def test_past_its_cpu_quota_an_identity_runs_none_of_its_code_through_list_variables(
    service: tuple[SandboxService, Clock],
) -> None:
    svc, _ = service
    sid = (await svc.new_session("token:cpu")).session_id
    assert (await svc.run("token:cpu", BURN.format(s=0.6) + SLOW_REPRS, session_id=sid)).status == "ok"
    assert (await refused(svc, "token:cpu", session_id=sid)).quota == "cpu_s_per_hour"  # past it: no run
    session = svc.sessions.get(sid, "token:cpu")
    # Past the quota its idle session is paused (what the quota does itself): a listing would resume it
    # (its snapshot restored: its __reduce__s) and run its __repr__s in the new container, whose CPU
    # no figure of the old one shows; what the listings answer says whether they ran.
    await wait_until(lambda: session.sandbox is None, 60)
    ran = 0
    for _ in range(3):
        with contextlib.suppress(OverQuota):  # a refusal is what should hold
            listing = await svc.list_variables("token:cpu", sid)
            ran += sum(each.repr == "slow" for each in listing.variables)
    # Each listing ran the identity's __repr__s for ~4 s of CPU, past the quota, none of it a run.
    assert ran == 0, f"{ran} of the identity's __repr__s (0.4 CPU s each) ran past its quota"


async def cpu_used(svc: SandboxService, owner: str) -> float:
    return next(each.used for each in await svc.accounting.quotas.standing(owner) if each.quota == "cpu_s_per_hour")


async def test_past_its_cpu_quota_an_identity_cannot_have_containers_started_for_it_uncharged(
    service: tuple[SandboxService, Clock],
) -> None:
    """A file call on a paused session resumes it: a new container, whose start (the agent, the
    libraries it loads: about a CPU second here) is its first figure, charged to nobody, and no
    quota refuses the call. An identity with one session more than its live cap makes every such
    call pause one and resume another: CPU without end, past its quota, with no run at all."""
    svc, _ = service
    sid = (await svc.new_session("token:cpu")).session_id
    await svc.write_file("token:cpu", sid, "a.txt", b"x")
    assert (await svc.run("token:cpu", BURN.format(s=0.6), session_id=sid)).status == "ok"
    assert (await refused(svc, "token:cpu", session_id=sid)).quota == "cpu_s_per_hour"  # past it
    session = svc.sessions.get(sid, "token:cpu")
    before, started = await cpu_used(svc, "token:cpu"), 0.0
    for _ in range(3):
        await svc.keeper.pause(session)  # or the quota paused it already (its idle sessions, past it)
        await wait_until(lambda: session.sandbox is None, 60)
        with contextlib.suppress(OverQuota):  # a refusal is one way for this to hold
            await svc.read_file("token:cpu", sid, "a.txt")
            started += session.cpu_charged_s  # the new container's first figure: what its start used
    charged = await cpu_used(svc, "token:cpu") - before
    assert charged >= 0.9 * started, f"{started:.2f} CPU seconds of starts past the quota, {charged:.2f} charged"
