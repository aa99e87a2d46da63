"""Following a run from a tool call: stream its new output as progress, for as long as the call waits."""

from __future__ import annotations

from contextlib import aclosing

import anyio
from mcp.server.mcpserver import Context

from ..service.run_registry import Run
from .sdk import progress_requested

MESSAGE_MAX = 4000
INTERVAL_S = 0.1  # at most ten progress notifications a second


async def follow(run: Run, ctx: Context, wait_s: float) -> bool:
    """Wait up to ``wait_s`` for ``run`` to end, reporting its output as progress when the caller asked
    for it. True when it ended. Cancelling the caller does not stop the run (the caller decides)."""
    with anyio.move_on_after(wait_s):
        if progress_requested(ctx):
            await _report_until_done(run, ctx)
        else:
            await run.finished.wait()
    return run.done


async def _report_until_done(run: Run, ctx: Context) -> None:
    count = 0
    async with aclosing(run.output.follow(from_now=True)) as batches:
        async for batch in batches:
            if run.done:
                return  # its whole output is in the result the caller gets now
            for stream, text in batch:
                count += 1
                prefix = "" if stream == "stdout" else "[stderr] "
                await ctx.report_progress(count, None, prefix + text[-MESSAGE_MAX:])
            with anyio.move_on_after(INTERVAL_S):  # pacing: batch output between notifications, not past the end
                await run.finished.wait()
