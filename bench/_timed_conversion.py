"""``python -m bench._timed_conversion SRC DST``: a slim conversion timed inside the process, after the
imports and opening the source (start-up that does not grow with the model); prints the seconds."""

import sys
import time
from pathlib import Path

from kvconvert.io.source import open_source
from kvconvert.methods.slim import SlimMethod
from kvconvert.pipeline import convert

source = open_source(sys.argv[1])
start = time.perf_counter()
convert(source, SlimMethod(), Path(sys.argv[2]), progress=False)
print(f"{time.perf_counter() - start:.4f}")
