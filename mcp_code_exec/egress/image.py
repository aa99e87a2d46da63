"""Whether the engine's egress proxy image is the one this version builds (as ``sandbox.image``
does for the sandbox image): its build context's hash is a label of the image."""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path
from typing import Literal

from ..errors import ImageMissing
from ..runtime.base import LABEL_CONTEXT, ContainerEngine

BUILD_COMMAND = "mcp-code-exec image egress"


def context_dir() -> Path:
    """The proxy image's build context: packaged with the wheel, or the repository's images/egress."""
    package = Path(__file__).resolve().parents[1]
    packaged = package / "_images" / "egress"
    if (packaged / "Dockerfile").exists():
        return packaged
    return package.parent / "images" / "egress"


@cache
def context_hash() -> str:
    digest = hashlib.sha256()
    root = context_dir()
    for path in sorted(root.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


async def image_status(engine: ContainerEngine, image: str) -> Literal["current", "stale", "missing"]:
    labels = await engine.image_labels(image)
    if labels is None:
        return "missing"
    built_from = labels.get(LABEL_CONTEXT)
    return "current" if built_from is None or built_from == context_hash() else "stale"


async def require_current_image(engine: ContainerEngine, image: str) -> None:
    status = await image_status(engine, image)
    if status != "current":
        why = "is not present" if status == "missing" else "was built from another version of this server"
        raise ImageMissing(f"the egress proxy's image {image!r} {why}; build it with `{BUILD_COMMAND}`")
