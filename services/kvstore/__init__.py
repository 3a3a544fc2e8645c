"""`splitserve kvstore`: the shared KV block store (issue 21; docs/architecture.md §4)."""
