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


KEY = "k" * 32


@pytest.mark.parametrize("how", ["emptied", "removed"])
def test_a_log_emptied_or_removed_while_no_server_ran_goes_on_from_the_line_kept_and_verify_finds_the_cut(
    log_path: Path, how: str
) -> None:
    """With a key nobody else can seal lines, but anyone who can write the file can empty it: a new
    chain begun at seq 0 would say nothing of what it held. It goes on from the line kept instead."""
    settings = AuditSettings(path=str(log_path), key=KEY)
    audit = AuditLog(settings)
    audit.open()
    write_some(audit, 3)
    audit.close()
    kept = audit.last
    assert kept is not None
    if how == "emptied":
        log_path.write_bytes(b"")
    else:
        log_path.unlink()
    again = AuditLog(settings)
    again.kept = kept
    again.open()
    again.close()
    first, said = (json.loads(line) for line in lines(log_path)[:2])
    assert first["event"] == "audit.file" and (first["seq"], first["prev"]) == (kept[0] + 1, kept[1])
    assert said["event"] == "audit.truncated" and said["kept_seq"] == kept[0] and said["after_seq"] == -1
    (found,) = [str(each) for each in verify([log_path], KEY.encode()).breaks]
    assert "none of its lines were left" in found


def test_a_rotation_a_crash_cut_short_goes_on_from_the_file_rotated_and_a_cut_behind_it_is_found(
    log_path: Path,
) -> None:
    """The server renamed the full file and died before making the next: at the restart the chain goes
    on from the rotated file's last line (nothing is missing); lines cut from that file are said."""
    settings = AuditSettings(path=str(log_path), key=KEY)
    audit = AuditLog(settings)
    audit.open()
    write_some(audit, 3)
    audit.close()
    kept = audit.last
    assert kept is not None
    rotated = log_path.with_name(log_path.name + ".000000000000")
    log_path.rename(rotated)  # where the crash left it: no file at the path
    again = AuditLog(settings)
    again.kept = kept
    again.open()
    again.close()
    both = verify([rotated, log_path], KEY.encode())
    assert both.intact and both.first_seq == 0 and json.loads(lines(log_path)[0])["file"] == 1
    log_path.unlink()
    rotated.write_bytes(b"".join(lines(rotated)[:-2]))  # its last lines cut, and the file after it removed
    third = AuditLog(settings)
    third.kept = again.last
    third.open()
    third.close()
    found = [str(each) for each in verify([rotated, log_path], KEY.encode()).breaks]
    assert len(found) == 1 and "lines were cut from the end of the log" in found[0]
