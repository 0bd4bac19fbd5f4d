"""DeepSeek-V4 C4 indexer: Q RoPE + FP8 quant (specs section 8) and KV compress + insert (section 11b).

Only the FP8 indexer path is implemented; the MXFP4 path (``indexer_kv_dtype == "mxfp4"``, PTX E2M1
conversion on CUDA, aiter on ROCm) is left for later. Both kernels round with exact power-of-two
scales ``s = 2**ceil(log2(max(amax, 1e-4) / FP8_MAX))`` (``ceil(log2)`` from the exponent bits) and
write FP8 bytes with a bit-exact encoder (see :mod:`._quant`). ``rope(x, p)`` below is GPT-J
interleaved RoPE on the last ``R = cos_sin_cache.shape[1]`` dims: pairs ``(e, o) = (x[2i], x[2i+1])``
of that part, ``c, s = cos_sin_cache[p, i], cos_sin_cache[p, R/2 + i]``, ``e' = e*c - o*s``,
``o' = o*c + e*s``.

**Indexer Q** (grid ``(T, H)``, one program per token and head)::

    y = float32(index_q[t, h]);  y[rot] = float32(bf16(rope(y, positions[t])[rot]))   # NoPE part as is
    s = pow2 scale of amax(|y|) with FP8_MAX (448 e4m3fn; 224 e4m3fnuz on gfx942)
    q_fp8[t, h] = fp8(y / s);   w_out[t, h] = float32(index_weights[t, h]) * s * softmax_scale * head_scale

The q scale is folded into the weights: there is no q-scale tensor. On ROCm the rotation uses
explicit ``fma(e, c, -(o*s))``, ``fma(o, c, e*s)``.

**Indexer KV compress + insert** (grid ``(T,)``; a token writes only if ``slot_mapping[t] >= 0``,
``(pos + 1) % cr == 0`` and ``compressed_slot_mapping[t] >= 0``). With window ``L = 2*cr`` (overlap)
ending at ``pos``, state rows read through the state block table, the older ``cr`` positions from
the first half of each state (kv ``[0, hd)``, score ``[SW, SW+hd)``), the newer ones from the second::

    c = sum_i softmax_i(score_i) * kv_i             (per column; positions < 0 excluded)
    n = c * rsqrt(mean(c**2) + eps) * w
    x = float32(bf16(rope(n, (pos // cr) * cr)))     s = pow2 scale of amax(|x|) with 448
    page, j = divmod(compressed_slot_mapping[t], kv_block_size)
    kv_cache page bytes [j*hd, (j+1)*hd) = e4m3fn(clamp(x / s, +-448))
    kv_cache page bytes [kv_block_size*hd + 4j, +4) = float32 s, or (MX_SCALE) the UE8M0 byte x4 as int32

K is always OCP e4m3fn (max 448), even on gfx942.
"""

from __future__ import annotations

import warmreg

from .indexer_kv import (
    IndexerKVCompressInsert,
    IndexerKVInsertKey,
    indexer_kv_compress_insert_reference,
    indexer_page_stride,
)
from .indexer_q import IndexerQKey, IndexerQRopeQuant, indexer_q_rope_quant_reference
from .model import DSV4

__all__ = [
    "IndexerKVInsertKey",
    "IndexerKVCompressInsert",
    "IndexerQKey",
    "IndexerQRopeQuant",
    "indexer_kv_compress_insert_reference",
    "indexer_page_stride",
    "indexer_q_rope_quant_reference",
    "register",
]


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the C4 indexer kernels (FP8 indexer cache).

    Indexer Q runs through Triton on ROCm and on CUDA without CuTeDSL (CuTeDSL replaces it; XPU has its
    own op). The KV compress + insert runs through Triton on every platform.
    """
    c4 = model.has_c4
    q_rope = IndexerQRopeQuant(
        num_heads=model.index_n_heads, head_dim=model.index_head_dim, rope_dim=model.qk_rope_head_dim, dtype=model.dtype
    )
    triton_q = warmreg.is_rocm | (warmreg.is_cuda & ~warmreg.has_feature("cutedsl"))
    registry.add(q_rope, when=triton_q if c4 else False)
    insert = IndexerKVCompressInsert(
        head_dim=model.index_head_dim, rope_dim=model.qk_rope_head_dim, compress_ratio=4, weight_dtype=model.dtype
    )
    registry.add(insert, when=c4)
