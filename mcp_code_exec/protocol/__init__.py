"""The host-agent protocol, specified once on the host side.

``frames``: the byte framing and its size and nesting limits; ``messages``: every request the host
sends and every event the agent may send, as typed models; ``paths``: the /mnt/data path rules.
The agent's half is ``images/python/agent/mcpx_agent/protocol.py`` (stdlib only, it runs in the
sandbox); ``tests/unit/test_protocol_halves.py`` runs frames and paths through both so they
cannot drift.
"""
