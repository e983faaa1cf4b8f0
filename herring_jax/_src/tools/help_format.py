"""The help layout of `herring-jax` and its subcommands' parsers, here so
that the command (cli.py) and the tools it runs import it from below."""

from __future__ import annotations

import argparse
import copy


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the line breaks of a description and epilog (the modes of
    train-bench are laid out by hand) and shows each option's default."""

    @staticmethod
    def _shows_default(action) -> bool:
        return bool(action.option_strings) and action.default not in (None, False, "",
                                                                       argparse.SUPPRESS)

    def _format_action(self, action):
        if action.help is None and self._shows_default(action):
            # argparse prints nothing after an option without help text.
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    def _get_help_string(self, action):
        text = action.help or ""
        if "%(default)" in text or not self._shows_default(action):
            return text
        return f"{text} (default: %(default)s)"
