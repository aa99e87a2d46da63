"""Container engines: the port (``base``), its Docker adapter (``docker/``), several engines as one
(``cluster``, with ``members`` keeping each one's health), an in-memory engine for the unit tier
(``memory``), and whether an image is the one its build context makes (``images``)."""
