"""The host-agent protocol, specified once on the host side.

``frames``: the byte framing and its size and nesting limits; ``messages``: every request the host
sends and every event the agent may send, as typed models; ``paths``: the /mnt/data path rules.
The agent's half is ``images/python/agent/mcpx_agent/protocol.py`` (the framing) and ``events.py``
(a builder per event; stdlib only, they run in the sandbox); ``tests/unit/test_protocol_halves.py``
runs frames, paths and every event the agent builds through both so they cannot drift.
"""
