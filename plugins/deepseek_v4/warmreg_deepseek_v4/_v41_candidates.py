"""Where DeepSeek-V4.1's two-level candidate filtering launches its kernels (vLLM 0.34 ``models/deepseek_v41``).

A checkpoint with ``candidate_source_layer_id >= 0`` and ``candidate_topk_blocks > 0`` gets a candidate buffer
(``nvidia/model.py: DeepseekV4Model.__init__``, int32 ``[max_num_batched_tokens, candidate_topk_blocks]``); the
indexer of the index layer ``candidate_source_layer_id`` writes each row's top candidate blocks of
``candidate_block_size`` compressed positions into it (``candidate_write``), and the indexer of every later index
layer reads it (``attention.py: DeepseekV4Attention.__init__``: ``uses_candidates = 0 <= candidate_source_layer <
layer_id``). Both run in ``sparse_attn_indexer``'s prefill chunks and decode rows
(``model_executor/layers/sparse_attn_indexer.py``), which pass no row starts on CUDA (``row_starts`` stays None
outside XPU) and int32 row ends.

Planned on CUDA outside the SM100 family (:data:`DENSE_FP32`), where the indexer logits are FP32
(``_set_deepseek_indexer_logits_dtype``: BF16 only where ``mqa_logits_use_mx_scales``, the SM100 family), DeepSelect
cannot run (``has_deep_select``: the SM100 family only) so the source scores every block (``FULL_WIDTH``) and stores
``torch.topk``'s blocks, and ``attention_config.indexer_sparse_logits`` resolves off
(``_indexer_sparse_logits_supported``: the SM100 family only) so the consumers mask dense logits.

On the SM100 family (:func:`sm100_keys`), assuming what warmreg cannot read: vLLM's wheel ships the DeepSelect
extension (``vllm._deepselect_C``, in the 0.34 wheel), whose rows need 1024-byte input and 32-byte output strides
(``check_deep_select_layout``); ``kernel_config.sparse_indexer_topk_backend`` is ``auto`` (vLLM's default); the target's
``+deepgemm`` feature stands for a DeepGEMM with the sparse MQA kernels (``has_deep_gemm_sparse_mqa``, 2.8 on), as
:mod:`.uniform_decode` reads it for the varlen decode. Then ``select_candidate_blocks`` ranks with DeepSelect
(``FULL_WIDTH`` off, no store) where a row's blocks ``nblocks >= K`` and ``K`` rows of int32 are 32-byte aligned, else
with ``torch.topk`` (``FULL_WIDTH``, the store): the decode rows' logits are ``max_model_len // ratio`` wide and BF16
(the ``auto`` top-k, cooperative or persistent for ``index_topk`` 512 / 1024 / 2048, takes BF16; else
``as_fp32_logits``), scored into FP32; the prefill chunks' logits are FP32, any width from one block (``FULL_WIDTH``)
up to the chunk's compressed context (wide enough for DeepSelect once ``max_num_seqs`` requests of ``max_model_len``
reach ``K`` blocks: an approximation of the chunk planner). The consumers take the sparse-logits indexer (the
expansion, :mod:`.v41_candidate_expand`) where ``_indexer_sparse_logits_supported`` holds (DeepGEMM's sparse kernels,
no DCP or PCP, a block size of 8 or 16 multiples, DeepSelect's layout of ``K * BS`` BF16 columns and ``index_topk``
int32 outputs), else dense logits (the flags and the mask, FP32 prefill and the decode's dtype). Not planned yet: the
specialized decode's cooperative selection (:mod:`.v41_specialized_candidates`) and ROCm
(:mod:`.v41_rocm_candidate_mask`).
"""

from __future__ import annotations

import attrs

import warmreg

from ._serving import max_model_len, serving_int
from .model import DSV4, PLUGIN

__all__ = ["DENSE_FP32", "SM10X", "Sm100Keys", "candidate_roles", "sm100_keys"]

#: The SM100 family (vLLM's ``is_device_capability_family(100)``).
SM10X = warmreg.is_cuda & warmreg.sm_at_least(100) & warmreg.sm_below(110)
#: CUDA outside the SM100 family: FP32 indexer logits, no DeepSelect, dense consumers (module docstring).
DENSE_FP32 = warmreg.is_cuda & ~SM10X


@attrs.frozen(kw_only=True)
class Sm100Keys:
    """What a two-level deployment's kernels are keyed on in the SM100 family (module docstring)."""

    #: ``(logits dtype, scores dtype, FULL_WIDTH)`` of the source's block scores
    scores: tuple[tuple[str, str, bool], ...]
    #: whether a ``FULL_WIDTH`` call stores ``torch.topk``'s blocks
    store: bool
    #: the dense consumers' logits dtypes: ``(prefill, decode)``
    mask_logits: tuple[str, ...]
    #: the sparse consumers' DeepGEMM sparse block (``pick_sparse_block_kv``), 0 where they cannot take sparse logits
    sparse_block_kv: int


def candidate_roles(model: DSV4) -> tuple[bool, bool]:
    """``(writes, reads)``: whether a layer of ``model`` selects candidate blocks (the candidate source is an index
    layer that builds an indexer: a backbone ``index_source_layer_ids`` layer with a compressed cache) and whether one
    masks with them (an index layer above the source). Both False for DeepSeek-V4 or a checkpoint without two-level
    filtering.

    :raises warmreg.ConfigError: naming ``text.candidate_block_size`` when two-level filtering is on with a block size
        of 0 (vLLM's ``sparse_attn_indexer`` asserts ``candidate_block_size > 0``).
    """
    source = model.candidate_source_layer_id
    if not model.v41 or source < 0 or model.candidate_topk_blocks <= 0:
        return False, False
    layers = [
        i
        for i in model.index_source_layer_ids
        if i < model.num_hidden_layers and i < len(model.ratios) and model.ratios[i]
    ]
    writes, reads = source in layers, any(i > source for i in layers)
    if (writes or reads) and model.candidate_block_size <= 0:
        raise warmreg.ConfigError(
            "text.candidate_block_size", f"is {model.candidate_block_size}; two-level candidate filtering "
            f"(candidate_source_layer_id {source}, candidate_topk_blocks {model.candidate_topk_blocks}) needs a block "
            "size > 0", plugin=PLUGIN, fix="set the checkpoint's candidate_block_size",
        )  # fmt: skip
    return writes, reads


def _deep_select_output(k: int) -> bool:
    """Whether DeepSelect takes ``k`` int32 outputs a row: ``k <= 4096`` and ``4 k`` a multiple of 32 bytes."""
    return k <= 4096 and (4 * k) % 32 == 0


def sm100_keys(model: DSV4, config: warmreg.WarmConfig) -> Sm100Keys:
    """The SM100 family's keys of a two-level deployment (:func:`candidate_roles` True for a role), under the module
    docstring's assumptions.

    :raises warmreg.ConfigError: for a serving int that is missing or invalid (``max_model_len``, ``max_num_seqs``).
    """
    k, bs, index_topk = model.candidate_topk_blocks, model.candidate_block_size, model.index_topk
    source = model.candidate_source_layer_id
    width = max_model_len(config) // max(1, model.ratios[source] if source < len(model.ratios) else 1)
    dcp = serving_int(config, "decode_context_parallel_size", 1)
    pcp = serving_int(config, "prefill_context_parallel_size", 1)
    decode = "bfloat16" if index_topk in (512, 1024, 2048) and dcp == 1 else "float32"
    deep = _deep_select_output(k)
    scores = {(decode, "float32", not (deep and -(-width // bs) >= k))}
    if k > 1:
        scores.add(("float32", "float32", True))  # a prefill chunk narrower than K blocks
    if deep and -(-(serving_int(config, "max_num_seqs") * width) // bs) >= k:
        scores.add(("float32", "float32", False))
    sbk = next((b for b in (16, 8) if bs % b == 0), 0)
    sparse = dcp == 1 and pcp == 1 and sbk and (k * bs * 2) % 1024 == 0 and k * bs < 2**23
    return Sm100Keys(
        scores=tuple(sorted(scores)), store=any(fw for *_, fw in scores),
        mask_logits=tuple(dict.fromkeys(("float32", decode))),
        sparse_block_kv=sbk if sparse and _deep_select_output(index_topk) else 0,
    )  # fmt: skip
