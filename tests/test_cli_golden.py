"""Every command's flags, choices and defaults, as they are: a refactor of the CLI (commands generated
from the method registry, #37) must keep them identical. Regenerate deliberately with
``python -m tests.test_cli_golden`` when a flag is added or changed on purpose."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GOLDEN = Path(__file__).parent / "golden" / "cli_flags.json"


def cli_flags() -> dict[str, list[dict[str, Any]]]:
    from kvconvert.cli import main

    flags: dict[str, list[dict[str, Any]]] = {}
    for name, command in sorted(main.commands.items()):
        params = []
        for p in command.params:
            entry: dict[str, Any] = {
                "name": p.name,
                "kind": type(p).__name__,
                "opts": sorted(p.opts + p.secondary_opts),
            }
            if hasattr(p.type, "choices"):
                entry["choices"] = list(p.type.choices)
            if getattr(p, "default", None) is not None and not callable(p.default):
                entry["default"] = p.default if isinstance(p.default, (int, float, str, bool)) else str(p.default)
            params.append(entry)
        flags[name] = params
    return flags


def test_every_commands_flags_are_unchanged():
    golden = json.loads(GOLDEN.read_text())
    current = json.loads(json.dumps(cli_flags()))
    assert sorted(current) == sorted(golden), "commands added or removed"
    for command in golden:
        by_name = {p["name"]: p for p in current[command]}
        assert sorted(by_name) == sorted(p["name"] for p in golden[command]), f"{command}: options added or removed"
        for expected in golden[command]:
            assert by_name[expected["name"]] == expected, f"kvconvert {command} {expected['opts']} changed"


if __name__ == "__main__":
    GOLDEN.write_text(json.dumps(cli_flags(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")
