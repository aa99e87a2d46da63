"""``mcp-code-exec usage``: the audit log's run lines added up per identity over a time range, as a
table or CSV, with the configuration's identities named where the log holds their hashes."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import pytest

from mcp_code_exec.commands.cli import main
from mcp_code_exec.config.accounting import AuditSettings
from mcp_code_exec.ledger.audit import AuditLog
from mcp_code_exec.ledger.report import parse_time, spent

DAY = 86400.0
T0 = 1_749_999_600.0


def usage(cpu: float, memory: int = 1 << 20) -> dict[str, float | int]:
    return {
        "wall_s": 1.0,
        "cpu_user_s": cpu,
        "cpu_system_s": 0.5,
        "peak_memory_bytes": memory,
        "data_written_bytes": 10,
    }


@pytest.fixture
def log(tmp_path: Path) -> Path:
    path = tmp_path / "audit.log"
    clock = {"now": T0}
    audit = AuditLog(AuditSettings(path=str(path)), clock=lambda: clock["now"])
    audit.open()
    for day, who, cpu in ((0, "token:alice", 2.0), (0, "token:alice", 1.0), (3, "token:alice", 4.0), (3, "local", 9.0)):
        clock["now"] = T0 + day * DAY
        audit.record("run", identity=who, run="r_x", status="ok", usage=usage(cpu, int(cpu) << 20))
    audit.record("call", tool="run_python", identity="local", outcome="refused: quota runs_per_minute reached")
    audit.close()
    return path


def test_runs_are_added_up_per_identity_within_the_range(log: Path) -> None:
    every = spent([log])
    alice = next(each for who, each in every.items() if len(every) == 2 and each.totals.runs == 3)
    assert alice.totals.cpu_user_s == 7.0 and alice.totals.cpu_system_s == 1.5
    assert alice.totals.peak_memory_bytes == 4 << 20 and alice.totals.data_written_bytes == 30
    later = spent([log], since=T0 + DAY)
    assert sorted(each.totals.runs for each in later.values()) == [1, 1]
    assert sum(each.refused for each in later.values()) == 1
    assert spent([log], until=T0 + 1) and all(each.totals.runs == 2 for each in spent([log], until=T0 + 1).values())


def test_usage_prints_csv_with_configured_identities_named(
    log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "config.toml"
    config.write_text('[http.tokens]\nalice = "a-token-long-enough-to-be-one"\n')
    assert main(["usage", "--config", str(config), "--csv", str(log)]) == 0
    table = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    assert table[0][:4] == ["identity", "runs", "refused", "wall_s"]
    assert table[1][:3] == ["local", "1", "1"] and table[2][:3] == ["token:alice", "3", "0"]  # most CPU first
    assert main(["usage", "--config", str(config), "--since", "2025-06-16", str(log)]) == 0
    text = capsys.readouterr().out.splitlines()
    assert text[0].startswith("identity") and len(text) == 3
    assert main(["usage", "--since", "yesterday-ish", str(log)]) == 2


def test_times_are_iso_or_a_span_back_from_now() -> None:
    assert parse_time("7d", 1000 * DAY) == 993 * DAY and parse_time("90m", 10_000.0) == 4600.0
    assert parse_time("2025-06-15T15:00:00Z", 0) == T0 == parse_time("2025-06-15T15:00:00", 0)
    with pytest.raises(ValueError, match="not a time"):
        parse_time("soon", 0)
