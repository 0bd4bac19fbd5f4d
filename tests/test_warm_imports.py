"""Warm must not pull heavy imports into a serving process.

A meta tensor's ``torch.empty_like`` runs PyTorch's Python reference, which imports sympy: 1.4 to
2.6 s in a fresh process without bytecode (measured on the H200 host), most of a warm from a warm
cache. This runs the planning and every key's launch code of the example configs, exactly as warm
does (with the compile step left out), in a fresh interpreter where importing sympy fails loudly.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import sys, traceback

class _NoSympy:
    def find_spec(self, name, path=None, target=None):
        if name == "sympy" or name.startswith("sympy."):
            traceback.print_stack(limit=14)
            raise ImportError("warm imported sympy")

sys.meta_path.insert(0, _NoSympy())
import warmreg
from warmreg.kernel import WARM_SESSION

class Capture:
    def capture(self, kernel, spec):
        return spec.outputs

count = 0
for config in sys.argv[1:]:
    plan = warmreg.plan(config, target="cuda:90")
    token = WARM_SESSION.set(Capture())
    try:
        for kp, key in plan.items():
            kp.kernel_for(key).launch_for_warm(key)
            count += 1
    finally:
        WARM_SESSION.reset(token)
assert "sympy" not in sys.modules
print("keys", count)
"""


def test_warm_launch_code_of_the_examples_imports_no_sympy() -> None:
    configs = [str(ROOT / "examples" / f"{name}.json") for name in ("deepseek_v4_flash", "deepseek_v4_pro", "kimi_k3")]
    out = subprocess.run([sys.executable, "-c", _CHILD, *configs], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["keys", "135"]
