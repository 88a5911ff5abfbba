"""The conversion commands, one per registered method, built from the method's config dataclass: its
fields with ``help`` are the command's flags (``kvconvert.cli.fields``), its docstring the command's help."""

from __future__ import annotations

import inspect
from typing import Any

import click

from kvconvert.cli.common import main, run_conversion, user_errors, wrote
from kvconvert.cli.fields import config_values, field_options
from kvconvert.cli.options import ConversionOptions, conversion_options
from kvconvert.methods import METHODS


def method_command(name: str) -> click.Command:
    """``kvconvert NAME``: parse the shared options and the method's own, build the method, convert."""
    config_class = METHODS[name].config

    def convert(options: ConversionOptions, **values: Any) -> None:
        from kvconvert.methods import build_method

        config = config_class(**config_values(config_class, values))
        report = run_conversion(build_method(name, config), options)
        wrote(options.out, report)

    command = conversion_options(field_options(config_class)(user_errors(convert)))
    summary = (inspect.getdoc(config_class) or "").split("\n\n")[0]  # the rest speaks of the config's fields
    return click.command(name, help=summary)(command)


for _name in METHODS:
    main.add_command(method_command(_name))
