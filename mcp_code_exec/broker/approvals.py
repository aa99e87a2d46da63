"""Calls waiting for a human: the broker puts one on its run, and whoever follows the run for the
client (``run_python``, ``get_run``, a task) asks the human the way that client can, and answers.

An approval is answered once: the first answer counts, a second (a replayed retry) finds nothing.
The model never answers one: only the client's elicitation (a human's form) does.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

import anyio

PREVIEW_MAX = 600  # characters of the arguments the human sees


@dataclass(eq=False)
class Approval:
    call: int
    server: str
    tool: str
    arguments: dict[str, Any]
    key: str = field(default_factory=lambda: "approve-" + secrets.token_urlsafe(9))
    answered: anyio.Event = field(default_factory=anyio.Event)
    allowed: bool = False
    reason: str = ""

    def answer(self, allowed: bool, reason: str) -> bool:
        """Settle it; False if it was settled already (an approval is used once)."""
        if self.answered.is_set():
            return False
        self.allowed, self.reason = allowed, reason
        self.answered.set()
        return True

    def message(self) -> str:
        shown = json.dumps(self.arguments, ensure_ascii=False, sort_keys=True, default=str)
        if len(shown) > PREVIEW_MAX:
            shown = shown[: PREVIEW_MAX - 20] + f"... ({len(shown)} characters)"
        return (
            f"Code running in the sandbox wants to call the tool {self.tool!r} on the server {self.server!r} "
            f"with these arguments: {shown}. Allow this one call?"
        )


@dataclass(eq=False)
class RunApprovals:
    """A run's calls waiting for approval; ``changed`` is set when one is added."""

    pending: dict[str, Approval] = field(default_factory=dict)
    changed: anyio.Event = field(default_factory=anyio.Event)

    def add(self, approval: Approval) -> None:
        self.pending[approval.key] = approval
        self.changed.set()

    def remove(self, approval: Approval) -> None:
        self.pending.pop(approval.key, None)

    def renew(self) -> anyio.Event:
        if self.changed.is_set():
            self.changed = anyio.Event()
        return self.changed

    def waiting(self) -> list[Approval]:
        return [approval for approval in self.pending.values() if not approval.answered.is_set()]

    def take(self, key: str) -> Approval | None:
        """The approval with this key, once (a second take finds nothing)."""
        return self.pending.pop(key, None)
