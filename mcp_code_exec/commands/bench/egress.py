"""Egress figures, when the proxy's image is present: an allowed HTTPS GET through the proxy against
the same GET from the host, the proxy's idle memory, and what egress costs runs that do not use it
(a stateless ``print(1+1)`` and a warm container's memory with ``[egress]`` on).

The allowed host is the bench's own: an HTTPS server on the engine's bridge gateway (the address
the proxy's container reaches the host by), with a certificate of a throwaway CA made by the
host's ``openssl`` and given to the proxy as ``upstream_ca``; ``allow`` names its address and port.
Each GET opens a new connection, from the host as from the sandbox (its code times its own GETs).
"""

from __future__ import annotations

import ipaddress
import json
import shutil
import ssl
import subprocess
import tempfile
import threading
import urllib.request
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from ...config.settings import Config
from ...config.units import MIB
from ...egress.image import image_status
from ...runtime.docker.engine import DockerEngine
from ...service.facade import SandboxService
from .calls import PRINT
from .measure import Bench

BODY = b'{"ok": true}'
# One TLS context, as the host's client has (loading the CA bundle is not the proxy's cost).
TIMED = (
    "import json, ssl, time, urllib.request\n"
    "context = ssl.create_default_context()\n"
    "samples = []\n"
    "for _ in range(COUNT + 3):\n"
    "    began = time.perf_counter()\n"
    "    urllib.request.urlopen('URL', timeout=30, context=context).read()\n"
    "    samples.append((time.perf_counter() - began) * 1000)\n"
    "print(json.dumps(samples[3:]))\n"
)


class Quiet(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY)

    def log_message(self, format: str, *args: Any) -> None:
        pass


async def egress(bench: Bench) -> None:
    config = bench.config
    if shutil.which("openssl") is None:
        return  # no openssl to make the bench's own host's certificate
    engine = await DockerEngine.connect(config.docker_host, disk_image=config.image)  # the service closes it
    if await image_status(engine, config.egress.image) != "current":
        await engine.aclose()
        return  # no proxy image: `mcp-code-exec image egress`
    bridge = (await engine.call(engine.client.api.inspect_network, "bridge"))["IPAM"]["Config"][0]
    gateway = str(bridge.get("Gateway") or next(ipaddress.ip_network(bridge["Subnet"]).hosts()))  # where it is unsaid
    with tempfile.TemporaryDirectory(prefix="mcpx-bench-egress-") as tmp:
        ca, context = await anyio.to_thread.run_sync(certificates, Path(tmp), gateway)
        server = ThreadingHTTPServer((gateway, 0), Quiet)
        server.socket = context.wrap_socket(server.socket, server_side=True)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        entry = f"{gateway}:{server.server_address[1]}"
        try:
            await _measure(bench, engine, with_egress(config, ca, Path(tmp), entry), f"https://{entry}/", ca)
        finally:
            server.shutdown()


def certificates(tmp: Path, address: str) -> tuple[Path, ssl.SSLContext]:
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", str(tmp / "ca.key"), "-out", str(tmp / "ca.pem"), "-days", "1", "-subj", "/CN=bench CA",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
            str(tmp / "host.key"), "-out", str(tmp / "host.csr"), "-subj", f"/CN={address}")  # fmt: skip
    (tmp / "ext").write_text(f"subjectAltName=IP:{address}\nextendedKeyUsage=serverAuth\n")
    openssl("x509", "-req", "-in", str(tmp / "host.csr"), "-CA", str(tmp / "ca.pem"), "-CAkey", str(tmp / "ca.key"),
            "-CAcreateserial", "-out", str(tmp / "host.pem"), "-days", "1", "-extfile", str(tmp / "ext"))  # fmt: skip
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tmp / "host.pem", tmp / "host.key")
    return tmp / "ca.pem", context


def with_egress(config: Config, ca: Path, state: Path, entry: str) -> Config:
    egress = config.egress.model_copy(update={"allow": [], "secrets": []})
    settings = egress.model_validate(
        {**egress.model_dump(), "allow": [entry], "upstream_ca": str(ca), "state_dir": str(state / "state")}
    )
    pool = config.pool.model_copy(update={"size": 1, "session_spares": 0})
    return config.model_copy(update={"egress": settings, "pool": pool})


async def _measure(bench: Bench, engine: DockerEngine, config: Config, url: str, ca: Path) -> None:
    count = bench.plan.tool_calls
    host = bench.metric("egress_host", "HTTPS GET from the host (new connection)")
    through = bench.metric("egress_proxy", "  the same from a sandbox, through the egress proxy")
    context = ssl.create_default_context(cafile=str(ca))

    async def from_host() -> bool:
        fetch = partial(urllib.request.urlopen, url, timeout=30, context=context)
        return bool(await anyio.to_thread.run_sync(lambda: fetch().read()))

    async with SandboxService.start(config, engine=engine) as service:
        outward = service.egress.egress
        assert outward is not None
        with anyio.fail_after(120):
            await outward.proxy.ready.wait()
        await service.wait_ready()
        await bench.sample(host, count, from_host)
        result = await service.run("bench-egress", TIMED.replace("COUNT", str(count)).replace("URL", url), timeout=300)
        if result.status == "ok":
            through.samples += json.loads(result.stdout)
        else:
            through.failures += 1
            through.note = f"{result.status}: {result.error.message if result.error else ''}"[:200]
        runs = bench.metric("egress_idle_print", "stateless print(1+1) with [egress] on, not used")
        await bench.sample(runs, bench.plan.prints // 2, lambda: _printed(service))
        await anyio.sleep(5)  # idle: the proxy's memory at rest
        assert outward.proxy.container_id is not None
        memory = await engine.memory_usage(outward.proxy.container_id)
        bench.metric("egress_memory", "the egress proxy's idle memory", unit="MiB", value=memory.docker_stats / MIB)
        per = [await engine.memory_usage(c) for c in sorted(service.stateless_pool.container_ids())]
        if per:
            bench.metric("egress_container", "idle memory per warm container, [egress] on", unit="MiB",
                         value=sum(m.docker_stats for m in per) / len(per) / MIB)  # fmt: skip


async def _printed(service: SandboxService) -> bool:
    result = await service.run("bench", PRINT)
    return result.status == "ok" and result.stdout == "2\n"
