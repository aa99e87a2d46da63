"""One audit line per tool call that runs code or changes state (see ``ledger/audit``): the tool,
who called it, the session and run, the code's hash and size, how it ended. With
``audit.required`` a call the log cannot record is refused before it does anything."""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

from mcp.types import CallToolResult

from ..config.accounting import AuditSettings
from ..errors import OverQuota
from ..ledger.audit import AuditLog
from .identity import owner_of

P = ParamSpec("P")
R = TypeVar("R")

# The tools that run code or change state: one audit line each (``audited``). ``restrict_egress``
# narrows a session's reach; ``list_variables`` runs each value's ``__repr__`` in the session (and
# may restore its snapshot first).
AUDITED = {"run_python", "cancel_run", "new_session", "close_session", "fork_session", "restrict_egress",
           "list_variables", "export_notebook", "write_file", "file_url"}  # fmt: skip


def audited(name: str, fn: Callable[P, Awaitable[R]], log: Callable[[], AuditLog]) -> Callable[P, Awaitable[R]]:
    """``fn`` with its call's audit line (``AuditUnavailable`` first, where the log must and cannot record it)."""

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        audit = log()
        audit.require()
        started, outcome, run = time.perf_counter(), "ok", kwargs.get("run_id")
        try:
            result = await fn(*args, **kwargs)
            if isinstance(result, CallToolResult):
                found = result.structured_content or {}
                outcome = str(found.get("status") or ("error" if result.is_error else "ok"))
                run = found.get("run_id") or run
            elif isinstance(result, dict) and "taskId" in result:  # a run answered as a task (``tasks``)
                outcome, run = str(result.get("status")), result["taskId"]
            return result
        except OverQuota as exc:
            outcome = f"refused: quota {exc.quota}"
            raise
        except BaseException as exc:
            outcome = f"error: {type(exc).__name__}"
            raise
        finally:
            fields = {"session": kwargs.get("session_id"), "run": run, "code": kwargs.get("code")}
            elapsed = round((time.perf_counter() - started) * 1000, 1)
            audit.record("call", tool=name, identity=owner_of(), outcome=outcome, duration_ms=elapsed, **fields)

    return wrapper


def audited_tool(
    name: str, fn: Callable[P, Awaitable[R]], settings: AuditSettings, log: Callable[[], AuditLog]
) -> Callable[P, Awaitable[R]]:
    """``fn``, with its audit line where it runs code or changes state and a log is configured (read
    from ``[audit]``: the tools are registered before the service starts)."""
    return audited(name, fn, log) if name in AUDITED and settings.file is not None else fn
