"""What identities spend and what they did: quotas over time, the audit log, usage reports.

Pure bookkeeping below the engine port (it knows no engine, container or transport): rolling
windows and the quota book (``windows``, ``quotas``: the service admits runs and installs through
it, the sandbox layer keeps its counts on the engine, ``sandbox/ledgers``), the audit log's chain
and writer (``chain``, ``audit``: every layer records into it; ``audit_logger``: what is logged on
the audit logger goes there too), and the report ``mcp-code-exec
usage`` prints (``report``).
"""
