"""DeepSeek-V4.1 on ROCm: the shared V4.1 ops whose kernel V4.1's ``amd`` model launches unchanged (same vLLM
function, same arguments), registered with ROCm predicates (their own modules register them for CUDA).

* :class:`.v41_hc_collapse.HcCollapse`: ``DeepseekV4Model.forward`` (``models/deepseek_v41/amd/model.py``) collapses
  the ``hc_mult`` streams with the last layer's FFN pre-mix through ``torch.ops.vllm.hc_collapse_triton`` before the
  final norm, every step on the last pipeline rank (warmreg has no pipeline setting: every rank is the last). The
  streams come from ``MHCPostOp`` (aiter's, TileLang's or the Torch post: a fresh ``[T, hc_mult, H]`` tensor) and the
  pre-mix from the last seam's ``[T, hc_mult]`` output, as on CUDA, so the same key.
* the engram layers' n-gram hash (:class:`.v41_engram_hash.EngramHash`) and table lookup
  (:class:`.v41_engram_lookup.EngramLookup`): the ``amd`` model builds ``NgramHashState`` and its decoder layers
  ``RocmEngram`` (``amd/model.py``), whose hash (``DeepseekV4Model.forward``) and lookup (``Engram.prepare_embeddings``,
  the same FP8 E4M3 host table: ``common/engram.py``) are the common code CUDA runs, every step, so the same keys.
* the unsharded engram gate (:class:`.v41_engram_gate.EngramGate`, ``_fused_engram_post_wkv_kernel``):
  ``RocmEngram._post_wkv`` calls ``Engram._post_wkv`` when its ``wkv`` is whole (``kv_shards == 1``), which
  ``_create_wkv`` keeps at tensor-parallel size 1 or off CDNA3 / CDNA4 (``_shards_engram_gate``;
  ``use_sequence_parallel`` is always False on ROCm); elsewhere the sharded gate runs (:mod:`.v41_rocm_engram_gate`).
* the SWA metadata builder's own path (``DeepseekV41ROCMAiterSparseSWAMetadataBuilder.build``, ``amd/rocm.py``) for
  every step ``swa_decode_meta.build`` does not take (no ``--monokernel``, a prefill in the batch, more than 32 decode
  tokens): the common builder's decode SWA rows (:class:`.swa_indices.DecodeSwaIndices`,
  ``_compute_swa_indices_and_lens_kernel``, ``sliding_window`` wide, as on CUDA), then
  ``build_ragged_indices_from_dense`` of those rows (:mod:`.rocm_ragged`: the count and the compaction), whose rows
  are ``sliding_window`` wide, or DSpark's non-causal width under ``speculative_method`` ``dspark``; where prefill
  attends in-tree (not aiter's sparse MLA), also ``rocm_sparse_attn_prefill``'s compaction of each layer kind's
  combined rows (``combine_topk_swa_indices``: ``top_k + sliding_window`` rounded up to 128, ``top_k`` 0 for
  SWA-only layers and ``index_topk`` for ratios 1 and 2).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

import warmreg

from ._rocm_attention import aiter_sparse_mla
from ._serving import serving_int
from ._v41_rocm import MONOKERNEL_ARCHS
from .dspark import DSPARK, dspark_swa_index_width, num_speculative_tokens, speculative_method
from .model import DSV4
from .rocm_ragged import RocmRaggedCompact, RocmRaggedCount
from .swa_indices import DecodeSwaIndices
from .v41_engram_gate import EngramGate
from .v41_engram_hash import EngramHash
from .v41_engram_lookup import EngramLookup
from .v41_hc_collapse import HcCollapse

__all__ = ["V41RocmRaggedCompact", "V41RocmRaggedCount", "register"]

#: vLLM's ``_SPARSE_PREFILL_TOPK_ALIGNMENT``: V4.1's combined prefill rows are ``top_k + window`` rounded up to it.
COMBINE_ALIGN = 128


class _Widths:
    """The row widths V4.1's SWA builder compacts, given (DeepSeek-V4's :func:`.rocm_ragged.ragged_row_widths` reads
    V4's topology)."""

    def __init__(self, widths: tuple[int, ...] = (128,)) -> None:
        """:param widths: the dense row widths compacted."""
        self.widths = widths

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        return {"indices": [warmreg.meta((1, w), torch.int32) for w in self.widths]}


class V41RocmRaggedCount(_Widths, RocmRaggedCount):
    """:class:`.rocm_ragged.RocmRaggedCount` over V4.1's decode SWA row widths."""

    name = RocmRaggedCount.name


class V41RocmRaggedCompact(_Widths, RocmRaggedCompact):
    """:class:`.rocm_ragged.RocmRaggedCompact` over V4.1's decode SWA row widths."""

    name = RocmRaggedCompact.name


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the shared V4.1 ops the ROCm model launches (see the module docstring) on ROCm: the head collapse, the
    SWA builder's decode rows and their compaction; with engram layers the hash and the lookup, and the unsharded gate
    at tensor-parallel size 1 or off gfx942 / gfx950.

    :raises warmreg.ConfigError: for a malformed ``serving.tensor_parallel_size`` or DSpark setting.
    """
    registry.add(
        HcCollapse(hidden_size=model.hidden_size, hc_mult=model.hc_mult), when=warmreg.is_rocm if model.v41 else False
    )
    if not model.v41:
        return
    registry.add(DecodeSwaIndices(), when=warmreg.is_rocm)
    widths = {model.sliding_window}
    if speculative_method(config) == DSPARK:
        widths.add(dspark_swa_index_width(model.sliding_window, num_speculative_tokens(config)))
    if not aiter_sparse_mla(platform):  # the in-tree prefill compacts each layer kind's combined rows
        top_ks = {0} | ({model.index_topk} if any(r > 0 for r in model.ratios) else set())
        widths |= {-(-(k + model.sliding_window) // COMBINE_ALIGN) * COMBINE_ALIGN for k in top_ks}
    for ragged in (V41RocmRaggedCount(tuple(sorted(widths))), V41RocmRaggedCompact(tuple(sorted(widths)))):
        registry.add(ragged, when=warmreg.is_rocm)
    layout = model.engram
    if layout is None:
        return
    hashing = EngramHash(n_layers=len(layout.layer_ids), max_ngram_size=layout.max_ngram_size, n_heads=layout.n_heads)
    registry.add(hashing, when=warmreg.is_rocm)
    registry.add(EngramLookup(layout=layout), when=warmreg.is_rocm)
    whole = serving_int(config, "tensor_parallel_size", 1) == 1
    gate = EngramGate(hidden_size=model.hidden_size, hc_mult=model.hc_mult, dtype=model.dtype)
    registry.add(gate, when=warmreg.is_rocm if whole else warmreg.is_rocm & ~warmreg.rocm_arch_in(*MONOKERNEL_ARCHS))
