"""A run's ``egress_bytes``: the bytes the proxy recorded for its grant, taken once as its notes are
(at the run's end). The real proxy: ``tests/engine/test_egress_usage.py``."""

from __future__ import annotations

from mcp_code_exec.egress.accounting import Accounting


def test_a_grants_bytes_are_taken_once_at_its_runs_end_and_a_grant_with_no_request_moved_none() -> None:
    books = Accounting(["data.example.org"])
    for up, down in ((100, 2000), (50, 300)):
        books.take({"ev": "access", "decision": "allowed", "identity": "abc", "grant": "r:1",
                    "host": "data.example.org", "up": up, "down": down})  # fmt: skip
    assert books.bytes_of("r:1") is None  # not ended yet
    assert books.notes("r:1") == [] and books.bytes_of("r:1") == 2450
    assert books.bytes_of("r:1") is None  # once
    assert books.notes("r:2") == [] and books.bytes_of("r:2") == 0
