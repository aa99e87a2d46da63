"""mcp-code-exec: an MCP server that runs untrusted Python in hardened, warm Docker containers."""

__version__ = "0.1.0"
