"""mcp-code-exec: an MCP server that runs untrusted Python in hardened, warm Docker containers.

The embedding API: ``load_config`` reads the configuration (file, environment, overrides) into a
``Config``; ``SandboxService.start(config)`` is the service as an async context manager (runs,
sessions, files); every error it raises to a caller is a ``SandboxError``. The MCP face over it is
``mcp_code_exec.mcp_server.build_server``.
"""

__version__ = "0.1.0"  # first: the layers below read it while the package is importing them

from .config import Config, load_config
from .errors import SandboxError
from .service import SandboxService

__all__ = ["Config", "SandboxError", "SandboxService", "__version__", "load_config"]
