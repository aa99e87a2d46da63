"""``serve`` over stdio: the front that relays its client to the local service. Standard library only.

front          relays a client to the local service, starting it if needed
handshake      the answer to a client's handshake that a front gives at once
local_service  where a user's local service lives, the identity it gives a client, reaching it
isolation      the host's Python processes never import what a sandbox wrote
"""
