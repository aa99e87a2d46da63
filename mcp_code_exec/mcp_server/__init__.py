"""The MCP face of the sandbox service: the only package that imports ``mcp`` (with the CLI).

app            build_server: assembles the parts below over a running service
tools          the tools (thin adapters to the service) and their one error mapping
resources      files and run output as resources, per identity
notify         change notifications for both protocol eras, scoped per identity
tasks          the Tasks extension (SEP-2663) for run_python
approval       asking the user before a code-mode call that needs it
identity       who is asking (the bearer token's name, or the stdio client's OS user or name)
progress       following a run from a call: output as progress notifications
answers        results as content blocks and the text a model reads; descriptions: what it reads of the tools
notebook_view  a session's notebook as an MCP Apps view
sdk            every use of the SDK's internals, in one place
http/          the HTTP host: SSE and streamable HTTP, tokens, guards, file URLs, the metrics port
local/         the local service stdio fronts share, and the server over stdio in one process
"""

from .app import build_server

__all__ = ["build_server"]
