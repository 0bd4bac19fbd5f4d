"""DeepSeek-V4.1 as a model this plugin plans: the config reading (nested published form, vLLM's flat form), the
backend policy, and which keys examples/deepseek_v41.json plans for the first V4.1 ops on cuda:90 and cuda:100, with
engine-shaped calls through the launch code and real cross-compiles."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from warmreg_deepseek_v4 import v41_hc_expand, v41_pad_q, v41_q_norm_quant, v41_ring_slots
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.plugin import warmreg_model_types

import warmreg
from warmreg.testing import OpCall, RegisterPlugin, assert_warmup_inputs_reproduce, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
PAD, HC, RING, QNQ = (m.name for m in (v41_pad_q.PadInterleavedQ, v41_hc_expand.HcExpand,
                                      v41_ring_slots.RingSlotMapping, v41_q_norm_quant.QKVNormQuant))  # fmt: skip
NORM = "warmreg.ops.fused_qkv_rmsnorm"


def _v41(**serving: Any) -> dict[str, Any]:
    config = example_config("deepseek_v41")
    config["serving"].update(serving)
    return config


def _names(config: Any, target: str) -> set[str]:
    return {k.name for k in warmreg.plan(config, target=target).kernels}


# -- the model -------------------------------------------------------------------------------------------------------
def test_v41_is_served_and_read_from_text_config() -> None:
    assert "deepseek_v41" in warmreg_model_types()
    m = DSV4.from_config(warmreg.WarmConfig.load(EXAMPLES / "deepseek_v41.json"))
    assert m.v41 and (m.hidden_size, m.q_lora_rank, m.hc_mult, m.num_hidden_layers) == (5120, 1280, 4, 43)
    assert m.ratios[:3] == (0, 0, 2) and len(m.ratios) == 44 and m.ratios[-1] == 0  # the MTP layer past the list
    assert m.ratios[19:21] == (2, 1) and m.ratios[42] == 1  # ratio 2 up to layer 19, 1 from the candidate source 20
    assert m.v41_compressed_ratios == (1, 2) and not (m.has_c4 or m.has_c128)
    assert m.kv_source_layer_ids == (2, 8, 14, 20, 24, 28, 32, 36) and m.mxfp8_checkpoint and m.fp8_checkpoint
    assert (m.vision_n_layers, m.image_tokens) == (0, 0)


def test_vllm_flat_form_reads_the_same() -> None:
    """vLLM's ``DeepseekV41Config`` flattens text_config and writes vision_* fields: same values."""
    config = example_config("deepseek_v41")
    flat = {**config["model"].pop("text_config"), **config["model"], "vision_n_layers": 0, "vision_max_n_token": 1024}
    nested = DSV4.from_config(warmreg.WarmConfig.load(example_config("deepseek_v41")))
    assert DSV4.from_config(warmreg.WarmConfig.load({"model": flat, "serving": config["serving"]})) == nested


def test_v41_config_errors_name_the_field() -> None:
    config = example_config("deepseek_v41")
    config["model"]["text_config"]["compress_ratios"][5] = 4
    with pytest.raises(warmreg.ConfigError, match=r"text\.compress_ratios\[5\]"):
        warmreg.plan(config, target="cuda:90")
    with pytest.raises(warmreg.ConfigError, match=r"serving\.attention_backend"):
        warmreg.plan(_v41(attention_backend="FLASHINFER_MLA_SPARSE"), target="cuda:100")
    with pytest.raises(warmreg.ConfigError, match="FLASHMLA_MEGA_ATTN_DSV41, which needs sm_10x"):
        warmreg.plan(_v41(attention_backend="FLASHMLA_MEGA_ATTN_DSV41"), target="cuda:90")


# -- the plan of the first V4.1 ops ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("target", "fused"), [("cuda:90", False), ("cuda:100", True)])
def test_example_plans_the_norm_the_target_runs(target: str, fused: bool) -> None:
    """Hopper runs the MXFP8 linears on Marlin: the shared Q/KV RMSNorm; SM10x on FlashInfer: the fused query quant."""
    names = _names(EXAMPLES / "deepseek_v41.json", target)
    assert {HC, RING} <= names and PAD not in names  # FlashMLA's split-KV path: no interleaved Q
    assert (QNQ in names, NORM in names) == (fused, not fused)


def test_keys_of_the_example_on_cuda_100() -> None:
    plan = warmreg.plan(EXAMPLES / "deepseek_v41.json", target="cuda:100")
    (qnq,) = plan.kernel(QNQ).keys
    assert qnq.fields() == {
        "q_size": 1280, "kv_size": 512, "block": 2048, "dtype": "bfloat16", "q_stride": "div16", "kv_stride": "div16",
        "trigger_first": False, "launch_pdl": True, "num_warps": 8,
    }  # fmt: skip
    (hc,) = plan.kernel(HC).keys
    assert (hc.fields()["hidden"], hc.fields()["stride_m"], hc.fields()["numel"]) == (5120, 5120, "div16")
    (ring,) = plan.kernel(RING).keys
    assert ring.fields() == {"capacity": 8, "block": 256, "num_warps": 4}


def test_ring_size_follows_the_drafts_and_needs_ratio_2() -> None:
    (ring,) = warmreg.plan(_v41(num_speculative_tokens=7), target="cuda:90").kernel(RING).keys
    assert ring.fields()["capacity"] == 16
    config = example_config("deepseek_v41")
    config["model"]["text_config"]["compress_ratios"] = [0, 0] + [1] * 41
    assert RING not in _names(config, "cuda:90")


def test_pad_by_copy_at_tp2_on_mega_attention() -> None:
    """32 local heads padded to 64 with >= 2048 tokens a step: planned; TP 8 (8 heads) or a 1024-token budget: not."""
    mega = _v41(attention_backend="FLASHMLA_MEGA_ATTN_DSV41", tensor_parallel_size=2)
    (key,) = warmreg.plan(mega, target="cuda:100").kernel(PAD).keys
    assert key.fields() == {"live": 512, "pad": 512, "block_rows": 4, "dtype": "bfloat16", "rows": "div16", "num_warps": 4}
    assert PAD not in _names(_v41(attention_backend="FLASHMLA_MEGA_ATTN_DSV41"), "cuda:100")
    mega["serving"]["max_num_batched_tokens"] = 1024
    assert PAD not in _names(mega, "cuda:100")


def test_runtime_calls_are_planned() -> None:
    """vLLM's calls through the launch code on meta tensors: the fused projection's views, the embedding, the ring
    slot buffer prefix, the interleaved Q of a large eager step."""
    plan = warmreg.plan(EXAMPLES / "deepseek_v41.json", target="cuda:100")
    fused = warmreg.meta((8192, 1792), torch.bfloat16)
    for t in (1, 17, 8192):
        call = OpCall(plan.kernel(QNQ).kernel, (fused[:t, :1280], fused[:t, 1280:], warmreg.meta((1280,), torch.bfloat16),
                      warmreg.meta((512,), torch.bfloat16), 1e-6), {"launch_pdl": True})  # fmt: skip
        assert call.launch_code().key in plan.kernel(QNQ).keys
        call = OpCall(plan.kernel(HC).kernel, (warmreg.meta((t, 5120), torch.bfloat16), 4), {})
        assert call.launch_code().key in plan.kernel(HC).keys
        table, t2r, pos = warmreg.meta((256, 4096), torch.int32), warmreg.meta((8192,), torch.int32), warmreg.meta((t,), torch.int64)
        kwargs = {"num_actual_tokens": t, "num_tokens": t, "capacity": 8, "out": warmreg.meta((8192,), torch.int64)[:t]}
        assert OpCall(plan.kernel(RING).kernel, (table, t2r, pos), kwargs).launch_code().key in plan.kernel(RING).keys
    for name in (QNQ, HC, RING):
        assert_warmup_inputs_reproduce(plan.kernel(name).kernel, plan.kernel(name).keys)
    pad = warmreg.plan(_v41(attention_backend="FLASHMLA_MEGA_ATTN_DSV41", tensor_parallel_size=2), target="cuda:100")
    for t in (2048, 5000, 8192):
        q, out = warmreg.meta((t, 32, 512), torch.bfloat16), warmreg.meta((t, 64, 512), torch.bfloat16)
        assert OpCall(pad.kernel(PAD).kernel, (q, out), {}).launch_code().key in pad.kernel(PAD).keys
    assert_warmup_inputs_reproduce(pad.kernel(PAD).kernel, pad.kernel(PAD).keys)


@pytest.mark.parametrize("target", ["cuda:90", "cuda:100"])
def test_warm_cross_compiles(target: str) -> None:
    modules = (v41_hc_expand, v41_ring_slots, v41_q_norm_quant, v41_pad_q)
    plugins = [RegisterPlugin(m.register, model=DSV4.from_config) for m in modules]
    config = _v41(attention_backend="FLASHMLA_MEGA_ATTN_DSV41", tensor_parallel_size=2) if target == "cuda:100" else _v41()
    report = warmreg.warm(config, target=target, plugins=plugins, entry_points=False)
    assert report.ok and report.compiled == (4 if target == "cuda:100" else 2), [(r.kernel, r.error) for r in report.failed]
