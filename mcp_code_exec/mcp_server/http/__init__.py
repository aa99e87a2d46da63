"""The HTTP host: the MCP server on SSE or streamable HTTP, with its tokens, its guards and its own routes."""
