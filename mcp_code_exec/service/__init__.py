"""The sandbox service: what the MCP face asks of it, whatever the transport.

``facade`` (``SandboxService``, the one door; ``port.ServicePort`` is its surface, which the MCP
face is typed against), ``execution`` (admission and the run), ``runs`` (the
registry of runs that may outlive their call), ``sessions``, ``files`` and ``run_files`` (a
session's files and those a stateless run left), ``uris``, ``outcomes``, ``engines``, and
``packages/`` (``pip install`` without a network: requirements, wheels, installs).
"""

from .facade import SandboxService

__all__ = ["SandboxService"]
