"""Everything a slim conversion does except converting: imports, config, shard index.

``python -m bench._import_floor SRC``: the RSS floor that bench/slim_bench.py compares against.
"""

import sys

import kvconvert.cli  # noqa: F401
import kvconvert.methods.slim  # noqa: F401
import kvconvert.pipeline  # noqa: F401
from kvconvert.io.source import open_source

open_source(sys.argv[1]).tensor_names()
