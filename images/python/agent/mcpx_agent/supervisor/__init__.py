"""The supervisor (root, three capabilities): the host's channel, runs, files, quotas, the wipe."""
