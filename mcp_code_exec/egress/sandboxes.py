"""What an egress-enabled sandbox is started with: the proxy's socket volume, read-only at
``MOUNT``, and the variables that tell its agent to start the relay and where the CA bundle is."""

from __future__ import annotations

MOUNT = "/run/mcpx-egress"
SOCKET_VOLUME_PREFIX = "mcp-code-exec-egress-"  # and the service instance
# gVisor lets a sandbox connect to a host's unix socket only with this flag (its older name too).
HOST_UDS_FLAGS = ("--host-uds=open", "--host-uds=all", "-fsgofer-host-uds", "--fsgofer-host-uds")


def sandbox_environment() -> dict[str, str]:
    """For the agent: the socket its relay joins, the bundle its clients are told to trust."""
    return {"MCPX_EGRESS_SOCKET": f"{MOUNT}/proxy.sock", "MCPX_EGRESS_CA": f"{MOUNT}/ca-bundle.pem"}
