"""Finished runs wait for their owner in bounded server memory, and one client's flood of
unfetched results sheds its own, never another client's."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import pytest
from _support import make_test_config

from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio

# Four incompressible 256x256 PNGs (~190 KiB each) per run, never fetched by the one who asked.
PICTURES = (
    "import numpy as np, io\nfrom PIL import Image as P\nfrom IPython.display import display, Image\n"
    "for _ in range(4):\n    buffer = io.BytesIO()\n"
    "    P.fromarray(np.random.randint(0, 256, (256, 256, 3), dtype=np.uint8)).save(buffer, format='PNG')\n"
    "    display(Image(data=buffer.getvalue()))"
)


@pytest.fixture(scope="module")
async def tight() -> AsyncIterator[SandboxService]:
    config = make_test_config(runs={"max_kept_mb": 2}, pool={"size": 2, "session_spares": 0})
    async with SandboxService.start(config) as service:
        yield service


async def test_a_flood_of_unfetched_images_stays_in_budget_and_spares_another_clients_result(
    tight: SandboxService,
) -> None:
    victim = await tight.start_run("victim", PICTURES)
    with anyio.fail_after(60):
        await victim.finished.wait()
    flood = []
    for _ in range(8):
        flood.append(await tight.start_run("flooder", PICTURES))
        with anyio.fail_after(60):
            await flood[-1].finished.wait()
    kept = tight.run_registry.get(victim.id, "victim").result  # a look at the registry settles its books
    assert tight.run_registry.kept_bytes <= 2 << 20
    assert kept is not None and len(kept.images) == 4
    oldest = tight.run_registry.get(flood[0].id, "flooder").result
    assert oldest is not None and oldest.images == [] and "dropped before anyone fetched them" in oldest.notes[-1]
    newest = tight.run_registry.get(flood[-1].id, "flooder").result
    assert newest is not None and len(newest.images) == 4
