#!/bin/bash
# One prepared GPU session (at most 570 s on an H200): the codes-reading kernels' launch shapes swept on
# Llama-3-8B's attention (bench/kernel_sweep.py), then static caches decoded eagerly, through captured CUDA graphs and
# compiled (bench/kernels_bench.py --graphs --compiled) against the original with the best launch, then the kernels'
# GPU tests. Results
# and logs go to $OUT (or /tmp/kvconvert-gpu-check when OUT is unset): eight files, as many as the device tool
# brings back.
#
# The device image's transformers may be older than kvconvert's pin: carry the wheel (from the repository root, here)
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .whl transformers==5.23.0
# and run `bash bench/gpu_check.sh` there, the wheel folder travelling with the tree. SWEEP_S, BENCH_S and TEST_S
# bound the sweep, the end-to-end bench and the tests (seconds; 0: skip that part); SHAPES picks the end-to-end context:batch pairs,
# ONLY the conversions, SWEEP_KERNELS the kernels whose launches are swept (default kivi; fp8,kivi both), COMPILED
# the runs also decoded compiled by Inductor and captured (run labels, comma-separated; empty: none; each compile
# took 13-65 s on an H200), STATIC_TESTS=1 also the static caches' GPU tests, TESTS other pytest arguments instead of the
# kernels' tests, QUICK=1 one launch per kernel in the sweep, GROWING=" " the growing caches' eager rows too, KERNEL_PATHS_ONLY=1 the conversions with a kernel timed
# with it alone. The defaults' timeouts sum to 570 s (30 + 180 + 280 + 80), under
# the device tool's 600 s a call with the wheel's install: give it timeout_s=600.
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
# is SDPA exact in float32 here (the fp8 static test's open mismatch on an H200, docs/gpu.md)? seconds
timeout 30 python3 bench/sdpa_precision.py 2>&1 | tee -a "$OUT/env.txt"
start=$(date +%s)
if [ "${SWEEP_S:-180}" != 0 ]; then  # SWEEP_S=0: no sweep (the kernels' module launches)
  # shellcheck disable=SC2086
  timeout "${SWEEP_S:-180}" python3 bench/kernel_sweep.py --shapes 16:8192,1:32768 --kernels "${SWEEP_KERNELS:-kivi}" \
    ${QUICK:+--quick} --copy-to "$OUT" > "$OUT/bench.log" 2>&1
  echo "sweep rc=$? $(( $(date +%s) - start )) s" | tee -a "$OUT/env.txt"
  grep "^|" "$OUT/bench.log" | head -12
fi
launch=()
[ -s "$OUT/best-launch.json" ] && launch=(--launch "$OUT/best-launch.json") && cat "$OUT/best-launch.json"
start=$(date +%s)
[ "${BENCH_S:-280}" = 0 ] || timeout "${BENCH_S:-280}" python3 bench/kernels_bench.py --contexts 8192 --batches 16 --shapes "${SHAPES:-8192:16,32768:1}" \
  --graphs ${GROWING:---no-growing} --no-probe --serving none --steps 16 --only "${ONLY:-quant fp8,quant 4-bit KIVI}" \
  --compiled "${COMPILED-quant 4-bit KIVI [Triton kernels]}" "${launch[@]}" ${KERNEL_PATHS_ONLY:+--kernel-paths-only} \
  --copy-to "$OUT" >> "$OUT/bench.log" 2>&1
echo "bench rc=$? $(( $(date +%s) - start )) s" | tee -a "$OUT/env.txt"
grep "^|" "$OUT/bench.log" | tail -24
[ "${TEST_S:-80}" = 0 ] && exit 0  # TEST_S=0: no tests
start=$(date +%s)
if [ -n "${TESTS:-}" ]; then  # TESTS: these pytest arguments instead of the kernels' default selection below
  # shellcheck disable=SC2086
  timeout "${TEST_S:-80}" python3 -m pytest -q -x -p no:cacheprovider $TESTS > "$OUT/tests.log" 2>&1
  echo "tests ($TESTS) rc=$? $(( $(date +%s) - start )) s" | tee -a "$OUT/env.txt"
  tail -5 "$OUT/tests.log"
  exit 0
fi
# first whether generate's compiled static steps take the KIVI kernel (a run of its own: pytest runs tests in file
# order, and in one run with the others it came after 48 parametrisations of the kernel's test, past the time), then
# the KIVI and fp8 kernels natively in the time left (the first failure stops them: their parametrisations each
# compile); the static caches' GPU tests with STATIC_TESTS=1
timeout "${TEST_S:-80}" python3 -m pytest -q -p no:cacheprovider -k "generate_compiles" tests/test_kernels.py \
  > "$OUT/tests.log" 2>&1
echo "generate-compiles test rc=$? $(( $(date +%s) - start )) s" | tee -a "$OUT/env.txt"
left=$(( ${TEST_S:-80} - ($(date +%s) - start) ))
[ "$left" -gt 5 ] && timeout "$left" python3 -m pytest -q -x -p no:cacheprovider \
  -k "kivi_decode_matches or kivi_kernel_reads or fp8_decode" tests/test_kernels.py >> "$OUT/tests.log" 2>&1
echo "kernel tests rc=$? $(( $(date +%s) - start )) s" | tee -a "$OUT/env.txt"
tail -3 "$OUT/tests.log"
[ "${STATIC_TESTS:-0}" = 1 ] || exit 0
start=$(date +%s)
timeout "${TEST_S:-80}" python3 -m pytest -q -p no:cacheprovider -k "gpu or cuda_graph or fp8" tests/test_static_cache.py \
  >> "$OUT/tests.log" 2>&1
echo "static-cache tests rc=$? $(( $(date +%s) - start )) s" | tee -a "$OUT/env.txt"
tail -3 "$OUT/tests.log"
