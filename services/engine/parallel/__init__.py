"""Tensor parallelism: one process per rank over torch.distributed, and rank 0's control channel."""
