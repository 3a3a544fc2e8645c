"""KV index, load model, scoring policies, KV-event ingestion, discovery (issue 6)."""
