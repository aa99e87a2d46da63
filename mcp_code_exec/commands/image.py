"""Building the sandbox image, offline if need be.

The base image is a build argument. Where none can be pulled (no registry), a Debian base is
made from the machine's own apt mirror with debootstrap (``offline_base``) and imported into the engine.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import anyio
import anyio.to_thread

from ..errors import EngineError, WheelError
from ..sandbox.image import BUILD_COMMAND, context_dir, context_hash
from ..service.packages import wheels
from .offline_base import make_offline_rootfs, remove_without_crossing_mounts

DEFAULT_BASE = "debian:bookworm-slim"
OFFLINE_BASE = "mcp-code-exec-base:bookworm"
# The egress proxy's base: Debian trixie (mitmproxy 12 needs Python 3.12 or newer).
EGRESS_BASE = "debian:trixie-slim"
EGRESS_OFFLINE_BASE = "mcp-code-exec-base:trixie"


async def ensure_base(
    builder: object,
    base: str | None,
    log: Callable[[str], None],
    *,
    default: str = DEFAULT_BASE,
    offline: str = OFFLINE_BASE,
    suite: str = "bookworm",
) -> str:
    """Pick (or make) the base image: explicit, local, pulled, or made offline (Debian ``suite``)."""
    from ..runtime.docker.images import ImageBuilder

    assert isinstance(builder, ImageBuilder)
    if base:
        if await builder.present(base) or await builder.pull(base):
            return base
        raise EngineError(f"base image {base!r} is not present and cannot be pulled")
    for candidate in (default, offline):
        if await builder.present(candidate):
            return candidate
    log(f"pulling {default}")
    if await builder.pull(default):
        return default
    log(f"no registry answers; making {offline} offline")
    tarball = await make_offline_rootfs(log, suite, default)
    try:
        await builder.import_rootfs(tarball, offline)
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(remove_without_crossing_mounts, os.path.dirname(tarball), log)
    return offline


async def build(
    image: str,
    *,
    base: str | None = None,
    extra_apt: str = "",
    docker_host: str | None = None,
    wheel_cache: str | None = None,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
) -> None:
    from ..runtime.docker.engine import DockerEngine
    from ..runtime.docker.images import ImageBuilder

    engine = await DockerEngine.connect(docker_host)
    try:
        builder = ImageBuilder(engine)
        chosen = await ensure_base(builder, base, log)
        arch = wheels.sandbox_arch(await engine.architecture())
        with tempfile.TemporaryDirectory(prefix="mcp-code-exec-build-") as tmp:
            context = Path(tmp, "context")
            await anyio.to_thread.run_sync(functools.partial(prepare_context, context, arch, wheel_cache, log))
            log(f"building {image} on {chosen}")
            await builder.build(
                str(context),
                image,
                {"BASE_IMAGE": chosen, "CONTEXT_HASH": context_hash(), "EXTRA_APT_PACKAGES": extra_apt},
                lambda line: log("  " + line),
            )
    finally:
        await engine.aclose()


def prepare_context(context: Path, arch: str, wheel_cache: str | None, log: Callable[[str], None]) -> None:
    """A copy of the build context with the locked wheels for ``arch`` in ``wheels/``."""
    shutil.copytree(context_dir(), context, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "wheels"))
    pins = list(wheels.read_lock((context / "requirements.lock").read_text()).values())
    cache = wheels.cache_root(wheel_cache) / arch
    log(f"fetching {len(pins)} locked wheels for {arch} into {cache} (the host's pip; only missing ones download)")
    try:
        found = wheels.fetch(pins, arch, cache)
    except WheelError as exc:
        raise EngineError(f"the image's packages could not be fetched: {exc}") from None
    wheels.copy_into(found, context / "wheels")


def fetch_requirements(requirements: Path, into: Path, arch: str, log: Callable[[str], None]) -> None:
    """Resolve a requirements file against the image's lock and put the wheels it adds in ``into``."""
    lock = wheels.read_lock((context_dir() / "requirements.lock").read_text())
    lines = [line.strip() for line in requirements.read_text().splitlines()]
    wanted = [line for line in lines if line and not line.startswith("#")]
    into.mkdir(parents=True, exist_ok=True)
    if not wanted:
        return
    try:
        pins = [pin for pin in wheels.resolve(wanted, arch, constraints=lock) if pin.name not in lock]
        log(f"fetching {len(pins)} wheels for {arch}: " + ", ".join(f"{pin.name}=={pin.version}" for pin in pins))
        wheels.copy_into(wheels.fetch(pins, arch, wheels.cache_root() / arch), into)
    except WheelError as exc:
        raise EngineError(f"the requirements could not be fetched: {exc}") from None


# The zygote's preloaded modules in one file (images/python/agent/mcpx_agent/zygote/bundle.py), written by
# importing what the zygote imports; the caches that leaves in /run/mcpx are not kept.
BUNDLE_STEP = "RUN python3 -P -m mcpx_agent.zygote.bundle && rm -rf /run/mcpx"


def custom_dockerfile(from_image: str, apt: str = "", requirements: bool = False, snippet: str = "") -> str:
    """A Dockerfile that adds packages on top of the sandbox image (the agent stays as it is)."""
    lines = [f"FROM {from_image}", "USER root"]
    if apt.strip():
        lines.append(
            "RUN apt-get update && apt-get install -y --no-install-recommends "
            f"{apt.strip()} && apt-get clean && rm -rf /var/lib/apt/lists/*"
        )
    if requirements:
        # Wheels the host fetched (resolved against the image's own lock, so nothing it ships moves);
        # installed offline and hash-checked, like the image's own.
        lines.append("COPY wheels/ /tmp/wheels/")
        lines.append(
            "RUN python3 -m pip install --no-index --find-links /tmp/wheels --break-system-packages "
            "--root-user-action=ignore --no-cache-dir --disable-pip-version-check /tmp/wheels/*.whl "
            "&& python3 -m pip check && rm -rf /tmp/wheels"
        )
    if snippet.strip():
        lines.append(snippet.strip())
    lines.append("RUN find / -xdev -perm /6000 -type f -exec chmod a-s {} + || true")
    lines.append(BUNDLE_STEP)  # the packages changed: the base image's bundle no longer matches
    lines.append('CMD ["python3", "-u", "-P", "-m", "mcpx_agent"]')
    return "\n".join(lines) + "\n"


async def build_custom(
    tag: str,
    from_image: str,
    *,
    apt: str = "",
    requirements: str | None = None,
    snippet: str | None = None,
    docker_host: str | None = None,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
) -> None:
    from ..runtime.docker.engine import DockerEngine
    from ..runtime.docker.images import ImageBuilder

    snippet_text = Path(snippet).read_text() if snippet else ""  # noqa: ASYNC240 - one small file, CLI only
    engine = await DockerEngine.connect(docker_host)
    try:
        builder = ImageBuilder(engine)
        if not await builder.present(from_image):
            raise EngineError(f"the image to extend, {from_image!r}, is not present; build it with `{BUILD_COMMAND}`")
        with tempfile.TemporaryDirectory(prefix="mcp-code-exec-custom-") as context:
            if requirements:
                arch = wheels.sandbox_arch(await engine.architecture())
                fetch = functools.partial(fetch_requirements, Path(requirements), Path(context, "wheels"), arch, log)
                await anyio.to_thread.run_sync(fetch)
            Path(context, "Dockerfile").write_text(  # noqa: ASYNC240 - CLI only, before a minutes-long build
                custom_dockerfile(from_image, apt, bool(requirements), snippet_text)
            )
            log(f"building {tag} from {from_image}")
            await builder.build(context, tag, {}, lambda line: log("  " + line))
    finally:
        await engine.aclose()
