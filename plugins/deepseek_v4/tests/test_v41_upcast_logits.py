"""The indexer's BF16 logits upcast: against the PyTorch reference under Triton's interpreter (exact: bf16 -> fp32 is
exact), padded row strides, rows longer than the grid's splits, columns past each row's end left unwritten, empty
inputs, errors, ``out=``, and the plan of examples/deepseek_v41.json and the DeepSeek-V4 examples (sm_10x only)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from warmreg_deepseek_v4 import v41_upcast_logits
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.v41_upcast_logits import UpcastLogits, upcast_grid, upcast_logits_reference

import warmreg
from warmreg.testing import OpCall, RegisterPlugin, assert_warmup_inputs_reproduce, check_out, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
NAME = UpcastLogits.name


def _v41(**serving: Any) -> dict[str, Any]:
    config = example_config("deepseek_v41")
    config["serving"].update(serving)
    return config


def _inputs(seed: int, rows: int, width: int, pitch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, pitch, generator=g) * 5).bfloat16()[:, :width]
    ends = torch.randint(0, width + 1, (rows,), generator=g, dtype=torch.int32)
    return logits, ends


@pytest.mark.parametrize(("rows", "width", "pitch"), [(3, 2500, 2560), (1, 5000, 5000), (700, 40, 48)])
def test_matches_reference_and_leaves_the_tail(rows: int, width: int, pitch: int) -> None:
    """Three row tiles with a padded stride; one row of five tiles over 1024 // 1 splits; many short rows."""
    logits, ends = _inputs(rows + width, rows, width, pitch)
    ends[0] = width  # a full row
    out = torch.full((rows, pitch), 7777.0)[:, :width]
    got = UpcastLogits()(logits, ends, out=out)
    assert got is out and got.stride() == logits.stride()
    torch.testing.assert_close(got, upcast_logits_reference(logits, ends, fill=7777.0), rtol=0, atol=0)


def test_fresh_output_keeps_the_logits_strides() -> None:
    logits, ends = _inputs(1, 4, 100, 112)
    got = UpcastLogits()(logits, ends)
    assert got.dtype == torch.float32 and got.shape == (4, 100) and got.stride() == (112, 1)
    keep = torch.arange(100)[None, :] < ends.long()[:, None]
    assert torch.equal(got[keep], logits.float()[keep])


def test_grid_is_vllms() -> None:
    assert upcast_grid(1, 5000) == (1, 5)  # cdiv(5000, 1024) splits
    assert upcast_grid(3, 2500) == (3, 3)
    assert upcast_grid(700, 1 << 20) == (700, 1)  # 1024 // 700
    assert upcast_grid(16, 1 << 20) == (16, 64)
    assert upcast_grid(0, 10) is None and upcast_grid(4, 0) is None


def test_empty_inputs_launch_nothing() -> None:
    out = UpcastLogits()(torch.empty(0, 8, dtype=torch.bfloat16), torch.empty(0, dtype=torch.int32))
    assert out.shape == (0, 8) and out.dtype == torch.float32


def test_errors_name_the_argument() -> None:
    logits, ends = _inputs(2, 3, 64, 64)
    op = UpcastLogits()
    with pytest.raises(warmreg.LaunchError, match="logits must be bf16"):
        op(logits.float(), ends)
    with pytest.raises(warmreg.LaunchError, match="logits must be bf16"):
        op(logits.t(), ends)
    with pytest.raises(warmreg.LaunchError, match="row_ends must be a contiguous 1-D int32"):
        op(logits, ends.long())
    with pytest.raises(warmreg.LaunchError, match="row_ends must be a contiguous 1-D int32 tensor of 3"):
        op(logits, ends[:2])
    with pytest.raises(warmreg.LaunchError, match="logits' strides"):
        op(logits[:, :32], ends, out=torch.empty(3, 32))  # contiguous, but the logits' row stride is 64


def test_out() -> None:
    """Full rows (every column below its end), so that the whole buffer is written and compared."""

    def build() -> OpCall:
        logits, ends = _inputs(3, 5, 300, 300)
        return OpCall(UpcastLogits(), (logits, ends.fill_(300)), {})

    check_out(build)


# -- the plan ----------------------------------------------------------------------------------------------------------
def test_example_plans_one_key_on_sm100_only() -> None:
    plan = warmreg.plan(EXAMPLES / "deepseek_v41.json", target="cuda:100")
    (key,) = plan.kernel(NAME).keys
    assert key.fields() == {"logits_dtype": "bfloat16", "block": 1024, "num_warps": 4}
    assert_warmup_inputs_reproduce(plan.kernel(NAME).kernel, plan.kernel(NAME).keys)
    for rows, width, pitch in ((1, 1 << 19, 1 << 19), (8192, 3000, 3072), (7, 100, 1536)):  # prefill chunk, decode
        logits = warmreg.meta((rows, pitch), torch.bfloat16)[:, :width]
        call = OpCall(plan.kernel(NAME).kernel, (logits, warmreg.meta((rows + 3,), torch.int32)[3:]), {})
        assert call.launch_code().key in plan.kernel(NAME).keys  # an offset row_ends slice too
    for target in ("cuda:90", "cuda:120"):  # FP32 logits there: nothing to upcast
        assert NAME not in {k.name for k in warmreg.plan(EXAMPLES / "deepseek_v41.json", target=target).kernels}


def test_v41_without_indexers_plans_nothing() -> None:
    config = _v41()
    config["model"]["text_config"]["index_source_layer_ids"] = [0, 1]  # sliding-window layers: no indexer
    assert NAME not in {k.name for k in warmreg.plan(config, target="cuda:100").kernels}


@pytest.mark.parametrize("example", ["deepseek_v4_flash", "deepseek_v4_pro", "deepseek_v4_flash_0731_dspark"])
def test_deepseek_v4_c4_indexer_plans_one_key_on_sm10x(example: str) -> None:
    """DeepSeek-V4's C4 indexer runs the same ``sparse_attn_indexer``: BF16 logits on sm_10x, FP32 elsewhere."""
    for target in ("cuda:100", "cuda:103", "cuda:100+cutedsl"):
        plan = warmreg.plan(EXAMPLES / f"{example}.json", target=target)
        (key,) = plan.kernel(NAME).keys
        assert key.fields() == {"logits_dtype": "bfloat16", "block": 1024, "num_warps": 4}
    mxfp4 = warmreg.plan(example_config(example, indexer_kv_dtype="mxfp4"), target="cuda:100")
    assert len(mxfp4.kernel(NAME).keys) == 1  # the MXFP4 indexer cache scores through the same upcast
    for target in ("cuda:90", "cuda:120", "rocm:gfx942", "rocm:gfx950+aiter", "xpu:pvc"):
        assert NAME not in {k.name for k in warmreg.plan(EXAMPLES / f"{example}.json", target=target).kernels}
    config = example_config(example)
    config["model"]["compress_ratios"] = [0 if r == 4 else r for r in config["model"]["compress_ratios"]]
    assert NAME not in {k.name for k in warmreg.plan(config, target="cuda:100").kernels}  # no C4 layer: no indexer


def test_warm_cross_compiles() -> None:
    plugin = RegisterPlugin(v41_upcast_logits.register, model=DSV4.from_config)
    report = warmreg.warm(_v41(), target="cuda:100", plugins=[plugin], entry_points=False)
    assert report.ok and report.compiled == 1, [(r.kernel, r.error) for r in report.failed]
