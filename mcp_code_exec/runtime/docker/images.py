"""Image operations for the ``image`` command: slow, one-off, never on a request path."""

from __future__ import annotations

import functools
from collections.abc import Callable

import anyio
import anyio.to_thread

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

    async def build(
        self,
        context: str,
        image: str,
        buildargs: dict[str, str],
        on_line: Callable[[str], None],
        *,
        dockerfile: str | None = None,
    ) -> None:
        def _build() -> None:
            stream = self.engine.client.api.build(
                path=context, tag=image, buildargs=buildargs, rm=True, forcerm=True, decode=True, dockerfile=dockerfile
            )
            for chunk in stream:
                if "error" in chunk:
                    raise EngineError(f"image build failed: {str(chunk['error']).strip()}")
                text = str(chunk.get("stream", "")).rstrip()
                if text:
                    on_line(text)

        await self.engine.call(_build)
