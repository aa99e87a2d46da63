"""Files kept from stateless runs: bounded in size, and one client's runs evict only its own."""

from __future__ import annotations

import pytest

from mcp_code_exec.errors import RunNotFound
from mcp_code_exec.service.run_files import RunFileStore


def test_past_the_budget_the_client_holding_most_loses_its_oldest_files_first() -> None:
    store = RunFileStore(keep_s=3600, max_total_bytes=10_000)
    store.put("r_victim", "victim", {"report.csv": (b"v" * 2000, 0.0)})
    for i in range(10):
        store.put(f"r_{i}", "flooder", {"blob": (b"x" * 3000, 0.0)})
    assert store.get("r_victim", "victim", "report.csv") == (b"v" * 2000, 0.0)
    with pytest.raises(RunNotFound):
        store.files("r_0", "flooder")
    assert [path for path, _, _ in store.files("r_9", "flooder")] == ["blob"]
    assert sum(size for _, _, size in store.listing("flooder")) + 2000 <= 10_000


def test_empty_files_with_long_names_weigh_what_they_hold() -> None:
    store = RunFileStore(keep_s=3600, max_total_bytes=1 << 20)
    name = "d" * 250 + "/" + "e" * 250 + "/" + "f" * 250 + "/"
    for i in range(100):  # each run leaves 100 empty files with 1 KB paths
        store.put(f"r_{i}", "me", {f"{name}{n:04}": (b"", 0.0) for n in range(100)})
    with pytest.raises(RunNotFound):
        store.files("r_0", "me")  # past the budget, although no file holds a byte
    assert len(store.files("r_99", "me")) == 100
    assert store._total <= 1 << 20


def test_a_clients_files_are_its_own() -> None:
    store = RunFileStore(keep_s=3600, max_total_bytes=100)
    store.put("r_1", "alice", {"a.txt": (b"a", 0.0)})
    with pytest.raises(RunNotFound):
        store.get("r_1", "bob", "a.txt")
