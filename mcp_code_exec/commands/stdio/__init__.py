"""``serve`` over stdio: the front that relays its client to the local service. Standard library only."""
