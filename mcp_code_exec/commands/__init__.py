"""What a person runs: ``cli`` (``mcp-code-exec``), ``doctor``, ``image`` (build and custom images)
and ``bench`` (the benchmark, an MCP client of the server)."""
