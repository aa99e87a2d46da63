"""Following a run from a tool call: stream its new output as progress, for as long as the call waits."""

from __future__ import annotations

import anyio
from mcp.server.mcpserver import Context

from ..service.runs import Run
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
    positions = {stream: run.output.end(stream) for stream in ("stdout", "stderr")}
    count = 0
    while not run.done:
        changed = run.output.renew()
        if all(run.output.end(stream) == positions[stream] for stream in positions):
            await changed.wait()  # set by new output and by the run's end
        if run.done:
            return  # its whole output is in the result the caller gets now
        for stream in ("stdout", "stderr"):
            text = run.output.since(stream, positions[stream])
            positions[stream] = run.output.end(stream)
            if text:
                count += 1
                prefix = "" if stream == "stdout" else "[stderr] "
                await ctx.report_progress(count, None, prefix + text[-MESSAGE_MAX:])
        with anyio.move_on_after(INTERVAL_S):  # pacing: batch output between notifications, not past the end
            await run.finished.wait()
