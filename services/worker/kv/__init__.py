"""The worker side of KV transfer: the seam (transfer), its connector implementation
(connector_transfer, rank_transfer, tp_fanout), the two halves of a disaggregated
request (remote_prefill on the decode worker, prefill_server on the prefill worker)
and the decode side's write fences (write_fences)."""
