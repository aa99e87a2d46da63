"""The agent's meter read on this machine's kernel: CPU that grows by what a process burns, whichever
way it is read (a cgroup, or every process's account in /proc), and a peak that can be started
afresh. The figures inside real sandboxes, under runc and gVisor: ``tests/engine/test_usage.py``."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "images" / "python" / "agent"))
from mcpx_agent import meter


def burn(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_cpu_grows_by_at_least_what_this_process_burns() -> None:
    before = meter.cpu_us()
    burn(0.3)
    after = meter.cpu_us()
    used = (after[0] - before[0]) + (after[1] - before[1])
    assert used >= 0.25e6  # ticks are 10 ms: within two of them, and others' work may add to it
    assert meter.cpu_source() in ("cgroup2", "cgroup1", "proc")


PROBE = """
import os, sys, time
sys.path.insert(0, sys.argv[1])
from mcpx_agent import meter
before = meter._processes()
child = os.fork()
if child == 0:
    end = time.process_time() + 0.4
    while time.process_time() < end:
        pass
    os._exit(0)
os.waitpid(child, 0)  # gone: its time is ours now (cutime)
after = meter._processes()
print(sum(after) - sum(before))
"""


def test_every_process_account_counts_a_child_that_burned_and_ended() -> None:
    """Read as in a gVisor sandbox, in a pid namespace of its own: only its processes are in /proc."""
    agent = str(Path(meter.__file__).resolve().parents[1])
    try:
        done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", PROBE, agent],
                              capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    except FileNotFoundError:
        pytest.skip("no unshare here")
    if done.returncode != 0 and "Operation not permitted" in done.stderr:
        pytest.skip("a pid namespace needs root here")
    assert done.returncode == 0, done.stderr
    assert 0.38e6 <= int(done.stdout) <= 0.6e6


def test_a_peak_started_afresh_follows_what_is_allocated_after() -> None:
    if not meter.reset_peak():
        pytest.skip("this kernel keeps no resettable high-water mark")
    block = bytearray(64 << 20)
    for offset in range(0, len(block), 4096):
        block[offset] = 1
    own, _ = meter.own_peak_kib()
    del block
    meter.reset_peak()
    after, _ = meter.own_peak_kib()
    assert own - after >= 60 << 10  # the 64 MiB were in the first peak, and left the second
    assert meter.peak_kib(os.getpid()) == after


def test_a_process_that_is_gone_has_no_peak() -> None:
    assert meter.peak_kib(2**22 + 12345) is None


REAPED_MID_READING = """
import os, sys, time
sys.path.insert(0, sys.argv[1])
from mcpx_agent import meter, procfs
child = os.fork()
if child == 0:
    end = time.process_time() + 0.4
    while time.process_time() < end:
        pass
    os._exit(0)
deadline = time.monotonic() + 30
while (procfs.stat_fields(child) or [b"Z"])[0] != b"Z":  # ended, not yet reaped (its account is its own)
    assert time.monotonic() < deadline
    time.sleep(0.01)
reaped = []

def reaping_first(pid):
    if pid == child and not reaped:  # as a reaper does between reading its account and the child's
        reaped.append(os.waitpid(child, 0))
    return procfs.stat_fields(pid)

meter.stat_fields = reaping_first
print(sum(meter._processes()))
"""


def test_a_process_reaped_while_the_accounts_are_read_is_still_counted() -> None:
    """Its reaper (pid 1 here) is read before the reap, the child after it: the time was in neither
    account when read, as with a stateless run's worker reaped by the zygote while the run is measured."""
    agent = str(Path(meter.__file__).resolve().parents[1])
    try:
        done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", REAPED_MID_READING, agent],
                              capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    except FileNotFoundError:
        pytest.skip("no unshare here")
    if done.returncode != 0 and "Operation not permitted" in done.stderr:
        pytest.skip("a pid namespace needs root here")
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) >= 0.38e6  # the child's 0.4 s, now in the reaper's cutime
