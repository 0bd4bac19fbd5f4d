"""Whether a Kimi-K3 deployment has DSA (DeepSeek sparse attention) layers, and which DSA indexer kernels vLLM 0.34
runs for them: the config reading the DSA op modules share (FP8: :mod:`.dsa_prologue`, :mod:`.dsa_k_insert`,
:mod:`.dsa_q_quant`; MXFP4: ``dsa_indexer_mxfp4``).

Kimi-K3.1 checkpoints carry a nested ``text_config.dsa_config`` (vLLM 0.34
``transformers_utils/configs/kimi_linear.py: KimiLinearDSAConfig``); decoder layer ``i`` (0-based) is a DSA layer
when ``i + 1`` is in ``dsa_config.dsa_layers`` (``KimiLinearConfig.is_dsa_layer``; ``layers`` is read as an alias),
and such a layer is a :class:`KimiK3DSAAttention` in place of the dense MLA (``models/kimi_k3/nvidia/model.py:
KimiDecoderLayer.__init__``, full-attention layers only). Its indexer (``models/kimi_k3/nvidia/dsa.py``) runs:

* the **key insert**: with ``use_fused_k_insert`` (``index_k_norm_type == "layernorm"``, ``index_rope_dim == 0``
  and no prefill context parallelism) one Triton kernel normalises, quantizes and inserts the key and fills the
  step's top-k rows with -1: ``indexer_k_norm_quant_insert`` (FP8 cache) or ``mxfp4_k_norm_quant_insert``. When the
  layer's projections are packed (:attr:`DSALayout.fused_prologue`) the same work and the q_a / kv_a RMSNorms and
  the fp8_ds_mla MLA insert run as one launch instead: ``dsa_fused_prologue`` / ``mxfp4_fused_prologue``;
* the **query quant**: ``indexer_q_quant_fold_weights`` (FP8) or ``mxfp4_q_quant``, on every scoring step;
* the **index RoPE** (``index_rope``) when ``index_rope_dim > 0``, which vLLM 0.34 refuses for every Kimi-K3
  layout (see :func:`dsa_layout`), so it never launches and no op here reproduces it.

The FP8 / MXFP4 choice is ``serving.indexer_kv_dtype`` (vLLM's ``--attention-config '{"indexer_kv_dtype": ...}'``,
``models/kimi_k3/common/dsa_cache.py: kimi_k3_indexer_uses_fp4``): ``auto`` and ``fp8`` are FP8, ``mxfp4`` needs the
SM10x family and the fused key insert. vLLM's DSA layers are CUDA-only (``KimiK3DSAAttention`` raises on ROCm), so
on other platforms nothing here is planned.

Not warmreg settings, hence ASSUMED: prefill context parallelism off, the DSA projections unquantized (vLLM packs
only ``UnquantizedLinearMethod`` linears), weights neither offloaded nor pre-processed, no HiSparse cache and no
specialized decode (``KimiK3ForCausalLM.process_weights_after_loading`` packs the projections only without it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs

import warmreg

from .model import PLUGIN, KimiK3, positive, positive_text_int, rms_norm_eps

__all__ = [
    "FP8_DS_MLA_SOURCES",
    "INDEXER_KV_DTYPES",
    "DSALayout",
    "dsa_layout",
    "mla_cache_is_fp8_ds_mla",
]

#: ``serving.indexer_kv_dtype`` values (vLLM's ``DSA_INDEXER_KV_DTYPES`` plus ``auto``).
INDEXER_KV_DTYPES = ("auto", "fp8", "mxfp4")
#: ``serving.kv_cache_dtype`` values FlashMLA's sparse backend serves as ``fp8_ds_mla``
#: (``model_executor/layers/attention/mla_attention.py: _canonicalize_sparse_mla_kv_cache_dtype``).
FP8_DS_MLA_SOURCES = ("fp8", "fp8_e4m3", "fp8_ds_mla")
#: ``dsa_config`` defaults (``KimiLinearDSAConfig``).
_DEFAULTS: Mapping[str, Any] = {
    "index_topk": 2048, "index_head_dim": 64, "index_num_heads": 16, "index_rope_dim": 0,
    "index_k_norm_type": "rmsnorm", "index_topk_freq": 1,
}  # fmt: skip
_FIELD = "text.dsa_config"


def _ids(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class DSALayout:
    """The DSA layers of one deployment, as vLLM 0.34's Kimi-K3 indexer reads them.

    :param layers: 1-based decoder layer ids with DSA (``dsa_config.dsa_layers``).
    :param index_topk: keys each query keeps (the top-k buffer's width).
    :param index_head_dim: the indexer head size (query heads and the shared key).
    :param index_num_heads: indexer query heads (not split by tensor parallelism).
    :param index_k_norm_type: ``"layernorm"`` (bias-full fp32 LayerNorm) or ``"rmsnorm"``.
    :param indexer_fp4: MXFP4 indexer keys and queries (else FP8).
    :param fused_k_insert: the key is normalised, quantized and inserted by this layer's Triton kernel
        (``KimiK3DSAIndexer.use_fused_k_insert``), not inside ``sparse_attn_indexer``.
    :param fused_prologue: the layer's projections are packed (``KimiK3DSAAttention.pack_projections``), so the
        key insert runs inside the fused prologue with the q_a / kv_a RMSNorms and the MLA cache insert.
    :param q_lora_rank: ``text.q_lora_rank`` (None: an uncompressed query projection).
    :param kv_lora_rank: ``text.kv_lora_rank``.
    :param qk_rope_head_dim: ``text.qk_rope_head_dim`` (the k_pe width written beside the latent).
    :param eps: ``text.rms_norm_eps``, the epsilon of the q_a, kv_a and indexer key norms.
    :param dtype: the activation dtype name.
    """

    layers: tuple[int, ...] = attrs.field(converter=_ids)
    index_topk: int
    index_head_dim: int
    index_num_heads: int
    index_k_norm_type: str
    indexer_fp4: bool
    fused_k_insert: bool
    fused_prologue: bool
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_rope_head_dim: int
    eps: float
    dtype: str

    @property
    def padded_index_num_heads(self) -> int:
        """The query heads DeepGEMM's scoring kernels take: 32 or 64 (``KimiK3DSAIndexer.padded_index_num_heads``)."""
        return 32 if self.index_num_heads <= 32 else 64


def _bad(name: str, problem: str, config: warmreg.WarmConfig, fix: str | None = None) -> warmreg.ConfigError:
    return warmreg.ConfigError(
        f"{_FIELD}.{name}", problem, plugin=PLUGIN, fix=fix or f"correct it in {config.source}"
    )  # fmt: skip


def _int(config: warmreg.WarmConfig, dsa: Mapping[str, Any], name: str, *, zero: bool = False) -> int:
    value = dsa.get(name, _DEFAULTS[name])
    problem = positive(value if not zero or value != 0 else 1)
    if problem:
        raise _bad(name, problem.replace("> 0", ">= 0") if zero else problem, config)
    return int(value)


def _layers(config: warmreg.WarmConfig, dsa: Mapping[str, Any]) -> tuple[int, ...]:
    layers = dsa.get("dsa_layers", dsa.get("layers"))
    if not isinstance(layers, list | tuple) or any(positive(i) for i in layers):
        raise _bad("dsa_layers", f"must be a list of 1-based layer ids (got {layers!r})", config)
    return tuple(sorted(set(layers)))


def mla_cache_is_fp8_ds_mla(config: warmreg.WarmConfig, platform: warmreg.Platform) -> bool:
    """Whether the DSA layers' MLA cache is vLLM's ``fp8_ds_mla`` (656 bytes a token), which the fused prologue
    writes (``pack_projections`` requires it).

    vLLM canonicalizes the cache dtype per sparse backend (``_canonicalize_sparse_mla_kv_cache_dtype``): FlashMLA's
    sparse backend serves every FP8 name of :data:`FP8_DS_MLA_SOURCES` as ``fp8_ds_mla``, FlashInfer's SM120 sparse
    backend ``auto`` and FP8; every other backend keeps the requested dtype. ``serving.attention_backend`` may name
    FlashMLA's sparse backend as ``FLASHMLA_SPARSE`` or, since warmreg's Kimi-K3 block-size arithmetic
    (:data:`warmreg_kimi_k3.backends.MLA_KERNEL_BLOCK_SIZES`) knows the dense names only, as ``FLASHMLA``: on a DSA
    model every MLA layer is sparse, and vLLM runs FlashMLA's sparse twin (64-token kernel pages, as FlashMLA's).
    """
    kv = config.get("serving.kv_cache_dtype", str, plugin=PLUGIN, default="auto")
    backend = config.get("serving.attention_backend", str, plugin=PLUGIN, default="")
    if kv == "fp8_ds_mla":
        return True
    if backend in ("FLASHMLA", "FLASHMLA_SPARSE"):
        return kv in FP8_DS_MLA_SOURCES
    if backend == "FLASHINFER_MLA_SPARSE_SM120":
        return platform.is_cuda and platform.sm // 10 == 12 and kv in ("auto", "fp8", "fp8_e4m3")
    return False


def _indexer_fp4(config: warmreg.WarmConfig, platform: warmreg.Platform, fused_k_insert: bool) -> bool:
    field = "serving.indexer_kv_dtype"
    value = config.get(field, str, plugin=PLUGIN, default="auto", choices=INDEXER_KV_DTYPES)
    if value != "mxfp4":
        return False
    if platform.sm // 10 != 10:
        raise warmreg.ConfigError(
            field, f"is 'mxfp4', which Kimi-K3's DSA indexer runs on sm_10x only; {platform} is not", plugin=PLUGIN,
            fix="set it to 'fp8' (or 'auto'), or target cuda:100 / cuda:103",
        )  # fmt: skip
    if not fused_k_insert:
        raise warmreg.ConfigError(
            field, "is 'mxfp4', which needs the fused Kimi-K3 DSA key insert (dsa_config.index_k_norm_type "
            "'layernorm' and index_rope_dim 0)", plugin=PLUGIN, fix="set it to 'fp8' (or 'auto')",
        )  # fmt: skip
    return True


def dsa_layout(model: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> DSALayout | None:
    """The DSA layout of a deployment on ``platform``, or None when it has no DSA layer (no ``dsa_config``, or none
    of its ``dsa_layers`` is a full-attention layer of ``text.linear_attn_config``) or ``platform`` is not CUDA.

    Validates as vLLM 0.34 does when it builds the layers (it fails to start otherwise): ``index_rope_dim`` 0
    (``KimiK3DSAAttention`` refuses indexer RoPE under ``mla_use_nope``, and ``KimiDecoderLayer`` asserts
    ``mla_use_nope`` for every Kimi-K3 MLA layer); ``index_num_heads <= 64``; ``index_k_norm_type`` one of
    ``rmsnorm`` / ``layernorm``; ``index_topk_freq == 1``; ``mxfp4`` only with the fused key insert on sm_10x.

    :raises warmreg.ConfigError: naming the field, for a malformed ``dsa_config``, a setting vLLM refuses, or a
        missing MLA field.
    """
    dsa = config.text.get("dsa_config")
    if dsa is None or not platform.is_cuda:
        return None
    if not isinstance(dsa, Mapping):
        raise warmreg.ConfigError(
            _FIELD, f"must be an object (got {dsa!r})", plugin=PLUGIN, fix=f"correct it in {config.source}"
        )
    layers = _layers(config, dsa)
    linear = config.text.get("linear_attn_config")
    if isinstance(linear, Mapping) and linear.get("full_attn_layers") is not None:
        full = set(linear["full_attn_layers"])
        layers = tuple(i for i in layers if i in full)
    if not layers:
        return None
    head_dim, heads = _int(config, dsa, "index_head_dim"), _int(config, dsa, "index_num_heads")
    rope_dim = _int(config, dsa, "index_rope_dim", zero=True)
    if rope_dim:
        raise _bad("index_rope_dim", f"is {rope_dim}: vLLM 0.34 refuses indexer RoPE on Kimi-K3, whose MLA layers are "
                   "NoPE-only (mla_use_nope)", config, fix="set it to 0 (Kimi-K3.1's value)")  # fmt: skip
    if heads > 64:
        raise _bad("index_num_heads", f"({heads}) is more than the 64 DeepGEMM's DSA indexer takes", config)
    norm = dsa.get("index_k_norm_type", _DEFAULTS["index_k_norm_type"])
    if norm not in ("rmsnorm", "layernorm"):
        raise _bad("index_k_norm_type", f"must be 'rmsnorm' or 'layernorm' (got {norm!r})", config)
    if dsa.get("index_topk_freq", 1) not in (None, 1):
        raise _bad(
            "index_topk_freq", f"must be 1: Kimi-K3.1 has no index share (got {dsa['index_topk_freq']!r})", config
        )
    fused_k_insert = (
        norm == "layernorm"
    )  # and index_rope_dim 0 (checked above) and no PCP (not a warmreg setting: assumed off)
    fp4 = _indexer_fp4(config, platform, fused_k_insert)
    q_lora = config.get("text.q_lora_rank", int, plugin=PLUGIN, check=positive, default=None)
    dcp = config.get("serving.decode_context_parallel_size", int, plugin=PLUGIN, default=1)
    nope = config.get("text.mla_use_nope", bool, plugin=PLUGIN, default=False)
    gate = config.get("text.mla_use_output_gate", bool, plugin=PLUGIN, default=False)
    fused_prologue = (
        fused_k_insert and dcp == 1 and q_lora is not None and nope and gate
        and mla_cache_is_fp8_ds_mla(config, platform)
    )  # fmt: skip
    return DSALayout(
        layers=layers, index_topk=_int(config, dsa, "index_topk"), index_head_dim=head_dim, index_num_heads=heads,
        index_k_norm_type=norm, indexer_fp4=fp4, fused_k_insert=fused_k_insert,
        fused_prologue=fused_prologue, q_lora_rank=q_lora, kv_lora_rank=positive_text_int(config, "kv_lora_rank"),
        qk_rope_head_dim=positive_text_int(config, "qk_rope_head_dim"), eps=rms_norm_eps(config), dtype=model.dtype,
    )  # fmt: skip
