"""Request migration (DESIGN section 7): continue a request on another decode worker when
the stream from the one serving it breaks.

A stream is broken when the worker call fails with a status that says the worker (not
the request) is the problem — it crashed or was killed (UNAVAILABLE), it is shutting
down or draining and gave up (UNAVAILABLE, CANCELLED), the connection was lost, it
failed internally — or when it ends without a finished message. The frontend then
sends the prompt plus every token it has already forwarded to the client to another
decode worker, excluding every worker that failed this request, with the remaining
token budget, up to `limit` times. The client sees one uninterrupted stream.

Why replay is exact:
- greedy: the new worker recomputes the KV of prompt + forwarded tokens and continues
  from the same logits (the engine's oracle tests show any batch or prefill split gives
  the same greedy tokens);
- seeded sampling: a draw consumes the same random numbers whatever the probabilities
  (sampler.skip_draws), so the new worker seeds the generator and skips one draw per
  forwarded token (`SamplingParams.num_prior_draws`): the continuation is the one the
  first worker would have sampled;
- penalties and min_tokens: `num_prior_output_tokens` tells the new worker which of its
  prompt tokens are output, so presence/frequency penalties count the same tokens
  (repetition counts prompt + output either way), and min_tokens is reduced by the
  forwarded tokens like max_tokens;
- unseeded sampling: the continuation is a fresh sample from the same distribution,
  which is all an unseeded request promises;
- stop strings: the frontend detokenizes the whole output (text/stop_checker.py) and
  judges stop strings itself, so a stop string that spans the migration point is still
  found and cut (workers never see stop strings, and the new one only its own tokens);
- usage: prompt tokens are the original prompt's, completion tokens all forwarded ones.

When it is refused (and counted, `splitserve_migrations_total{outcome="refused_*"}`):
migration disabled (`limit` 0), the limit reached, no other decode worker ready, or the
context full (prompt + forwarded tokens leave no room). Errors that are the request's
own fault (INVALID_ARGUMENT and the like) are never retried.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

import grpc

from splitserve.proto.v1 import worker_pb2
from splitserve.services.worker_protocol.proto_conversion import params_to_proto
from splitserve.services.worker_protocol.sampling_params import SamplingParams

DEFAULT_LIMIT = 2

# Statuses that blame the worker or the connection, not the request.
_BROKEN = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL,
           grpc.StatusCode.UNKNOWN, grpc.StatusCode.ABORTED, grpc.StatusCode.DATA_LOSS}


DEFAULT_WAIT_S = 30.0


class Refusal(enum.Enum):
    DISABLED = "disabled"
    LIMIT = "limit"
    NO_WORKER = "no_worker"
    CONTEXT_FULL = "context_full"

    @property
    def message(self) -> str:
        return {Refusal.DISABLED: "migration is disabled (--migration-limit 0)",
                Refusal.LIMIT: "it was already migrated as often as --migration-limit allows",
                Refusal.NO_WORKER: "no other decode worker (of the weights revision that began the response) "
                                   "became ready within --migration-wait",
                Refusal.CONTEXT_FULL: "the prompt and the tokens generated so far fill the context"}[self]


def breaks_stream(exc) -> bool:
    """`exc`: a grpc.aio.AioRpcError or a session's WorkerCallError (both have code()).
    True when the call failed because of the worker or the network (migrate), False when
    the worker refused the request itself (report it to the client)."""
    return exc.code() in _BROKEN


@dataclass(slots=True)
class Progress:
    """One request across the workers that served it: what the client has been sent."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)      # forwarded to the client
    num_cached_tokens: int | None = None                    # from the first worker that said
    failed_worker_ids: set[str] = field(default_factory=set)
    # worker id -> the instance whose stream broke: the same worker restarted (a new
    # instance at its address, `splitserve serve` restarting it) may serve the request again.
    failed_instances: dict[str, str] = field(default_factory=dict)
    num_migrations: int = 0
    # The fingerprint (weights, tokenizer, engine) of the worker the forwarded tokens came from:
    # a migration continues only on a worker of the same one, never mixing two revisions.
    fingerprint: str = ""
    # Moves an operator asked for (live_moves.py): not failures, not counted against the limit.
    num_moves: int = 0
    kv_source: worker_pb2.KvSource | None = None   # the next call reads the KV from there
    move_to: str | None = None                      # the next call goes to this decode worker
    moved_from: str = ""                            # ... or to any but this one

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    def attempt_id(self) -> str:
        """The request id the next worker call uses: a fresh one per attempt, so a worker or a
        prefill worker that still holds the old attempt never sees a duplicate id."""
        attempts = self.num_migrations + self.num_moves
        return self.request_id if not attempts else f"{self.request_id}.m{attempts}"

    def worker_request(self) -> worker_pb2.TokenGenerateRequest:
        """The next worker call: prompt + forwarded tokens, the remaining budget (max_tokens
        and min_tokens), the draws a seeded generator has made so far, and how many prompt
        tokens are output (presence/frequency penalties count them as the first worker did).

        Without stop strings: workers stop on token ids only and ignore them (text is the
        frontend's work), so sending them would only suggest that a worker judges them. A
        stop string ends the request here: the frontend closes the worker stream, which
        aborts the request on the worker."""
        n = self.num_output_tokens
        params = replace(
            self.params, max_tokens=self.params.max_tokens - n, stop=[], include_stop_str_in_output=False,
            num_prior_draws=self.params.num_prior_draws + (n if self.params.seed is not None else 0),
            min_tokens=max(0, self.params.min_tokens - n),
            num_prior_output_tokens=self.params.num_prior_output_tokens + n,
            # Sent with the first token: once any token was forwarded, the client has them.
            prompt_logprobs=self.params.prompt_logprobs if not n else None)
        message = worker_pb2.TokenGenerateRequest(
            request_id=self.attempt_id(), token_ids=self.prompt_ids + self.token_ids,
            params=params_to_proto(params), cache_salt=params.cache_salt)
        if self.kv_source is not None:
            message.kv_source.CopyFrom(self.kv_source)
        return message


@dataclass(slots=True, frozen=True)
class MigrationPolicy:
    limit: int = DEFAULT_LIMIT
    # How long a request whose worker broke waits for a decode worker when none other is
    # ready (the only one restarting): the wait is the client's TTFT/ITL gap, not an error.
    wait_s: float = DEFAULT_WAIT_S

    def refusal(self, progress: Progress, max_model_len: int | None) -> Refusal | None:
        """Why this request must not be re-dispatched now; None when it may be (the caller
        still needs a worker: no route is Refusal.NO_WORKER)."""
        if self.limit <= 0:
            return Refusal.DISABLED
        if progress.num_migrations >= self.limit:
            return Refusal.LIMIT
        n = progress.num_output_tokens
        if n >= progress.params.max_tokens or (
                max_model_len is not None and len(progress.prompt_ids) + n >= max_model_len):
            return Refusal.CONTEXT_FULL
        return None
