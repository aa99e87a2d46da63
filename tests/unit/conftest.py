"""The unit tier: no Docker engine, seconds to run. Containers are played by ``FakeAgent`` over the
in-memory engine (``mcp_code_exec.runtime.memory``); the real-engine tier is ``tests/engine``."""
