"""Whose containers and sessions are whose: a server that is gone is judged by its process entry."""

from __future__ import annotations

import os
import signal
import socket
import subprocess

from mcp_code_exec.sandbox.ownership import _start_ticks, owner_alive


def test_a_killed_server_not_yet_reaped_counts_as_gone() -> None:
    """A zombie keeps its process entry until its parent reaps it: a service started right after a
    server was killed must still take over that server's sessions."""
    child = subprocess.Popen(["sleep", "60"])
    try:
        token = f"{socket.gethostname()}:{child.pid}:{_start_ticks(child.pid)}"
        assert owner_alive(token)
        child.send_signal(signal.SIGKILL)
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # it has ended; it stays unreaped
        assert not owner_alive(token)  # dead, though its process entry is still there
    finally:
        child.kill()
        child.wait()
