"""DeepSeek-V4.1's compressor (state save + pooling + RMSNorm) and its PCP ring store: the PyTorch references under
Triton's interpreter, hand-picked pooling, errors, the plan, out=, and cross-compiles."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from warmreg_deepseek_v4 import v41_compress, v41_ring_rows
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.v41_compress import V41SaveCompressNorm, v41_save_compress_norm_reference
from warmreg_deepseek_v4.v41_ring_rows import V41SaveRingRows, v41_save_ring_rows_reference

import warmreg
from warmreg.testing import OpCall, RegisterPlugin, assert_warmup_inputs_reproduce, check_out

NAME = V41SaveCompressNorm.name
I32, I64 = torch.int32, torch.int64
EPS = 1e-6


def v41_config(ratios: list[int] | None = None, **serving: Any) -> dict[str, Any]:
    """A small DeepSeek-V4.1 config (vLLM's nested form): four layers, compressors on layers 1..3."""
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


def _step(capacity: int = 8, seed: int = 0) -> dict[str, Any]:
    """Three chunks (first positions odd, even, odd: a decode token) in ring blocks 1..3, then a padding row."""
    g = torch.Generator().manual_seed(seed)
    chunks = [(5, 6), (0, 3), (9, 1)]
    positions = torch.cat([torch.arange(p, p + n) for p, n in chunks] + [torch.zeros(1, dtype=I64)])
    qsl = torch.tensor([0, 6, 9, 10], dtype=I32)
    req = torch.tensor([0] * 6 + [1] * 3 + [2, 0], dtype=I32)
    slots = torch.where(
        torch.arange(11) < 10, torch.tensor([1, 2, 3])[req.long()] * capacity + positions % capacity, -1
    )
    return {
        "kv_score": torch.randn(11, 1024, generator=g),
        "positions": positions,
        "state_cache": torch.randn(4, capacity, 1024, generator=g),
        "slot_mapping": slots.to(I64),
        "query_start_loc": qsl,
        "token_to_req_indices": req,
        "norm_weight": (torch.rand(512, generator=g) + 0.5).to(torch.bfloat16),
    }


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    # the interpreter truncates fp32 -> bf16 where the reference rounds to nearest: one bf16 ulp (2**-7 relative)
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("capacity", [8, 16])
def test_ratio2_matches_reference(capacity: int) -> None:
    a = _step(capacity, capacity)
    ours, ref = {k: v.clone() for k, v in a.items()}, {k: v.clone() for k, v in a.items()}
    latent = V41SaveCompressNorm()(**{k: ours[k] for k in a}, eps=EPS, compress_ratio=2)
    want = torch.full_like(latent, 0.0)
    v41_save_compress_norm_reference(**{k: ref[k] for k in a}, eps=EPS, compress_ratio=2, latent=want)
    closing = [t for t in range(10) if int(a["positions"][t]) % 2 == 1]
    _close(latent[closing], want[closing])
    assert torch.equal(ours["state_cache"], ref["state_cache"])  # the ring tails, bitwise
    assert not torch.equal(ours["state_cache"], a["state_cache"])


def test_pooling_by_hand() -> None:
    """Equal scores average the two rows; a score gap of ln(3) weighs them 3:1; the chunk's first token pools with
    the ring row of the position before it."""
    cap = 8
    kv_score = torch.zeros(2, 1024)
    kv_score[0, :512], kv_score[1, :512] = 1.0, 5.0
    kv_score[1, 512:] = torch.log(torch.tensor(3.0))
    state = torch.zeros(2, cap, 1024)
    state[1, 2, :512] = 2.0  # position 2's row of the request in block 1
    positions = torch.tensor([3, 4], dtype=I64)  # token 0 closes (2, 3); token 1 opens a group
    slots = torch.tensor([1 * cap + 3, 1 * cap + 4], dtype=I64)
    latent = V41SaveCompressNorm()(
        kv_score, positions, state, slots, torch.tensor([0, 2], dtype=I32), torch.zeros(2, dtype=I32),
        torch.ones(512, dtype=torch.bfloat16), eps=0.0, compress_ratio=2,
    )  # fmt: skip
    assert torch.allclose(latent[0].float(), torch.ones(512))  # the mean 1.5 normalized: every dim 1
    assert torch.equal(state[1, 3], kv_score[0]) and torch.equal(state[1, 4], kv_score[1])
    kv_score = torch.stack([kv_score[1], kv_score[1]])
    kv_score[0, :512], kv_score[0, 512:] = -1.0, 0.0
    out = V41SaveCompressNorm()(
        kv_score, torch.tensor([4, 5], dtype=I64), state, slots, torch.tensor([0, 2], dtype=I32),
        torch.zeros(2, dtype=I32), torch.ones(512, dtype=torch.bfloat16), eps=0.0, compress_ratio=2,
    )  # fmt: skip
    assert torch.allclose(out[1].float(), torch.ones(512))  # (-1 * 1 + 5 * 3) / 4 = 3.5 > 0, normalized


def test_ratio1_and_offset_views() -> None:
    """Ratio 1: every slotted token is a group, no ring; kv_score may be a row slice of a larger output."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(12, 512, generator=g)
    slots = torch.tensor([3, -1, 9, 4, 0], dtype=I64)
    w = (torch.rand(512, generator=g) + 0.5).to(torch.bfloat16)
    got = V41SaveCompressNorm()(base[2:], torch.arange(10), None, slots, None, None, w, eps=EPS, compress_ratio=1)
    want = torch.zeros_like(got)
    v41_save_compress_norm_reference(
        base[2:], torch.arange(10), None, slots, None, None, w, eps=EPS, compress_ratio=1, latent=want
    )
    _close(got[[0, 2, 3, 4]], want[[0, 2, 3, 4]])


def test_launch_errors() -> None:
    a, k = _step(), V41SaveCompressNorm()
    with pytest.raises(warmreg.LaunchError, match="compress_ratio must be 1 or 2"):
        k(**a, eps=EPS, compress_ratio=4)
    with pytest.raises(warmreg.LaunchError, match="kv_score must be float32"):
        k(**{**a, "kv_score": a["kv_score"].half()}, eps=EPS, compress_ratio=2)
    with pytest.raises(warmreg.LaunchError, match="kv_score rows must be 64-byte aligned"):
        k(**{**a, "kv_score": torch.randn(11, 1032)[:, 4:1028]}, eps=EPS, compress_ratio=2)
    with pytest.raises(warmreg.LaunchError, match=r"slot_mapping must be a contiguous 1-D torch\.int64"):
        k(**{**a, "slot_mapping": a["slot_mapping"].int()}, eps=EPS, compress_ratio=2)
    with pytest.raises(warmreg.LaunchError, match="needs state_cache"):
        k(**{**a, "state_cache": None}, eps=EPS, compress_ratio=2)
    assert k(**{**a, "slot_mapping": a["slot_mapping"][:0]}, eps=EPS, compress_ratio=2).shape == (11, 512)


def test_ring_rows_match_reference() -> None:
    g = torch.Generator().manual_seed(5)
    rows, state = torch.randn(5, 1024, generator=g), torch.randn(3, 8, 1024, generator=g)
    slots = torch.tensor([9, -1, 17, 23, -1], dtype=I64)
    want = state.clone()
    v41_save_ring_rows_reference(rows, slots, want)
    assert V41SaveRingRows()(rows, slots, state) is state
    assert torch.equal(state, want)
    with pytest.raises(warmreg.LaunchError, match="power-of-two capacity"):
        V41SaveRingRows()(rows, slots, torch.zeros(3, 6, 1024))


# -- the plan ---------------------------------------------------------------------------------------------------
def _plan(config: dict[str, Any], target: str) -> warmreg.Plan:
    plugin = RegisterPlugin(v41_compress.register, model=DSV4.from_config)
    return warmreg.plan(config, target=target, plugins=[plugin], entry_points=False)


@pytest.mark.parametrize("target", ["cuda:90", "cuda:100"])
def test_plan_one_key_a_ratio(target: str) -> None:
    keys = _plan(v41_config(), target).kernel(NAME).keys
    assert sorted((k.compress_ratio, k.state_block) for k in keys) == [(1, 1), (2, 8)]
    assert all(not k.has_prev_rows and k.num_warps == 4 and not k.launch_pdl for k in keys)


def test_plan_ring_capacity_follows_drafts_and_nothing_elsewhere() -> None:
    keys = _plan(v41_config([0, 2, 0, 2], num_speculative_tokens=7), "cuda:90").kernel(NAME).keys
    assert [(k.compress_ratio, k.state_block) for k in keys] == [(2, 16)]
    assert NAME not in {k.name for k in _plan(v41_config([0, 0, 0, 0]), "cuda:90").kernels}
    assert NAME not in {k.name for k in _plan(v41_config(), "rocm:gfx942").kernels}


def test_plan_under_prefill_context_parallelism() -> None:
    """PCP: ratio 2 reads gathered rows and the ring store is planned; ratio 1 is unchanged."""
    config = v41_config(prefill_context_parallel_size=2)
    keys = _plan(config, "cuda:90").kernel(NAME).keys
    assert sorted((k.compress_ratio, k.has_prev_rows) for k in keys) == [(1, False), (2, True)]
    ring = RegisterPlugin(v41_ring_rows.register, model=DSV4.from_config)
    plan = warmreg.plan(config, target="cuda:90", plugins=[ring], entry_points=False)
    assert [k.state_block for k in plan.kernel(V41SaveRingRows.name).keys] == [8]
    plan = warmreg.plan(v41_config(), target="cuda:90", plugins=[ring], entry_points=False)
    assert V41SaveRingRows.name not in {k.name for k in plan.kernels}


def test_runtime_calls_are_planned() -> None:
    kp = _plan(v41_config(), "cuda:90").kernel(NAME)
    a = {k: (warmreg.meta(tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v) for k, v in _step().items()}
    for ratio in (1, 2):
        kv = warmreg.meta((64, 512 * ratio), torch.float32)
        call = OpCall(kp.kernel, (), {**a, "kv_score": kv, "eps": EPS, "compress_ratio": ratio})
        assert call.launch_code().key in kp.keys
    assert_warmup_inputs_reproduce(kp.kernel, kp.keys)


def test_warm_cross_compiles_for_cuda() -> None:
    plugin = RegisterPlugin(v41_compress.register, model=DSV4.from_config)
    for target in ("cuda:90", "cuda:100"):
        report = warmreg.warm(v41_config(), target=target, plugins=[plugin], entry_points=False)
        assert report.ok and report.compiled == 2, [(r.kernel, r.error) for r in report.failed]


def test_out() -> None:
    step = _step()
    closing = (step["positions"] % 2 == 1) & (step["slot_mapping"] >= 0)  # only group-closing rows are written

    def build() -> OpCall:
        return OpCall(
            V41SaveCompressNorm(), (), {**_step(), "eps": EPS, "compress_ratio": 2},
            masks=(closing[:, None].expand(11, 512),),
        )  # fmt: skip

    check_out(build)
