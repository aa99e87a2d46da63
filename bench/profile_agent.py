"""Where a stateless run's time goes inside the container, in figures that do not depend on load.

Starts one warm container exactly as the server does (the configuration's image, limits and
hardened flags), with the agent wrapped so that each reply carries the worker's counts, and runs
stateless cells in it. Per run it reports:

- the copy-on-write and other page faults the worker takes, before the request (fork, warm-up)
  and while running the cell: the dominant cost of a forked CPython, and stable across runs;
- the worker's time for the cell, the agent's time from request to reply, and the round trip as
  the server sees it (these depend on the machine's load).

    mcp-code-exec image build                           # the agent profiled is the image's
    python bench/profile_agent.py                       # print(1+1), 200 runs
    python bench/profile_agent.py --code 'import pandas' --runs 50 --pause 0.05
    python bench/profile_agent.py --env MCPX_SPLIT_BEFORE_IMPORTS=1   # an agent switch, A/B

It ends with the container's idle memory (as the bench's "idle memory per warm container" reads
it) and how much of the zygote's heap is on huge pages.

Timings on a shared machine move from run to run; fault counts do not: compare those.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import secrets
import statistics
import sys
import time
from typing import Any

import anyio
import docker

from mcp_code_exec.config.settings import load_config
from mcp_code_exec.protocol.messages import RunOptions
from mcp_code_exec.runtime.base import LABEL_INSTANCE, LABEL_KIND, LABEL_OWNER
from mcp_code_exec.runtime.docker.engine import DockerEngine
from mcp_code_exec.sandbox.container import start_sandbox
from mcp_code_exec.sandbox.ownership import SANDBOX_UIDS, owner_token
from mcp_code_exec.sandbox.run_events import RawRun
from mcp_code_exec.sandbox.spec import container_spec

# Runs in the container instead of ``python3 -m mcpx_agent``: wraps the worker so that each
# reply carries the worker's fault counts and timings in its "result" field.
ENTRY = """
import resource, sys, time
from mcpx_agent import __main__ as agent
from mcpx_agent.worker import worker
def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
marks = {}
real_warm, real_execute, real_send = worker.warm_up, worker.execute, type(worker.SINK).send
def warm_up(shell):
    marks["before_warm"] = faults(); real_warm(shell); marks["after_warm"] = faults()
def execute(shell, code, options, **rehearsal):
    if not rehearsal:
        marks["start"], marks["t0"] = faults(), time.perf_counter()
    real_execute(shell, code, options, **rehearsal)
def send(sink, header, *args, **kwargs):
    if header.get("kind") == "done" and "t0" in marks:
        header["result"] = "%d %d %d %.3f" % (marks.get("before_warm", 0), marks.get("after_warm", 0)
            - marks.get("before_warm", 0), faults() - marks["start"], (time.perf_counter() - marks["t0"]) * 1000)
    return real_send(sink, header, *args, **kwargs)
worker.warm_up, worker.execute, type(worker.SINK).send = warm_up, execute, send
# The supervisor's stages, its own CPU (process_time) summed per stage, and the CPU of the
# supervisor, the zygotes (the full and the lean one, summed) and their reaped children (the
# workers) from /proc: all cumulative,
# in each done event's stderr (the host takes differences between runs).
import json, os
from mcpx_agent.supervisor import supervisor as sup, files, wipe, runner, spares
STAGES = {}
def timed(name, fn):
    def wrapped(*args, **kwargs):
        began = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            STAGES[name] = STAGES.get(name, 0.0) + time.process_time() - began
    return wrapped
def ticks(pid):
    fields = open("/proc/%d/stat" % pid).read().rpartition(")")[2].split()
    return [int(value) / os.sysconf("SC_CLK_TCK") for value in fields[11:15]]  # utime stime cutime cstime
real_send_event = sup.Supervisor.send
def send_event(self, header, payload=b""):
    kind = header.get("ev")
    if kind == "done":
        zygotes = [ticks(zygote.pid) for zygote in getattr(self, "zygotes", lambda: [self.zygote])()]
        header["stderr"] = json.dumps({"stages": STAGES, "supervisor": ticks(os.getpid()),
                                       "zygote": [sum(column) for column in zip(*zygotes)], "cpu": time.process_time()})
    timed("send " + str(kind), real_send_event)(self, header, payload)
sup.Supervisor.send = send_event
for name in ("take_worker", "kill_sandbox_processes", "next_request"):
    setattr(sup.Supervisor, name, timed(name, getattr(sup.Supervisor, name)))
spares.Spares.order = timed("order_spare", spares.Spares.order)  # every order, take_worker's too
runner.Runner.run = timed("run (to the worker's done)", runner.Runner.run)
files.collect = timed("collect files", files.collect)
wipe.wipe = timed("wipe", wipe.wipe)
sys.exit(agent.main())
"""
WARMUP_RUNS = 10  # not reported: the machine's caches fill during these
SETTLE_S = 1.0  # after the last run, before the memory is read: its clean-up and the next fork are done
MIB = 1 << 20


def service_options(config: object) -> RunOptions:
    limits = config.limits  # type: ignore[attr-defined]
    cap = limits.max_output_bytes
    return RunOptions(
        max_output_bytes=cap, max_result_bytes=cap, max_display_bytes=cap, max_displays=limits.max_displays,
        max_images=limits.max_images, max_image_bytes=limits.max_image_bytes, max_image_pixels=limits.max_image_pixels,
    )  # fmt: skip


def summary(values: list[float]) -> str:
    ordered = sorted(values)
    return f"p50 {statistics.median(ordered):8.2f}  p90 {ordered[int(len(ordered) * 0.9)]:8.2f}"


def zygote_memory(container_id: str) -> dict[str, int]:
    """The zygote's smaps_rollup in KiB (its real uid is the sandbox uid + 1); empty where it cannot be read."""
    client = docker.from_env()
    try:
        top = client.containers.get(container_id).top(ps_args="-eo pid,ruid")
    finally:
        client.close()
    zygotes = [pid for pid, ruid in top["Processes"] if int(ruid) % 2 and int(ruid) - 1 in SANDBOX_UIDS]
    try:
        with open(f"/proc/{zygotes[0]}/smaps_rollup") as file:
            rollup = file.read()
    except (OSError, IndexError):
        return {}
    return {name: int(kib) for name, kib in re.findall(r"^(\w+):\s+(\d+) kB", rollup, re.MULTILINE)}


async def profile(
    code: str, runs: int, pause_s: float, config_path: str | None, extra_env: dict[str, str],
    cumulative: list[dict[str, Any]], memory: dict[str, float],
) -> list[list[float]]:  # fmt: skip
    config = load_config(config_path)
    labels = {LABEL_OWNER: owner_token(), LABEL_INSTANCE: secrets.token_hex(8), LABEL_KIND: "stateless"}
    spec = container_spec(config.sandbox, labels)
    environment = {**spec.environment, **extra_env}
    spec = dataclasses.replace(spec, command=["python3", "-u", "-c", ENTRY], environment=environment)
    engine = await DockerEngine.connect(config.docker_host)
    rows: list[list[float]] = []
    try:
        async with anyio.create_task_group() as tg:
            sandbox = await start_sandbox(engine, spec, tg, kind="stateless", timeout_s=config.pool.start_timeout_s)
            try:
                for number in range(runs + WARMUP_RUNS):
                    await anyio.sleep(pause_s)  # pacing between runs, not synchronisation
                    started = time.perf_counter()
                    raw = RawRun()
                    await sandbox.execute(code, timeout_s=60, options=service_options(config), raw=raw)
                    await sandbox.confirm_clean()
                    elapsed = (time.perf_counter() - started) * 1000
                    result = raw.result
                    if result.status != "ok":
                        raise SystemExit(f"the run failed: {result.status} {result.error}")
                    if number >= WARMUP_RUNS:
                        before_warm, warm, cell, cell_ms = (float(field) for field in str(result.result).split())
                        rows.append([before_warm, warm, cell, cell_ms, result.duration_ms, elapsed])
                        cumulative.append(json.loads(result.stderr))
                await anyio.sleep(SETTLE_S)
                usage = await engine.memory_usage(sandbox.container_id)
                memory.update(docker_stats=usage.docker_stats / MIB, own=usage.own / MIB)
                rollup = await anyio.to_thread.run_sync(zygote_memory, sandbox.container_id)
                memory.update({name: kib / 1024 for name, kib in rollup.items()})
            finally:
                await sandbox.destroy()
    finally:
        await engine.aclose()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="configuration file (TOML): its image and limits are used")
    parser.add_argument("--code", default="print(1+1)")
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--pause", type=float, default=0.02, help="seconds between runs (lets the clean-up finish)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="more container environment")
    args = parser.parse_args()
    extra_env = dict(item.split("=", 1) for item in args.env)
    cumulative: list[dict[str, Any]] = []
    memory: dict[str, float] = {}
    rows = anyio.run(profile, args.code, args.runs, args.pause, args.config, extra_env, cumulative, memory)
    columns = [list(column) for column in zip(*rows, strict=True)]
    print(f"{args.runs} stateless runs of {args.code!r}")
    print(f"  page faults after fork, before warm-up   {summary(columns[0])}")
    print(f"  page faults in the warm-up               {summary(columns[1])}")
    print(f"  page faults while running the cell       {summary(columns[2])}")
    print(f"  worker time for the cell [ms]            {summary(columns[3])}")
    print(f"  agent, request to reply [ms]             {summary(columns[4])}")
    print(f"  round trip, as the server sees it [ms]   {summary(columns[5])}")
    stages(cumulative)
    print("memory, idle after the runs [MiB]:")
    print(f"  the container (docker stats' figure)      {memory.get('docker_stats', 0):7.1f}")
    print(f"  the same, less all page cache             {memory.get('own', 0):7.1f}")
    print(f"  the zygote: resident, anonymous           {memory.get('Rss', 0):7.1f} {memory.get('Anonymous', 0):7.1f}")
    print(f"  the zygote: on huge pages                 {memory.get('AnonHugePages', 0):7.1f}")
    return 0


def stages(cumulative: list[dict[str, Any]]) -> None:
    """CPU per run in the container, by process and by the supervisor's stage (mean over the runs)."""
    first, last = cumulative[0], cumulative[-1]
    runs = len(cumulative) - 1
    if runs < 1:
        return

    def per_run(before: float, after: float) -> str:
        return f"{(after - before) / runs * 1000:7.3f}"

    sup_before, sup_after = sum(first["supervisor"][:2]), sum(last["supervisor"][:2])
    zyg_before, zyg_after = first["zygote"], last["zygote"]
    print("CPU per run in the container, mean [ms] (/proc, 10 ms ticks summed over the runs):")
    print(f"  the supervisor                            {per_run(sup_before, sup_after)}")
    print(f"  the zygote (its forks, reaping)           {per_run(sum(zyg_before[:2]), sum(zyg_after[:2]))}")
    print(f"  the workers (warm-up, cell, exit)         {per_run(sum(zyg_before[2:]), sum(zyg_after[2:]))}")
    print("the supervisor's CPU by stage, mean [ms] (process_time; the stages do not nest):")
    for name in sorted(last["stages"]):
        print(f"  {name:<40}  {per_run(first['stages'].get(name, 0.0), last['stages'][name])}")
    print(f"  {'the supervisor in all (process_time)':<40}  {per_run(first['cpu'], last['cpu'])}")


if __name__ == "__main__":
    sys.exit(main())
