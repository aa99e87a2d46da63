"""Test hosts of the egress tests' own: two network namespaces on this machine, each joined to the
host by a veth pair, running ``fixtures/egress_host.py``; a test CA (given to the proxy as
``[egress] upstream_ca``) and a certificate of it for every test name; a PEP 503 index (requests and
httpx with what they need, fetched on the host by the project's own wheel code for the sandbox's
interpreter), and a git repository. Names resolve through a hosts file of the tests' own
(``[egress] hosts_file``): the machine's /etc/hosts is never touched.

The proxy's container reaches them as it reaches any host outside Docker: through the engine's
bridge and the host's routing. Everything is removed by ``stop``: servers, namespaces, veths and the
directory. Root only (the tests skip otherwise).
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
SERVER = HERE / "fixtures" / "egress_host.py"
DOMAIN = "egress.test"
ON_FIRST = ("data", "api", "pypi", "git", "a.files")  # names of the first host
PACKAGE = "egress-probe-pkg"
SECRET_HEADER = "Authorization"


def missing_tools() -> str | None:
    """Why the test hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root: makes network namespaces and veth pairs for test hosts of its own"
    for tool in ("ip", "openssl", "git"):
        if shutil.which(tool) is None:
            return f"needs {tool} to make the test hosts"
    return None


@dataclass
class EgressHosts:
    root: Path
    first: str  # the allowed hosts' address
    second: str  # a private address no entry's range holds
    secret: str
    namespaces: list[str] = field(default_factory=list)
    veths: list[str] = field(default_factory=list)
    servers: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def name(self, short: str) -> str:
        return f"{short}.{DOMAIN}"

    @property
    def ca(self) -> Path:
        return self.root / "pki" / "ca.pem"

    @property
    def hosts_file(self) -> Path:
        return self.root / "hosts"

    @property
    def first_network(self) -> str:
        return self.first.rsplit(".", 1)[0] + ".0/24"


def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=60)


def _free_subnets() -> tuple[str, str]:
    routes = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True, check=True).stdout
    for n in [os.getpid() % 200, *range(200)]:
        first, second = f"10.254.{n + 20}", f"10.253.{n + 20}"
        if f"{first}." not in routes and f"{second}." not in routes:
            return first, second
    raise RuntimeError("no free test subnet")


def sandbox_wheels(names: list[str]) -> list[Path]:
    """Wheels of ``names`` and their dependencies for the sandbox's interpreter, in the host's wheel
    cache (fetched with the host's pip the first time, as an image build fetches its own)."""
    from mcp_code_exec.service.packages import wheels

    arch = wheels.sandbox_arch(os.uname().machine)
    return wheels.fetch(wheels.resolve(names, arch), arch, wheels.cache_root() / arch)


def start(secret: str, packages: list[Path]) -> EgressHosts:
    root = Path(tempfile.mkdtemp(prefix="mcpx-egress-hosts-"))
    first, second = _free_subnets()
    hosts = EgressHosts(root=root, first=f"{first}.2", second=f"{second}.2", secret=secret)
    try:
        _certificates(hosts)
        _content(hosts, packages)
        tag = str(os.getpid() % 100000)
        for index, net in enumerate((first, second), start=1):
            _namespace(hosts, f"mcpx-eg{tag}-{index}", f"mcpxeg{tag}{index}", net)
        names = [f"{hosts.first} " + " ".join(hosts.name(n) for n in ON_FIRST)]
        names += [f"{hosts.second} {hosts.name('internal')}", f"127.0.0.1 {hosts.name('loop')}"]
        names += [f"169.254.169.254 {hosts.name('metadata')}"]
        hosts.hosts_file.write_text("\n".join(names) + "\n")
        _wait_serving(hosts)
    except BaseException:
        stop(hosts)
        raise
    return hosts


def _namespace(hosts: EgressHosts, namespace: str, veth: str, net: str) -> None:
    _run("ip", "netns", "add", namespace)
    hosts.namespaces.append(namespace)
    _run("ip", "link", "add", f"{veth}h", "type", "veth", "peer", "name", f"{veth}n")
    hosts.veths.append(f"{veth}h")
    _run("ip", "link", "set", f"{veth}n", "netns", namespace)
    _run("ip", "addr", "add", f"{net}.1/24", "dev", f"{veth}h")
    _run("ip", "link", "set", f"{veth}h", "up")
    for command in (
        ("ip", "addr", "add", f"{net}.2/24", "dev", f"{veth}n"),
        ("ip", "link", "set", f"{veth}n", "up"),
        ("ip", "link", "set", "lo", "up"),
        ("ip", "route", "add", "default", "via", f"{net}.1"),
    ):
        _run("ip", "netns", "exec", namespace, *command)
    pki = hosts.root / "pki"
    server = subprocess.Popen(
        ["ip", "netns", "exec", namespace, sys.executable, str(SERVER), "--root", str(hosts.root / "www"),
         "--cert", str(pki / "server.pem"), "--key", str(pki / "server.key"), "--life", "3600"],
        env={"PATH": os.environ.get("PATH", ""), "EGRESS_TEST_SECRET": hosts.secret, "EGRESS_TEST_HEADER": SECRET_HEADER},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    hosts.servers.append(server)


def _wait_serving(hosts: EgressHosts, timeout_s: float = 20.0) -> None:
    """Poll the servers' ports from the host (they take a moment to start in their namespace)."""
    import socket

    deadline = time.monotonic() + timeout_s
    for address in (hosts.first, hosts.second):
        while True:
            try:
                socket.create_connection((address, 443), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)  # polling a server in another namespace: no event to wait on


def _certificates(hosts: EgressHosts) -> None:
    pki = hosts.root / "pki"
    pki.mkdir()
    _run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(pki / "ca.key"),
         "-out", str(pki / "ca.pem"), "-days", "2", "-subj", "/CN=mcp-code-exec egress test CA",
         "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip
    _run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(pki / "server.key"),
         "-out", str(pki / "server.csr"), "-subj", f"/CN={hosts.name('data')}")  # fmt: skip
    names = ",".join(f"DNS:{hosts.name(n)}" for n in (*ON_FIRST, "internal", "loop"))
    (pki / "ext.cnf").write_text(
        f"subjectAltName={names},IP:{hosts.first}\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n"
    )
    _run("openssl", "x509", "-req", "-in", str(pki / "server.csr"), "-CA", str(pki / "ca.pem"),
         "-CAkey", str(pki / "ca.key"), "-CAcreateserial", "-out", str(pki / "server.pem"), "-days", "2",
         "-extfile", str(pki / "ext.cnf"))  # fmt: skip


def _content(hosts: EgressHosts, packages: list[Path]) -> None:
    """The index (``packages``, and one wheel made here) and a git repository over dumb HTTP."""
    www = hosts.root / "www"
    (www / "packages").mkdir(parents=True)
    made = www / "packages" / f"{PACKAGE.replace('-', '_')}-1.0-py3-none-any.whl"
    made.write_bytes(_wheel())
    projects: dict[str, list[Path]] = {}
    for wheel in [made, *packages]:
        if wheel != made:
            shutil.copyfile(wheel, www / "packages" / wheel.name)
        project = re.sub(r"[-_.]+", "-", wheel.name.split("-", 1)[0]).lower()
        projects.setdefault(project, []).append(www / "packages" / wheel.name)
    for project, files in projects.items():
        (www / "simple" / project).mkdir(parents=True)
        links = "".join(
            f'<a href="../../packages/{f.name}#sha256={hashlib.sha256(f.read_bytes()).hexdigest()}">{f.name}</a>\n'
            for f in files
        )
        (www / "simple" / project / "index.html").write_text(links)
    (www / "simple" / "index.html").write_text("".join(f'<a href="{p}/">{p}</a>\n' for p in sorted(projects)))
    work = hosts.root / "work"
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@egress.test", "-c", "init.defaultBranch=main"]
    _run(*git, "init", "-q", str(work))
    (work / "README").write_text("reached through the egress proxy\n")
    _run(*git, "-C", str(work), "add", "README")
    _run(*git, "-C", str(work), "commit", "-q", "-m", "first")
    _run(*git, "clone", "-q", "--bare", str(work), str(www / "git" / "demo.git"))
    _run("git", "-C", str(www / "git" / "demo.git"), "update-server-info")


def _wheel() -> bytes:
    module = b"VALUE = 42\n"
    dist = "egress_probe_pkg-1.0.dist-info"
    files = {
        "egress_probe_pkg/__init__.py": module,
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: 1.0\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = ""
    for path, content in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(content).digest()).rstrip(b"=").decode()
        record += f"{path},sha256={digest},{len(content)}\n"
    files[f"{dist}/RECORD"] = (record + f"{dist}/RECORD,,\n").encode()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for path, content in files.items():
            archive.writestr(path, content)
    return buffer.getvalue()


def stop(hosts: EgressHosts) -> None:
    for server in hosts.servers:
        server.kill()
        server.wait(timeout=10)
    for veth in hosts.veths:
        subprocess.run(["ip", "link", "del", veth], capture_output=True, timeout=30, check=False)
    for namespace in hosts.namespaces:
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30, check=False)
    shutil.rmtree(hosts.root, ignore_errors=True)
