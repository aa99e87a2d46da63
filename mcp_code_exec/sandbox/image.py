"""Whether the engine's sandbox image is the one this version of the agent builds.

The image carries the hash of its build context (the agent, the Dockerfile, the lock) as a label;
an image built from another context is stale. Building it is ``commands/image.py``'s.
"""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path
from typing import Literal

from ..errors import ImageMissing
from ..runtime.base import LABEL_CONTEXT, ContainerEngine

BUILD_COMMAND = "mcp-code-exec image build"


def context_dir() -> Path:
    """The image's build context: packaged with the wheel, or the repository's images/python."""
    package = Path(__file__).resolve().parents[1]
    packaged = package / "_images" / "python"
    if (packaged / "Dockerfile").exists():
        return packaged
    return package.parent / "images" / "python"


@cache
def context_hash() -> str:
    digest = hashlib.sha256()
    root = context_dir()
    for path in sorted(root.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


ImageStatus = Literal["current", "stale", "missing"]


async def image_status(engine: ContainerEngine, image: str) -> ImageStatus:
    """Whether the image is there, and built from this version of the agent (the one check of it)."""
    labels = await engine.image_labels(image)
    if labels is None:
        return "missing"
    built_from = labels.get(LABEL_CONTEXT)
    return "current" if built_from is None or built_from == context_hash() else "stale"


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
