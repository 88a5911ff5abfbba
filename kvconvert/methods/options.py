"""What a method's config says about its command. A config field made with ``option`` is a flag of
``kvconvert <method>``: its type gives the flag's type (``Literal`` -> a choice, ``bool`` -> a switch,
``X | None`` -> optional), its default the flag's, ``help`` its --help line; the CLI builds every method
command from these (``kvconvert.cli.methods``). A field without ``help`` is a library-only setting.

Kept free of torch and click: ``kvconvert --help`` reads every config without loading either."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field
from typing import Any

CALIB_HELP = "Calibration text: file, directory of *.txt, or dataset name[:config]:split:column (default calib_data/)."


def option(default: Any = MISSING, *, help: str, flags: tuple[str, ...] = (), group: str = "") -> Any:
    """A config field that is also a command-line option. ``flags``: its spellings (default
    ``--field-name``; the first names it in --help, the others are kept aliases); no default: required;
    ``group``: options of a group come after the method's own, together."""
    metadata = {"help": help, "flags": flags, "group": group}
    return field(metadata=metadata) if default is MISSING else field(default=default, metadata=metadata)


# The calibration group: every command that runs the model on text spells these three the same way.
def calib_option(help: str = CALIB_HELP, *, turns_on: str | None = None) -> Any:
    """``--calib``. With ``turns_on`` (a bool field's name) calibration is optional for the method: a bare
    ``--calib`` stands for the shipped calib_data/ and, like ``--calib SOURCE``, sets that field."""
    return field(default=None, metadata={"help": help, "flags": (), "group": "calibration", "turns_on": turns_on})


def calib_tokens_option(default: int = 16384) -> Any:
    return option(default, help="Calibration tokens (512-token chunks).", group="calibration")


def seed_option() -> Any:
    return option(0, help="Seed of the chunk shuffle.", group="calibration")


@dataclass(frozen=True)
class Calibration:
    """The calibration options alone (``kvconvert analyze``'s)."""

    calib: str | None = calib_option()
    calib_tokens: int = calib_tokens_option()
    seed: int = seed_option()
