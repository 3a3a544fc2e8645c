"""The worker's part of disaggregation, over the engine contract and kvtransfer's KVSender/KVReceiver:
the two halves of a disaggregated request (remote_prefill on the decode worker, prefill_server on
the prefill worker) and the decode side's write fences (write_fences)."""
