"""`splitserve serve --autoscale` with real processes (services/launch/autoscale_thread.py): under a load
that doubles, the SLO planner starts a second worker, the frontend routes to it and the SLO is
met again within a bounded time; in the quiet period that follows, once the cool-down has
passed, a worker drains and leaves while streams keep running, and no request fails.

The load is sized from the profile `serve` prints at start-up, with the planner's own model
(services/planner/sizing.py): phase 2 runs at 1.1 times the largest rate the model gives one
worker, phase 1 at half that. Just above one worker's modelled capacity, because the profile
is measured on an idle machine: two workers, the frontend and this client share 2 cores, so
each worker's real capacity under the doubled load is well below its profile. Arrivals are
evenly spaced (a Poisson process over 2-second intervals would be noise the planner rightly
reacts to). Every response is counted and checked for its full token count. Aggregated
mode, kept (`--autoscale-mode fixed`: this test is about the counts), at most 2 workers. The machine must be otherwise idle: another process taking a core
leaves two workers no more room than one.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest

from splitserve.services.launch.autoscale_thread import planner_config
from splitserve.services.launch.topology import AutoscaleSettings
from splitserve.services.planner import (CapacityProfile, DecodeMeasurement, PredictedLoad, PrefillMeasurement,
                                         SizingModel)
from splitserve.testing.processes import pid_alive

from .conftest import start_serve, stop_serve

pytestmark = pytest.mark.alone             # SLO and time bounds: no other test on the cores

TTFT_MS, ITL_MS = 3000.0, 1000.0
INTERVAL_S, COOLDOWN_S, MAX_WORKERS = 2.0, 6.0, 2
PROMPT, OUTPUT = 1024, 8                   # prefill-heavy: TTFT binds
PHASE1_S = 14.0
SCALE_UP_WITHIN_S = 12.0                   # step -> "starting worker-1": the next full interval or two
READY_WITHIN_S = 60.0                      # step -> worker-1 serving (process start and model load)
SETTLE_S = 10.0                            # after it is ready: the queue built meanwhile drains
MEASURE_S = 16.0                           # the window in which the SLO must hold again
QUIET_STREAMS, QUIET_PROMPT, QUIET_OUTPUT = 2, 32, 200
SHRINK_WITHIN_S = COOLDOWN_S + 40.0        # quiet start -> a worker leaves
DRAINED_WITHIN_S = 30.0                    # it leaves -> it has drained and exited


@dataclass
class Result:
    sent_at: float
    expected: int
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = -1
    error: str = ""


@dataclass
class Log:
    """serve's output lines with the time each was first seen."""

    proc: object
    seen: list[tuple[float, str]] = field(default_factory=list)

    def poll(self) -> None:
        lines = self.proc.lines
        now = time.monotonic()
        self.seen.extend((now, line) for line in lines[len(self.seen):])

    def first(self, pattern: str, after: float = 0.0) -> tuple[float, re.Match] | None:
        self.poll()
        for t, line in self.seen:
            if t >= after and (m := re.search(pattern, line)):
                return t, m
        return None


def _profile(output: str) -> CapacityProfile:
    """The profile serve printed (profile_run.ProfileResult.describe)."""
    line = re.search(r"profile: prefill (.*?); decode (.*?); KV (\d+) tokens; start-up ([\d.]+) s", output)
    assert line, output
    prefill = [PrefillMeasurement(int(n), int(n) / float(tps))
               for n, tps in re.findall(r"(\d+) tokens (\d+) tok/s", line.group(1))]
    decode = [DecodeMeasurement(int(b), float(ms) / 1e3) for b, ms in re.findall(r"batch (\d+) ([\d.]+) ms/step",
                                                                                 line.group(2))]
    return CapacityProfile.from_measurements(prefill, decode, float(line.group(4)), int(line.group(3)))


def _rates(profile: CapacityProfile) -> tuple[float, float]:
    """(phase 1, phase 2) request rates: the model needs 1 worker at the first, 2 at the second
    (module header)."""
    settings = AutoscaleSettings(MAX_WORKERS, TTFT_MS / 1e3, ITL_MS / 1e3, INTERVAL_S, COOLDOWN_S, switch_modes=False)
    model = SizingModel.of(profile, planner_config(settings, aggregated=True))

    def need(rate: float) -> int:
        load = PredictedLoad(0.0, rate, PROMPT, PROMPT, OUTPUT, 0.0, 0.0, 0.0)
        return model.aggregated(load, MAX_WORKERS + 1).count

    lo, hi = 0.01, 1000.0                          # the largest rate one worker is enough for
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if need(mid) <= 1 else (lo, mid)
    r2 = 1.1 * lo
    assert need(r2 / 2) == 1 and need(r2) >= 2, (lo, need(r2))
    return r2 / 2, r2


async def _complete(client: openai.AsyncOpenAI, model: str, prompt: list[int], max_tokens: int,
                    out: Result) -> None:
    try:
        last = None
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        async for chunk in stream:
            now = time.monotonic()
            if chunk.choices and chunk.choices[0].text is not None:
                if out.ttft is None:
                    out.ttft = now - out.sent_at
                elif last is not None:
                    out.gaps.append(now - last)
                last = now
            if chunk.usage is not None:
                out.tokens = chunk.usage.completion_tokens
        if out.tokens != max_tokens:
            out.error = f"{out.tokens} tokens of {max_tokens}"
    except Exception as exc:  # noqa: BLE001 - every failure is counted
        out.error = repr(exc)


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def _pid_of(server, worker_id: str) -> int | None:
    for pid in server.proc.children():
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except (FileNotFoundError, ProcessLookupError):
            continue
        if "--worker-id" in args and args[args.index("--worker-id") + 1] == worker_id:
            return pid
    return None


def test_autoscale_grows_for_a_doubled_load_meets_the_slo_again_and_shrinks_without_losing_a_request(llama_dir):
    server = start_serve(str(llama_dir), "--autoscale", "--max-workers", str(MAX_WORKERS),
                         "--slo-ttft-p90-ms", str(TTFT_MS), "--slo-itl-p90-ms", str(ITL_MS),
                         "--autoscale-interval", str(INTERVAL_S), "--autoscale-cooldown", str(COOLDOWN_S),
                         "--autoscale-mode", "fixed", "--router", "round-robin", "--kv-cache-gib", "0.1")
    log = Log(server.proc)
    started_pids: dict[str, int] = {}
    try:
        assert "etcd ready at 127.0.0.1:" in server.proc.output
        r1, r2 = _rates(_profile(server.proc.output))
        results, marks = asyncio.run(_drive(server, log, r1, r2, started_pids))
    finally:
        stop_serve(server)
    for name, pid in started_pids.items():
        assert not pid_alive(pid), f"{name} (pid {pid}) outlived serve"

    output = server.proc.output
    t_step, t_quiet = marks["step"], marks["quiet"]
    # Phase 1 needed one worker: nothing started before the step.
    up = log.first(r"autoscale: starting (worker-\d+) \(both\)")
    assert up is not None, output
    assert up[0] >= t_step, f"scaled up before the load doubled (r1 {r1:.2f}/s):\n{output}"
    assert up[0] - t_step <= SCALE_UP_WITHIN_S, output
    assert re.search(r"autoscale: planner: 1A -> 2A aggregated .*aggregated 1->2 \[", output), output
    ready = log.first(rf"autoscale: {up[1].group(1)} ready after [\d.]+ s at")
    assert ready is not None and ready[0] - t_step <= READY_WITHIN_S, output
    # The SLO is met again: requests sent from SETTLE_S after the new worker was ready to the end of phase 2.
    window = [r for r in results if ready[0] + SETTLE_S <= r.sent_at <= t_quiet and r.expected == OUTPUT]
    assert len(window) >= 10, (len(window), output)
    ttft_p90 = _p90([r.ttft for r in window])
    itl_p90 = _p90([g for r in window for g in r.gaps])
    print(f"rates {r1:.2f} -> {r2:.2f}/s; scale-up {up[0] - t_step:.1f} s and ready {ready[0] - t_step:.1f} s "
          f"after the step; then TTFT p90 {ttft_p90:.2f} s, ITL p90 {itl_p90:.3f} s over {len(window)} requests")
    assert ttft_p90 <= TTFT_MS / 1e3, (ttft_p90, r2, output)
    assert itl_p90 <= ITL_MS / 1e3, (itl_p90, output)
    # The quiet period: after the cool-down one worker drains and exits, while streams run.
    leaves = log.first(r"autoscale: (worker-\d+) \(both\) leaves, (\d+) requests on it; draining it", after=t_quiet)
    assert leaves is not None and leaves[0] - t_quiet <= SHRINK_WITHIN_S, output
    assert re.search(r"autoscale: planner: 2A -> 1A aggregated", output), output
    gone = log.first(rf"autoscale: {leaves[1].group(1)} drained and stopped after [\d.]+ s \(exit code 0\)")
    assert gone is not None and gone[0] - leaves[0] <= DRAINED_WITHIN_S, output
    print(f"{leaves[1].group(1)} left {leaves[0] - t_quiet:.1f} s into the quiet period with "
          f"{leaves[1].group(2)} requests on it, gone {gone[0] - leaves[0]:.1f} s later; {len(results)} requests")
    assert marks["end"] >= gone[0] + 2.0            # requests kept coming after it left
    # Every request, in every phase, answered in full.
    failed = [r for r in results if r.error]
    assert not failed, (len(failed), [r.error for r in failed[:5]], output)
    assert sum(r.expected == QUIET_OUTPUT for r in results) >= 4
    assert "Traceback" not in output, output


async def _drive(server, log: Log, r1: float, r2: float, started_pids: dict[str, int]):
    """Phase 1 at r1, phase 2 at r2 until the SLO window is over, then the quiet streams until a
    worker has drained and left; returns every request's Result and the phase times."""
    rng = random.Random(22)
    results: list[Result] = []
    tasks: list[asyncio.Task] = []
    marks: dict[str, float] = {}
    async with openai.AsyncOpenAI(base_url=server.openai_url, api_key="unused", max_retries=0,
                                  timeout=120) as client:
        model = (await client.models.list()).data[0].id

        def send(prompt_len: int, max_tokens: int) -> asyncio.Task:
            r = Result(time.monotonic(), max_tokens)
            results.append(r)
            prompt = [rng.randrange(3, 32000) for _ in range(prompt_len)]
            tasks.append(asyncio.create_task(_complete(client, model, prompt, max_tokens, r)))
            return tasks[-1]

        async def paced(rate: float, until) -> None:
            next_at = time.monotonic()
            while not until():
                send(PROMPT, OUTPUT)
                next_at += 1.0 / rate
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
                log.poll()
                for name in ("worker-1",):
                    if name not in started_pids and (pid := _pid_of(server, name)):
                        started_pids[name] = pid

        t0 = time.monotonic()
        await paced(r1, lambda: time.monotonic() - t0 >= PHASE1_S)
        marks["step"] = time.monotonic()

        def phase2_over() -> bool:
            ready = log.first(r"autoscale: worker-\d+ ready after")
            if ready is None:
                assert time.monotonic() - marks["step"] <= READY_WITHIN_S + 5, \
                    f"no worker ready {READY_WITHIN_S} s after the step:\n{server.proc.output}"
                return False
            return time.monotonic() >= ready[0] + SETTLE_S + MEASURE_S

        await paced(r2, phase2_over)
        marks["quiet"] = time.monotonic()

        def quiet_over() -> bool:
            gone = log.first(r"autoscale: worker-\d+ drained and stopped", after=marks["quiet"])
            if gone is None:
                return time.monotonic() - marks["quiet"] > SHRINK_WITHIN_S + DRAINED_WITHIN_S
            return time.monotonic() >= gone[0] + 3.0

        async def streamer() -> None:
            while not quiet_over():
                await send(QUIET_PROMPT, QUIET_OUTPUT)
                await asyncio.sleep(0.05)         # the quiet load: a short pause between two requests

        await asyncio.gather(*(streamer() for _ in range(QUIET_STREAMS)))
        marks["end"] = time.monotonic()
        await asyncio.gather(*tasks)
    log.poll()
    return results, marks


# -- a mode switch (--autoscale-mode auto, the default) ----------------------------------------
SWITCH_STREAMS, SWITCH_PROMPT, SWITCH_OUTPUT = 2, 48, 48
# A paced load: a closed loop's grows with the machine's speed, and on a quick moment it crossed one
# aggregated worker's utilisation bound (0.8), so the planner's window kept disaggregated serving.
SWITCH_PAUSE_S = 0.3
SWITCH_WITHIN_S = 90.0                     # light load -> the prefill worker gone


def test_autoscale_switches_a_light_disaggregated_deployment_to_one_aggregated_worker_without_losing_a_request(
        llama_dir):
    """1 prefill + 1 decode worker under a light load that one aggregated worker meets: after the
    cool-down the planner switches (aggregated needs 1 worker, disaggregated 2). The decode worker
    moves to the aggregated pool in place (the same process, which now prefills its prompts
    itself) and the prefill worker drains, while two streams keep running. No worker starts, and
    every request is answered in full, also those after the prefill worker is gone."""
    server = start_serve(str(llama_dir), "--prefill-workers", "1", "--decode-workers", "1", "--autoscale",
                         "--max-workers", "2", "--slo-ttft-p90-ms", str(TTFT_MS), "--slo-itl-p90-ms", str(ITL_MS),
                         "--autoscale-interval", str(INTERVAL_S), "--autoscale-cooldown", str(COOLDOWN_S),
                         "--kv-cache-gib", "0.1", num_workers=2, aggregated=False)
    log = Log(server.proc)
    try:
        assert "mode auto" in server.proc.output, server.proc.output
        decode_pid = _pid_of(server, "decode-0")
        assert decode_pid is not None, server.proc.output
        results = asyncio.run(_stream_until_switched(server, log))
        assert _pid_of(server, "decode-0") == decode_pid and pid_alive(decode_pid), server.proc.output
        assert _pid_of(server, "prefill-0") is None, server.proc.output
    finally:
        stop_serve(server)
    output = server.proc.output
    assert re.search(r"autoscale: planner: 1P\+1D -> 1A aggregated .*switch from disaggregated", output), output
    assert "autoscale: switching to aggregated serving: decode-0 now serves in the aggregated pool in place" in output
    order = [log.first(p) for p in (r"autoscale: switching to aggregated serving",
                                    r"autoscale: prefill-0 \(prefill\) leaves",
                                    r"autoscale: prefill-0 drained and stopped after [\d.]+ s \(exit code 0\)")]
    assert all(order), output
    assert [t for t, _ in order] == sorted(t for t, _ in order), output
    assert "autoscale: starting" not in output, output
    print(f"switched in {order[-1][0] - order[0][0]:.1f} s (switch -> prefill-0 gone); {len(results)} requests")
    failed = [r for r in results if r.error]
    assert not failed, (len(failed), [r.error for r in failed[:5]], output)
    assert len(results) >= 10
    assert "Traceback" not in output, output


async def _stream_until_switched(server, log: Log) -> list[Result]:
    """SWITCH_STREAMS clients, each one request after another, until prefill-0 has drained and
    exited and 3 more requests each ran on what is left (or SWITCH_WITHIN_S passed)."""
    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = (await client.models.list()).data[0].id
    results: list[Result] = []
    deadline = time.monotonic() + SWITCH_WITHIN_S
    rng = random.Random(7)

    async def stream_loop() -> None:
        after = None
        while time.monotonic() < deadline:
            if after is None and log.first(r"autoscale: prefill-0 drained and stopped"):
                after = 0
            if after is not None:
                if after >= 3:
                    return
                after += 1
            out = Result(time.monotonic(), SWITCH_OUTPUT)
            results.append(out)
            await _complete(client, model, [rng.randrange(1000, 30000) for _ in range(SWITCH_PROMPT)],
                            SWITCH_OUTPUT, out)
            await asyncio.sleep(SWITCH_PAUSE_S)

    try:
        await asyncio.gather(*(stream_loop() for _ in range(SWITCH_STREAMS)))
    finally:
        await client.close()
    return results
