"""DeepSeek-V4.1 on ROCm: the sparse MLA decode kernels of DeepSeek-V4's ROCm ops, over V4.1's layer ratios.

V4.1's ``DeepseekV41ROCMAiterMLAAttention._forward_decode`` (vLLM 0.34 ``models/deepseek_v41/amd/rocm.py``) calls the
same ``rocm_sparse_attn_decode`` (``v1/attention/ops/rocm_aiter_mla_sparse.py``) as DeepSeek-V4, on every step with
decode tokens, for every layer, unless decode takes aiter's sparse MLA (``_use_aiter_sparse_mla``: gfx950 with
``+aiter`` and ``+aiter_sparse_mla``, :func:`._rocm_attention.aiter_sparse_mla`): ``q [T, H, head_dim]`` bf16, the SWA
builder's ragged decode rows over the SWA cache, and, for a compressed layer (``swa_only = compress_ratio == 0`` is
False: ratios 1 and 2), the ``_decode_topk_ragged`` stream over the ``fp8_ds_mla`` compressed cache; the layer's fp32
sink; ``inv_rope_positions=positions`` (int64) and the rotary cache always. What it launches, by arch:

* gfx942: the split-KV partial pass (:class:`.rocm_sparse_attn_decode.RocmSparseAttnDecodePartial`, SWA-only and
  compressed layers) and the reduce (:class:`.rocm_sparse_attn_reduce.RocmSparseAttnReduce`) into the bf16
  ``output`` with the inverse RoPE folded in (V4.1 passes the positions on every arch; no adaptive splits);
* every ROCm arch but gfx942 and gfx950: the single-pass decode
  (:class:`.rocm_sparse_attn_decode_ragged.RocmSparseAttnDecodeRagged`, with the sink).

Off gfx950 the attention output is bf16 (``_alloc_attn_out``) and ``forward_mqa`` rotates back the rows the decode did
not, ``rocm_inverse_rope_rows_(output[rotated:end, :n_local_heads], positions[rotated:end], cos_sin_cache,
rope_head_dim)`` with ``end = output.shape[0]`` (the in-tree prefill's rows: aiter's sparse MLA is gfx950's alone):
:class:`.rocm_inverse_rope.RocmInverseRope`, at DeepSeek-V4's key (same head geometry, int64 positions). V4.1's
``_o_proj`` calls ``rocm_inv_rope_einsum`` with ``inverse_rope=False`` (no launch); on gfx950 the prefill rows take
the MXFP8 inverse RoPE (:mod:`.v41_rocm_inverse_rope_mxfp8`).

Where DeepSeek-V4's domains read a compressed layer as a ratio above 1 (V4's C4 / C128), V4.1's compressed ratios are
1 and 2: the domains here read ``r > 0``. Not planned here: gfx950's decode (``_alloc_attn_out`` gives the decode an
MXFP8 ``output_mxfp8``, so its reduce runs with ``QUANT_OUT``, a variant
:class:`.rocm_sparse_attn_reduce.RocmSparseAttnReduce` does not reproduce yet).

The in-tree prefill (``_forward_prefill``, every ROCm arch where aiter's Triton sparse MLA does not take prefill:
``_use_aiter_sparse_mla`` is the same switch as decode's, with no head limit) runs, for every prefill chunk of every
layer, the K gathers (:mod:`.v41_rocm_gather_k`), V4.1's ``combine_topk_swa_indices``
(:class:`.v41_combine_indices.V41CombineTopkSwa`, the same vLLM function and arguments as on CUDA: ``top_k`` 0 for an
SWA-only layer, the indexer's top-k for ratios 1 and 2), then ``rocm_sparse_attn_prefill`` with the layer's sink
(:class:`.rocm_sparse_attn_prefill.RocmSparseAttnPrefill`, DeepSeek-V4's op: the same head geometry and a key that does
not depend on the ratio), whose compaction of the combined rows :mod:`.v41_rocm_shared` plans.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

import warmreg

from ._rocm_attention import aiter_sparse_mla
from ._serving import serving_int
from .fp8_ds_mla import SCALE_BYTES, TOKEN_BYTES
from .model import DSV4
from .rocm_inverse_rope import RocmInverseRope
from .rocm_sparse_attn_decode import RocmSparseAttnDecodePartial
from .rocm_sparse_attn_decode_ragged import SPLIT_KV_ARCHS, RocmSparseAttnDecodeRagged
from .rocm_sparse_attn_prefill import RocmSparseAttnPrefill
from .rocm_sparse_attn_reduce import RocmSparseAttnReduce
from .v41_combine_indices import V41CombineTopkSwa

__all__ = ["V41RocmDecodePartial", "V41RocmDecodeRagged", "V41RocmDecodeReduce", "register"]


def _extras(model: DSV4) -> list[Any]:
    """The extra segment of each layer kind: none for SWA-only (ratio 0) layers, the ``fp8_ds_mla`` compressed cache
    ``[pages, B, 584]`` for ratios 1 and 2 (the MTP layers past ``compress_ratios`` are SWA-only)."""
    cache = warmreg.meta((1, 1, TOKEN_BYTES + SCALE_BYTES), torch.uint8)
    kinds = sorted({min(r, 1) for r in model.ratios})
    return [cache if kind else None for kind in kinds]


def _heads(model: DSV4, config: warmreg.WarmConfig) -> int:
    return model.num_attention_heads // serving_int(config, "tensor_parallel_size", 1)


class V41RocmDecodePartial(RocmSparseAttnDecodePartial):
    """:class:`.rocm_sparse_attn_decode.RocmSparseAttnDecodePartial` over V4.1's layer kinds (gfx942)."""

    name = RocmSparseAttnDecodePartial.name

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        model = DSV4.from_config(config)
        return {  # the SWA cache is FNUZ where the platform's FP8 is (gfx942)
            "q": [warmreg.meta((1, _heads(model, config), model.head_dim), torch.bfloat16)],
            "extra_cache": _extras(model),
            "fnuz_main": [platform.fp8_fnuz],
        }


class V41RocmDecodeReduce(RocmSparseAttnReduce):
    """:class:`.rocm_sparse_attn_reduce.RocmSparseAttnReduce` as V4.1's gfx942 decode runs it: the layer's sink, the
    inverse RoPE at int64 positions, no adaptive splits, bf16 out."""

    name = RocmSparseAttnReduce.name

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        model = DSV4.from_config(config)
        return {
            "part_acc": [warmreg.meta((1, 1, 1, model.head_dim), torch.float32)],
            "attn_sink": [warmreg.meta((1,), torch.float32)],
            "positions": [warmreg.meta((1,), torch.int64)],
            "adaptive": [False],
        }


class V41RocmDecodeRagged(RocmSparseAttnDecodeRagged):
    """:class:`.rocm_sparse_attn_decode_ragged.RocmSparseAttnDecodeRagged` over V4.1's layer kinds (ROCm archs other
    than gfx942 and gfx950)."""

    name = RocmSparseAttnDecodeRagged.name

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        model = DSV4.from_config(config)
        heads = _heads(model, config)
        return {
            "q": [warmreg.meta((1, heads, model.head_dim), torch.bfloat16)],
            "attn_sink": [warmreg.meta((heads,), torch.float32)],
            "extra_cache": _extras(model),
            "fnuz_main": [platform.fp8_fnuz],
        }


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register V4.1's ROCm sparse decode (see the module docstring): gfx942's partial pass and reduce, the
    single-pass decode off gfx942 and gfx950, the inverse RoPE of the unrotated rows off gfx950, and the in-tree
    prefill's combine and sparse attention where aiter's sparse MLA does not take prefill. Nothing for DeepSeek-V4
    (its own modules register these kernels)."""
    if not model.v41:
        return
    rope = model.qk_rope_head_dim
    gfx942 = warmreg.rocm_arch_in("gfx942") if not aiter_sparse_mla(platform) else False
    registry.add(V41RocmDecodePartial(rope_head_dim=rope), when=gfx942)
    registry.add(V41RocmDecodeReduce(rope_head_dim=rope), when=gfx942)
    registry.add(V41RocmDecodeRagged(rope_head_dim=rope), when=warmreg.is_rocm & ~warmreg.rocm_arch_in(*SPLIT_KV_ARCHS))
    registry.add(RocmInverseRope(), when=warmreg.is_rocm & ~warmreg.rocm_arch_in("gfx950"))
    in_tree = warmreg.is_rocm if not aiter_sparse_mla(platform) else False  # _forward_prefill, not the aiter one
    combine = V41CombineTopkSwa(window_size=model.sliding_window, index_topk=model.index_topk, ratios=model.ratios)
    registry.add(combine, when=in_tree)
    registry.add(RocmSparseAttnPrefill(), when=in_tree)
