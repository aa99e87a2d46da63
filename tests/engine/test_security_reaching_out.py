"""Hostile code reaching out of its container (docs/security.md#reaching-out): for the Docker socket and API,
for the network, and for the server's environment, configuration and token."""

from __future__ import annotations

import ast
import secrets

import anyio
import pytest
from _security import OWNER, assert_answers
from _support import make_test_config

from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio


# -- 23. the Docker socket and API -----------------------------------------------------------------------
DOCKER_HUNT = (
    "import glob, os, socket\n"
    "found = [p for p in ('/var/run/docker.sock', '/run/docker.sock', '/run/containerd/containerd.sock',\n"
    "                     '/var/run/docker', '/run/containerd', '/run/podman/podman.sock') if os.path.lexists(p)]\n"
    "found += glob.glob('/**/*.sock', recursive=False)\n"
    "found += [k for k in os.environ if k.startswith('DOCKER')]\n"
    "for mount in open('/proc/self/mountinfo'):\n"
    "    if 'docker.sock' in mount or 'containerd' in mount:\n"
    "        found.append(mount.strip())\n"
    "reached = []\n"
    "for host in ('172.17.0.1', '172.18.0.1', '10.0.0.1', '192.168.65.1', 'host.docker.internal', '127.0.0.1'):\n"
    "    for port in (2375, 2376):\n"
    "        try:\n"
    "            socket.create_connection((host, port), timeout=2).close()\n"
    "            reached.append((host, port))\n"
    "        except OSError:\n"
    "            pass\n"
    "routes = open('/proc/net/route').read().splitlines()[1:]\n"
    "print(found, reached, routes)\n"
)


async def test_the_docker_socket_and_api_are_absent_and_unreachable(service: SandboxService) -> None:
    with anyio.fail_after(60):
        result = await service.run(OWNER, DOCKER_HUNT, timeout=45)
    assert result.status == "ok", result
    assert result.stdout == "[] [] []\n", result
    await assert_answers(service)


# -- 25. network -------------------------------------------------------------------------------------------
NETWORK = (
    "import os, socket\n"
    "reached = []\n"
    "for host, port in (('1.1.1.1', 443), ('8.8.8.8', 53), ('169.254.169.254', 80), ('172.17.0.1', 80),\n"
    "                   ('172.17.0.1', 8000), ('127.0.0.1', 8000), ('10.0.0.1', 80), ('[::1]', 8000)):\n"
    "    try:\n"
    "        family = socket.AF_INET6 if host.startswith('[') else socket.AF_INET\n"
    "        with socket.socket(family, socket.SOCK_STREAM) as s:\n"
    "            s.settimeout(2)\n"
    "            s.connect((host.strip('[]'), port))\n"
    "        reached.append((host, port))\n"
    "    except OSError:\n"
    "        pass\n"
    "try:\n"
    "    socket.getaddrinfo('example.com', 80)\n"
    "    reached.append('dns')\n"
    "except OSError:\n"
    "    pass\n"
    "try:\n"
    "    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
    "    u.sendto(b'x', ('8.8.8.8', 53))\n"
    "    reached.append('udp')\n"
    "except OSError:\n"
    "    pass\n"
    "print(reached, sorted(os.listdir('/sys/class/net')))\n"
)


async def test_no_outbound_connection_is_possible(service: SandboxService) -> None:
    with anyio.fail_after(60):
        result = await service.run(OWNER, NETWORK, timeout=45)
    assert result.status == "ok", result
    assert result.stdout == "[] ['lo']\n", result
    await assert_answers(service)


KERNEL_SHARED = (
    "import errno, os, socket, ctypes\nrefused = []\n"
    "for family in (socket.AF_INET, socket.AF_INET6):\n"
    "    try:\n        socket.socket(family).close()\n"
    "    except OSError as error:\n        refused.append(errno.errorcode[error.errno])\n"
    "a, b = socket.socketpair(); a.send(b'unix works'); print(b.recv(20).decode())\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "print(refused, libc.inotify_init1(0), errno.errorcode[ctypes.get_errno()])\n"
    "rt = ctypes.CDLL('librt.so.1', use_errno=True)\n"
    "made = rt.mq_open(b'/q', os.O_CREAT | os.O_RDWR, 0o600, None)\n"
    "try:\n    open('/dev/mqueue/q2', 'w'); made = 0\nexcept OSError as error:\n    pass\n"
    "print(made, errno.errorcode[ctypes.get_errno()])\n"
)


async def test_without_a_network_internet_sockets_inotify_and_posix_queues_are_refused_and_unix_sockets_work(
    service: SandboxService,
) -> None:
    # Loopback socket buffers are charged to no container's memory, and inotify instances are
    # counted per uid across the host: both would let one tenant starve the others.
    result = await service.run(OWNER, KERNEL_SHARED)
    assert result.status == "ok", result
    unix, refused, queues = result.stdout.splitlines()
    assert unix == "unix works"
    if service.config.runtime == "runsc":  # gVisor turns every refusal into EPERM; its queues are its own
        assert refused == "['EPERM', 'EPERM'] -1 EPERM"
    else:
        assert refused == "['EAFNOSUPPORT', 'EAFNOSUPPORT'] -1 ENOSYS"
        assert queues == "-1 EACCES"  # POSIX queue bytes are counted per uid across the host too


# -- 26. the server's environment and configuration ---------------------------------------------------------
LOOK_FOR_SECRETS = (
    "import os\n"
    "blobs = [repr(dict(os.environ)).encode()]\n"
    "for p in os.listdir('/proc'):\n"
    "    for what in ('environ', 'cmdline'):\n"
    "        try:\n"
    "            blobs.append(open(f'/proc/{p}/{what}', 'rb').read())\n"
    "        except OSError:\n"
    "            pass\n"
    "for path in ('/etc/hostname', '/etc/hosts', '/proc/1/cgroup', '/proc/self/mountinfo'):\n"
    "    try:\n"
    "        blobs.append(open(path, 'rb').read())\n"
    "    except OSError:\n"
    "        pass\n"
    "for root, dirs, files in os.walk('/run'):\n"
    "    for name in files:\n"
    "        try:\n"
    "            blobs.append(open(os.path.join(root, name), 'rb').read(1 << 16))\n"
    "        except OSError:\n"
    "            pass\n"
    "data = b'\\n'.join(blobs)\n"
    "print(sorted(os.environ))\n"
    "print([c for c in CANARIES if c.encode() in data])\n"
)


# What user code finds in its environment: the agent's fixed set, and thread-pool sizes.
SANDBOX_ENVIRONMENT = (
    "HOME",
    "LANG",
    "MPLBACKEND",
    "MPLCONFIGDIR",
    "PATH",
    # pip, offline: only the wheels the host copied in, into the session's own site directory
    "PIP_BREAK_SYSTEM_PACKAGES",
    "PIP_DISABLE_PIP_VERSION_CHECK",
    "PIP_FIND_LINKS",
    "PIP_NO_CACHE_DIR",
    "PIP_NO_COMPILE",
    "PIP_NO_INDEX",
    "PIP_NO_WARN_SCRIPT_LOCATION",
    "PIP_PROGRESS_BAR",
    "PLOTLY_RENDERER",
    "PYTHONUNBUFFERED",
    "PYTHONUSERBASE",
    "TERM",
    "TMPDIR",
    "USER",
    "OPENBLAS_NUM_THREADS",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
)


async def test_the_servers_environment_and_token_never_reach_the_sandbox(monkeypatch: pytest.MonkeyPatch) -> None:
    env_canary = "envcanary" + secrets.token_hex(8)
    token_canary = "tokencanary" + secrets.token_hex(8)
    monkeypatch.setenv("MCP_CODE_EXEC_SECRET_FOR_TEST", env_canary)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", env_canary)
    config = make_test_config(
        pool={"size": 1, "session_spares": 0}, http={"token": token_canary, "tokens": {"other": token_canary + "2"}}
    )
    code = f"CANARIES = {[env_canary, token_canary]!r}\n" + LOOK_FOR_SECRETS
    async with SandboxService.start(config) as service:
        await service.wait_ready()
        session = await service.new_session(OWNER)
        for session_id in (None, session.session_id):
            result = await service.run(OWNER, code, session_id=session_id)
            assert result.status == "ok", result
            names, leaked = result.stdout.splitlines()
            assert leaked == "[]", result
            assert "AWS_SECRET_ACCESS_KEY" not in names and "MCP_CODE_EXEC" not in names
            assert ast.literal_eval(names) == sorted(SANDBOX_ENVIRONMENT)
