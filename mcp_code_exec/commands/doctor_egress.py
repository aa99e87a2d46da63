"""``doctor``'s egress checks, when ``[egress] allow`` names hosts: the proxy's image, gVisor's
``--host-uds=open``, then (in the probe service) the proxy answering and a sandbox's request to a
made-up host refused by it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio

from ..config.settings import Config
from ..egress.image import BUILD_COMMAND, image_status
from ..egress.sandboxes import HOST_UDS_FLAGS
from ..errors import SandboxError

if TYPE_CHECKING:
    from .doctor import Report

PROXY_WAIT_S = 90.0
REFUSAL_PROBE = (
    "import urllib.request\n"
    "try:\n"
    "    urllib.request.urlopen('https://egress-doctor.invalid/', timeout=20)\n"
    "    print('reached')\n"
    "except Exception as exc:\n"
    "    print(exc)\n"
)


async def before_sandbox(engine: Any, config: Config, report: Report) -> bool:
    """The proxy's image, and (under gVisor) the flag that lets sandboxes reach its socket."""
    if not config.egress.enabled:
        return True
    image = config.egress.image
    try:
        status = await image_status(engine, image)
    except SandboxError as exc:
        report.fail("egress image", str(exc), f"run `{BUILD_COMMAND}`")
        return False
    if status != "current":
        why = "is not present" if status == "missing" else "was built from another version of this server"
        report.fail("egress image", f"{image!r} {why}", f"run `{BUILD_COMMAND}`")
        return False
    report.ok("egress image", f"{image} is present and current")
    if config.runtime == "runsc":
        args = await engine.runtime_args("runsc") or []
        if not any(flag in args for flag in HOST_UDS_FLAGS):
            report.fail(
                "egress under gVisor",
                f"runsc is registered with {args} and without --host-uds=open: sandboxes cannot reach the proxy's "
                "socket, so every egress request fails",
                'add "--host-uds=open" to its runtimeArgs in /etc/docker/daemon.json and reload dockerd (SIGHUP); '
                "`sudo scripts/ensure-docker.sh` does it",
            )
            return False
        report.ok("egress under gVisor", "runsc lets sandboxes reach the proxy's socket (--host-uds=open)")
    return True


async def probe(service: Any, config: Config, report: Report) -> None:
    """The proxy answers, and refuses a sandbox's request to a host nobody allowed, with its 403."""
    outward = service.egress.egress
    if outward is None:
        return
    with anyio.move_on_after(PROXY_WAIT_S):
        await outward.proxy.ready.wait()
    if not outward.proxy.ready.is_set():
        report.fail("egress proxy", f"the proxy did not start ({outward.proxy.last_error})", "check `docker logs`")
        return
    try:
        took = await outward.proxy.ping()
    except SandboxError as exc:
        report.fail("egress proxy", f"the proxy does not answer ({exc})", "check the engine")
        return
    report.ok("egress proxy", f"the proxy runs and answers in {took * 1000:.1f} ms")
    result = await service.run("doctor", REFUSAL_PROBE, timeout=60)
    said = result.stdout.strip()
    if result.status == "ok" and "403 egress refused" in said:
        report.ok("egress policy", "a sandbox's request to a host nobody allowed is refused by the proxy (403)")
    else:
        fix = outward.unreachable or "check that sandboxes mount the proxy's socket volume (see docs/egress.md)"
        report.fail("egress policy", f"a request to a made-up host ended {result.status}: {said[:300]!r}", fix)
