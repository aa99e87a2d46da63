"""Whether the engine's egress proxy image is the one this version builds (as ``sandbox.image``
does for the sandbox image): its build context's hash is a label of the image."""

from __future__ import annotations

from pathlib import Path

from ..errors import ImageMissing
from ..runtime import images
from ..runtime.base import ContainerEngine
from ..runtime.images import ImageStatus

BUILD_COMMAND = "mcp-code-exec image egress"


def context_dir() -> Path:
    """The proxy image's build context: packaged with the wheel, or the repository's images/egress."""
    return images.packaged_context("egress")


def context_hash() -> str:
    return images.context_hash(context_dir())


async def image_status(engine: ContainerEngine, image: str) -> ImageStatus:
    return await images.image_status(engine, image, context_hash())


async def require_current_image(engine: ContainerEngine, image: str) -> None:
    status = await image_status(engine, image)
    if status != "current":
        why = "is not present" if status == "missing" else "was built from another version of this server"
        raise ImageMissing(f"the egress proxy's image {image!r} {why}; build it with `{BUILD_COMMAND}`")
