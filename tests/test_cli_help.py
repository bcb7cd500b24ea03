"""Every `kvgate` subcommand explains itself: `--help` lists each option with one line of help
and, where the option has one, its default."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvgate_cli


def parsers(
    parser: argparse.ArgumentParser, prog: str
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """A parser and its nested sub-parsers (`kvgate billing export`)."""
    yield prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, f"{prog} {name}")


def has_default(action: argparse.Action) -> bool:
    default = action.default
    return not (default is None or default is False or default == [])


def subcommand(name: str) -> argparse.ArgumentParser:
    parser = kvgate_cli.build_parser(name)
    (commands,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices[name]


@pytest.mark.parametrize("name", sorted(kvgate_cli.COMMANDS))
def test_every_option_has_a_line_of_help_and_its_default(name: str) -> None:
    for prog, parser in parsers(subcommand(name), f"kvgate {name}"):
        shown = "".join(parser.format_help().split())  # argparse wraps lines (and at hyphens)
        for action in parser._actions:
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            if isinstance(action, argparse._SubParsersAction):
                continue
            assert action.help, f"{prog} {action.option_strings or action.dest}: no help"
            if action.option_strings and has_default(action):
                line = parser._get_formatter()._expand_help(action)
                assert "default" in line, f"{prog} {action.option_strings}: no default shown"
                assert "".join(line.split()) in shown


def test_serve_shows_its_settings_defaults() -> None:
    """`serve`'s options stay None (a KVGATE_* variable or --config still applies): the default
    shown is the setting's."""
    text = " ".join(subcommand("serve").format_help().split())
    for shown in ("HTTP port (default: 8080)", "(default: 9090)", "(default: cache_aware)"):
        assert shown in text


def test_the_installed_command_prints_the_engines_options() -> None:
    kvgate = Path(sys.executable).parent / "kvgate"
    out = subprocess.run(
        [str(kvgate), "engine", "--help"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert "--capacity-blocks" in out and "(default: 8192)" in " ".join(out.split())
