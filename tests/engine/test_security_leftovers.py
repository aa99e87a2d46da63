"""Between tenants, what one run leaves behind (docs/security.md#between-tenants: earlier runs in memory,
trees that break the wipe, syscalls a sandbox never needs, IPC objects and connections): nothing of it
reaches the next run, whether in memory, in files, in IPC objects or in closed connections, and the
syscalls that could reach across are refused. Each case runs under runc and, where it applies, gVisor
(``test_security_runsc.py`` runs the ``check_*`` functions here on its own service); each asserts the
safe outcome.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import AsyncIterator

import anyio
import pytest
from _security import OWNER, VICTIM
from _support import make_test_config

from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
async def one_container(service: SandboxService) -> AsyncIterator[SandboxService]:
    """A service with a single recycled stateless container: every run lands in the same one.

    The same checks run under gVisor in ``test_security_runsc.py``, on its own one-container service.
    (It asks for the suite's shared service only so that one is set up first: anyio unwinds
    higher-scoped fixtures' task groups in the order they were entered.)
    """
    settings = make_test_config(pool={"size": 1, "session_spares": 0}, limits={"memory_mb": 512})
    async with SandboxService.start(settings) as service:
        await service.wait_ready()
        yield service


# -- 40. memory remnants ------------------------------------------------------------------------------
def plant(secret: dict[str, str]) -> str:
    """A victim's cell that carries one secret in each channel a run has."""
    return (
        f"# {secret['code']}\n"
        "import sys\n"
        "from IPython.display import display\n"
        f"print({secret['stdout']!r})\n"
        f"print({secret['stderr']!r}, file=sys.stderr)\n"
        f"display({secret['display']!r})\n"
        f"open('/mnt/data/secret.txt', 'w').write({secret['file']!r})\n"
        f"x = [{secret['value']!r}] * 3\n"
        "print('lean' if 'pandas' not in sys.modules else 'full')\n"
        "x\n"
    )


# The scanner holds only the first half of each secret and a hash of the whole, so it can never
# find its own copy: a candidate is confirmed by hashing what follows the half in the memory read.
SCAN = """
import hashlib, json, os, re, sys
wanted = json.loads(WANTED)
found = {}
def check(blob, where):
    for name, (half, length, digest) in wanted.items():
        head = bytes.fromhex(half)
        start = blob.find(head)
        while start != -1:
            if hashlib.sha256(blob[start:start + length]).hexdigest() == digest:
                found.setdefault(name, where)
            start = blob.find(head, start + 1)
maps = open('/proc/self/maps').read().splitlines()
mem = os.open('/proc/self/mem', os.O_RDONLY)
scanned = 0
for line in maps:
    fields = line.split()
    path = fields[5] if len(fields) > 5 else ''
    # Data of a run can only be in writable memory: the heap, anonymous maps, stacks, and the
    # writable segments of libraries. Read-only file maps are library code (gVisor would also
    # allocate a page for every one read through /proc/self/mem).
    if 'r' not in fields[1] or path in ('[vvar]', '[vsyscall]', '[vdso]'):
        continue
    if 'w' not in fields[1] and path.startswith('/'):
        continue
    start, end = (int(part, 16) for part in fields[0].split('-'))
    for offset in range(start, end, 1 << 22):
        size = min(1 << 22, end - offset) + 64  # overlapping reads: a secret on a boundary is seen whole
        try:
            chunk = os.pread(mem, min(size, end - offset), offset)
        except OSError:
            break
        scanned += len(chunk)
        check(chunk, 'memory ' + (path or 'anon'))
for pid in [p for p in os.listdir('/proc') if p.isdigit()] + ['self']:
    for name in ('cmdline', 'environ', 'status', 'stat', 'maps', 'comm', 'cwd', 'io', 'wchan', 'net/tcp', 'net/unix'):
        try:
            with open(f'/proc/{pid}/{name}', 'rb') as handle:
                check(handle.read(1 << 24), f'/proc/{pid}/{name}')
        except OSError:
            pass
print(json.dumps({'found': found, 'scanned_mb': scanned >> 20, 'lean': 'pandas' not in sys.modules}))
"""


def scanner(secrets_by_channel: dict[str, str], *, full: bool = False) -> str:
    """The scan, in a worker of the full zygote (``full``: the cell imports a data library) or, where
    the container has one, of the lean zygote (see ``mcpx_agent.zygote.lean``)."""
    wanted = {
        name: (value.encode()[: len(value) // 2].hex(), len(value.encode()), hashlib.sha256(value.encode()).hexdigest())
        for name, value in secrets_by_channel.items()
    }
    return ("import numpy\n" if full else "") + f"WANTED = {json.dumps(json.dumps(wanted))}\n" + SCAN


async def test_no_later_run_can_read_an_earlier_runs_data_from_memory_or_proc(one_container: SandboxService) -> None:
    await check_no_remnants(one_container)


async def check_no_remnants(service: SandboxService) -> None:
    """A victim in a worker of each zygote the container has, then scans in workers of each,
    forked one after another (see ``LEAN_SPARE_AFTER`` for which zygote's spare a cell finds)."""
    names = ("code", "stdout", "stderr", "display", "file", "value")
    lean_zygote = service.config.sandbox.lean_interpreter and service.config.runtime != "runsc"
    scanned_kinds = set()
    for victim_full in (False, True) if lean_zygote else (True,):
        for _ in range(2):
            await service.run(OWNER, "1")  # lean cells in a row: the next spare is the lean zygote's
        secret = {name: f"{name}-{secrets.token_hex(16)}" for name in names}
        victim = await service.run(VICTIM, ("import numpy\n" if victim_full else "") + plant(secret))
        assert victim.status == "ok", victim
        assert secret["stdout"] in victim.stdout and secret["value"] in (victim.result or "")
        assert victim.stdout.endswith("full\n" if victim_full or not lean_zygote else "lean\n"), victim.stdout
        for full in (False, False, True, False, False, False):
            result = await service.run(OWNER, scanner(secret, full=full), timeout=60)
            assert result.status == "ok", result
            report = json.loads(result.stdout)
            # the whole address space was read, libraries included (a lean worker's is the smaller)
            assert report["scanned_mb"] > (10 if report["lean"] else 20), report
            assert report["found"] == {}, report
            scanned_kinds.add(report["lean"])
    assert scanned_kinds == ({True, False} if lean_zygote else {False})


async def test_the_scanner_finds_a_secret_its_own_run_holds(one_container: SandboxService) -> None:
    """The scan above can fail: the same scan finds a secret held by the run doing the scan."""
    own = {"value": f"value-{secrets.token_hex(16)}"}
    held = f"kept = bytes.fromhex({own['value'].encode().hex()!r})\n"
    result = await one_container.run(OWNER, held + scanner(own), timeout=60)
    assert result.status == "ok", result
    assert "value" in json.loads(result.stdout)["found"], result.stdout


# -- 43. trees the wipe might choke on ---------------------------------------------------------------
BUILD_TREES = """
import os, ctypes
os.chdir('/tmp')
for _ in range(3000):                     # very deep
    os.mkdir('d'); os.chdir('d')
os.chdir('/tmp')
os.mkdir('wide')
for i in range(2000):                     # very wide
    open(f'wide/{i}', 'w').close()
os.makedirs('locked/inner/deeper')
open('locked/inner/deeper/f', 'w').write('x')
os.chmod('locked/inner/deeper', 0)
os.chmod('locked/inner', 0)
os.chmod('locked', 0)                     # unreadable, unwritable modes
for name in (b'new\\nline', b'\\xff\\xfe-not-utf8', b' ', b'-rf', b'.hidden', b'x' * 255):
    open(os.path.join(b'/tmp', name), 'wb').write(b'odd')
open('/mnt/data/in-data', 'w').write('x')
try:
    os.setxattr('/mnt/data', 'user.note', b'left for the next client')
except OSError:
    pass
os.chmod('/mnt/data', 0)                  # the directory the next client works in
print('built')
"""
CHECK_CLEAN = """
import os
print(sorted(os.listdir('/tmp')), sorted(os.listdir('/mnt/data')), oct(os.stat('/mnt/data').st_mode & 0o777))
try:
    print(os.listxattr('/mnt/data'))
except OSError:
    print([])
open('/mnt/data/ok', 'w').write('writable')
"""


async def test_a_tree_built_to_break_the_wipe_leaves_the_next_client_a_clean_container(
    one_container: SandboxService,
) -> None:
    await check_wipe(one_container)


async def check_wipe(service: SandboxService) -> None:
    with anyio.fail_after(120):
        built = await service.run(VICTIM, BUILD_TREES, timeout=90)
    assert built.status == "ok", built
    result = await service.run(OWNER, CHECK_CLEAN)
    assert result.status == "ok", result
    assert result.stdout == "[] [] 0o755\n[]\n", result.stdout


# -- 45. syscalls a Python sandbox never needs --------------------------------------------------------------
SYSCALL_PROBE = """
import ctypes, errno, platform, socket
libc = ctypes.CDLL(None, use_errno=True)
numbers = {'x86_64': {'io_uring_setup': 425, 'userfaultfd': 323, 'ptrace': 101, 'process_vm_readv': 310,
                      'keyctl': 250, 'unshare': 272, 'bpf': 321, 'perf_event_open': 298, 'mount': 165},
           'aarch64': {'io_uring_setup': 425, 'userfaultfd': 282, 'ptrace': 117, 'process_vm_readv': 270,
                       'keyctl': 219, 'unshare': 97, 'bpf': 280, 'perf_event_open': 241, 'mount': 40}}[platform.machine()]
result = {}
for name, number in numbers.items():
    ctypes.set_errno(0)
    result[name] = 'allowed' if libc.syscall(number, 0, 0, 0, 0, 0) >= 0 else errno.errorcode.get(ctypes.get_errno())
for family in ('AF_ALG', 'AF_PACKET', 'AF_VSOCK'):
    try:
        socket.socket(getattr(socket, family), socket.SOCK_RAW if family == 'AF_PACKET' else socket.SOCK_SEQPACKET).close()
        result[family] = 'allowed'
    except (OSError, AttributeError) as exc:
        result[family] = 'refused'
print(result)
"""


async def test_syscalls_a_python_sandbox_never_needs_fail(one_container: SandboxService) -> None:
    await check_syscalls(one_container)


async def check_syscalls(service: SandboxService) -> None:
    result = await service.run(OWNER, SYSCALL_PROBE)
    assert result.status == "ok", result
    outcome = eval(result.stdout)
    assert all(value in ("EPERM", "ENOSYS", "refused") for value in outcome.values()), outcome


# -- 46 (and 16). nothing of one stateless run reaches the next: IPC objects included, gVisor too --------
IPC_LEFT = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
shm = libc.shmget(0, 4096, 0o1000 | 0o666)
addr = libc.shmat(shm, None, 0)
ctypes.memmove(addr, b'secret-in-shm', 13)
libc.msgget(0, 0o1000 | 0o666)
libc.semget(0, 1, 0o1000 | 0o666)
import os
fd = os.open('/dev/shm/posix-left', os.O_CREAT | os.O_WRONLY, 0o600); os.write(fd, b'x'); os.close(fd)
print('left')
"""
IPC_COUNTS = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
buf = (ctypes.c_int * 64)()
libc.shmctl(0, 14, buf); shm = buf[0]
libc.msgctl(0, 12, buf); msg = buf[0]
libc.semctl(0, 0, 19, buf); sem = buf[7]
print(shm, msg, sem, sorted(os.listdir('/dev/shm')))
"""


async def test_ipc_objects_of_one_run_are_gone_in_the_next(one_container: SandboxService) -> None:
    await check_ipc(one_container)


async def check_ipc(service: SandboxService) -> None:
    for _ in range(2):
        assert (await service.run(VICTIM, IPC_LEFT)).stdout == "left\n"
        result = await service.run(OWNER, IPC_COUNTS)
        assert result.stdout == "0 0 0 []\n", result


# -- 9. closed TCP connections leave nothing for the next run ------------------------------------------------
TCP_TIME_WAIT = """
import socket
server = socket.socket(); server.bind(('127.0.0.1', 0)); server.listen()
port = server.getsockname()[1]
client = socket.create_connection(('127.0.0.1', port)); accepted, _ = server.accept()
client_port = client.getsockname()[1]
client.close(); accepted.close(); server.close()
print(client_port)
"""
TCP_STATES = """
states = [line.split()[3] for line in open('/proc/net/tcp').read().splitlines()[1:]]
print(states)
"""


async def test_connections_a_run_closed_are_not_visible_to_the_next(service: SandboxService) -> None:
    # Without a network the sandbox gets no internet sockets at all (the seccomp profile), so no
    # run can leave a port behind; the states of the loopback table are checked all the same.
    for _ in range(service.config.pool.size + 1):
        attempt = await service.run(VICTIM, TCP_TIME_WAIT)
        assert attempt.error is not None and attempt.error.type in ("OSError", "PermissionError"), attempt
        assert "Address family not supported" in attempt.error.message or "not permitted" in attempt.error.message
        result = await service.run(OWNER, TCP_STATES)
        assert result.stdout == "[]\n", result
