"""KV tiers below the engine's device pool: host memory and local disk (issue 21).

A full, cached block that the pool evicts is written down (device → host → disk) instead of
being lost; a prompt whose next blocks miss the pool but sit in a lower tier loads them back
instead of recomputing them. Every block that leaves the pool carries its layout key and a
checksum (`block_codec.py`); one that fails either is dropped and recomputed.
"""
