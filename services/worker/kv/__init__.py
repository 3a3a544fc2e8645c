"""The worker side of KV transfer: remote prefill (decode side), the prefill server, write fences, per-rank transfer, TP fan-out."""
