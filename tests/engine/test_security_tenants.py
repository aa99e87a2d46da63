"""Between tenants (SECURITY-CASES.md 40-46): nothing of one run reaches the next, and no run can
hurt the server, the pool or another client. Each case runs under runc and, where it applies,
gVisor; each asserts the safe outcome.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import AsyncIterator

import anyio
import pytest
from _security import OWNER, assert_answers
from _support import make_test_config

from mcp_code_exec.config import Config
from mcp_code_exec.service import SandboxService

pytestmark = pytest.mark.anyio
VICTIM = "victim"


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
        "x\n"
    )


# The scanner holds only the first half of each secret and a hash of the whole, so it can never
# find its own copy: a candidate is confirmed by hashing what follows the half in the memory read.
SCAN = """
import hashlib, json, os, re
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
print(json.dumps({'found': found, 'scanned_mb': scanned >> 20}))
"""


def scanner(secrets_by_channel: dict[str, str]) -> str:
    wanted = {
        name: (value.encode()[: len(value) // 2].hex(), len(value.encode()), hashlib.sha256(value.encode()).hexdigest())
        for name, value in secrets_by_channel.items()
    }
    return f"WANTED = {json.dumps(json.dumps(wanted))}\n" + SCAN


async def test_no_later_run_can_read_an_earlier_runs_data_from_memory_or_proc(one_container: SandboxService) -> None:
    await check_no_remnants(one_container)


async def check_no_remnants(service: SandboxService) -> None:
    names = ("code", "stdout", "stderr", "display", "file", "value")
    secret = {name: f"{name}-{secrets.token_hex(16)}" for name in names}
    victim = await service.run(VICTIM, plant(secret))
    assert victim.status == "ok", victim
    assert secret["stdout"] in victim.stdout and secret["value"] in (victim.result or "")
    # Several scans: the container's next workers, forked one after another.
    results = [await service.run(OWNER, scanner(secret), timeout=60) for _ in range(3)]
    for result in results:
        assert result.status == "ok", result
        report = json.loads(result.stdout)
        assert report["scanned_mb"] > 20, report  # the whole address space was read, libraries included
        assert report["found"] == {}, report


async def test_the_scanner_finds_a_secret_its_own_run_holds(one_container: SandboxService) -> None:
    """The scan above can fail: the same scan finds a secret held by the run doing the scan."""
    own = {"value": f"value-{secrets.token_hex(16)}"}
    held = f"kept = bytes.fromhex({own['value'].encode().hex()!r})\n"
    result = await one_container.run(OWNER, held + scanner(own), timeout=60)
    assert result.status == "ok", result
    assert "value" in json.loads(result.stdout)["found"], result.stdout


# -- 41. forged frames on every descriptor the run holds -----------------------------------------------
FORGE = """
import json, os, struct
def frame(header, payload=b''):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack('>II', len(raw), len(payload)) + raw + payload
forgeries = {
    'deep': frame(b'[' * 100000 + b']' * 100000),
    'deep-object': frame(b'{"kind":"done","error":' + b'{"a":' * 50000 + b'1' + b'}' * 50001),
    'huge-header': struct.pack('>II', 2**31, 0),
    'huge-payload': struct.pack('>II', 2, 2**31) + b'{}',
    'not-json': frame(b'\\xff\\xfe not json'),
    'not-object': frame([1, 2, 3]),
    'unknown-kind': frame({'kind': 'shell', 'cmd': 'rm -rf /'}),
    'extra-key': frame({'kind': 'display', 'text': 'x', 'ev': 'done', 'id': 1}),
    'bad-type': frame({'kind': 'done', 'status': 'ok', 'result': 5, 'error': None, 'exec_ms': 1}),
    'bad-status': frame({'kind': 'done', 'status': 'pwned', 'result': None, 'error': None, 'exec_ms': 1}),
    'fake-image': frame({'kind': 'image', 'mime': 'image/png', 'width': 1, 'height': 1}, b'\\x89PNG\\r\\n\\x1a\\n' + b'A' * 100),
    'svg-image': frame({'kind': 'image', 'mime': 'image/svg+xml', 'width': 1, 'height': 1}, b'<svg/>'),
    'truncated': frame({'kind': 'display', 'text': 'x' * 100})[:50],
}
which = WHICH
for fd in (3, 4, 5, 6, 7, 8, 9, 100):
    try:
        os.write(fd, forgeries[which])
    except OSError:
        pass
print('sent', which)
"""
FORGERIES = (
    "deep", "deep-object", "huge-header", "huge-payload", "not-json", "not-object", "unknown-kind", "extra-key",
    "bad-type", "bad-status", "fake-image", "svg-image", "truncated",
)  # fmt: skip


@pytest.mark.parametrize("which", FORGERIES)
async def test_a_forged_result_frame_fails_only_its_own_run(service: SandboxService, which: str) -> None:
    session = await service.new_session(OWNER)
    sid = session.session_id
    try:
        await service.run(OWNER, "kept = 42", session_id=sid)
        for session_id in (None, sid):
            with anyio.fail_after(60):
                result = await service.run(OWNER, FORGE.replace("WHICH", repr(which)), session_id=session_id)
            # Its own run may fail (and a session's interpreter may be replaced); nothing else may.
            assert result.status in ("ok", "error", "crashed"), result
            if result.status == "error" and result.error is not None:
                assert result.error.type in ("SandboxProtocolError",), result
            await assert_answers(service, session_id)
        await assert_answers(service, owner=VICTIM)  # another client is served
    finally:
        await service.close_session(OWNER, sid)
    assert service.stateless.owned == service.config.pool.size


# -- 42. result floods -----------------------------------------------------------------------------------
async def test_many_images_and_displays_are_capped_and_counted(service: SandboxService) -> None:
    code = (
        "import matplotlib.pyplot as plt\n"
        "from IPython.display import display\n"
        "for i in range(40):\n"
        "    plt.figure(figsize=(1, 1)); plt.plot([i])\n"
        "for i in range(5000):\n"
        "    display(f'line {i}')\n"
    )
    with anyio.fail_after(120):
        result = await service.run(OWNER, code, timeout=100)
    limits = service.config.limits
    assert result.status == "ok", result
    assert result.image_count == limits.max_images == len(result.images)
    assert len(result.displays) <= limits.max_displays
    assert {"images", "displays"} <= set(result.truncated)
    assert sum(len(text) for text in result.displays) <= 2 * limits.max_output_bytes


async def test_a_huge_last_value_is_cut_and_the_session_keeps_its_variables(service: SandboxService) -> None:
    session = await service.new_session(OWNER)
    sid = session.session_id
    try:
        await service.run(OWNER, "kept = 'still here'", session_id=sid)
        for size in (5, 20):
            result = await service.run(OWNER, f"'é' * ({size} * 2**20)", session_id=sid, timeout=60)
            assert result.status == "ok", result
            assert not result.session_restarted
            assert "result" in result.truncated
            assert len((result.result or "").encode()) < 2 * service.config.limits.max_output_bytes
            assert "bytes of the value cut here" in (result.result or "")
        assert (await service.run(OWNER, "kept", session_id=sid)).result == "'still here'"
    finally:
        await service.close_session(OWNER, sid)


async def test_code_over_the_size_cap_is_refused_and_big_non_ascii_code_runs(service: SandboxService) -> None:
    from mcp_code_exec.errors import SandboxError

    with pytest.raises(SandboxError, match="over the cap"):
        await service.run(OWNER, "x = '" + "é" * 3_000_000 + "'")
    result = await service.run(OWNER, "x = '" + "é" * 300_000 + "'\nlen(x)")
    assert result.status == "ok" and result.result == "300000", result


async def test_server_memory_stays_bounded_under_result_floods(service: SandboxService) -> None:
    import gc

    from test_security_resources import rss_kib

    floods = (
        "'x' * (20 * 2**20)",
        "import sys\nfor _ in range(200): sys.stdout.write('y' * 2**20)",
        "from IPython.display import display\nfor i in range(20000): display('z' * 1000)",
    )
    await service.run(OWNER, floods[0])
    gc.collect()
    before = rss_kib()
    for _ in range(3):
        for code in floods:
            assert (await service.run(OWNER, code, timeout=60)).status == "ok"
    gc.collect()
    assert rss_kib() - before < 60 * 1024, "the server kept what the floods sent"


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


# -- 44. a session's background writer ---------------------------------------------------------------------
BACKGROUND_WRITER = """
import os, subprocess, sys
subprocess.Popen([sys.executable, '-c', '''
import time
block = b"w" * (1 << 20)
n = 0
while True:
    with open(f"/mnt/data/bg-{n}", "wb") as handle:
        handle.write(block)
    n += 1
    time.sleep(0.05)
'''], start_new_session=True)
print('started')
"""


async def test_a_background_writer_left_by_a_session_is_held_to_the_quota(config: Config) -> None:
    quota_mb = 30
    settings = make_test_config(pool={"size": 1, "session_spares": 0}, limits={"session_data_mb": quota_mb})
    async with SandboxService.start(settings) as service:
        session = await service.new_session(OWNER)
        sid = session.session_id
        await service.run(OWNER, "kept = 1", session_id=sid)
        assert (await service.run(OWNER, BACKGROUND_WRITER, session_id=sid)).stdout == "started\n"
        largest = 0
        with anyio.fail_after(60):
            while True:  # polls the engine's files through the agent; the watcher acts on its own clock
                entries, _ = await service.list_files(OWNER, sid, ".")
                total = sum(entry.size for entry in entries)
                largest = max(largest, total)
                if total > quota_mb * 2**20:
                    before = total
                    await anyio.sleep(2)  # pacing: does it still grow after the watcher acted?
                    entries, _ = await service.list_files(OWNER, sid, ".")
                    if sum(entry.size for entry in entries) == before:
                        break
                await anyio.sleep(0.2)  # pacing of the poll
        assert largest < (quota_mb + 30) * 2**20, f"{largest} bytes written past a {quota_mb} MiB quota"
        result = await service.run(OWNER, "import os; os.system('rm -f /mnt/data/bg-*'); 'cleared'", session_id=sid)
        assert result.session_restarted, result
        assert any("quota" in note for note in result.notes), result
        await assert_answers(service, sid)
        await service.close_session(OWNER, sid)


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
    if service.config.runtime == "runsc":
        pytest.skip("gVisor has no TIME_WAIT setting: documented, single-use mode is the answer there")
    for _ in range(service.config.pool.size + 1):
        assert (await service.run(VICTIM, TCP_TIME_WAIT)).status == "ok"
        result = await service.run(OWNER, TCP_STATES)
        assert result.stdout == "[]\n", result
