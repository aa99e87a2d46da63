"""Files kept from stateless runs: bounded in size, and one client's runs evict only its own."""

from __future__ import annotations

import pytest

from mcp_code_exec.errors import RunNotFound
from mcp_code_exec.service.run_files import RunFileStore


def test_past_the_budget_the_client_holding_most_loses_its_oldest_files_first() -> None:
    store = RunFileStore(keep_s=3600, max_total_bytes=100)
    store.put("r_victim", "victim", {"report.csv": (b"v" * 20, 0.0)})
    for i in range(10):
        store.put(f"r_{i}", "flooder", {"blob": (b"x" * 30, 0.0)})
    assert store.get("r_victim", "victim", "report.csv") == (b"v" * 20, 0.0)
    with pytest.raises(RunNotFound):
        store.files("r_0", "flooder")
    assert [path for path, _, _ in store.files("r_9", "flooder")] == ["blob"]
    assert sum(size for _, _, size in store.listing("flooder")) + 20 <= 100


def test_a_clients_files_are_its_own() -> None:
    store = RunFileStore(keep_s=3600, max_total_bytes=100)
    store.put("r_1", "alice", {"a.txt": (b"a", 0.0)})
    with pytest.raises(RunNotFound):
        store.get("r_1", "bob", "a.txt")
