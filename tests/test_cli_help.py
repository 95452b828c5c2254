"""Every ``--help`` of the ``mpigrad`` command tree prints and exits 0: the tree is walked
from mpigrad.cli (each command's parser, each subcommand's, recursively), so a command
added later is covered without touching this file."""

from __future__ import annotations

import argparse

import pytest

from mpigrad.cli import COMMANDS, command_parser, main


def _subcommand_paths(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """Every subcommand path below ``parser``: ``("compare",)``, ``("iteration",)``, ..."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield path + (name,)
                yield from _subcommand_paths(child, path + (name,))


def _help_commands() -> list[list[str]]:
    commands = [[]]
    for name in COMMANDS:
        _, parser = command_parser(name)
        commands.append([name])
        commands.extend([name, *sub] for sub in _subcommand_paths(parser))
    return commands


def test_the_walk_reaches_the_subcommands():
    commands = {" ".join(c) for c in _help_commands()}
    assert {"trace compare", "trace repair", "bench iteration", "data verify", "doctor"} <= commands


@pytest.mark.parametrize("command", _help_commands(), ids=lambda c: " ".join(c) or "mpigrad")
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_exits_0(command, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*command, flag])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: mpigrad"), out[:200]
