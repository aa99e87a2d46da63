"""What an attack on the audit log found (issue 36), without a server: each line names an identity
the same way, whoever records it; every call that changes state or runs code has its line (a run
started as a task too); and with ``required`` nothing the log cannot record is done."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import anyio
import pytest
from mcp_types import CallToolRequestParams, ClientCapabilities
from test_code_mode_broker import StandInClock, broker_with, call, server, tool

from mcp_code_exec.config.accounting import AuditSettings
from mcp_code_exec.config.oauth import OAuthSettings
from mcp_code_exec.errors import OverQuota
from mcp_code_exec.ledger.audit import AuditLog
from mcp_code_exec.ledger.audit_logger import attach, detach
from mcp_code_exec.mcp_server import tasks
from mcp_code_exec.mcp_server.audit_calls import AUDITED
from mcp_code_exec.mcp_server.http.oauth_verifier import OAuthVerifier, Principal
from mcp_code_exec.observability.logs import identity_hash, logged_id

ISSUER = "https://idp.example"
IDENTITY = f"oauth:{ISSUER} sub=ann"
pytestmark = pytest.mark.anyio


def recorded(path: Path, identities: Literal["hashed", "named"]) -> dict[str, str]:
    """The identity each kind of line names, after a sign-in and a run of the same identity."""
    audit = AuditLog(AuditSettings(path=str(path), identities=identities))
    audit.open()
    attach(audit)
    try:
        verifier = OAuthVerifier(OAuthSettings(issuer=ISSUER, resource="https://mcp.example/mcp"))
        principal = Principal(token="t", client_id="app", scopes=[], expires_at=None, identity=IDENTITY)
        verifier.signed_in("digest", principal, 60)
        audit.record("run", identity=IDENTITY, status="ok")
    finally:
        detach(audit)
        audit.close()
    found = [json.loads(line) for line in path.read_text().splitlines()]
    return {line["event"]: line["identity"] for line in found if "identity" in line}


def test_a_sign_in_line_names_its_identity_as_the_run_lines_do(tmp_path: Path) -> None:
    hashed = recorded(tmp_path / "hashed.log", "hashed")
    assert hashed["run"] == identity_hash(IDENTITY)
    assert hashed["oauth_sign_in"] == hashed["run"]  # today: the hash of the hash, which names nobody
    named = recorded(tmp_path / "named.log", "named")
    assert named["oauth_sign_in"] == named["run"] == IDENTITY  # today: the hash, though names are asked for


def test_every_tool_that_changes_state_or_runs_a_sessions_code_leaves_an_audit_line() -> None:
    # restrict_egress narrows a session's reach (and its record); list_variables runs each value's
    # __repr__ in the session's interpreter (and restores its snapshot: each record's __reduce__).
    assert {"restrict_egress", "list_variables"} <= AUDITED


async def test_with_a_required_log_that_cannot_be_written_no_code_mode_call_reaches_its_upstream(
    tmp_path: Path,
) -> None:
    # A code-mode call acts on another server (a commit, a message): with ``required`` it is one of
    # the calls the server must refuse while it cannot record them, as run_python is.
    path = tmp_path / "audit.log"
    path.write_bytes(b"not an audit line\n")  # nothing to go on from: the log fails until moved aside
    audit = AuditLog(AuditSettings(path=str(path), required=True))
    audit.open()
    assert not audit.healthy
    attach(audit)
    try:
        async with broker_with(server(), [tool("look", read_only=True)]) as broker:
            upstream = broker.upstreams["up"]
            with contextlib.suppress(Exception):  # a refusal, however the broker says it
                await broker.answer("local", broker.new_budget(), call("look"), b"{}", StandInClock())  # type: ignore[arg-type]
    finally:
        detach(audit)
        audit.close()
    assert audit.lost >= 1  # its line was lost ...
    assert upstream.called == []  # type: ignore[attr-defined]  # ... and today the call went through all the same


class TaskService:
    """What the Tasks extension asks of the service, around one audit log: a run that keeps going,
    or (``refuse``) a quota that refuses it."""

    def __init__(self, audit: AuditLog, refuse: bool) -> None:
        limits, runs = SimpleNamespace(max_run_s=60.0), SimpleNamespace(keep_s=60.0, resource_links=False)
        self.config = SimpleNamespace(limits=limits, runs=runs, audit=audit.settings)
        self.accounting = SimpleNamespace(audit=audit)
        self.refuse = refuse
        self.run = SimpleNamespace(id="r_task", finished=anyio.Event(), done=False, cancelled=False, result=None,
                                   started_at=time.time(), started=time.perf_counter(), finished_at=None)  # fmt: skip

    async def start_run(self, identity: str, code: str, **_: object) -> SimpleNamespace:
        if self.refuse:
            raise OverQuota("over the quota runs_per_minute", "runs_per_minute", 60.0, time.time() + 60)
        return self.run

    def tool_approvals(self, run: object) -> None:
        return None

    def get_run(self, identity: str, run_id: str) -> SimpleNamespace:
        return self.run

    async def cancel_and_wait(self, run: SimpleNamespace) -> None:
        run.done = run.cancelled = True


@pytest.mark.parametrize("refuse", [False, True], ids=["a run that goes on as a task", "a quota's refusal"])
async def test_a_run_started_as_a_task_and_its_cancel_each_leave_an_audit_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refuse: bool
) -> None:
    # A client that declares the Tasks extension has run_python started by the extension, not by the
    # tool: its runs, their quota refusals and tasks/cancel are recorded all the same.
    monkeypatch.setattr(tasks, "QUICK_S", 0.0)
    path = tmp_path / "audit.log"
    audit = AuditLog(AuditSettings(path=str(path)))
    audit.open()
    service = TaskService(audit, refuse)
    extension = tasks.TasksExtension(service)  # type: ignore[arg-type]
    capabilities = ClientCapabilities(extensions={tasks.TASKS: {}})
    ctx: Any = SimpleNamespace(session=SimpleNamespace(client_capabilities=capabilities), protocol_version="2026-07-28")
    params = CallToolRequestParams(name="run_python", arguments={"code": "while True: pass"})

    async def not_the_tool(ctx: object) -> None:
        raise AssertionError("the tool itself is not called for a task")

    answer = await extension.intercept_tool_call(params, ctx, not_the_tool)
    if not refuse:
        assert isinstance(answer, dict) and answer["taskId"] == "r_task"
        assert await extension._cancel(ctx, tasks.TaskIdParams(task_id="r_task")) == {}
    audit.close()
    found = [json.loads(line) for line in path.read_text().splitlines()]
    calls = [(line["tool"], line["outcome"]) for line in found if line["event"] == "call"]
    if refuse:
        assert calls == [("run_python", "refused: quota runs_per_minute")]
    else:
        assert calls == [("run_python", "working"), ("tasks/cancel", "ok")]
        assert {line["run"] for line in found if line["event"] == "call"} == {logged_id("r_task")}
    assert all(line["identity"] == identity_hash("local") for line in found if line["event"] == "call")
