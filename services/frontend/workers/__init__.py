"""The frontend's workers: the pool (membership and readiness) and the session each request travels on."""
