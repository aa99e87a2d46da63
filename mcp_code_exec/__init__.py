"""mcp-code-exec: an MCP server that runs untrusted Python in hardened, warm Docker containers.

The embedding API: ``load_config`` reads the configuration (file, environment, overrides) into a
``Config``; ``SandboxService.start(config)`` is the service as an async context manager (runs,
sessions, files); every error it raises to a caller is a ``SandboxError``. The MCP face over it is
``mcp_code_exec.mcp_server.build_server``.

The names load on first use: ``import mcp_code_exec`` alone (as the command line does before it
knows what it will run) costs nothing of the service's imports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import Config, load_config
    from .errors import SandboxError
    from .service import SandboxService

__version__ = "0.1.0"
__all__ = ["Config", "SandboxError", "SandboxService", "__version__", "load_config"]
_HOMES = {"Config": ".config", "load_config": ".config", "SandboxError": ".errors", "SandboxService": ".service"}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home, __name__), name)
