"""Building the egress proxy's image (``mcp-code-exec image egress``), offline if need be.

As the sandbox image: the locked wheels (images/egress/requirements.lock: mitmproxy and what it
needs, for CPython 3.13) are fetched with the host's pip into a copy of the build context and
installed offline, hash-checked; the base is Debian trixie, pulled or made with debootstrap from
the machine's own apt mirror where no registry answers.
"""

from __future__ import annotations

import functools
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import anyio.to_thread

from ..config.egress import DEFAULT_IMAGE
from ..egress.image import context_dir, context_hash
from ..errors import EngineError, WheelError
from ..service.packages import wheels
from .image import EGRESS_BASE, EGRESS_OFFLINE_BASE, ensure_base


async def build_egress(
    image: str = DEFAULT_IMAGE,
    *,
    base: str | None = None,
    docker_host: str | None = None,
    wheel_cache: str | None = None,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
) -> float:
    """Build the proxy's image; returns the seconds it took."""
    from ..runtime.docker.engine import DockerEngine
    from ..runtime.docker.images import ImageBuilder

    started = time.monotonic()
    engine = await DockerEngine.connect(docker_host)
    try:
        builder = ImageBuilder(engine)
        chosen = await ensure_base(builder, base, log, default=EGRESS_BASE, offline=EGRESS_OFFLINE_BASE, suite="trixie")
        arch = wheels.sandbox_arch(await engine.architecture())
        with tempfile.TemporaryDirectory(prefix="mcp-code-exec-egress-build-") as tmp:
            context = Path(tmp, "context")
            await anyio.to_thread.run_sync(functools.partial(prepare_context, context, arch, wheel_cache, log))
            log(f"building {image} on {chosen}")
            arguments = {"BASE_IMAGE": chosen, "CONTEXT_HASH": context_hash()}
            await builder.build(str(context), image, arguments, lambda line: log("  " + line))
    finally:
        await engine.aclose()
    return time.monotonic() - started


def prepare_context(context: Path, arch: str, wheel_cache: str | None, log: Callable[[str], None]) -> None:
    """A copy of the build context (links followed: hostpatterns.py is the server's own module) with
    the locked wheels for ``arch`` in ``wheels/``."""
    shutil.copytree(context_dir(), context, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "wheels"))
    pins = list(wheels.read_lock((context / "requirements.lock").read_text()).values())
    cache = wheels.cache_root(wheel_cache) / f"egress-{arch}"
    log(f"fetching {len(pins)} locked wheels of the egress proxy for {arch} into {cache}")
    try:
        found = wheels.fetch(pins, arch, cache, wheels.EGRESS_PROXY)
    except WheelError as exc:
        raise EngineError(f"the egress proxy's packages could not be fetched: {exc}") from None
    wheels.copy_into(found, context / "wheels")
