"""Command-line flags generated from config dataclasses: one flag per field, `--` + its name with dashes, its
help the field's `help` metadata (`pdserve.core.settings.setting`) or its attribute docstring. A setting shared
by several commands is one field of one slice (`pdserve.core.settings`), so its flag has the same name, default
and help on every command that takes it."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing


def add_config_args(parser: argparse.ArgumentParser, config, skip: frozenset[str] = frozenset(),
                    deprecated: dict[str, str] | None = None) -> None:
    """One flag per field of `config`, a config dataclass or an instance of one (whose values are then the
    defaults). `deprecated`: an old spelling -> the field it now names; it still works and warns when used."""
    cls = config if isinstance(config, type) else type(config)
    helps = field_help(cls)
    hints = typing.get_type_hints(cls)
    aliases: dict[str, list[str]] = {}
    for old, name in (deprecated or {}).items():
        aliases.setdefault(name, []).append(old)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flags = ["--" + f.name.replace("_", "-"), *aliases.pop(f.name, [])]
        help_ = helps[f.name].replace("%", "%%") + "".join(f" ({old}: deprecated)" for old in flags[1:])  # literal %
        if flags[1:] and (hints[f.name] is bool or typing.get_origin(hints[f.name]) is tuple):
            raise ValueError(f"deprecated spellings of --{f.name} would not warn: only single-value flags have them")
        default = f.default if config is cls else getattr(config, f.name)
        hint = hints[f.name]
        if hint is bool:
            parser.add_argument(*flags, action=argparse.BooleanOptionalAction, default=default, help=help_)
            continue
        if typing.get_origin(hint) is tuple:  # repeatable
            parser.add_argument(*flags, action="append", type=str, default=None, help=help_ + " (repeatable)",
                                metavar=f.name.upper())
            continue
        base = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
        parser.add_argument(*flags, type=base if base in (int, float) else str, default=default, help=help_,
                            metavar=f.name.upper(), action=WarnDeprecated, deprecated=tuple(flags[1:]))
    if aliases:
        raise ValueError(f"{cls.__name__} has no fields {sorted(aliases)} for deprecated flags")


class WarnDeprecated(argparse.Action):
    """Stores the value; an old spelling of the flag also prints a one-line warning to stderr."""

    def __init__(self, option_strings, dest, deprecated: tuple[str, ...] = (), **kwargs) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.deprecated = deprecated

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if option_string in self.deprecated:
            print(f"warning: {option_string} is deprecated; use {self.option_strings[0]}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def field_help(cls) -> dict[str, str]:
    """Each field's help: its `help` metadata, else its attribute docstring (for generated CLI help)."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = str(nxt.value.value)
    return {f.name: f.metadata.get("help") or docs.get(f.name, "") for f in dataclasses.fields(cls)}
