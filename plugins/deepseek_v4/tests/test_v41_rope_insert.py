"""DeepSeek-V4.1's compressed-cache insert: every record decoded against the PyTorch RoPE reference under Triton's
interpreter, the record choice, errors, the plan and cross-compiles. (Bit equality with vLLM's kernels is
``tests/engines/test_vllm034_kernels_dsv41_cache.py``.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from warmreg_deepseek_v4 import v41_rope_insert
from warmreg_deepseek_v4._mxfp4 import E2M1_GRID
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.v41_rope_insert import V41RopeInsert, v41_rope_reference

import warmreg
from warmreg.testing import OpCall, RegisterPlugin, assert_warmup_inputs_reproduce

NAME = V41RopeInsert.name
I64 = torch.int64
BS = 8
SLOTS = torch.tensor([0, 5, -1, 9, 15, 2, 12], dtype=I64)
POSITIONS = torch.tensor([1, 3, 5, 6, 9, 11, 100], dtype=I64)


def v41_config(ratios: list[int] | None = None, **serving: Any) -> dict[str, Any]:
    """(As in test_v41_compress.py.) A small DeepSeek-V4.1 config (vLLM's nested form): four layers, compressors on layers 1..3."""
    text = {
        "hidden_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 64, "head_dim": 512,
        "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8, "index_n_heads": 64, "index_head_dim": 128,
        "index_topk": 512, "sliding_window": 128, "rms_norm_eps": 1e-6, "num_nextn_predict_layers": 1,
        "compress_ratios": ratios if ratios is not None else [0, 2, 1, 2], "kv_source_layer_ids": [1, 2, 3],
        "index_source_layer_ids": [1], "max_position_embeddings": 4096,
    }  # fmt: skip
    settings = {"max_num_batched_tokens": 256, "max_num_seqs": 8, "max_model_len": 4096, "block_size": 256,
                "attention_backend": "FLASHMLA_SPARSE_DSV41", **serving}  # fmt: skip
    return {"model": {"model_type": "deepseek_v41", "text_config": text}, "serving": settings}


def _inputs(width: int, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    angles = torch.rand(128, 32, generator=g) * 6.3
    cache = torch.zeros(2, BS * width + 32, dtype=torch.uint8).as_strided((2, BS, width), (BS * width + 32, width, 1))
    return {
        "latent": (torch.randn(8, 512, generator=g) * 3).to(torch.bfloat16),
        "positions": POSITIONS,
        "cos_sin_cache": torch.cat([angles.cos(), angles.sin()], dim=1),
        "kv_cache": cache if dtype == torch.uint8 else torch.zeros(2, BS, 512, dtype=dtype),
        "slot_mapping": SLOTS,
    }


def _live(ratio: int) -> list[tuple[int, int]]:
    """(token, slot) of the tokens that write: a slot, and a group end."""
    return [(t, int(s)) for t, (s, p) in enumerate(zip(SLOTS, POSITIONS)) if s >= 0 and (int(p) + 1) % ratio == 0]


def _e4m3(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float8_e4m3fn).float()


def _codes_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """e4m3fn bytes equal up to Triton 3.8's interpreter: it truncates fp32 to bf16 (a code may move by one) and
    drops the carry when fp32 -> e4m3fn rounds up into the next binade (code - 8 where the reference's mantissa is
    0). The GPU rounds both to nearest even; the differential test against vLLM's kernels is exact."""
    g, w = got.contiguous().view(torch.uint8).int(), want.contiguous().view(torch.uint8).int()
    carry = ((w & 0x7) == 0) & ((w & 0x7F) - (g & 0x7F) == 8)
    bad = ~(((g & 0x80) == (w & 0x80)) & (((g - w).abs() <= 1) | carry))
    assert not bad.any(), f"{int(bad.sum())} codes differ: got {g[bad][:8].tolist()}, want {w[bad][:8].tolist()}"


def _ue8m0_reference(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale bytes, e4m3 codes)`` of fp32 blocks ``[N, B]`` as the kernels' math has them, in PyTorch."""
    e = torch.ceil(torch.log2(blocks.abs().amax(1).clamp(min=1e-4) * (1.0 / 448.0)))
    q = (blocks * torch.exp2(-e)[:, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return (e + 127).clamp(0, 255).to(torch.uint8), q


@pytest.mark.parametrize("ratio", [1, 2])
def test_mxfp8_record(ratio: int) -> None:
    """528 bytes: 512 e4m3 values of the rotated row in 16 blocks of 32, then their UE8M0 scales."""
    a = _inputs(528, torch.uint8)
    V41RopeInsert()(**a, compress_ratio=ratio)
    y = v41_rope_reference(a["latent"], a["positions"], a["cos_sin_cache"], compress_ratio=ratio)
    live = _live(ratio)
    for t, s in live:
        rec = a["kv_cache"][s // BS, s % BS]
        scales, codes = _ue8m0_reference(y[t].view(16, 32))
        assert torch.equal(rec[512:], scales)
        _codes_close(rec[:512], codes.flatten())
    written = {s for _, s in live}
    for s in set(range(16)) - written:
        assert (a["kv_cache"][s // BS, s % BS] == 0).all()


def test_fp8_ds_mla_record() -> None:
    """584-byte pages: NoPE e4m3 of the unrotated latent (7 blocks of 64), bf16 RoPE, 8 scale bytes (last 0)."""
    a = _inputs(584, torch.uint8)
    V41RopeInsert()(**a, compress_ratio=2)
    y = v41_rope_reference(a["latent"], a["positions"], a["cos_sin_cache"], compress_ratio=2)
    for t, s in _live(2):
        page = a["kv_cache"].as_strided((2, BS * 584 + 32), (BS * 584 + 32, 1))[s // BS]
        values, scales = page[(s % BS) * 576 :][:576], page[BS * 576 + (s % BS) * 8 :][:8]
        assert scales[7] == 0
        want_scales, codes = _ue8m0_reference(a["latent"][t].float().view(8, 64))
        assert torch.equal(scales[:7], want_scales[:7])
        _codes_close(values[:448], codes.flatten()[:448])
        rope = values[448:].contiguous().view(torch.bfloat16).float()
        torch.testing.assert_close(rope, y[t, 448:], atol=1e-5, rtol=2**-7)  # bf16 truncation: one ulp


def test_nvfp4_record() -> None:
    """288 bytes: e2m1 pairs (even dim in the low nibble) of 32 blocks of 16, then their e4m3 scales."""
    a = _inputs(288, torch.uint8)
    V41RopeInsert()(**a, compress_ratio=1)
    y = v41_rope_reference(a["latent"], a["positions"], a["cos_sin_cache"], compress_ratio=1)
    grid = torch.tensor(E2M1_GRID)
    for t, s in _live(1):
        rec = a["kv_cache"][s // BS, s % BS]
        nib = torch.stack([rec[:256] & 15, rec[:256] >> 4], dim=1).flatten().long()
        vals = grid[nib & 7] * torch.where(nib >= 8, -1.0, 1.0)
        scale = _e4m3(rec[256:]).repeat_interleave(16)
        # the largest e2m1 step is 2 (between 4 and 6): a value is within one step of its scale
        assert ((vals * scale - y[t]).abs() <= 2 * scale + 1e-6).all()
        amax = y[t].abs().view(32, 16).amax(1).repeat_interleave(16)
        torch.testing.assert_close(scale, amax / 6, rtol=2**-3, atol=2**-9)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_plain_rows(dtype: torch.dtype) -> None:
    a = _inputs(512, dtype)
    fp8 = dtype == torch.float8_e4m3fn
    scale = torch.tensor([0.02])
    V41RopeInsert()(**a, compress_ratio=2, fp8_scale=scale if fp8 else None)
    y = v41_rope_reference(a["latent"], a["positions"], a["cos_sin_cache"], compress_ratio=2)
    for t, s in _live(2):
        row = a["kv_cache"][s // BS, s % BS]
        if fp8:
            _codes_close(row, (y[t].bfloat16().float() / scale).clamp(-448.0, 448.0).to(dtype))
        else:  # bf16 truncation in the interpreter: one ulp
            torch.testing.assert_close(row.float(), y[t], rtol=2**-7, atol=1e-5)


def test_launch_errors() -> None:
    k, a = V41RopeInsert(), _inputs(528, torch.uint8)
    with pytest.raises(warmreg.LaunchError, match="kv_cache must be uint8"):
        k(**{**a, "kv_cache": torch.zeros(2, BS, 500, dtype=torch.uint8)}, compress_ratio=1)
    with pytest.raises(warmreg.LaunchError, match="fp8_scale"):
        k(**{**a, "kv_cache": torch.zeros(2, BS, 512, dtype=torch.float8_e4m3fn)}, compress_ratio=1)
    with pytest.raises(warmreg.LaunchError, match="latent must be contiguous bf16"):
        k(**{**a, "latent": a["latent"].float()}, compress_ratio=1)
    with pytest.raises(warmreg.LaunchError, match="compress_ratio must be 1 or 2"):
        k(**a, compress_ratio=4)


# -- the plan ---------------------------------------------------------------------------------------------------
def _plan(config: dict[str, Any], target: str) -> warmreg.Plan:
    plugin = RegisterPlugin(v41_rope_insert.register, model=DSV4.from_config)
    return warmreg.plan(config, target=target, plugins=[plugin], entry_points=False)


@pytest.mark.parametrize(
    ("target", "serving", "record"),
    [
        ("cuda:90", {}, "fp8_ds_mla"),
        ("cuda:100", {}, "mxfp8"),
        ("cuda:100", {"kv_cache_dtype": "nvfp4_ds_mla"}, "nvfp4"),
        ("cuda:100", {"attention_backend": "FLASHMLA_MEGA_ATTN_DSV41"}, "nvfp4"),
        ("cuda:100", {"attention_backend": "FLASHMLA_MEGA_ATTN_DSV41", "kv_cache_dtype": "fp8_ds_mla"}, "mxfp8"),
        ("cuda:100", {"attention_backend": "FLASHINFER_MLA_SPARSE_DSV41"}, "bfloat16"),
        ("cuda:100", {"attention_backend": "FLASHINFER_MLA_SPARSE_DSV41", "kv_cache_dtype": "fp8"}, "fp8"),
        ("cuda:120", {"attention_backend": "FLASHINFER_MLA_SPARSE_DSV41", "kv_cache_dtype": "fp8"}, "fp8_ds_mla"),
    ],
)
def test_plan_picks_the_record(target: str, serving: dict[str, str], record: str) -> None:
    keys = _plan(v41_config(**serving), target).kernel(NAME).keys
    assert sorted((k.record, k.compress_ratio) for k in keys) == [(record, 1), (record, 2)]


def test_refused_caches_and_nothing_planned_elsewhere() -> None:
    with pytest.raises(warmreg.ConfigError, match="nvfp4_ds_mla"):
        _plan(v41_config(kv_cache_dtype="nvfp4_ds_mla"), "cuda:90")
    with pytest.raises(warmreg.ConfigError, match="packed KV layouts take only fp8"):
        _plan(v41_config(kv_cache_dtype="bfloat16"), "cuda:90")
    assert NAME not in {k.name for k in _plan(v41_config([0, 0, 0, 0]), "cuda:90").kernels}
    assert NAME not in {k.name for k in _plan(v41_config(), "rocm:gfx942").kernels}


def test_runtime_calls_are_planned_and_warm() -> None:
    kp = _plan(v41_config(), "cuda:100").kernel(NAME)
    a = {k: warmreg.meta(tuple(v.shape), v.dtype) for k, v in _inputs(528, torch.uint8).items()}
    a["kv_cache"] = warmreg.meta((9, 128, 528), torch.uint8)
    for ratio in (1, 2):
        assert OpCall(kp.kernel, (), {**a, "compress_ratio": ratio}).launch_code().key in kp.keys
    assert_warmup_inputs_reproduce(kp.kernel, kp.keys)
    plugin = RegisterPlugin(v41_rope_insert.register, model=DSV4.from_config)
    for target, serving in (
        ("cuda:90", {}),
        ("cuda:100", {"attention_backend": "FLASHINFER_MLA_SPARSE_DSV41", "kv_cache_dtype": "fp8"}),
        ("cuda:100", {"kv_cache_dtype": "nvfp4_ds_mla"}),
    ):
        report = warmreg.warm(v41_config(**serving), target=target, plugins=[plugin], entry_points=False)
        assert report.ok and report.compiled == 2, [(r.kernel, r.error) for r in report.failed]
