"""Shared helpers of the adversarial suite (tests/engine/test_security_*.py)."""

from __future__ import annotations

import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from mcp_code_exec.models import RunResult
from mcp_code_exec.service.facade import SandboxService

OWNER = "attacker"
VICTIM = "victim"  # another client, whose data or service the attacker is after

# Processes of the sandbox's uid other than the one running this code (and its parent chain is root).
OTHER_USER_PROCESSES = (
    "import os\n"
    "me = os.getpid()\n"
    "others = []\n"
    "for p in os.listdir('/proc'):\n"
    "    if not p.isdigit() or int(p) == me:\n"
    "        continue\n"
    "    try:\n"
    "        status = open(f'/proc/{p}/status').read()\n"
    "    except OSError:\n"
    "        continue\n"
    "    if f'\\nUid:\\t{os.getuid()}\\t' in status and '\\nState:\\tZ' not in status:  # a zombie runs nothing\n"
    "        others.append(p)\n"
    "print(len(others))"
)

IDENTITY = (
    "import os, subprocess\n"
    "def ident(text):\n"
    "    s = dict(l.split(':\\t', 1) for l in text.splitlines() if ':\\t' in l)\n"
    "    uids = set(s['Uid'].split())\n"
    "    uid = 'sandbox' if len(uids) == 1 and 2**30 <= int(min(uids)) < 2**30 + 2**24 else s['Uid'].strip()\n"
    "    return [uid, s['Gid'].split()[0], s['CapPrm'].strip(), s['CapEff'].strip(),\n"
    "            s['CapAmb'].strip(), s['NoNewPrivs'].strip(), s['Seccomp'].strip()]\n"
    "print(ident(open('/proc/self/status').read()))\n"
    "print(ident(subprocess.run(['cat', '/proc/self/status'], capture_output=True, text=True).stdout))\n"
)
IDENTITY_LINE = "['sandbox', '1000', '0000000000000000', '0000000000000000', '0000000000000000', '1', '2']"


async def assert_answers(service: SandboxService, session_id: str | None = None, owner: str = OWNER) -> RunResult:
    """The safe end of every case: a following ``print(1)`` in the same place succeeds."""
    result = await service.run(owner, "print(1)", session_id=session_id, timeout=30)
    assert result.status == "ok", result
    assert result.stdout == "1\n", result
    return result


@asynccontextmanager
async def stateless_and_session(service: SandboxService, owner: str = OWNER) -> AsyncIterator[tuple[str | None, str]]:
    """Where every sandbox-wide guarantee is checked: a stateless run (None) and a fresh session,
    closed afterwards."""
    session = await service.new_session(owner)
    try:
        yield (None, session.session_id)
    finally:
        await service.close_session(owner, session.session_id)


async def no_other_user_processes(service: SandboxService, session_id: str | None = None) -> None:
    """Nothing of the sandbox user survives: the next run sees no uid-1000 process but itself.

    Stateless runs go to whichever warm container is idle, so every one of them is checked.
    """
    rounds = 1 if session_id is not None else service.config.pool.size + 1
    for _ in range(rounds):
        result = await service.run(OWNER, OTHER_USER_PROCESSES, session_id=session_id, timeout=30)
        assert result.status == "ok", result
        assert result.stdout.strip() == "0", result


def rss_kib() -> int:
    """This process's resident memory (the server's, in tests that run the service in-process)."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS in /proc/self/status")


def runsc_available() -> bool:
    try:
        out = subprocess.run(
            ["docker", "info", "--format", "{{json .Runtimes}}"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return '"runsc"' in out.stdout


def runsc_leftovers() -> list[str]:
    """runsc sandbox processes that no running container accounts for (see ENVIRONMENT.md)."""
    try:
        found = subprocess.run(
            ["pgrep", "-af", "runsc-sandbox"], capture_output=True, text=True, timeout=10, check=False
        )
        running = subprocess.run(
            ["docker", "ps", "-q", "--no-trunc"], capture_output=True, text=True, timeout=30, check=False
        ).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return []
    leftovers = []
    for line in found.stdout.splitlines():
        if not any(container_id in line for container_id in running):
            leftovers.append(line)
    return leftovers
