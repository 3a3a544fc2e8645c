"""Test support shipped inside the import root, for tests/ and bench/.

`models` builds random-weight checkpoints with a real tokenizer; `oracle` runs
transformers' greedy decoding as the reference and compares against it. Both
need the `test` extra (transformers, sentencepiece, protobuf, mistral-common),
imported only when a function runs, so importing this package is cheap.

Real processes, one job per module: `processes` (a child with its output
collected), `cluster` (workers and frontends on loopback), `etcd`, `workers`
(a worker's Stats, the leak check, one Generate), `certs` (a throwaway CA).
`clock` is the stepped clock unit tests inject instead of sleeping; `waiting`
(`wait_until`, `async_wait_until`) is the one bounded poll for everything else
that waits on a condition, here and in tests/. `doc_blocks` reads the fenced code blocks
of the repository's Markdown for the docs test (tests/integration/docs).
"""

from splitserve.testing.models import ARCHS, build_random_model
from splitserve.testing.oracle import GreedyReference, assert_greedy_match, hf_greedy

__all__ = ["ARCHS", "GreedyReference", "assert_greedy_match", "build_random_model", "hf_greedy"]
