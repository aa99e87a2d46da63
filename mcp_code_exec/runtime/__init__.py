"""Container engines: the port (``base``) and its Docker adapter (``docker``)."""
