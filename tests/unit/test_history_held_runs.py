"""The session runs the supervisor holds before writing their history (``supervisor/history_writer.py``): held
in order, and written at once when what is held reaches the history's cap (images included) or the
count bound, so that memory stays bounded while an agent's loop never lets the session go idle."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "images" / "python" / "agent"))
from mcpx_agent.supervisor.history_writer import MAX_HELD_RUNS, HeldRuns, held_run

MIB = 1 << 20


def done(stdout: str = "", result: str | None = None) -> dict[str, Any]:
    return {"status": "ok", "duration_ms": 1.0, "stdout": stdout, "stderr": "", "result": result, "error": None}


def test_runs_are_held_in_order_until_taken_and_none_are_held_after() -> None:
    held = HeldRuns()
    for k in range(5):
        assert not held.add(held_run(f"x = {k}".encode(), done(result=str(k)), [], 16 * MIB))
    taken = held.take()
    assert [run.entry["code"] for run in taken] == [f"x = {k}" for k in range(5)]
    assert [run.entry["result"] for run in taken] == [str(k) for k in range(5)]
    assert held.take() == [] and held.held_bytes == 0


def test_held_runs_are_written_at_once_when_their_outputs_reach_the_cap() -> None:
    held = HeldRuns()
    assert not held.add(held_run(b"print('a' * 400_000)", done(stdout="a" * 400_000), [], MIB))
    assert not held.add(held_run(b"print('b' * 400_000)", done(stdout="b" * 400_000), [], MIB))
    assert held.add(held_run(b"print('c' * 400_000)", done(stdout="c" * 400_000), [], MIB))


def test_an_images_bytes_count_towards_the_cap() -> None:
    held = HeldRuns()
    image = ("image", "image/png", b"\x89PNG" + bytes(MIB))
    run = held_run(b"plt.show()", done(), [image], MIB)
    assert run.images == [("png", image[2])] and run.entry["images"] == []  # named when written
    assert held.add(run)


def test_tiny_runs_are_written_once_the_count_bound_is_reached() -> None:
    held = HeldRuns()
    wanted = [held.add(held_run(b"x += 1", done(), [], 16 * MIB)) for _ in range(MAX_HELD_RUNS)]
    assert wanted == [False] * (MAX_HELD_RUNS - 1) + [True]


def test_a_runs_code_is_cut_to_half_the_cap_as_before() -> None:
    run = held_run(b"#" * 10_000, done(), [], 4096)
    assert run.entry["code"] == "#" * 2048
