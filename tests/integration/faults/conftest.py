"""Fault tests: real worker/frontend processes (splitserve.testing.cluster) under concurrent
load from the official `openai` client, on the random 4-layer Llama.

Each test builds its own small cluster (it kills part of it) and ends with the leak check:
every surviving worker back to idle. Expected outputs come from the engine in this process
(greedy, and seeded sampling, which migration carries over), so "token-identical" means
identical to a run without any fault.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
from dataclasses import dataclass, field

import grpc
import openai
import pytest

from splitserve.proto.v1 import common_pb2, inference_pb2, inference_pb2_grpc

from splitserve.services.engine.config import EngineConfig
from splitserve.services.engine.engine import LLMEngine
from splitserve.services.worker_protocol.sampling_params import SamplingParams, StructuredOutput
from splitserve.testing.cluster import Cluster
from splitserve.testing.waiting import async_wait_until

MODEL_NAME = "llama"      # the served name: the checkpoint folder's name
# The fault tests' deployment: a frontend that spreads the load over every worker, and decode
# workers that send prompts of more than 64 uncached tokens to a prefill worker (20 s for one).
FRONTEND_FLAGS = ("--router", "round-robin", "--served-model-name", MODEL_NAME)
DECODE_FLAGS = ("--remote-prefill-threshold", "64", "--prefill-timeout", "20")


@dataclass(slots=True, frozen=True)
class Job:
    """One request of the load: a token-id prompt and how to sample it."""

    prompt: list[int]
    max_tokens: int
    seed: int | None = None          # None: greedy; else temperature 0.8 with this seed
    api: str = "sse"                 # sse | whole (HTTP, not streamed) | grpc (public Generate)
    # Sampling controls (penalties, min_tokens, logit_bias as {token id: bias}), HTTP only.
    controls: dict = field(default_factory=dict)
    ignore_eos: bool = True
    schema: dict | None = None       # structured output: the JSON schema (sent as response_format)

    def sampling(self) -> SamplingParams:
        extra = {} if self.seed is None else {"temperature": 0.8, "seed": self.seed}
        if self.schema is not None:
            extra["structured"] = StructuredOutput("json_schema", json.dumps(self.schema))
        return SamplingParams(max_tokens=self.max_tokens, ignore_eos=self.ignore_eos, **extra, **self.controls)

    def body(self) -> dict:
        extra = {"temperature": 0} if self.seed is None else {"temperature": 0.8, "seed": self.seed}
        controls = dict(self.controls)
        if "logit_bias" in controls:
            controls["logit_bias"] = {str(t): b for t, b in controls["logit_bias"].items()}
        if self.schema is not None:
            controls["response_format"] = {"type": "json_schema", "json_schema": {"name": "job", "schema": self.schema}}
        return dict(prompt=self.prompt, max_tokens=self.max_tokens, **extra,
                    extra_body={"ignore_eos": self.ignore_eos, "return_token_ids": True, **controls})


@dataclass(slots=True)
class Outcome:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None

    @property
    def completed(self) -> bool:
        return self.error is None and self.finish_reason is not None


def make_jobs(n: int, seed: int, min_len: int, max_len: int, max_tokens: int, num_seeded: int = 0) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        prompt = [rng.randrange(3, 31000) for _ in range(rng.randint(min_len, max_len))]
        jobs.append(Job(prompt, max_tokens, seed=1000 + i if i < num_seeded else None))
    return jobs


def expected_outputs(model_dir, jobs: list[Job]) -> list[list[int]]:
    """What a fault-free run produces: the engine in this process, each request alone."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=512, num_threads=1))
    try:
        return [r.token_ids for r in engine.generate([j.prompt for j in jobs], [j.sampling() for j in jobs])]
    finally:
        engine.close()


async def stream_job(client: openai.AsyncOpenAI, job: Job, progress: list[int], index: int,
                     stop_after: int | float | None = None) -> Outcome:
    """Stream one completion; progress[index] counts the tokens received so far. With
    `stop_after`, disconnect: an int closes the stream after that many tokens, a float
    gives up after that many seconds (before the first token, if it is short)."""
    out = Outcome()
    if isinstance(stop_after, float):
        try:
            async with asyncio.timeout(stop_after):
                return await stream_job(client, job, progress, index)
        except TimeoutError:
            out.error = "disconnected"
            return out
    try:
        stream = await client.completions.create(model=MODEL_NAME, stream=True,
                                                 stream_options={"include_usage": True}, **job.body())
        async with stream:
            async for chunk in stream:
                if chunk.usage is not None:
                    out.prompt_tokens, out.completion_tokens = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
                for choice in chunk.choices:
                    out.token_ids += getattr(choice, "token_ids", None) or []
                    out.text += choice.text
                    out.finish_reason = choice.finish_reason or out.finish_reason
                progress[index] = len(out.token_ids)
                if stop_after is not None and len(out.token_ids) >= stop_after:
                    out.error = "disconnected"
                    return out
    except openai.APIError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out


async def whole_job(client: openai.AsyncOpenAI, job: Job) -> Outcome:
    out = Outcome()
    try:
        reply = await client.completions.create(model=MODEL_NAME, **job.body())
        choice = reply.choices[0]
        out.token_ids, out.text, out.finish_reason = list(choice.token_ids), choice.text, choice.finish_reason
        out.prompt_tokens, out.completion_tokens = reply.usage.prompt_tokens, reply.usage.completion_tokens
    except openai.APIError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out


async def grpc_job(address: str, job: Job) -> Outcome:
    out = Outcome()
    request = inference_pb2.GenerateRequest(token_ids=inference_pb2.TokenIds(ids=job.prompt),
                                            max_tokens=job.max_tokens, ignore_eos=True, include_usage=True,
                                            temperature=0.0 if job.seed is None else 0.8)
    if job.seed is not None:
        request.seed = job.seed
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            async for r in inference_pb2_grpc.InferenceStub(channel).Generate(request):
                out.token_ids += list(r.token_ids)
                out.text += r.text
                if r.finish_reason:
                    out.finish_reason = "length" if r.finish_reason == common_pb2.FINISH_REASON_LENGTH else "other"
                if r.HasField("usage"):
                    out.prompt_tokens, out.completion_tokens = r.usage.prompt_tokens, r.usage.completion_tokens
    except grpc.aio.AioRpcError as exc:
        out.error = f"{exc.code().name}: {exc.details()}"
    return out


async def run_load(base_url: str, jobs: list[Job], trigger=None, stop_after: list | None = None,
                   timeout: float = 120.0, grpc_address: str = "") -> list[Outcome]:
    """All jobs at once; `trigger(progress)` (async) runs alongside, e.g. to kill a worker.
    progress[i] counts the tokens streamed so far (it stays 0 for whole and gRPC jobs)."""
    progress = [0] * len(jobs)

    def start(client, i: int, j: Job):
        if j.api == "whole":
            return whole_job(client, j)
        if j.api == "grpc":
            return grpc_job(grpc_address, j)
        return stream_job(client, j, progress, i, (stop_after or [None] * len(jobs))[i])

    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=timeout) as client:
        tasks = [asyncio.create_task(start(client, i, j)) for i, j in enumerate(jobs)]
        side = asyncio.create_task(trigger(progress)) if trigger is not None else None
        async with asyncio.timeout(timeout):
            outcomes = await asyncio.gather(*tasks)
            if side is not None:
                await side
    return outcomes


def run_killing(front, jobs: list[Job], victim, num_streams: int = 0) -> tuple[list[Outcome], int]:
    """Run `jobs` at once through `front` and SIGKILL the worker `victim` once each of the first
    `num_streams` (default: all) streams has 3 tokens; the outcomes, and how many requests the
    victim was running when it was killed."""
    running = {}

    async def kill(progress):
        await wait_progress(progress, 3, num_streams=num_streams)
        running["n"] = victim.stats().num_running
        victim.proc.process.send_signal(signal.SIGKILL)

    outcomes = asyncio.run(run_load(front.openai_url, jobs, kill, grpc_address=f"127.0.0.1:{front.grpc_port}"))
    assert victim.proc.process.wait(10) == -signal.SIGKILL
    return outcomes, running["n"]


async def wait_progress(progress: list[int], at_least: int, timeout: float = 60.0, num_streams: int = 0) -> None:
    """Until each of the first `num_streams` (default: all) streams has received `at_least` tokens."""
    n = num_streams or len(progress)
    await async_wait_until(lambda: min(progress[:n]) >= at_least, timeout=timeout, interval=0.01,
                           what=f"{at_least} tokens on each of {n} streams", details=lambda: f"progress: {progress}")


@pytest.fixture(scope="module")
def engine(llama_dir):
    """An in-process engine on the random Llama: the reference an unbroken request gives."""
    from splitserve.services.engine.config import EngineConfig
    from splitserve.services.engine.engine import LLMEngine

    e = LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=64, num_threads=1))
    yield e
    e.close()


@pytest.fixture
def cluster(llama_dir):
    c = Cluster(llama_dir)
    try:
        yield c
    finally:
        c.close()


