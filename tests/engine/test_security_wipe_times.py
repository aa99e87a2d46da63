"""The wipe leaves no bits in the top directories' times: whatever a stateless run sets them to
(the sandbox user owns /mnt/data and may set any time on it; every top's times move to the moment
a run touches it), the next run in the same container finds the times every wipe leaves."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
from _security import OWNER, runsc_available, runsc_leftovers
from _support import make_test_config, wait_until

from mcp_code_exec.service import SandboxService

pytestmark = pytest.mark.anyio

TOPS = ("/mnt/data", "/tmp", "/dev/shm", "/dev/mqueue")
READ = (
    "import json, os\n"
    "times = {}\n"
    f"for top in {TOPS!r}:\n"
    "    try:\n"
    "        st = os.stat(top)\n"
    "    except OSError:\n"
    "        continue\n"
    "    times[top] = [st.st_atime_ns, st.st_mtime_ns]\n"
    "print(json.dumps(times))\n"
)
# 60 bits of the run's choosing on /mnt/data, which it owns; on the others, the moment it chose.
SIGNAL = (
    "import os, time\n"
    f"for top in {TOPS!r}:\n"
    "    try:\n"
    "        os.utime(top, ns=(123456789123456789, 987654321987654321))\n"
    "        continue\n"
    "    except OSError:\n"
    "        pass\n"
    "    try:\n"
    "        os.listdir(top)\n"
    "        open(os.path.join(top, 'x'), 'w').close()\n"
    "        os.unlink(os.path.join(top, 'x'))\n"
    "        os.utime(top)\n"
    "    except OSError:\n"
    "        pass\n"
    "print(os.stat('/mnt/data').st_mtime_ns)\n"
)


async def check_times_carry_nothing(service: SandboxService) -> None:
    await service.run(OWNER, "print('a first run, so the next one follows a wipe')")
    before = await service.run(OWNER, READ)
    assert before.status == "ok", before
    signalled = await service.run(OWNER, SIGNAL)
    assert signalled.stdout == "987654321987654321\n", signalled  # the run could set them
    after = await service.run(OWNER, READ)
    assert after.status == "ok", after
    assert "/mnt/data" in json.loads(after.stdout) and "/tmp" in json.loads(after.stdout)
    assert json.loads(after.stdout) == json.loads(before.stdout)


async def test_a_stateless_run_reads_nothing_of_the_last_one_in_the_tops_times() -> None:
    config = make_test_config(pool={"size": 1, "session_spares": 0})
    async with SandboxService.start(config) as service:
        await service.wait_ready()
        await check_times_carry_nothing(service)


@pytest.fixture
async def gvisor_one() -> AsyncIterator[SandboxService]:
    settings = make_test_config(runtime="runsc", pool={"size": 1, "session_spares": 0})
    async with SandboxService.start(settings) as service:
        await service.wait_ready()
        yield service
    await wait_until(lambda: not runsc_leftovers(), 30)


@pytest.mark.skipif(not runsc_available(), reason="gVisor is not installed: `docker info` lists no runsc runtime")
async def test_under_gvisor_a_stateless_run_reads_nothing_of_the_last_one_in_the_tops_times(
    gvisor_one: SandboxService,
) -> None:
    await check_times_carry_nothing(gvisor_one)


# -- What a worker can read of the agent's own processes ---------------------------------------------
AGENT_PROC = (
    "import json, os\n"
    "seen = {}\n"
    "for pid in (p for p in os.listdir('/proc') if p.isdigit()):\n"
    "    try:\n"
    "        status = open(f'/proc/{pid}/status').read()\n"
    "    except OSError:\n"
    "        continue\n"
    "    if f'\\nUid:\\t{os.getuid()}\\t' in status or int(pid) == 1:\n"
    "        continue  # this run's own processes, and the container's init\n"
    "    for name in ('environ', 'maps'):\n"
    "        try:\n"
    "            with open(f'/proc/{pid}/{name}', 'rb') as handle:\n"
    "                seen[f'{pid}/{name}'] = len(handle.read())\n"
    "        except OSError as exc:\n"
    "            seen[f'{pid}/{name}'] = type(exc).__name__\n"
    "print(json.dumps(seen))\n"
)


async def check_agent_proc_hidden(service: SandboxService) -> None:
    result = await service.run(OWNER, AGENT_PROC)
    assert result.status == "ok", result
    seen = json.loads(result.stdout)
    assert len(seen) >= 4, seen  # the supervisor's and the zygote's, at least
    assert all(outcome in ("PermissionError", 0) for outcome in seen.values()), seen


async def test_a_worker_cannot_read_the_supervisors_or_zygotes_environ_or_maps(service: SandboxService) -> None:
    await check_agent_proc_hidden(service)


AGENT_ENVIRON = (
    "import json, os\n"
    "own = open('/proc/self/environ', 'rb').read()\n"
    "seen = {}\n"
    "for pid in (p for p in os.listdir('/proc') if p.isdigit()):\n"
    "    try:\n"
    "        status = open(f'/proc/{pid}/status').read()\n"
    "        if f'\\nUid:\\t{os.getuid()}\\t' in status or int(pid) == 1:\n"
    "            continue\n"
    "        seen[pid] = open(f'/proc/{pid}/environ', 'rb').read() == own\n"
    "    except OSError as exc:\n"
    "        seen[pid] = type(exc).__name__\n"
    "print(json.dumps(seen))\n"
)


@pytest.mark.skipif(not runsc_available(), reason="gVisor is not installed: `docker info` lists no runsc runtime")
async def test_under_gvisor_the_agents_environ_tells_a_worker_nothing_its_own_does_not(
    gvisor_one: SandboxService,
) -> None:
    """gVisor's procfs lets any process read another's ``environ`` and ``maps`` (an accepted channel,
    docs/security.md). The supervisor and the zygote are forks of the process the container started,
    as is every worker, so what a worker reads there is the very environment its own
    ``/proc/self/environ`` shows: nothing of the host's or of another run."""
    result = await gvisor_one.run(OWNER, AGENT_ENVIRON)
    assert result.status == "ok", result
    seen = json.loads(result.stdout)
    assert len(seen) >= 2, seen  # the supervisor's and the zygote's, at least
    assert all(outcome in (True, "PermissionError", "FileNotFoundError") for outcome in seen.values()), seen
