"""`splitserve admin`: an operator's actions against a running deployment's frontend over HTTP.

`admin requests` lists what runs (GET /admin/requests); `admin migrate --request ID [--to WORKER]`
moves a running request to another decode worker with its KV (POST /admin/migrate;
services/frontend/live_moves.py) and prints where it went, how, and how long the stream waited.
"""

from __future__ import annotations

import argparse
import json
import os
import urllib.error
import urllib.request

from splitserve.errors import SplitserveError

DEFAULT_URL = "http://127.0.0.1:8000"
API_KEY_ENV = "SPLITSERVE_API_KEY"


def add_admin_parser(sub) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=DEFAULT_URL,
                        help="the frontend's base URL, without /v1 (default: %(default)s)")
    common.add_argument("--api-key", default=None,
                        help=f"a key the frontend accepts, when it has --api-key (default: ${API_KEY_ENV})")
    common.add_argument("--timeout", type=float, default=60.0, metavar="S",
                        help="seconds to wait for the answer (default: %(default)s)")
    common.add_argument("--json", action="store_true", help="print the frontend's JSON answer instead")
    p = sub.add_parser("admin", help="operator actions on a running deployment (list and move requests)",
                       description="Operator actions against a deployment's frontend over HTTP.")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    actions.add_parser("requests", parents=[common],
                       help="list the requests running on this frontend, with their worker",
                       description="List the requests running on the frontend, with their decode worker."
                       ).set_defaults(func=cmd_admin_requests)
    m = actions.add_parser(
        "migrate", parents=[common], help="move a running request to another decode worker, with its KV cache",
        description="Move a running request to another decode worker after its next token. Its KV "
                    "moves with it (the new worker computes only the last token), or, where it cannot "
                    "(an aggregated worker, the vLLM engine), the new worker recomputes the context "
                    "(token replay). The client's stream goes on uninterrupted; greedy and seeded "
                    "outputs are the ones it would have produced unmoved.")
    m.add_argument("--request", required=True, metavar="ID",
                   help="the request's id (the response's `id`, as `admin requests` lists it)")
    m.add_argument("--to", metavar="WORKER", help="the decode worker's id (default: the router's pick, "
                                                  "never the one it runs on)")
    m.add_argument("--method", choices=("kv", "replay"), default="kv",
                   help="kv: move the KV cache; replay: recompute it on the new worker (default: %(default)s)")
    m.set_defaults(func=cmd_admin_migrate)


def cmd_admin_requests(args: argparse.Namespace) -> int:
    rows = _call(args, "GET", "/admin/requests")["data"]
    if args.json:
        print(json.dumps(rows))
        return 0
    if not rows:
        print("no request is running")
    for row in rows:
        print(f"{row['request_id']}  on {row['worker'] or '-'}  prompt {row['num_prompt_tokens']}  "
              f"output {row['num_output_tokens']}{'  (moving)' if row['moving'] else ''}")
    return 0


def cmd_admin_migrate(args: argparse.Namespace) -> int:
    body = {"request_id": args.request, "method": args.method, "timeout_s": args.timeout}
    if args.to:
        body["to"] = args.to
    moved = _call(args, "POST", "/admin/migrate", body)
    if args.json:
        print(json.dumps(moved))
        return 0
    how = "its KV moved" if moved["method"] == "kv" else f"token replay ({moved.get('replay_reason', '')})"
    print(f"moved {moved['request_id']} from {moved['from']} to {moved['to']} after {moved['num_tokens']} tokens: "
          f"{how}; next token {moved['seconds_to_next_token'] * 1000:.0f} ms after the decision")
    return 0


def _call(args: argparse.Namespace, method: str, path: str, body: dict | None = None) -> dict:
    request = urllib.request.Request(args.url.rstrip("/") + path, method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    key = args.api_key or os.environ.get(API_KEY_ENV)
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=args.timeout + 5) as reply:
            return json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = exc.reason
        raise SplitserveError(f"{method} {path}: {exc.code}: {message}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise SplitserveError(f"cannot reach the frontend at {args.url}: {getattr(exc, 'reason', exc)}") from None
