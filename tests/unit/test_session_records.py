"""A session's snapshot and history files, read as the hostile bytes they may be; and the session
messages' shapes on both halves of the protocol.

The agent's snapshot format (``worker/snapshot_format.py``) round-trips a namespace record by record; a file
cut anywhere, or forged, loads what it can and says why, never raising. The history reader and the
snapshot manifest's reader take any bytes. What the worker answers passes the supervisor's check and
what the supervisor sends passes the host's parser.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mcp_code_exec.protocol import messages as wire

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "images" / "python" / "agent"))
from mcpx_agent import history_format
from mcpx_agent import protocol as agent
from mcpx_agent.supervisor import session_requests, worker_requests
from mcpx_agent.worker import namespace as agent_namespace
from mcpx_agent.worker import snapshot_format

pytest.importorskip("cloudpickle")


@pytest.fixture
def snapshot_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setattr(snapshot_format, "DIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    yield tmp_path


def namespace() -> dict[str, Any]:
    return {
        "numbers": list(range(1000)),
        "blob": bytearray(b"x" * 200_000),  # out of band
        "square": lambda v: v * v,
        "js": json,
        "lock": threading.Lock(),
        "gen": (i for i in range(3)),
    }


def take(ns: dict[str, Any], max_bytes: int = 1 << 30) -> dict[str, Any]:
    return snapshot_format.write(
        ns, list(ns), max_bytes, {"cwd": os.getcwd(), "python": snapshot_format.python_version()}
    )


def test_a_namespace_round_trips_and_what_cannot_be_pickled_is_named(snapshot_dir: Path) -> None:
    outcome = take(namespace())
    assert outcome["over"] is False and outcome["skipped"] == ["lock (lock)", "gen (generator)"]
    loaded: dict[str, Any] = {}
    reply = agent_namespace.restore(loaded)
    assert set(loaded) == {"numbers", "blob", "square", "js"}
    assert loaded["square"](7) == 49 and loaded["js"] is json and loaded["blob"] == bytearray(b"x" * 200_000)
    assert (
        reply["outcome"] == "restored"
        and reply["restored"] == 4
        and "not kept: lock (lock), gen (generator)" in reply["note"]
    )
    assert json.loads((snapshot_dir / snapshot_format.MANIFEST).read_bytes())["names"] == [
        "numbers",
        "blob",
        "square",
        "js",
    ]


def test_a_namespace_over_the_cap_leaves_the_last_snapshot_and_names_the_largest(snapshot_dir: Path) -> None:
    take({"small": 1})
    before = (snapshot_dir / snapshot_format.FILE).read_bytes()
    outcome = take(namespace(), max_bytes=100_000)
    assert outcome["over"] is True and outcome["largest"][0].startswith("blob (0.2 MB)")
    assert (snapshot_dir / snapshot_format.FILE).read_bytes() == before
    assert [name for name in os.listdir(snapshot_dir) if ".tmp-" in name] == []


def test_no_snapshot_is_found_and_said(snapshot_dir: Path) -> None:
    reply = agent_namespace.restore({})
    assert reply["outcome"] == "none" and reply["restored"] == 0 and "no snapshot" in reply["note"]


def test_a_snapshot_cut_anywhere_loads_what_came_before_and_says_so(snapshot_dir: Path) -> None:
    take({"a": 1, "b": bytearray(5000), "c": "three"})
    whole = (snapshot_dir / snapshot_format.FILE).read_bytes()
    for cut in range(0, len(whole) - 1, 97):
        (snapshot_dir / snapshot_format.FILE).write_bytes(whole[:cut])
        loaded: dict[str, Any] = {}
        reply = agent_namespace.restore(loaded)
        assert reply["restored"] == len(loaded) <= 3
        assert reply["outcome"] == ("restored" if loaded else "failed"), (cut, reply)  # nothing back: failed
        assert "damaged" in reply["note"] or "truncated" in reply["note"], (cut, reply)


@pytest.mark.parametrize(
    "forged",
    [
        b"",
        b"\x80\x05garbage" * 50,
        snapshot_format.MAGIC + b"REC1" + b"\xff" * 40,
        snapshot_format.MAGIC + snapshot_format.RECORD.pack(b"REC1", 1, 1 << 62, 0) + b"a",
        snapshot_format.MAGIC + snapshot_format.RECORD.pack(b"REC1", 1, 1, 1 << 20) + b"a",
        snapshot_format.MAGIC + snapshot_format.TRAILER.pack(snapshot_format.TRAILER_TAG, 1 << 63),
        snapshot_format.MAGIC
        + snapshot_format.MANIFEST_HEAD.pack(b"MANI", 2)
        + b"[]"
        + snapshot_format.TRAILER.pack(snapshot_format.TRAILER_TAG, 16),
    ],
)
def test_a_forged_snapshot_is_reported_and_nothing_raises(snapshot_dir: Path, forged: bytes) -> None:
    (snapshot_dir / snapshot_format.FILE).write_bytes(forged)
    loaded: dict[str, Any] = {}
    reply = agent_namespace.restore(loaded)
    assert loaded == {} and reply["restored"] == 0
    assert "damaged" in reply["note"] or "truncated" in reply["note"] or "not a snapshot" in reply["note"], reply


def test_a_record_that_fails_to_load_is_skipped_and_named(snapshot_dir: Path) -> None:
    class Boom:
        def __reduce__(self) -> tuple[Any, ...]:
            return (int, ("not a number",))

    take({"boom": Boom(), "fine": 1})
    loaded: dict[str, Any] = {}
    reply = agent_namespace.restore(loaded)
    assert loaded == {"fine": 1} and any(
        item.startswith("boom (could not be loaded: ValueError") for item in reply["skipped"]
    )


@pytest.mark.parametrize(
    "raw",
    [b"[" * 5000, b'{"format": 1, "names": "x", "skipped": [1, {}], "taken_at": true, "cwd": 5}', b"\xff\xfe", b"{}"],
)
def test_the_manifest_reader_takes_any_bytes(raw: bytes) -> None:
    try:
        manifest = snapshot_format.read_manifest(raw)
    except snapshot_format.Damaged:
        return
    assert manifest == {"taken_at": None, "names": [], "skipped": [], "cwd": None, "python": ""}


def test_the_history_reader_keeps_only_well_formed_runs() -> None:
    good = {"kind": "run", "n": 1, "code": "1", "status": "ok", "images": [{"file": "img-1-0.png"}]}
    hostile = [
        b"[" * 100,
        b'{"kind": "run", "images": [{"file": "../../etc/passwd"}], "status": "pwned", "error": {"type": 5}}',
        b"not json",
        json.dumps({"kind": "header", "runs_dropped": "many"}).encode(),
        json.dumps(good).encode(),
    ]
    parsed = history_format.parse(b"\n".join(hostile))
    assert [entry["kind"] for entry in parsed] == ["run", "header", "run"]
    assert parsed[0]["images"] == [] and parsed[0]["status"] == "error" and parsed[0]["error"]["type"] == "Error"
    assert parsed[1]["runs_dropped"] == 0
    assert parsed[2]["images"] == [{"file": "img-1-0.png", "mime": "image/png"}]


# -- the messages' shapes, on both halves -----------------------------------------------------------
def test_what_the_worker_answers_passes_the_supervisors_check_and_reaches_the_host(snapshot_dir: Path) -> None:
    take(namespace())
    restored = agent.worker_frame(agent_namespace.restore({}), b"", 0)
    event = wire.parse_event(worker_requests.restored_event(1, restored))
    assert isinstance(event, wire.Restored) and event.restored == 4 and "gen (generator)" in event.skipped
    snap = agent.worker_frame({"kind": "snapshot_synced", "complete": True, "taken_at": 1.5, "size": 10}, b"", 0)
    assert wire.parse_event(worker_requests.snapshot_event(2, snap)) == wire.SnapshotSynced(
        ev="snapshot", id=2, complete=True, taken_at=1.5, size=10
    )
    item = {"name": "df", "type": "pandas.DataFrame", "repr": "x", "size": 80, "shape": [10, 1]}
    listed = agent.worker_frame(
        {"kind": "variables", "variables": [item, {**item, "name": "b"}], "truncated": False}, b"", 0
    )
    variables = wire.parse_event(worker_requests.variables_event(3, listed, 1))
    assert isinstance(variables, wire.VariableList) and variables.truncated and variables.variables[0].shape == [10, 1]


@pytest.mark.parametrize(
    "frame",
    [
        {"kind": "restored", "outcome": 1, "restored": 0, "skipped": [], "note": "", "taken_at": None},
        {"kind": "restored", "outcome": "found", "restored": 0, "skipped": [], "note": "", "taken_at": None},
        {"kind": "restored", "outcome": "restored", "restored": -1, "skipped": [], "note": "", "taken_at": None},
        {"kind": "restored", "outcome": "restored", "restored": 0, "skipped": [5], "note": "", "taken_at": None},
        {"kind": "snapshot_synced", "complete": True, "taken_at": None, "size": -1},
        {
            "kind": "variables",
            "variables": [{"name": "a", "type": "t", "repr": "r", "shape": [-1]}],
            "truncated": False,
        },
        {"kind": "variables", "variables": [{"name": "a", "type": "t", "repr": "r", "code": "x"}], "truncated": False},
        {"kind": "variables", "variables": ["a"], "truncated": False},
        {"kind": "note", "text": 5},
    ],
)
def test_the_supervisor_refuses_forged_session_frames(frame: dict[str, Any]) -> None:
    with pytest.raises(agent.ProtocolError):
        agent.worker_frame(frame, b"", 0)


def test_the_requests_the_host_sends_are_what_the_agent_dispatches() -> None:
    requests = [wire.Restore(id=1), wire.SnapshotSync(id=2, timeout=5), wire.Variables(id=3, limit=10, repr_chars=80)]
    requests.append(wire.ExportNotebook(id=4, path="s.ipynb"))
    ops = [request.model_dump(mode="json", exclude_none=True)["op"] for request in requests]
    assert tuple(ops) == session_requests.SESSION_OPS
    assert wire.RunOptions.model_fields.keys() >= {"snapshot_max_bytes", "history_max_bytes"}
