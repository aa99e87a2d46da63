"""Hostile code trying to escalate inside its container (docs/security.md#escalation): privileged
syscalls, kernel knobs, tracing or signalling the supervisor and PID 1, sudo and setuid tricks, the
container killed under a run, a session's files posing as libraries; and the identity code runs as."""

from __future__ import annotations

import anyio
import docker
import pytest
from _security import IDENTITY, IDENTITY_LINE, OWNER, assert_answers, stateless_and_session
from _support import wait_until

from mcp_code_exec.sandbox.ownership import SANDBOX_UIDS
from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio


# -- 18. privileged syscalls -------------------------------------------------------------------------
SYSCALLS = (
    "import ctypes, errno, os\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "libc.syscall.restype = ctypes.c_long\n"
    "def res(rc):\n"
    "    return 'ALLOWED' if rc >= 0 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))\n"
    "out = {}\n"
    "out['mount'] = res(libc.mount(b'none', b'/tmp', b'tmpfs', 0, None))\n"
    "out['mount_proc'] = res(libc.mount(b'proc', b'/mnt/data', b'proc', 0, None))\n"
    "out['unshare_user'] = res(libc.unshare(0x10000000))\n"
    "out['unshare_ns'] = res(libc.unshare(0x00020000))\n"
    "out['keyctl'] = res(libc.syscall(250, 0, -3, 0, 0, 0))  # keyctl(KEYCTL_GET_KEYRING_ID, session)\n"
    "out['add_key'] = res(libc.syscall(248, b'user', b'k', b'v', 1, -3))\n"
    "out['bpf'] = res(libc.syscall(321, 0, None, 0))  # bpf(BPF_MAP_CREATE)\n"
    "out['chroot'] = res(libc.chroot(b'/tmp'))\n"
    "out['setuid0'] = res(libc.setuid(0))\n"
    "out['sethostname'] = res(libc.sethostname(b'x', 1))\n"
    "out['perf_event_open'] = res(libc.syscall(298, None, 0, -1, -1, 0))\n"
    "out['init_module'] = res(libc.syscall(175, None, 0, b''))\n"
    "out['reboot'] = res(libc.syscall(169, 0xfee1dead, 672274793, 0x4321fedc, None))\n"
    "print(out)\n"
)
DENIED = {"EPERM", "EACCES", "ENOSYS", "EFAULT", "EINVAL"}  # never success


async def test_privileged_syscalls_are_refused(service: SandboxService) -> None:
    async with stateless_and_session(service) as places:
        for session_id in places:
            result = await service.run(OWNER, SYSCALLS, session_id=session_id)
            assert result.status == "ok", result
            outcome = eval(result.stdout)
            assert "ALLOWED" not in outcome.values(), outcome
            for name in ("mount", "mount_proc", "unshare_user", "unshare_ns", "keyctl", "bpf", "chroot", "setuid0"):
                assert outcome[name] == "EPERM", (name, outcome)
            assert set(outcome.values()) <= DENIED, outcome
            await assert_answers(service, session_id)


# -- 19. kernel knobs ----------------------------------------------------------------------------------
KNOBS = (
    "import glob\n"
    "targets = ['/proc/sys/kernel/hostname', '/proc/sys/vm/drop_caches', '/proc/sysrq-trigger',\n"
    "           '/proc/sys/kernel/core_pattern', '/sys/kernel/mm/transparent_hugepage/enabled',\n"
    "           '/sys/fs/cgroup/memory/memory.limit_in_bytes', '/sys/fs/cgroup/pids/pids.max',\n"
    "           '/sys/fs/cgroup/memory.max', '/proc/self/oom_score_adj', '/proc/1/oom_score_adj',\n"
    "           '/sys/class/net/lo/mtu']\n"
    "written = []\n"
    "for t in targets:\n"
    "    try:\n"
    "        with open(t, 'w') as handle:\n"
    "            handle.write('-1000' if 'oom' in t else '1')\n"
    "        written.append(t)\n"
    "    except OSError:\n"
    "        pass\n"
    "print(written)\n"
)


async def test_writes_to_proc_sys_and_sys_are_refused(service: SandboxService) -> None:
    result = await service.run(OWNER, KNOBS)
    assert result.status == "ok", result
    # Raising one's own OOM score is allowed (it only makes the run the first to go); lowering is not.
    assert result.stdout.strip() in ("[]", "['/proc/self/oom_score_adj']"), result
    lower = await service.run(OWNER, "with open('/proc/self/oom_score_adj', 'w') as f: f.write('-1000')")
    assert lower.status == "error", lower
    await assert_answers(service)


# -- 20. tracing the supervisor or PID 1 ----------------------------------------------------------------
TRACE = (
    "import ctypes, errno, os\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "libc.ptrace.restype = ctypes.c_long\n"
    "out = {}\n"
    "for label, pid in (('init', 1), ('supervisor', os.getppid())):\n"
    "    rc = libc.ptrace(16, pid, None, None)  # PTRACE_ATTACH\n"
    "    out[label + '.ptrace'] = 'ALLOWED' if rc == 0 else errno.errorcode[ctypes.get_errno()]\n"
    "    rc = libc.ptrace(0x4206, pid, None, None)  # PTRACE_SEIZE\n"
    "    out[label + '.seize'] = 'ALLOWED' if rc == 0 else errno.errorcode[ctypes.get_errno()]\n"
    "    for what in ('mem', 'environ', 'fd/0', 'fd/1', 'maps', 'root/run/mcpx', 'cwd'):\n"
    "        try:\n"
    "            with open(f'/proc/{pid}/{what}', 'rb') as handle:\n"
    "                handle.read(1)\n"
    "            out[f'{label}.{what}'] = 'ALLOWED'\n"
    "        except OSError as exc:\n"
    "            out[f'{label}.{what}'] = errno.errorcode.get(exc.errno, '?')\n"
    "    try:\n"
    "        os.listdir(f'/proc/{pid}/fd')\n"
    "        out[label + '.fdlist'] = 'ALLOWED'\n"
    "    except OSError as exc:\n"
    "        out[label + '.fdlist'] = errno.errorcode.get(exc.errno, '?')\n"
    "    try:\n"
    "        os.process_vm_readv if hasattr(os, 'process_vm_readv') else None\n"
    "    except Exception:\n"
    "        pass\n"
    "print(os.getppid() != 1, out)\n"
)


async def test_tracing_or_reading_the_supervisor_and_init_is_refused(service: SandboxService) -> None:
    async with stateless_and_session(service) as places:
        for session_id in places:
            result = await service.run(OWNER, TRACE, session_id=session_id)
            assert result.status == "ok", result
            parent_is_not_init, _, text = result.stdout.partition(" ")
            assert parent_is_not_init == "True"
            outcome = eval(text)
            assert "ALLOWED" not in outcome.values(), outcome
            assert outcome["supervisor.ptrace"] == outcome["init.ptrace"] == "EPERM"
            await assert_answers(service, session_id)


# -- 21. escalation ------------------------------------------------------------------------------------
ESCALATE = (
    "import os, shutil, stat, subprocess\n"
    "out = {}\n"
    "for tool in ('sudo', 'su', 'doas', 'pkexec', 'newgrp', 'passwd', 'chsh', 'mount', 'ping'):\n"
    "    path = shutil.which(tool)\n"
    "    if path:\n"
    "        r = subprocess.run([path, '-c', 'id -u'] if tool == 'su' else [path, 'id', '-u'],\n"
    "                           input='', capture_output=True, text=True, timeout=10)\n"
    "        out[tool] = r.stdout.strip()\n"
    "setid = []\n"
    "for top in ('/usr', '/bin', '/sbin', '/opt', '/lib'):\n"
    "    for root, dirs, files in os.walk(top):\n"
    "        for name in files:\n"
    "            try:\n"
    "                mode = os.lstat(os.path.join(root, name)).st_mode\n"
    "            except OSError:\n"
    "                continue\n"
    "            if stat.S_ISREG(mode) and mode & (stat.S_ISUID | stat.S_ISGID):\n"
    "                setid.append(os.path.join(root, name))\n"
    "calls = (lambda: os.setuid(0), lambda: os.setgid(0), lambda: os.setgroups([0]), lambda: os.setresuid(0, 0, 0))\n"
    "for call in calls:\n"
    "    try:\n"
    "        call()\n"
    "        setid.append('SETID-CALL-ALLOWED')\n"
    "    except PermissionError:\n"
    "        pass\n"
    "# a setuid copy of our own: no-new-privileges and nosuid mounts must neutralise it\n"
    "import sys\n"
    "shutil.copy(sys.executable, '/tmp/py'); os.chmod('/tmp/py', 0o4755)\n"
    "try:\n"
    "    r = subprocess.run(['/tmp/py', '-c', 'import os; print(os.geteuid())'], capture_output=True, text=True)\n"
    "    out['setuid-copy'] = r.stdout.strip() or r.stderr.strip()[-60:]\n"
    "except OSError as exc:\n"
    "    out['setuid-copy'] = type(exc).__name__\n"
    "print(out, setid, os.getuid(), os.geteuid())\n"
)


async def test_sudo_su_and_setuid_tricks_do_not_escalate(service: SandboxService) -> None:
    with anyio.fail_after(60):
        result = await service.run(OWNER, ESCALATE, timeout=45)
    assert result.status == "ok", result
    assert "'0'" not in result.stdout, result.stdout
    *_, setid, uid, euid = result.stdout.split()
    assert setid == "[]" and uid == euid and int(uid) in SANDBOX_UIDS, result.stdout
    await assert_answers(service)


# -- 22. signalling the supervisor or PID 1; the container dying anyway --------------------------------
SIGNALS = (
    "import os, signal\n"
    "out = []\n"
    "parent = os.getppid()\n"
    "for pid in (1, parent):\n"
    "    for sig in (signal.SIGTERM, signal.SIGKILL, signal.SIGSTOP, signal.SIGINT, signal.SIGCHLD):\n"
    "        try:\n"
    "            os.kill(pid, sig)\n"
    "            out.append((pid, sig.name))\n"
    "        except PermissionError:\n"
    "            pass\n"
    "for sig in (signal.SIGSTOP, signal.SIGKILL):\n"
    "    os.kill(-1, sig)  # 'succeeds' even when it reaches nobody (Linux counts EPERM as sent)\n"
    "states = [open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()[0] not in 'TtZX' for p in (1, parent)]\n"
    "print(out, states)\n"
)


async def test_signalling_init_or_the_supervisor_is_refused(service: SandboxService) -> None:
    async with stateless_and_session(service) as places:
        for session_id in places:
            result = await service.run(OWNER, SIGNALS, session_id=session_id)
            # kill(-1) reaches only the sandbox user's own processes: the run may take itself down
            assert result.status == "ok", result
            assert result.stdout == "[] [True, True]\n", result  # nothing delivered; neither stopped nor dead
            await assert_answers(service, session_id)


def kill_container(container_id: str) -> None:
    client = docker.from_env()
    try:
        client.api.kill(container_id)
    except docker.errors.APIError:
        pass
    finally:
        client.close()


async def test_a_session_container_killed_mid_run_is_reported_and_replaced(service: SandboxService) -> None:
    session = await service.new_session(OWNER)
    sid = session.session_id
    try:
        await service.run(OWNER, "open('kept.txt', 'w').write('yes'); x = 1", session_id=sid)
        started = anyio.Event()

        async def on_output(stream: str, text: str) -> None:
            started.set()

        async def kill_when_started() -> None:
            await started.wait()
            sandbox = service.sessions.get(sid, OWNER).sandbox
            assert sandbox is not None
            await anyio.to_thread.run_sync(kill_container, sandbox.container_id)

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(kill_when_started)
                result = await service.run(
                    OWNER,
                    "import time\nprint('running', flush=True)\ntime.sleep(600)",
                    session_id=sid,
                    timeout=60,
                    on_output=on_output,
                )
        assert result.status == "crashed", result
        assert result.session_restarted
        assert result.error is not None and "lost" in result.error.message
        assert (await service.run(OWNER, "open('kept.txt').read()", session_id=sid)).result == "'yes'"
        await assert_answers(service, sid)
    finally:
        await service.close_session(OWNER, sid)


async def test_a_sessions_files_never_stand_in_for_a_library_when_its_container_starts_again(
    service: SandboxService,
) -> None:
    # The agent starts in /mnt/data. Were that on the zygote's path, this pyparsing.py (matplotlib
    # imports pyparsing) would run as root at the next start of the session's container; were it
    # still the working directory, matplotlib would take the session's matplotlibrc.
    sid = (await service.new_session(OWNER)).session_id
    try:
        await service.write_file(OWNER, sid, "pyparsing.py", b"open('/mnt/data/ran', 'w').write('as root')\n")
        await service.write_file(OWNER, sid, "matplotlibrc", b"figure.dpi: 7\n")  # read from the working directory
        await service.write_file(OWNER, sid, "mine.py", b"VALUE = 42\n")
        sandbox = service.sessions.get(sid, OWNER).sandbox
        assert sandbox is not None
        await anyio.to_thread.run_sync(kill_container, sandbox.container_id)
        with anyio.fail_after(30):
            await sandbox.channel.closed.wait()
        # ... and the user's own modules in /mnt/data still import.
        probe = (
            "import os, mine, pyparsing, matplotlib as m\n"
            "(os.path.exists('ran'), mine.VALUE, pyparsing.__file__[:5], m.rcParams['figure.dpi'])"
        )
        result = await service.run(OWNER, probe, session_id=sid)
        assert result.session_restarted and result.result == "(False, 42, '/usr/', 100.0)", result
    finally:
        await service.close_session(OWNER, sid)


async def test_a_stateless_container_killed_mid_run_is_reported_and_the_pool_refills(service: SandboxService) -> None:
    started = anyio.Event()

    async def on_output(stream: str, text: str) -> None:
        started.set()

    async def kill_when_started() -> None:
        await started.wait()
        lent = list(service.stateless_pool._lent)
        for sandbox in lent:
            await anyio.to_thread.run_sync(kill_container, sandbox.container_id)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(kill_when_started)
            result = await service.run(
                OWNER, "import time\nprint('running', flush=True)\ntime.sleep(600)", timeout=60, on_output=on_output
            )
    assert result.status == "crashed", result
    assert result.error is not None and result.error.message
    pool = service.stateless_pool
    await wait_until(lambda: pool.owned == pool.size and pool.idle == pool.size, 60)
    await assert_answers(service)


# -- 24. identity ----------------------------------------------------------------------------------------
async def test_code_runs_as_a_sandbox_uid_with_no_capabilities_no_new_privs_and_seccomp(
    service: SandboxService,
) -> None:
    async with stateless_and_session(service) as places:
        for session_id in places:
            result = await service.run(OWNER, IDENTITY, session_id=session_id)
            assert result.status == "ok", result
            assert result.stdout.splitlines() == [IDENTITY_LINE, IDENTITY_LINE], result


PROCESS_UIDS = (
    "import os\n"
    "real = set()\n"
    "for p in os.listdir('/proc'):\n"
    "    try:\n"
    "        real.add(int(open(f'/proc/{p}/status').read().split('\\nUid:\\t')[1].split()[0]))\n"
    "    except (OSError, IndexError, ValueError):\n"
    "        pass\n"
    "print(os.getuid(), *sorted(real))\n"
)


async def test_every_process_of_a_sandbox_is_root_or_a_uid_of_its_own(service: SandboxService) -> None:
    # The zygote creates the workers' pipes, whose buffer pages the kernel charges to its real uid:
    # a zygote uid shared by every sandbox would let one tenant's grown pipes shrink another's.
    async with stateless_and_session(service) as places:
        sandbox_uids = []
        for session_id in places:
            result = await service.run(OWNER, PROCESS_UIDS, session_id=session_id)
            uid, *real = (int(field) for field in result.stdout.split())
            assert real == [0, uid, uid + 1] and uid in SANDBOX_UIDS, result.stdout  # root, user code, zygote
            sandbox_uids.append(uid)
        assert sandbox_uids[0] != sandbox_uids[1]
