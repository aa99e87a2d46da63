"""The audit log of a real server: a line for every call that runs code or changes state and for
every run (with its usage), none holding a token, the code or an id; the chain verifies, and
removing, editing or moving a line is found where it was done; a log on a full disk is reported,
and with ``required`` calls are refused until it can be written again. docs/accounting.md."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from _support import make_test_config
from _tasks_client import TasksClient, tasks_cancel
from mcp import Client
from mcp.types import CallToolResult
from test_quotas import remove_ledgers

from mcp_code_exec.commands.cli import main
from mcp_code_exec.ledger.chain import verify
from mcp_code_exec.mcp_server import build_server
from mcp_code_exec.observability import metrics
from mcp_code_exec.observability.logs import identity_hash, logged_id
from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio
SECRET = "a-value-that-must-never-be-logged-7f3a"
CODE = f"token = {SECRET!r}\nprint(len(token))"


@asynccontextmanager
async def audited(
    path: Path, quotas: Any = None, extensions: Any = (), **audit: Any
) -> AsyncIterator[tuple[SandboxService, Client]]:
    config = make_test_config(
        audit={"path": str(path), **audit}, quotas=quotas or {}, pool={"size": 1, "session_spares": 0}
    )
    async with SandboxService.start(config) as service:
        await service.wait_ready()
        try:
            async with Client(build_server(service), extensions=list(extensions)) as client:
                yield service, client
        finally:
            instance = service.instance
    remove_ledgers({instance})  # what the quota counted, which a server keeps for the next one


async def call(client: Client, tool: str, **arguments: Any) -> CallToolResult:
    return await client.call_tool(tool, arguments)


def events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_a_servers_log_holds_each_call_and_run_verifies_and_shows_tampering_where_it_was_done(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "audit.log"
    quotas = {"identities": {"local": {"runs_per_minute": 3}}}  # the in-memory client's identity
    async with audited(log, quotas) as (_, client):
        assert (await call(client, "run_python", code=CODE)).structured_content["status"] == "ok"
        session_id = (await call(client, "new_session")).structured_content["session_id"]
        await call(client, "run_python", code="x = 41", session_id=session_id)
        await call(client, "write_file", session_id=session_id, path="a.txt", content=base64.b64encode(b"hi").decode(),
                   encoding="base64")  # fmt: skip
        exported = await call(client, "export_notebook", session_id=session_id)
        assert not exported.is_error, exported
        await call(client, "run_python", code="x += 1", session_id=session_id)
        refused = await call(client, "run_python", code="1")  # the fourth run this minute
        assert refused.is_error and "quota runs_per_minute reached" in str(refused.content)
        await call(client, "close_session", session_id=session_id)
    text = log.read_text()
    assert SECRET not in text and session_id not in text and "local" not in text.replace(identity_hash("local"), "")
    found = events(log)
    assert [e["event"] for e in found[:2]] == ["audit.file", "server"] and found[-1]["event"] == "server"
    calls = [(e["tool"], e["outcome"]) for e in found if e["event"] == "call"]
    assert calls == [
        ("run_python", "ok"), ("new_session", "ok"), ("run_python", "ok"), ("write_file", "ok"),
        ("export_notebook", "ok"), ("run_python", "ok"), ("run_python", "refused: quota runs_per_minute"),
        ("close_session", "ok"),
    ]  # fmt: skip
    runs = [e for e in found if e["event"] == "run"]
    assert len(runs) == 3 and all(e["identity"] == identity_hash("local") and e["status"] == "ok" for e in runs)
    assert runs[0]["code_bytes"] == len(CODE) and runs[0]["usage"]["cpu_user_s"] >= 0 and "code" not in runs[0]
    assert main(["audit", "verify", str(log)]) == 0 and "intact:" in capsys.readouterr().out
    lines = log.read_bytes().splitlines(keepends=True)
    for tamper, where in (("remove", 6), ("edit", 6), ("move", 6)):
        changed = list(lines)
        if tamper == "remove":
            del changed[5]
        elif tamper == "edit":
            changed[5] = (
                changed[5].replace(b'"outcome":"ok"', b'"outcome":"no"').replace(b'"status":"ok"', b'"status":"no"')
            )
        else:
            changed[5], changed[6] = changed[6], changed[5]
        broken = tmp_path / f"{tamper}.log"
        broken.write_bytes(b"".join(changed))
        first = verify([broken], None).breaks[0]
        assert first.line == where, (tamper, first)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A filesystem of 1 MiB of its own, for a log that fills it (mounted and removed here)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small filesystem needs root")
    place = tmp_path / "small"
    place.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(place)], check=True, timeout=30)
    try:
        yield place
    finally:
        subprocess.run(["umount", "-l", str(place)], check=False, timeout=30)


def fill(place: Path) -> Path:
    filler = place / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        return filler  # full
    finally:
        os.close(fd)


async def test_a_full_log_is_reported_and_with_required_calls_are_refused_until_it_can_be_written(
    small_disk: Path,
) -> None:
    log = small_disk / "audit.log"
    async with audited(log, required=True) as (service, client):
        first = await call(client, "run_python", code="1")
        assert first.structured_content is not None and first.structured_content["status"] == "ok", first
        rejected = metrics.REJECTED.labels(reason="audit_unavailable")._value.get()
        filler = fill(small_disk)
        refused = await call(client, "run_python", code="print('never')")
        assert refused.is_error and "the audit log cannot be written (No space left on device" in str(refused.content)
        with pytest.raises(Exception, match="records every call and refuses those it cannot record"):
            await service.run("token:other", "1")  # every way to run code, not only the tool
        assert metrics.REJECTED.labels(reason="audit_unavailable")._value.get() == rejected + 2
        health = service.figures()["audit"]
        assert health["ok"] is False and "No space left" in health["error"] and not service.accounting.audit.healthy
        filler.unlink()
        assert (await call(client, "run_python", code="2")).structured_content["status"] == "ok"
        assert service.figures()["audit"]["ok"] is True
    found = events(log)
    assert [e["event"] for e in found].count("audit.gap") == 1 and verify([log], None).intact


async def test_a_log_that_cannot_be_written_loses_lines_counts_them_and_says_so_not_required(small_disk: Path) -> None:
    log = small_disk / "audit.log"
    async with audited(log) as (service, client):
        failures = metrics.AUDIT_FAILURES._value.get()
        filler = fill(small_disk)
        for _ in range(30):  # the log's last page has room for a few more lines: then they are lost
            assert (await call(client, "run_python", code="1")).structured_content["status"] == "ok"
            if metrics.AUDIT_FAILURES._value.get() >= failures + 2:
                break
        assert metrics.AUDIT_FAILURES._value.get() >= failures + 2  # a call line and a run line at least
        assert metrics.AUDIT_WRITABLE._value.get() == 0 and service.figures()["audit"]["ok"] is False
        assert service.accounting.audit.healthy  # not required: the server goes on, and says so
        filler.unlink()
        await call(client, "run_python", code="2")
    gap = [e for e in events(log) if e["event"] == "audit.gap"]
    assert len(gap) == 1 and gap[0]["lost"] >= 2 and verify([log], None).intact


async def test_a_run_started_as_a_task_its_quota_refusal_and_tasks_cancel_each_have_their_line(tmp_path: Path) -> None:
    # A client that declares MCP Tasks has run_python started by the extension, not by the tool.
    log = tmp_path / "audit.log"
    quotas = {"identities": {"local": {"runs_per_minute": 1}}}
    async with audited(log, quotas, extensions=[TasksClient()]) as (_, client):
        code = "import time\ntime.sleep(60)"
        raw = await client.session.call_tool("run_python", {"code": code}, allow_claimed=True)
        task_id = raw.task_id  # type: ignore[union-attr]
        refused = await client.call_tool("run_python", {"code": "1"})  # the second run this minute
        assert refused.is_error and "quota runs_per_minute reached" in str(refused.content)
        await tasks_cancel(client.session, task_id)
    calls = [(e["tool"], e["outcome"], e.get("run")) for e in events(log) if e["event"] == "call"]
    assert calls == [
        ("run_python", "working", logged_id(task_id)),
        ("run_python", "refused: quota runs_per_minute", None),
        ("tasks/cancel", "ok", logged_id(task_id)),
    ]
    assert verify([log], None).intact
