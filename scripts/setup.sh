#!/usr/bin/env bash
# Installs warmreg, both model-family plugins and the test tools into the current Python.
# Keeps a torch that is already installed (a GPU build); otherwise takes torch 2.13 (CPU).
# Pins Triton 3.6.0, the release warmreg's Triton adapter is checked against. transformers is the
# test extra that builds WarmConfig from a real DeepseekV4Config.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q "torch==2.13.0"
fi
if ! "$PY" -c "import sys, triton; sys.exit(triton.__version__ != '3.6.0')" 2>/dev/null; then
    "$PY" -m pip install -q "triton==3.6.0"
fi
"$PY" -m pip install -q "attrs>=23.1" "pluggy>=1.3" "typing-extensions>=4.8" "rich>=13" "pytest>=8" "setuptools>=68" "transformers>=5.23"
"$PY" -m pip install -q --no-build-isolation --no-deps -e . -e plugins/deepseek_v4 -e plugins/kimi_k3
