"""Controlled egress: sandboxes reach the hosts ``[egress] allow`` names, through a proxy of the
server's, with the headers ``[[egress.secrets]]`` add, which they never see.

A sandbox keeps no network of its own. A relay of its agent listens on 127.0.0.1:3128 in the
sandbox's loopback and carries bytes to the proxy's unix socket, on a volume every sandbox mounts
read-only; the proxy (mitmproxy with the addon of ``images/egress``, in a container of its own)
decides. Each run carries a grant the server signs (``tokens``) in its ``HTTP_PROXY``: who asks
(the identity's reach, as ``principals`` and a session's narrowing leave it, see ``reach``),
for which session or run, until when, from which container (the proxy takes it only from there).
``proxy`` starts the proxy, speaks its control channel and restarts it; ``accounting`` turns its
access records into metrics, log lines, day counters and notes for a run's result; ``service`` is
what the sandbox service calls.
"""
