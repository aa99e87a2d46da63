"""Between tenants, no run can hurt its neighbours (docs/security.md#between-tenants: forged frames,
result floods, background writers, per-uid kernel counts, block devices): forged result frames, floods
of results and a session's background writer cost only the run that made them, never the server, the
pool or another client; descriptors held in flight and block devices reach no other session. Each
case asserts the safe outcome.
"""

from __future__ import annotations

import anyio
import pytest
from _security import OWNER, VICTIM, assert_answers, rss_kib, stateless_and_session
from _support import make_test_config

from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio


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
    assert service.stateless_pool.owned == service.config.pool.size


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


@pytest.mark.parametrize("session_disk", ["filesystem", "agent"])
async def test_a_background_writer_left_by_a_session_is_held_to_the_quota(session_disk: str) -> None:
    # The agent's watcher stops the writer (and says so); with the filesystem as the limit, the
    # writer may meet ENOSPC and die first, whichever comes first: the quota holds either way.
    quota_mb = 30
    limits = {"session_data_mb": quota_mb, "session_disk": session_disk}
    settings = make_test_config(pool={"size": 1, "session_spares": 0}, limits=limits)
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
        if session_disk == "agent":
            assert result.session_restarted, result
            assert any("quota" in note for note in result.notes), result
        else:
            assert result.session_restarted or "No space left" in result.stderr, result
        await assert_answers(service, sid)
        await service.close_session(OWNER, sid)


# -- per-uid kernel counts: descriptors in flight over unix sockets ------------------------------------
HOLD_IN_FLIGHT = """
import errno, os, socket
held, peer = socket.socketpair()
held.setblocking(False)
r, w = os.pipe()
sent, refused = 0, None
while sent < 100_000:
    try:
        socket.send_fds(held, [b'x'], [r] * 200)
    except OSError as exc:
        refused = errno.errorcode.get(exc.errno)
        break
    sent += 200
os.close(r); os.close(w)
print(os.getuid(), sent, refused)
"""
PASS_ONE = """
import os, socket
a, b = socket.socketpair()
r, w = os.pipe()
socket.send_fds(a, [b'x'], [r])
_, fds, _, _ = socket.recv_fds(b, 1, 1)
print(os.getuid(), len(fds))
"""


async def test_a_session_holding_its_descriptors_in_flight_does_not_stop_another_passing_one(
    service: SandboxService,
) -> None:
    # The kernel counts descriptors in flight per uid, across the host, up to RLIMIT_NOFILE: were
    # every sandbox the same uid, one session could hold the whole count and make another tenant's
    # descriptor passing (multiprocessing, asyncio subprocesses) fail with ETOOMANYREFS.
    holder = await service.new_session(OWNER)
    victim = await service.new_session(VICTIM)
    try:
        held = await service.run(OWNER, HOLD_IN_FLIGHT, session_id=holder.session_id)
        holder_uid, sent, refused = held.stdout.split()
        assert refused == "ETOOMANYREFS" and int(sent) >= service.config.limits.nofile, held  # it holds it all
        for session_id in (victim.session_id, None):
            passed = await service.run(VICTIM, PASS_ONE, session_id=session_id)
            assert passed.status == "ok", passed
            uid, count = passed.stdout.split()
            assert count == "1" and uid != holder_uid, passed
    finally:
        await service.close_session(OWNER, holder.session_id)
        await service.close_session(VICTIM, victim.session_id)


async def test_no_sandbox_sees_the_block_devices_of_the_host_or_of_other_sessions(service: SandboxService) -> None:
    # Under runc /sys/block and /proc/diskstats named every session volume's loop device and
    # counted its writes: a tenant could watch another's disk activity.
    probe = (
        "import os\n"
        "seen = [p for p in ('/sys/block', '/sys/class/block', '/sys/dev/block') if os.path.isdir(p) and os.listdir(p)]\n"
        "seen += [p for p in ('/proc/diskstats', '/proc/partitions') if os.path.exists(p) and open(p).read()]\n"
        "print(seen)"
    )
    async with stateless_and_session(service) as places:
        for session_id in places:
            result = await service.run(OWNER, probe, session_id=session_id)
            assert result.status == "ok" and result.stdout == "[]\n", result
