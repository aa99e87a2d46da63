"""Controlled egress attacked as hostile sandbox code would (docs/security.md#egress): around the
relay, through upgraded connections. Against the test hosts of ``_egress_hosts`` and the real proxy,
under runc and gVisor, as ``test_egress``."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator

import pytest
from _egress import ALICE, TOKEN_ENV, egress_image, egress_service, ensure_egress_image, run, said
from _egress_hosts import EgressHosts, missing_tools, start, stop
from _security import runsc_available, runsc_leftovers
from _support import wait_until

from mcp_code_exec.service.facade import SandboxService

pytestmark = [pytest.mark.anyio, pytest.mark.skipif(missing_tools() is not None, reason=str(missing_tools()))]
RUNTIMES = [
    "runc",
    pytest.param("runsc", marks=pytest.mark.skipif(not runsc_available(), reason="gVisor is not registered as runsc")),
]


@pytest.fixture(scope="module")
def hosts() -> Iterator[EgressHosts]:
    ensure_egress_image(egress_image())
    secret = "s3cr3t-egress-" + os.urandom(8).hex()
    made = start("Bearer " + secret, [])  # no index is used here
    os.environ[TOKEN_ENV] = secret
    try:
        yield made
    finally:
        os.environ.pop(TOKEN_ENV, None)
        stop(made)


@pytest.fixture(scope="module", params=RUNTIMES)
async def egress(
    request: pytest.FixtureRequest, hosts: EgressHosts, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[SandboxService]:
    runtime = str(request.param)
    async with egress_service(hosts, tmp_path_factory.mktemp("egress-state"), runtime) as service:
        yield service
    if runtime == "runsc":
        await wait_until(lambda: not runsc_leftovers(), 30)


async def test_sandbox_code_cannot_connect_to_the_proxys_socket_around_its_relay(
    egress: SandboxService, hosts: EgressHosts
) -> None:
    """The relay holds a sandbox to its connection cap; code that connected to the mounted socket
    itself could open hundreds (each a socat process, of the proxy's 512) and starve every other
    sandbox's egress. Only the relay's group may connect: the sandbox user gets EACCES."""
    data = hosts.name("data")
    code = f"""
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect("/run/mcpx-egress/proxy.sock")
    direct = "connected"
except OSError as exc:
    direct = type(exc).__name__
print(json.dumps({{"direct": direct, "relayed": get("https://{data}/echo").get("status")}}))
"""
    found = said(await run(egress, ALICE, code))
    assert found["direct"] != "connected" and found["relayed"] == 200, found

