"""The HTTP host: the MCP server on SSE or streamable HTTP, and what is HTTP's own.

host         serve_http: the server built with the tokens and file URLs; /healthz, /metrics, /files
auth         the bearer tokens and the identity each names
guard        deadlines and shares for every connection (uvicorn's HTTP/1.1 protocol, guarded)
listeners    the connections all the server's listeners may hold together, and a quiet exit
observe      /metrics with its own permission, refused tokens counted, --metrics-port
logs         the HTTP layer's warnings, rate-limited
file_routes  /files/{token}: a session's file streamed out or in
file_tokens  the capability tokens of file URLs
"""
