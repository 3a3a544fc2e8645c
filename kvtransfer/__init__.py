"""Connector API, NIXL backend, TCP fallback, layout handshake (issue 3)."""
