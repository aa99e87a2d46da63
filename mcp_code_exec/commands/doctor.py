"""``mcp-code-exec doctor``: check that this machine can run sandboxes as configured.

One line per check on stdout, ``OK`` or ``FAIL`` and, on failure, what to do about it. The checks
build on each other (no engine, no image check), and the last ones start a real sandbox with the
configured image, runtime and limits and probe that the limits actually hold.
"""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any

import anyio

from ..config.mounts import target
from ..config.settings import Config
from ..errors import SandboxError
from ..sandbox.image import BUILD_COMMAND, image_status
from ..sandbox.ownership import SANDBOX_UIDS
from . import doctor_egress

if TYPE_CHECKING:
    from ..service.facade import SandboxService

PROBE_TIMEOUT_S = 30.0
START_TIMEOUT_S = 120.0
IDENTITY_PROBE = (
    "import os\n"
    "s = dict(l.split(':\\t', 1) for l in open('/proc/self/status').read().splitlines() if ':\\t' in l)\n"
    "nets = sorted(os.listdir('/sys/class/net')) if os.path.isdir('/sys/class/net') else []\n"
    "print(os.getuid(), s['CapEff'].strip(), nets)\n"
)
SYSCALL_PROBE = (
    "import ctypes, platform\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "numbers = {'x86_64': (425, 323, 101), 'aarch64': (425, 282, 117)}[platform.machine()]\n"
    "print(sum(libc.syscall(n, 0, 0, 0, 0, 0) >= 0 for n in numbers))\n"
)
DISK_PROBE = (
    "import os\nst = os.statvfs('/mnt/data')\nprint(st.f_bavail * st.f_frsize >> 20, st.f_blocks * st.f_frsize >> 20)"
)
MOUNTS_PROBE = (  # after a line that sets TARGETS
    "import json, os\n"
    "def seen(t):\n"
    "    return [os.path.isdir(t), os.access(t, os.R_OK | os.X_OK), os.access(t, os.W_OK)]\n"
    "print(json.dumps({t: seen(t) for t in TARGETS}))\n"
)
PIDS_PROBE = (
    "import threading, time\n"
    "started = 0\n"
    "try:\n"
    "    while started < {ceiling}:\n"
    "        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    "        started += 1\n"
    "except RuntimeError:\n"
    "    pass\n"
    "print(started)\n"
)


class Report:
    def __init__(self) -> None:
        self.failed = False
        self.where = ""  # with several engines, which one the checks are about: "[name] "

    def ok(self, check: str, detail: str) -> None:
        print(f"OK    {self.where}{check}: {detail}", flush=True)

    def fail(self, check: str, detail: str, fix: str) -> None:
        self.failed = True
        print(f"FAIL  {self.where}{check}: {detail}; fix: {fix}", flush=True)


async def doctor(config: Config) -> int:
    """Run the checks (with several engines, on each one in turn); 0 when all passed, 1 otherwise."""
    report = Report()
    try:
        await _mounts_on_host(config, report)
        for engine in config.cluster.engines:
            report.where = f"[{engine.name}] "
            # A cluster of this one engine: its connection (TLS, ssh), admission and probes, alone.
            await _checks(
                config.model_copy(update={"cluster": config.cluster.model_copy(update={"engines": [engine]})}), report
            )
        if not config.cluster.engines:
            await _checks(config, report)
    except Exception as exc:  # noqa: BLE001 - the doctor reports, it never crashes
        report.fail("doctor", f"unexpected error {type(exc).__name__}: {exc}", "report this as a bug")
    print("all checks passed" if not report.failed else "some checks failed", file=sys.stderr)
    return 1 if report.failed else 0


async def _checks(config: Config, report: Report) -> None:
    from ..runtime.docker.engine import DockerEngine

    url, cert_path, fix = config.docker_host, None, "start Docker, or set docker_host / DOCKER_HOST"
    if config.cluster.engines:
        (member,) = config.cluster.engines
        url, cert_path = member.url, None if member.cert_path is None else str(member.cert_path)
        fix = "start that engine, check its URL (ssh: the key and known_hosts; tcp: the TLS files)"
    try:
        engine = await DockerEngine.connect(url, cert_path=cert_path)
    except SandboxError as exc:
        report.fail("engine", str(exc), fix)
        return
    try:
        report.ok("engine", f"reachable at {engine.endpoint}")
        ready = await _image(engine, config, report) and await _runtime(engine, config, report)
        if not ready or not await doctor_egress.before_sandbox(engine, config, report):
            return
    finally:
        await engine.aclose()
    await _sandbox(config, report)


async def _image(engine: Any, config: Config, report: Report) -> bool:
    try:
        status = await image_status(engine, config.image)
    except SandboxError as exc:
        report.fail("image", str(exc), f"run `{BUILD_COMMAND}`")
        return False
    if status == "missing":
        report.fail("image", f"{config.image!r} is not present", f"run `{BUILD_COMMAND}`")
        return False
    if status == "stale":
        report.fail("image", f"{config.image!r} was built from another version of the agent", f"run `{BUILD_COMMAND}`")
        return False
    report.ok("image", f"{config.image} is present and current")
    return True


async def _runtime(engine: Any, config: Config, report: Report) -> bool:
    if config.runtime is None:
        report.ok("runtime", "the engine's default runtime")
        return True
    try:
        runtimes = await engine.runtimes()
    except SandboxError as exc:
        report.fail("runtime", f"cannot ask the engine for its runtimes ({exc})", "check the engine")
        return False
    if config.runtime not in runtimes:
        fix = (
            "install gVisor (`apt-get install runsc`) and register it: `sudo scripts/ensure-docker.sh`"
            if config.runtime == "runsc"
            else f"register {config.runtime!r} with the engine, or remove runtime from the config"
        )
        report.fail(
            "runtime", f"{config.runtime!r} is not registered with the engine (it has {', '.join(runtimes)})", fix
        )
        return False
    report.ok("runtime", f"{config.runtime} is registered")
    return True


async def _sandbox(config: Config, report: Report) -> None:
    """Start a one-container service with the configured image, runtime and limits, and probe it."""
    from ..service.facade import SandboxService

    pool = config.pool.model_copy(update={"size": 1, "session_spares": 0, "mode": "single-use"})
    sessions = config.sessions.model_copy(update={"durable": False})  # it takes over no one's sessions
    probe_config = config.model_copy(update={"pool": pool, "sessions": sessions})
    limits = config.limits
    try:
        with anyio.fail_after(START_TIMEOUT_S + 4 * (PROBE_TIMEOUT_S + 20)):
            async with SandboxService.start(probe_config) as service:
                try:
                    await service.wait_ready(START_TIMEOUT_S)
                except (TimeoutError, SandboxError) as exc:
                    detail = service.stateless_pool.last_error or exc
                    report.fail("sandbox start", f"no sandbox became ready ({detail})", _start_fix(config))
                    return
                report.ok("sandbox start", f"a sandbox starts{' under ' + config.runtime if config.runtime else ''}")
                await _probe_identity(service, config, report)
                await _probe_mounts(service, config, report)
                await _probe_syscalls(service, config, report)
                await _probe_memory(service, limits.memory_mb, report)
                await _probe_pids(service, limits.pids, report)
                await _probe_session_disk(service, config, report)
                await doctor_egress.probe(service, config, report)
    except TimeoutError:
        report.fail("sandbox", "the probes did not finish in time", "check the engine's load and `docker info`")
    except SandboxError as exc:
        report.fail("sandbox", str(exc), _start_fix(config))


def _start_fix(config: Config) -> str:
    if config.runtime:
        return f"check that `docker run --runtime {config.runtime} --network none {config.image} true` works"
    return f"check that `docker run --network none {config.image} true` works, or rebuild with `{BUILD_COMMAND}`"


async def _probe_identity(service: SandboxService, config: Config, report: Report) -> None:
    result = await service.run("doctor", IDENTITY_PROBE, timeout=PROBE_TIMEOUT_S)
    fields = result.stdout.strip().split(maxsplit=2)
    if result.status != "ok" or len(fields) != 3:
        report.fail("isolation", f"the identity probe ended {result.status}: {result.error}", "rebuild the image")
        return
    uid, caps, nets = fields
    if not uid.isdigit() or int(uid) not in SANDBOX_UIDS or int(caps, 16) != 0:
        report.fail(
            "isolation", f"code runs as uid {uid} with capabilities {caps}", f"rebuild the image with `{BUILD_COMMAND}`"
        )
    elif not config.network and nets not in ("['lo']", "[]"):
        report.fail(
            "isolation", f"network interfaces {nets} although network is off", "check the engine's network settings"
        )
    else:
        report.ok(
            "isolation",
            f"code runs as uid {uid} (one per sandbox), no capabilities" + ("" if config.network else ", no network"),
        )


async def _mounts_on_host(config: Config, report: Report) -> None:
    for mount in config.mounts:
        check = f"mount {mount.name}"
        if await anyio.to_thread.run_sync(os.path.isdir, mount.path):
            mode = "writable" if mount.writable else "read-only"
            report.ok(check, f"{mount.path} is shared at {target(mount.name)}, {mode}")
        else:
            report.fail(
                check, f"{mount.path} is no longer a directory", "restore it, or remove the mount from the config"
            )


async def _probe_mounts(service: SandboxService, config: Config, report: Report) -> None:
    """Each configured directory is seen by the sandbox user as configured (Docker Desktop shares
    only the directories listed under its file sharing settings)."""
    if not config.mounts:
        return
    targets = [target(mount.name) for mount in config.mounts]
    result = await service.run("doctor", f"TARGETS = {targets!r}\n" + MOUNTS_PROBE, timeout=PROBE_TIMEOUT_S)
    try:
        seen = json.loads(result.stdout)
    except ValueError:
        report.fail("mounts", f"the mount probe ended {result.status}: {result.error}", "rebuild the image")
        return
    for mount in config.mounts:
        visible, readable, writable = seen.get(target(mount.name), (False, False, False))
        check, where = f"mount {mount.name}", target(mount.name)
        if not visible:
            report.fail(
                check,
                f"{where} is missing in the sandbox",
                "Docker Desktop: share the directory (Settings, Resources, File sharing)",
            )
        elif not readable:
            report.fail(
                check,
                f"the sandbox user cannot read {where}",
                f"let others read it on the host: chmod o+rx {mount.path}",
            )
        elif writable != mount.writable:
            wrong = "cannot write to" if mount.writable else "can write to the read-only"
            fix = (
                f"let group 1000 write there: chgrp 1000 {mount.path} && chmod g+rwx, or chmod o+w"
                if mount.writable
                else "check the engine"
            )
            report.fail(check, f"the sandbox user {wrong} {where}", fix)
        else:
            report.ok(check, f"the sandbox user sees {where} {'writable' if writable else 'read-only'}")


async def _probe_syscalls(service: SandboxService, config: Config, report: Report) -> None:
    """io_uring, userfaultfd and ptrace must fail: the project's seccomp profile is in force."""
    result = await service.run("doctor", SYSCALL_PROBE, timeout=PROBE_TIMEOUT_S)
    if result.status == "ok" and result.stdout.strip() == "0":
        report.ok("syscall filter", "io_uring, userfaultfd and ptrace are refused")
        return
    fix = (
        'register runsc with "--oci-seccomp" in its runtimeArgs (/etc/docker/daemon.json) and reload dockerd; '
        "`sudo scripts/ensure-docker.sh` does it"
        if config.runtime == "runsc"
        else "the engine did not apply the seccomp profile; check `docker info` for seccomp support"
    )
    report.fail("syscall filter", f"syscalls that must be refused were allowed ({result.stdout.strip()} of 3)", fix)


async def _probe_memory(service: SandboxService, memory_mb: int, report: Report) -> None:
    code = f"hog = bytearray({memory_mb * 2} * 1024 * 1024)\nprint('allocated')"
    result = await service.run("doctor", code, timeout=PROBE_TIMEOUT_S)
    if result.status == "memory_limit" or (result.status == "crashed" and "allocated" not in result.stdout):
        report.ok("memory limit", f"a run allocating {memory_mb * 2} MiB was stopped ({result.status})")
    else:
        report.fail(
            "memory limit",
            f"a run allocating twice the {memory_mb} MiB limit ended {result.status!r}",
            "the engine must support memory limits (cgroup memory controller; on cgroup v1 swap accounting too)",
        )


async def _probe_pids(service: SandboxService, pids: int, report: Report) -> None:
    result = await service.run("doctor", PIDS_PROBE.format(ceiling=pids * 4), timeout=PROBE_TIMEOUT_S)
    try:
        started = int(result.stdout.strip())
    except ValueError:
        started = -1
    if result.status == "ok" and 0 <= started <= pids:  # stopped at the limit (gVisor counts as NPROC does)
        report.ok("pids limit", f"threads stopped at {started} (limit {pids})")
    else:
        report.fail(
            "pids limit",
            f"the pids probe ended {result.status!r} after starting {started} threads (limit {pids})",
            "the engine must support pids limits (cgroup pids controller)",
        )


async def _probe_session_disk(service: SandboxService, config: Config, report: Report) -> None:
    """Who enforces a session's disk quota; with the filesystem, a real session's /mnt/data is one of its size."""
    quota = config.limits.session_data_mb
    if (enforcement := service.disk_enforcement()).by == "agent":
        hidden = "a deleted file kept alive by a memory mapping escapes it"
        if config.limits.session_disk == "agent":
            report.ok(
                "session disk", f"only the sandbox's count guards the quota (limits.session_disk = agent; {hidden})"
            )
        else:
            report.fail(
                "session disk",
                f"the engine cannot make sized volumes ({enforcement.why_not}): only the sandbox's count guards "
                f"a session's quota, and {hidden}",
                "run the engine on Linux as root with loop devices (`modprobe loop`), or set "
                'limits.session_disk = "agent" to accept the count alone',
            )
        return
    try:
        session = await service.new_session("doctor")
        try:
            result = await service.run("doctor", DISK_PROBE, session_id=session.session_id, timeout=PROBE_TIMEOUT_S)
        finally:
            await service.close_session("doctor", session.session_id)
        free_mb, size_mb = (int(field) for field in result.stdout.split())
    except (SandboxError, ValueError) as exc:
        report.fail("session disk", f"a session with a sized volume could not be probed ({exc})", "check the engine")
        return
    if free_mb < quota:
        report.fail(
            "session disk",
            f"a session's filesystem has {free_mb} MiB free, under its {quota} MiB quota",
            "report this as a bug",
        )
        return
    report.ok(
        "session disk",
        f"each session's /mnt/data is a filesystem of its own ({size_mb} MiB, {free_mb} MiB "
        f"free for a {quota} MiB quota): writes past it fail, whatever hides the usage",
    )
