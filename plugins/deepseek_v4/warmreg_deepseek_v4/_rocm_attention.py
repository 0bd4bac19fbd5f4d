"""Which sparse-MLA path a ROCm DeepSeek-V4 deployment takes (vLLM 0.34 ``models/deepseek_v4/amd/rocm.py``), read
by the registrations of the ROCm index and metadata ops (``rocm_*`` modules).

Every ROCm DeepSeek-V4 attention layer is ``DeepseekV4ROCMAiterMLAAttention`` (``amd/model.py``), whatever
``serving.attention_backend`` says (vLLM's ROCm backend is ``ROCM_FLASHMLA_SPARSE_DSV4``). It picks, once per layer:

* aiter's Triton sparse MLA for decode (``_use_aiter_sparse_mla_decode = _aiter_sparse_mla_enabled(...)``): the
  environment variable ``VLLM_ROCM_USE_AITER_TRITON_SPARSE_MLA`` set, aiter enabled (``VLLM_ROCM_USE_AITER``, the
  target's ``+aiter`` feature) and gfx950 (``rocm_aiter_ops.is_triton_sparse_mla_enabled``), and no KV connector;
* and for prefill (``_use_aiter_sparse_mla_prefill``): the same, with at most 64 query heads a rank
  (``_AITER_SPARSE_MLA_PREFILL_MAX_HEADS``). Otherwise prefill gathers the caches into a bf16 workspace and runs the
  in-tree Triton sparse prefill on combined top-k + SWA indices.

The environment variable is not part of ``VllmConfig``; like ``VLLM_ROCM_USE_AITER`` (the ``+aiter`` feature) it is a
feature of the target: ``+aiter_sparse_mla`` (``rocm:gfx950+aiter+aiter_sparse_mla``). A KV connector
(``kv_transfer_config``) is not a warmreg setting: assumed absent (with one, vLLM ignores the variable; leave the
feature off then).
"""

from __future__ import annotations

import warmreg

from ._serving import serving_int
from .model import DSV4

__all__ = [
    "AITER_SPARSE_MLA_ARCHS",
    "AITER_SPARSE_MLA_FEATURE",
    "AITER_SPARSE_MLA_PREFILL_MAX_HEADS",
    "aiter_sparse_mla",
    "aiter_sparse_mla_prefill",
]

#: The one architecture aiter's Triton sparse MLA runs on (``is_triton_sparse_mla_enabled``: ``on_gfx950()``).
AITER_SPARSE_MLA_ARCHS = frozenset({"gfx950"})
#: Query heads a rank up to which prefill takes aiter's sparse MLA (``_AITER_SPARSE_MLA_PREFILL_MAX_HEADS``).
AITER_SPARSE_MLA_PREFILL_MAX_HEADS = 64


#: The target feature for ``VLLM_ROCM_USE_AITER_TRITON_SPARSE_MLA=1``.
AITER_SPARSE_MLA_FEATURE = "aiter_sparse_mla"


def aiter_sparse_mla(platform: warmreg.Platform) -> bool:
    """Whether decode runs on aiter's Triton sparse MLA: ROCm gfx950 with ``+aiter`` and ``+aiter_sparse_mla``
    (``VLLM_ROCM_USE_AITER_TRITON_SPARSE_MLA`` set)."""
    on = warmreg.rocm_arch_in(*AITER_SPARSE_MLA_ARCHS) & warmreg.has_feature("aiter")
    return (on & warmreg.has_feature(AITER_SPARSE_MLA_FEATURE))(platform)


def aiter_sparse_mla_prefill(config: warmreg.WarmConfig, model: DSV4, platform: warmreg.Platform) -> bool:
    """Whether prefill runs on aiter's sparse MLA: :func:`aiter_sparse_mla` and at most 64 query heads a rank
    (``num_attention_heads / serving.tensor_parallel_size``, vLLM's ``n_local_heads``).

    :raises warmreg.ConfigError: if a setting is not of its type.
    """
    heads = model.num_attention_heads // serving_int(config, "tensor_parallel_size", 1)
    return aiter_sparse_mla(platform) and heads <= AITER_SPARSE_MLA_PREFILL_MAX_HEADS
