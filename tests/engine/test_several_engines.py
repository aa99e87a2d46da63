"""Several Docker engines as one ([cluster] engines): the main engine and two extra dockerd daemons
on this machine (the ``extra_engines`` fixture). Stateless runs spread over all of them, sessions
open on each, and one engine killed under load costs no stateless call: its sessions say "engine
unavailable" until it is back, then work again with their files. Nothing is left on any engine.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from _extra_engines import ExtraEngine
from _support import ServerProcess, existing_volumes, make_test_config, project_containers, project_volumes

from mcp_code_exec.config.settings import Config
from mcp_code_exec.errors import SandboxError
from mcp_code_exec.mcp_server.answers import run_content
from mcp_code_exec.runtime.cluster import ClusterEngine
from mcp_code_exec.runtime.docker.endpoints import candidate_endpoints
from mcp_code_exec.service.facade import SandboxService

pytestmark = [pytest.mark.anyio, pytest.mark.slow]
HOSTNAME = "import socket; print(socket.gethostname())"  # a container's host name is its short id
READY_S = 180.0


def cluster_config(extras: Iterable[ExtraEngine], **pool: Any) -> Config:
    """The main engine and the extra ones (one of them over tcp:// with TLS, when it listens so)."""
    engines: list[dict[str, Any]] = [{"url": candidate_endpoints(None)[0], "name": "main"}]
    for extra in extras:
        if extra.tcp_url is not None:
            engines.append({"url": extra.tcp_url, "name": extra.name, "cert_path": str(extra.client_certs)})
        else:
            engines.append({"url": extra.url, "name": extra.name})
    cluster = {"engines": engines, "health_interval_s": 0.5, "health_timeout_s": 5.0}
    return make_test_config(cluster=cluster, pool={"size": 3, "max_size": 6, "session_spares": 0, **pool})


def hosts(extras: Iterable[ExtraEngine]) -> dict[str, str | None]:
    """Where the docker CLI reaches each engine (the extra ones by their unix sockets)."""
    return {"main": None, **{extra.name: extra.url for extra in extras}}


@asynccontextmanager
async def cluster_service(
    config: Config, extras: Iterable[ExtraEngine]
) -> AsyncIterator[tuple[SandboxService, ClusterEngine]]:
    """A service over the engines; on leaving, checks that nothing of it is left on any of them."""
    async with SandboxService.start(config) as service:
        assert service.containers.cluster is not None
        await service.stateless_pool.wait_for(lambda pool: pool.idle >= config.pool.size, READY_S)
        yield service, service.containers.cluster
    for name, host in hosts(extras).items():
        assert project_containers(instance=service.instance, host=host) == [], name
        assert project_volumes(instance=service.instance, host=host) == [], name
        assert existing_volumes(service.volumes.names, host=host) == [], name


def per_engine(cluster: ClusterEngine, key: str) -> dict[str, int]:
    return {figures["name"]: figures[key] for figures in cluster.health.figures()}


class Load:
    """Clients calling stateless runs in a loop until ``stop``; every outcome that is not a
    clean ``2`` is kept, with what it said."""

    def __init__(self, service: SandboxService) -> None:
        self.service = service
        self.stop = anyio.Event()
        self.done = 0
        self.failures: list[str] = []
        self._progress = anyio.Event()

    async def client(self, owner: str) -> None:
        while not self.stop.is_set():
            try:
                result = await self.service.run(owner, "print(1+1)")
                if result.status != "ok" or result.stdout != "2\n":
                    self.failures.append(f"{result.status}: {result.error}")
            except SandboxError as exc:
                self.failures.append(f"{type(exc).__name__}: {exc}")
            self.done += 1
            self._progress.set()
            self._progress = anyio.Event()

    async def reach(self, calls: int, timeout_s: float) -> None:
        with anyio.fail_after(timeout_s):
            while self.done < calls:
                await self._progress.wait()


async def test_stateless_calls_spread_over_every_engine(extra_engines: list[ExtraEngine]) -> None:
    config = cluster_config(extra_engines, max_size=3)  # no growth: every container stays to be named
    async with cluster_service(config, extra_engines) as (service, cluster):
        assert per_engine(cluster, "stateless") == {"main": 1, "extra-1": 1, "extra-2": 1}
        served: Counter[str | None] = Counter()

        async def client(owner: str) -> None:
            for _ in range(6):
                result = await service.run(owner, HOSTNAME)
                assert result.status == "ok", result.error
                (container_id,) = [
                    c for c in service.stateless_pool.container_ids() if c.startswith(result.stdout.strip())
                ]
                served[cluster.home_of(container_id)] += 1

        with anyio.fail_after(240):
            async with anyio.create_task_group() as tg:
                for index in range(8):
                    tg.start_soon(client, f"client-{index}")
        assert set(served) == {"main", "extra-1", "extra-2"}, served
        assert sum(served.values()) == 48


async def test_sessions_open_on_every_engine_and_nothing_is_left_on_any_after_shutdown(
    extra_engines: list[ExtraEngine],
) -> None:
    config = cluster_config(extra_engines)
    async with cluster_service(config, extra_engines) as (service, cluster):
        for _ in range(3):
            sid = (await service.new_session("me")).session_id
            await service.write_file("me", sid, "where.txt", b"here")
            assert (await service.run("me", "x = open('where.txt').read()\nx", session_id=sid)).result == "'here'"
        homes = {
            session.volume or "": cluster.volume_home(session.volume or "") or "" for session in service.sessions.all()
        }
        assert sorted(homes.values()) == ["extra-1", "extra-2", "main"]  # each engine has room for one
        where = hosts(extra_engines)
        for volume, home in homes.items():
            assert existing_volumes([volume], host=where[home]) == [volume]
        assert (await service.run("me", "print(1+1)")).stdout == "2\n"
        # The sessions stay open: the shutdown removes them, on every engine (checked on leaving).


async def test_an_engine_killed_under_load_costs_no_stateless_call_and_its_sessions_come_back_with_it(
    extra_engines: list[ExtraEngine],
) -> None:
    victim = extra_engines[0]
    config = cluster_config(extra_engines)
    async with cluster_service(config, extra_engines) as (service, cluster):
        sessions = {}
        for _ in range(3):
            sid = (await service.new_session("me")).session_id
            await service.write_file("me", sid, "kept.txt", b"on the volume")
            sessions[cluster.volume_home(service.sessions.get(sid, "me").volume or "")] = sid
        member = next(m for m in cluster.members if m.name == victim.name)
        load = Load(service)
        async with anyio.create_task_group() as tg:
            for index in range(4):
                tg.start_soon(load.client, f"load-{index}")
            await load.reach(20, 120)
            await anyio.to_thread.run_sync(victim.kill)
            await cluster.health.wait_for(lambda: not member.up, 30)
            await load.reach(load.done + 40, 180)
            load.stop.set()
        assert load.failures == []

        down = await service.run("me", "open('kept.txt').read()", session_id=sessions[victim.name])
        assert down.status == "crashed" and down.error is not None
        assert down.error.type == "EngineDown" and "engine unavailable" in down.error.message, down.error
        assert run_content(down, links=False).is_error  # a client sees the tool fail, not the user's code
        for name in ("main", "extra-2"):
            assert (await service.run("me", "1 + 1", session_id=sessions[name])).result == "2"

        await anyio.to_thread.run_sync(victim.start)
        await cluster.health.wait_for(lambda: member.up, 60)
        back = await service.run("me", "open('kept.txt').read()", session_id=sessions[victim.name])
        assert back.status == "ok" and back.result == "'on the volume'" and back.session_restarted
        await service.stateless_pool.wait_for(lambda pool: per_engine(cluster, "stateless")[victim.name] >= 1, 120)


async def test_doctor_checks_every_engine_and_names_the_one_that_fails(
    extra_engines: list[ExtraEngine], capsys: pytest.CaptureFixture[str]
) -> None:
    from mcp_code_exec.commands.doctor import doctor

    config = cluster_config(extra_engines[1:])  # the main engine, and the one over tcp:// with TLS
    ghost = {"url": "unix:///run/mcpx-no-such-engine/docker.sock", "name": "ghost"}
    engines = [engine.model_dump() for engine in config.cluster.engines] + [ghost]
    config = make_test_config(cluster={"engines": engines})
    with anyio.fail_after(600):
        assert await doctor(config) == 1
    out = capsys.readouterr().out
    for name in ("main", extra_engines[1].name):
        for check in ("engine", "image", "sandbox start", "isolation", "memory limit", "pids limit"):
            assert f"OK    [{name}] {check}:" in out, out
    assert "FAIL  [ghost] engine: no Docker engine answers" in out, out


async def test_healthz_gives_each_engines_figures_by_name_never_its_address(
    extra_engines: list[ExtraEngine], tmp_path: Path
) -> None:
    import httpx2

    from mcp_code_exec.commands.bench.report import config_for_subprocess, to_toml

    config = cluster_config(extra_engines, size=1)
    path = tmp_path / "config.toml"
    path.write_text(to_toml(config_for_subprocess(config)))
    async with ServerProcess(
        "streamable-http", env={"MCP_CODE_EXEC_TOKEN": "t"}, args=["--config", str(path)]
    ) as server:
        response = await anyio.to_thread.run_sync(lambda: httpx2.get(f"{server.url}/healthz", timeout=10))
    assert response.status_code == 200
    health = response.json()
    assert health["ok"] is True
    assert [engine["name"] for engine in health["engines"]] == ["main", "extra-1", "extra-2"]
    assert all(engine["up"] and engine["sessions"] == 0 for engine in health["engines"])
    assert "unix://" not in response.text and "/run/" not in response.text


async def test_a_tls_engine_is_verified_against_its_own_ca_whatever_the_environment_says(
    extra_engines: list[ExtraEngine], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    from mcp_code_exec.errors import EngineUnavailable
    from mcp_code_exec.runtime.docker.engine import DockerEngine

    tls = extra_engines[-1]
    assert tls.tcp_url is not None
    bundle = tmp_path / "bundle.pem"  # a CA bundle the environment names, which did not sign the engine
    await anyio.run_process(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=another-ca",
         "-keyout", str(tmp_path / "other-key.pem"), "-out", str(bundle)],
    )  # fmt: skip
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(bundle))
    monkeypatch.setenv("CURL_CA_BUNDLE", str(bundle))
    engine = await DockerEngine.connect(tls.tcp_url, cert_path=str(tls.client_certs))  # its own CA wins
    await engine.aclose()
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    for name in ("cert.pem", "key.pem"):
        shutil.copy(tls.client_certs / name, wrong / name)
    shutil.copy(bundle, wrong / "ca.pem")
    with pytest.raises(EngineUnavailable, match="no Docker engine answers"):  # verification is still on
        await DockerEngine.connect(tls.tcp_url, cert_path=str(wrong), timeout_s=10)


async def test_an_engine_over_ssh_works_through_its_tunnel_and_again_after_its_ssh_died(
    extra_engines: list[ExtraEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    import os
    import signal

    from _support import wait_until

    from mcp_code_exec.runtime.docker.engine import DockerEngine

    monkeypatch.setenv("PATH", f"{Path(__file__).parent / 'fake_ssh'}:{os.environ['PATH']}")  # a stand-in ssh
    url = f"ssh://tester@far-away{extra_engines[0].run_dir}/docker.sock"  # the remote socket: extra-1's
    cluster = {"engines": [{"url": url, "name": "over-ssh"}], "health_interval_s": 0.5}
    config = make_test_config(cluster=cluster, pool={"size": 1, "session_spares": 0})
    async with SandboxService.start(config) as service:
        assert service.containers.cluster is not None
        (member,) = service.containers.cluster.members
        assert isinstance(member.engine, DockerEngine) and member.engine._tunnel is not None
        tunnel = member.engine._tunnel
        assert (await service.run("me", "print(1+1)")).stdout == "2\n"
        sid = (await service.new_session("me")).session_id
        await service.write_file("me", sid, "kept.txt", b"over ssh")
        assert existing_volumes([service.sessions.get(sid, "me").volume or ""], host=extra_engines[0].url)

        ssh = tunnel._process
        assert ssh is not None
        os.kill(ssh.pid, signal.SIGKILL)  # the connection to the far host is gone
        await anyio.to_thread.run_sync(ssh.wait, 30)
        await wait_until(lambda: tunnel.running, 60)  # a health check started ssh again
        await service.containers.cluster.health.wait_for(lambda: member.up, 60)
        with anyio.fail_after(120):
            again = await service.run("me", "open('kept.txt').read()", session_id=sid)
            while again.error is not None and again.error.type == "EngineDown":  # out until the next check
                await service.containers.cluster.health.wait_for(lambda: member.up, 60)
                again = await service.run("me", "open('kept.txt').read()", session_id=sid)
        assert again.status == "ok" and again.result == "'over ssh'", again.error
        await service.stateless_pool.wait_for(lambda pool: pool.idle >= 1, 120)
        assert (await service.run("me", "print(1+1)")).stdout == "2\n"
    assert project_containers(instance=service.instance, host=extra_engines[0].url) == []
    assert project_volumes(instance=service.instance, host=extra_engines[0].url) == []
    assert not await anyio.Path(tunnel.local).exists()  # the tunnel is gone with the service
