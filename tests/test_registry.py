"""One registry: every method has a package, a runtime and a command, and nothing else does."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import kvconvert.methods as methods
from kvconvert.cli import main
from kvconvert.methods import METHODS
from kvconvert.runtime.modeling_kvconvert import METHOD_RUNTIMES


def test_the_runtime_map_and_the_registry_name_the_same_methods():
    assert sorted(METHOD_RUNTIMES) == sorted(METHODS)


def test_every_registered_method_is_a_package_with_a_command():
    packages = {info.name for info in pkgutil.iter_modules(methods.__path__) if info.ispkg}
    assert packages == set(METHODS)
    for name, entry in METHODS.items():
        config, method = entry.config, entry.method
        assert method.name == name and method.__module__ == f"kvconvert.methods.{name}.method"
        assert importlib.import_module(config.__module__).__name__.startswith(f"kvconvert.methods.{name}")
        assert name in main.commands, f"no `kvconvert {name}` command"


def test_no_module_of_a_method_is_imported_by_another_method():
    """A method's own calibration code lives in its package and serves it alone; shared code is in calib/."""
    import ast
    from pathlib import Path

    root = Path(methods.__file__).parent
    for name in METHODS:
        for path in (root / name).glob("*.py"):
            tree = ast.parse(path.read_text())
            imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
            others = {m for m in imported for other in METHODS if other != name
                      and m.startswith(f"kvconvert.methods.{other}")}  # fmt: skip
            assert not others, f"{path} imports {others}"


@pytest.mark.parametrize(
    "args, expected",
    [
        (["quant", "--kv-budget", "0.3", "--min-bits", "3"], {"min_bits": 3, "max_bits": 4, "calib_tokens": 2048}),
        (["lorc", "--kv-budget", "0.5", "--calib"], {"calibrate": True, "calib": None, "calib_tokens": 16384}),
        (["lorc", "--kv-budget", "0.5", "--calib", "x.txt"], {"calibrate": True, "calib": "x.txt"}),
        (["lorc", "--kv-budget", "0.5"], {"calibrate": False, "calib": None, "refine_chunks": 8}),
        (["zack", "--kv-budget", "0.5", "--calib", "x.txt"], {"calib": "x.txt", "schedule": "rate"}),
        (["minicache", "--sink", "2"], {"sink": 2, "calibrate": False}),
        (["minicache", "--unmerged-sink", "3", "--calib"], {"sink": 3, "calibrate": True, "calib": None}),
        (["razor", "--window-sink", "1", "--window", "8"], {"sink": 1, "window": 8, "kv_budget": None}),
        (["slim", "--accept-v-error"], {"accept_v_error": True, "max_v_error": 1e-2}),
    ],
)
def test_a_flag_is_a_config_field_parsed_back_into_the_config(args, expected, monkeypatch, tmp_path):
    """A method command's own flags are its config's ``option`` fields: choices come back as their type,
    a bare ``--calib`` (the shipped text) or a given one turns calibration on, aliases reach the same field."""
    from click.testing import CliRunner

    import kvconvert.methods

    built = []

    def build_method(name, config, storage=None):
        built.append(config)
        raise SystemExit(0)  # parsed: nothing to convert

    monkeypatch.setattr(kvconvert.methods, "build_method", build_method)
    result = CliRunner().invoke(main, [*args, "--model", "m", "--out", str(tmp_path / "o")])
    assert result.exit_code == 0 and len(built) == 1, result.output
    assert type(built[0]) is METHODS[args[0]].config
    for key, value in expected.items():
        assert getattr(built[0], key) == value, key


def test_every_option_field_is_a_flag_of_its_command():
    from kvconvert.cli.fields import cli_fields

    for name, entry in METHODS.items():
        flags = {p.name: p for p in main.commands[name].params}
        for field in cli_fields(entry.config):
            assert field.name in flags and flags[field.name].help == field.metadata["help"], (name, field.name)


def test_the_cli_and_the_runtime_stay_in_small_files():
    """#37's bounds: a CLI module only parses and prints (< 250 lines); a runtime file does one job (<= 500)."""
    from pathlib import Path

    root = Path(methods.__file__).parents[1]
    for path in (root / "cli").glob("*.py"):
        assert len(path.read_text().splitlines()) < 250, path
    for path in (root / "runtime").glob("*.py"):
        assert len(path.read_text().splitlines()) <= 500, path
