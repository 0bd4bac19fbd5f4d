"""A DeepSeek-V4.1 DSpark draft launches DeepSeek-V4's DSpark kernels with V4.1's values: the draft read from the text
model's fields (``text_config``), its 32-token SWA pages, the plan on CUDA and ROCm (and nothing without DSpark), the
non-causal rows over 32-token pages against the reference under Triton's interpreter, and V4's draft unchanged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from warmreg_deepseek_v4.dspark import V41_SWA_PAGE_SIZE, DSparkDraft, dspark_swa_index_width
from warmreg_deepseek_v4.dspark_inputs import DSparkInputs
from warmreg_deepseek_v4.dspark_swa_indices import DSparkSwaIndices, dspark_swa_indices_reference
from warmreg_deepseek_v4.model import DSV4

import warmreg
from warmreg.ops import block_table_width
from warmreg.testing import config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
INPUTS, ROWS = DSparkInputs.name, DSparkSwaIndices.name


def _config(text: dict[str, Any] | None = None, **serving: Any) -> dict[str, Any]:
    """The V4.1 example as a DSpark deployment (3 draft tokens unless ``serving`` says otherwise)."""
    config = example_config("deepseek_v41")
    config["model"]["text_config"].update(text or {})
    config["serving"].update({"speculative_method": "dspark", "num_speculative_tokens": 3, **serving})
    return config


def _draft(config: dict[str, Any]) -> DSparkDraft | None:
    cfg = warmreg.WarmConfig.load(config)
    return DSparkDraft.from_config(cfg, DSV4.from_config(cfg))


def test_the_draft_reads_the_text_model() -> None:
    """The example's text model: window 128, one MTP layer (``n_mtp_layers`` unset: ``num_nextn_predict_layers``),
    the noise id of ``dspark_noise_token_id``, 32-token pages; a ``mask_token_id`` wins, ``n_mtp_layers`` wins."""
    d = _draft(_config())
    assert d is not None
    assert (d.num_tokens, d.num_query_per_req, d.sample_from_anchor) == (3, 3, True)
    assert (d.window, d.index_width, d.swa_block_size, d.ratios) == (128, 192, V41_SWA_PAGE_SIZE, (1,))
    assert d.noise_token_id == 128799
    d = _draft(_config({"mask_token_id": 7, "n_mtp_layers": 3, "sample_from_anchor": False}))
    assert d is not None and (d.noise_token_id, d.ratios, d.num_query_per_req) == (7, (1, 1, 1), 4)


def test_the_block_size_defaults_to_the_text_models() -> None:
    """``num_speculative_tokens`` unset: the text model's ``dspark_block_size`` (V4 reads the top level)."""
    config = _config({"dspark_block_size": 5})
    del config["serving"]["num_speculative_tokens"]
    d = _draft(config)
    assert d is not None and (d.num_tokens, d.index_width) == (5, dspark_swa_index_width(128, 5))
    config["model"]["text_config"].pop("dspark_block_size")
    with pytest.raises(warmreg.ConfigError, match="dspark_block_size"):
        _draft(config)


def test_a_draft_without_a_noise_token_is_refused() -> None:
    """vLLM's ``get_parallel_drafting_token_id`` raises without one; warmreg names the text model's field."""
    config = _config()
    config["model"]["text_config"].pop("dspark_noise_token_id")
    with pytest.raises(warmreg.ConfigError, match=r"text\.dspark_noise_token_id"):
        _draft(config)


def test_deepseek_v4_keeps_its_draft() -> None:
    """DeepSeek-V4's DSpark example: top-level fields, 3 draft layers by default, 64-token pages."""
    d = _draft(example_config("deepseek_v4_flash_0731_dspark"))
    assert d is not None
    assert (d.num_tokens, d.noise_token_id, d.ratios) == (5, 128799, (1, 1, 1))
    assert (d.swa_block_size, d.index_width) == (64, 192)


@pytest.mark.parametrize("target", ["cuda:90", "cuda:100", "rocm:gfx942"])
def test_plan_with_dspark(target: str) -> None:
    """Both kernels are planned on every platform (ROCm's builder falls back to the shared one), one key each: the
    V4.1 values in the speculator's key (32-token pages, the SWA table of ``cdiv(max_model_len, 32)`` columns)."""
    serving = {"attention_backend": "ROCM_FLASHMLA_SPARSE_DSV41"} if target.startswith("rocm") else {}
    plan = warmreg.plan(_config(**serving), target=target)
    names = {k.name for k in plan.kernels}
    assert {INPUTS, ROWS} <= names
    (rows,) = plan.kernel(ROWS).keys
    assert (rows.window_size, rows.index_width, rows.block_size) == ("div16", "div16", "div16")
    keys = plan.kernel(INPUTS).keys
    assert {k.kv_block_size for k in keys} == {warmreg.int_class(32)}
    assert {k.num_query_per_req for k in keys} == {warmreg.int_class(3)}
    assert {k.noise_token_id for k in keys} == {warmreg.int_class(128799)}
    width = block_table_width(plan.config.serving["max_model_len"], V41_SWA_PAGE_SIZE, 1)
    assert {k.block_table_stride for k in keys} == {warmreg.int_class(width)}


@pytest.mark.parametrize("method", [None, "mtp"])
def test_nothing_planned_without_dspark(method: str | None) -> None:
    config = example_config("deepseek_v41")
    if method:
        config["serving"]["speculative_method"] = method
    names = {k.name for k in warmreg.plan(config, target="cuda:100").kernels}
    assert not {INPUTS, ROWS} & names


def test_domains_use_the_32_token_pages() -> None:
    """The speculator's domains: block size 32 and the SWA table of 32-token pages; the rows' domain the same page."""
    plan = warmreg.plan(_config(), target="cuda:90")
    cfg = plan.config
    d = _draft(_config())
    assert d is not None
    dom = DSparkInputs(draft=d).domains(cfg, plan.platform)
    assert list(dom["block_size"]) == [32]
    (table,) = dom["block_table"]
    assert table.shape[1] == block_table_width(cfg.serving["max_model_len"], 32, 1)
    rows = DSparkSwaIndices(window=d.window, index_width=d.index_width, block_size=d.swa_block_size)
    assert list(rows.domains(cfg, plan.platform)["block_size"]) == [32]


@pytest.mark.parametrize("prefix", [0, 31, 32, 129, 5000])
def test_rows_over_32_token_pages(prefix: int) -> None:
    """The non-causal rows over V4.1's 32-token pages equal the reference: two requests of three draft tokens."""
    gen = torch.Generator().manual_seed(prefix)
    qlen, seqs = 3, [prefix + 3, 40 + 3]
    table = torch.randint(1, 1 << 20, (2, max(seqs) // 32 + 1), generator=gen, dtype=torch.int32)
    qsl = torch.arange(3, dtype=torch.int32) * qlen
    req = torch.arange(2, dtype=torch.int32).repeat_interleave(qlen)
    valid = torch.ones(6, dtype=torch.bool)
    valid[4] = False
    args = (qsl, torch.tensor(seqs, dtype=torch.int32), req, valid, table)
    kw: dict[str, Any] = dict(num_tokens=6, window_size=128, index_width=192, block_size=32)
    got, want = DSparkSwaIndices()(*args, **kw), dspark_swa_indices_reference(*args, **kw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    length = min(prefix, 128) + 3
    p = torch.arange(max(prefix - 128, 0), max(prefix - 128, 0) + length)
    assert torch.equal(got[0][0, :length].long(), table[0].long()[p // 32] * 32 + p % 32)
    assert got[1][4] == 0 and bool((got[0][4] == -1).all())
