#!/bin/bash
# One prepared GPU session (about 9 minutes on an H200): static caches decoded eagerly and through
# captured CUDA graphs against the original (bench/kernels_bench.py --graphs), then the GPU-only tests. Results and
# logs go to $OUT (or /tmp/kvconvert-gpu-check when OUT is unset).
#
# The device image's transformers may be older than kvconvert's pin: carry the wheel (from the repository root, here)
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .whl transformers==5.23.0
# and run `bash bench/gpu_check.sh` there, the wheel folder travelling with the tree. BENCH_S and TEST_S bound the
# bench and each test file (seconds), SHAPES picks the context:batch pairs.
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/kvconvert-gpu-check}
mkdir -p "$OUT"
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/env.txt"
python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)" \
  | tee -a "$OUT/env.txt"
start=$(date +%s)
timeout "${BENCH_S:-330}" python3 bench/kernels_bench.py --contexts 8192 --batches 16 --shapes "${SHAPES:-8192:16,32768:1}" \
  --graphs --no-growing --serving none --steps 16 --copy-to "$OUT" > "$OUT/bench.log" 2>&1
echo "bench rc=$? $(( $(date +%s) - start )) s" | tee -a "$OUT/env.txt"
grep -v "^{'kernel'" "$OUT/bench.log" | grep "^|" | tail -45
start=$(date +%s)
timeout "${TEST_S:-100}" python3 -m pytest -q -p no:cacheprovider tests/test_static_cache.py -k "gpu or cuda_graph" \
  > "$OUT/tests-static.log" 2>&1
echo "static-cache tests rc=$? $(( $(date +%s) - start )) s" | tee -a "$OUT/env.txt"
tail -3 "$OUT/tests-static.log"
start=$(date +%s)
timeout "${TEST_S:-100}" python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py > "$OUT/tests-kernels.log" 2>&1
echo "kernel tests rc=$? $(( $(date +%s) - start )) s" | tee -a "$OUT/env.txt"
tail -3 "$OUT/tests-kernels.log"
