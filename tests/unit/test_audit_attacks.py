"""What an attack on the audit log found (issue 36), without a server: each line names an identity
the same way, whoever records it; every call that changes state or runs code has its line; and with
``required`` nothing the log cannot record is done."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Literal

import pytest
from test_code_mode_broker import StandInClock, broker_with, call, server, tool

from mcp_code_exec.config.accounting import AuditSettings
from mcp_code_exec.config.oauth import OAuthSettings
from mcp_code_exec.ledger.audit import AuditLog
from mcp_code_exec.ledger.audit_logger import attach, detach
from mcp_code_exec.mcp_server.audit_calls import AUDITED
from mcp_code_exec.mcp_server.http.oauth_verifier import OAuthVerifier, Principal
from mcp_code_exec.observability.logs import identity_hash

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
