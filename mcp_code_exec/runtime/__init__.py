"""Container engines: the port (``base``), its Docker adapter (``docker/``), several engines as one
(``cluster``, with ``members`` keeping each one's health) and an in-memory engine for the unit tier
(``memory``)."""
