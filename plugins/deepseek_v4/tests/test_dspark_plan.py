"""A DeepSeek-V4 deployment with DSpark (examples/deepseek_v4_flash_0731_dspark.json) through the whole plugin:
the switch, the default draft length, what the draft step adds to the plan on each target and what it drops (the
MTP norms), and the config errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from warmreg_deepseek_v4 import plugin
from warmreg_deepseek_v4.dspark import DSparkDraft, num_speculative_tokens
from warmreg_deepseek_v4.model import DSV4

import warmreg
from warmreg.testing import config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)

#: FlashInfer's DeepSeek-V4 backend with a cache it takes on SM10x (per-tensor FP8 rows)
FLASHINFER = {"attention_backend": "FLASHINFER_MLA_SPARSE_DSV4", "kv_cache_dtype": "fp8"}

DSPARK = "deepseek_v4_flash_0731_dspark"
SPARK = {"deepseek_v4.dspark_noncausal_swa_indices": 1, "deepseek_v4.prepare_dspark_inputs": 6}
MTP = {"deepseek_v4.mtp_input_rmsnorm", "deepseek_v4.mtp_shared_head_rmsnorm"}


def _keys(config: Any, target: str) -> dict[str, int]:
    plan = warmreg.plan(config, target=target, plugins=[plugin], entry_points=False)
    return {kp.name: len(kp.keys) for kp in plan.kernels}


def test_the_example_reads_as_a_dspark_draft() -> None:
    cfg = warmreg.WarmConfig.load(example_config(DSPARK))
    draft = DSparkDraft.from_config(cfg, DSV4.from_config(cfg))
    assert draft == DSparkDraft(
        num_tokens=5, num_query_per_req=5, sample_from_anchor=True, noise_token_id=128799, ratios=(1, 1, 1),
        window=128, index_width=192,
    )  # fmt: skip
    assert num_speculative_tokens(cfg) == 5  # unset in the example: dspark_block_size


@pytest.mark.parametrize(
    ("target", "total"), [("cuda:90", 80), ("cuda:100", 79), ("rocm:gfx942", 111), ("rocm:gfx950", 121), ("xpu:pvc", 80)]
)
def test_plan_on_each_target(target: str, total: int) -> None:
    """The DSpark kernels on every target; no MTP norms (the MTP layers do not draft); the target step's 1 + 5
    decode rows widen the uniform-decode flattening (D 1..6) exactly as num_speculative_tokens 5 would."""
    got = _keys(example_config(DSPARK), target)
    assert {n: got[n] for n in SPARK} == SPARK and not MTP & set(got)
    assert sum(got.values()) == total
    as_mtp = _keys(example_config(DSPARK, speculative_method="mtp", num_speculative_tokens=5), target)
    # XPU's sparse MLA attention also runs the draft's non-causal rows: one width more than under MTP
    widened = {"deepseek_v4.xpu_sparse_mla"} & set(got)
    assert all(got[n] == as_mtp[n] + 1 for n in widened)
    assert {n: v for n, v in got.items() if n not in set(SPARK) | widened} == {n: v for n, v in as_mtp.items() if n not in MTP | widened}


def test_flashinfer_plans_the_draft_rows() -> None:
    got = _keys(example_config(DSPARK, **FLASHINFER), "cuda:100")
    mtp = _keys(example_config("deepseek_v4_flash", **FLASHINFER), "cuda:100")
    assert got["deepseek_v4.flashinfer_mixed_sparse_indices"] == mtp["deepseek_v4.flashinfer_mixed_sparse_indices"] + 1


@pytest.mark.parametrize(("method", "mtp"), [("mtp", True), (None, True), ("eagle", False), ("ngram", False)])
def test_mtp_norms_only_when_the_mtp_layers_draft(method: str | None, mtp: bool) -> None:
    config = example_config("deepseek_v4_flash")
    config["serving"].pop("speculative_method")
    if method:
        config["serving"]["speculative_method"] = method
    got = _keys(config, "cuda:90")
    assert (MTP <= set(got)) == mtp and not set(SPARK) & set(got)


def test_draft_layers_plan_as_vllm_builds_them() -> None:
    """The draft layers are SWA-only whatever compress_ratios lists past num_hidden_layers (vLLM's
    DeepseekV4Attention): a real DeepseekV4Config's 43 + 1 entries plan what the legacy 46-entry list plans."""
    full = example_config(DSPARK)
    short = example_config(DSPARK)
    short["model"]["compress_ratios"] = short["model"]["compress_ratios"][:44]
    compressed = example_config(DSPARK)
    compressed["model"]["compress_ratios"] = [*compressed["model"]["compress_ratios"][:43], 4, 128, 4]

    def keys(config: Any) -> set[tuple[str, Any]]:
        plan = warmreg.plan(config, target="cuda:90", plugins=[plugin], entry_points=False)
        return {(kp.name, key) for kp, key in plan.items()}

    assert keys(short) == keys(full) == keys(compressed)
    cfg = warmreg.WarmConfig.load(compressed)
    draft = DSparkDraft.from_config(cfg, DSV4.from_config(cfg))
    assert draft is not None and draft.ratios == (1, 1, 1)


def test_config_errors() -> None:
    with pytest.raises(warmreg.ConfigError, match=r"speculative_method.*accepted: mtp, dspark"):
        _keys(example_config(DSPARK, speculative_method="medusa"), "cuda:90")
    config = example_config(DSPARK)
    del config["model"]["dspark_block_size"]
    with pytest.raises(warmreg.ConfigError, match="dspark_block_size"):
        _keys(config, "cuda:90")
    assert "deepseek_v4.prepare_dspark_inputs" in _keys(example_config(DSPARK, num_speculative_tokens=3), "cuda:90")
    config = example_config(DSPARK)
    del config["model"]["dspark_noise_token_id"]
    with pytest.raises(warmreg.ConfigError, match="dspark_noise_token_id"):
        _keys(config, "cuda:90")
