"""Bad configs and targets: one WarmregError naming the field and the fix; CLI exit 2, one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import warmreg

ROOT = Path(__file__).resolve().parents[2]
FLASH = json.loads((ROOT / "examples" / "deepseek_v4_flash.json").read_text())


def _flash(**changes: Any) -> dict[str, Any]:
    cfg = json.loads(json.dumps(FLASH))
    for dotted, value in changes.items():
        section, name = dotted.split("__")
        if value is None:
            cfg[section].pop(name, None)
        else:
            cfg[section][name] = value
    return cfg


CASES = {
    "missing model field": (_flash(model__q_lora_rank=None), "model.q_lora_rank"),
    "wrong type": (_flash(model__head_dim="512"), "model.head_dim"),
    "zero limit": (_flash(serving__max_num_seqs=0), "serving.max_num_seqs"),
    "negative limit": (_flash(serving__max_model_len=-1), "serving.max_model_len"),
    "missing serving limit": (_flash(serving__max_num_batched_tokens=None), "serving.max_num_batched_tokens"),
    "unknown model type": (_flash(model__model_type="llama_9"), "model.model_type"),
    "unknown attention backend": (_flash(serving__attention_backend="FLASH_ATTN"), "serving.attention_backend"),
    "unknown serving setting": (_flash(serving__max_batch=8), "serving.max_batch"),
    "bad compress ratio": (_flash(model__compress_ratios=[0, 3, 4]), "model.compress_ratios[1]"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_config_is_one_error_naming_the_field(case: str) -> None:
    """a bad config (missing field, wrong type, zero/negative limit, unknown model or backend) is one WarmregError naming the field and the fix"""
    cfg, field = CASES[case]
    with pytest.raises(warmreg.ConfigError) as info:
        warmreg.plan(cfg, target="cuda:90")
    assert info.value.field == field
    assert "fix:" in str(info.value)


@pytest.mark.parametrize("target", ["cuda", "sm90", "cuda:sm_90", "rocm:942", "tpu:v5"])
def test_unparsable_target(target: str) -> None:
    """a target string that does not parse is one TargetError listing the accepted forms"""
    with pytest.raises(warmreg.TargetError, match=r"fix: write (backend:arch, )?e\.g\.") as info:
        warmreg.plan(FLASH, target=target)
    assert info.value.target == target


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["plan", "{bad}", "--target", "cuda:90"], "serving.max_num_seqs"),
        (["warm", "{bad}", "--target", "cuda:90"], "serving.max_num_seqs"),
        (["plan", "{missing}"], "does not exist"),
        (["plan", str(ROOT / "examples" / "deepseek_v4_flash.json"), "--target", "gpu:90"], "does not parse"),
    ],
)
def test_cli_prints_one_line_and_exits_2(args: list[str], needle: str, tmp_path: Path) -> None:
    """the CLI answers bad input with exit code 2 and one readable line, no traceback"""
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_flash(serving__max_num_seqs=0)))
    argv = [a.format(bad=bad, missing=tmp_path / "nope.json") for a in args]
    done = subprocess.run([sys.executable, "-m", "warmreg", *argv], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in done.stderr
