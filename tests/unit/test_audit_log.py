"""The audit log's file and chain, without a server: lines that verify, every kind of tampering
found where it was done, rotation that carries the chain on, a log that cannot be written said and
(with ``required``) refused, and what a line may never hold. On a real server:
``tests/engine/test_audit.py``."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr

from mcp_code_exec.commands.cli import main
from mcp_code_exec.config.accounting import AuditSettings
from mcp_code_exec.errors import AuditUnavailable
from mcp_code_exec.ledger.audit import AuditLog
from mcp_code_exec.ledger.audit_logger import attach, detach
from mcp_code_exec.ledger.chain import ZERO, iso, seal, unseal, verify
from mcp_code_exec.observability import metrics
from mcp_code_exec.observability.logs import identity_hash, logged_id

CODE = "secret_value = 'do-not-log-me'\nprint(secret_value)"


@pytest.fixture
def log_path(tmp_path: Path) -> Path:
    return tmp_path / "audit" / "audit.log"


@pytest.fixture
def opened(log_path: Path) -> Iterator[AuditLog]:
    audit = AuditLog(AuditSettings(path=str(log_path)))
    audit.open()
    yield audit
    audit.close()


def write_some(audit: AuditLog, count: int) -> None:
    for n in range(count):
        audit.record("run", identity="token:alice", session="s_abcdefghijkl", run=f"r_{n:012d}", code=CODE,
                     status="ok", usage={"wall_s": 0.01 * n, "cpu_user_s": 0.005})  # fmt: skip


def lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def breaks(path: Path, key: bytes | None = None) -> list[str]:
    return [str(found) for found in verify([path], key).breaks]


def test_a_written_log_verifies_and_its_lines_hold_hashes_not_secrets(opened: AuditLog, log_path: Path) -> None:
    write_some(opened, 5)
    verdict = verify([log_path], None)
    assert verdict.intact and verdict.lines == 7 and verdict.first_seq == 0 and verdict.last_seq == 6
    text = log_path.read_text()
    assert "do-not-log-me" not in text and "token:alice" not in text and "s_abcdefghijkl" not in text
    first_run = json.loads(lines(log_path)[2])
    assert first_run["identity"] == identity_hash("token:alice")
    assert first_run["session"] == logged_id("s_abcdefghijkl") and first_run["code_bytes"] == len(CODE)
    assert len(first_run["code_sha256"]) == 64 and "code" not in first_run
    assert [json.loads(line)["event"] for line in lines(log_path)[:2]] == ["audit.file", "server"]
    assert json.loads(lines(log_path)[0])["prev"] == ZERO
    assert oct(log_path.stat().st_mode & 0o777) == "0o600"


def test_the_code_itself_and_names_are_written_only_where_configured(log_path: Path) -> None:
    audit = AuditLog(AuditSettings(path=str(log_path), include_code=True, identities="named"))
    audit.open()
    write_some(audit, 1)
    audit.close()
    run = json.loads(lines(log_path)[2])
    assert run["code"] == CODE and run["identity"] == "token:alice"


@pytest.mark.parametrize(
    ("tamper", "where", "what"),
    [
        ("edit", 4, "changed after it was written"),
        ("edit_and_rehash", 5, "is not the one it was chained to"),
        ("remove", 4, "seq jumps from 2 to 4: 1 line(s) missing before it, or moved"),
        ("swap", 4, "seq jumps from 2 to 4"),
        ("truncate", 4, "not a sealed audit line"),
    ],
)
def test_tampering_with_a_line_is_found_where_it_was_done(
    opened: AuditLog, log_path: Path, tamper: str, where: int, what: str
) -> None:
    write_some(opened, 6)
    content = lines(log_path)
    line = content[3]  # seq 3, on line 4 of the file
    if tamper == "edit":
        content[3] = line.replace(b'"status":"ok"', b'"status":"no"')
    elif tamper == "edit_and_rehash":  # one who can write the file but holds no key can do this
        _, _, body = unseal(line) or (b"", "", {})
        forged = {**body, "status": "no"}
        forged.pop("hash", None)
        from mcp_code_exec.ledger.chain import seal

        content[3], _ = seal(forged, None)
    elif tamper == "remove":
        del content[3]
    elif tamper == "swap":
        content[3], content[4] = content[4], content[3]
    elif tamper == "truncate":
        content[3] = line[: len(line) // 2] + b"\n"
    log_path.write_bytes(b"".join(content))
    found = breaks(log_path)
    assert found and found[0].startswith(f"{log_path}:{where}: ") and what in found[0], found
    if tamper == "swap":
        assert found[1] == f"{log_path}:5: out of order: seq 3 after seq 4"


def test_lines_cut_from_the_start_of_a_file_are_found(opened: AuditLog, log_path: Path) -> None:
    """With a key, nobody without it can forge lines, but anyone who can write the file can cut its
    first lines: the rest still links up, so only the file's missing first line shows it."""
    write_some(opened, 6)
    content = lines(log_path)
    log_path.write_bytes(b"".join(content[3:]))
    found = breaks(log_path)
    assert found == [
        f"{log_path}:1: seq 3: the file does not begin with its audit.file line: lines were cut from its start"
    ]


def test_with_a_key_a_chain_made_again_without_it_does_not_verify(log_path: Path) -> None:
    audit = AuditLog(AuditSettings(path=str(log_path), key=SecretStr("k" * 32)))
    audit.open()
    write_some(audit, 3)
    audit.close()
    assert breaks(log_path, b"k" * 32) == []
    assert "chained with a key" in breaks(log_path)[0]
    assert "changed after it was written" in breaks(log_path, b"another key")[0]


def test_rotation_carries_the_chain_on_and_the_files_verify_together_in_any_order(log_path: Path) -> None:
    audit = AuditLog(AuditSettings(path=str(log_path), max_mb=1))
    audit.open()
    audit.settings = audit.settings.model_copy(update={"max_mb": 0})  # every line past the first rotates: 1 byte
    for n in range(4):
        audit.record("call", tool="new_session", identity="local", outcome="ok", n=n)
    audit.close()
    files = sorted(log_path.parent.iterdir())
    assert len(files) == 6  # the server's start in the first, then four calls and its stop: a file each
    verdict = verify(list(reversed(files)), None)
    assert verdict.intact and verdict.lines == 12 and verdict.last_seq == 11, verdict.breaks
    os.unlink(files[2])  # a whole file gone from the middle
    assert "missing before it" in str(verify(files[:2] + files[3:], None).breaks[0])


def test_a_restarted_log_goes_on_where_it_ended(log_path: Path) -> None:
    for _ in range(2):
        audit = AuditLog(AuditSettings(path=str(log_path)))
        audit.open()
        write_some(audit, 2)
        audit.close()
    assert verify([log_path], None).intact and verify([log_path], None).lines == 9


@pytest.mark.parametrize(
    "damage", [b'{"v":1,"seq":11,"ev', b"garbage\n\nmore garbage\n"], ids=["cut short", "lines appended"]
)
def test_a_damaged_end_is_kept_reported_by_verify_and_the_chain_goes_on_from_the_last_sealed_line(
    log_path: Path, damage: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """A server must not begin a new chain after a damaged end (whoever can write the file could then
    start the record afresh): the damage stays where it is, and is found there."""
    audit = AuditLog(AuditSettings(path=str(log_path)))
    audit.open()
    write_some(audit, 2)
    audit.close()
    with open(log_path, "ab") as handle:
        handle.write(damage)
    audit = AuditLog(AuditSettings(path=str(log_path)))
    audit.open()
    audit.record("call", tool="new_session", identity="local", outcome="ok")
    audit.close()
    assert [p.name for p in log_path.parent.iterdir()] == [log_path.name]  # nothing set aside
    found = verify([log_path], None)
    bad = damage.count(b"\n") or 1
    # the file's line, the server's start, two calls, its stop: then the damage, and only it is a break
    assert [b.line for b in found.breaks] == list(range(6, 6 + bad)), found.breaks
    said = json.loads(lines(log_path)[5 + bad])
    assert said["event"] == "audit.damaged" and said["lines"] == bad and said["after_seq"] == 4 and said["seq"] == 5
    assert json.loads(lines(log_path)[6 + bad])["seq"] == 6  # the chain went on
    assert any("not sealed audit lines" in r.getMessage() for r in caplog.records)


def test_with_a_key_a_forged_last_line_is_damage_not_where_a_restarted_chain_goes_on(log_path: Path) -> None:
    key = SecretStr("k" * 32)
    audit = AuditLog(AuditSettings(path=str(log_path), key=key))
    audit.open()
    write_some(audit, 2)
    audit.close()
    forged = seal({"v": 1, "seq": 10**12, "time": "x", "event": "call", "prev": ZERO}, b"not the key")[0]
    with open(log_path, "ab") as handle:
        handle.write(forged)
    audit = AuditLog(AuditSettings(path=str(log_path), key=key))
    audit.open()
    audit.record("call", tool="new_session", identity="local", outcome="ok")
    audit.close()
    said = json.loads(lines(log_path)[6])
    assert said["event"] == "audit.damaged" and said["after_seq"] == 4 and said["seq"] == 5
    assert json.loads(lines(log_path)[-1])["seq"] < 10  # numbered on from the last line the key sealed


@pytest.mark.parametrize("how", ["removed", "replaced by a copy of its start"])
def test_a_file_removed_or_replaced_while_the_server_writes_is_noticed_and_found_by_verify(
    log_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    audit = AuditLog(AuditSettings(path=str(log_path)))
    audit.open()
    write_some(audit, 2)
    if how == "removed":
        log_path.unlink()
    else:
        start = lines(log_path)[:2]
        log_path.rename(log_path.parent / "moved-away")
        log_path.write_bytes(b"".join(start))
        assert verify([log_path], None).intact  # what a reader of the path alone saw, so far
    audit.record("call", tool="new_session", identity="local", outcome="ok")
    audit.close()
    said = [json.loads(line) for line in lines(log_path)]
    assert [each["event"] for each in said[:2]] == ["audit.file", "audit.replaced"]
    assert said[1]["after_seq"] == said[0]["seq"] - 1  # the chain went on from the head the server held
    found = verify([log_path], None)
    assert [b.line for b in found.breaks] == [2] and "removed or replaced" in found.breaks[0].what
    assert any("removed or replaced" in r.getMessage() for r in caplog.records)


def test_a_file_with_no_sealed_line_to_go_on_from_is_not_begun_anew(log_path: Path) -> None:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.write_bytes(b"not an audit log\n")
    audit = AuditLog(AuditSettings(path=str(log_path)))
    audit.open()
    assert audit.failing is not None and "holds no sealed audit line" in audit.failing
    assert not audit.record("call", tool="new_session", identity="local", outcome="ok")
    assert log_path.read_bytes() == b"not an audit log\n"


def test_a_log_that_cannot_be_written_is_reported_refused_when_required_and_its_gap_said_after(log_path: Path) -> None:
    audit = AuditLog(AuditSettings(path=str(log_path), required=True))
    audit.open()
    failures = metrics.AUDIT_FAILURES._value.get()
    full = os.open("/dev/full", os.O_WRONLY)  # every write: ENOSPC
    assert audit._fd is not None
    os.dup2(full, audit._fd)
    os.close(full)
    assert audit.record("call", tool="new_session") is False
    status = audit.status()
    assert status is not None and status["ok"] is False and status["error"] == "No space left on device"
    assert status["lost"] == 1 and metrics.AUDIT_FAILURES._value.get() == failures + 1
    assert metrics.AUDIT_WRITABLE._value.get() == 0
    log_path.rename(log_path.with_suffix(".aside"))
    log_path.mkdir()  # nor can the file be opened again
    with pytest.raises(AuditUnavailable, match=r"cannot be written \(Is a directory\).*refuses"):
        audit.require()
    log_path.rmdir()
    log_path.with_suffix(".aside").rename(log_path)
    audit.require()  # written again: a gap line first
    audit.close()
    gap = [json.loads(line) for line in lines(log_path) if b'"audit.gap"' in line]
    assert len(gap) == 1 and gap[0]["lost"] == 1 and audit.status() == {"ok": True, "seq": 3}  # refusals lose no line
    assert verify([log_path], None).intact and metrics.AUDIT_WRITABLE._value.get() == 1


def test_a_log_another_server_holds_is_reported_not_written(opened: AuditLog, log_path: Path) -> None:
    second = AuditLog(AuditSettings(path=str(log_path), required=True))
    second.open()
    assert second.status() is not None and second.status()["ok"] is False  # type: ignore[index]
    assert "another server writes this audit log" in str(second.status())
    with pytest.raises(AuditUnavailable):
        second.require()
    assert verify([log_path], None).intact


def test_not_required_a_failing_log_refuses_nothing(log_path: Path) -> None:
    log_path.parent.mkdir()
    log_path.parent.chmod(0o500)
    try:
        audit = AuditLog(AuditSettings(path=str(log_path)))
        audit.open()
        if os.geteuid() != 0:
            assert audit.status() is not None and audit.status()["ok"] is False  # type: ignore[index]
        audit.require()
    finally:
        log_path.parent.chmod(0o700)


def test_what_the_audit_logger_says_with_fields_is_recorded_with_its_identity_hashed(
    opened: AuditLog, log_path: Path
) -> None:
    attach(opened)
    try:
        logging.getLogger("mcp_code_exec.audit").info(
            "oauth sign-in", extra={"fields": {"event": "oauth_sign_in", "identity": "oauth:https://idp sub=1"}}
        )
        logging.getLogger("mcp_code_exec.audit").info("code_mode identity=x", extra={"fields": {"identity": "x"}})
    finally:
        detach(opened)
    events = [json.loads(line) for line in lines(log_path)[2:]]
    assert [e["event"] for e in events] == ["oauth_sign_in", "code_mode"]
    assert events[0]["identity"] == identity_hash("oauth:https://idp sub=1")


def test_audit_verify_says_intact_or_where_it_breaks(
    opened: AuditLog, log_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_some(opened, 3)
    assert main(["audit", "verify", str(log_path)]) == 0
    assert "intact: 5 lines, seq 0 to 4; head " in capsys.readouterr().out
    content = lines(log_path)
    del content[2]
    log_path.write_bytes(b"".join(content))
    assert main(["audit", "verify", str(log_path)]) == 1
    out = capsys.readouterr().out
    assert f"BROKEN {log_path}:3: seq jumps from 1 to 3: 1 line(s) missing before it, or moved" in out


def test_in_the_server_lines_are_written_and_synced_off_the_callers_thread_in_their_order(
    log_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller is the event loop: a slow disk or a sync must not hold it. The lines still go in
    the order they were recorded, each with the time it was recorded at, and all are in at close."""
    synced_by: list[str] = []
    fsync = os.fsync

    def watched(fd: int) -> None:
        synced_by.append(threading.current_thread().name)
        fsync(fd)

    clock = [1_750_000_000.0]
    audit = AuditLog(AuditSettings(path=str(log_path), fsync=True), clock=lambda: clock[0])
    audit.open(background=True)
    monkeypatch.setattr(os, "fsync", watched)
    for n in range(50):
        clock[0] += 1
        audit.record("call", tool="new_session", identity="local", outcome="ok", n=n)
    audit.close()
    assert synced_by and threading.current_thread().name not in synced_by[:-1], synced_by  # the last: close's own
    found = [json.loads(line) for line in lines(log_path)]
    calls = [line for line in found if line["event"] == "call"]
    assert [line["n"] for line in calls] == list(range(50)) and [line["seq"] for line in found] == list(range(53))
    assert calls[0]["time"] == iso(1_750_000_001.0) and verify([log_path], None).intact
