"""A session made over stdio outlives its local service: the service is SIGKILLed, and the next
front (a new process, the same OS user and config) starts a new service that serves the session
again, its variables and files with it; a front configured with another identity cannot see it.

The service here is durable (the suite's are not), in a scope of this test's own, so it takes over
no session another test or a user's service left; the test closes its session, and the per-test
runtime directory's services are stopped at its end (``conftest.private_local_services``).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
from pathlib import Path

import anyio
import pytest
from _durable import docker, records_of, remove_sessions
from _local_service import live_service_pids, stop_services
from _stdio_front import sdk_front
from _support import wait_until
from test_stdio_local_service import call_in_a_new_process, runtime_dir, structured

from mcp_code_exec.config.settings import Config
from mcp_code_exec.runtime.base import LABEL_UID

pytestmark = pytest.mark.anyio
MAKE = (
    "import pandas as pd\n"
    "df = pd.DataFrame({'x': range(1000), 'y': [i * i for i in range(1000)]})\n"
    "open('/mnt/data/notes.txt', 'w').write('kept')\n"
)
SNAPSHOT = "/mnt/data/.mcpx/snapshot/ns.pkl"  # appears complete (renamed into place)
SHOW = "print(df.shape, int(df.y.sum()), open('/mnt/data/notes.txt').read())"
SHOWN = "(1000, 2) 332833500 kept\n"


def durable_config(tmp_path: Path, config: Config, scope: str, extra: str = "", name: str = "config.toml") -> Path:
    path = tmp_path / name
    path.write_text(
        f"image = {json.dumps(config.image)}\n"
        "[limits]\nmemory_mb = 256\ndefault_timeout_s = 20\nmax_run_s = 90\n"
        "[pool]\nsize = 1\nsession_spares = 0\nacquire_timeout_s = 60\n"
        f"[sessions]\ndurable = true\nscope = {json.dumps(scope)}\n{extra}"
    )
    return path


def snapshot_written(session_id: str) -> bool:
    """Whether the session's container holds a complete snapshot (asked as the uid owning its files:
    the snapshot's directory is that uid's alone)."""
    for record, volume in records_of([session_id]).items():
        uid = docker("volume", "inspect", "--format", f'{{{{index .Labels "{LABEL_UID}"}}}}', record).strip()
        for container in docker("ps", "-q", "--filter", f"volume={volume}").split():
            probe = f"import os; print(os.path.exists({SNAPSHOT!r}))"
            if docker("exec", "--user", uid, container, "python3", "-c", probe).strip() == "True":
                return True
    return False


async def reaped(pid: int) -> None:
    """Until the process is reaped, not only dead: a new service judges an old one gone by its process
    entry, which a zombie still has (init reaps a service, a front's grandchild; here it does so late)."""
    await wait_until(lambda: not Path(f"/proc/{pid}").exists(), 60)


async def stop_the_service() -> None:
    """SIGTERM: a durable service keeps its sessions (volume, snapshot, record) for the next one."""
    [pid] = live_service_pids(runtime_dir())
    killed = await anyio.to_thread.run_sync(stop_services, runtime_dir())
    assert killed == [], f"services that did not stop on SIGTERM: {killed}"
    await reaped(pid)


async def test_a_session_outlives_a_killed_local_service_for_its_user_and_no_other_identity(
    tmp_path: Path, config: Config
) -> None:
    scope = f"test-stdio-restart-{secrets.token_hex(4)}"
    mine = sdk_front(durable_config(tmp_path, config, scope))
    other_config = durable_config(tmp_path, config, scope, '[stdio]\nidentity = "someone-else"\n', "other.toml")
    other = sdk_front(other_config)
    session_id = structured(await call_in_a_new_process(mine, "new_session", {}))["session_id"]
    try:
        structured(await call_in_a_new_process(mine, "run_python", {"code": MAKE, "session_id": session_id}))
        # The snapshot is written once the session has been idle a moment, off the run's path: the
        # service is killed only when it is complete, so the test does not race its writer.
        await wait_until(lambda: snapshot_written(session_id), 60, every_s=0.2)
        [pid] = live_service_pids(runtime_dir())
        os.kill(pid, signal.SIGKILL)
        await reaped(pid)

        shown = await call_in_a_new_process(mine, "run_python", {"code": SHOW, "session_id": session_id})
        assert structured(shown)["stdout"] == SHOWN
        assert live_service_pids(runtime_dir()) not in ([], [pid])  # a new service answered
        read = await call_in_a_new_process(mine, "read_file", {"session_id": session_id, "path": "notes.txt"})
        assert not read.is_error and "kept" in str(read.content), read.content
        await stop_the_service()

        # The other identity's front starts a service of its own config, which takes the session over
        # (its server stopped), and still refuses it: it is not that identity's.
        refused = await call_in_a_new_process(other, "run_python", {"code": "df", "session_id": session_id})
        assert refused.is_error and "no such session" in str(refused.content), refused.content
        files = await call_in_a_new_process(other, "list_files", {"session_id": session_id})
        assert files.is_error and "no such session" in str(files.content), files.content
        await stop_the_service()

        closed = await call_in_a_new_process(mine, "close_session", {"session_id": session_id})
        assert not closed.is_error, closed.content
    finally:
        await anyio.to_thread.run_sync(stop_services, runtime_dir())
        remove_sessions([session_id])  # after a failure: its record and volume (none after a close)


async def test_an_idle_durable_service_pauses_its_live_session_exits_and_the_next_one_resumes_it(
    tmp_path: Path, config: Config
) -> None:
    # The session is still live when its client leaves (pause_after_s is far off): the service must
    # not wait for it, since a durable session is kept on disk by the stop as by a pause.
    scope = f"test-stdio-idle-{secrets.token_hex(4)}"
    extra = "pause_after_s = 3600\n[stdio]\nidle_exit_s = 2\n"
    mine = sdk_front(durable_config(tmp_path, config, scope, extra))
    session_id = structured(await call_in_a_new_process(mine, "new_session", {}))["session_id"]
    try:
        structured(await call_in_a_new_process(mine, "run_python", {"code": MAKE, "session_id": session_id}))
        [pid] = live_service_pids(runtime_dir())
        await reaped(pid)  # exited on its own: no connection, nothing live
        assert live_service_pids(runtime_dir()) == []
        [volume] = records_of([session_id]).values()
        assert docker("ps", "-aq", "--filter", f"volume={volume}").split() == []  # its container given back

        shown = await call_in_a_new_process(mine, "run_python", {"code": SHOW, "session_id": session_id})
        assert structured(shown)["stdout"] == SHOWN
        closed = await call_in_a_new_process(mine, "close_session", {"session_id": session_id})
        assert not closed.is_error, closed.content
    finally:
        await anyio.to_thread.run_sync(stop_services, runtime_dir())
        remove_sessions([session_id])
