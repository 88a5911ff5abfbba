"""Recipe files map onto typed configs; every mistake is a one-line error naming key and file."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvconvert.errors import KVConvertError
from kvconvert.methods.slim import SlimConfig
from kvconvert.recipe import load_recipe, parse_recipe

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def test_shipped_slim_recipe_parses():
    method, config = load_recipe(RECIPES / "slim.yaml")
    assert method == "slim" and config == SlimConfig(max_v_error=0.01)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"method": "slim", "max_v_eror": 0.1}, "unknown key 'max_v_eror'"),
        ({"method": "slim", "max_v_error": "big"}, "'max_v_error' must be float"),
        ({"method": "slim", "max_v_error": -1.0}, "max_v_error must be > 0"),
        ({"method": "slim", "force": 1}, "'force' must be bool"),
        ({"method": "nope"}, "unknown method 'nope'"),
        (["slim"], "a recipe is a mapping"),
    ],
)
def test_recipe_errors_name_key_and_file(data, message):
    with pytest.raises(KVConvertError, match=message) as info:
        parse_recipe(data, "r.yaml")
    assert str(info.value).startswith("r.yaml: ") and "\n" not in str(info.value)
