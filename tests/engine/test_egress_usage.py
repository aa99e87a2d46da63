"""A run's bytes through the egress proxy in its usage (docs/accounting.md): the proxy's account of
the run's grant, in the result's ``usage.egress_bytes`` and the session's totals (runc; the proxy's
counting is the same under gVisor, checked with the budgets in ``test_egress``)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator

import pytest
from _egress import ALICE, egress_service, egress_test_hosts, run, said
from _egress_hosts import EgressHosts, missing_tools
from _support import make_test_config

from mcp_code_exec.service.facade import SandboxService

pytestmark = [pytest.mark.anyio, pytest.mark.skipif(missing_tools() is not None, reason=str(missing_tools()))]


@pytest.fixture(scope="module")
def hosts() -> Iterator[EgressHosts]:
    with egress_test_hosts("s3cr3t-egress-" + os.urandom(8).hex(), []) as made:
        yield made


@pytest.fixture(scope="module")
async def egress(hosts: EgressHosts, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[SandboxService]:
    async with egress_service(hosts, tmp_path_factory.mktemp("egress-state"), None) as service:
        yield service


async def test_a_run_without_egress_reports_no_egress_bytes() -> None:
    async with SandboxService.start(make_test_config(pool={"size": 1, "session_spares": 0})) as service:
        await service.wait_ready()
        result = await service.run(ALICE, "1")
        assert result.usage is not None and result.usage.egress_bytes is None  # no network: absent


async def test_the_bytes_a_run_moved_through_egress_are_in_its_usage_and_its_sessions_totals(
    egress: SandboxService, hosts: EgressHosts
) -> None:
    data, size = hosts.name("data"), 1 << 20
    code = f"""
got = 0
with urllib.request.urlopen("https://{data}/big?n={size}", timeout=60) as response:
    while chunk := response.read(1 << 16):
        got += len(chunk)
print(json.dumps({{"got": got, "after": get("https://{data}/echo")["status"]}}))
"""
    stateless = await run(egress, ALICE, code)
    assert said(stateless) == {"got": size, "after": 200}
    assert stateless.usage is not None and stateless.usage.egress_bytes is not None
    assert stateless.usage.egress_bytes >= size, stateless.usage
    session = (await egress.new_session(ALICE)).session_id
    try:
        quiet = await egress.run(ALICE, "x = 1", session_id=session)
        assert quiet.usage is not None and quiet.usage.egress_bytes == 0  # a run that reached nothing
        moved = await run(egress, ALICE, code, session_id=session)
        assert said(moved)["got"] == size and moved.usage is not None
        assert moved.usage.egress_bytes is not None and moved.usage.egress_bytes >= size, moved.usage
        report = await egress.usage(ALICE, session)
        assert report.session is not None and report.session.egress_bytes == moved.usage.egress_bytes
    finally:
        await egress.close_session(ALICE, session)
