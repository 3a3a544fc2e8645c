"""The `splitserve` command line: parse (parsers.py), then run the command (commands.py).

Each subcommand has its own `--help`.
`generate` runs the built-in engine once over some prompts and is a contract
other tools call: with `--json` it prints one JSON object per prompt with at
least `token_ids` and `text`. `serve` is the main job: workers plus the
OpenAI-compatible frontend on this machine. `worker` and `frontend` run one
process each (what `serve` starts, and what a cluster deployment runs).
"""

from __future__ import annotations

import logging
import sys

from splitserve.errors import SplitserveError
from splitserve.services.cli.parsers import build_parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except SplitserveError as exc:
        print(f"splitserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
