"""Controlled egress attacked as hostile sandbox code would (docs/security.md#egress): around the
relay, through upgraded connections, with grants copied out of their sandbox, holding connections.
Against the test hosts of ``_egress_hosts`` and the real proxy, under runc and gVisor, as
``test_egress``."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator

import anyio
import pytest
from _egress import ALICE, egress_service, egress_test_hosts, run, said
from _egress_hosts import EgressHosts, missing_tools
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
    with egress_test_hosts("s3cr3t-egress-" + os.urandom(8).hex(), []) as made:  # no index is used here
        yield made


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
    itself could open as many as it likes and starve every other sandbox's egress. Only the relay's
    group may connect: the sandbox user gets EACCES."""
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


async def test_a_websocket_is_counted_against_the_budget_and_cut_past_it(
    egress: SandboxService, hosts: EgressHosts
) -> None:
    """An upgraded connection is a tunnel whose bytes are counted and dropped (mitmproxy's WebSocket
    layer, off, counted none and kept every message in the shared proxy's memory)."""
    data = hosts.name("data")
    code = f"""
import base64
token = os.environ["HTTP_PROXY"].split("run:", 1)[1].split("@", 1)[0]
auth = "Basic " + base64.b64encode(f"run:{{token}}".encode()).decode()
s = socket.create_connection(("127.0.0.1", 3128), timeout=30)
s.sendall((f"GET http://{data}/ws-big?n={12 << 20} HTTP/1.1\\r\\nHost: {data}\\r\\nProxy-Authorization: {{auth}}\\r\\n"
           "Upgrade: websocket\\r\\nConnection: Upgrade\\r\\nSec-WebSocket-Version: 13\\r\\n"
           "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\\r\\n\\r\\n").encode())
got, first, error = 0, b"", ""
try:
    while chunk := s.recv(1 << 16):
        first = first or chunk[:40]
        got += len(chunk)
except OSError as exc:
    error = type(exc).__name__
after = get("http://{data}/echo")
print(json.dumps({{"first": first.decode("latin-1"), "got": got, "error": error, "after": after.get("status")}}))
"""
    found = said(await run(egress, ALICE, code))
    assert found["first"].startswith("HTTP/1.1 101"), found
    assert found["got"] < 5 << 20 and found["after"] == 403, found  # 4 MiB a run


async def test_a_tunnels_first_request_sent_in_pieces_is_checked_whole(
    egress: SandboxService, hosts: EgressHosts
) -> None:
    """A plain-HTTP request inside a CONNECT tunnel, its Host line sent before the rest of its head,
    is still checked against the tunnel's target (mitmproxy settles the layer at the Host line)."""
    data = hosts.name("data")
    code = f"""
import base64, time
token = os.environ["HTTP_PROXY"].split("run:", 1)[1].split("@", 1)[0]
auth = "Basic " + base64.b64encode(f"run:{{token}}".encode()).decode()
s = socket.create_connection(("127.0.0.1", 3128), timeout=15)
s.sendall(f"CONNECT {data}:80 HTTP/1.1\\r\\nHost: {data}:80\\r\\nProxy-Authorization: {{auth}}\\r\\n\\r\\n".encode())
connected = s.recv(4096).decode("latin-1").split("\\r\\n")[0]
s.sendall(b"GET /echo HTTP/1.1\\r\\nHost: evil.egress.test\\r\\n")
time.sleep(1)  # the attack: the rest of the head in a later read
s.sendall(b"Connection: close\\r\\n\\r\\n")
answer = b""
try:
    while chunk := s.recv(65536):
        answer += chunk
except OSError as exc:
    answer += repr(exc).encode()
print(json.dumps({{"connected": connected, "answer": answer.decode("latin-1")[:300]}}))
"""
    found = said(await run(egress, ALICE, code))
    assert " 200" in found["connected"] and "evil" not in found["answer"] and " 200 " not in found["answer"], found


async def test_a_request_head_that_never_ends_is_refused_not_buffered(
    egress: SandboxService, hosts: EgressHosts
) -> None:
    """mitmproxy buffers an HTTP/1 head whole, without a bound, and so does its choice of a tunnel's
    layer: one sandbox could fill the shared proxy's memory with a header line that never ends. A
    plain request's head past 64 KiB is answered 431 and closed; a tunnel's first 64 KiB that name
    no host are cut."""
    data = hosts.name("data")
    code = f"""
import base64
token = os.environ["HTTP_PROXY"].split("run:", 1)[1].split("@", 1)[0]
auth = "Basic " + base64.b64encode(f"run:{{token}}".encode()).decode()
def endless(tunnel):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=10)
    if tunnel:
        s.sendall(f"CONNECT {data}:80 HTTP/1.1\\r\\nHost: {data}:80\\r\\nProxy-Authorization: {{auth}}\\r\\n\\r\\n".encode())
        s.recv(4096)
        s.sendall(b"GET /echo HTTP/1.1\\r\\nX-Pad: ")
    else:
        s.sendall(f"GET http://{data}/echo HTTP/1.1\\r\\nHost: {data}\\r\\nProxy-Authorization: {{auth}}\\r\\nX-Pad: ".encode())
    sent, answer, error, pad = 0, b"", "", b"a" * 65536
    try:
        while sent < 32 << 20:
            s.sendall(pad)
            sent += len(pad)
        answer = s.recv(4096)
    except OSError as exc:
        error = type(exc).__name__
    return {{"sent": sent, "answer": answer.decode("latin-1")[:100], "error": error}}
print(json.dumps({{"plain": endless(False), "tunnel": endless(True)}}))
"""
    found = said(await run(egress, ALICE, code))
    for case in found.values():
        assert case["sent"] < 32 << 20 or "431" in case["answer"], found


async def test_the_secret_never_goes_in_plain_text_to_port_443(egress: SandboxService, hosts: EgressHosts) -> None:
    """Plain HTTP inside a CONNECT tunnel to the secret's host, or ``http://host:443/``: the proxy
    would add the header and send it in clear text to the port its operator took for TLS."""
    api = hosts.name("api")
    code = f"""
import base64
token = os.environ["HTTP_PROXY"].split("run:", 1)[1].split("@", 1)[0]
auth = "Basic " + base64.b64encode(f"run:{{token}}".encode()).decode()
def answer(s):
    got = b""
    try:
        while chunk := s.recv(65536):
            got += chunk
    except OSError as exc:
        got += repr(exc).encode()
    return got.decode("latin-1").split("\\r\\n")[0]
s = socket.create_connection(("127.0.0.1", 3128), timeout=15)
s.sendall(f"CONNECT {api}:443 HTTP/1.1\\r\\nHost: {api}:443\\r\\nProxy-Authorization: {{auth}}\\r\\n\\r\\n".encode())
s.recv(4096)
s.sendall(b"GET /secret-check HTTP/1.1\\r\\nHost: {api}\\r\\nConnection: close\\r\\n\\r\\n")
tunnel = answer(s)
s = socket.create_connection(("127.0.0.1", 3128), timeout=15)
s.sendall(f"GET http://{api}:443/secret-check HTTP/1.1\\r\\nHost: {api}:443\\r\\nProxy-Authorization: {{auth}}\\r\\nConnection: close\\r\\n\\r\\n".encode())
print(json.dumps({{"tunnel": tunnel, "plain": answer(s)}}))
"""
    found = said(await run(egress, ALICE, code))
    assert all(" 403 " in line and "TLS only" in line for line in found.values()), found


VIA = """
def via(proxy, url):
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": proxy, "https": proxy}))
    try:
        with opener.open(url, timeout=30) as r:
            return {"status": r.status, "body": r.read(2000).decode("latin-1")}
    except urllib.error.HTTPError as e:
        return {"status": e.code, "body": e.read(2000).decode("latin-1")}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"[:600]}
"""


async def test_a_grant_works_only_from_the_sandbox_it_was_issued_to(egress: SandboxService, hosts: EgressHosts) -> None:
    """A fork starts from its source's files and variables, so it holds a copy of the source's
    grant; code may copy a grant anywhere. Narrowed, the fork (or another session given the token)
    must not reach through that copy what it may no longer reach: the proxy takes a grant only from
    the container it was issued to (its relay's key)."""
    api, data = hosts.name("api"), hosts.name("data")
    source = (await egress.new_session(ALICE)).session_id
    other = (await egress.new_session(ALICE, [data])).session_id
    try:
        keep = (
            'open("/mnt/data/proxy", "w").write(os.environ["HTTP_PROXY"]); print(json.dumps(os.environ["HTTP_PROXY"]))'
        )
        copied = said(await run(egress, ALICE, keep, source))
        (fork,) = await egress.fork_session(ALICE, source)
        try:
            assert (await egress.restrict_egress(ALICE, fork, [data])).egress == [data]
            probe = (
                VIA
                + f"""
copied = open("/mnt/data/proxy").read() if os.path.exists("/mnt/data/proxy") else {copied!r}
print(json.dumps({{"copied_http": via(copied, "http://{api}/secret-check"),
                   "copied_https": via(copied, "https://{api}/secret-check"),
                   "own": get("http://{api}/secret-check"), "own_data": get("https://{data}/echo").get("status")}}))
"""
            )
            for where in (fork, other):
                found = said(await run(egress, ALICE, probe, where))
                assert found["copied_http"].get("status") == 407, (where, found)
                assert "issued to another sandbox" in found["copied_http"]["body"], found
                assert "407" in found["copied_https"].get("error", ""), found
                assert found["own"].get("status") == 403 and found["own_data"] == 200, found
            # where it was issued, the same token still works
            found = said(
                await run(
                    egress, ALICE, VIA + f'print(json.dumps(via({copied!r}, "http://{api}/secret-check")))', source
                )
            )
            assert found.get("status") == 200, found
        finally:
            await egress.close_session(ALICE, fork)
    finally:
        await egress.close_session(ALICE, source)
        await egress.close_session(ALICE, other)


HOLDERS, HELD = 8, 64  # sandboxes, and the most connections each one's relay holds


async def test_sandboxes_holding_every_connection_they_may_do_not_deny_a_fresh_one(
    egress: SandboxService, hosts: EgressHosts
) -> None:
    """A process per connection in the proxy (socat) let eight sandboxes holding their relay's 64
    connections each (slowloris: a head that never ends) use up the proxy's 512 processes: every
    other sandbox's egress failed. One process holds them all now, and the proxy's descriptors are
    sized for every sandbox the server may run."""
    if egress.config.runtime == "runsc":
        pytest.skip("the proxy's capacity does not depend on the sandboxes' runtime (runc shows it)")
    data = hosts.name("data")
    hold = f"""
import time
held, answers = [], []
for _ in range({HELD}):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=20)
    s.sendall(b"GET http://{data}/echo HTTP/1.1\\r\\nHost: {data}\\r\\n\\r\\n")  # no credentials: a 407, kept alive
    held.append(s)
deadline = time.monotonic() + 40
for s in held:
    try:
        s.settimeout(max(0.1, deadline - time.monotonic()))
        answers.append(s.recv(64).decode("latin-1").split("\\r\\n")[0])
        s.sendall(b"GET http://{data}/echo HTTP/1.1\\r\\nX-Pad: ")  # then a head that never ends
    except OSError as e:
        answers.append(type(e).__name__)
print(json.dumps(sum(" 407 " in answer for answer in answers)))
"""
    sessions = [(await egress.new_session(ALICE)).session_id for _ in range(HOLDERS)]
    try:
        answered: list[int] = []

        async def holder(session: str) -> None:
            answered.append(said(await run(egress, ALICE, hold, session)))

        async with anyio.create_task_group() as tg:
            for session in sessions:
                tg.start_soon(holder, session)
        outward = egress.egress.egress
        assert outward is not None
        pong = await outward.proxy.ask({"op": "ping"})
        fresh = said(await run(egress, ALICE, f'print(json.dumps(get("https://{data}/echo").get("status")))'))
        assert (fresh, answered) == (200, [HELD] * HOLDERS)
        assert pong.get("bridged", 0) >= HOLDERS * HELD, pong  # all of them still held
    finally:
        for session in sessions:
            await egress.close_session(ALICE, session)
