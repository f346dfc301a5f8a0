"""`redknot` command line. Subcommands register here; each builds its objects and passes them in."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="redknot", description="RedKnot-MLA: certified document reuse for DeepSeek-V4")
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("demo", help="build a small random checkpoint, prefill and greedily generate, print timings")
    d.add_argument("--tokens", type=int, default=4096, help="prompt length to prefill")
    d.add_argument("--new-tokens", type=int, default=32)
    d.add_argument("--chunk", type=int, default=1024, help="prefill chunk size (rows per forward)")
    d.add_argument("--model", default=None, help="checkpoint directory; default: a small random one built once")
    d.add_argument("--workdir", default=".cache/demo", help="where the random checkpoint is written")
    d.add_argument("--device", default="cpu")

    args = p.parse_args(argv)
    if args.cmd == "demo":
        from runtime.demo import run_demo
        return run_demo(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
