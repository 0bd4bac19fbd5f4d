#!/usr/bin/env bash
# The two serving engines' real config classes, each in its own venv (their pins clash: transformers,
# xgrammar, compressed-tensors, tokenizers), built as shared/notes/engine-configs.md found works on a
# CPU-only machine: vLLM 0.33.0 (VllmConfig) and SGLang 0.5.23 (ServerArgs), on torch 2.14.1 (the build
# that lies on disk; it runs on CPU). Each venv is about 6 GB; vLLM's takes about 4 min, SGLang's about 3.
#
# Usage: bash scripts/engine-envs.sh COMMAND [ENGINE ...]        ENGINE: vllm, sglang (default: both)
#   build   make DIR/ENGINE (kept if already built) with the engine, pytest, and this checkout
#           installed editable without dependencies (warmreg, both plugins, integrations/ENGINE)
#   test    build, then run tests/engines in each venv: the config and integration tests
#           (test_ENGINE.py, test_ENGINE_integration.py: the engine loads warmreg's plugin itself), then, in a
#           process of their own, the differential kernel tests (test_ENGINE_kernels*.py: the engine's own
#           Triton kernels against warmreg's ops under Triton's interpreter)
#   record  build, then write tests/engines/snapshots/ENGINE*.json from the real objects
#           (scripts/record_engine_snapshots.py), the data tests/test_engine_configs.py reads
# DIR is $WARMREG_ENGINE_VENVS, default build/engine-venvs/ in this checkout (git-ignored as build/); CI keeps
# it outside the clone so a later run reuses it. A venv is rebuilt when its package lists below change (their
# hash is kept in DIR/ENGINE/.built).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
cmd=${1:-}
[ $# -gt 0 ] && shift
engines=("$@")
[ ${#engines[@]} -gt 0 ] || engines=(vllm sglang)
root=${WARMREG_ENGINE_VENVS:-$repo/build/engine-venvs}
PY=${PYTHON:-python3}
case "$cmd" in build|test|record) ;; *) sed -n '2,14p' "$0"; exit 2 ;; esac

# Exactly the modules that importing the engine and building its config asked for (one
# ModuleNotFoundError at a time), with the engine's own pins (the notes).
vllm_deps=(packaging pydantic regex numpy cbor2 psutil pyzmq urllib3 aiohttp requests openai
  msgspec cloudpickle pillow pybase64 cachetools uvloop py-cpuinfo prometheus_client partial_json_parser einops
  "transformers==5.20.2" "oss-harmony>=0.0.11" "xgrammar==0.2.8" "fastapi>=0.133.0,<0.137.0"
  "llguidance>=1.7.0,<1.8.0" "compressed-tensors==0.17.0" "apache-tvm-ffi==0.1.11")
sglang_deps=(numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic
  pyzmq tqdm IPython aiohttp torchvision dill gguf "apache-tvm-ffi==0.1.11" "sentencepiece==0.2.1"
  "compressed-tensors==0.18.0" "transformers==5.19.0" "tokenizers==0.23.2"
  "openai==2.8.0" partial-json-parser einops  # these three: DSPARK speculation's resolution
  fastapi "uvicorn>=0.51")  # these two: importing the model runner, whose methods warmreg-sglang hooks

build() {  # ENGINE
    local e=$1 venv="$root/$1" start=$SECONDS stamp
    stamp=$(printf '%s\n' "$e" "${vllm_deps[@]}" "${sglang_deps[@]}" "$(declare -f build)" | sha256sum | cut -c1-16)
    if [ "$(cat "$venv/.built" 2>/dev/null)" = "$stamp" ]; then
        echo "== $e: $venv (already built)"
    else
        echo "== $e: building $venv"
        rm -rf "$venv"
        "$PY" -m venv "$venv"
        local pip=("$venv/bin/pip" install -q)
        # pip warns about each engine requirement left out (flashinfer, sgl-kernel, ...), about vLLM's
        # torch==2.14.0 pin and warmreg's triton pin; none of them stops the config from building.
        "${pip[@]}" torch==2.14.1
        if [ "$e" = vllm ]; then
            "${pip[@]}" --no-deps vllm==0.33.0
            "${pip[@]}" "${vllm_deps[@]}"
        else
            "${pip[@]}" --no-deps sglang==0.5.23
            "${pip[@]}" "${sglang_deps[@]}"
        fi
        "${pip[@]}" attrs pluggy rich typing-extensions numpy "pytest>=8"
        echo "$stamp" > "$venv/.built"
    fi
    # warmreg from this checkout, every time (cheap): --no-deps keeps the engine's transformers pin; the engine's
    # own integration (integrations/ENGINE: its plugin entry point) too.
    "$venv/bin/pip" install -q --no-deps -e "$repo" -e "$repo/plugins/deepseek_v4" -e "$repo/plugins/kimi_k3" \
        -e "$repo/integrations/$e"
    echo "== $e: ready in $((SECONDS - start)) s"
}

engine_env() {  # ENGINE: the environment the engine needs on a CPU-only machine
    # vLLM detects no platform without it ("RuntimeError: Device string must not be empty").
    if [ "$1" = vllm ]; then echo VLLM_TARGET_DEVICE=cpu; else echo WARMREG_ENGINE=sglang; fi
}

status=0
for e in "${engines[@]}"; do
    case "$e" in vllm|sglang) ;; *) echo "unknown engine: $e (vllm, sglang)"; exit 2 ;; esac
    build "$e"
    py="$root/$e/bin/python"
    case "$cmd" in
        test)
            start=$SECONDS
            env "$(engine_env "$e")" "$py" -m pytest -q -p no:cacheprovider "tests/engines/test_$e.py" \
                "tests/engines/test_${e}_integration.py" || status=1
            kernels=(tests/engines/test_"$e"_kernels*.py)
            if [ -e "${kernels[0]}" ]; then  # own process: they set TRITON_INTERPRET before the engine imports
                env "$(engine_env "$e")" "$py" -m pytest -q -p no:cacheprovider "${kernels[@]}" || status=1
            fi
            echo "== $e: tests in $((SECONDS - start)) s"
            ;;
        record)
            # From /: a folder holding a warmreg/ directory would shadow the editable install (the notes).
            (cd / && env "$(engine_env "$e")" "$py" "$repo/scripts/record_engine_snapshots.py" "$e" \
                "$repo/tests/engines/snapshots") || status=1
            ;;
    esac
done
exit $status
