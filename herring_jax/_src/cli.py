"""The `herring-jax` command: subcommands registered in one table."""

from __future__ import annotations

import argparse
import sys

from herring_jax._src import bench, launch

# name -> (help, add_arguments(parser), run(args) -> exit code)
SUBCOMMANDS = {
    "launch": ("start N local processes of a command", launch.add_arguments, launch.run),
    "bench": ("time herring_jax's all-reduce against its peers", bench.add_arguments, bench.run),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="herring-jax")
    sub = parser.add_subparsers(dest="subcommand", required=True)
    for name, (text, add_arguments, _) in SUBCOMMANDS.items():
        add_arguments(sub.add_parser(name, help=text))
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return SUBCOMMANDS[args.subcommand][2](args)


if __name__ == "__main__":
    raise SystemExit(main())
