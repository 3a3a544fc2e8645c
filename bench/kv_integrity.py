"""What verifying a prompt's KV costs: transfer throughput with the end-to-end digest against without.

Two processes on loopback (the sender pinned to core 0, the receiver to core 1), each with its
own connector and `RankTransfer`, as a prefill and a decode worker hold them. One transfer is one
prompt's KV: `--tokens` tokens (default 2,048) of SmolLM2-135M's shape in float32 (30 layers, 3 KV
heads of 64, blocks of 16: 92 MiB), posted layer by layer as a prefill would, then the completion
notification; it ends when the receiver's `watch` hands the payload on (after its digest check,
where there is one). Throughput = bytes ÷ (first post → payload handed on).

By default every layer is posted at once: no compute between layers, the worst case for the
digest, whose hashing then competes with the copies on the sender's core instead of hiding behind
the next layer's compute. `--layer-ms M` posts one layer every M ms, as a prefill computing layers
does; the cost that remains is the exposed time (last layer posted → payload handed on), reported
per mode (on this CPU one layer of a 2,048-token prefill computes in ~400 ms, bench/README).

Modes, interleaved in each repetition so the machine's drift hits them alike:
- `off`: no digest (the sender treats the receiver as unverifiable, as it does a GPU or TP>1 pool);
- `xxh3`: the digest as shipped (transfer_digest.py: an xxh3-64 stream per layer and K/V half over
  runs of blocks, envelope KVd3);
- `xxh3-blocks`: the first xxh3 digest (a sum of xxh3-64 per (layer, block), envelope KVd2);
- `crc32`: the digest before issue 41 (the same sum with zlib CRC-32, envelope KVd1).
Receivers check all three envelopes (earlier senders during a rolling update).

`ratio` = throughput with the shipped digest ÷ without, the median over the repetitions of a
round; target ≥ 0.95 (issue 41) in every one of `--rounds` rounds (min / median / max reported).
Run it with nothing else on the machine.

    python bench/kv_integrity.py --rounds 3 --out bench/results/kv_integrity.json
    python bench/kv_integrity.py --quick            # a smoke run

JSON (`--out`): the commit, CPU and load (/proc/loadavg at start and end), each round's
throughputs per mode (median and best, GB/s) and ratios, and the target.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from splitserve.hardware import write_report
from splitserve.kvtransfer import KVLayout, make_connector
from splitserve.kvtransfer import transfer_digest
from splitserve.kvtransfer.rank_transfer import RankTransfer
from splitserve.kvtransfer.sender_receiver import LayerReady, TransferEndpoint, TransferGrant, TransferTarget

TARGET = 0.95
MODES = ("off", "xxh3", "xxh3-blocks", "crc32")
LAYOUT = dict(model="smollm2-135m", dtype="float32", num_layers=30, num_kv_heads=3, head_dim=64, block_size=16)


def _transfer(backend: str, name: str, num_blocks: int, seed: int, core: int) -> RankTransfer:
    if core < os.cpu_count():
        os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    layout = KVLayout(**LAYOUT)
    connector = make_connector(backend, name, layout)
    pool = torch.randn(layout.pool_shape(num_blocks), generator=torch.Generator().manual_seed(seed))
    connector.register(pool.to(layout.torch_dtype))
    return RankTransfer(connector, layout.block_size)


def _receiver(conn, backend: str, num_blocks: int) -> None:
    """The decode side: grant blocks, then report when the payload was handed on (and any error)."""
    transfer = _transfer(backend, "decode", num_blocks, seed=1, core=1)
    conn.send(transfer.metadata)
    while (message := conn.recv()) is not None:
        request_id, block_ids = message
        grant = transfer.expect(request_id, block_ids, ttl_s=60)
        done = threading.Event()
        outcome: list = []
        transfer.watch(request_id, lambda payload, error: (outcome.append((time.monotonic(), error)), done.set()))
        conn.send((grant.incarnation, grant.deadline_unix))
        done.wait(60)
        transfer.release(request_id)
        at, error = outcome[0] if outcome else (0.0, "no notification")
        conn.send((at, None if error is None else str(error)))
    transfer.close()


def _mode(sender: RankTransfer, mode: str) -> None:
    """Point the sender at one mode's digest (module docstring)."""
    sender._verifiable = (lambda target: False) if mode == "off" else functools.partial(
        RankTransfer._verifiable, sender)
    earlier = {"xxh3-blocks": transfer_digest.XXH3, "crc32": transfer_digest.CRC32}.get(mode)
    sender.new_digest = transfer_digest.StreamDigest if earlier is None else functools.partial(
        transfer_digest.BlockSumDigest, algorithm=earlier)


def one_transfer(sender: RankTransfer, conn, receiver_meta, request_id: str, blocks: list[int],
                 num_tokens: int, layer_s: float = 0.0) -> tuple[float, float]:
    """Seconds from the first post, and from the last, to the receiver handing the payload on."""
    conn.send((request_id, blocks))
    incarnation, deadline = conn.recv()
    target = TransferTarget(TransferEndpoint(receiver_meta.name, receiver_meta.to_bytes(),
                                             receiver_meta.layout_hash.encode(), incarnation),
                            blocks, 0, TransferGrant(incarnation, deadline))
    sent = threading.Event()
    began = time.monotonic()
    sender.begin(request_id, target, num_tokens, notify=True)
    for layer in range(LAYOUT["num_layers"]):
        if layer and layer_s:
            time.sleep(layer_s)                                   # the next layer computing
        sender.on_layer_ready(LayerReady(request_id, layer, 0, blocks, num_tokens))
    last = time.monotonic()
    sender.close_send(request_id, b"first-token", lambda payload, error: sent.set())
    at, error = conn.recv()
    if error is not None:
        raise RuntimeError(f"{request_id}: {error}")
    sent.wait(10)
    return at - began, at - last


def run_round(backend: str, num_tokens: int, repeats: int, layer_s: float = 0.0) -> dict:
    layout = KVLayout(**LAYOUT)
    num_blocks = -(-num_tokens // layout.block_size)
    nbytes = num_blocks * layout.num_layers * 2 * layout.block_size * layout.num_kv_heads * layout.head_dim * 4
    parent, child = mp.Pipe()
    receiver = mp.get_context("spawn").Process(target=_receiver, args=(child, backend, num_blocks), daemon=True)
    receiver.start()
    sender = _transfer(backend, "prefill", num_blocks, seed=2, core=0)
    try:
        meta = parent.recv()
        blocks = list(range(num_blocks))
        seconds: dict[str, list[float]] = {m: [] for m in MODES}
        exposed: dict[str, list[float]] = {m: [] for m in MODES}
        for i in range(repeats + 1):                              # the first repetition warms up
            order = MODES if i % 2 else tuple(reversed(MODES))
            for mode in order:
                _mode(sender, mode)
                took, tail = one_transfer(sender, parent, meta, f"{mode}-{i}", blocks, num_tokens, layer_s)
                if i:
                    seconds[mode].append(took)
                    exposed[mode].append(tail)
        parent.send(None)
        receiver.join(30)
    finally:
        sender.close()
        if receiver.is_alive():
            receiver.kill()
    gbps = {m: [nbytes / s / 1e9 for s in v] for m, v in seconds.items()}
    ratios = [a / b for a, b in zip(gbps["xxh3"], gbps["off"])]
    blocks_ratios = [a / b for a, b in zip(gbps["xxh3-blocks"], gbps["off"])]
    crc_ratios = [a / b for a, b in zip(gbps["crc32"], gbps["off"])]
    return {"bytes": nbytes, "gbps_median": {m: statistics.median(v) for m, v in gbps.items()},
            "gbps_best": {m: max(v) for m, v in gbps.items()}, "ratio": statistics.median(ratios),
            "ratio_xxh3_blocks": statistics.median(blocks_ratios), "ratio_crc32": statistics.median(crc_ratios),
            "exposed_ms_median": {m: statistics.median(v) * 1e3 for m, v in exposed.items()},
            "repeats": repeats, "layer_ms": layer_s * 1e3}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", nargs="+", default=["tcp", "nixl"])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--layer-ms", type=float, default=0.0,
                   help="post one layer every this many ms, as a computing prefill does (default 0: all at once)")
    p.add_argument("--quick", action="store_true", help="one round, 2 repetitions, tcp only")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.quick:
        args.rounds, args.repeats, args.backends = 1, 2, ["tcp"]
    load_start = Path("/proc/loadavg").read_text().split()[:3]
    results: dict[str, list[dict]] = {b: [] for b in args.backends}
    for r in range(args.rounds):
        for backend in args.backends:
            results[backend].append(run_round(backend, args.tokens, args.repeats, args.layer_ms / 1e3))
    console = Console()
    paced = f", one layer every {args.layer_ms:g} ms" if args.layer_ms else ", all layers at once"
    table = Table(title=f"KV transfer with and without its digest ({args.tokens} tokens, "
                        f"{results[args.backends[0]][0]['bytes'] / 2**20:.0f} MiB{paced})")
    for column in ("backend", "round", "GB/s off", "GB/s xxh3", "GB/s xxh3-blocks", "GB/s crc32",
                   f"xxh3 / off (≥ {TARGET})", "xxh3-blocks / off", "crc32 / off", "exposed ms off / xxh3"):
        table.add_column(column)
    met = True
    summary = {}
    for backend, rounds in results.items():
        for i, row in enumerate(rounds, 1):
            g = row["gbps_median"]
            table.add_row(backend, str(i), f"{g['off']:.2f}", f"{g['xxh3']:.2f}", f"{g['xxh3-blocks']:.2f}",
                          f"{g['crc32']:.2f}", f"{row['ratio']:.3f}", f"{row['ratio_xxh3_blocks']:.3f}",
                          f"{row['ratio_crc32']:.3f}",
                          f"{row['exposed_ms_median']['off']:.2f} / {row['exposed_ms_median']['xxh3']:.2f}")
        ratios = [row["ratio"] for row in rounds]
        summary[backend] = {"min": min(ratios), "median": statistics.median(ratios), "max": max(ratios),
                            "met": all(x >= TARGET for x in ratios)}
        met = met and summary[backend]["met"]
    console.print(table)
    for backend, s in summary.items():
        console.print(f"{backend}: xxh3 / off min/median/max {s['min']:.3f}/{s['median']:.3f}/{s['max']:.3f}: "
                      f"≥ {TARGET} {'met' if s['met'] else 'NOT met'} in every round")
    if args.out:
        write_report(args.out, {"benchmark": "kv_integrity", "load_average_start": load_start,
                                "load_average_end": Path("/proc/loadavg").read_text().split()[:3],
                                "args": vars(args), "layout": LAYOUT, "rounds": results,
                                "verified_vs_unverified_throughput": summary, "target": TARGET, "met": met})
    return 0


if __name__ == "__main__":
    sys.exit(main())
