"""The in-container agent, grouped by the process that runs the code (the security boundary).

``supervisor/`` runs as root with only CAP_KILL, CAP_SETUID and CAP_SETGID: it talks to the host,
never runs user code and never forks a worker. ``zygote/`` loads the libraries once and forks every
worker; it never holds anything of a run. ``worker/`` is a fork of the zygote that drops to a
sandbox uid and runs the user's code. Shared by all three: ``protocol`` (the agent's half of the
wire format), ``identity`` (the one libc handle and acting as the sandbox user) and ``output``
(capped output capture); ``__main__`` starts them.
"""
