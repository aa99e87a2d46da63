"""Where a stateless run's time goes inside the container, in figures that do not depend on load.

Starts the sandbox image's agent with ``docker run -i`` (the same hardened flags the server uses,
the agent of this checkout mounted over the image's), drives it over its pipes with the framed
protocol, and reports per stateless run:

- the copy-on-write and other page faults the worker takes, before the request (fork, warm-up)
  and while running the cell: the dominant cost of a forked CPython, and stable across runs;
- the worker's time for the cell, the agent's time from request to reply, and the reply's
  round trip as this process sees it (these depend on the machine's load).

    python bench/profile_agent.py                       # print(1+1), 200 runs
    python bench/profile_agent.py --code 'import pandas' --runs 50 --pause 0.05

Timings on a shared machine move from run to run; fault counts do not: compare those.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "images" / "python" / "agent"))
from mcpx_agent import protocol  # noqa: E402 - the agent's own framing, from this checkout

# Runs inside the container instead of ``python3 -m mcpx_agent``: wraps the worker so that each
# reply carries the worker's fault counts and timings in its "result" field.
ENTRY = """
import resource, sys, time
from mcpx_agent import __main__ as agent, worker
def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
marks = {}
real_warm, real_execute, real_send = worker.warm_up, worker.execute, type(worker.SINK).send
def warm_up(shell):
    marks["before_warm"] = faults(); real_warm(shell); marks["after_warm"] = faults()
def execute(shell, request, **kwargs):
    marks["start"], marks["t0"] = faults(), time.perf_counter(); real_execute(shell, request, **kwargs)
def send(sink, header, *args, **kwargs):
    if header.get("kind") == "done" and "t0" in marks:
        header["result"] = "%d %d %d %.3f" % (marks.get("before_warm", 0), marks.get("after_warm", 0)
            - marks.get("before_warm", 0), faults() - marks["start"], (time.perf_counter() - marks["t0"]) * 1000)
    return real_send(sink, header, *args, **kwargs)
worker.warm_up, worker.execute, type(worker.SINK).send = warm_up, execute, send
sys.exit(agent.main())
"""


def docker_command(image: str, entry_dir: str) -> list[str]:
    agent = ROOT / "images" / "python" / "agent"
    tmpfs = {
        "/tmp": "rw,nosuid,nodev,size=64m,mode=1777",
        "/run/mcpx": "rw,nosuid,nodev,noexec,size=16m,mode=0700",
        "/mnt/data": "rw,nosuid,nodev,size=64m,uid=1000,gid=1000,mode=0755",
    }
    command = ["docker", "run", "--rm", "-i", "--init", "--network", "none", "--read-only", "--log-driver", "none"]
    command += ["--cap-drop", "ALL", "--cap-add", "KILL", "--cap-add", "SETUID", "--cap-add", "SETGID"]
    command += ["--security-opt", "no-new-privileges", "--memory", "512m", "--cpus", "1", "--pids-limit", "128"]
    command += ["-e", "OPENBLAS_NUM_THREADS=1", "-e", "OMP_NUM_THREADS=1", "-e", "MKL_NUM_THREADS=1"]
    for path, options in tmpfs.items():
        command += ["--tmpfs", f"{path}:{options}"]
    command += ["-v", f"{agent}:/opt/mcpx/agent:ro", "-v", f"{entry_dir}:/opt/mcpx/profile:ro"]
    command += ["-e", "PYTHONPATH=/opt/mcpx/profile:/opt/mcpx/agent", image, "python3", "-u", "-m", "profile_entry"]
    return command


def summary(values: list[float]) -> str:
    ordered = sorted(values)
    return f"p50 {statistics.median(ordered):8.2f}  p90 {ordered[int(len(ordered) * 0.9)]:8.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image", default="mcp-code-exec:latest")
    parser.add_argument("--code", default="print(1+1)")
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--pause", type=float, default=0.02, help="seconds between runs (lets the clean-up finish)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as entry_dir:
        (Path(entry_dir) / "profile_entry.py").write_text(ENTRY)
        agent = subprocess.Popen(docker_command(args.image, entry_dir), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert agent.stdin is not None and agent.stdout is not None
        to_agent, frames = agent.stdin.fileno(), protocol.FrameReader(agent.stdout.fileno())

        def receive(event: str) -> dict[str, object]:
            while True:
                for header, _ in frames.frames():
                    if header.get("ev") == event:
                        return header
                frames.fill()
                if frames.eof:
                    raise SystemExit("the agent exited")

        receive("ready")
        options = {"max_output_bytes": 65536, "max_image_bytes": 1_000_000, "max_image_pixels": 2_000_000}
        rows: list[list[float]] = []
        try:
            for number in range(args.runs + 10):  # the first ten warm the machine's caches
                time.sleep(args.pause)  # pacing between runs, not synchronisation
                started = time.perf_counter()
                request = {"op": "exec", "id": number, "code": args.code, "mode": "stateless", "timeout": 60}
                protocol.send(to_agent, {**request, "options": options})
                reply = receive("done")
                elapsed = (time.perf_counter() - started) * 1000
                if reply.get("status") != "ok":
                    raise SystemExit(f"the run failed: {reply}")
                before_warm, warm, cell, cell_ms = str(reply["result"]).split()
                if number >= 10:
                    agent_ms = float(str(reply["duration_ms"]))
                    rows.append([float(before_warm), float(warm), float(cell), float(cell_ms), agent_ms, elapsed])
        finally:
            agent.stdin.close()
            agent.wait(timeout=30)
    columns = list(zip(*rows, strict=True))
    print(f"{args.runs} stateless runs of {args.code!r}")
    print(f"  page faults after fork, before warm-up   {summary(list(columns[0]))}")
    print(f"  page faults in the warm-up               {summary(list(columns[1]))}")
    print(f"  page faults while running the cell       {summary(list(columns[2]))}")
    print(f"  worker time for the cell [ms]            {summary(list(columns[3]))}")
    print(f"  agent, request to reply [ms]             {summary(list(columns[4]))}")
    print(f"  round trip over docker run -i [ms]       {summary(list(columns[5]))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
