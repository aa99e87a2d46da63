"""Load: many MCP clients at once; nothing wrong, nothing lost, nothing leaked.

Several in-memory MCP clients (``Client(build_server(service))``) run at the same time, each
cycling through:

- stateless runs that print a token unique to the call (the answer must carry the caller's token);
- runs in the client's own session that increment a counter (every value must be exact);
- ``write_file`` then ``read_file`` of a fresh file (every file must come back, and be listed at the end);
- hostile runs: an endless loop with ``timeout=1`` and a ``bytearray(10**10)`` memory blow-up
  (they must end as ``timeout`` / ``memory_limit`` (or ``MemoryError``), never hang or crash).

At the end: zero wrong or lost results, no container or volume of this process beyond the pools'
own (and none at all once the service is closed), and the process's RSS back within 20 % of its
start (after a garbage collection and ``malloc_trim``, so freed memory the allocator still holds
is not counted as a leak).

The short form runs in CI (about a minute). Size it with environment variables for a long form::

    LOAD_CLIENTS=32 LOAD_SECONDS=600 LOAD_POOL=4 python -m pytest tests/test_load.py -s

``LOAD_CLIENTS`` (default 8) concurrent clients, ``LOAD_SECONDS`` (default 20) of load,
``LOAD_POOL`` (default 2) warm stateless containers. ``-s`` shows the measured numbers.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import secrets
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest
from _support import make_test_config, project_containers, project_volumes, wait_until
from mcp import Client

from mcp_code_exec.mcp_server import build_server
from mcp_code_exec.service.facade import SandboxService

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

CLIENTS = int(os.environ.get("LOAD_CLIENTS", "8"))
SECONDS = float(os.environ.get("LOAD_SECONDS", "20"))
POOL = int(os.environ.get("LOAD_POOL", "2"))
CALL_BOUND_S = 120.0  # one call may wait for a container, run, and be replaced; past this it hung


def rss_bytes() -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def settled_rss() -> int:
    gc.collect()
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap back, so only live memory counts
    return rss_bytes()


@dataclass
class Tally:
    calls: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)

    def wrong(self, kind: str, detail: Any) -> None:
        self.problems.append(f"{kind}: {str(detail)[:300]}")


def structured(result: Any) -> dict[str, Any]:
    data = result.structured_content
    assert isinstance(data, dict), result
    return data


async def one_client(client: Client, number: int, deadline: float, tally: Tally) -> None:
    session_id = structured(await client.call_tool("new_session", {}))["session_id"]
    counter = 0
    files: dict[str, str] = {}
    step = 0
    while time.monotonic() < deadline:
        kind = ("token", "counter", "file", "token", "counter", "hostile")[step % 6]
        if kind == "hostile":
            kind = "timeout" if (step // 6 + number) % 2 == 0 else "memory"
        step += 1
        tally.calls[kind] += 1
        try:
            with anyio.fail_after(CALL_BOUND_S):
                if kind == "token":
                    token = f"tok-{number}-{secrets.token_hex(8)}"
                    got = structured(await client.call_tool("run_python", {"code": f"print({token!r})"}))
                    if got["status"] != "ok" or got["stdout"] != token + "\n":
                        tally.wrong(kind, (token, got["status"], got["stdout"], got.get("error")))
                elif kind == "counter":
                    code = "counter = globals().get('counter', 0) + 1\ncounter"
                    got = structured(await client.call_tool("run_python", {"code": code, "session_id": session_id}))
                    counter += 1
                    if got["status"] != "ok" or got["result"] != str(counter):
                        tally.wrong(kind, (counter, got["status"], got["result"], got.get("error")))
                elif kind == "file":
                    name, text = f"f{step}.txt", f"content {number} {step} {secrets.token_hex(8)}"
                    wrote = await client.call_tool(
                        "write_file", {"session_id": session_id, "path": name, "content": text}
                    )
                    back = await client.call_tool("read_file", {"session_id": session_id, "path": name})
                    files[name] = text
                    if wrote.is_error or back.is_error or getattr(back.content[0], "text", None) != text:
                        tally.wrong(kind, (name, wrote.is_error, back.content[0]))
                elif kind == "timeout":
                    got = structured(await client.call_tool("run_python", {"code": "while True: pass", "timeout": 1}))
                    if got["status"] != "timeout":
                        tally.wrong(kind, (got["status"], got.get("error")))
                else:
                    got = structured(
                        await client.call_tool("run_python", {"code": "b = bytearray(10**10)", "timeout": 20})
                    )
                    memory_error = got["status"] == "error" and (got.get("error") or {}).get("type") == "MemoryError"
                    if got["status"] != "memory_limit" and not memory_error:
                        tally.wrong(kind, (got["status"], got.get("error")))
        except TimeoutError:
            tally.wrong(kind, f"no answer within {CALL_BOUND_S:.0f} s (hung)")
        except Exception as exc:
            tally.wrong(kind, f"{type(exc).__name__}: {exc}")
    with anyio.fail_after(CALL_BOUND_S):
        listing = structured(await client.call_tool("list_files", {"session_id": session_id}))
        listed = {entry["path"] for entry in listing["entries"]}
        if not set(files) <= listed:
            tally.wrong("file", f"lost files: {sorted(set(files) - listed)}")
        closed = await client.call_tool("close_session", {"session_id": session_id})
        if closed.is_error:
            tally.wrong("close", closed.content)
    tally.calls["file-list"] += 1


async def test_concurrent_clients_get_only_their_own_results_and_nothing_leaks() -> None:
    config = make_test_config(
        pool={"size": POOL, "session_spares": 1, "acquire_timeout_s": 60},
        sessions={"max_sessions": CLIENTS + 2},
    )
    tally = Tally()
    async with SandboxService.start(config) as service:
        await service.wait_ready()
        server = build_server(service)
        async with Client(server) as warm:  # first use builds schemas and imports; not a leak
            await warm.call_tool("run_python", {"code": "1"})
        rss_start = settled_rss()
        started = time.monotonic()
        async with anyio.create_task_group() as tg:
            clients = [Client(server) for _ in range(CLIENTS)]
            deadline = started + SECONDS
            for number, client in enumerate(clients):

                async def drive(client: Client = client, number: int = number) -> None:
                    async with client:
                        await one_client(client, number, deadline, tally)

                tg.start_soon(drive)
        duration = time.monotonic() - started
        del clients, server
        rss_end = settled_rss()

        total = sum(tally.calls.values())
        print(
            f"\nload: {CLIENTS} clients, {total} calls in {duration:.1f} s ({dict(tally.calls)}), "
            f"{len(tally.problems)} wrong or lost; RSS {rss_start / 2**20:.1f} MiB -> {rss_end / 2**20:.1f} MiB"
        )
        assert tally.problems == [], "\n".join(tally.problems[:20])
        assert tally.calls["token"] >= CLIENTS and tally.calls["file-list"] == CLIENTS

        # Only the pools' own containers remain (replacements of recycled ones may still be starting).
        def only_pools() -> bool:
            pooled = service.stateless_pool.container_ids() | service.session_spares.container_ids()
            new = set(project_containers(instance=service.instance))
            new_volumes = set(project_volumes(instance=service.instance))
            full = service.stateless_pool.idle == POOL and service.session_spares.idle == 1
            return full and new == pooled and len(new_volumes) == 1 and len(service.sessions) == 0

        await wait_until(only_pools, 60)
        assert rss_end <= rss_start * 1.2, f"RSS grew from {rss_start} to {rss_end} bytes"
    assert project_containers(instance=service.instance) == []
    assert project_volumes(instance=service.instance) == []
