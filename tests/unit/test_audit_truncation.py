"""Lines cut from the audit log's end while no server ran: the last line a server kept as written
(away from the file, ``AuditLog.kept``) shows it at the next start, and ``audit verify`` finds it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mcp_code_exec.config.accounting import AuditSettings
from mcp_code_exec.ledger.audit import AuditLog
from mcp_code_exec.ledger.chain import verify


@pytest.fixture
def log_path(tmp_path: Path) -> Path:
    return tmp_path / "audit" / "audit.log"


def write_some(audit: AuditLog, count: int) -> None:
    for n in range(count):
        audit.record("call", tool="run_python", identity="token:alice", outcome="ok", duration_ms=n)


def lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def breaks(path: Path) -> list[str]:
    return [str(found) for found in verify([path], None).breaks]


@pytest.mark.parametrize("cut", [2, 5], ids=["some lines", "all but the file's first"])
def test_lines_cut_from_the_end_before_a_restart_are_said_where_the_chain_goes_on_and_found_by_verify(
    log_path: Path, cut: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Whole lines cut from the end leave a file that verifies on its own: the last line the server
    kept as written (away from the file) shows it at the next start."""
    audit = AuditLog(AuditSettings(path=str(log_path)))
    audit.open()
    write_some(audit, 4)
    audit.close()
    kept = audit.last
    assert kept is not None and kept[0] == 6  # the file's line, the start, four runs, the stop
    log_path.write_bytes(b"".join(lines(log_path)[:-cut]))
    assert verify([log_path], None).intact  # cut at a line's end: the chain alone cannot tell
    again = AuditLog(AuditSettings(path=str(log_path)))
    again.kept = kept
    again.open()
    again.close()
    said = json.loads(lines(log_path)[7 - cut])
    assert said["event"] == "audit.truncated" and said["kept_seq"] == 6 and said["after_seq"] == 6 - cut
    (found,) = breaks(log_path)
    assert "lines were cut from the end of the log before the server started" in found
    assert any("lines were cut" in r.getMessage() for r in caplog.records)


def test_a_line_put_in_place_of_the_last_one_kept_is_found_and_a_log_that_went_on_is_not(log_path: Path) -> None:
    audit = AuditLog(AuditSettings(path=str(log_path)))
    audit.open()
    write_some(audit, 1)
    audit.close()
    kept = audit.last
    assert kept is not None
    behind = AuditLog(AuditSettings(path=str(log_path)))
    behind.kept = (kept[0] - 1, "0" * 64)  # a head kept before the last lines: the file went on past it
    behind.open()
    behind.close()
    assert verify([log_path], None).intact
    other = AuditLog(AuditSettings(path=str(log_path)))
    other.kept = (behind.last[0] if behind.last else 0, "f" * 64)  # another line at that seq than the one kept
    other.open()
    other.close()
    assert any("lines were cut from the end" in found for found in breaks(log_path))
