"""A session's variables outlive its container: snapshots taken off the call's path, restored into a
new container by the ``restore`` request; and the session's history comes back as a notebook.

These tests drive the agent through the session's sandbox directly; the host's wiring (``restore``
sent when a session gets a new container, the MCP tools) is tested in test_durable_*.py.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import AsyncIterator

import anyio
import pytest
from _security import runsc_available
from _support import make_test_config

from mcp_code_exec.errors import FileOperationError
from mcp_code_exec.models import RunResult
from mcp_code_exec.protocol import messages as wire
from mcp_code_exec.sandbox.container import Sandbox
from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio
OWNER = "snapshots"
MIB = 1 << 20
RUNTIMES = ["runc", pytest.param("runsc", marks=pytest.mark.skipif(not runsc_available(), reason="no gVisor"))]

STATE = """
import threading, socket, types
import numpy as np, pandas as pd
import matplotlib.pyplot as plt
df = pd.DataFrame({"a": np.arange(100_000), "b": np.random.rand(100_000)})
def double(x):
    return 2 * x
class Point:
    def __init__(self, x, y):
        self.x, self.y = x, y
    def norm(self):
        return (self.x ** 2 + self.y ** 2) ** 0.5
p = Point(3, 4)
inc = lambda v: v + 1
fig, ax = plt.subplots()
ax.plot([1, 2, 3])
import json as js
it = (i for i in range(3))
fh = open("data.txt", "w")
lock = threading.Lock()
import duckdb
conn = duckdb.connect()
"""
CHECK = (
    "(int(df['a'].sum()), double(21), p.norm(), inc(1), type(fig).__name__, len(fig.axes), js.dumps([1]),"
    " 'it' in globals(), 'conn' in globals())"
)


def with_snapshots(service: SandboxService, snapshot_mb: int = 200, history_mb: int = 4) -> None:
    """Turn on what the host's session settings will: snapshots and history for every session run."""
    update = {"snapshot_max_bytes": snapshot_mb * MIB, "history_max_bytes": history_mb * MIB}
    service.executor.session_options = service.executor.session_options.model_copy(update=update)


def service_for(runtime: str) -> SandboxService:
    config = make_test_config(
        runtime=None if runtime == "runc" else "runsc",
        limits={"memory_mb": 512},
        pool={"size": 1, "session_spares": 1},
    )
    return SandboxService.start(config)  # type: ignore[return-value]


@pytest.fixture(scope="module", params=RUNTIMES)
async def any_runtime(request: pytest.FixtureRequest) -> AsyncIterator[SandboxService]:
    async with service_for(request.param) as service:  # type: ignore[attr-defined]
        await service.wait_ready()
        with_snapshots(service)
        yield service


@pytest.fixture(scope="module")
async def snap() -> AsyncIterator[SandboxService]:
    async with service_for("runc") as service:  # type: ignore[attr-defined]
        await service.wait_ready()
        with_snapshots(service)
        yield service


def sandbox_of(service: SandboxService, sid: str) -> Sandbox:
    sandbox = service.sessions.get(sid, OWNER).sandbox
    assert sandbox is not None
    return sandbox


async def ok(service: SandboxService, sid: str, code: str) -> RunResult:
    result = await service.run(OWNER, code, session_id=sid)
    assert result.status == "ok", result
    return result


async def synced(service: SandboxService, sid: str) -> wire.SnapshotSynced:
    event, _ = await sandbox_of(service, sid).request(wire.SnapshotSync(timeout=60))
    assert isinstance(event, wire.SnapshotSynced) and event.complete, event
    return event


async def restore(service: SandboxService, sid: str) -> wire.Restored:
    event, _ = await sandbox_of(service, sid).request(wire.Restore())
    assert isinstance(event, wire.Restored), event
    return event


async def new_container(service: SandboxService, sid: str) -> None:
    """Kill the session's container; the next run finds it dead and starts another on the volume."""
    old = sandbox_of(service, sid)
    await anyio.run_process(["docker", "kill", old.container_id], check=False)
    with anyio.fail_after(30):
        await old.channel.closed.wait()
    after = await service.run(OWNER, "'x' in globals()", session_id=sid)
    assert after.session_restarted is True and after.result == "False", after


async def test_variables_survive_a_killed_container_and_what_cannot_be_kept_is_named(
    any_runtime: SandboxService,
) -> None:
    service = any_runtime
    sid = (await service.new_session(OWNER)).session_id
    try:
        await ok(service, sid, STATE)
        before = await ok(service, sid, CHECK)
        state = await synced(service, sid)
        assert state.taken_at is not None and state.size is not None and state.size > 800_000
        await new_container(service, sid)
        restored = await restore(service, sid)
        assert restored.outcome == "restored" and restored.restored >= 8, restored
        for name in ("it (generator)", "fh (open file)", "lock (lock)", "conn (duckdb connection)"):
            assert name in restored.skipped and name in restored.note, restored
        after = await ok(service, sid, CHECK)
        assert after.result == before.result.replace("True, True)", "False, False)"), (before, after)  # type: ignore[union-attr]
    finally:
        await service.close_session(OWNER, sid)


async def test_a_run_that_kills_its_interpreter_loses_only_its_own_changes(snap: SandboxService) -> None:
    sid = (await snap.new_session(OWNER)).session_id
    try:
        await ok(snap, sid, "x = 1")
        await synced(snap, sid)
        crashed = await snap.run(OWNER, "x = 2; y = 3; import os; os._exit(1)", session_id=sid)
        assert crashed.status == "crashed", crashed
        await restore(snap, sid)
        assert (await ok(snap, sid, "(x, 'y' in globals())")).result == "(1, False)"
    finally:
        await snap.close_session(OWNER, sid)


FORGE = "import os; os.makedirs('/mnt/data/.mcpx/snapshot', exist_ok=True)\n"


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (FORGE + "open('/mnt/data/.mcpx/snapshot/ns.pkl', 'wb').write(b'\\x80\\x05 not a snapshot' * 100)", "damaged"),
        ("p = '/mnt/data/.mcpx/snapshot/ns.pkl'; os.truncate(p, os.path.getsize(p) // 2)", "truncated"),
    ],
)
async def test_a_forged_or_truncated_snapshot_is_reported_and_the_session_goes_on(
    snap: SandboxService, damage: str, said: str
) -> None:
    sid = (await snap.new_session(OWNER)).session_id
    saved = snap.executor.session_options
    try:
        await ok(snap, sid, "import os\nsmall = 1\nbig = bytes(2_000_000)")
        await synced(snap, sid)
        with_snapshots(snap, snapshot_mb=0)  # the damage is the last word: no snapshot after it
        await ok(snap, sid, damage)
        snap.executor.session_options = saved
        await new_container(snap, sid)
        restored = await restore(snap, sid)
        assert said in restored.note, restored
        assert (await ok(snap, sid, "40 + 2")).result == "42"
    finally:
        snap.executor.session_options = saved
        await snap.close_session(OWNER, sid)


@pytest.mark.parametrize(
    ("reduce", "said"),
    [("(os._exit, (3,))", "its interpreter stopped"), ("(time.sleep, (3600,))", "bomb (took longer than")],
)
async def test_a_snapshot_whose_loading_kills_or_hangs_gives_a_note_and_a_working_session(
    snap: SandboxService, reduce: str, said: str
) -> None:
    sid = (await snap.new_session(OWNER)).session_id
    code = f"import os, time\nclass Bomb:\n    def __reduce__(self):\n        return {reduce}\nbomb = Bomb()\nkept = 7"
    try:
        await ok(snap, sid, code)
        await synced(snap, sid)
        await new_container(snap, sid)
        with anyio.fail_after(60):
            restored = await restore(snap, sid)
        assert said in restored.note, restored
        assert (await ok(snap, sid, "40 + 2")).result == "42"
    finally:
        await snap.close_session(OWNER, sid)


async def test_a_namespace_over_the_snapshot_cap_is_not_snapshotted_and_the_next_notes_say_so(
    snap: SandboxService,
) -> None:
    sid = (await snap.new_session(OWNER)).session_id
    saved = snap.executor.session_options
    try:
        await ok(snap, sid, "small = 1")
        first = await synced(snap, sid)
        with_snapshots(snap, snapshot_mb=2)
        await ok(snap, sid, "huge = bytes(5_000_000)\nmiddling = bytes(1_000_000)")
        second = await synced(snap, sid)
        assert second.taken_at == first.taken_at  # the last snapshot stays
        notes = (await ok(snap, sid, "1")).notes
        assert any("huge (4.8 MB)" in note and "not snapshotted" in note for note in notes), notes
    finally:
        snap.executor.session_options = saved
        await snap.close_session(OWNER, sid)


async def test_variables_lists_names_types_and_shapes_and_cuts_a_hanging_repr(snap: SandboxService) -> None:
    sid = (await snap.new_session(OWNER)).session_id
    code = (
        "import numpy as np, pandas as pd, time\n"
        "df = pd.DataFrame({'a': range(10), 'b': range(10)})\narr = np.zeros((3, 4))\n"
        "class Slow:\n    def __repr__(self):\n        time.sleep(60)\nslow = Slow()\nn = 5"
    )
    try:
        await ok(snap, sid, code)
        with anyio.fail_after(30):
            event, _ = await sandbox_of(snap, sid).request(wire.Variables(limit=100, repr_chars=200))
        assert isinstance(event, wire.VariableList), event
        found = {item.name: item for item in event.variables}
        assert set(found) >= {"df", "arr", "slow", "n", "np", "pd", "time"}
        assert found["df"].type == "pandas.core.frame.DataFrame" and found["df"].shape == [10, 2]
        assert found["arr"].shape == [3, 4] and found["arr"].size == 96
        assert found["n"].repr == "5" and "took longer" in found["slow"].repr
        assert (await ok(snap, sid, "n")).result == "5"  # the session's interpreter lives on
        limited, _ = await sandbox_of(snap, sid).request(wire.Variables(limit=2, repr_chars=50))
        assert isinstance(limited, wire.VariableList) and len(limited.variables) == 2 and limited.truncated
    finally:
        await snap.close_session(OWNER, sid)


# After the cell, a thread says it is holding the worker's GIL and keeps it (the regular expression's
# matching never lets it go), so the worker answers no request of the host's.
HOLD_THE_WORKER = (
    "import re, threading\n"
    "def hold():\n    open('holding', 'w').close()\n    re.match(r'(a+)+$', 'a' * 64 + 'b')\n"
    "threading.Timer(0.1, hold).start()\nx = 1"
)


async def held(service: SandboxService, sid: str) -> None:
    with anyio.fail_after(30):
        while "holding" not in [entry.path for entry in (await service.list_files(OWNER, sid))[0]]:  # noqa: ASYNC110
            await anyio.sleep(0.05)  # pacing of the poll of the session's files


async def test_a_worker_replaced_for_not_answering_a_sync_or_a_listing_tells_the_next_run_its_variables_are_gone(
    snap: SandboxService,
) -> None:
    sid = (await snap.new_session(OWNER)).session_id
    try:
        for request in (wire.SnapshotSync(timeout=1), wire.Variables(limit=10, repr_chars=50)):
            await ok(snap, sid, HOLD_THE_WORKER)
            await held(snap, sid)
            with anyio.fail_after(60):
                try:
                    await sandbox_of(snap, sid).request(request)
                except FileOperationError as exc:  # the listing's refusal says the interpreter restarted
                    assert "it was restarted" in str(exc), exc
            after = await snap.run(OWNER, "'x' in globals()", session_id=sid)
            assert after.result == "False" and after.session_restarted is True, (request.op, after)
            assert (await ok(snap, sid, "import os; os.remove('holding')")).session_restarted is False  # told once
    finally:
        await snap.close_session(OWNER, sid)


async def test_the_history_exports_as_a_valid_notebook_with_streams_value_image_and_error(snap: SandboxService) -> None:
    nbformat = pytest.importorskip("nbformat")
    sid = (await snap.new_session(OWNER)).session_id
    try:
        await ok(snap, sid, "import sys\nprint('to stdout'); print('to stderr', file=sys.stderr)\n6 * 7")
        await ok(snap, sid, "import matplotlib.pyplot as plt\nplt.plot([1, 2]); plt.show()")
        failed = await snap.run(OWNER, "1 / 0", session_id=sid)
        assert failed.status == "error"
        event, _ = await sandbox_of(snap, sid).request(wire.ExportNotebook(path="out/session.ipynb"))
        assert isinstance(event, wire.Written) and event.path == "out/session.ipynb", event
        content = await snap.read_file(OWNER, sid, "out/session.ipynb")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a missing cell id is only a warning (reads would add one)
            nbformat.validate(json.loads(content.data))
            notebook = nbformat.reads(content.data.decode(), as_version=4)
        outputs = [output for cell in notebook.cells for output in cell.get("outputs", [])]
        kinds = {(o["output_type"], o.get("name", "")) for o in outputs}
        assert {("stream", "stdout"), ("stream", "stderr"), ("execute_result", ""), ("error", "")} <= kinds
        assert any("image/png" in o.get("data", {}) for o in outputs)
        assert any(o.get("ename") == "ZeroDivisionError" for o in outputs)
        assert json.loads(json.dumps(notebook))["nbformat_minor"] == 5
    finally:
        await snap.close_session(OWNER, sid)


async def test_the_reserved_directory_is_neither_listed_nor_reported_as_changed(snap: SandboxService) -> None:
    sid = (await snap.new_session(OWNER)).session_id
    try:
        await ok(snap, sid, "x = 1")
        await synced(snap, sid)
        second = await ok(snap, sid, "open('mine.txt', 'w').write('x'); import os; sorted(os.listdir('.mcpx'))")
        assert "snapshot" in (second.result or "") and "history" in (second.result or "")
        assert [f.path for f in second.files] == ["mine.txt"]
        entries, _ = await snap.list_files(OWNER, sid)
        assert [entry.path for entry in entries] == ["mine.txt"]
    finally:
        await snap.close_session(OWNER, sid)
