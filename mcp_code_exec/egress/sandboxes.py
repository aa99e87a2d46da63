"""What an egress-enabled sandbox is started with: the proxy's socket volume, read-only at
``MOUNT``, and the variables that tell its agent to start the relay and where the CA bundle is."""

from __future__ import annotations

MOUNT = "/run/mcpx-egress"
# The group of the proxy's socket, and the agent's relay's (``mcpx_agent.relay.RELAY_UID``): only the
# relay may connect to it, so a sandbox's connections are the relay's, and held to its cap; the
# sandbox user, who can read the CA bundle beside it, gets EACCES.
RELAY_GID = (1 << 30) - 2
SOCKET_VOLUME_PREFIX = "mcp-code-exec-egress-"  # and the service instance
# gVisor lets a sandbox connect to a host's unix socket only with this flag (its older name too).
HOST_UDS_FLAGS = ("--host-uds=open", "--host-uds=all", "-fsgofer-host-uds", "--fsgofer-host-uds")


def sandbox_environment() -> dict[str, str]:
    """For the agent: the socket its relay joins, the bundle its clients are told to trust."""
    return {"MCPX_EGRESS_SOCKET": f"{MOUNT}/proxy.sock", "MCPX_EGRESS_CA": f"{MOUNT}/ca-bundle.pem"}
