"""Whether the engine's sandbox image is the one this version of the agent builds.

The image carries the hash of its build context (the agent, the Dockerfile, the lock) as a label;
an image built from another context is stale. Building it is ``commands/image.py``'s.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ImageMissing
from ..runtime import images
from ..runtime.base import ContainerEngine
from ..runtime.images import ImageStatus

BUILD_COMMAND = "mcp-code-exec image build"


def context_dir() -> Path:
    """The image's build context: packaged with the wheel, or the repository's images/python."""
    return images.packaged_context("python")


def context_hash() -> str:
    return images.context_hash(context_dir())


async def image_status(engine: ContainerEngine, image: str) -> ImageStatus:
    """Whether the image is there, and built from this version of the agent (the one check of it)."""
    return await images.image_status(engine, image, context_hash())


async def require_current_image(engine: ContainerEngine, image: str) -> None:
    status = await image_status(engine, image)
    if status == "missing":
        raise ImageMissing(f"the sandbox image {image!r} is not present; build it with `{BUILD_COMMAND}`")
    if status == "stale":
        raise ImageMissing(
            f"the sandbox image {image!r} was built from another version of the agent; "
            f"rebuild it with `{BUILD_COMMAND}`"
        )


async def image_is_current(image: str, docker_host: str | None = None) -> bool:
    from ..runtime.docker.engine import DockerEngine

    engine = await DockerEngine.connect(docker_host)
    try:
        return await image_status(engine, image) == "current"
    finally:
        await engine.aclose()
