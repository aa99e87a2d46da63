"""What the agent holds while it rewrites or exports a session's history, which the session can
rewrite itself: the sandbox's processes share one memory limit (under gVisor, going past it ends
the sandbox, the session's variables with it), so the supervisor's history writer and its export
hold the history as bytes and bounded lists, never a parsed object per line of it. Measured with
``tracemalloc`` (Python's own allocations) in this process, on the agent's own code."""

from __future__ import annotations

import base64
import json
import math
import os
import sys
import tracemalloc
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "images" / "python" / "agent"))
from mcpx_agent.supervisor import files, history_writer, notebook, notebook_writer, transfer

MIB = 1 << 20
CAP = 4 * MIB  # a quarter of the default: the tier stays fast, the proportions hold


@pytest.fixture
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """``/mnt/data`` in a temporary directory, acted on as this process's user."""
    monkeypatch.setattr(files, "ROOT", str(tmp_path))
    monkeypatch.setattr(history_writer, "as_sandbox_user", nullcontext)
    monkeypatch.setattr(notebook, "as_sandbox_user", nullcontext)
    (tmp_path / ".mcpx" / "history").mkdir(parents=True)
    yield tmp_path


def tiny_run(n: int) -> bytes:
    """A run line as the history writer writes it for ``print(1)``."""
    entry = {"kind": "run", "n": n, "at": 1.0, "code": "print(1)", "status": "ok", "duration_ms": 1.0,
             "stdout": "1\n", "stderr": "", "result": None, "displays": [], "images": [], "error": None,
             "tables": []}  # fmt: skip
    return json.dumps(entry).encode() + b"\n"


def peak_mib(action: Any) -> float:
    tracemalloc.start()
    try:
        action()
        return tracemalloc.get_traced_memory()[1] / MIB
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("kind", ["its own tiny runs", "half a million forged lines"])
def test_the_history_writer_rewrites_a_history_at_its_cap_holding_little_more_than_its_bytes(
    data_dir: Path, kind: str
) -> None:
    """A history at its cap of 22,000 tiny runs (an agent's loop of ``print(1)``), or half a million
    one-line runs the session wrote itself: the next write rewrites it within the cap, holding no
    parsed line but the one at hand (a parsed line is about a kilobyte of objects: at the default
    16 MiB cap the writer held 190 MiB, and the sandbox's 256 MiB went with it)."""
    path = data_dir / ".mcpx" / "history" / "runs.jsonl"
    if kind == "its own tiny runs":
        path.write_bytes(b"".join(tiny_run(n) for n in range(1, CAP // len(tiny_run(99_999)))))
    else:
        path.write_bytes(b'{"kind":"run"}\n' * 500_000)
    writer = history_writer.HistoryWriter()
    done = {"status": "ok", "duration_ms": 1.0, "stdout": "x" * 300, "stderr": "", "result": None, "error": None}
    writer.hold(b"print('x' * 300)", done, [], CAP)
    peak = peak_mib(writer.flush)
    lines = path.read_bytes().splitlines()
    assert path.stat().st_size <= CAP and len(lines) > 1000, path.stat().st_size
    assert json.loads(lines[-1])["stdout"] == "x" * 300  # the new run is there, whole
    assert peak < 5 * CAP / MIB, f"the writer held {peak:.0f} MiB to rewrite a history of {CAP // MIB} MiB"


def test_the_export_of_a_hostile_history_is_bounded_valid_and_says_what_it_left_out(data_dir: Path) -> None:
    """Half a million forged lines, then runs naming one figure a thousand times each and values nbformat
    refuses (a negative count, NaN times, a lone surrogate): the export reads the newest megabytes,
    keeps at most ``MAX_IMAGES`` images named, counts every copy of a figure against its budget,
    writes a notebook nbformat validates, and says what it left out."""
    nbformat = pytest.importorskip("nbformat")
    folder = data_dir / ".mcpx" / "history"
    (folder / "img-1-0.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 100_000)
    named = {"kind": "run", "n": -5, "at": math.nan, "duration_ms": math.inf, "code": "x\ud800",
             "stdout": "out", "result": "1", "images": [{"file": "img-1-0.png"}] * 1000}  # fmt: skip
    with (folder / "runs.jsonl").open("wb") as out:
        out.write(b'{"kind":"run"}\n' * 500_000)
        out.write((json.dumps(named).encode() + b"\n") * 400)
    read_max = CAP + MIB
    answer: dict[str, Any] = {}
    peak = peak_mib(lambda: answer.update(notebook.export_notebook(read_max)))
    assert answer["error"] is None, answer
    written = (data_dir / ".mcpx" / transfer.EXPORT_TEMP).read_text()
    nbformat.validate(json.loads(written))
    cells = json.loads(written)["cells"]
    said = cells[0]["source"]
    assert "left out of this export" in said and "images past the export's size were left out" in said, said
    shown = sum(1 for cell in cells for output in cell.get("outputs", []) if "image/png" in output.get("data", {}))
    assert shown * 100_000 <= read_max and answer["size"] < 2 * read_max
    assert peak < 2, f"the export held {peak:.1f} MiB of a history of {read_max // MIB} MiB read"


def test_a_run_as_long_as_the_bound_and_a_figure_as_large_are_written_a_slice_at_a_time(data_dir: Path) -> None:
    """One run of 2 MiB of output and a traceback of half a million lines, and a figure of 4 MiB:
    the export holds that one run's line and its parse (about three times the line), never the figure
    or the notebook (a cell built whole held the figure's base64 and every copy the encoder made of it)."""
    nbformat = pytest.importorskip("nbformat")
    folder = data_dir / ".mcpx" / "history"
    figure = b"\x89PNG\r\n\x1a\n" + os.urandom(4 * MIB)
    (folder / "img-1-0.png").write_bytes(figure)
    run = {"kind": "run", "n": 1, "code": "draw()", "stdout": "é" * (2 * MIB), "images": [{"file": "img-1-0.png"}],
           "error": {"type": "E", "message": "m", "traceback": "\n" * 500_000}}  # fmt: skip
    line = json.dumps(run, ensure_ascii=False).encode() + b"\n"
    (folder / "runs.jsonl").write_bytes(line)
    answer: dict[str, Any] = {}
    peak = peak_mib(lambda: answer.update(notebook.export_notebook(CAP + MIB)))
    assert answer["error"] is None, answer
    written = json.loads((data_dir / ".mcpx" / transfer.EXPORT_TEMP).read_text())
    nbformat.validate(written)
    [cell] = written["cells"]
    outputs = {output["output_type"]: output for output in cell["outputs"]}
    assert outputs["stream"]["text"] == run["stdout"]
    assert base64.b64decode(outputs["display_data"]["data"]["image/png"]) == figure
    assert len(outputs["error"]["traceback"]) == notebook_writer.MAX_TRACEBACK_LINES + 1
    assert peak < 3.5 * len(line) / MIB, f"the export held {peak:.1f} MiB for a run of {len(line) / MIB:.1f} MiB"
