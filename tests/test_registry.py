"""One registry: every method has a package, a runtime and a command, and nothing else does."""

from __future__ import annotations

import importlib
import pkgutil

import kvconvert.methods as methods
from kvconvert.cli import main
from kvconvert.methods import METHODS
from kvconvert.runtime.modeling_kvconvert import METHOD_RUNTIMES


def test_the_runtime_map_and_the_registry_name_the_same_methods():
    assert sorted(METHOD_RUNTIMES) == sorted(METHODS)


def test_every_registered_method_is_a_package_with_a_command():
    packages = {info.name for info in pkgutil.iter_modules(methods.__path__) if info.ispkg}
    assert packages == set(METHODS)
    for name, (config, method) in METHODS.items():
        assert method.name == name and method.__module__ == f"kvconvert.methods.{name}"
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
