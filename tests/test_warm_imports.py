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

_BLOCK = r"""
import sys, traceback

class _Blocked:
    def find_spec(self, name, path=None, target=None):
        if name == "{module}" or name.startswith("{module}."):
            traceback.print_stack(limit=20)
            raise ImportError("imported {module}")

sys.meta_path.insert(0, _Blocked())
"""

_CHILD = _BLOCK.format(module="sympy") + r"""
import warmreg
from warmreg.runtime.launch import WARM_SESSION

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
    import warmreg

    planned = sum(warmreg.plan(c, target="cuda:90").num_keys for c in configs)
    assert planned >= 135 and out.stdout.split() == ["keys", str(planned)]  # every key's launch code ran


_NO_TORCH = _BLOCK.format(module="torch") + r"""
from warmreg.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_the_cli_refuses_bad_input_without_importing_torch(tmp_path: Path) -> None:
    """torch's import alone takes 2 s on the 2-core machine: a bad config, target, output or cache
    directory, and a pack refused for what it is, answer without it (exit 2, one line)."""
    config = tmp_path / "c.json"
    config.write_text('{"model": {"model_type": "deepseek_v4"}, "serving": {"max_num_batched_tokens": 64, "max_model_len": 0}}')
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    example = str(ROOT / "examples" / "kimi_k3.json")
    cases = [
        (["plan", str(config), "--target", "cuda:90"], "serving.max_model_len", {}),
        (["warm", example, "--target", "cuda:9x"], "cuda:9x", {}),
        (["warm", example, "--target", "cuda:90", "--json", str(tmp_path / "missing" / "r.json")], "does not exist", {}),
        (["build", example, "--target", "cuda:90", "-o", str(not_a_dir / "p.tar.gz")], "not a directory", {}),
        (["pack", "verify", str(not_a_dir)], "pack", {}),
        (["pack", "install", str(not_a_dir)], "pack", {}),
        (["warm", example, "--target", "cuda:90"], "not a directory", {"TRITON_CACHE_DIR": str(not_a_dir)}),
    ]
    for argv, needle, env in cases:
        done = subprocess.run([sys.executable, "-c", _NO_TORCH, *argv], capture_output=True, text=True, timeout=120, cwd=ROOT,
                              env={**__import__("os").environ, **env})  # fmt: skip
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and needle in lines[0], (argv, done.stderr[-2000:])


def test_prefetch_returns_at_once_without_importing_torch_on_the_callers_thread() -> None:
    """An engine calls ``warmreg.prefetch()`` early, before it imports torch: the call itself imports no torch
    (it resolved through the module of ``warm``, which pulls the pipeline and torch in: 1.3 s on this machine);
    torch comes with the plugins, on the prefetch's own thread."""
    code = _BLOCK.format(module="torch").replace("class _Blocked:", "import threading\n\nclass _Blocked:").replace(
        'if name == "torch"', 'if threading.current_thread() is threading.main_thread() and name == "torch"'
    ) + "import warmreg\nwarmreg.prefetch()\nprint('returned', 'torch' in sys.modules)\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip().startswith("returned"), done.stderr[-2000:]
    assert "imported torch" not in done.stderr, done.stderr[-2000:]
