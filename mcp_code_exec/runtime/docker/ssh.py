"""An ssh:// engine: its socket forwarded to a private local one by the machine's ssh client.

``ssh -N -L LOCAL:REMOTE [-l user] [-p port] -- host`` with ``BatchMode`` (never a prompt: keys
and known_hosts as ``~/.ssh/config`` says). One ssh connection carries every API call and every
container's attach stream (each a channel of it), so the engine is then a unix socket to the rest
of the adapter. The Docker SDK's own ssh support needs paramiko, and starts an ssh process per
connection. REMOTE is the URL's path (``ssh://deploy@host2/run/user/1000/docker.sock``), by default
``/var/run/docker.sock``. The local socket lives in a directory only this user can enter: whoever
reaches it has the remote engine. The tunnel is started again when its ssh has exited (``ensure``,
at each health check), and dies with this process (Linux: a parent-death signal).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from urllib.parse import urlsplit

import anyio
import anyio.to_thread

from ...errors import EngineUnavailable

DEFAULT_REMOTE = "/var/run/docker.sock"
PR_SET_PDEATHSIG = 1


def _prctl() -> object | None:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl() if sys.platform == "linux" else None  # looked up here: after a fork, no dlopen


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    if callable(_PRCTL):
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)


class SshTunnel:
    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or ""
        self.remote = parts.path if parts.path not in ("", "/") else DEFAULT_REMOTE
        options = ["-o", "BatchMode=yes", "-o", "ExitOnForwardFailure=yes", "-o", "StreamLocalBindUnlink=yes"]
        options += ["-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3"]
        options += ["-l", parts.username] if parts.username else []
        self._options = options + (["-p", str(parts.port)] if parts.port else [])
        self._dir = tempfile.mkdtemp(prefix="mcp-code-exec-ssh-")  # mode 0700
        self.local = os.path.join(self._dir, "docker.sock")
        self._process: subprocess.Popen[bytes] | None = None
        self._starting = anyio.Lock()  # health checks and calls may ask at once: one ssh

    @property
    def url(self) -> str:
        return f"unix://{self.local}"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    async def ensure(self, timeout_s: float = 15.0) -> None:
        """The tunnel up: ssh started (again) if it is not running, and the local socket there."""
        async with self._starting:
            if not (self.running and await anyio.Path(self.local).exists()):
                await self._start(timeout_s)

    async def _start(self, timeout_s: float) -> None:
        await self._stop()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.local)
        log_path = os.path.join(self._dir, "ssh.log")
        argv = ["ssh", "-N", *self._options, "-L", f"{self.local}:{self.remote}", "--", self.host]
        with open(log_path, "wb") as log:  # noqa: ASYNC230 - a local file, opened once per tunnel start
            # Started from the event loop's thread: the parent-death signal follows the thread
            # that forked, and a worker thread exits when idle.
            self._process = subprocess.Popen(  # noqa: ASYNC220 - fork and exec, not a wait
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=log,
                preexec_fn=_die_with_parent if _PRCTL is not None else None,
            )
        try:
            with anyio.fail_after(timeout_s):
                while not await anyio.Path(self.local).exists():
                    if not self.running:
                        raise EngineUnavailable(f"ssh to {self.host} failed: {self._said(log_path)}")
                    await anyio.sleep(0.05)  # polling for another process's socket to appear
        except TimeoutError:
            await self._stop()
            detail = f"did not forward the engine's socket within {timeout_s:g} s"
            raise EngineUnavailable(f"ssh to {self.host} {detail}") from None

    def _said(self, log_path: str) -> str:
        try:
            with open(log_path, "rb") as log:
                text = log.read()[-300:].decode("utf-8", "replace").strip()
        except OSError:
            text = ""
        return text or f"it exited with {self._process.returncode if self._process else '?'}"

    async def _stop(self) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            await anyio.to_thread.run_sync(process.wait, 5)
        except subprocess.TimeoutExpired:
            process.kill()
            await anyio.to_thread.run_sync(process.wait)

    async def close(self) -> None:
        with anyio.CancelScope(shield=True):
            await self._stop()
        shutil.rmtree(self._dir, ignore_errors=True)
