"""The egress proxy's life and the service's grants without an engine: the proxy is played by a
coroutine on an in-memory byte pipe that speaks its control channel (bootstrap line, JSON lines,
ready, pong, ack), so a restart, the state given again, the fire-and-forget messages and the gVisor
check are bookkeeping the unit tier can hold."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.abc import ByteStream

from mcp_code_exec.config.settings import load_config
from mcp_code_exec.egress import service, tokens
from mcp_code_exec.egress.service import Egress
from mcp_code_exec.errors import EgressError
from mcp_code_exec.mcp_server.descriptions import tool_descriptions
from mcp_code_exec.runtime.base import LABEL_INSTANCE, ContainerRecord, ProxySpec, VolumeRecord
from mcp_code_exec.runtime.memory import byte_pipe

pytestmark = pytest.mark.anyio


class PlayedProxy:
    """``ProxyEngine`` whose proxy is a coroutine; ``stop()`` ends the current one, as a crash does."""

    def __init__(self, runsc_args: list[str] | None = None) -> None:
        self.runsc_args = runsc_args
        self.boots: list[dict[str, Any]] = []
        self.heard: list[list[dict[str, Any]]] = []  # per start, the messages after the bootstrap
        self.made_volumes: list[str] = []
        self.events: dict[str, anyio.Event] = {}  # "boot 2", "op end", ...: set when it happens
        self.removed: list[str] = []
        self.alive: anyio.CancelScope | None = None
        self.tg: Any = None

    async def image_labels(self, image: str) -> dict[str, str] | None:
        return {}

    async def proxy_volume(self, spec: ProxySpec) -> None:
        self.made_volumes.append(spec.socket_volume)

    async def runtime_args(self, runtime: str) -> list[str] | None:
        return self.runsc_args

    async def start_proxy(self, spec: ProxySpec) -> tuple[str, ByteStream]:
        host, proxy = byte_pipe()
        self.heard.append([])
        self.tg.start_soon(self._play, proxy, self.heard[-1])
        return f"proxy-{len(self.heard)}", host

    async def remove(self, container_id: str) -> None:
        self.removed.append(container_id)

    def event(self, name: str) -> anyio.Event:
        return self.events.setdefault(name, anyio.Event())

    def stop(self) -> None:
        assert self.alive is not None
        self.alive.cancel()

    async def _play(self, stream: ByteStream, heard: list[dict[str, Any]]) -> None:
        with anyio.CancelScope() as self.alive:
            buffer = b""
            booted = False
            try:
                while True:
                    buffer += await stream.receive()
                    while b"\n" in buffer:
                        line, buffer = buffer.split(b"\n", 1)
                        message = json.loads(line)
                        if not booted:
                            booted = True
                            self.boots.append(message)
                            self.event(f"boot {len(self.boots)}").set()
                            await stream.send(
                                b'{"ev": "ca", "key": "-----BEGIN PRIVATE KEY-----", "cert": "CERTIFICATE"}\n'
                            )
                            await stream.send(b'{"ev": "ready"}\n')
                            continue
                        heard.append(message)
                        self.event(f"op {message.get('op')}").set()
                        if message.get("op") == "ping":
                            await stream.send(json.dumps({"ev": "pong", "id": message["id"]}).encode() + b"\n")
                        elif "id" in message:
                            await stream.send(json.dumps({"ev": "ack", "id": message["id"]}).encode() + b"\n")
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                pass
        await stream.aclose()

    # the rest of ContainerEngine, unused here
    async def containers(self, label: str) -> list[ContainerRecord]:
        return []

    async def volumes(self, label: str) -> list[VolumeRecord]:
        return []


def egress(engine: PlayedProxy, tmp_path: Path, runtime: str | None = None) -> Egress:
    config = load_config(
        environ={"KEY": "secret-value"},
        overrides={
            "egress": {
                "allow": ["a.example", {"host": "b.example", "principals": ["alice"]}],
                "state_dir": str(tmp_path),
                "budget_run_mb": 2,
                "secrets": [{"host": "b.example", "header": "X-Key", "value_env": "KEY"}],
            }
        },
    )
    made = Egress(
        config.egress,
        engine,  # type: ignore[arg-type]
        labels={LABEL_INSTANCE: "i"},
        instance="i",
        runtime=runtime,
        identities={"token:alice"},
        environ={"KEY": "secret-value"},
    )
    made.proxy.health_s = 0.05
    return made


async def test_a_proxy_that_stops_is_started_again_and_given_its_state(tmp_path: Path) -> None:
    engine = PlayedProxy()
    async with anyio.create_task_group() as tg:
        engine.tg = tg
        outward = egress(engine, tmp_path)
        await outward.start(tg)
        with anyio.fail_after(10):
            await outward.proxy.ready.wait()
        assert engine.made_volumes == ["mcp-code-exec-egress-i"]
        boot = engine.boots[0]
        assert boot["grant_key"] == outward.key.hex() and boot["ca_key"] == ""  # the first start makes the CA
        config = engine.heard[0][0]
        assert config["op"] == "config" and config["allow"] == ["a.example", "b.example"]
        assert config["secrets"] == [{"host": "b.example", "header": "X-Key", "value": "secret-value"}]
        assert config["budget_run"] == 2 << 20
        assert (tmp_path / "ca.key").stat().st_mode & 0o777 == 0o600  # the CA the proxy made is kept
        await outward.narrow("s_1", ("a.example",))
        grant, url = outward.run_proxy("token:bob", "r_1", 30, "c0" * 32)
        assert url.startswith("http://run:") and url.endswith("@127.0.0.1:3128")
        outward.run_ended(grant, 30)
        with anyio.fail_after(10):
            await engine.event("op end").wait()  # written by the proxy's queue, off the run's path
        engine.stop()
        with anyio.fail_after(20):
            await engine.event("boot 2").wait()
            while not outward.proxy.ready.is_set():  # noqa: ASYNC110 - a new Event at each start of the proxy
                await anyio.sleep(0.01)
        assert engine.removed == ["proxy-1"]
        assert engine.boots[1]["ca_key"].startswith("-----BEGIN PRIVATE KEY")  # the kept CA, given back
        again = [m.get("op") for m in engine.heard[1]]
        assert again[:4] == ["config", "usage", "narrow", "end"]
        assert await outward.proxy.ping() >= 0
        tg.cancel_scope.cancel()


async def test_under_gvisor_without_host_uds_egress_says_why_it_cannot_work(tmp_path: Path) -> None:
    engine = PlayedProxy(runsc_args=["--network=none", "--oci-seccomp"])
    async with anyio.create_task_group() as tg:
        engine.tg = tg
        outward = egress(engine, tmp_path, runtime="runsc")
        await outward.start(tg)
        assert outward.unreachable is not None and "--host-uds=open" in outward.unreachable
        tg.cancel_scope.cancel()
    fine = PlayedProxy(runsc_args=["--network=none", "--host-uds=open"])
    async with anyio.create_task_group() as tg:
        fine.tg = tg
        outward = egress(fine, tmp_path, runtime="runsc")
        await outward.start(tg)
        assert outward.unreachable is None
        tg.cancel_scope.cancel()


def test_a_session_keeps_one_grant_per_container_and_each_run_starts_its_budget_again(tmp_path: Path) -> None:
    engine = PlayedProxy()
    outward = egress(engine, tmp_path)
    here, there = "c0" * 32, "d1" * 32
    first = outward.session_proxy("s_1", "token:alice", ("a.example", "b.example"), here)
    assert outward.session_proxy("s_1", "token:alice", ("a.example",), here) == first  # the same token in it
    moved = outward.session_proxy("s_1", "token:alice", ("a.example",), there)  # a new container: a token of its own
    assert moved[0] == first[0] and moved[1] != first[1]
    token = first[1].split("run:", 1)[1].split("@", 1)[0]
    assert first[0] == tokens.session_grant("s_1") and "s_1" not in token  # the session id is not in it
    outward.session_closed("s_1")
    assert first[0] in outward.ended


def test_the_tools_say_egress_only_where_it_is_on() -> None:
    off = tool_descriptions(load_config(environ={}))
    on = tool_descriptions(load_config(environ={}, overrides={"egress": {"allow": ["a.example"]}}))
    assert off["restrict_egress"] == "" and "egress" not in off["new_session"]
    assert on["restrict_egress"] and "never widen" in on["restrict_egress"] and "egress:" in on["new_session"]


def test_the_ended_grants_kept_for_a_restart_are_dropped_once_past_their_expiry(tmp_path: Path) -> None:
    """A stateless run's end is kept to give a restarted proxy again; a server of many runs must not
    keep every one it ever ended."""
    outward = egress(PlayedProxy(), tmp_path)
    outward.ended = {f"old-{n}": 1.0 for n in range(service.ENDED_KEPT + 1)}  # expired long ago
    live, _ = outward.run_proxy("token:bob", "r_1", 30, "c0" * 32)
    outward.run_ended(live, 30)
    assert list(outward.ended) == [live]


def test_only_the_relays_group_is_given_the_proxys_socket(tmp_path: Path) -> None:
    """The proxy container is in the relay's group and makes its socket that group's alone: the
    sandbox user (another uid, not in it) cannot connect around the relay and its connection cap."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "images" / "python" / "agent"))
    from mcpx_agent.relay import RELAY_UID

    outward = egress(PlayedProxy(), tmp_path)
    assert outward.proxy.spec.socket_gid == RELAY_UID
    assert outward._boot()["socket_gid"] == RELAY_UID


def test_the_heads_budget_shares_the_proxys_spare_memory_and_refuses_too_little() -> None:
    assert service.heads_budget(128, 24) == (128 - service.PROXY_IDLE_MIB << 20) // (25 * service.HEAD_COST)
    assert service.heads_budget(4096, 24) == service.HEADS_BUDGET_MAX
    with pytest.raises(EgressError, match="at least 97"):
        service.heads_budget(96, 64)
