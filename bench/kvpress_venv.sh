#!/usr/bin/env bash
# make bench-longctx's kvpress virtualenv: kvpress 0.5.5 pins transformers < 5.3, so it cannot share kvconvert's
# environment. Torch first, pinned as kvconvert's (an unpinned one pulls GBs of CUDA wheels).
set -u
VENV=${1:?usage: kvpress_venv.sh VENV}
KVPRESS=kvpress==0.5.5
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import kvpress" 2>/dev/null; then
  exit 0
fi
python3 -m venv "$VENV" || { echo "bench-longctx: could not create the virtualenv $VENV"; exit 1; }
"$VENV/bin/pip" install -q torch==2.13.0 >/dev/null 2>&1 \
  || { echo "bench-longctx: could not install torch==2.13.0 (is PyPI reachable?)"; exit 1; }
"$VENV/bin/pip" install -q "$KVPRESS" >/dev/null 2>&1 \
  || { echo "bench-longctx: could not install $KVPRESS (is PyPI reachable?)"; exit 1; }
"$VENV/bin/python" -c "import kvpress" 2>/dev/null || { echo "bench-longctx: $KVPRESS installed but does not import"; exit 1; }
