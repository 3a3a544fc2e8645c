"""The `splitserve` argument parsers: one builder per command, shared groups of flags.

Each command's `--help` is its documentation; defaults are shown in it. Parsing
only: `commands.py` turns the flags into configs.
"""

from __future__ import annotations

import argparse

from splitserve import __version__
from splitserve.router.policies.kv import DEFAULT_PREFILL_WEIGHT
from splitserve.services.cli import commands
from splitserve.services.cli.admin import add_admin_parser
from splitserve.services.cli import flow_control_args as _flow_control_args
from splitserve.services.cli import security as _security_args


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default="smollm2",
                   help="'smollm2' (the shipped SmolLM2-135M-Instruct), a Hugging Face model "
                        "folder, or a .gguf file (default: %(default)s)")
    g.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    g.add_argument("--dtype", default="auto",
                   help="auto (bf16 on CUDA, float32 on CPU), float32, bfloat16 or float16")
    g.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor-parallel degree: N processes, one per rank (default: 1)")
    g.add_argument("--block-size", type=int, default=None,
                   help="KV block size in tokens (default: 16 for the built-in engine, vLLM's own choice for "
                        "--engine vllm: 128 on CPU, whose attention wants multiples of 32)")
    g.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV pool size per rank in GiB")
    g.add_argument("--kv-host-gib", type=float, default=0.0,
                   help="host-memory KV tier below the pool: blocks the pool evicts are kept here and "
                        "loaded back on a prefix hit (pinned on CUDA; 0: off; default: %(default)s)")
    g.add_argument("--kv-disk-gib", type=float, default=0.0,
                   help="local-disk KV tier below the host tier (needs --kv-disk-path; 0: off)")
    g.add_argument("--kv-disk-path", default=None, metavar="DIR",
                   help="folder for the disk tier's block files (one file per block, checksummed)")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget per step (prefill chunk size)")
    g.add_argument("--max-num-seqs", type=int, default=64, help="maximum running sequences")
    g.add_argument("--max-logprobs", type=int, default=20, metavar="N",
                   help="vLLM's: the most logprobs (logprobs, top_logprobs, prompt_logprobs) a request may ask "
                        "for per token; -1: the whole vocabulary, which a request asks for with -1 "
                        "(default: %(default)s)")
    g.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads per rank (default: torch's, all cores; under `serve` on CPU: "
                        "the cores shared out among the ranks it starts)")
    g.add_argument("--cpu-cores", default=None, metavar="LIST",
                   help="pin the ranks' compute threads to these cores, e.g. 0-3 (shared out among the "
                        "ranks; threads default to one per core; default: not pinned; `serve` on CPU "
                        "sets it, see its --cpu-bind)")
    g.add_argument("--cpu-yield", choices=["auto", "off"], default="off",
                   help="ranks pinned to cores (--cpu-cores; `serve` pins them on CPU): auto measures "
                        "each second how much of the rank's cores other processes use (a benchmark "
                        "client, the frontend, anything else) and steps with one compute thread fewer "
                        "per core's worth of that use (given up from 0.35 of a core, taken back below "
                        "0.15; nothing given up while they use more than all its cores but one, "
                        "where every thread is a share of the CPU), so that a process on the same "
                        "machine does not stall every operator; off: one thread per core always "
                        "(default: %(default)s)")
    g.add_argument("--attention-backend", choices=["auto", "paged", "gather"], default="auto",
                   help="decode attention: 'paged' reads the KV pool in place (on CPU a kernel built "
                        "for this CPU on first use, needs g++; on CUDA a Triton kernel), 'gather' copies "
                        "each sequence's blocks out first (the old path); auto: paged where its kernel "
                        "builds, else gather (default: %(default)s)")


def _parse_tier_credit(text: str) -> dict[str, float]:
    from splitserve.router.index import LOWER_TIERS

    credit = {}
    for item in filter(None, text.split(",")):
        tier, _, share = item.partition("=")
        try:
            value = float(share)
        except ValueError:
            value = -1.0
        if tier not in LOWER_TIERS or not 0.0 <= value <= 1.0:
            raise argparse.ArgumentTypeError(f"{item!r}: want TIER=SHARE with TIER one of "
                                             f"{', '.join(LOWER_TIERS)} and SHARE in [0, 1]")
        credit[tier] = value
    return credit


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids takes comma-separated integers, got {text!r}")


def _add_operator_parser(sub) -> None:
    p = sub.add_parser("operator", help="run the Kubernetes operator (ServingDeployment, gang scheduler)",
                       description="Reconcile ServingDeployments into frontends and gang-scheduled worker "
                                   "groups, heal and drain them. Runs in a pod (in-cluster service account) "
                                   "or locally against a kubeconfig. In a pod the chart sets SPLITSERVE_* "
                                   "environment variables that stand in for the flags.")
    p.add_argument("--kubeconfig", default=None,
                   help="kubeconfig file (default: in-cluster service account, else $KUBECONFIG or ~/.kube/config)")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", default=None, metavar="NS",
                       help="watch this namespace (repeatable; default: $SPLITSERVE_WATCH_NAMESPACES, "
                            "comma-separated, empty meaning all)")
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace")
    p.add_argument("--etcd-endpoint", default=None, metavar="HOST:PORT[,HOST:PORT...]",
                   help="etcd that workers register in and frontends read, written into each deployment's "
                        "ConfigMap (default: $SPLITSERVE_ETCD, else splitserve-etcd:2379; a comma-separated "
                        "list of every member, schemes dropped, all of which the pods get)")
    p.add_argument("--etcd-tls-secret", default=None, metavar="SECRET",
                   help="a Secret (ca.crt, tls.crt, tls.key) that every worker and frontend pod mounts to reach "
                        "an etcd serving TLS with client certificates (default: $SPLITSERVE_ETCD_TLS_SECRET; "
                        "unset: plaintext etcd)")
    p.add_argument("--interval", type=float, default=2.0, metavar="S",
                   help="seconds between reconcile passes when no watch event arrives (default: %(default)s)")
    p.add_argument("--worker-address", choices=["auto", "annotation"], default="auto",
                   help="how the drain reaches a group's rank-0 worker: auto (the pod's "
                        "splitserve.io/worker-address annotation, else podIP:50051) or annotation only "
                        "(simulated nodes, whose pod IPs are fake; default: %(default)s)")
    p.add_argument("--node-grace", type=float, default=10.0, metavar="S",
                   help="replace the groups on a node once it has been NotReady this long "
                        "(default: %(default)s)")
    p.add_argument("--leader-election-namespace", default=None, metavar="NS",
                   help="elect one active replica through the Lease splitserve-operator in NS "
                        "(default: $SPLITSERVE_LEADER_ELECTION_NAMESPACE; unset: no election)")
    p.add_argument("--health-port", type=int, default=None, metavar="PORT",
                   help="serve kopf's liveness endpoint /healthz on 0.0.0.0:PORT (default: "
                        "$SPLITSERVE_HEALTH_PORT; unset: none)")
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics on 0.0.0.0:PORT/metrics: the SLO planner's decisions "
                        "(splitserve_planner_*, spec.autoscaling) (default: none)")
    p.set_defaults(func=commands.cmd_operator)


def _add_bench_parser(sub) -> None:
    # Everything after `bench` goes to the load generator's own parser (its --help,
    # and `bench compare A.json B.json`); prefix_chars keeps argparse from reading it here.
    p = sub.add_parser("bench", help="load-test an OpenAI-compatible endpoint (see `bench --help`)",
                       add_help=False, prefix_chars="\0")
    p.add_argument("bench_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=commands.cmd_bench)


WORKER_GROUP_HELP = """\
tensor-parallel groups across machines (one process per rank, e.g. one pod each):
  With these variables set, `--tp N` starts no local ranks; each rank is its own
  `splitserve worker`, all with the same engine flags.
  SPLITSERVE_TP_RANK          this process's rank, 0..N-1. Rank 0 is the worker the
                              router talks to (gRPC API, health, etcd); it hosts the
                              rendezvous and waits for every rank before SERVING.
                              Ranks >= 1 serve no API: they join rank 0, load their
                              shard and run its steps; their KV connector listens on
                              --host. Rank 0 exits 1 when a rank is lost (replace the
                              group as a unit); a rank exits when rank 0 is gone.
  SPLITSERVE_TP_WORLD_SIZE    N, the number of ranks (--tp, if given, must match)
  SPLITSERVE_TP_LEADER        HOST:PORT of rank 0's rendezvous: rank 0 listens on PORT
                              on every interface, the others dial HOST:PORT
  SPLITSERVE_TP_JOIN_TIMEOUT  seconds rank 0 waits for every rank to join and load (and
                              a rank for rank 0), naming the missing ones (default: 600)
"""


VLLM_WORKER_HELP = """
the vLLM engine (--engine vllm; docs/engines.md):
  Run this command with the vLLM engine environment's python (scripts/install-vllm-cpu.sh
  makes it). vLLM runs in this process; what follows `--` is parsed by vLLM's own engine
  argument parser and overrides what splitserve derives from its flags (--model, --dtype,
  --device, --tp, --block-size, --max-num-seqs, --max-num-batched-tokens, --max-logprobs,
  --kv-cache-gib), e.g.
    splitserve worker --engine vllm --model smollm2 -- --max-model-len 4096
  With --role prefill / --role decode, splitserve's KV connector runs inside vLLM and pushes
  each layer's KV from the prefill worker into the blocks the decode worker's vLLM reserved
  (--tp 1; docs/engines.md); --kv-connector nixl-vllm runs vLLM's own NixlConnector instead.
"""

KV_ENVIRONMENT_HELP = """
damaging KV on purpose (kvtransfer/faults.py; off by default):
  Proves that no damaged block becomes a token: each is rejected by its checksum and
  recomputed, and counted (splitserve_kv_transfer_digest_mismatches_total,
  splitserve_worker_kv_tier_dropped_blocks_total).
  SPLITSERVE_KV_FAULTS        SITE=KIND[@RATE],...  transfer=drop|corrupt, host=flip,
                              disk=flip|drop, store=flip; RATE the share of events hit (default 1)
  SPLITSERVE_KV_FAULT_FILE    a file holding the same text: faults are on while it exists
  SPLITSERVE_KV_FAULT_SEED    which events a RATE below 1 hits, the same in every run

weights revision (splitserve/checkpoints/fingerprint.py):
  A prefill and a decode worker exchange KV only if their fingerprints (weights, tokenizer,
  engine) are equal, so a rolling update's old and new workers never mix in one response. The
  weights are named by a digest of their files (read once, kept in ~/.cache/splitserve).
  SPLITSERVE_WEIGHTS_REVISION TEXT   name the weights instead (a release tag): nothing is read
"""


def _add_engine_choice(p: argparse.ArgumentParser, worker: bool) -> None:
    p.add_argument("--engine", choices=["builtin", "vllm"], default="builtin",
                   help="the engine: splitserve's built-in torch engine, or vLLM (in its own environment; "
                        "docs/engines.md) (default: %(default)s)")
    if not worker:
        p.add_argument("--engine-python", default=None, metavar="PATH",
                       help="with --engine vllm: the python the vLLM workers run with (default: the vLLM engine "
                            "environment that `make install-vllm-cpu` makes, "
                            "~/.cache/splitserve/engines/vllm-cpu-VERSION/bin/python)")
    p.add_argument("engine_args", nargs="*", metavar="-- VLLM_FLAGS",
                   help="with --engine vllm: vLLM engine flags, parsed by vLLM's own parser after `--` "
                        "(e.g. -- --max-model-len 4096 --quantization fp8); they override splitserve's")


def _add_worker_parser(sub) -> None:
    p = sub.add_parser("worker", help="run one engine behind the gRPC worker service",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Run one engine (one tensor-parallel group) behind the gRPC "
                                   "Worker service and the standard gRPC health service.",
                       epilog=WORKER_GROUP_HELP + VLLM_WORKER_HELP + KV_ENVIRONMENT_HELP)
    _add_engine_args(p)
    _add_engine_choice(p, worker=True)
    p.add_argument("--role", choices=["prefill", "decode", "both"], default="both",
                   help="prefill, decode, or both (aggregated; default)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default: %(default)s)")
    p.add_argument("--advertise-host", default=None, metavar="HOST",
                   help="the address other processes reach this worker at: registered in etcd and given "
                        "to KV transfer peers (TCP; NIXL picks its own) (default: --host; required with --etcd "
                        "when --host is a wildcard such as 0.0.0.0: a pod passes its IP)")
    p.add_argument("--port", type=int, default=0, help="gRPC port (default: 0, any free port)")
    p.add_argument("--worker-id", default=None, help="name in logs, stats and KV events")
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics (GET /metrics, plain HTTP) on --host:PORT: KV usage, "
                        "queue and token counters, KV transfer bytes and latency (default: off; 0: any "
                        "free port)")
    p.add_argument("--session-port", type=int, default=0, metavar="PORT",
                   help="the session stream frontends send requests over (GenerateSession's messages on a "
                        "plain TCP connection, TLS as the gRPC port), on --host:PORT; Describe tells "
                        "frontends the port (default: 0, any free port; -1: off, frontends use the "
                        "GenerateSession gRPC call)")
    p.add_argument("--kv-store", default=None, metavar="HOST:PORT|etcd",
                   help="a shared KV block store (`splitserve kvstore`): publish the blocks this worker "
                        "computes and fetch the prefixes it holds when that is quicker than recomputing; "
                        "'etcd': the store registered in --etcd (needs --tp 1; default: none)")
    _add_disaggregation_args(p)
    _add_etcd_args(p)
    p.add_argument("--etcd-ttl", type=int, default=10, metavar="S",
                   help="lease TTL of the etcd registration; routers drop the worker this long after it "
                        "stops refreshing (default: %(default)s)")
    _add_drain_arg(p, "calls")
    _add_tracing_arg(p, "each request's prefill, KV transfer and decode")
    _security_args.add_worker_tls_args(p)
    _security_args.add_transfer_token_arg(p)
    p.set_defaults(func=commands.cmd_worker)


def _add_tracing_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help=f"export OpenTelemetry traces of {what} to this OTLP/gRPC collector, e.g. "
                        "http://127.0.0.1:4317 (as vLLM's flag; the client's W3C traceparent header is "
                        "continued). Needs `pip install 'splitserve[tracing]'` (default: "
                        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT when set, else off)")


def _add_drain_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                   help=f"on SIGTERM: stop admitting, give running {what} this long to finish, then exit "
                        "(default: %(default)s)")


def _add_migration_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--migration-limit", type=int, default=2, metavar="N",
                   help="move a request to another decode worker at most N times when the stream from "
                        "its worker breaks (crash, lost connection, drain timeout); 0 disables "
                        "(default: %(default)s)")
    p.add_argument("--migration-wait", type=float, default=30.0, metavar="S",
                   help="when no other decode worker is ready for a broken stream (the only one is "
                        "restarting), wait up to S seconds for one before failing the request "
                        "(default: %(default)s)")


def _add_tool_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='tool_choice="auto" (the default when a request sends tools): find tool calls in the '
                        "model's output with --tool-call-parser (as vLLM's flag; without it such requests get "
                        "400; required and named choices need no parser)")
    p.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json"],
                   help="how the model writes tool calls: hermes (Hermes, Qwen 2.5/3: <tool_call>{...}"
                        "</tool_call>) or llama3_json (Llama 3.x: {\"name\": ..., \"parameters\": ...})")


def _add_generation_config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                   help="defaults for the sampling parameters a request omits (temperature, top_p, top_k, "
                        "min_p): auto takes the model folder's generation_config.json, the values the "
                        "model's authors recommend (for the shipped SmolLM2: temperature 0.2, top_p 0.9), "
                        "as vLLM does; vllm ignores it (temperature 1, top_p 1, no top_k or min_p); or a "
                        "folder holding a generation_config.json. A value the request sets always wins "
                        "(default: %(default)s)")


def _add_disaggregation_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("disaggregation")
    g.add_argument("--transfer", choices=["auto", "nixl", "tcp"], default="auto",
                   help="KV transfer between prefill and decode workers (default: nixl when "
                        "importable, else tcp)")
    g.add_argument("--kv-connector", choices=["splitserve", "nixl-vllm"], default="splitserve",
                   help="with --engine vllm: what moves a prompt's KV from the prefill to the decode worker: "
                        "splitserve's connector inside vLLM (each layer pushed as it is computed, over "
                        "--transfer), or vLLM's own NixlConnector (the decode worker reads the whole prompt "
                        "over NIXL after the prefill; both pools must use the same) (default: %(default)s)")
    g.add_argument("--remote-prefill-threshold", type=int, default=64, metavar="TOKENS",
                   help="decode role: prompts with fewer uncached tokens are prefilled locally "
                        "(default: %(default)s)")
    g.add_argument("--prefill-timeout", type=float, default=30.0, metavar="S",
                   help="decode role: give up on remote prefill after this long, retries included, "
                        "and prefill locally (default: %(default)s)")


_ROUTERS = ["kv", "round-robin", "random", "least-loaded", "power-of-two"]


def _add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--router", default="kv", choices=_ROUTERS,
                   help="routing policy (default: %(default)s: prefix overlap against load)")
    p.add_argument("--prefill-weight", type=float, default=DEFAULT_PREFILL_WEIGHT,
                   help="kv policy: cost of one uncached prompt block relative to one block of load "
                        "(default: %(default)s: its prefill time plus the new KV memory it takes)")
    p.add_argument("--router-temperature", type=float, default=0.0,
                   help="kv policy: sample winners ∝ exp(-normalized cost / T); 0 picks the lowest "
                        "(default: %(default)s)")
    p.add_argument("--kv-tier-credit", type=_parse_tier_credit, default={}, metavar="TIER=SHARE,...",
                   help="kv policy: a prompt block in a worker's host or disk KV tier, or in the shared KV "
                        "store it is attached to, counts as this share of one in its device pool, e.g. "
                        "host=0.9,disk=0.6,store=0.5 (default: those; see router/core.py)")


def _add_etcd_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--etcd", action="append", default=None, metavar="HOST:PORT[,HOST:PORT...]",
                   help="etcd endpoint(s) for worker discovery (repeatable or comma-separated, every member of "
                        "the cluster; default: none, static)")
    _security_args.add_etcd_tls_args(p)
    p.add_argument("--etcd-prefix", default="/splitserve/workers/",
                   help="key prefix workers register under (default: %(default)s)")


def _add_frontend_parser(sub) -> None:
    p = sub.add_parser("frontend", help="run the OpenAI-compatible HTTP and gRPC frontend",
                       description="Serve the OpenAI-compatible HTTP API and the public gRPC "
                                   "Generate API in front of running workers.")
    p.add_argument("--model", default="smollm2", help="the workers' model (for its tokenizer)")
    p.add_argument("--served-model-name", default=None,
                   help="model name clients use (default: the workers' model name)")
    _add_generation_config_arg(p)
    _add_tool_args(p)
    p.add_argument("--worker", action="append", default=None, metavar="ROLE=HOST:PORT",
                   help="a worker, e.g. both=127.0.0.1:50051 (repeatable; roles: both, decode, prefill); "
                        "or find them with --etcd")
    _add_router_args(p)
    p.add_argument("--prefill-router", default=None, choices=_ROUTERS,
                   help="the prefill leg's policy (default: the same as --router)")
    p.add_argument("--router-seed", type=int, default=None, help="seed of the random policies")
    p.add_argument("--remote-prefill-threshold", type=int, default=64, metavar="TOKENS",
                   help="prompts with fewer tokens uncached on the chosen decode worker are prefilled "
                        "there (default: %(default)s; the decode worker checks again itself)")
    _add_etcd_args(p)
    p.add_argument("--host", default="127.0.0.1", help="listen address (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default: %(default)s)")
    p.add_argument("--grpc-port", type=int, default=None,
                   help="public gRPC port (default: none)")
    p.add_argument("--gateway", action="store_true",
                   help="gateway mode: this frontend serves one pod's decode worker behind a Gateway API "
                        "Inference Extension gateway; the endpoint picker (splitserve epp, or llm-d's) chose the "
                        "pod and names the prefill worker in the header x-prefiller-host-port (its gRPC host:port); "
                        "without the header the worker prefills locally")
    _add_migration_arg(p)
    _add_drain_arg(p, "requests")
    _add_tracing_arg(p, "each request (its routing, worker calls and migrations)")
    _security_args.add_api_key_args(p)
    _security_args.add_limit_args(p)
    _flow_control_args.add_flow_control_args(p, serve=False)
    _security_args.add_public_tls_args(p)
    _security_args.add_frontend_worker_tls_args(p)
    p.set_defaults(func=commands.cmd_frontend)


def _add_epp_parser(sub) -> None:
    p = sub.add_parser("epp", help="run the endpoint picker a Gateway API Inference Extension gateway calls",
                       description="Serve Envoy's ext_proc protocol as a Gateway API Inference Extension "
                                   "endpoint picker: each request through the gateway is parsed and tokenized as "
                                   "the model servers do, scored by the KV-aware router against the workers' "
                                   "cached prefixes and load, and sent to the chosen pod "
                                   "(x-gateway-destination-endpoint; for a disaggregated pool the prefill worker "
                                   "in x-prefiller-host-port). The pods run `splitserve frontend --gateway`.")
    p.add_argument("--model", default="smollm2", help="the workers' model (for its tokenizer and chat template)")
    p.add_argument("--served-model-name", default=None,
                   help="model name clients use (default: the workers' model name); others get the model "
                        "servers' 404 from the picker")
    _add_tool_args(p)
    g = p.add_argument_group("where the workers are (one of)")
    g.add_argument("--pool-name", default=None, metavar="NAME",
                   help="an InferencePool (inference.networking.k8s.io/v1): its selected pods with the "
                        "llm-d.ai/role label are the workers (gRPC on their container port named grpc), reached "
                        "on its targetPorts[0]; needs get/list/watch on pods and inferencepools")
    g.add_argument("--pool-namespace", default="default", metavar="NS",
                   help="the InferencePool's namespace (default: %(default)s)")
    g.add_argument("--worker", action="append", default=None, metavar="ROLE=HOST:PORT",
                   help="a worker's gRPC address, e.g. decode=10.0.0.7:50051 (repeatable; roles: both, decode, "
                        "prefill)")
    _add_etcd_args(p)
    p.add_argument("--target-port", type=int, default=8000, metavar="PORT",
                   help="the port of a worker pod's OpenAI API (splitserve frontend --gateway) on the worker's host, "
                        "for --worker and --etcd workers (default: %(default)s; an InferencePool's own wins)")
    p.add_argument("--endpoint", action="append", default=[], metavar="GRPC_HOST:PORT=HTTP_HOST:PORT",
                   help="the OpenAI endpoint of one worker when it is not HOST:--target-port (several workers on "
                        "one host); repeatable")
    p.add_argument("--fallbacks", type=int, default=0, metavar="N",
                   help="list N more endpoints after the pick, for a proxy that tries them in turn (default: 0; "
                        "Envoy's ORIGINAL_DST cluster takes exactly one)")
    _add_router_args(p)
    p.add_argument("--prefill-router", default=None, choices=_ROUTERS,
                   help="the prefill leg's policy (default: the same as --router)")
    p.add_argument("--remote-prefill-threshold", type=int, default=64, metavar="TOKENS",
                   help="prompts with fewer uncached tokens on the chosen decode worker get no prefill pick "
                        "(default: %(default)s)")
    p.add_argument("--host", default="0.0.0.0", help="listen address (default: %(default)s)")
    p.add_argument("--port", type=int, default=9002, help="ext_proc gRPC port, with grpc.health.v1 (default: %(default)s)")
    p.add_argument("--health-port", type=int, default=9003,
                   help="gRPC health port for probes: liveness, readiness (default: %(default)s)")
    p.add_argument("--metrics-port", type=int, default=9090,
                   help="Prometheus /metrics port (default: %(default)s; -1: off)")
    p.add_argument("--max-body-bytes", type=int, default=32 * 1024 * 1024, metavar="N",
                   help="a request body past N bytes gets 413 (default: %(default)s)")
    p.add_argument("--max-prompt-tokens", type=int, default=0, metavar="N",
                   help="refuse prompts past N tokens, as the model servers' frontends do (default: the context)")
    _add_drain_arg(p, "ext_proc streams")
    _flow_control_args.add_flow_control_args(p, serve=False)
    p.add_argument("--objective", action="append", default=[], metavar="NAME=PRIORITY",
                   help="an InferenceObjective outside Kubernetes: a request whose header "
                        "x-gateway-inference-objective (or x-llm-d-inference-objective) is NAME gets this priority "
                        "in flow control (higher is more critical, as the objective's spec.priority); repeatable. "
                        "With --pool-name the pool's InferenceObjectives (inference.networking.x-k8s.io/v1alpha2) "
                        "are read too, and win")
    g = p.add_argument_group("TLS of the ext_proc port (the gateway connects with TLS)")
    g.add_argument("--tls-cert", default=None, metavar="PEM", help="the picker's certificate chain")
    g.add_argument("--tls-key", default=None, metavar="PEM", help="its private key")
    _security_args.add_frontend_worker_tls_args(p)
    p.set_defaults(func=commands.cmd_epp)


def _add_autoscale_args(p: argparse.ArgumentParser) -> None:
    from splitserve.services.launch.topology import AUTOSCALE_DEFAULTS as d

    g = p.add_argument_group("autoscaling (services/planner, services/launch/autoscale_thread.py)")
    g.add_argument("--autoscale", action="store_true",
                   help="let the SLO planner start and drain workers (between 1 and --max-workers per pool; "
                        "the counts above are where it starts): every --autoscale-interval it reads the "
                        "frontends' TTFT/ITL and the workers' load, predicts the next load and prints its "
                        "decision; a worker it removes drains first (no request lost). Workers and frontends "
                        "then find each other through a local etcd serve starts (needs the etcd binary). "
                        "Not with --on-ray")
    g.add_argument("--max-workers", type=int, default=None, metavar="N",
                   help=f"with --autoscale: the most workers at once, all pools together "
                        f"(default: {d['max_workers']})")
    g.add_argument("--slo-ttft-p90-ms", type=float, default=None, metavar="MS",
                   help=f"with --autoscale: the p90 time to first token to meet (default: {d['slo_ttft_p90_ms']:g})")
    g.add_argument("--slo-itl-p90-ms", type=float, default=None, metavar="MS",
                   help=f"with --autoscale: the p90 inter-token latency to meet (default: {d['slo_itl_p90_ms']:g})")
    g.add_argument("--autoscale-interval", type=float, default=None, metavar="S",
                   help=f"with --autoscale: seconds between decisions (default: {d['autoscale_interval']:g})")
    g.add_argument("--autoscale-cooldown", type=float, default=None, metavar="S",
                   help=f"with --autoscale: a pool shrinks only this long after its last change, and only when "
                        f"every interval of that window says it can (default: {d['autoscale_cooldown']:g})")
    g.add_argument("--autoscale-mode", choices=("auto", "fixed"), default=None,
                   help="with --autoscale: `auto` lets the planner switch between aggregated and disaggregated "
                        "serving when the other mode meets the SLO with fewer workers (workers that decode move "
                        "between the aggregated and the decode pool in place; prefill workers are replaced one "
                        "place at a time; no request lost); `fixed` keeps the mode serve starts in "
                        f"(default: {d['autoscale_mode']})")
    g.add_argument("--autoscale-metrics-port", type=int, default=None, metavar="PORT",
                   help="with --autoscale: serve each decision as Prometheus metrics (splitserve_planner_*: counts "
                        "chosen and needed, the binding constraint, predicted and observed load) on "
                        "127.0.0.1:PORT/metrics (0: any free port; default: off)")


def _add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="start workers and the frontend on this machine",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Start the workers and the OpenAI-compatible frontend as processes on this\n"
                                   "machine, wait until they are ready, print the URL; Ctrl-C or SIGTERM stops\n"
                                   "them all.",
                       epilog=KV_ENVIRONMENT_HELP + "  (serve's workers inherit these variables)\n")
    _add_engine_args(p)
    _add_engine_choice(p, worker=False)
    p.add_argument("--aggregated", action="store_true",
                   help="no separate prefill pool: every worker prefills and decodes (the default with "
                        "--engine vllm unless --prefill-workers or --decode-workers is given)")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="with --aggregated: number of workers (default: 1)")
    p.add_argument("--kv-store-gib", type=float, default=0.0, metavar="GIB",
                   help="start a shared KV block store (`splitserve kvstore`) of this size that every "
                        "worker publishes its computed blocks to and fetches missed prefixes from "
                        "(needs --tp 1; 0: none; default: %(default)s)")
    p.add_argument("--cpu-bind", choices=["auto", "none"], default="auto",
                   help="on CPU: pin each worker's compute threads to cores of its own (auto), "
                        "or let them float (none) (default: %(default)s)")
    p.add_argument("--reserved-cores", type=int, default=None, metavar="N",
                   help="with --cpu-bind auto: cores kept free of workers for the frontend and clients "
                        "at all times (default: 1 on machines of 8 cores or more when the other cores "
                        "still give every rank one of its own, else 0; --engine vllm workers are not pinned "
                        "unless this or --cpu-cores is given; with --cpu-yield auto the "
                        "workers also give cores up while other processes use them; vLLM's CPU "
                        "placement is --reserved-cores 1 --cpu-yield off)")
    p.add_argument("--prefill-workers", type=int, default=None, metavar="N",
                   help="disaggregated: prefill workers (default: 1)")
    p.add_argument("--decode-workers", type=int, default=None, metavar="M",
                   help="disaggregated: decode workers (default: 1)")
    _add_disaggregation_args(p)
    _add_router_args(p)
    p.add_argument("--frontends", type=int, default=1, metavar="K",
                   help="frontends (router replicas), each on its own HTTP port (--port, then free "
                        "ports, all printed) and each building the same KV index from the workers' "
                        "events (default: %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="frontend listen address (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default: %(default)s)")
    p.add_argument("--grpc-port", type=int, default=None,
                   help="public gRPC port (default: HTTP port + 1; 0: any free port)")
    p.add_argument("--served-model-name", default=None, help="model name clients use")
    _add_generation_config_arg(p)
    _add_tool_args(p)
    p.add_argument("--worker-metrics", action="store_true",
                   help="each worker also serves its own Prometheus /metrics (`worker --metrics-port`, as the "
                        "operator's pods do) on a free port of 127.0.0.1; serve prints each URL")
    p.add_argument("--ready-timeout", type=float, default=600.0, metavar="S",
                   help="give up when not ready after this many seconds (default: %(default)s)")
    _add_migration_arg(p)
    _add_tracing_arg(p, "every request through the frontends and the workers (each child gets the flag)")
    _add_autoscale_args(p)
    ray = p.add_argument_group("Ray Serve (splitserve.services.ray_serve)")
    ray.add_argument("--on-ray", action="store_true",
                     help="run as a Ray Serve application: on --ray-address, else on a local Ray")
    ray.add_argument("--ray-address", default=None, metavar="ADDR",
                     help="the Ray cluster to use (e.g. auto, or ray://HOST:10001; default: RAY_ADDRESS, "
                          "else a local Ray)")
    ray.add_argument("--config", default=None, metavar="FILE",
                     help="a ServingDeployment manifest (or its spec) in YAML; replaces the pool, router "
                          "and model flags (engine flags such as --kv-cache-gib still apply)")
    ray.add_argument("--ray-cpus-per-worker", type=float, default=1.0, metavar="C",
                     help="without --config: CPUs each worker replica reserves (default: %(default)s)")
    _security_args.add_api_key_args(p)
    _security_args.add_limit_args(p)
    _flow_control_args.add_flow_control_args(p, serve=True)
    _security_args.add_serve_tls_args(p)
    _security_args.add_transfer_token_arg(p)
    p.set_defaults(func=commands.cmd_serve)


def _add_kvstore_parser(sub) -> None:
    p = sub.add_parser("kvstore", help="run the shared KV block store workers publish to and fetch from",
                       description="Hold KV blocks by content hash for every worker of a deployment "
                                   "(workers: --kv-store HOST:PORT). Blocks move over the KV transfer "
                                   "(NIXL or TCP), checked by CRC-32; least recently used blocks are "
                                   "evicted when --capacity-gib is full. The first worker to attach sets "
                                   "the layout (model, dtype, block size).")
    p.add_argument("--capacity-gib", type=float, default=1.0, help="block memory in GiB (default: %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default: %(default)s)")
    p.add_argument("--port", type=int, default=0, help="gRPC port (default: 0, any free port)")
    p.add_argument("--advertise-host", default=None, metavar="HOST",
                   help="the address workers reach this store at: registered in etcd, and given for TCP "
                        "transfers (default: --host; required with --etcd when --host is a wildcard)")
    p.add_argument("--transfer", choices=["auto", "nixl", "tcp"], default="auto",
                   help="KV transfer backend; the workers' must match (auto: whatever the first worker "
                        "uses; default: %(default)s)")
    p.add_argument("--etcd", action="append", default=None, metavar="HOST:PORT[,HOST:PORT...]",
                   help="register in this etcd (leased) so that workers started with --kv-store etcd find "
                        "the store (default: none)")
    _security_args.add_etcd_tls_args(p)
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics (GET /metrics) on --host:PORT: blocks held and capacity, "
                        "blocks offered, stored, fetched, evicted and rejected (default: off; 0: any free port)")
    p.add_argument("--fault-fetch-delay", type=float, default=0.0, help=argparse.SUPPRESS)   # tests only
    _security_args.add_transfer_token_arg(p)
    p.set_defaults(func=commands.cmd_kvstore)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splitserve",
        description="Serve LLMs with disaggregated prefill and decode.")
    parser.add_argument("--version", action="version", version=f"splitserve {__version__}")
    parser.add_argument("--log-level", default="WARNING", help="logging level (default: %(default)s)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    gen = sub.add_parser("generate", help="generate text for prompts with the built-in engine",
                         description="Generate text with the built-in engine, no server involved.")
    _add_engine_args(gen)
    src = gen.add_argument_group("prompts")
    src.add_argument("--prompt", action="append", metavar="TEXT", help="prompt text (repeatable)")
    src.add_argument("--prompt-ids", action="append", type=_parse_ids, metavar="IDS",
                     help="prompt as comma-separated token ids (repeatable)")
    src.add_argument("--chat", action="store_true",
                     help="wrap each --prompt as a user message in the model's chat template")
    smp = gen.add_argument_group("sampling")
    smp.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default: %(default)s)")
    smp.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    smp.add_argument("--top-p", type=float, default=1.0)
    smp.add_argument("--top-k", type=int, default=0)
    smp.add_argument("--seed", type=int, default=None, help="per-request seed for reproducible sampling")
    smp.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    gen.set_defaults(func=commands.cmd_generate)

    _add_worker_parser(sub)
    _add_frontend_parser(sub)
    _add_epp_parser(sub)
    _add_serve_parser(sub)
    _add_bench_parser(sub)
    _add_operator_parser(sub)
    _add_kvstore_parser(sub)
    add_admin_parser(sub)
    return parser
