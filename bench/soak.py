"""Soak run: mixed load with periodic faults, watching KV usage, memory and errors over time.

    python bench/soak.py --duration 600                       # the 10-minute soak (random test model)
    python bench/soak.py --duration 180 --fault-interval 20   # a shorter one
    python bench/soak.py --model /path/to/hf-folder --concurrency 4

It starts its own deployment on loopback (1 prefill and 2 decode workers over the TCP
KV transfer, one frontend with the kv router), then for `--duration` seconds:

- load: `--concurrency` clients send a mix of requests back to back — short prompts
  (prefilled on the decode worker) and long ones (prefilled remotely), streamed and
  whole, greedy and seeded sampling, and about one in ten abandoned by its client at a
  random point;
- faults, one every `--fault-interval` seconds, in turn: SIGKILL a decode worker,
  SIGKILL a prefill worker, SIGTERM a decode worker (graceful drain), each restarted on
  the same port a few seconds later;
- every `--sample-interval` seconds: each worker's used KV blocks, running requests and
  RSS, the frontend's RSS, and the request counts so far (ok, abandoned on purpose,
  errors by kind, migrations), printed as a table row.

At the end the load stops, every worker must be idle again (the leak check), and the
samples go to `--out`.json and a plot `--out`.png (KV blocks, RSS and cumulative
errors over time, faults marked). Like the other benchmarks it measures and exits 0;
read the verdict line. Not part of `make test`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from splitserve.testing.cluster import Cluster, Frontend
from splitserve.testing.workers import idle_problems, wait_idle

MODEL_NAME = "soak"


@dataclass
class Counts:
    ok: int = 0
    abandoned: int = 0                       # the client went away on purpose
    errors: dict[str, int] = field(default_factory=dict)

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    @property
    def num_errors(self) -> int:
        return sum(self.errors.values())


@dataclass
class Sample:
    t: float
    kv_used: dict[str, int]
    running: dict[str, int]
    rss_mib: dict[str, float]
    ok: int
    abandoned: int
    errors: int
    migrations: float


def rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


# -- load ------------------------------------------------------------------------------
async def one_request(client: httpx.AsyncClient, rng: random.Random, counts: Counts) -> None:
    long_prompt = rng.random() < 0.3
    prompt = [rng.randrange(3, 31000) for _ in range(rng.randint(200, 500) if long_prompt else rng.randint(10, 60))]
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": rng.randint(8, 64), "ignore_eos": True,
            "temperature": 0}
    if rng.random() < 0.3:
        body.update(temperature=0.8, seed=rng.randrange(1 << 30))
    stream = rng.random() < 0.7
    abandon_after = rng.randint(1, 10) if stream and rng.random() < 0.1 else None
    body["stream"] = stream
    try:
        if not stream:
            r = await client.post("/v1/completions", json=body)
            if r.status_code == 200:
                counts.ok += 1
            else:
                counts.error(f"http_{r.status_code}")
            return
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                counts.error(f"http_{r.status_code}")
                return
            n, finished = 0, False
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    counts.error("in_band_" + str(event["error"].get("type")))
                    return
                n += 1
                finished = finished or any(c.get("finish_reason") for c in event.get("choices", []))
                if abandon_after is not None and n >= abandon_after:
                    counts.abandoned += 1
                    return
            if finished:
                counts.ok += 1
            else:
                counts.error("stream_ended_early")
    except httpx.HTTPError as exc:
        counts.error(type(exc).__name__)


async def client_loop(base_url: str, seed: int, deadline: float, counts: Counts) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        while time.monotonic() < deadline:
            await one_request(client, rng, counts)


# -- faults ----------------------------------------------------------------------------
class Faults:
    KINDS = ("sigkill_decode", "sigkill_prefill", "sigterm_decode")

    def __init__(self, cluster: Cluster, worker_args: dict[str, list[str]], ports: dict[str, int]):
        self.cluster = cluster
        self.worker_args = worker_args
        self.ports = ports
        self.events: list[tuple[float, str]] = []
        self.rng = random.Random(0)

    async def run(self, start: float, deadline: float, interval: float) -> None:
        i = 0
        while time.monotonic() + interval < deadline:
            await asyncio.sleep(interval)
            kind = self.KINDS[i % len(self.KINDS)]
            i += 1
            await self.inject(kind, start)

    async def inject(self, kind: str, start: float) -> None:
        role = "prefill" if kind == "sigkill_prefill" else "decode"
        victims = [w for w in self.cluster.live_workers() if w.role == role]
        if not victims:
            return
        victim = self.rng.choice(victims)
        sig = signal.SIGTERM if kind == "sigterm_decode" else signal.SIGKILL
        self.events.append((time.monotonic() - start, f"{kind} {victim.name}"))
        print(f"  !! {time.monotonic() - start:6.1f} s  {kind} {victim.name}", flush=True)
        victim.proc.process.send_signal(sig)
        code = await asyncio.to_thread(victim.proc.process.wait, 60)
        if sig == signal.SIGTERM and code != 0:
            self.events.append((time.monotonic() - start, f"{victim.name} exited {code} after SIGTERM"))
        await asyncio.sleep(2.0)
        self.cluster.start_worker(victim.name, victim.role, *self.worker_args[victim.name],
                                  port=self.ports[victim.name])
        await asyncio.to_thread(self.cluster.wait_workers)


# -- sampling --------------------------------------------------------------------------
def take_sample(t: float, cluster: Cluster, front: Frontend, counts: Counts) -> Sample:
    kv, running, rss = {}, {}, {}
    for w in cluster.workers.values():
        rss[w.name] = rss_mib(w.proc.pid)
        try:
            s = w.stats()
            kv[w.name], running[w.name] = s.num_used_kv_blocks, s.num_running
        except Exception:       # noqa: BLE001 - a worker being killed or restarted
            kv[w.name], running[w.name] = -1, -1
    rss["frontend"] = rss_mib(front.proc.pid)
    try:
        migrations = sum(front.metric("splitserve_migrations_total", outcome=o) for o in ("migrated", "retried"))
    except OSError:
        migrations = float("nan")
    return Sample(round(t, 1), kv, running, rss, counts.ok, counts.abandoned, counts.num_errors, migrations)


def print_row(s: Sample, header: bool) -> None:
    names = sorted(s.kv_used)
    if header:
        print(f"{'t (s)':>7} " + " ".join(f"{'kv ' + n:>8}" for n in names)
              + " " + " ".join(f"{'rss ' + n:>9}" for n in [*names, "frontend"])
              + f" {'ok':>6} {'aband.':>6} {'errors':>6} {'migr.':>6}", flush=True)
    print(f"{s.t:7.1f} " + " ".join(f"{s.kv_used[n]:8d}" for n in names)
          + " " + " ".join(f"{s.rss_mib[n]:9.0f}" for n in [*names, "frontend"])
          + f" {s.ok:6d} {s.abandoned:6d} {s.errors:6d} {s.migrations:6.0f}", flush=True)


async def sampler(start: float, deadline: float, interval: float, cluster: Cluster, front: Frontend,
                  counts: Counts, samples: list[Sample]) -> None:
    while time.monotonic() < deadline:
        s = await asyncio.to_thread(take_sample, time.monotonic() - start, cluster, front, counts)
        print_row(s, header=not samples)
        samples.append(s)
        await asyncio.sleep(interval)


# -- report ----------------------------------------------------------------------------
def plot(samples: list[Sample], events: list[tuple[float, str]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s.t for s in samples]
    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    for name in sorted(samples[0].kv_used):
        axes[0].plot(t, [max(s.kv_used.get(name, -1), 0) for s in samples], label=name)
    axes[0].set_ylabel("KV blocks in use")
    for name in sorted(samples[0].rss_mib):
        axes[1].plot(t, [s.rss_mib.get(name, 0) for s in samples], label=name)
    axes[1].set_ylabel("RSS (MiB)")
    axes[2].plot(t, [s.ok for s in samples], label="completed")
    axes[2].plot(t, [s.errors for s in samples], label="errors")
    axes[2].plot(t, [s.migrations for s in samples], label="migrations")
    axes[2].set_ylabel("requests (cumulative)")
    axes[2].set_xlabel("time (s)")
    for ax in axes:
        for when, _ in events:
            ax.axvline(when, color="red", alpha=0.3, linestyle="--")
        ax.legend(loc="upper left", fontsize="small")
    axes[0].set_title("splitserve soak: dashed red lines are injected faults")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def build_model(arg: str, tmp: Path) -> str:
    if arg != "random-llama":
        return arg
    from splitserve.testing.models import build_random_model

    return str(build_random_model("llama", tmp / "random-llama", seed=0))


async def soak(args: argparse.Namespace, cluster: Cluster) -> int:
    from splitserve.net import free_port

    ports = {name: free_port() for name in ("p0", "d0", "d1")}
    decode = ["--remote-prefill-threshold", "64", "--prefill-timeout", "10", "--drain-timeout", "5"]
    worker_args = {"p0": [], "d0": decode, "d1": decode}
    for name, role in (("p0", "prefill"), ("d0", "decode"), ("d1", "decode")):
        cluster.start_worker(name, role, *worker_args[name], port=ports[name])
    cluster.wait_workers()
    front = cluster.start_frontend("--served-model-name", MODEL_NAME)
    front.wait_ready()
    print(f"deployment ready: {front.openai_url}; soaking for {args.duration:.0f} s", flush=True)
    counts, samples, faults = Counts(), [], Faults(cluster, worker_args, ports)
    start = time.monotonic()
    deadline = start + args.duration
    tasks = [asyncio.create_task(client_loop(front.base_url, i, deadline, counts)) for i in range(args.concurrency)]
    side = [asyncio.create_task(faults.run(start, deadline, args.fault_interval)),
            asyncio.create_task(sampler(start, deadline, args.sample_interval, cluster, front, counts, samples))]
    await asyncio.gather(*tasks, *side)
    final = await asyncio.to_thread(take_sample, time.monotonic() - start, cluster, front, counts)
    print_row(final, header=False)
    samples.append(final)
    try:
        idle_s = (await asyncio.to_thread(wait_idle, cluster.live_workers(), 5.0)).took_s
        leaks = {}
    except AssertionError:
        idle_s = None
        leaks = {w.name: idle_problems(w.stats()) for w in cluster.live_workers()}
    report = {"duration_s": args.duration, "concurrency": args.concurrency, "fault_interval_s": args.fault_interval,
              "ok": counts.ok, "abandoned": counts.abandoned, "errors": counts.errors,
              "migrations": final.migrations, "faults": faults.events, "idle_after_s": idle_s, "leaks": leaks,
              "samples": [asdict(s) for s in samples]}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    plot(samples, faults.events, out.with_suffix(".png"))
    rss_growth = {n: round(samples[-1].rss_mib.get(n, 0) - samples[0].rss_mib.get(n, 0), 1) for n in samples[0].rss_mib}
    print(f"\nverdict: {counts.ok} completed, {counts.abandoned} abandoned on purpose, {counts.num_errors} errors "
          f"{counts.errors or ''}, {final.migrations:.0f} migrations, {len(faults.events)} faults; "
          f"workers idle after the load: {'yes' if idle_s is not None else 'NO ' + str(leaks)}; "
          f"RSS change (MiB): {rss_growth}", flush=True)
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (default: %(default)s)")
    p.add_argument("--model", default="random-llama",
                   help="random-llama (built into a temporary folder), a HF folder or smollm2")
    p.add_argument("--concurrency", type=int, default=6, help="concurrent clients (default: %(default)s)")
    p.add_argument("--fault-interval", type=float, default=30.0, help="seconds between faults (default: %(default)s)")
    p.add_argument("--sample-interval", type=float, default=5.0, help="seconds between samples (default: %(default)s)")
    p.add_argument("--out", default="bench/results/soak", help="JSON and PNG path without suffix")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(build_model(args.model, Path(tmp)))
        try:
            return asyncio.run(soak(args, cluster))
        finally:
            cluster.close()


if __name__ == "__main__":
    sys.exit(main())
