"""Code mode's broker: the host's MCP client of the upstream servers configured in ``[code_mode]``.

Sandbox code calls ``mcp_tools.<server>.<tool>(...)``; the call crosses the framed channel to the
host (never a network socket), and the broker judges it (who may use the server, the policy's
allow, ask or deny, the run's budgets, the tool's input schema), makes it upstream, and answers
with a capped result. It is a layer of its own between ``service`` (which wires it into runs) and
``sandbox`` (which carries the calls), and the one place besides the MCP face that imports
``mcp``: it is an MCP client.
"""
