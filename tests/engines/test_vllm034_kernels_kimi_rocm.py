"""Kimi-K3's ROCm ops against vLLM 0.34's own kernels (``vllm/models/kimi_k3/amd/``), on identical engine-shaped
inputs, under Triton's interpreter: the KDA metadata builder's device chunk metadata, the plain decode's packed
KDA step, the speculative (and mixed-batch plain-decode) KDA recurrent step and the attention residuals.

Runs in the vLLM 0.34 venv (``VLLM_TARGET_DEVICE=cpu CUDA_VISIBLE_DEVICES= build/engine-venvs/vllm-0.34/bin/python -m
pytest tests/engines/test_vllm034_kernels_kimi_rocm.py``); skips, naming why, elsewhere. Each test calls vLLM's
Python entry point as its call site does (``prepare_chunk_metadata_device(prefill_query_start_loc,
prefill_query_start_loc_cpu, FLA_CHUNK_SIZE)`` from ``KimiK3ROCmKDAMetadataBuilder._build_chunk_metadata``;
``fused_recurrent_kda_packed_decode(mixed_qkv=..., raw_g=..., raw_beta=..., A_log=..., dt_bias=..., lower_bound=...,
initial_state=..., state_indices=...)`` from ``KimiK3DeltaAttention._forward``'s pure non-speculative decode batch;
``fused_recurrent_kda(q, k, v, raw_g, raw_beta, A_log, dt_bias, lower_bound, initial_state, cu_seqlens,
ssm_state_indices, num_accepted_tokens, uniform_sequence_length, out)`` from its speculative and mixed-batch decode
paths;
``attn_res(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight, num_blocks, block_write_idx, eps,
output_norm_eps, quant_dtype=None)`` from ``amd/linear.py: _apply_attn_res`` of an unquantized checkpoint) and
warmreg's drop-in on clones of the same seeded tensors, then compares every buffer either side writes, bitwise:
the metadata are index kernels, and the decode step and the residual mix run the same fp32 operations in the same
order on both sides.
Nothing is patched.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# First: skips where vLLM is not installed, else sets TRITON_INTERPRET and CUDA_VISIBLE_DEVICES before any
# kernel module is imported.
from vllm_kernels import assert_same, clones, engine, seeded  # isort: skip

import pytest
import torch
import vllm

if not vllm.__version__.startswith("0.34"):
    pytest.skip(f"these compare vLLM 0.34's kernels; this venv has vLLM {vllm.__version__}", allow_module_level=True)

vllm_meta = engine("vllm.models.kimi_k3.amd.kda_metadata")
vllm_fr = engine("vllm.models.kimi_k3.amd.ops.third_party.kda.fused_recurrent")
vllm_attn_res = engine("vllm.models.kimi_k3.amd.ops.attn_res")
from warmreg_kimi_k3.attn_res import AttnRes  # noqa: E402
from warmreg_kimi_k3.backends import KDALayout  # noqa: E402
from warmreg_kimi_k3.kda_packed_decode import KDAPackedDecode  # noqa: E402
from warmreg_kimi_k3.rocm_chunk_metadata import ROCmChunkMetadata  # noqa: E402
from warmreg_kimi_k3.rocm_kda_recurrent import ROCmKDARecurrent  # noqa: E402

I32 = torch.int32


def _prefill_starts(decodes: int, prefill_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The builder's ``prefill_query_start_loc`` of a mixed batch (decode-first): the non-speculative starts past
    the decodes, rebased by the decode tokens (a fresh tensor), and its host copy."""
    lens = torch.cat([torch.ones(decodes, dtype=torch.int64), torch.tensor(prefill_lens, dtype=torch.int64)])
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(I32)
    prefill = starts[decodes:] - decodes
    return prefill, prefill.clone()


@pytest.mark.parametrize(
    ("decodes", "prefill_lens"),
    [
        (0, [9]),
        (3, [64, 65, 1, 300]),  # chunk boundaries
        (5, [1] * 127 + [129]),  # 128 prefills: BLOCK_N 256
        (0, [2000, 3, 0, 77] * 40),  # 160 sequences, an empty one among them
        (7, torch.randint(1, 700, (250,), generator=seeded(250)).tolist()),  # 250 random prefills: BLOCK_N 256
    ],
)
def test_chunk_metadata_matches_vllm(decodes: int, prefill_lens: list[int]) -> None:
    cu, cu_cpu = _prefill_starts(decodes, prefill_lens)
    ours, theirs = clones(cu=cu, cu_cpu=cu_cpu), clones(cu=cu, cu_cpu=cu_cpu)
    want_indices, want_offsets = vllm_meta.prepare_chunk_metadata_device(theirs["cu"], theirs["cu_cpu"],
                                                                         vllm_meta.FLA_CHUNK_SIZE)  # fmt: skip
    got_indices, got_offsets = ROCmChunkMetadata(max_prefills=256)(ours["cu"], ours["cu_cpu"])
    assert_same(got_indices, want_indices, "chunk_indices")
    assert_same(got_offsets, want_offsets, "chunk_offsets")
    assert_same(ours["cu"], theirs["cu"], "cu_seqlens (unwritten)")


# -- the plain decode's packed KDA step ------------------------------------------------------------------------------
H, D, SLOTS = 2, 128, 7  # Kimi-K3's KDA head dim, two heads on this rank


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("indices", [[3], [4, 0, 2, 6, 0]])  # one row; padded rows on the null slot 0
def test_packed_decode_matches_vllm(indices: list[int], lower_bound: float | None) -> None:
    """ROCm's layer: the conv update's fresh ``[B, 3P]`` output, the gate projection's rows, beta a column of the
    packed projection; bitwise equal outputs (zeros on the null slot) and states in the ``[S, H, V, K]`` pool."""
    layout = KDALayout(num_heads=H, head_dim=D, conv_width=4, lower_bound=lower_bound, tensor_parallel_size=1,
                       num_speculative_tokens=3, dtype="bfloat16")  # fmt: skip
    g, batch, p = seeded(len(indices)), len(indices), H * D
    proj = torch.randn(batch, 4 * p + D + H + 8, generator=g).bfloat16()
    args = {
        "mixed_qkv": torch.randn(batch, 3 * p, generator=g).bfloat16(),
        "raw_g": torch.randn(1, batch, H, D, generator=g).bfloat16(),
        "raw_beta": proj[:, 4 * p + D : 4 * p + D + H].unsqueeze(0),
        "A_log": torch.rand(H, generator=g).mul(1.5).add(0.5).log(),
        "dt_bias": torch.randn(H * D, generator=g) * 0.5,
        "initial_state": torch.randn(SLOTS, H, D, D, generator=g) * 0.1,
        "state_indices": torch.tensor(indices, dtype=I32),
        "lower_bound": lower_bound,
    }
    theirs, ours = clones(**args), clones(**args)
    want, _ = vllm_fr.fused_recurrent_kda_packed_decode(**theirs)
    got = KDAPackedDecode(layout=layout)(**ours, launch_pdl=False)
    assert_same(got, want, "o")
    assert_same(ours["initial_state"], theirs["initial_state"], "state pool")


# -- the attention residuals -----------------------------------------------------------------------------------------
# (num_blocks, block_write_idx, has_delta, output norm): call sites of Kimi-K3's forward (amd/linear.py
# KimiDecoderLayer.forward_attn_residual and the model output), as warmreg_kimi_k3.attn_res.call_sites lists them
ATTN_RES_SITES = {
    "layer0_attention": (0, 0, False, True),
    "attention_write": (3, 3, True, True),
    "attention": (1, -1, True, True),
    "mlp_after_write": (4, -1, False, True),
    "mlp": (8, -1, True, True),
    "output": (8, -1, True, False),
}


@pytest.mark.parametrize(
    ("tokens", "site"),
    [(1, "layer0_attention"), (8, "attention"), (5, "attention_write"), (8, "mlp_after_write"), (8, "mlp"),
     (3, "output")],
)  # fmt: skip
def test_attn_res_matches_vllm(tokens: int, site: str) -> None:
    """ROCm's ``attn_res`` at the model's hidden size 7168 (BLOCK_D 8192, masked) on the engine's ``[T, 8, hidden]``
    residual buffer, the (4, 8) decode tile with more than one block and the (1, 4) tile at one block or none:
    bitwise equal output, updated prefix and residual buffer."""
    nb, write, has_delta, norm = ATTN_RES_SITES[site]
    g, hidden = seeded(tokens), 7168

    def randn(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return (shift + scale * torch.randn(*shape, generator=g)).bfloat16()

    args = {
        "prefix": randn(tokens, hidden), "delta": randn(tokens, hidden, scale=0.1) if has_delta else None,
        "blocks": randn(tokens, 8, hidden), "norm_weight": randn(hidden, scale=0.2, shift=1.0),
        "qk_weight": randn(hidden, scale=0.02), "output_norm_weight": randn(hidden, scale=0.2, shift=1.0) if norm else None,
    }  # fmt: skip
    eps, out_eps = 1e-5, 1e-5 if norm else 0.0  # the model passes output_norm_eps=0.0 at the model output
    theirs, ours = clones(**args), clones(**args)
    want = vllm_attn_res.attn_res(**theirs, num_blocks=nb, block_write_idx=write, eps=eps, output_norm_eps=out_eps)
    op = AttnRes(hidden_size=hidden, num_layers=93, block_size=12, eps=eps, output_norm_eps=1e-5)
    got = op(**ours, num_blocks=nb, block_write_idx=write, eps=eps, output_norm_eps=out_eps if norm else None,
             launch_pdl=False)  # fmt: skip
    assert_same(got, want, "output")
    assert_same(ours["prefix"], theirs["prefix"], "prefix (updated in place)")
    assert_same(ours["blocks"], theirs["blocks"], "residual buffer (block write)")


# -- the KDA recurrent step ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize(
    ("lens", "uniform", "spec"),
    [
        ([4], 4, True),  # one speculative sequence: the static single-sequence loop
        ([4, 4, 4], 4, True),  # a uniform speculative length: the static loop without cu_seqlens
        ([2, 4, 1, 3], None, True),  # varlen, a null initial slot
        ([3] * 13, None, True),  # 26 head-sequences with multi-token rows: BV 8, 4 stages
        ([1, 1, 1, 1, 1], None, False),  # a mixed batch's plain decodes: 1-D indices, a padded slot 0
    ],
)
def test_recurrent_matches_vllm(lens: list[int], uniform: int | None, spec: bool, lower_bound: float | None) -> None:
    """q, k, v column slices of the conv update's ``[T, 3P]`` output, the gate rows, beta a projection column, the
    fp32 pool, ``[N, 4]`` indices with accepted counts (or 1-D); bitwise equal ``o`` (a zeroed ``out`` on both sides:
    vLLM writes a null-slot sequence's first row only) and pool."""
    g, n, t, p = seeded(len(lens) + int(spec)), len(lens), sum(lens), H * D
    conv = torch.randn(t, 3 * p, generator=g).bfloat16()
    q, k, v = (conv[:, c : c + p].view(1, t, H, D) for c in (0, p, 2 * p))
    proj = (2 * torch.randn(t, 4 * p + D + H + 8, generator=g)).bfloat16()
    if spec:
        indices = (torch.randperm(n * 4, generator=g).view(n, 4) + 1).to(I32)  # distinct slots 1 .. 4N
        if n == 4:
            indices[2, 0] = 0  # a null initial slot (accepted 1)
        accepted = torch.tensor([min(1 + i % 4, 4) for i in range(n)], dtype=I32)
    else:
        indices, accepted = torch.tensor([3, 0, 5, 1, 6], dtype=I32), None
    args = {
        "q": q, "k": k, "v": v, "raw_g": (torch.randn(1, t, H, D, generator=g) - 1.0).bfloat16(),
        "raw_beta": proj[:, 4 * p + D : 4 * p + D + H].unsqueeze(0),
        "A_log": torch.log(0.5 + 1.5 * torch.rand(H, generator=g)), "dt_bias": torch.randn(H * D, generator=g) * 0.5,
        "lower_bound": lower_bound, "initial_state": torch.randn(4 * n + 1, H, D, D, generator=g) * 0.1,
        "cu_seqlens": torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=I32),
        "ssm_state_indices": indices, "num_accepted_tokens": accepted, "uniform_sequence_length": uniform,
        "out": torch.zeros(1, t, H, D).bfloat16(),
    }  # fmt: skip
    theirs, ours = clones(**args), clones(**args)
    want, _ = vllm_fr.fused_recurrent_kda(**theirs)
    kernel = ROCmKDARecurrent(num_heads=H, head_k_dim=D, head_v_dim=D, lower_bound=lower_bound, max_num_seqs=16)
    got = kernel(**ours)
    assert got is ours["out"] and want is theirs["out"]
    assert_same(got, want, "o")
    assert_same(ours["initial_state"], theirs["initial_state"], "state pool")
