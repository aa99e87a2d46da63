"""What user code sees of egress: the proxy and CA variables that make requests, urllib, httpx,
pip, curl and git go through the server's proxy (see ``relay``), in sandboxes started with it.

The CA bundle and NO_PROXY are the container's, set once for every worker (``static``). The proxy's
URL carries the run's grant, so it comes with each cell (``before_cell``); a session's stays the
same from cell to cell, and is then not written again (each write copies pages of the forked heap).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")  # curl reads only the lower case
CA_VARS = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_CERT", "NODE_EXTRA_CA_CERTS", "CURL_CA_BUNDLE", "GIT_SSL_CAINFO")
NO_PROXY = "localhost,127.0.0.1,::1"
# User code's own pip may use an index through the proxy (the server's offline installs set their
# own variables, see ``packages``): an allowed index just works, another is refused by the proxy.
DROPPED = ("PIP_NO_INDEX", "PIP_FIND_LINKS")


def static(container: Mapping[str, str]) -> dict[str, str]:
    """The variables every worker gets, from the container's environment (none without egress)."""
    bundle = container.get("MCPX_EGRESS_CA")
    if not bundle:
        return {}
    return {**{name: bundle for name in CA_VARS}, "NO_PROXY": NO_PROXY, "no_proxy": NO_PROXY}


def before_cell(proxy: object) -> None:
    """Point the proxy variables at this cell's grant (or remove them: a run without egress)."""
    if isinstance(proxy, str) and proxy.startswith("http://"):
        if os.environ.get("HTTP_PROXY") != proxy:
            for name in PROXY_VARS:
                os.environ[name] = proxy
    elif "HTTP_PROXY" in os.environ:
        for name in PROXY_VARS:
            os.environ.pop(name, None)
