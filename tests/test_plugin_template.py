"""The plugin template: small (its code besides the kernel within :data:`MAX_CODE_LINES`), and installed like a
published plugin: in a fresh virtual environment, found by warmreg through its entry point, planned and
cross-compiled through the ``warmreg`` command line.

The venv sees this interpreter's site-packages (``tests.helpers.venv_beside``, also when this
interpreter is itself a venv) so that torch, Triton, warmreg (and pytest) come from there: nothing is
downloaded, the test runs offline, and the only thing the venv adds is the template itself, installed with pip exactly as a user would install a
``warmreg-<family>`` distribution (``--no-build-isolation --no-deps``: no index is consulted, the
system setuptools builds the wheel). pip itself also comes from the system site (``--without-pip``
saves the seconds ``ensurepip`` takes); run as ``<venv>/bin/python -m pip`` it installs into the
venv, whose prefix is the running interpreter's.
"""

from __future__ import annotations

import ast
import io
import json
import os
import shutil
import subprocess
import tokenize
from pathlib import Path

import pytest

from tests.helpers import venv_beside

TEMPLATE = Path(__file__).resolve().parents[1] / "examples" / "plugin_template"
KERNEL = "warmreg_template.scaled_add.ScaledAdd"
#: The template's code lines besides its ``@triton.jit`` kernel (issue 39: fewer than vLLM's seed design needs).
MAX_CODE_LINES = 55
CONFIG = {
    "model": {"model_type": "template_llm", "hidden_size": 256},
    "serving": {"max_num_batched_tokens": 128, "dtype": "bfloat16"},
}


def code_lines(source: str) -> int:
    """Lines holding code: not blank, not only a comment, not part of a docstring, not in a ``@triton.jit``
    function (the kernel, decorator included)."""
    skip: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node):
            doc = node.body[0]
            skip.update(range(doc.lineno, (doc.end_lineno or doc.lineno) + 1))
        if isinstance(node, ast.FunctionDef) and any(_is_jit(d) for d in node.decorator_list):
            skip.update(range(min(d.lineno for d in node.decorator_list), (node.end_lineno or node.lineno) + 1))
    layout = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in layout:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines - skip)


def _is_jit(decorator: ast.expr) -> bool:
    """``@triton.jit`` or ``@triton.jit(...)``."""
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(target, ast.Attribute) and target.attr == "jit" and isinstance(target.value, ast.Name) and target.value.id == "triton"


def test_code_lines_count_code_only() -> None:
    source = '''"""Module docstring."""
import triton


@triton.jit(do_not_specialize=["n"])
def _kernel(x_ptr, n):
    tl.store(x_ptr, n)


def f(x):  # a comment
    """A docstring
    on two lines."""
    # only a comment

    return (x +
            1)
'''
    assert code_lines(source) == 4  # the import, def f, and the return's two lines


def test_the_template_is_small() -> None:
    counts = {p.name: code_lines(p.read_text()) for p in sorted((TEMPLATE / "warmreg_template").glob("*.py"))}
    assert "scaled_add.py" in counts and sum(counts.values()) <= MAX_CODE_LINES, (
        f"the template has {sum(counts.values())} code lines besides its kernel {counts}: at most {MAX_CODE_LINES}"
    )


def _run(python: Path, *args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(python), *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.mark.slow
def test_template_installs_plans_and_warms_through_the_cli(tmp_path: Path) -> None:
    python = venv_beside(tmp_path / "venv")
    source = tmp_path / "plugin_template"  # build from a copy: pip leaves build/ and *.egg-info behind
    shutil.copytree(TEMPLATE, source, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton-cache"), "PIP_NO_INDEX": "1"}
    env.pop("PYTHONPATH", None)

    pip_install = ("-m", "pip", "install", "--quiet", "--no-build-isolation", "--no-deps")
    _run(python, *pip_install, str(source), env=env, cwd=tmp_path)
    config = tmp_path / "template_llm.json"
    config.write_text(json.dumps(CONFIG))

    cli = ("-m", "warmreg")
    plan = json.loads(
        _run(python, *cli, "plan", str(config), "--target", "cuda:90", "--json", env=env, cwd=tmp_path).stdout
    )
    assert "template" in plan["plugins"]
    (kernel,) = [k for k in plan["kernels"] if k["name"] == KERNEL]
    assert kernel["plugins"] == ["template"]
    planned = [key["fields"] for key in kernel["keys"]]
    assert planned == [
        {
            "dtype": "bfloat16", "y_dtype": "bfloat16", "hidden": 256, "block_size": 1024, "y_row_stride": "div16",
            "x_aligned": True, "y_aligned": True, "num_warps": 4,
        }
    ]  # fmt: skip

    report_path = tmp_path / "report.json"
    warm_args = ("warm", str(config), "--target", "cuda:90", "--workers", "1", "--quiet", "--json", str(report_path))
    _run(python, *cli, *warm_args, env=env, cwd=tmp_path)
    report = json.loads(report_path.read_text())
    results = [r for r in report["results"] if r["kernel"] == KERNEL]
    assert [r["key"]["fields"] for r in results] == planned
    assert all(r["status"] == "compiled" and not r["error"] for r in results), results

    # The template's own tests (reference under the interpreter, coverage, warm) pass where it is installed.
    _run(python, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(source / "tests"), env=env, cwd=source)
