"""OpenAI-compatible HTTP and gRPC inference API (issue 4)."""
