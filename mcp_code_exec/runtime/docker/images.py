"""Image operations for the ``image`` command: slow, one-off, never on a request path."""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable

import anyio
import anyio.to_thread
import docker.utils

from ...errors import EngineError
from .engine import DockerEngine


class ImageBuilder:
    """Image operations for the ``image`` command (slow, one-off; not on any request path)."""

    def __init__(self, engine: DockerEngine) -> None:
        self.engine = engine

    async def present(self, image: str) -> bool:
        return await self.engine.image_labels(image) is not None

    async def pull(self, image: str, timeout_s: float = 60.0) -> bool:
        repository, _, tag = image.partition(":")
        try:
            with anyio.fail_after(timeout_s):
                await anyio.to_thread.run_sync(
                    functools.partial(self.engine.client.api.pull, repository, tag=tag or "latest"),
                    abandon_on_cancel=True,
                )
        except (Exception, TimeoutError):  # noqa: BLE001 - no registry is an expected outcome here
            return False
        return await self.present(image)

    async def import_rootfs(self, tar_path: str, image: str) -> None:
        repository, _, tag = image.partition(":")

        def _import() -> None:
            self.engine.client.api.import_image_from_file(tar_path, repository=repository, tag=tag or "latest")

        await self.engine.call(_import)

    async def build(self, context: str, image: str, buildargs: dict[str, str], on_line: Callable[[str], None]) -> None:
        """Build ``context`` (a directory with a Dockerfile) as ``image``. Cancelled, the call is
        abandoned: the engine cancels the build when this process's connection to it closes."""

        def _build() -> None:
            # The context's archive is an unnamed file, gone with the process however it ends (the
            # SDK's own is a named one, left behind by a process stopped while it uploads it).
            with tempfile.TemporaryFile() as archive:
                docker.utils.tar(context, fileobj=archive)
                stream = self.engine.client.api.build(
                    fileobj=archive,
                    custom_context=True,
                    tag=image,
                    buildargs=buildargs,
                    rm=True,
                    forcerm=True,
                    decode=True,
                )
                for chunk in stream:
                    if "error" in chunk:
                        raise EngineError(f"image build failed: {str(chunk['error']).strip()}")
                    text = str(chunk.get("stream", "")).rstrip()
                    if text:
                        on_line(text)

        await self.engine.call(_build)
