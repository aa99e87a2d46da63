"""Errors of mcp-code-exec. What user code does is never one of these: it is data in a result.

Exception tree::

    SandboxError                 anything this package raises on purpose
    ├── EngineError              the container engine failed or cannot be reached
    │   ├── EngineUnavailable    no engine answers (the message says how to start one)
    │   │   └── EngineDown       one engine of several is out (a session on it waits for it; its
    │   │                        files are kept there): "engine unavailable, retry later"
    │   ├── ImageMissing         the sandbox image is absent or outdated (names the build command)
    │   └── VolumeSizeUnsupported  the engine cannot give a volume a filesystem of its own size
    ├── SandboxLost              a container or its agent died or stopped answering mid-request
    │   └── ProtocolViolation    the agent sent bytes the protocol does not allow (it is replaced)
    ├── PoolBusy                 no warm container came free within the wait; retry
    ├── PoolClosed               the pool is shutting down
    ├── SessionNotFound          unknown, closed or someone else's session (one message for all)
    ├── RunNotFound              unknown, expired or someone else's run (one message for all)
    ├── SessionBusy              the session is running code (the message names the run), or a
    │                            file URL's transfer found it held by another transfer
    ├── SessionLimit             too many sessions open (all clients, or this client's share)
    ├── ClientLimit              this client already has as many runs going as it may
    │   └── OverQuota            an identity's quota is used up (runs a minute, CPU seconds, package
    │                            installs, stored disk): names the quota, its window, when it frees
    ├── AuditUnavailable         the audit log cannot be written and ``audit.required`` is set: the
    │                            call is refused, nothing was done
    ├── InvalidPath              a file path that is malformed or leaves /mnt/data
    ├── FileOperationError       the agent refused or failed a file operation
    │   ├── QuotaExceeded        it would take the session's /mnt/data over its quota
    │   └── TooLarge             more bytes than the operation's cap
    ├── PackageError             a cell's `pip install` was refused or could not be served (the run
    │                            ends as status "error" with this sentence; nothing of the cell ran)
    ├── WheelError               a wheel could not be resolved or fetched by the host's pip (the
    │   │                        message says which and why; a run's install turns it into a PackageError)
    │   ├── NoDistribution       pip found nothing it may use for a requirement
    │   ├── PipTimeout           pip took longer than it may; it was killed
    │   └── DownloadTooLarge     pip's downloads went past the bytes it was given; it was killed
    ├── Unsupported              the sandbox image's agent does not know the request (an image older
    │                            than the server: the message names the build command)
    ├── EgressError              the egress proxy refused a message of the server's, or cannot run
    │   ├── ProxyGone            the proxy is not running or stopped answering (it is started again)
    │   └── ReachRefused         a session asked to reach a host outside its reach (egress is only
    │                            ever narrowed), or for egress where the server has none
    └── ConfigError              a bad configuration value or file

Each class says how an HTTP answer reports it (``http_status``, for the file URLs): 503 unless it
says otherwise, for the sandbox or the engine failing.

Foreign errors (docker's, requests', the OS's) are translated into these in one place each:
``runtime.docker.engine.translate`` for the engine (``runtime.cluster`` turns an engine of several
that stopped answering into ``EngineDown``), ``runtime.docker.disks.outcome`` for the helper that
makes sized volumes, ``sandbox.channel`` for the agent's stream (where every exception a container's bytes
can cause ends as ``SandboxLost``).
"""

from __future__ import annotations


class SandboxError(Exception):
    """Base class; ``str(exc)`` is a sentence a model or a human can act on."""

    http_status = 503


class EngineError(SandboxError):
    pass


class EngineUnavailable(EngineError):
    pass


class EngineDown(EngineUnavailable):
    """One engine of a cluster stopped answering (or was refused): what lives there waits for it."""

    def __init__(self, engine: str, detail: str = "") -> None:
        super().__init__(
            f"engine unavailable: the Docker engine {engine!r} is not answering"
            + (f" ({detail})" if detail else "")
            + "; a session there keeps its files and works again (its variables lost) once the engine is "
            "back: retry later, or start a new session"
        )
        self.engine = engine


class ImageMissing(EngineError):
    pass


class VolumeSizeUnsupported(EngineError):
    """Sized volumes need loop devices on the engine's host (a Linux engine run as root, whose
    containers may be given CAP_SYS_ADMIN and the loop devices); the message says what was missing."""


class SandboxLost(SandboxError):
    pass


class ProtocolViolation(SandboxLost):
    pass


class PoolBusy(SandboxError):
    pass


class PoolClosed(SandboxError):
    pass


class SessionNotFound(SandboxError):
    http_status = 404

    def __init__(self, session_id: str) -> None:
        if session_id.startswith("r_"):  # a run's id where a session's goes: say where it belongs
            said = f"{session_id!r} is a run's id, not a session's: pass it as run_id (session_id is for sessions)"
        else:
            said = f"no such session: {session_id!r} (it may have been closed or expired; start one with new_session)"
        super().__init__(said)
        self.session_id = session_id


class RunNotFound(SandboxError):
    def __init__(self, run_id: str) -> None:
        super().__init__(
            f"no such run: {run_id!r} (finished runs are kept for a while, then forgotten; run the code again)"
        )
        self.run_id = run_id


class SessionBusy(SandboxError):
    http_status = 409

    def __init__(self, session_id: str, run_id: str | None) -> None:
        if run_id is None:  # held by a file transfer or another file call
            message = f"session {session_id!r} is busy with another file transfer; retry once it has ended"
        else:
            message = (
                f"session {session_id!r} is busy with run {run_id!r}; call get_run('{run_id}') to wait for it, "
                f"or cancel_run('{run_id}') to stop it"
            )
        super().__init__(message)
        self.session_id = session_id
        self.run_id = run_id


class SessionLimit(SandboxError):
    pass


class ClientLimit(SandboxError):
    pass


class OverQuota(ClientLimit):
    """``quota``: its name (``[quotas]``); ``window_s``: the span it counts over (None: at any time);
    ``frees_at``: when enough of it frees for the call to pass (epoch seconds; None: not by waiting)."""

    def __init__(self, message: str, quota: str, window_s: float | None, frees_at: float | None) -> None:
        super().__init__(message)
        self.quota = quota
        self.window_s = window_s
        self.frees_at = frees_at


class AuditUnavailable(SandboxError):
    pass


class InvalidPath(SandboxError):
    pass


class FileOperationError(SandboxError):
    """The agent refused it: for a write, what is at the path is in the way (a directory, the
    permissions); a read it refused has no file to give (the file URLs answer 404 then)."""

    http_status = 409


class QuotaExceeded(FileOperationError):
    http_status = 507


class TooLarge(FileOperationError):
    http_status = 413


class PackageError(SandboxError):
    pass


class WheelError(SandboxError):
    pass


class NoDistribution(WheelError):
    """No such project, or no wheel of it for the sandbox: ``requirement`` names what was asked."""

    def __init__(self, message: str, requirement: str) -> None:
        super().__init__(message)
        self.requirement = requirement


class PipTimeout(WheelError):
    pass


class DownloadTooLarge(WheelError):
    pass


class Unsupported(SandboxError):
    pass


class EgressError(SandboxError):
    pass


class ProxyGone(EgressError):
    pass


class ReachRefused(EgressError):
    pass


class ConfigError(SandboxError):
    pass
