"""The sandbox engine on the real Docker engine: isolation, sessions, timeouts, identity, cleanup."""

from __future__ import annotations

import pytest
from _security import no_other_user_processes

from mcp_code_exec.errors import InvalidPath, SessionNotFound
from mcp_code_exec.sandbox.ownership import SANDBOX_UIDS
from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio
OWNER = "tester"


async def test_stateless_print_returns_its_output(service: SandboxService) -> None:
    result = await service.run(OWNER, "print(1+1)")
    assert result.status == "ok"
    assert result.stdout == "2\n"
    assert result.session_id is None


async def test_a_variable_set_in_one_stateless_run_is_undefined_in_the_next(service: SandboxService) -> None:
    first = await service.run(OWNER, "leak = 123")
    assert first.status == "ok"
    for _ in range(service.config.pool.size + 1):  # whichever warm container serves it
        second = await service.run(OWNER, "leak")
        assert second.status == "error"
        assert second.error is not None and second.error.type == "NameError"


# What a cell sees of the shell's history: its number, the _i names, In and Out, the cells cached
# for tracebacks. Each worker rehearses a cell before its first one (warm_up): none of it may show.
HISTORY_PROBE = (
    "import linecache\n"
    "ip = get_ipython()\n"
    "numbered = lambda names: sorted(k for k in names if k.startswith('_i') and k[2:].isdigit())\n"
    "history = ip.history_manager\n"
    "print(ip.execution_count, repr(_i), repr(_ii), repr(_iii), len(In), len(history.input_hist_raw), len(Out),\n"
    "      len(_oh), len(history.db_input_cache), numbered(globals()), numbered(ip.user_ns_hidden),\n"
    "      len([k for k in linecache.cache if k.startswith('<ipython-input')]), len(ip.compile._filename_map),\n"
    "      ip.last_execution_result is None, ip.last_execution_succeeded)\n"
)
FIRST_CELL = "1 '' '' '' 2 2 0 0 1 ['_i1'] ['_i1'] 1 1 True True\n"


@pytest.mark.parametrize("data_library", ["", "import pandas\n"])  # the lean zygote's worker, the full one's
async def test_a_stateless_cell_is_the_first_of_its_shell(service: SandboxService, data_library: str) -> None:
    for _ in range(service.config.pool.size + 1):  # whichever warm container serves it
        result = await service.run(OWNER, data_library + HISTORY_PROBE)
        assert (result.status, result.stdout) == ("ok", FIRST_CELL)
    failed = await service.run(OWNER, "print(1+1)\n1/0")
    assert failed.error is not None and "Cell In[1], line 2" in failed.error.traceback


async def test_a_sessions_cells_are_numbered_from_one_with_nothing_before_them(service: SandboxService) -> None:
    session = await service.new_session(OWNER)
    try:
        first = await service.run(OWNER, HISTORY_PROBE, session_id=session.session_id)
        assert (first.status, first.stdout) == ("ok", FIRST_CELL)
        second = await service.run(
            OWNER, "print(ip.execution_count, len(In), _ii == ''); 1/0", session_id=session.session_id
        )
        assert second.stdout == "2 3 True\n"
        assert second.error is not None and "Cell In[2], line 1" in second.error.traceback
    finally:
        await service.close_session(OWNER, session.session_id)


async def test_files_written_by_one_stateless_run_are_absent_in_the_next(service: SandboxService) -> None:
    write = (
        "import os\n"
        "for d in ('/tmp', '/mnt/data', '/dev/shm'):\n"
        "    open(os.path.join(d, 'secret.txt'), 'w').write('x')\n"
        "os.makedirs('/tmp/deep/er', exist_ok=True); os.chmod('/tmp/deep', 0)\n"
        "print(sorted(os.listdir('/tmp')))"
    )
    first = await service.run(OWNER, write)
    assert first.status == "ok", first
    assert "secret.txt" in first.stdout
    for _ in range(service.config.pool.size + 1):
        second = await service.run(
            OWNER, "import os; print([os.listdir(d) for d in ('/tmp', '/mnt/data', '/dev/shm')])"
        )
        assert second.stdout.strip() == "[[], [], []]"


async def test_a_process_left_running_after_setsid_is_gone_before_the_next_run(service: SandboxService) -> None:
    spawn = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(1000)\n"
        "    os._exit(0)\n"
        "print('spawned')"
    )
    assert (await service.run(OWNER, spawn)).stdout == "spawned\n"
    await no_other_user_processes(service)  # in every warm container, each run sees only itself


async def test_a_session_keeps_variables_between_runs(service: SandboxService) -> None:
    session = await service.new_session(OWNER)
    try:
        assert (await service.run(OWNER, "x = 41", session_id=session.session_id)).status == "ok"
        result = await service.run(OWNER, "x + 1", session_id=session.session_id)
        assert result.result == "42"
        assert result.session_id == session.session_id
    finally:
        await service.close_session(OWNER, session.session_id)


async def test_a_session_file_is_read_by_the_next_run_and_not_seen_by_another_session(service: SandboxService) -> None:
    one = await service.new_session(OWNER)
    two = await service.new_session(OWNER)
    try:
        wrote = await service.run(OWNER, "open('notes.txt', 'w').write('kept')", session_id=one.session_id)
        assert [f.path for f in wrote.files] == ["notes.txt"]
        assert (await service.run(OWNER, "open('notes.txt').read()", session_id=one.session_id)).result == "'kept'"
        other = await service.run(
            OWNER, "import os; sorted(set(os.listdir('/mnt/data')) - {'.mcpx'})", session_id=two.session_id
        )
        assert other.result == "[]"
    finally:
        await service.close_session(OWNER, one.session_id)
        await service.close_session(OWNER, two.session_id)


async def test_an_endless_loop_times_out_and_the_session_answers_the_next_run(service: SandboxService) -> None:
    session = await service.new_session(OWNER)
    try:
        await service.run(OWNER, "kept = 'yes'", session_id=session.session_id)
        result = await service.run(OWNER, "while True: pass", session_id=session.session_id, timeout=2)
        assert result.status == "timeout"
        after = await service.run(OWNER, "kept", session_id=session.session_id)
        assert after.status == "ok"
        assert after.result == "'yes'"  # the interrupt was honoured: state survived
    finally:
        await service.close_session(OWNER, session.session_id)


async def test_an_interrupt_that_is_ignored_is_escalated_and_the_session_restarts(service: SandboxService) -> None:
    session = await service.new_session(OWNER)
    try:
        await service.run(OWNER, "open('file.txt', 'w').write('safe'); lost = 1", session_id=session.session_id)
        stubborn = "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True: time.sleep(0.01)"
        result = await service.run(OWNER, stubborn, session_id=session.session_id, timeout=1)
        assert result.status == "timeout"
        assert result.session_restarted
        after = await service.run(OWNER, "open('file.txt').read()", session_id=session.session_id)
        assert after.result == "'safe'"
        assert (await service.run(OWNER, "lost", session_id=session.session_id)).status == "error"
    finally:
        await service.close_session(OWNER, session.session_id)


async def test_code_runs_as_a_sandbox_uid_without_capabilities_or_network(service: SandboxService) -> None:
    probe = (
        "import os\n"
        "status = dict(l.split(':\\t', 1) for l in open('/proc/self/status').read().splitlines() if ':\\t' in l)\n"
        "print(os.getuid(), os.geteuid(), status['CapEff'].strip(), status['NoNewPrivs'].strip(), status['Seccomp'].strip())\n"
        "print(sorted(os.listdir('/sys/class/net')))"
    )
    result = await service.run(OWNER, probe)
    uid_line, net_line = result.stdout.splitlines()
    uid, euid, *rest = uid_line.split()
    assert uid == euid and int(uid) in SANDBOX_UIDS, uid_line
    assert rest == ["0000000000000000", "1", "2"]
    assert net_line == "['lo']"


async def test_numpy_uses_one_thread_per_cpu_of_the_containers_quota(service: SandboxService) -> None:
    # BLAS threads sized to the host's cores would spin on a quota of one CPU and slow every cell.
    assert service.config.limits.cpus == 1.0
    code = "import os, numpy as np\na = np.ones((300, 300)); a @ a\nlen(os.listdir('/proc/self/task'))"
    result = await service.run(OWNER, code)
    assert result.result == "1"


async def test_an_unknown_session_gets_a_clear_error(service: SandboxService) -> None:
    with pytest.raises(SessionNotFound, match="no such session"):
        await service.run(OWNER, "1", session_id="s_made_up")


async def test_another_owner_cannot_use_a_session(service: SandboxService) -> None:
    session = await service.new_session(OWNER)
    try:
        with pytest.raises(SessionNotFound):
            await service.run("someone-else", "1", session_id=session.session_id)
        with pytest.raises(SessionNotFound):
            await service.list_files("someone-else", session.session_id)
    finally:
        await service.close_session(OWNER, session.session_id)
    with pytest.raises(SessionNotFound):
        await service.run(OWNER, "1", session_id=session.session_id)


@pytest.mark.parametrize("bad", ["../etc/passwd", "/etc/passwd", "a/../../b", "x\x00y", "a\\b", "%2e%2e/x", "a" * 300])
async def test_paths_outside_mnt_data_are_refused(service: SandboxService, bad: str) -> None:
    session = await service.new_session(OWNER)
    try:
        with pytest.raises(InvalidPath):
            await service.write_file(OWNER, session.session_id, bad, b"x")
        with pytest.raises(InvalidPath):
            await service.read_file(OWNER, session.session_id, bad)
    finally:
        await service.close_session(OWNER, session.session_id)
