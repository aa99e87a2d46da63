"""The supervisor (root, three capabilities): the host's channel, runs, the session, files, quotas, the wipe."""
