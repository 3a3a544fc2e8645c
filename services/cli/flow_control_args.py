"""The `--flow-control` flags of `splitserve frontend` and `serve`, and the settings they build.

`serve` checks them here before it starts anything and forwards them to each frontend
(launch/children.py, which with no `--max-concurrency` gives every frontend its share of the
workers' running batch: `--max-num-seqs` divided among `--frontends`). Every other flag of the
group needs `--flow-control`.
"""

from __future__ import annotations

import argparse

from splitserve.errors import SplitserveError
from splitserve.services.flow_control import BandConfig

from splitserve.services.frontend import flow_admission as fa

BAND_KEYS = ("max-queue", "max-wait", "min-share")
_GROUP_FLAGS = ("max_concurrency", "priority_band", "max_queue", "max_queue_wait", "fair_share", "fair_share_burst")
_FLAG_NAMES = {"fair_share": "--no-fair-share"}


def add_flow_control_args(p: argparse.ArgumentParser, serve: bool) -> None:
    g = p.add_argument_group(
        "flow control (issue 40; off by default)",
        "Admission before routing, when requests outnumber the room on the workers: each request waits "
        "in the band of its `priority` (vLLM's field: lower goes first), tenants get fair shares within a "
        "band (the header x-llm-d-inference-fairness-id, else the API key, else one shared flow), "
        "the earliest x-llm-d-slo-ttft-ms deadline goes first within a tenant; a full band, a passed "
        "deadline or a wait too long is answered 429 with x-llm-d-request-dropped-reason and "
        "Retry-After, before any worker sees the request.")
    g.add_argument("--flow-control", action="store_true",
                   help="turn flow control on; it also lets requests carry a non-zero `priority` (refused "
                        "without it, as vLLM refuses it without --scheduling-policy priority)")
    per_frontend = (" per frontend; default: --max-num-seqs divided among --frontends, the workers' running "
                    "batch: more would only queue inside the worker, in arrival order" if serve
                    else f" (default: {fa.DEFAULT_MAX_CONCURRENCY}, the workers' default --max-num-seqs: "
                         "more would only queue inside the worker, in arrival order)")
    g.add_argument("--max-concurrency", type=int, default=None, metavar="N",
                   help="requests dispatched at once per ready decode-capable worker (both or decode role); "
                        "one more waits in its band" + per_frontend)
    g.add_argument("--priority-band", action="append", default=None, metavar="P[,KEY=VALUE...]",
                   help="a band serving priority P and up to the next band's value (the lowest band also "
                        "takes every priority below it); repeatable; keys: max-queue=N (requests waiting "
                        "in it at once), max-wait=S (seconds a request may wait before its 429), "
                        "min-share=F (the fraction of the last 100 dispatches it is owed while it has "
                        "requests waiting, so that it never starves; the shares add up to at most 1). "
                        f"Default: bands {', '.join(str(b) for b in fa.DEFAULT_BAND_PRIORITIES)} (negative "
                        "priorities before the default 0, positive ones after it), none owed a share")
    g.add_argument("--max-queue", type=int, default=None, metavar="N",
                   help=f"a band's max-queue unless it gives one (default: {fa.DEFAULT_MAX_QUEUE}); when a "
                        "band is full the newest request of the tenant holding the most is shed, the "
                        "newcomer itself when that is its own tenant")
    g.add_argument("--max-queue-wait", type=float, default=None, metavar="S",
                   help=f"a band's max-wait unless it gives one (default: {fa.DEFAULT_MAX_WAIT_S:g}; "
                        "inf: no limit)")
    g.add_argument("--no-fair-share", dest="fair_share", action="store_const", const=False, default=None,
                   help="tenants of a band take plain turns, one request each, instead of fair shares: by "
                        "default the tenant holding the fewest requests goes first, the tenant with the most "
                        "requests waiting (a flood) holds at most its fair share of the room (the room divided by "
                        "the band's tenants with requests running or waiting) while a lighter tenant has requests "
                        "running or waiting, and a lighter tenant's request that finds the room full goes at once, "
                        "up to --fair-share-burst requests beyond it, so a steady tenant barely feels a flooding one")
    g.add_argument("--fair-share-burst", type=int, default=None, metavar="N",
                   help=f"requests in all that lighter tenants may have dispatched beyond the room while a flood "
                        f"holds units (default: {fa.DEFAULT_BURST}; never more than the room itself; 0: never). "
                        "The worker runs them in its batch when --max-concurrency is below --max-num-seqs, else "
                        "queues them first in line")


def parse_band(text: str, max_queue: int, max_wait_s: float) -> BandConfig:
    """`P[,max-queue=N][,max-wait=S][,min-share=F]` → BandConfig; SplitserveError naming the problem."""
    head, *items = [part.strip() for part in text.split(",")]
    values: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in BAND_KEYS or key in values:
            raise SplitserveError(f"--priority-band {text!r}: {item!r} is not one of "
                                  f"{', '.join(k + '=...' for k in BAND_KEYS)} (each at most once)")
        values[key] = value
    try:
        band = BandConfig(int(head), int(values.get("max-queue", max_queue)),
                          float(values.get("max-wait", max_wait_s)), float(values.get("min-share", 0.0)))
        band.validate("--priority-band")
    except ValueError as exc:
        raise SplitserveError(f"--priority-band {text!r}: {exc}") from None
    return band


def flow_control_settings(args: argparse.Namespace) -> fa.FlowControlSettings | None:
    """The settings `--flow-control` and its group ask for; None when it is off."""
    if not args.flow_control:
        given = [_FLAG_NAMES.get(name, f"--{name.replace('_', '-')}") for name in _GROUP_FLAGS
                 if getattr(args, name) is not None]
        if given:
            raise SplitserveError(f"{', '.join(given)} need --flow-control")
        return None
    max_queue = fa.DEFAULT_MAX_QUEUE if args.max_queue is None else args.max_queue
    max_wait_s = fa.DEFAULT_MAX_WAIT_S if args.max_queue_wait is None else args.max_queue_wait
    specs = args.priority_band or [str(p) for p in fa.DEFAULT_BAND_PRIORITIES]
    bands = tuple(parse_band(spec, max_queue, max_wait_s) for spec in specs)
    burst = fa.DEFAULT_BURST if args.fair_share_burst is None else args.fair_share_burst
    if burst < 0:
        raise SplitserveError(f"--fair-share-burst must be >= 0, not {burst}")
    try:
        return fa.FlowControlSettings(bands, fa.DEFAULT_MAX_CONCURRENCY if args.max_concurrency is None
                                      else args.max_concurrency, fair_share=args.fair_share is not False,
                                      burst=burst)
    except ValueError as exc:
        raise SplitserveError(str(exc)) from None

