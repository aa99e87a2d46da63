"""The in-container agent, grouped by the process that runs the code (the security boundary).

``supervisor/`` runs as root with only CAP_KILL, CAP_SETUID and CAP_SETGID: it talks to the host,
never runs user code and never forks a worker. ``zygote/`` loads the libraries once and forks every
worker; it never holds anything of a run. ``worker/`` is a fork of the zygote that drops to a
sandbox uid and runs the user's code. Shared by all three: ``protocol`` (the agent's half of the
wire format), ``events`` (a builder for everything the agent says), ``handles`` (a worker's pid and
pipes), ``identity`` (the one libc handle and acting as the sandbox user), ``output`` (capped output
capture) and ``history_format`` (a session's history file); ``__main__`` starts them.
"""
