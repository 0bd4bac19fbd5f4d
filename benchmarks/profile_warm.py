"""Where a warm from a warm disk cache spends its time (cProfile), on the local GPU.

Runs one cold warm in a subprocess to fill a fresh cache, then profiles a second warm from that
cache in another subprocess (CUDA context created before the timer, as in an engine).

    python benchmarks/profile_warm.py examples/deepseek_v4_flash.json > profile.txt
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

_CODE = """
import cProfile, pstats, sys, time, torch, warmreg
torch.empty(1, device="cuda")
prof = cProfile.Profile()
t = time.perf_counter()
prof.enable()
r = warmreg.warm({config!r}, progress=False)
prof.disable()
print(r.summary(), "wall", round(time.perf_counter() - t, 3), "plan", round(r.plan_seconds, 3))
pstats.Stats(prof, stream=sys.stdout).sort_stats("cumulative").print_stats(40)
pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(20)
"""


def main() -> None:
    config = sys.argv[1]
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache}
        subprocess.run([sys.executable, "-c", f"import warmreg; print(warmreg.warm({config!r}).summary())"], env=env, check=True)
        subprocess.run([sys.executable, "-c", _CODE.format(config=config)], env=env, check=True)


if __name__ == "__main__":
    main()
