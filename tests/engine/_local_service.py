"""The local service stdio fronts share, as the tests see it: a private runtime directory per test
(``MCP_CODE_EXEC_RUNTIME_DIR``, so no test touches a user's real service), the services found there, and
stopping them (SIGTERM, then SIGKILL past a bound) when the test ends."""

from __future__ import annotations

import fcntl
import os
import signal
import tempfile
import time
from pathlib import Path


def private_runtime_dir() -> Path:
    """A short path (a unix socket's path is at most 107 bytes), 0700, of this test alone."""
    return Path(tempfile.mkdtemp(prefix="mcx-"))


def service_dir(runtime_dir: Path) -> Path:
    return runtime_dir / "mcp-code-exec"


def live_service_pids(runtime_dir: Path) -> list[int]:
    """Pids of the services living in ``runtime_dir``: each holds its pid file locked while it lives."""
    found = []
    for pid_file in sorted(service_dir(runtime_dir).glob("*.pid")):
        handle = os.open(pid_file, os.O_RDONLY)
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = pid_file.read_text().strip()
            if text.isdigit():
                found.append(int(text))
        finally:
            os.close(handle)
    return found


def process_gone(pid: int) -> bool:
    """No such process, or only a zombie with no thread left (the service is its front's grandchild:
    init reaps it; its main thread is a zombie before its other threads have exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        threads = len(list(Path(f"/proc/{pid}/task").iterdir()))
    except OSError:
        return True
    return state == "Z" and threads <= 1


def stop_services(runtime_dir: Path, timeout_s: float = 60.0) -> list[int]:
    """Stop every service in ``runtime_dir`` (SIGTERM: it closes its sessions); SIGKILL one that is
    still there after ``timeout_s``. Returns the pids that had to be killed."""
    pids = live_service_pids(runtime_dir)
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    killed = []
    for pid in pids:
        while not process_gone(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not process_gone(pid):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
    return killed
