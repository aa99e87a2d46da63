"""The Docker adapter of the engine port (``runtime.base``): the only package that imports the
Docker SDK. ``engine`` (``DockerEngine``), ``attach`` (the attach stream), ``disks`` (sized
volumes), ``endpoints`` (unix, tcp with TLS, ssh), ``images``, ``mounts``, ``ssh``."""
