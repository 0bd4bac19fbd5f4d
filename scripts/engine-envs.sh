#!/usr/bin/env bash
# The serving engines' real config classes and kernels, each in its own venv (their pins clash: transformers,
# xgrammar, compressed-tensors, tokenizers), built as shared/notes/engine-configs.md found works on a
# CPU-only machine: vLLM 0.33.0 and 0.34.0 (VllmConfig) and SGLang 0.5.23 (ServerArgs), on torch 2.14.1 (the
# build that lies on disk; it runs on CPU). Each venv is about 6 GB; vLLM's takes about 4 min, SGLang's about 3.
#
# Usage: bash scripts/engine-envs.sh COMMAND [ENGINE ...]
#   ENGINE: vllm (0.33.0), vllm-0.34 (0.34.0), sglang (0.5.23); default: all three
#   build   make DIR/ENGINE (kept if already built) with the engine, pytest, and this checkout
#           installed editable without dependencies (warmreg, both plugins, integrations/ENGINE)
#   prepare the part of build that takes minutes (the venv, the engine and its packages, vLLM's kernel DSLs) and
#           not this checkout, so that it can run beside something that has this checkout's C extension loaded
#           (CI runs it beside the suite; reinstalling the checkout rebuilds that extension in place)
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
[ ${#engines[@]} -gt 0 ] || engines=(vllm vllm-0.34 sglang)
root=${WARMREG_ENGINE_VENVS:-$repo/build/engine-venvs}
PY=${PYTHON:-python3}
case "$cmd" in prepare|build|test|record) ;; *) sed -n '2,17p' "$0"; exit 2 ;; esac

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
    stamp=$(printf '%s\n' "$e" "$(release "$e")" "${vllm_deps[@]}" "${sglang_deps[@]}" "$(declare -f build)" | sha256sum | cut -c1-16)
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
        if [ "$(family "$e")" = vllm ]; then
            "${pip[@]}" --no-deps "$(release "$e")"
            "${pip[@]}" "${vllm_deps[@]}"
        else
            "${pip[@]}" --no-deps "$(release "$e")"
            "${pip[@]}" "${sglang_deps[@]}"
        fi
        "${pip[@]}" attrs pluggy rich typing-extensions numpy "pytest>=8"
        echo "$stamp" > "$venv/.built"
    fi
    [ "$cmd" != prepare ] || return 0
    # warmreg from this checkout, every time (cheap): --no-deps keeps the engine's transformers pin; the engine's
    # own integration (integrations/ENGINE: its plugin entry point) too.
    "$venv/bin/pip" install -q --no-deps -e "$repo" -e "$repo/plugins/deepseek_v4" -e "$repo/plugins/kimi_k3" \
        -e "$repo/integrations/$(family "$e")"
    # pytest-xdist: the engine tests run one worker per core (each file on one worker)
    "$venv/bin/python" -c "import xdist" 2>/dev/null || "$venv/bin/pip" install -q "pytest-xdist>=3"
    echo "== $e: ready in $((SECONDS - start)) s"
}

vllm_dsls() {  # ENGINE: the kernel DSLs vLLM's wheel requires, at vLLM's own pins, in a vLLM venv (idempotent)
    # TileLang, CuTeDSL (nvidia-cutlass-dsl[cu13]) and quack-kernels, read from vLLM's metadata
    # (importlib.metadata.requires("vllm")): on CUDA vLLM registers its CuTeDSL and TileLang kernels only where
    # they import, so warmreg_vllm.registry_keys needs them to see the GPU's registrations (issue 38). About
    # 25 s and 0.8 GB per venv (z3-solver, ml-dtypes, torch-c-dlpack-ext, protobuf come with them). Its own stamp,
    # so adding it did not rebuild the venvs.
    local venv="$root/$1" reqs stamp
    [ "$(family "$1")" = vllm ] || return 0
    reqs=$("$venv/bin/python" -c 'import importlib.metadata as m, re
names = {"tilelang", "nvidia-cutlass-dsl", "quack-kernels"}
print("\n".join(r for r in m.requires("vllm") if ";" not in r and re.split(r"[\[=<>!~ ]", r)[0] in names))')
    stamp=$(printf '%s\n' "$reqs" | sha256sum | cut -c1-16)
    [ "$(cat "$venv/.dsls" 2>/dev/null)" = "$stamp" ] && return 0
    echo "== $1: vLLM's kernel DSLs: $(echo $reqs)"
    # shellcheck disable=SC2086  # one requirement per word
    "$venv/bin/pip" install -q $reqs
    echo "$stamp" > "$venv/.dsls"
}

release() {  # ENGINE: the pinned release
    case "$1" in vllm) echo vllm==0.33.0 ;; vllm-0.34) echo vllm==0.34.0 ;; sglang) echo sglang==0.5.23 ;; esac
}

family() {  # ENGINE: vllm or sglang (the tests' and the integration's name)
    echo "${1%%-*}"
}

engine_env() {  # ENGINE: the environment the engine needs on a CPU-only machine (words for env)
    # vLLM detects no platform without VLLM_TARGET_DEVICE ("RuntimeError: Device string must not be empty"), and
    # keeps Triton on without a GPU driver only with CUDA_VISIBLE_DEVICES set and empty (vllm/triton_utils/
    # importing.py: its distributed-start case): 0.34's CPU platform refuses to start without Triton, and with
    # Triton 0.33 picks the model runner a GPU host does (V2).
    if [ "$(family "$1")" = vllm ]; then echo "VLLM_TARGET_DEVICE=cpu CUDA_VISIBLE_DEVICES="; else echo WARMREG_ENGINE=sglang; fi
}

status=0
for e in "${engines[@]}"; do
    case "$e" in vllm|vllm-0.34|sglang) ;; *) echo "unknown engine: $e (vllm, vllm-0.34, sglang)"; exit 2 ;; esac
    build "$e"
    vllm_dsls "$e"
    py="$root/$e/bin/python"
    case "$cmd" in
        test)
            start=$SECONDS
            f=$(family "$e")
            env $(engine_env "$e") "$py" -m pytest -q -p no:cacheprovider -n auto --dist loadfile "tests/engines/test_$f.py" \
                "tests/engines/test_${f}_integration.py" $([ "$e" != vllm-0.34 ] || echo tests/engines/test_vllm_coverage_source.py) \
                $([ "$f" != vllm ] || echo tests/engines/test_vllm_registry_keys.py tests/engines/test_vllm_pack.py tests/engines/test_vllm_kimi_k3_pack.py) || status=1
            # The differential kernel tests: test_vllm_kernels*.py against vLLM 0.33's kernels,
            # test_vllm034_kernels*.py against 0.34's (the kernels 0.34 added or changed).
            kernels=(tests/engines/test_"${e//[-.]/}"_kernels*.py)
            if [ -e "${kernels[0]}" ]; then  # own process: they set TRITON_INTERPRET before the engine imports
                env $(engine_env "$e") "$py" -m pytest -q -p no:cacheprovider -n auto --dist loadfile "${kernels[@]}" || status=1
            fi
            echo "== $e: tests in $((SECONDS - start)) s"
            ;;
        record)
            [ "$e" != vllm-0.34 ] || { echo "record: the snapshots are of vllm (0.33.0) and sglang"; exit 2; }
            # From /: a folder holding a warmreg/ directory would shadow the editable install (the notes).
            (cd / && env $(engine_env "$e") "$py" "$repo/scripts/record_engine_snapshots.py" "$e" \
                "$repo/tests/engines/snapshots") || status=1
            ;;
    esac
done
exit $status
