"""Local processes started in a session of their own (so in a process group of their own), and
stopped whole: code mode's stdio upstreams, the host's pip, debootstrap.

A process's children stay in its group unless they leave it, so signalling the group reaches what
the process started (npx's node, pip's build backends, debootstrap's chroot). The group outlives its
leader while any member lives, so its id cannot have been reused while something of it is left.
"""

from __future__ import annotations

import os
import signal
from contextlib import suppress

import anyio
from anyio.abc import Process


def signal_group(process: Process, sent: signal.Signals) -> None:
    """Send ``sent`` to the process's group, if anything of it is left."""
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sent)


async def stop_group(process: Process, *, grace_s: float, close_stdin: bool = False) -> None:
    """Stop the process and everything left in its group, in steps, each given ``grace_s``:

    1. with ``close_stdin``, its stdin closed (a stdio server's cue to end);
    2. SIGTERM to the group, unless the process has ended (debootstrap's exit trap unmounts);
    3. SIGKILL to whatever of the group is left, even once the process has ended.
    """
    if close_stdin and process.stdin is not None:
        with suppress(Exception):
            await process.stdin.aclose()
        with anyio.move_on_after(grace_s):
            await process.wait()
    if process.returncode is None:
        signal_group(process, signal.SIGTERM)
        with anyio.move_on_after(grace_s):
            await process.wait()
    signal_group(process, signal.SIGKILL)
    with anyio.move_on_after(grace_s):
        await process.wait()
