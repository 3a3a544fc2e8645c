"""`serve --autoscale`'s start-up profile: how fast one worker prefills and decodes.

Run once, against the first worker that decodes, after every worker is SERVING and before
`serve` says it is ready (so that no client request shares the worker with it), straight
through the worker's gRPC Generate (no frontend, so its /metrics see none of it):

1. one warm-up request (32-token prompt, 4 tokens): first-use costs (the paged-attention
   kernel, allocator growth) stay out of the timings;
2. prefill: one prompt of each of PROMPT_LENGTHS (those the worker's context and KV pool
   hold), max_tokens 1, twice; the quicker wall time of the two is the prompt's prefill
   time (`PrefillMeasurement`);
3. decode: for each of BATCH_SIZES (up to --max-num-seqs), that many concurrent requests
   (16-token prompts, DECODE_TOKENS tokens each, EOS ignored); over the span in which all
   of them are decoding (from the last first token to the first last token), the tokens
   they received give the batch's tokens/s, hence its step time (`DecodeMeasurement`).

Every prompt is random token ids under a cache salt of its own (no prefix-cache hit). It
delays serve's "ready" line by the run: 2-3 s for the random test model on one core of a
2-core machine (mostly Python and gRPC per token), longer for a real model on CPU.
The profile is refined online afterwards (planner/profile.py: observations_from_sample) and
its start-up time by every worker the autoscaler starts. The KV capacity is Describe's
num_kv_blocks x block_size.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from dataclasses import dataclass

from splitserve.proto.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from splitserve.services.planner import CapacityProfile, DecodeMeasurement, PrefillMeasurement
from splitserve.tls import PLAINTEXT, TlsConfig

PROMPT_LENGTHS = (64, 256, 1024)
BATCH_SIZES = (1, 4, 16)
DECODE_PROMPT = 16
DECODE_TOKENS = 24
CALL_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class ProfileResult:
    profile: CapacityProfile
    prefill: tuple[PrefillMeasurement, ...]
    decode: tuple[DecodeMeasurement, ...]
    took_s: float

    def describe(self) -> str:
        prefill = ", ".join(f"{m.prompt_tokens} tokens {m.prompt_tokens / m.seconds:.0f} tok/s"
                            for m in self.prefill)
        decode = ", ".join(f"batch {m.batch_size} {m.step_seconds * 1e3:.1f} ms/step" for m in self.decode)
        kv = self.profile.kv_capacity_tokens
        return (f"prefill {prefill}; decode {decode}; KV {kv if kv is not None else '?'} tokens; "
                f"start-up {self.profile.startup_s:.1f} s (profiled in {self.took_s:.1f} s)")


def decode_step_seconds(batch_size: int, streams: list[list[tuple[float, int]]]) -> float | None:
    """One decode step of `batch_size` sequences from each stream's (arrival time, tokens) messages:
    the tokens received while every stream was decoding, over that span (module header); None
    when the span holds no token."""
    if not streams or any(not s for s in streams):
        return None
    start = max(s[0][0] for s in streams)
    end = min(s[-1][0] for s in streams)
    tokens = sum(n for s in streams for t, n in s if start < t <= end)
    if end <= start or tokens <= 0:
        return None
    return batch_size / (tokens / (end - start))


class _Client:
    def __init__(self, address: str, tls: TlsConfig):
        self.channel = tls.channel(address)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self.vocab = 1000

    def describe(self) -> worker_pb2.DescribeResponse:
        info = self.stub.Describe(worker_pb2.DescribeRequest(), timeout=10)
        self.vocab = max(16, info.vocab_size)
        return info

    def prompt(self, rng: random.Random, length: int) -> list[int]:
        return [rng.randrange(3, self.vocab) for _ in range(length)]

    def generate(self, token_ids: list[int], max_tokens: int) -> list[tuple[float, int]]:
        """(arrival time, tokens) of each message."""
        request = worker_pb2.TokenGenerateRequest(
            request_id=f"profile-{uuid.uuid4().hex}", token_ids=token_ids, cache_salt=uuid.uuid4().hex,
            params=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        return [(time.monotonic(), len(r.token_ids)) for r in self.stub.Generate(request, timeout=CALL_TIMEOUT_S)]

    def close(self) -> None:
        self.channel.close()


def profile_worker(address: str, startup_s: float, max_num_seqs: int, tls: TlsConfig = PLAINTEXT,
                   seed: int = 0) -> ProfileResult:
    """The profile of the worker at `address` (module header); raises grpc.RpcError when it fails."""
    began = time.monotonic()
    rng = random.Random(seed)
    client = _Client(address, tls)
    try:
        info = client.describe()
        kv_tokens = info.num_kv_blocks * info.block_size or None
        room = min(info.max_model_len or 2**31, kv_tokens or 2**31)
        client.generate(client.prompt(rng, 32), 4)                          # warm-up
        prefill = []
        for length in [n for n in PROMPT_LENGTHS if n + 2 <= room // 2] or [min(PROMPT_LENGTHS[0], room // 2)]:
            seconds = []
            for _ in range(2):
                t0 = time.monotonic()
                client.generate(client.prompt(rng, length), 1)
                seconds.append(time.monotonic() - t0)
            prefill.append(PrefillMeasurement(length, min(seconds)))
        decode = []
        per_sequence = DECODE_PROMPT + DECODE_TOKENS
        for batch in [b for b in BATCH_SIZES if b <= max_num_seqs and b * per_sequence <= room] or [1]:
            step = _decode_batch(client, rng, batch)
            if step is not None:
                decode.append(DecodeMeasurement(batch, step))
    finally:
        client.close()
    profile = CapacityProfile.from_measurements(prefill, decode, startup_s, kv_tokens)
    return ProfileResult(profile, tuple(prefill), tuple(decode), time.monotonic() - began)


def _decode_batch(client: _Client, rng: random.Random, batch: int) -> float | None:
    prompts = [client.prompt(rng, DECODE_PROMPT) for _ in range(batch)]
    streams: list[list[tuple[float, int]]] = [[] for _ in range(batch)]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            streams[i] = [(t, n) for t, n in client.generate(prompts[i], DECODE_TOKENS) if n]
        except BaseException as exc:  # noqa: BLE001 - re-raised below, in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(batch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return decode_step_seconds(batch, streams)
