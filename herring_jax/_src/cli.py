"""The `herring-jax` console script: one subcommand per entry in SUBCOMMANDS.

Usage::

  herring-jax launch -n 4 [--devices-per-process 2] [--servers 2] -- python train.py
  herring-jax serve --coordinator HOST:PORT
  herring-jax bench -n 4
  herring-jax train-bench -n 4
  herring-jax timeline trace.rank*.json -o trace.json
  herring-jax <subcommand> --help

A module adds a subcommand by calling register() (or adding to SUBCOMMANDS)
with a function that adds its options to an argparse parser and a function
that runs the parsed arguments and returns an exit code.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from herring_jax._src.launcher import launch, serving
from herring_jax._src.process import timeline
from herring_jax._src.tools import bench, train_bench
from herring_jax._src.tools.help_format import HelpFormatter

AddArguments = Callable[[argparse.ArgumentParser], None]
Run = Callable[[argparse.Namespace], int]

# name -> (one-line help, add_arguments(parser), run(args) -> exit code)
SUBCOMMANDS: dict[str, tuple[str, AddArguments, Run]] = {}


def register(name: str, help: str, add_arguments: AddArguments, run: Run) -> None:
    """Makes `herring-jax NAME ...` parse with add_arguments and call run.

    Args:
      name: the subcommand's name.
      help: one line for `herring-jax --help`.
      add_arguments: adds the subcommand's options to its (sub)parser.
      run: takes the parsed arguments and returns the exit code.
    """
    SUBCOMMANDS[name] = (help, add_arguments, run)


register("launch", "start N local processes of a command", launch.add_arguments, launch.run)
register("serve", "run a server-only process of a job (sums, trains nothing)",
         serving.add_arguments, serving.run)
register("bench", "time herring_jax's all-reduce against its peers", bench.add_arguments,
         bench.run)
register("train-bench", "training step time and scaling efficiency per reducer",
         train_bench.add_arguments, train_bench.run)
register("timeline", "merge the HERRING_TIMELINE traces of a job's processes into one",
         timeline.add_arguments, timeline.run)


def build_parser() -> argparse.ArgumentParser:
    """Returns the `herring-jax` parser with one subparser per registered subcommand.

    No option is taken by a prefix of its name (allow_abbrev=False): a
    misspelt `--max-restart` is an error, not `--max-restarts`.
    """
    parser = argparse.ArgumentParser(prog="herring-jax",
                                     description="herring_jax command-line tools",
                                     allow_abbrev=False)
    sub = parser.add_subparsers(dest="subcommand", metavar="SUBCOMMAND", required=True)
    for name, (text, add_arguments, _) in SUBCOMMANDS.items():
        add_arguments(sub.add_parser(name, help=text, description=text,
                                     formatter_class=HelpFormatter, allow_abbrev=False))
    return parser


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._subparsers._group_actions:  # noqa: SLF001 - argparse has no accessor
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            return action.choices[name]
    raise KeyError(name)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `herring-jax`.

    Args:
      argv: the arguments after the program name; sys.argv[1:] when None.

    Returns:
      The subcommand's exit code.
    """
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # The subcommand's usage, not the top level's, goes with its own options.
        _subparser(parser, args.subcommand).error(
            f"unrecognized arguments: {' '.join(unknown)}")
    return SUBCOMMANDS[args.subcommand][2](args)


if __name__ == "__main__":
    raise SystemExit(main())
