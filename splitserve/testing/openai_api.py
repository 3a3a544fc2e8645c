"""A running frontend's OpenAI API as tests read it: the name of the model it serves.

Requests name the model they want; a splitserve frontend serves one, listed by /v1/models
once a worker is ready (503 before), so tests read the name there rather than repeat it.
"""

from __future__ import annotations

import ssl

import httpx


def served_model_name(openai_url: str, *, headers: dict[str, str] | None = None,
                      verify: ssl.SSLContext | bool = True) -> str:
    """The id of the one model that /v1/models at `openai_url` (http://HOST:PORT/v1) lists.

    `headers` carry an API key where the frontend wants one; `verify` is the TLS context
    that trusts an HTTPS frontend's certificate."""
    reply = httpx.get(f"{openai_url}/models", headers=headers, verify=verify, timeout=30)
    reply.raise_for_status()
    models = reply.json()["data"]
    assert len(models) == 1, models
    return models[0]["id"]
