"""splitserve: LLM serving with disaggregated prefill and decode.

This folder is only the import root; the code lives in the top-level folders that
pyproject.toml maps to `splitserve.services`, `splitserve.router`, and so on.
"""

__version__ = "0.1.0"
