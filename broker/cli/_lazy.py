"""Lazy registration of ``clmq``'s commands: a command imports only what it runs.

Every verb's parser lives beside its implementation, and those modules import what the
verb needs (the broker service, the client, rich, numpy, the benchmarks ...). Building
every parser for every run made ``clmq broker`` import every benchmark. Instead the
command line is a table of :class:`Verbs`: the names and one-line help of the commands
one registrar adds. The command a run names is built in full (its registrar's module is
imported then); the others are listed by name and help line only, which is all that
``clmq --help`` (or a misspelt command's error) shows of them. ``build_parser()``
without arguments still builds every verb, and ``tests/test_cli_lazy.py`` checks that
each command's ``--help`` is the same either way (a command added to a registrar but not
to its table fails there).
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# A registrar adds its commands to a sub-parsers action; ``words`` are the command
# line's words after the command (None: build everything), for registrars that add
# sub-commands lazily themselves (``clmq bench``).
Registrar = Callable[[Any, list[str] | None], None]


@dataclass(frozen=True)
class Verbs:
    """The commands one registrar adds, in the order it adds them, each with the help
    line its parent's ``--help`` lists."""

    register: Registrar
    commands: tuple[tuple[str, str], ...]

    @property
    def names(self) -> tuple[str, ...]:
        """The commands' names."""
        return tuple(name for name, _ in self.commands)


def calls(target: str) -> Registrar:
    """A registrar that imports ``module`` and calls ``module.function(sub)``
    (``target`` is ``"module:function"``)."""
    module, _, function = target.partition(":")

    def register(sub: Any, words: list[str] | None) -> None:
        getattr(importlib.import_module(module), function)(sub)

    return register


def chosen_command(table: Sequence[Verbs], words: Sequence[str]) -> tuple[str | None, list[str]]:
    """The first of ``words`` that names a command of ``table``, and the words after
    it; ``(None, [])`` when none does (``--help``, ``--version``, a misspelt command)."""
    names = {name for verbs in table for name in verbs.names}
    for i, word in enumerate(words):
        if word in names:
            return word, list(words[i + 1 :])
    return None, []


def add_verbs(sub: Any, table: Sequence[Verbs], words: Sequence[str] | None) -> bool:
    """Add ``table``'s commands to ``sub`` in order: with ``words`` None every one in
    full, else only the registrar of the command ``words`` name (its siblings in the
    same registrar come with it), the others as parsers with their help line only.
    Whether anything was built in full."""
    chosen, rest = (None, None) if words is None else chosen_command(table, words)
    built = False
    for verbs in table:
        if words is None or chosen in verbs.names:
            verbs.register(sub, rest)
            built = True
            continue
        for name, help_line in verbs.commands:
            sub.add_parser(name, help=help_line)
    return built


def parser_tree(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], str]:
    """Every command's path (``("bench", "e2e")``) and its ``--help`` text, ``()`` the
    top level's."""
    out = {path: parser.format_help()}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                out |= parser_tree(child, (*path, name))
    return out
