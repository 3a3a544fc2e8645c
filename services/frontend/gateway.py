"""Gateway mode (`splitserve frontend --gateway`): an endpoint picker in front chose this pod.

Behind a Gateway API Inference Extension gateway, each decode (or aggregated) worker pod serves the
OpenAI API itself, through a frontend whose only worker is the pod's own. The endpoint picker
(`splitserve epp`, or llm-d's) already chose this pod, and for a disaggregated pool also the
prefill worker, which it names in the request header `x-prefiller-host-port` (llm-d's name): the
prefill worker's gRPC `host:port`. The frontend hands it to its decode worker as the prefill peer;
without the header (no prefill pool, or the gateway failing open past the picker) the decode
worker prefills locally.
"""

from __future__ import annotations

from splitserve.services.frontend.errors import APIError, invalid

PREFILLER_HEADER = "x-prefiller-host-port"
_PREFILLER_HEADER_BYTES = PREFILLER_HEADER.encode()


def gateway_prefill_address(headers: list[tuple[bytes, bytes]]) -> str:
    """The `x-prefiller-host-port` header's `host:port` ("" when absent); an APIError (400) for a
    value that is not one `host:port` (llm-d may list several: the first is taken)."""
    value = next((v for k, v in headers if k.lower() == _PREFILLER_HEADER_BYTES), b"")
    text = value.decode("latin-1").strip()
    if not text:
        return ""
    first = text.split(",")[0].strip()
    host, sep, port = first.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise _bad(text)
    return first


def _bad(value: str) -> APIError:
    return invalid(f"header {PREFILLER_HEADER} must be the prefill worker's host:port, got {value[:100]!r}",
                   None, "invalid_header")
