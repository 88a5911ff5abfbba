"""``python -m bench._timed_conversion SRC DST [METHOD]``: a conversion (slim, or lorc --kv-budget 0.5
--schedule uniform) timed inside the process, after the imports and opening the source (start-up that
does not grow with the model); prints the seconds."""

import sys
import time
from pathlib import Path

from kvconvert.io.source import open_source
from kvconvert.methods.base import Method
from kvconvert.methods.lorc.method import LorcConfig, LorcMethod
from kvconvert.methods.slim.method import SlimMethod
from kvconvert.pipeline import convert

METHODS: dict[str, Method] = {"slim": SlimMethod(), "lorc": LorcMethod(LorcConfig(kv_budget=0.5, schedule="uniform"))}

source = open_source(sys.argv[1])
method = METHODS[sys.argv[3] if len(sys.argv) > 3 else "slim"]
start = time.perf_counter()
convert(source, method, Path(sys.argv[2]), progress=False)
print(f"{time.perf_counter() - start:.4f}")
