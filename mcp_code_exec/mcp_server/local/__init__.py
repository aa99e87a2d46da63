"""The local service stdio fronts share, and the server over stdio in one process.

daemon        the service: MCP over a unix socket, one MCP session per connection
late_service  its SandboxService while it starts, and the gate that holds calls until it has
stdio         ``serve --in-process``: the server on this process's stdin and stdout
"""
