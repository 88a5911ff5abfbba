"""kvconvert: offline conversion of causal LMs into checkpoints with a smaller KV cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__version__ = "0.1.0"


def load(path: str | Path, **kwargs: Any) -> Any:
    """Load a kvconvert output directory with the installed runtime (no remote code is executed).

    Equivalent to ``AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`` but uses
    ``kvconvert.runtime`` from this package instead of the ``.py`` files shipped in ``path``.
    """
    from kvconvert.runtime.modeling_kvconvert import KVConvertForCausalLM

    if not Path(path).expanduser().exists():
        # a Hub id: fetched (or found in the cache) as the CLI fetches sources, so that offline it fails at
        # once with one clear line instead of transformers' retries, and no .py file is downloaded
        from kvconvert.io.source import hub_snapshot

        path = hub_snapshot(str(path), kwargs.pop("revision", None))
    return KVConvertForCausalLM.from_pretrained(str(path), **kwargs)


__all__ = ["__version__", "load"]
