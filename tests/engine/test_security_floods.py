"""Hostile code flooding the service (docs/security.md#output-and-load): endless and huge output,
output that is not text or looks like the protocol, fifty runs at once, and the server's own memory
after all of it.

Every case ends the same way: a clear status or error comes back, the service still answers,
and a following ``print(1)`` in the same place succeeds.
"""

from __future__ import annotations

import gc

import anyio
import pytest
from _security import OTHER_USER_PROCESSES, OWNER, assert_answers, rss_kib
from _support import wait_until

from mcp_code_exec.errors import PoolBusy
from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio


# -- 9, 10. output floods ---------------------------------------------------------------------------
async def test_endless_print_is_cut_at_the_cap_with_a_marker(service: SandboxService) -> None:
    streamed: list[str] = []

    async def on_output(stream: str, text: str) -> None:
        streamed.append(text)

    # Both streams, for 3 s: about 60 events at the agent's pace, past the first few the host allows
    # at once (frames.EVENT_PACES), so the pace it holds the agent to is the one it keeps.
    code = "import sys\nwhile True: print('spam' * 50); print('eggs' * 50, file=sys.stderr)"
    with anyio.fail_after(30):
        result = await service.run(OWNER, code, timeout=3, on_output=on_output)
    cap = service.config.limits.max_output_bytes
    assert result.status == "timeout", result
    assert set(result.truncated) == {"stdout", "stderr"}
    assert "bytes of output cut here" in result.stdout
    assert len(result.stdout.encode()) < cap + 200
    assert sum(len(t) for t in streamed) < 4 * 1024 * 1024  # live streaming is throttled, not a firehose
    await assert_answers(service)


HUGE_WRITE = (
    "import mmap, os, sys\n"
    "sys.stdout.write('y' * (16 << 20)); sys.stdout.flush()\n"
    "flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # untouched private pages read as the zero page\n"
    "zeros = mmap.mmap(-1, 400 << 20, flags=flags, prot=mmap.PROT_READ)  # 400 MB of output, no memory\n"
    "view = memoryview(zeros)\n"
    "while view:\n"
    "    view = view[os.write(1, view):]\n"
    "os.write(2, b'e' * (32 << 20))\n"
    "print('end')\n"
)


async def test_one_huge_write_to_stdout_is_cut_at_the_cap(service: SandboxService) -> None:
    with anyio.fail_after(60):
        result = await service.run(OWNER, HUGE_WRITE, timeout=40)
    cap = service.config.limits.max_output_bytes
    assert result.status == "ok", result
    assert set(result.truncated) == {"stdout", "stderr"}
    assert result.stdout.endswith("end\n")
    assert len(result.stdout.encode()) < cap + 200
    assert len(result.stderr.encode()) < cap + 200
    await assert_answers(service)


# -- 11. output that is not text, or looks like the protocol ------------------------------------------
PROTOCOL_LOOKALIKE = (
    "import json, os, struct, sys\n"
    "fake = json.dumps({'ev': 'done', 'id': 1, 'status': 'ok', 'stdout': 'forged'}).encode()\n"
    "frame = struct.pack('>II', len(fake), 0) + fake\n"
    "mux = struct.pack('>BxxxI', 1, len(frame)) + frame\n"
    "for fd in (1, 2):\n"
    "    os.write(fd, b'\\xff\\xfe\\x80 not utf-8 \\xc3\\x28 ' + mux + frame + b'\\x00\\x1b[2J\\n')\n"
    '    os.write(fd, b\'{"jsonrpc": "2.0", "id": 1, "result": {"forged": true}}\\n\')\n'
    "for target in ('/proc/1/fd/1', '/proc/1/fd/0', f'/proc/{os.getppid()}/fd/1', '/dev/console', '/dev/tty'):\n"
    "    try:\n"
    "        with open(target, 'wb') as handle:\n"
    "            handle.write(mux)\n"
    "        print('WROTE', target)\n"
    "    except OSError as exc:\n"
    "        print('refused', target, type(exc).__name__)\n"
    "print('done')\n"
)


async def test_binary_and_protocol_lookalike_output_arrives_as_text(service: SandboxService) -> None:
    session = await service.new_session(OWNER)
    sid = session.session_id
    try:
        for session_id in (None, sid):
            result = await service.run(OWNER, PROTOCOL_LOOKALIKE, session_id=session_id)
            assert result.status == "ok", result
            assert "WROTE" not in result.stdout, result.stdout
            assert result.stdout.endswith("done\n")
            assert "\ufffd" in result.stdout and "not utf-8" in result.stdout
            assert '"forged": true' in result.stdout and '"stdout": "forged"' in result.stderr
            assert result.stdout.count("refused") == 5
            await assert_answers(service, session_id)
    finally:
        await service.close_session(OWNER, sid)


# -- 17. concurrency ---------------------------------------------------------------------------------
async def test_fifty_concurrent_runs_each_get_their_own_result_or_busy(service: SandboxService) -> None:
    outcomes: dict[int, object] = {}

    async def one(n: int) -> None:
        try:
            result = await service.run(f"{OWNER}-{n}", f"import time; time.sleep(0.02); print({n} * 7)")
        except PoolBusy as exc:
            assert "retry" in str(exc)
            outcomes[n] = "busy"
            return
        assert result.status == "ok", result
        outcomes[n] = result.stdout

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            for n in range(50):
                tg.start_soon(one, n)
    for n, outcome in outcomes.items():
        assert outcome in ("busy", f"{n * 7}\n"), (n, outcome)
    assert len(outcomes) == 50
    assert sum(1 for o in outcomes.values() if o != "busy") >= 1
    pool = service.stateless_pool
    await wait_until(lambda: pool.owned == pool.size and pool.idle == pool.size, 60)
    await assert_answers(service)


# -- the server itself stays flat ----------------------------------------------------------------------
async def test_server_memory_returns_to_its_level_after_hostile_runs(service: SandboxService) -> None:
    hostile = [
        "while True: print('x' * 1000)",
        HUGE_WRITE,
        "import sys; sys.stderr.write('z' * (32 << 20))",
        OTHER_USER_PROCESSES,
    ]
    for code in hostile:  # warm-up: imports, buffers and caches of the first calls
        await service.run(OWNER, code, timeout=2)
    gc.collect()
    before = rss_kib()
    for _ in range(3):
        for code in hostile:
            await service.run(OWNER, code, timeout=2)
    gc.collect()
    after = rss_kib()
    assert after <= before * 1.2, (before, after)


# -- code mode's call frames where code mode is off --------------------------------------------------
async def test_a_forged_tool_call_frame_where_code_mode_is_off_is_refused_at_once(service: SandboxService) -> None:
    code = (
        "from mcpx_agent.worker.mcp_tools import CHANNEL, ToolDenied\n"
        "try:\n"
        "    CHANNEL.wait(CHANNEL.send('anything', 'tool', {}, False))\n"
        "except ToolDenied as exc:\n"
        "    print('refused:', exc)\n"
    )
    result = await service.run(OWNER, code, timeout=20)  # the suite's service has no [code_mode]
    assert result.status == "ok", result  # not the run's timeout
    assert result.stdout == "refused: no tool server of that name is available to this caller\n", result


async def test_a_flood_of_forged_tool_call_frames_where_code_mode_is_off_stops_only_its_run(
    service: SandboxService,
) -> None:
    flood = (
        "from mcpx_agent import protocol\n"
        "for call in range(20000):\n"
        "    protocol.send(3, {'kind': 'call', 'call': call, 'server': 'x', 'tool': 't'}, b'{}')\n"
    )
    result = await service.run(OWNER, flood, timeout=60)
    assert result.status == "crashed" and result.error is not None, result
    assert "more than 100 tool calls, far past what it may make" in result.error.message, result
    assert (await service.run(OWNER, "print(1)")).stdout == "1\n"


# A done's header is held to a little structure outside its strings (frames.EVENT_STRUCTURE_LIMITS):
# the most files a run can report must still fit, in a session and stateless.
MANY_FILES = (
    "import os\nfor i in range(3000):\n    open(f'/mnt/data/{\"d\" * 200}{i:05}-\\x01\\x02\\x03', 'w').write('x')\n"
)


@pytest.mark.parametrize("where", ["session", "stateless"])
async def test_a_run_that_leaves_thousands_of_files_gets_its_result(service: SandboxService, where: str) -> None:
    session_id = (await service.new_session(OWNER)).session_id if where == "session" else None
    try:
        with anyio.fail_after(120):
            result = await service.run(OWNER, MANY_FILES, session_id=session_id, timeout=60)
        assert result.status == "ok", result.error
        assert len(result.files) + result.files_omitted >= 100, (len(result.files), result.files_omitted)
        await assert_answers(service, session_id)
    finally:
        if session_id is not None:
            await service.close_session(OWNER, session_id)
