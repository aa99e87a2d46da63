"""Hostile code against the sandbox's resource limits (SECURITY-CASES.md, cases 1-17).

Every case ends the same way: a clear status or error comes back, the service still answers,
and a following ``print(1)`` in the same place succeeds.
"""

from __future__ import annotations

import gc

import anyio
import pytest
from _security import OTHER_USER_PROCESSES, OWNER, assert_answers, no_other_user_processes
from _support import wait_until

from mcp_code_exec.errors import PoolBusy
from mcp_code_exec.service import SandboxService

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


def rss_kib() -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS in /proc/self/status")


# -- 1. fork bomb ---------------------------------------------------------------------------------
@pytest.mark.parametrize("bomb", [FORK_BOMB, FORK_BOMB_EXPONENTIAL], ids=["sleepers", "exponential"])
async def test_a_fork_bomb_hits_the_pids_limit_and_leaves_no_process(service: SandboxService, bomb: str) -> None:
    with anyio.fail_after(40):
        result = await service.run(OWNER, bomb, timeout=3)
    # 128 forked copies of an interpreter may hit the memory limit before the pids limit stops them
    assert result.status in ("timeout", "memory_limit"), result
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


# -- 9, 10. output floods ---------------------------------------------------------------------------
async def test_endless_print_is_cut_at_the_cap_with_a_marker(service: SandboxService) -> None:
    streamed: list[str] = []

    async def on_output(stream: str, text: str) -> None:
        streamed.append(text)

    with anyio.fail_after(20):
        result = await service.run(OWNER, "while True: print('spam' * 50)", timeout=2, on_output=on_output)
    cap = service.config.limits.max_output_bytes
    assert result.status == "timeout", result
    assert "stdout" in result.truncated
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


# -- 12, 13, 14. disk, inodes, descriptors -------------------------------------------------------------
FILL_DISK = (
    "import errno, os\n"
    "def fill(directory):\n"
    "    written = 0\n"
    "    try:\n"
    "        for n in range(100000):\n"
    "            with open(os.path.join(directory, f'big{n}'), 'wb') as handle:\n"
    "                for _ in range(1 << 12):\n"
    "                    handle.write(b'x' * (1 << 20))\n"
    "                    written += 1\n"
    "    except OSError as exc:\n"
    "        print(directory, errno.errorcode[exc.errno], written > 0)\n"
    "for d in DIRS:\n"
    "    fill(d)\n"
)


async def test_filling_tmp_and_data_reports_enospc_and_the_next_run_is_clean(service: SandboxService) -> None:
    code = "DIRS = ['/tmp', '/mnt/data', '/dev/shm']\n" + FILL_DISK
    with anyio.fail_after(60):
        result = await service.run(OWNER, code, timeout=40)
    assert result.status == "ok", result
    for directory in ("/tmp", "/mnt/data", "/dev/shm"):
        assert any(
            line.startswith(directory + " E") and line.endswith(" True") for line in result.stdout.splitlines()
        ), result
        assert f"{directory} ENOSPC" in result.stdout or f"{directory} EFBIG" in result.stdout
    for _ in range(service.config.pool.size + 1):
        check = await service.run(OWNER, "import os; print([os.listdir(d) for d in ('/tmp', '/mnt/data', '/dev/shm')])")
        assert check.stdout == "[[], [], []]\n", check


async def test_filling_tmp_in_a_session_reports_enospc_and_the_session_answers(service: SandboxService) -> None:
    session = await service.new_session(OWNER)
    sid = session.session_id
    try:
        code = "DIRS = ['/tmp', '/dev/shm']\n" + FILL_DISK
        with anyio.fail_after(60):
            result = await service.run(OWNER, code, session_id=sid, timeout=40)
        assert result.status == "ok", result
        assert "/tmp E" in result.stdout and "/dev/shm E" in result.stdout
        await assert_answers(service, sid)
        freed = await service.run(
            OWNER, "import glob, os\nfor f in glob.glob('/tmp/big*'): os.unlink(f)\nprint('ok')", session_id=sid
        )
        assert freed.stdout == "ok\n"
    finally:
        await service.close_session(OWNER, sid)


async def test_a_single_file_over_the_size_limit_gets_efbig(service: SandboxService) -> None:
    code = (
        "import errno\n"
        "with open('/mnt/data/huge', 'wb') as f:\n"
        "    try:\n"
        f"        f.truncate({service.config.limits.fsize_mb + 1} << 20)\n"
        "    except OSError as exc:\n"
        "        print(errno.errorcode[exc.errno])\n"
    )
    result = await service.run(OWNER, code)
    assert result.status == "ok", result
    assert result.stdout == "EFBIG\n"
    await assert_answers(service)


INODES = (
    "import errno, os\n"
    "n = 0\n"
    "try:\n"
    "    while True:\n"
    "        open(f'{DIR}/f{n}', 'w').close()\n"
    "        n += 1\n"
    "except OSError as exc:\n"
    "    print(errno.errorcode[exc.errno], n > 0)\n"
)


async def test_creating_files_until_inodes_run_out_is_an_error(service: SandboxService) -> None:
    with anyio.fail_after(60):
        result = await service.run(OWNER, "DIR = '/tmp'\n" + INODES, timeout=40)
    assert result.status == "ok", result
    assert result.stdout == "ENOSPC True\n"
    for _ in range(service.config.pool.size + 1):
        check = await service.run(OWNER, "import os; print(len(os.listdir('/tmp')))")
        assert check.stdout == "0\n", check


async def test_list_files_stays_usable_over_a_huge_directory(service: SandboxService) -> None:
    session = await service.new_session(OWNER)
    sid = session.session_id
    try:
        made = await service.run(
            OWNER,
            # Under the session's quota of 10,000 entries: more would end the run as over quota
            # (at its next periodic check, or at its end), which is not what this test is about.
            "import os\nos.makedirs('many')\nfor n in range(9000): open(f'many/f{n}', 'w').close()\nprint('made')",
            session_id=sid,
            timeout=40,
        )
        assert service.config.limits.session_max_files >= 9001
        assert made.status == "ok" and made.stdout == "made\n", made
        assert len(made.files) <= 2000  # the changed-files report is bounded too
        with anyio.fail_after(30):
            entries, truncated = await service.list_files(OWNER, sid, ".", limit=100)
        assert truncated and len(entries) == 100
        with anyio.fail_after(30):
            entries, truncated = await service.list_files(OWNER, sid, "many", limit=5000)
        assert truncated and len(entries) == 5000
        await assert_answers(service, sid)
    finally:
        await service.close_session(OWNER, sid)


async def test_opening_files_without_end_gets_emfile(service: SandboxService) -> None:
    code = (
        "import errno\n"
        "held = []\n"
        "try:\n"
        "    for _ in range(10**6):\n"
        "        held.append(open('/dev/null'))\n"
        "except OSError as exc:\n"
        "    print(errno.errorcode[exc.errno], len(held) < 10**6)\n"
    )
    session = await service.new_session(OWNER)
    try:
        for session_id in (None, session.session_id):
            result = await service.run(OWNER, code, session_id=session_id)
            assert result.status == "ok", result
            assert result.stdout == "EMFILE True\n"
            await assert_answers(service, session_id)
    finally:
        await service.close_session(OWNER, session.session_id)


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


# -- 16. nothing carries over between stateless runs -------------------------------------------------
PLACES = ("/tmp", "/dev/shm", "/var/tmp", "/mnt/data", "/dev/mqueue", "/run/mcpx", "/run", "/var/lock", "/home", "/")
LEAVE_TRACES = (
    "import ctypes, os\n"
    "placed = []\n"
    f"for d in {PLACES!r}:\n"
    "    try:\n"
    "        open(os.path.join(d, '.trace'), 'w').write('x')\n"
    "        placed.append(d)\n"
    "    except OSError:\n"
    "        pass\n"
    "rt = ctypes.CDLL('librt.so.1', use_errno=True)\n"
    "rt.mq_open.restype = ctypes.c_int\n"
    "if rt.mq_open(b'/trace-mq', os.O_CREAT | os.O_RDWR, 0o600, None) >= 0:\n"
    "    placed.append('mq')\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "if libc.shmget(0x7ace, 4096, 0o1600) >= 0:\n"
    "    placed.append('sysv')\n"
    "print(placed)\n"
)
FIND_TRACES = (
    "import ctypes, os\n"
    f"found = [d for d in {PLACES!r} if os.path.lexists(os.path.join(d, '.trace'))]\n"
    "found += [f'/dev/mqueue/{n}' for n in (os.listdir('/dev/mqueue') if os.path.isdir('/dev/mqueue') else [])]\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "if libc.shmget(0x7ace, 0, 0) >= 0:\n"
    "    found.append('sysv')\n"
    "print(found)\n"
)


async def test_nothing_a_stateless_run_leaves_anywhere_is_seen_by_the_next(service: SandboxService) -> None:
    placed = await service.run(OWNER, LEAVE_TRACES)
    assert placed.status == "ok", placed
    assert "'/tmp'" in placed.stdout  # it did manage to write somewhere
    for _ in range(service.config.pool.size + 1):
        found = await service.run(OWNER, FIND_TRACES)
        assert found.stdout == "[]\n", found


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
    pool = service.stateless
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
