"""Recipe files map onto typed configs; every mistake is a one-line error naming key and file."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvconvert.errors import KVConvertError
from kvconvert.methods.lorc import LorcConfig
from kvconvert.methods.slim import SlimConfig
from kvconvert.recipe import load_recipe, parse_recipe
from kvconvert.runtime.kvconvert_codec import QuantSpec

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def test_shipped_slim_recipe_parses():
    method, config, storage = load_recipe(RECIPES / "slim.yaml")
    assert method == "slim" and config == SlimConfig(max_v_error=0.01) and storage == QuantSpec()


@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_recipe_parses(path):
    method, config, storage = load_recipe(path)
    assert type(config).__name__.lower().startswith(method)
    assert storage.quantized == ("kv_bits" in path.read_text())


def test_lorc_recipe_types():
    method, config, storage = parse_recipe(
        {"method": "lorc", "kv_budget": 1, "threshold": None, "compress": "k", "kv_bits": 4, "kv_residual": 0}
    )
    assert method == "lorc" and config == LorcConfig(kv_budget=1.0, compress="k")
    assert storage == QuantSpec(bits=4, group=64, residual=0)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"method": "slim", "max_v_eror": 0.1}, "unknown key 'max_v_eror'"),
        ({"method": "slim", "max_v_error": "big"}, "'max_v_error' must be float"),
        ({"method": "slim", "max_v_error": -1.0}, "max_v_error must be > 0"),
        ({"method": "slim", "accept_v_error": 1}, "'accept_v_error' must be bool"),
        ({"method": "slim", "force": True}, "unknown key 'force'"),
        ({"method": "nope"}, "unknown method 'nope'"),
        ({"method": "lorc", "kv_budget": 0.5, "schedule": "steep"}, "'schedule' must be one of 'progressive'"),
        ({"method": "lorc", "kv_budget": 0.5, "threshold": "high"}, "'threshold' must be float or null"),
        ({"method": "lorc"}, "kv_budget"),
        (["slim"], "a recipe is a mapping"),
        ({"method": "slim", "kv_bits": 5}, "kv bits must be one of"),
        ({"method": "slim", "kv_group": "big"}, "'kv_group' must be int"),
        ({"method": "quant", "kv_bits": 4, "kv_value_bits": 16}, "kv value bits .* are 8, 4, 3 or 2"),
        ({"method": "quant", "kv_bits": 3, "kv_value_bits": 2, "kv_layout": "token"}, "token layout is 4-bit"),
        ({"method": "quant", "kv_format": "fp8", "kv_value_bits": 4}, "--kv-value-bits"),
    ],
)
def test_recipe_errors_name_key_and_file(data, message):
    with pytest.raises(KVConvertError, match=message) as info:
        parse_recipe(data, "r.yaml")
    assert str(info.value).startswith("r.yaml: ") and "\n" not in str(info.value)


def test_a_width_for_sliding_window_layers_quantizes_them():
    """``kv_local_bits`` implies ``kv_include_local`` and survives the runtime spec's round trip; said together with
    ``kv_include_local: false`` it is a one-line error naming the file."""
    _, _, storage = parse_recipe({"method": "quant", "kv_bits": 3, "kv_local_bits": 4}, "r.yaml")
    assert storage.include_local and storage.local_bits == 4 and storage.for_local().bits == 4 and storage.bits == 3
    assert QuantSpec.from_spec({"kv_quant": storage.to_spec()}) == storage
    with pytest.raises(KVConvertError, match="r.yaml: kv local bits"):
        parse_recipe({"method": "quant", "kv_bits": 3, "kv_local_bits": 4, "kv_include_local": False}, "r.yaml")
