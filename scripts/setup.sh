#!/usr/bin/env bash
# Installs warmreg, both model-family plugins and the test tools into the current Python ($PYTHON or
# python3), and says what it installs.
#
# An engine's environment is kept as it is: a torch that is already installed (a GPU build) stays, and
# so does an installed Triton of a supported release (3.6.x-3.9.x). Only where none is installed does
# it take torch 2.13 (CPU) and Triton 3.8.0, the release the current engines run (vLLM 0.33 and SGLang
# 0.5.23, through torch 2.14). TRITON=3.x.y picks another release for a fresh environment (CI's other
# releases use it). transformers is the test extra that builds WarmConfig from a real DeepseekV4Config.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEFAULT_TRITON=${TRITON:-3.8.0}
say() { printf 'setup: %s\n' "$*" >&2; }

if "$PY" -c "import torch" 2>/dev/null; then
    say "keeping torch $("$PY" -c 'import torch; print(torch.__version__)')"
else
    say "installing torch 2.13.0 (the package index's default build; the tests need no GPU)"
    "$PY" -m pip install -q "torch==2.13.0"
fi
installed=$("$PY" -c "import triton; print(triton.__version__)" 2>/dev/null || true)
case "$installed" in
    3.6.*|3.7.*|3.8.*|3.9.*)
        if [ -n "${TRITON:-}" ] && [ "$installed" != "$TRITON" ]; then
            say "installing Triton $TRITON (asked for; $installed was installed)"
            "$PY" -m pip install -q "triton==$TRITON"
        else
            say "keeping Triton $installed"
        fi ;;
    "")
        say "installing Triton $DEFAULT_TRITON"
        "$PY" -m pip install -q "triton==$DEFAULT_TRITON" ;;
    *)
        say "Triton $installed is outside 3.6-3.9: installing Triton $DEFAULT_TRITON"
        "$PY" -m pip install -q "triton==$DEFAULT_TRITON" ;;
esac
# transformers (the tests' DeepseekV4Config) only where none is installed: an engine pins its own
if "$PY" -c "import transformers" 2>/dev/null; then
    say "keeping transformers $("$PY" -c 'import transformers; print(transformers.__version__)')"
    transformers=()
else
    transformers=("transformers>=5.23")
fi
say "installing attrs, pluggy, rich, numpy and the test tools (pytest, pytest-xdist, build, setuptools ${transformers[*]:+, transformers})"
"$PY" -m pip install -q "attrs>=23.1" "pluggy>=1.3" "typing-extensions>=4.8" "rich>=13" "numpy>=1.24" \
    "pytest>=8" "pytest-xdist>=3.5" "setuptools>=70.1" "build>=1" ${transformers[@]+"${transformers[@]}"}
say "installing warmreg, warmreg-deepseek-v4 and warmreg-kimi-k3 (editable)"
"$PY" -m pip install -q --no-build-isolation --no-deps -e . -e plugins/deepseek_v4 -e plugins/kimi_k3
