"""The MCP face of the sandbox service: the only package that imports ``mcp`` (with the CLI).

app          build_server: assembles the parts below over a running service
tools        the tools (thin adapters to the service) and their one error mapping
resources    files and run output as resources, per identity
notify       change notifications for both protocol eras, scoped per identity
tasks        the Tasks extension (SEP-2663) for run_python
identity     who is asking (the bearer token's name, or the stdio client's OS user or name)
progress     following a run from a call: output as progress notifications
content      results as content blocks; render: the text a model reads; texts: descriptions
sdk          every use of the SDK's internals, in one place
daemon       the local service stdio fronts share (MCP over a unix socket, one session per connection)
transports   stdio, SSE and streamable HTTP (tokens, Host/Origin, limits); http_guard
"""

from .app import build_server

__all__ = ["build_server"]
