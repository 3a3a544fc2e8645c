"""One HTTP request's ext_proc stream, from request headers to the last response chunk.

Envoy opens one `Process` stream per request (FULL_DUPLEX_STREAMED bodies). The request's
headers are kept; its body chunks are gathered (up to `max_body_bytes`: 413 past it) until the
chunk with `end_of_stream` (often an empty one). Then the picker parses it, flow control admits it
(it may wait in its band, or be shed: 429, `x-llm-d-request-dropped-reason`), the picker routes
it, and the answer goes back in protocol
order: the headers mutation (endpoint, prefill worker, clear_route_cache) first, then the whole
body in chunks. A refusal is one `ImmediateResponse` (the model server's own 4xx body, 503 when
nothing is ready) and ends the stream. On the way back every response chunk is passed on as it
comes; the first with bytes credits the router's first token (the prefill is over), the last
credits completion. A stream that ends any other way (the client gone, Envoy cancelling) credits
completion and releases the flow-control ticket in `close()`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import orjson

from splitserve.proto.v1 import ext_proc_pb2

from splitserve.services.frontend.errors import APIError
from splitserve.services.flow_control import DROPPED_REASON_HEADER, Shed, Ticket

from splitserve.services.epp import protocol
from splitserve.services.epp.metrics import EppMetrics
from splitserve.services.epp.picker import EndpointPicker, Pick

log = logging.getLogger(__name__)

JSON = ("content-type", "application/json")
# Flow control for one request, called with its headers and its body's priority once it is
# parsed: the Ticket it holds until its response ends; raises the 429 APIError (or Shed).
Admission = Callable[[dict[str, str], int], Awaitable[Ticket]]


@dataclass(slots=True)
class Exchange:
    picker: EndpointPicker
    metrics: EppMetrics
    max_body_bytes: int
    admission: Admission | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)
    subset: frozenset[str] | None = None
    pick: Pick | None = None
    ticket: Ticket | None = None
    streamed_first: bool = False
    finished: bool = False
    ended: bool = False           # nothing more to answer: the stream may close

    async def on(self, message: ext_proc_pb2.ProcessingRequest) -> list[ext_proc_pb2.ProcessingResponse]:
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            self.headers = protocol.header_map(message.request_headers.headers)
            self.subset = protocol.subset_hint(message)
            return await self._route(None) if message.request_headers.end_of_stream else []
        if kind == "request_body":
            self.body += message.request_body.body
            if len(self.body) > self.max_body_bytes:
                return self._refuse(APIError(413, f"the request body is larger than {self.max_body_bytes} bytes",
                                             type="invalid_request_error", code="request_too_large"))
            return await self._route(bytes(self.body)) if message.request_body.end_of_stream else []
        if kind == "request_trailers":
            out = [] if self.pick is not None else await self._route(bytes(self.body), trailers_follow=True)
            return out if self.ended else [*out, protocol.continue_trailers("request_trailers")]
        if kind == "response_headers":
            return [protocol.continue_headers("response_headers")]
        if kind == "response_body":
            chunk = message.response_body
            if chunk.body and not self.streamed_first and self.pick is not None:
                self.streamed_first = True
                self.picker.credit_first_token(self.pick)
            if chunk.end_of_stream:
                self._finish()
            return protocol.body_chunks("response_body", chunk.body, chunk.end_of_stream)
        if kind == "response_trailers":
            self._finish()
            return [protocol.continue_trailers("response_trailers")]
        return []

    async def _route(self, body: bytes | None, trailers_follow: bool = False) -> list[ext_proc_pb2.ProcessingResponse]:
        began = time.perf_counter()
        path = self.headers.get(":path", "/")
        try:
            parsed = self.picker.parse(path, body)
            if self.admission is not None:
                self.ticket = await self.admission(self.headers, parsed.priority)
                began = time.perf_counter()       # the pick's own time: the wait is flow control's
            self.pick = self.picker.route(parsed, self.subset)
        except Shed as shed:
            self.metrics.outcome("shed")
            return self._immediate(429, APIError(429, str(shed), type="rate_limit_error", code=shed.reason).body(),
                                   [(DROPPED_REASON_HEADER, shed.reason), ("retry-after", str(shed.retry_after_s))])
        except APIError as error:
            return self._refuse(error)
        except Exception:  # noqa: BLE001 - one request's bug must not end the picker
            log.exception("epp: picking for %s failed", path)
            return self._refuse(APIError(500, "the endpoint picker failed on this request", type="server_error"))
        self.metrics.picked(time.perf_counter() - began)
        log.debug("epp: %s -> %s%s (%s)", path, ",".join(self.pick.endpoints),
                 f", prefill {self.pick.prefill}" if self.pick.prefill else "", self.pick.worker_id)
        out = [protocol.route_to(self.pick.endpoints, self.pick.prefill)]
        if body is not None:
            out += protocol.body_chunks("request_body", body, not trailers_follow)
        return out

    def _refuse(self, error: APIError) -> list[ext_proc_pb2.ProcessingResponse]:
        self.metrics.outcome("shed" if error.status == 429 else "unavailable" if error.status == 503 else
                             "refused" if error.status < 500 else "failed")
        return self._immediate(error.status, error.body(), list(error.headers.items()))

    def _immediate(self, status: int, document: dict, headers: list[tuple[str, str]]
                   ) -> list[ext_proc_pb2.ProcessingResponse]:
        self.ended = True
        self.close()
        return [protocol.immediate(status, orjson.dumps(document), [JSON, *headers])]

    def _finish(self) -> None:
        if self.pick is not None and not self.finished:
            self.finished = True
            self.picker.credit_finished(self.pick)
        if self.ticket is not None:
            self.ticket.release()

    def close(self) -> None:
        """However the stream ended: the router's booking and the ticket end here (idempotent)."""
        self._finish()
