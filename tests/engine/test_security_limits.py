"""Hostile code against the sandbox's process, memory and time limits
(docs/security.md#processes-memory-and-time): fork bombs, thousands of threads, memory hogs, runs that
never end, processes and threads that try to outlive their run, unbounded recursion.

Every case ends the same way: a clear status or error comes back, the service still answers,
and a following ``print(1)`` in the same place succeeds.
"""

from __future__ import annotations

import anyio
import pytest
from _security import OWNER, assert_answers, no_other_user_processes

from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio

FORK_BOMB = (
    "import os, time\n"
    "while True:\n"
    "    try:\n"
    "        if os.fork() == 0:\n"
    "            time.sleep(1000)\n"
    "    except OSError:\n"
    "        pass\n"
)
FORK_BOMB_EXPONENTIAL = "import os\nwhile True:\n    try:\n        os.fork()\n    except BaseException:\n        pass\n"


# -- 1. fork bomb ---------------------------------------------------------------------------------
@pytest.mark.parametrize("bomb", [FORK_BOMB, FORK_BOMB_EXPONENTIAL], ids=["sleepers", "exponential"])
async def test_a_fork_bomb_hits_the_pids_limit_and_leaves_no_process(service: SandboxService, bomb: str) -> None:
    with anyio.fail_after(40):
        result = await service.run(OWNER, bomb, timeout=3)
    # 128 forked copies of an interpreter may hit the memory limit before the pids limit stops them;
    # the exponential bomb sometimes takes its container down with it (seen once in three full runs:
    # to be understood), which is the worst a container may do: it is replaced, and said so.
    lost = result.status == "crashed" and result.error is not None and result.error.type == "SandboxLost"
    assert result.status in ("timeout", "memory_limit") or (bomb == FORK_BOMB_EXPONENTIAL and lost), result
    await no_other_user_processes(service)
    await assert_answers(service)


async def test_a_fork_bomb_in_a_session_is_killed_and_the_session_recovers(service: SandboxService) -> None:
    session = await service.new_session(OWNER)
    sid = session.session_id
    try:
        await service.run(OWNER, "open('kept.txt', 'w').write('yes')", session_id=sid)
        with anyio.fail_after(40):
            result = await service.run(OWNER, FORK_BOMB, session_id=sid, timeout=3)
        assert result.status in ("timeout", "memory_limit"), result
        await no_other_user_processes(service, sid)
        assert (await service.run(OWNER, "open('kept.txt').read()", session_id=sid)).result == "'yes'"
        await assert_answers(service, sid)
    finally:
        await service.close_session(OWNER, sid)


# -- 2. thousands of threads ----------------------------------------------------------------------
THREADS = (
    "import threading, time\n"
    "for _ in range(5000):\n"
    "    threading.Thread(target=time.sleep, args=(1000,), daemon=True).start()\n"
)


async def test_thousands_of_threads_end_in_cant_start_new_thread(service: SandboxService) -> None:
    result = await service.run(OWNER, THREADS, timeout=20)
    assert result.status == "error", result
    assert result.error is not None and result.error.type == "RuntimeError"
    assert "can't start new thread" in result.error.message
    await no_other_user_processes(service)
    await assert_answers(service)


async def test_thousands_of_threads_in_a_session_leave_it_usable(service: SandboxService) -> None:
    session = await service.new_session(OWNER)
    try:
        result = await service.run(OWNER, THREADS, session_id=session.session_id, timeout=20)
        assert result.status == "error", result
        assert result.error is not None and "can't start new thread" in result.error.message
        await assert_answers(service, session.session_id)
    finally:
        await service.close_session(OWNER, session.session_id)


# -- 3. memory --------------------------------------------------------------------------------------
@pytest.mark.parametrize("hog", ["bytearray(10**10)", "x = [bytes(10**6) for _ in range(10**5)]"])
async def test_a_memory_hog_gets_memory_limit_and_the_session_keeps_its_files(
    service: SandboxService, hog: str
) -> None:
    session = await service.new_session(OWNER)
    sid = session.session_id
    try:
        await service.run(OWNER, "open('kept.txt', 'w').write('yes'); variable = 1", session_id=sid)
        with anyio.fail_after(60):
            result = await service.run(OWNER, hog, session_id=sid, timeout=30)
        assert result.status == "memory_limit", result
        assert result.error is not None and result.error.message
        after = await service.run(OWNER, "variable", session_id=sid)
        if result.session_restarted:  # the interpreter was replaced, and the caller was told so
            assert after.status == "error" and after.error is not None and after.error.type == "NameError"
        else:  # a MemoryError inside the interpreter: nothing was lost
            assert after.result == "1", after
        assert (await service.run(OWNER, "open('kept.txt').read()", session_id=sid)).result == "'yes'"
        await assert_answers(service, sid)
    finally:
        await service.close_session(OWNER, sid)


async def test_a_memory_hog_in_a_stateless_run_gets_memory_limit(service: SandboxService) -> None:
    with anyio.fail_after(60):
        result = await service.run(OWNER, "x = bytearray(10**10)", timeout=30)
    assert result.status == "memory_limit", result
    await assert_answers(service)


# -- 4, 5, 6. timeouts --------------------------------------------------------------------------
STUBBORN = (
    "import signal\n"
    "for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1):\n"
    "    signal.signal(s, signal.SIG_IGN)\n"
    "while True:\n"
    "    pass\n"
)
CATCHES_INTERRUPT = (
    "while True:\n"
    "    try:\n"
    "        while True:\n"
    "            pass\n"
    "    except KeyboardInterrupt:\n"
    "        print('caught', flush=True)\n"
)
SLEEPER = "import time\ntime.sleep(10**9)\n"


@pytest.mark.parametrize(
    "code",
    ["while True: pass", SLEEPER, STUBBORN, CATCHES_INTERRUPT],
    ids=["busy-loop", "sleep", "signals-ignored", "keyboardinterrupt-caught"],
)
async def test_a_run_that_never_ends_is_stopped_at_the_timeout(service: SandboxService, code: str) -> None:
    with anyio.fail_after(2 + 3 + 10):  # timeout, the agent's grace and escalation, slack
        result = await service.run(OWNER, code, timeout=2)
    assert result.status == "timeout", result
    await no_other_user_processes(service)
    await assert_answers(service)


@pytest.mark.parametrize(
    "code",
    ["while True: pass", SLEEPER, STUBBORN, CATCHES_INTERRUPT],
    ids=["busy-loop", "sleep", "signals-ignored", "keyboardinterrupt-caught"],
)
async def test_a_session_run_that_never_ends_is_stopped_and_the_session_answers(
    service: SandboxService, code: str
) -> None:
    session = await service.new_session(OWNER)
    sid = session.session_id
    try:
        await service.run(OWNER, "open('kept.txt', 'w').write('yes')", session_id=sid)
        with anyio.fail_after(2 + 3 + 10):
            result = await service.run(OWNER, code, session_id=sid, timeout=2)
        assert result.status == "timeout", result
        assert (await service.run(OWNER, "open('kept.txt').read()", session_id=sid)).result == "'yes'"
        await assert_answers(service, sid)
    finally:
        await service.close_session(OWNER, sid)


# -- 7, 8. processes and threads outliving the run -------------------------------------------------
ESCAPEES = (
    "import os, signal, threading, time\n"
    "if os.fork() == 0:\n"
    "    os.setsid()\n"
    "    for s in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):\n"
    "        signal.signal(s, signal.SIG_IGN)\n"
    "    if os.fork() == 0:\n"
    "        while True:\n"
    "            open('/tmp/still-here', 'w').write(str(time.time()))\n"
    "            time.sleep(0.01)\n"
    "    os._exit(0)\n"
    "def busy():\n"
    "    while True:\n"
    "        open('/dev/shm/thread-was-here', 'w').write('x')\n"
    "        time.sleep(0.01)\n"
    "threading.Thread(target=busy).start()  # not a daemon\n"
    "print('left behind')\n"
)


async def test_setsid_children_and_non_daemon_threads_do_not_survive_a_stateless_run(service: SandboxService) -> None:
    result = await service.run(OWNER, ESCAPEES, timeout=10)
    assert result.status == "ok", result
    assert result.stdout == "left behind\n"
    await no_other_user_processes(service)
    for _ in range(service.config.pool.size + 1):
        check = await service.run(OWNER, "import os; print(os.listdir('/tmp'), os.listdir('/dev/shm'))")
        assert check.stdout == "[] []\n", check


async def test_setsid_children_do_not_survive_a_session_run_that_timed_out(service: SandboxService) -> None:
    session = await service.new_session(OWNER)
    sid = session.session_id
    try:
        result = await service.run(OWNER, ESCAPEES + STUBBORN, session_id=sid, timeout=2)
        assert result.status == "timeout", result
        assert result.session_restarted
        await no_other_user_processes(service, sid)
        await assert_answers(service, sid)
    finally:
        await service.close_session(OWNER, sid)


# -- 15. unbounded recursion ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "code",
    [
        "import sys\nsys.setrecursionlimit(10**9)\nnested = []\nfor _ in range(10**7): nested = [nested]\nrepr(nested)",
        "import sys\nsys.setrecursionlimit(10**9)\ndef f(n): return f(n + 1)\nf(0)",
    ],
    ids=["c-recursion", "python-recursion"],
)
async def test_unbounded_recursion_is_reported_and_the_session_answers(service: SandboxService, code: str) -> None:
    session = await service.new_session(OWNER)
    sid = session.session_id
    try:
        await service.run(OWNER, "open('kept.txt', 'w').write('yes')", session_id=sid)
        with anyio.fail_after(60):
            result = await service.run(OWNER, code, session_id=sid, timeout=30)
        assert result.status in ("crashed", "memory_limit"), result
        assert result.session_restarted
        assert result.error is not None and result.error.message
        assert (await service.run(OWNER, "open('kept.txt').read()", session_id=sid)).result == "'yes'"
        await assert_answers(service, sid)
    finally:
        await service.close_session(OWNER, sid)
