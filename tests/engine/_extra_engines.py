"""Extra Docker engines on this machine, for the tests of several engines.

Each ``ExtraEngine`` is a ``dockerd`` of its own: its own socket, data root, exec root (so its own
containerd), pid file and bridge. Not ``--bridge none``: at start-up dockerd would then delete the
host's ``docker0`` and break the main engine's bridge network (see ENVIRONMENT.md); each gets a
bridge of its own instead, with iptables and masquerading off. gVisor is registered as the main
engine registers it (its ``runtimes`` from /etc/docker/daemon.json), when it is there.

The sandbox image is copied in with ``docker save | docker load`` (one ``save`` feeding every
engine at once), and not at all when the engine already holds that image id: the data roots are
removed at the end, unless ``MCP_CODE_EXEC_KEEP_EXTRA_ENGINES=1`` keeps them as a cache for the
next run. Whatever a crashed run left (a daemon, containers, volumes, mounts, a bridge) is cleaned
up before the engines start. Everything here is blocking: call it from a thread in async code.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import IO

from mcp_code_exec.commands.offline_base import unmount_under

MAIN_DAEMON_JSON = Path("/etc/docker/daemon.json")
KEEP = os.environ.get("MCP_CODE_EXEC_KEEP_EXTRA_ENGINES") == "1"
START_S = 90.0
STOP_S = 60.0
LOAD_S = 600.0


def docker(*args: str, host: str | None = None, timeout_s: float = 60.0, check: bool = False) -> str:
    command = ["docker", *(["-H", host] if host else []), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()[-500:]}")
    return done.stdout if done.returncode == 0 else ""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)  # pacing a poll of another process's state
    return True


class ExtraEngine:
    """``tls``: it also listens on tcp://127.0.0.1 with mutual TLS (``tcp_url``; the client's
    ca.pem, cert.pem and key.pem in ``client_certs``), certificates made here with openssl."""

    def __init__(self, index: int, *, tls: bool = False) -> None:
        self.index = index
        self.tls = tls
        self.tcp_url: str | None = None
        self.name = f"extra-{index}"
        self.run_dir = Path(f"/run/mcpx-extra-{index}")
        self.data_root = Path(f"/var/lib/mcpx-extra-{index}")
        self.bridge = f"mcpx-br{index}"
        self.url = f"unix://{self.run_dir}/docker.sock"
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def pidfile(self) -> Path:
        return self.run_dir / "docker.pid"

    @property
    def client_certs(self) -> Path:
        return self.run_dir / "client"

    def _tls_arguments(self) -> list[str]:
        if not self.tls:
            return []
        server = self.run_dir / "tls"
        if self.tcp_url is None:
            make_certificates(server, self.client_certs)
            self.tcp_url = f"tcp://127.0.0.1:{_free_port()}"
        return [
            "--host", self.tcp_url,
            "--tlsverify",
            "--tlscacert", str(server / "ca.pem"),
            "--tlscert", str(server / "cert.pem"),
            "--tlskey", str(server / "key.pem"),
        ]  # fmt: skip

    def pid(self) -> int | None:
        try:
            pid = int(self.pidfile.read_text().strip())
        except (OSError, ValueError):
            return None
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return None
        return pid if str(self.run_dir).encode() in cmdline and _alive(pid) else None

    # -- the daemon ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the daemon (again) and wait until it answers."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.data_root.mkdir(parents=True, exist_ok=True)
        config = self.run_dir / "daemon.json"
        config.write_text(json.dumps({"runtimes": _main_runtimes()}))
        # After a SIGKILL its containerd dies too, but may stay a zombie a while (this machine's init
        # reaps late): a new dockerd that finds its pid in the pid file waits for it, and gives up.
        containerd_pid = self.run_dir / "exec" / "containerd" / "containerd.pid"
        with contextlib.suppress(OSError, ValueError):
            if not _alive(int(containerd_pid.read_text().strip())):
                containerd_pid.unlink()
        if self._log is None:
            self._log = open(self.run_dir / "dockerd.log", "ab")  # noqa: SIM115 - closed in stop()
        command = [
            "dockerd",
            "--config-file", str(config),
            "--host", self.url,
            "--data-root", str(self.data_root),
            "--exec-root", str(self.run_dir / "exec"),
            "--pidfile", str(self.pidfile),
            "--bridge", self.bridge,
            "--iptables=false",
            "--ip-masq=false",
            *self._tls_arguments(),
        ]  # fmt: skip
        # A session of its own: a Ctrl-C aimed at pytest does not reach it.
        self.process = subprocess.Popen(command, stdout=self._log, stderr=self._log, start_new_session=True)
        deadline = time.monotonic() + START_S
        while not docker("info", "--format", "{{.ID}}", host=self.url, timeout_s=15).strip():
            if self.process.poll() is not None:
                tail = (self.run_dir / "dockerd.log").read_bytes()[-1500:].decode(errors="replace")
                raise RuntimeError(f"{self.name}: dockerd exited; the end of its log:\n{tail}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: dockerd did not answer within {START_S:.0f} s")
            time.sleep(0.2)  # pacing a poll of another process's state

    def kill(self) -> None:
        """SIGKILL, as a crash: containers' shims live on, volumes stay on disk."""
        pid = self.pid()
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            _wait_gone(pid, 30)
        if self.process is not None:
            self.process.wait(timeout=30)  # reap it
            self.process = None
        for helper in _processes(self.run_dir / "exec" / "containerd" / "containerd.toml"):
            _wait_gone(helper, 30)  # its containerd follows it (a signal on its parent's death)

    def stop(self) -> None:
        """A clean stop (it stops its containers first); SIGKILL past ``STOP_S``."""
        pid = self.pid()
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
            if not _wait_gone(pid, STOP_S):
                os.kill(pid, signal.SIGKILL)
                _wait_gone(pid, 30)
        if self.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=30)
            self.process = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def image_id(self, image: str) -> str:
        return docker("image", "inspect", "--format", "{{.Id}}", image, host=self.url).strip()

    def wipe(self) -> None:
        """Remove every container and volume (the engine is ours alone)."""
        containers = docker("ps", "-aq", host=self.url).split()
        if containers:
            docker("rm", "-f", *containers, host=self.url)
        volumes = docker("volume", "ls", "-q", host=self.url).split()
        if volumes:
            docker("volume", "rm", "-f", *volumes, host=self.url)

    # -- the machine around it -------------------------------------------------------------------------
    def make_bridge(self) -> None:
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)
        subprocess.run(["ip", "link", "add", "name", self.bridge, "type", "bridge"], check=True)
        subprocess.run(["ip", "addr", "add", _free_subnet(self.index), "dev", self.bridge], check=True)
        subprocess.run(["ip", "link", "set", self.bridge, "up"], check=True)

    def clean_up(self, *, keep_data: bool) -> None:
        """Whatever this engine left, from this run or a crashed one (idempotent)."""
        if self.pid() is None and _shims(self.run_dir):
            # A daemon killed with containers running: a new one reaps them, then stops cleanly.
            with contextlib.suppress(RuntimeError, OSError):
                self.make_bridge()
                self.start()
        self.stop()
        for shim in _shims(self.run_dir):  # a daemon that did not come back: its containers go with their shims
            with contextlib.suppress(ProcessLookupError):
                os.kill(shim, signal.SIGKILL)
        unmount_under(str(self.run_dir))
        unmount_under(str(self.data_root))  # a daemon's data root is a bind mount of itself
        shutil.rmtree(self.run_dir, ignore_errors=True)
        if not keep_data:
            shutil.rmtree(self.data_root, ignore_errors=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def make_certificates(server: Path, client: Path) -> None:
    """A throw-away CA, a server certificate for 127.0.0.1 and a client certificate (openssl)."""
    server.mkdir(parents=True, exist_ok=True)
    client.mkdir(parents=True, exist_ok=True)

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=server, capture_output=True, check=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=mcpx-test-ca",
            "-keyout", "ca-key.pem", "-out", "ca.pem")  # fmt: skip
    for name, usage, subject, where in (
        ("cert", "serverAuth\nsubjectAltName=IP:127.0.0.1", "/CN=127.0.0.1", server),
        ("client", "clientAuth", "/CN=client", client),
    ):
        (server / f"{name}.ext").write_text(f"extendedKeyUsage={usage}\n")
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", subject, "-keyout", str(where / "key.pem"),
                "-out", f"{name}.csr")  # fmt: skip
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca-key.pem", "-CAcreateserial",
                "-days", "2", "-extfile", f"{name}.ext", "-out", str(where / "cert.pem"))  # fmt: skip
    shutil.copy(server / "ca.pem", client / "ca.pem")


def _main_runtimes() -> dict[str, object]:
    """The main engine's extra runtimes (gVisor's runsc, if registered), for the extra engines too."""
    try:
        runtimes = json.loads(MAIN_DAEMON_JSON.read_text()).get("runtimes") or {}
    except (OSError, ValueError):
        return {}
    return {name: spec for name, spec in runtimes.items() if Path(str(spec.get("path", ""))).exists()}


def _processes(marker: Path, name: bytes = b"") -> list[int]:
    """Live processes whose command line holds ``marker`` (and ``name``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if str(marker).encode() in cmdline and name in cmdline and _alive(int(entry.name)):
                found.append(int(entry.name))
    return found


def _shims(run_dir: Path) -> list[int]:
    """containerd shims of an engine whose exec root is under ``run_dir``."""
    return _processes(run_dir / "exec", b"containerd-shim")


def _free_subnet(index: int) -> str:
    """An address for a bridge, in a private /24 no interface of this machine uses."""
    used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, check=False).stdout
    for third in range(230 + index, 256):
        if f" 10.{third}.{index}." not in used:
            return f"10.{third}.{index}.1/24"
    raise RuntimeError("no free private /24 for an extra engine's bridge")


def load_image(image: str, engines: list[ExtraEngine]) -> float:
    """Copy ``image`` from the main engine into those engines that lack that very image id, with one
    ``docker save`` feeding every ``docker load`` at once. Returns the seconds it took."""
    began = time.monotonic()
    wanted = docker("image", "inspect", "--format", "{{.Id}}", image, check=True).strip()
    missing = [engine for engine in engines if engine.image_id(image) != wanted]
    if not missing:
        return 0.0
    save = subprocess.Popen(["docker", "save", image], stdout=subprocess.PIPE)
    loads = [
        subprocess.Popen(["docker", "-H", engine.url, "load", "-q"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
        for engine in missing
    ]
    assert save.stdout is not None
    try:
        while chunk := save.stdout.read(1 << 20):
            for load in loads:
                assert load.stdin is not None
                load.stdin.write(chunk)
    finally:
        for load in loads:
            assert load.stdin is not None
            load.stdin.close()
        save.wait(timeout=LOAD_S)
        for load in loads:
            load.wait(timeout=LOAD_S)
    for engine in missing:
        if engine.image_id(image) != wanted:
            raise RuntimeError(f"{engine.name}: loading {image} failed")
    return time.monotonic() - began


def start_extra_engines(count: int, image: str) -> tuple[list[ExtraEngine], float]:
    """Clean up what a crashed run left, start ``count`` engines, empty, with ``image`` in each;
    the last one also answers on tcp:// with TLS."""
    engines = [ExtraEngine(index, tls=index == count) for index in range(1, count + 1)]
    try:
        for engine in engines:
            engine.clean_up(keep_data=True)  # a kept data root is a cache of the image
            engine.make_bridge()
            engine.start()
            engine.wipe()
        return engines, load_image(image, engines)
    except BaseException:
        stop_extra_engines(engines)
        raise


def stop_extra_engines(engines: list[ExtraEngine]) -> None:
    for engine in engines:
        engine.clean_up(keep_data=KEEP)
