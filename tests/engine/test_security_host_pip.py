"""Hostile input never reaches the host's pip (issue 23), on the real engine.

1. Nothing a sandbox wrote runs, is imported, built or looked up on the host: a ``pip`` package (and
   a ``sitecustomize``) planted in a writable mount that is the server's working directory never
   runs, and a requirement that names a local archive, a path or a URL is refused before pip runs;
   under runc and gVisor.
2. The host's work for a call ends with it and stays within a share per identity: a %pip whose
   resolution hangs is killed (its pid gone) when the run is cancelled, times out, or pip's own
   timeout passes; one identity's hanging installs do not hold up another's; a failed resolution is
   remembered instead of running pip again.
5. Installs refused by size download nothing into the cache, and the cache stays within its bound.

The machine's index (pip's own configuration) serves the real packages; ``_host_pip`` serves made
wheels and hanging names on loopback, as the index pip tries first.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import pytest
from _host_pip import LoopbackIndex, alive, loopback_index
from _security import runsc_available
from _support import make_test_config, wait_until

from mcp_code_exec.models import RunResult
from mcp_code_exec.service import SandboxService

pytestmark = pytest.mark.anyio
OWNER, OTHER = "host-pip", "host-pip-other"
RUNTIMES = ["runc", pytest.param("runsc", marks=pytest.mark.skipif(not runsc_available(), reason="no gVisor"))]
MARKER = "RAN-ON-THE-HOST"
PLANT = (
    "import os\n"
    "work = '/mnt/host/work'\n"
    "mark = 'import pathlib; pathlib.Path(__file__).resolve().parent.joinpath({0!r}).write_text(\"ran\")\\n'\n"
    "os.makedirs(f'{work}/pip', exist_ok=True)\n"
    "for path, up in (('pip/__init__.py', '..'), ('pip/__main__.py', '..'), ('sitecustomize.py', '.'),\n"
    "                 ('usercustomize.py', '.')):\n"
    f"    open(f'{{work}}/{{path}}', 'w').write(mark.format(up + '/{MARKER}-' + path.replace('/', '-')))\n"
    "sorted(os.listdir(work))\n"
)
# A source package whose setup.py leaves a mark in the workspace (WORKSPACE: its path on the host) if
# anything builds it, as archives pip would take for files, and as a directory.
ARCHIVES = (
    "import io, os, tarfile, zipfile\n"
    "work = '/mnt/host/work'\n"
    f'setup = b\'import pathlib; pathlib.Path(WORKSPACE, "{MARKER}-setup").write_text("built")\\n\'\n'
    "os.makedirs(f'{work}/x', exist_ok=True)\n"
    "open(f'{work}/x/setup.py', 'wb').write(setup)\n"
    "for name in ('x.tar', 'x.tbz', 'x.tar.gz'):\n"
    "    with tarfile.open(f'{work}/{name}', 'w') as tar:\n"
    "        tar.add(f'{work}/x', arcname='x-1.0')\n"
    "with zipfile.ZipFile(f'{work}/x.ZIP', 'w') as z:\n"
    "    z.writestr('x-1.0/setup.py', setup)\n"
    "sorted(os.listdir(work))\n"
)
REFUSED = [
    "x.tar",
    "x.ZIP",
    "x.tbz",
    "X.Tar.Gz",
    "x[extra].tar",
    "x==1.0+local.tar",
    "./x",
    "x/",
    "/mnt/host/work/x.tar",
    "~/x.tar",
    "file:x.tar",
    "file:///mnt/host/work/x.tar",
    "https://example.org/x-1.0.tar.gz",
    "x @ file:///mnt/host/work/x.tar",
]


@pytest.fixture(scope="module", params=RUNTIMES)
async def shared(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[SandboxService, Path]]:
    """A service, and the user's workspace: shared writable with every sandbox (one per runtime)."""
    workspace = tmp_path_factory.mktemp(f"workspace-{request.param}")
    workspace.chmod(0o777)
    config = make_test_config(
        runtime=None if request.param == "runc" else "runsc",
        mounts=[{"name": "work", "path": str(workspace), "writable": True}],
        pool={"size": 1, "session_spares": 0},
        packages={"cache_dir": str(workspace.parent / f"wheels-{request.param}")},
    )
    async with SandboxService.start(config) as svc:
        await svc.wait_ready()
        yield svc, workspace


@pytest.fixture
def in_workspace(shared: tuple[SandboxService, Path], monkeypatch: pytest.MonkeyPatch) -> Iterator[SandboxService]:
    """The service, with the workspace as the server's working directory (as hosts start stdio servers)."""
    service, workspace = shared
    monkeypatch.chdir(workspace)
    yield service
    assert ran_on_the_host(workspace) == []


def ran_on_the_host(workspace: Path) -> list[str]:
    return sorted(path.name for path in workspace.iterdir() if path.name.startswith(MARKER))


async def test_a_package_planted_in_the_servers_working_directory_never_runs_on_the_host(
    in_workspace: SandboxService,
) -> None:
    shared, workspace = in_workspace, Path.cwd()
    sid = (await shared.new_session(OWNER)).session_id
    try:
        planted = await shared.run(OWNER, PLANT, session_id=sid)
        assert planted.status == "ok", planted.error
        assert (workspace / "pip" / "__main__.py").is_file()  # it is there, in the server's cwd
        started = shared.packages.host.started
        installed = await shared.run(
            OWNER, "%pip install -q humanize\nimport humanize\nhumanize.intcomma(1000)", session_id=sid, timeout=60
        )
        assert installed.status == "ok", installed.error  # the host's own pip ran, not the planted one
        assert installed.result == "'1,000'"
        assert shared.packages.host.started > started
        assert ran_on_the_host(workspace) == []
    finally:
        await shared.close_session(OWNER, sid)


async def test_a_requirement_naming_a_file_a_path_or_a_url_is_refused_before_pip_runs(
    in_workspace: SandboxService,
) -> None:
    shared, workspace = in_workspace, Path.cwd()
    sid = (await shared.new_session(OWNER)).session_id
    try:
        made = await shared.run(OWNER, ARCHIVES, session_id=sid)
        assert made.status == "ok", made.error
        started = shared.packages.host.started
        for requirement in REFUSED:
            for line in (f"%pip install '{requirement}'", f"!pip install '{requirement}'"):
                refused = await shared.run(OWNER, f"print('ran')\n{line}", session_id=sid, timeout=60)
                assert refused.status == "error" and refused.stdout == "", (line, refused)
                assert refused.error is not None and refused.error.type == "PackageError"
                assert "not supported" in refused.error.message, (line, refused.error.message)
                assert str(workspace) not in refused.error.message  # nor is the server's cwd told
            packaged = await shared.run(OWNER, "print('ran')", packages=[requirement], timeout=60)
            assert packaged.error is not None and "not supported" in packaged.error.message, requirement
        assert shared.packages.host.started == started  # pip never ran for any of them
        assert ran_on_the_host(workspace) == []
    finally:
        await shared.close_session(OWNER, sid)


# -- 2: host work ends with its call, within a share per identity ---------------------------------
@pytest.fixture(scope="module")
def index() -> Iterator[LoopbackIndex]:
    with loopback_index() as served, pytest.MonkeyPatch.context() as patch:
        patch.setenv("PIP_INDEX_URL", served.url)  # tried first; the machine's own index comes after
        yield served


@pytest.fixture(scope="module")
async def bounded(index: LoopbackIndex, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[SandboxService]:
    cache = tmp_path_factory.mktemp("bounded-wheels")
    packages = {"cache_dir": str(cache), "pip_workers": 2, "pip_workers_per_client": 1, "pip_timeout_s": 15}
    packages |= {"max_mb": 1, "cache_max_mb": 2}
    config = make_test_config(pool={"size": 2, "session_spares": 0, "max_size": 6}, packages=packages)
    async with SandboxService.start(config) as svc:
        await svc.wait_ready()
        yield svc


async def hanging_pip(service: SandboxService, owner: str, count: int = 1) -> list[int]:
    """The pids of ``owner``'s runs of pip, once ``count`` of them are going."""
    running = service.packages.host.running
    await wait_until(lambda: sum(1 for who in running.values() if who == owner) >= count, 20)
    return [pid for pid, who in running.items() if who == owner]


async def gone(pids: list[int]) -> None:
    await wait_until(lambda: not any(alive(pid) for pid in pids), 5)  # killed and reaped, promptly


async def test_cancelling_a_run_kills_its_pip(bounded: SandboxService, index: LoopbackIndex) -> None:
    run = await bounded.start_run(OWNER, "%pip install slow-cancelled", timeout=60)
    pids = await hanging_pip(bounded, OWNER)
    run.cancel()
    with anyio.fail_after(10):
        await run.finished.wait()
    assert run.result is not None and run.result.status == "cancelled"
    await gone(pids)


async def test_a_run_that_times_out_kills_its_pip_and_so_does_pips_own_timeout(
    bounded: SandboxService, index: LoopbackIndex
) -> None:
    async with anyio.create_task_group() as tg:
        results: list[RunResult] = []

        async def install(name: str, timeout: float) -> None:  # noqa: ASYNC109 - the run's own
            results.append(await bounded.run(OWNER, f"%pip install {name}", timeout=timeout))

        tg.start_soon(install, "slow-timed-out", 3)
        pids = await hanging_pip(bounded, OWNER)
    assert results[0].error is not None and "longer than the run's timeout (3 s)" in results[0].error.message
    await gone(pids)
    began = anyio.current_time()
    own = await bounded.run(OWNER, "%pip install slow-past-pips-timeout", timeout=55)
    assert own.error is not None and "pip took longer than 15 s" in own.error.message, own.error
    assert anyio.current_time() - began < 30
    assert bounded.packages.host.running == {}


async def test_one_identity_gets_its_share_and_another_still_installs(
    bounded: SandboxService, index: LoopbackIndex
) -> None:
    first = await bounded.start_run(OWNER, "%pip install slow-one", timeout=50)
    second = await bounded.start_run(OWNER, "%pip install slow-two", timeout=50)
    try:
        pids = await hanging_pip(bounded, OWNER)
        await anyio.sleep(1.5)  # the second waits for the first: one pip of this identity at a time
        assert sorted(bounded.packages.host.running.values()) == [OWNER]
        other = await bounded.run(OTHER, "%pip install -q termcolor\nimport termcolor\nprint('ok')", timeout=40)
        assert other.status == "ok" and other.stdout.endswith("ok\n"), other.error
        assert not first.done and not second.done
    finally:
        first.cancel()
        second.cancel()
    with anyio.fail_after(10):
        await first.finished.wait()
        await second.finished.wait()
    await gone(pids)
    assert bounded.packages.host.running == {}


async def test_a_failed_resolution_is_remembered_not_asked_again(bounded: SandboxService) -> None:
    first = await bounded.run(OWNER, "%pip install nosuch-package-mcpx-23", timeout=40)
    assert first.error is not None and "no such package on the server's index" in first.error.message
    started, hits = bounded.packages.host.started, bounded.packages.stats.failure_hits
    again = await bounded.run(OTHER, "%pip install nosuch-package-mcpx-23", timeout=40)
    assert again.error is not None and again.error.message == first.error.message
    assert bounded.packages.host.started == started and bounded.packages.stats.failure_hits == hits + 1


# -- 5: sizes before the cache, and a bounded cache ------------------------------------------------
def cache_wheels(service: SandboxService) -> dict[str, int]:
    root = service.packages.cache.root
    return {path.name: path.stat().st_size for path in root.rglob("*") if path.is_file()}


async def test_an_install_refused_by_size_downloads_nothing_into_the_cache(
    bounded: SandboxService, index: LoopbackIndex
) -> None:
    # pydicom (2.3 MiB) on the machine's index, whose size pip's report tells before any download
    started = bounded.packages.host.started
    known = await bounded.run(OWNER, "%pip install pydicom", timeout=40)
    assert known.error is not None and "would bring 2 MiB of wheels" in known.error.message, known.error
    assert "allows 1 MiB per install ([packages] max_mb)" in known.error.message
    assert bounded.packages.host.started == started + 1  # resolved, never downloaded
    # a made 1.5 MiB wheel behind HTTP, whose size nobody tells: stopped as it passes the bound
    index.add("bulky-mcpx", "1.0", 1536 * 1024)
    unknown = await bounded.run(OWNER, "%pip install bulky-mcpx", timeout=40)
    assert unknown.error is not None and "would bring more than 1 MiB of wheels" in unknown.error.message
    assert not any(name.startswith(("pydicom", "bulky")) for name in cache_wheels(bounded))
    assert bounded.packages.stats.bytes_by_owner[OWNER] == 0  # nothing was kept for this identity


async def test_the_cache_stays_within_its_bound_least_recently_used_going_first(
    bounded: SandboxService, index: LoopbackIndex
) -> None:
    bound = 2 * 1024 * 1024
    names = [f"cached-mcpx-{n}" for n in range(4)]
    for name in names:
        index.add(name, "1.0", 600 * 1024)
    stats = bounded.packages.stats
    before, mine, others = stats.evicted, stats.bytes_by_owner[OWNER], stats.bytes_by_owner[OTHER]
    for name in names:
        module = name.replace("-", "_")
        result = await bounded.run(OWNER, f"import {module}\nprint({module}.VALUE)", packages=[name], timeout=40)
        assert result.status == "ok" and result.stdout == "1.0\n", result.error
        assert sum(cache_wheels(bounded).values()) <= bound
    kept = cache_wheels(bounded)
    assert names[-1].replace("-", "_") + "-1.0-py3-none-any.whl" in kept
    assert names[0].replace("-", "_") + "-1.0-py3-none-any.whl" not in kept  # the least recently used went
    assert stats.evicted > before
    assert (
        stats.bytes_by_owner[OWNER] >= mine + 4 * 600 * 1024 and stats.bytes_by_owner[OTHER] == others
    )  # per identity
