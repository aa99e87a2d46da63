"""The local service stdio clients share, and the server over stdio in one process."""
