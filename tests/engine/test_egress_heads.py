"""The shared egress proxy held by hostile sandboxes' unfinished request heads
(docs/security.md#egress): one sandbox's heads bounded in all, and every head in time. Against the
test hosts of ``_egress_hosts`` and the real proxy, under runc (the proxy does not depend on the
sandboxes' runtime), each with its own service (its proxy's memory, its head deadline)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from _egress import ALICE, BOB, egress_service, egress_test_hosts, run, said
from _egress_hosts import EgressHosts, missing_tools

from mcp_code_exec.egress import service as egress_service_module

pytestmark = [pytest.mark.anyio, pytest.mark.skipif(missing_tools() is not None, reason=str(missing_tools()))]
HELD = 64  # the most connections one sandbox's relay holds


@pytest.fixture(scope="module")
def hosts() -> Iterator[EgressHosts]:
    with egress_test_hosts("s3cr3t-egress-" + os.urandom(8).hex(), []) as made:  # no index is used here
        yield made


async def test_held_unfinished_heads_do_not_kill_the_shared_proxy(hosts: EgressHosts, tmp_path: Path) -> None:
    """Each of a sandbox's 64 connections holding a request head just under the head's bound, never
    ended: a few sandboxes doing so took the proxy's memory (128 MiB) and killed it, denying egress to
    every other identity. The unfinished heads of one container add up to at most its budget (sized
    from the proxy's memory and the sandboxes the server may run); past it a head is answered 431."""
    data = hosts.name("data")
    pad = 60 * 1024  # under the head's own bound (64 KiB): only the container's budget refuses it
    hold = f"""
held, refused = globals().setdefault("held", []), 0
for _ in range({HELD}):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=20)
    s.sendall(b"GET http://{data}/echo HTTP/1.1\\r\\nHost: {data}\\r\\n\\r\\n")  # a 407, kept alive
    held.append(s)
for s in held[-{HELD}:]:
    try:
        s.settimeout(20)
        s.recv(300)
        s.sendall(b"GET http://{data}/echo HTTP/1.1\\r\\nX-Pad: " + b"a" * {pad})  # a head that never ends
    except OSError:
        refused += 1
print(json.dumps(refused))
"""
    async with egress_service(hosts, tmp_path, "runc", egress={"memory_mb": 128}) as service:
        outward = service.egress.egress
        assert outward is not None
        first = outward.proxy.container_id
        sessions = [(await service.new_session(ALICE)).session_id for _ in range(4)]
        try:
            for session in sessions:
                said(await run(service, ALICE, hold, session))
            pong = await outward.proxy.ask({"op": "ping"})
            fresh = said(await run(service, BOB, f'print(json.dumps(get("http://{data}/echo").get("status")))'))
            assert (fresh, outward.proxy.container_id) == (200, first)
            assert 0 < pong["heads"] <= outward.heads_budget, (pong, outward.heads_budget)
        finally:
            for session in sessions:
                await service.close_session(ALICE, session)


async def test_a_request_head_begun_after_the_first_must_end_within_the_deadline(
    hosts: EgressHosts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The deadline for a request head covered a connection's first head alone: after one request
    (even one refused 407) a connection could hold a second head unfinished for ever. Each head's
    deadline starts at its first byte (shortened here to 3 s from 60)."""
    monkeypatch.setattr(egress_service_module, "HEAD_S", 3.0)
    data = hosts.name("data")
    hold = f"""
held = globals().setdefault("held", [])
for _ in range(8):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=20)
    s.sendall(b"GET http://{data}/echo HTTP/1.1\\r\\nHost: {data}\\r\\n\\r\\n")  # a 407, kept alive
    s.recv(300)
    s.sendall(b"GET http://{data}/echo HTTP/1.1\\r\\nX-Pad: a")  # a second head, never ended
    held.append(s)
print(json.dumps(len(held)))
"""
    async with egress_service(hosts, tmp_path, "runc") as service:
        outward = service.egress.egress
        assert outward is not None
        session = (await service.new_session(ALICE)).session_id
        try:
            assert said(await run(service, ALICE, hold, session)) == 8
            conns = (await outward.proxy.ask({"op": "ping"}))["conns"]
            with anyio.fail_after(30):
                while conns:  # polling the proxy's own count of its clients: each is closed at its deadline
                    await anyio.sleep(0.5)
                    conns = (await outward.proxy.ask({"op": "ping"}))["conns"]
        finally:
            await service.close_session(ALICE, session)


async def test_tunnels_holding_unfinished_first_messages_count_against_the_same_budget(
    hosts: EgressHosts, tmp_path: Path
) -> None:
    """A tunnel's first message is held back until it names a host (to check that name): 64 tunnels
    each holding just under 64 KiB of a request head that never ends held 4 MiB a sandbox outside
    the budget of its request heads. They count against it now, and a tunnel past it is cut."""
    data = hosts.name("data")
    pad = 60 * 1024
    hold = f"""
import base64, urllib.parse
proxy = urllib.parse.urlsplit(os.environ["HTTP_PROXY"])
auth = base64.b64encode(f"{{proxy.username}}:{{proxy.password}}".encode())
held, cut = globals().setdefault("held", []), 0
for _ in range({HELD}):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=20)
    s.sendall(b"CONNECT {data}:80 HTTP/1.1\\r\\nHost: {data}:80\\r\\nProxy-Authorization: Basic " + auth + b"\\r\\n\\r\\n")
    assert b" 200 " in s.recv(300)
    try:
        s.sendall(b"GET /echo HTTP/1.1\\r\\nX-Pad: " + b"a" * {pad})  # a first message that never ends
    except OSError:
        cut += 1
    held.append(s)
print(json.dumps(cut))
"""
    async with egress_service(hosts, tmp_path, "runc", egress={"memory_mb": 128}) as service:
        outward = service.egress.egress
        assert outward is not None
        session = (await service.new_session(ALICE)).session_id
        try:
            said(await run(service, ALICE, hold, session))
            pong = await outward.proxy.ask({"op": "ping"})
            assert 0 < pong["heads"] <= outward.heads_budget, (pong, outward.heads_budget)
            fresh = said(await run(service, BOB, f'print(json.dumps(get("http://{data}/echo").get("status")))'))
            assert fresh == 200
        finally:
            await service.close_session(ALICE, session)
