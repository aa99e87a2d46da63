"""One sandbox and what keeps sandboxes: ``container`` (a container and its agent), ``channel`` and
``transfer`` (the framed stream to the agent, and files over it), ``pool`` (warm containers),
``spec`` and ``seccomp`` (how a container is made), ``volumes`` (sessions' disks), ``ownership``
(whose container it is, and sweeping what a dead server left), ``image`` (is the image current)."""
