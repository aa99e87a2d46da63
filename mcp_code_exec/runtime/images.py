"""Whether an image on the engine was built from the build context this version ships.

Each image this project builds (the sandbox's, the egress proxy's) carries the hash of its build
context as a label (``LABEL_CONTEXT``); an image built from another context is stale. The sandbox
image's and the proxy's modules (``sandbox/image.py``, ``egress/image.py``) name their context and
say how to build it; the hash and the check are these.
"""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path
from typing import Literal

from .base import LABEL_CONTEXT, ContainerEngine

ImageStatus = Literal["current", "stale", "missing"]


def packaged_context(name: str) -> Path:
    """The build context ``images/<name>``: packaged with the wheel, or the repository's."""
    package = Path(__file__).resolve().parents[1]
    packaged = package / "_images" / name
    if (packaged / "Dockerfile").exists():
        return packaged
    return package.parent / "images" / name


@cache
def context_hash(root: Path) -> str:
    """The hash of a build context's files (their paths and bytes; compiled Python left out)."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


async def image_status(engine: ContainerEngine, image: str, built_from: str) -> ImageStatus:
    """Whether ``image`` is there, and built from the context whose hash is ``built_from``."""
    labels = await engine.image_labels(image)
    if labels is None:
        return "missing"
    label = labels.get(LABEL_CONTEXT)
    return "current" if label is None or label == built_from else "stale"
