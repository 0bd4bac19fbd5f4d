#!/usr/bin/env bash
# The checks CI runs on the supported Triton releases other than the one the test environment has
# (README, "Supported versions"). For each VERSION (default: 3.6.0 3.7.1 3.9.0), in a virtual
# environment beside the current Python (it sees that Python's torch and test tools; only Triton
# differs):
#   1. the adapter tests and, on the first and the last VERSION given (the oldest and the newest
#      release), every kernel test under Triton's interpreter (plugins, shared ops), less those marked
#      slow (a whole plan's cross-compile is step 3's pack build here); ROCm cross-compiles are most of
#      the plugin tests' time (63% of it on 3.9.0), so the first release leaves out the gfx950 cases and
#      the last the ROCm files (*rocm*): every ROCm case still runs on the suite's release, gfx942's
#      also on the first; a release in between runs the adapter, fast-launch and shared-op tests (CI's
#      45-minute budget),
#   2. the README's main job: warm the DeepSeek-V4-Flash example for cuda:90 (0 failed keys),
#   3. a Kimi-K3 pack built and installed under that release: the next warm compiles 0 keys.
# Usage: bash scripts/other-tritons.sh [VERSION ...]     (WARMREG_VENVS=DIR keeps the venvs there)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(3.6.0 3.7.1 3.9.0)
# the venvs (about 0.8 GiB each) and each release's check folder go on exit, unless WARMREG_VENVS keeps the venvs
scratch=()
trap 'rm -rf "${scratch[@]}"' EXIT
if [ -n "${WARMREG_VENVS:-}" ]; then root=$WARMREG_VENVS; else root=$(mktemp -d -t warmreg-tritons-XXXX); scratch+=("$root"); fi
core=(tests/test_triton_adapter.py tests/test_deferred_launcher.py tests/test_fast_launch.py tests/test_qkv_rmsnorm.py tests/test_slot_mapping.py)
plugin_tests=(plugins/deepseek_v4/tests plugins/kimi_k3/tests)
status=0
for v in "${versions[@]}"; do
    venv="$root/triton-$v"
    printf '\n== Triton %s (%s)\n' "$v" "$venv"
    [ -x "$venv/bin/python" ] || "$PY" -m venv --system-site-packages "$venv"
    vpy="$venv/bin/python"
    PYTHON="$vpy" TRITON="$v" bash scripts/setup.sh
    "$vpy" -c "import triton, sys; sys.exit(triton.__version__ != '$v')" || { echo "Triton $v did not install"; exit 1; }
    work=$(mktemp -d -t warmreg-check-XXXX)
    scratch+=("$work")
    export TRITON_CACHE_DIR="$work/cache"
    tests=("${core[@]}")
    skip=()
    if [ "$v" = "${versions[0]}" ] || [ "$v" = "${versions[${#versions[@]}-1]}" ]; then tests+=("${plugin_tests[@]}"); fi
    if [ ${#versions[@]} -gt 1 ] && [ "$v" = "${versions[0]}" ]; then skip=(-k 'not gfx950'); fi
    if [ ${#versions[@]} -gt 1 ] && [ "$v" = "${versions[${#versions[@]}-1]}" ]; then skip=(--ignore-glob='*rocm*'); fi
    "$vpy" -m pytest -q -p no:cacheprovider -n auto --dist loadfile -m "not slow" "${skip[@]}" "${tests[@]}" || status=1
    "$vpy" -m warmreg warm examples/deepseek_v4_flash.json --target cuda:90 --json "$work/flash.json" || status=1
    "$vpy" -m warmreg build examples/kimi_k3.json --target cuda:90 -o "$work/kimi.tar.gz" || status=1
    TRITON_CACHE_DIR="$work/fresh" "$vpy" -m warmreg warm examples/kimi_k3.json --target cuda:90 --pack "$work/kimi.tar.gz" \
        --json "$work/kimi.json" || status=1
    "$vpy" - "$work" "$v" <<'PY' || status=1
import json, sys
work, version = sys.argv[1], sys.argv[2]
flash = json.load(open(f"{work}/flash.json"))
kimi = json.load(open(f"{work}/kimi.json"))
def count(report, status):
    return sum(1 for r in report["results"] if r["status"] == status)
ok = count(flash, "failed") == 0 and count(kimi, "compiled") == 0 and count(kimi, "failed") == 0 and kimi["triton_version"] == version
print(f"Triton {version}: Flash cross-warm {len(flash['results'])} keys, {count(flash, 'failed')} failed; "
      f"Kimi-K3 from its pack {len(kimi['results'])} keys, {count(kimi, 'compiled')} compiled: {'ok' if ok else 'FAILED'}")
sys.exit(0 if ok else 1)
PY
    rm -rf "$work"
    unset TRITON_CACHE_DIR
done
exit $status
