"""Click options derived from a config dataclass (``kvconvert.methods.options``), and back: a flag is
declared once, as a field, and its type, default, choices and help come from there (as vLLM's
``EngineArgs`` derives its flags)."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import click

BARE_CALIB = "<calib_data>"  # what a bare --calib stands for: the shipped calib_data/


def cli_fields(config: type) -> list[dataclasses.Field[Any]]:
    """The fields of ``config`` that are command-line options: the method's own in declaration order,
    then each group's (the calibration options)."""
    fields = [f for f in dataclasses.fields(config) if "help" in f.metadata]
    return sorted(fields, key=lambda f: f.metadata["group"] != "")  # stable: declaration order otherwise


def _plain(hint: Any) -> Any:
    """``X | None`` -> ``X``; ``int | Literal[...] | None`` -> ``(int, Literal[...])`` (a number or a word)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 2 and args[0] is int and typing.get_origin(args[1]) is Literal:
            return tuple(args)
        assert len(args) == 1, f"a config option is one type or None, not {hint}"
        return args[0]
    return hint


class _IntOrWord(click.ParamType):
    """A whole number or one of a few words (``--mla-rope-dim 32`` or ``auto``)."""

    def __init__(self, words: tuple[str, ...]):
        self.words = words
        self.name = "integer|" + "|".join(words)

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        if isinstance(value, int) or value in self.words:
            return value
        try:
            return int(value)
        except ValueError:
            self.fail(f"{value!r} is neither a whole number nor {' / '.join(self.words)}", param, ctx)


def click_option(f: dataclasses.Field[Any], hint: Any) -> Callable[[Any], Any]:
    """The click option of one config field."""
    kind = _plain(hint)
    flag = "--" + f.name.replace("_", "-")
    flags = f.metadata["flags"] or (flag,)
    kwargs: dict[str, Any] = {"help": f.metadata["help"]}
    if kind is bool and f.default is None:  # three states: on, off, or not given (a recipe decides)
        flags, kwargs["default"] = (f"{flag}/--no-{flag[2:]}",), None
    elif kind is bool:
        assert f.default is False, f"{f.name}: a switch is off by default"
        kwargs["is_flag"] = True
    else:
        literal = typing.get_origin(kind) is Literal
        if literal:
            kwargs["type"] = click.Choice([str(c) for c in typing.get_args(kind)])
        elif isinstance(kind, tuple):
            kwargs["type"] = _IntOrWord(tuple(str(word) for word in typing.get_args(kind[1])))
        else:
            kwargs["type"] = click.Path(path_type=Path) if kind is Path else kind
        if f.default is dataclasses.MISSING:
            kwargs["required"] = True
        else:
            kwargs["default"] = str(f.default) if literal and f.default is not None else f.default
            kwargs["show_default"] = f.default is not None
        if f.metadata.get("turns_on"):  # a bare --calib: the shipped text
            kwargs.update(is_flag=False, flag_value=BARE_CALIB)
    return click.option(*flags, f.name, **kwargs)


def field_options(config: type) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator adding ``config``'s options to a command, in the order the fields are declared."""
    hints = typing.get_type_hints(config)
    options = [click_option(f, hints[f.name]) for f in cli_fields(config)]

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        for option in reversed(options):
            fn = option(fn)
        return fn

    return decorate


def config_values(config: type, values: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of ``config`` from parsed option ``values`` (choices back to their type;
    ``--calib`` given, bare or not, turns calibration on)."""
    hints = typing.get_type_hints(config)
    kwargs: dict[str, Any] = {}
    for f in cli_fields(config):
        value = values[f.name]
        kind = _plain(hints[f.name])
        if value is not None and typing.get_origin(kind) is Literal:
            value = type(typing.get_args(kind)[0])(value)
        if (switch := f.metadata.get("turns_on")) and value is not None:
            kwargs[switch] = True
            value = None if value == BARE_CALIB else value
        kwargs[f.name] = value
    return kwargs
