"""Every command's `--help` prints its usage and exits 0 (a help text is formatted by argparse, where a stray
`%` in a setting's description used to raise a traceback instead)."""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest

from pdserve.cli import build_parser


def _commands(parser: argparse.ArgumentParser, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    for action in parser._actions:  # noqa: SLF001 - argparse keeps subcommands only here
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for name, sub in action.choices.items():
                out += _commands(sub, prefix + (name,))
    return out


@pytest.mark.parametrize("command", _commands(build_parser()), ids=lambda c: " ".join(c) or "pdserve")
def test_help_prints_and_exits_zero(command):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
        build_parser().parse_args([*command, "--help"])
    assert e.value.code == 0
    assert "usage:" in out.getvalue()
