"""``pip install`` for sandboxes without a network: ``requirements`` (what a cell asks for, held to
the policy), ``wheels`` (the host's pip, isolated: resolve and fetch wheels only) and ``installs``
(plan a run's installs and ship the wheels into its sandbox)."""
