"""What DeepSeek-V4.1's compressor kernels read from a deployment: whether they run, the ring capacity, and the
record the compressed cache stores (vLLM 0.34 ``models/deepseek_v41/attention.py`` and ``compressor.py``).

* The compressor (``DeepseekCompressor``) lives on the kv-source layers of a compressed ratio (1 or 2):
  :attr:`.model.DSV4.v41_compressed_ratios`.
* Prefill context parallelism (:func:`pcp_size`) switches a ratio-2 compressor to rows gathered across ranks.
* The ring of a ratio-2 compressor holds ``max(8, next_pow2(num_speculative_tokens + 2))`` rows
  (``CompressorStateCache.__init__``): :func:`ring_capacity`.
* The compressed cache's record (:func:`compressed_record`, ``DeepseekV4Attention.__init__`` with
  ``_resolve_dsv4_kv_cache_dtype`` and ``_use_v41_mxfp8_kv_record``): FlashInfer's backend on SM10x
  (``DeepseekV4FlashInferMLAAttention``, ``use_fp8_ds_mla_layout`` False) stores plain ``[512]`` rows, bf16 for
  ``auto`` / ``bfloat16`` and per-tensor FP8 for ``fp8*``; every other CUDA attention class packs records: on the
  SM100 family the V4.1 MXFP8 record (528 bytes), or the NVFP4 one (288 bytes) for ``nvfp4_ds_mla``, which is what
  an unspecific ``auto`` / ``fp8`` becomes under FlashMLA's mega attention (``FLASHMLA_MEGA_ATTN_DSV41``,
  ``packed_kv_cache_dtype``); elsewhere (SM90, SM12x) DeepSeek-V4's 584-byte ``fp8_ds_mla`` record.
"""

from __future__ import annotations

import torch

import warmreg

from .model import DSV4, PLUGIN

__all__ = [
    "RECORDS", "V41_KV_CACHE_DTYPES", "check_index_vector", "compressed_record", "indexer_block_size", "index_ratios",
    "pcp_size", "v41_fp8_indexer", "ring_capacity", "v41_register_predicate",
]  # fmt: skip

#: ``serving.kv_cache_dtype`` values a V4.1 deployment may name (vLLM 0.34 ``CacheDType`` values its backends take).
V41_KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_ds_mla", "nvfp4_ds_mla")
#: The compressed-cache records, by :func:`compressed_record`'s name: bytes per token of the packed ones.
RECORDS = {"fp8_ds_mla": 584, "mxfp8": 528, "nvfp4": 288, "bfloat16": 0, "fp8": 0}


def v41_register_predicate(model: DSV4, config: warmreg.WarmConfig) -> tuple[warmreg.Predicate | bool, tuple[int, ...]]:
    """``(when, ratios)``: CUDA for a DeepSeek-V4.1 model with compressor layers, and their ratios."""
    ratios = model.v41_compressed_ratios
    return (warmreg.is_cuda if ratios else False), ratios


def index_ratios(model: DSV4) -> tuple[int, ...]:
    """V4.1: the compress ratios of the backbone ``index_source_layer_ids`` layers that build an indexer, sorted (the
    ratio every ``DeepseekV4Indexer`` and its ``DeepseekV4IndexerCache`` takes from its layer); () for V4 or a model
    whose index sources are all sliding-window layers."""
    if not model.v41:
        return ()
    layers = model.index_source_layer_ids
    return tuple(sorted({model.ratios[i] for i in layers if i < model.num_hidden_layers and model.ratios[i] > 0}))


def v41_fp8_indexer(config: warmreg.WarmConfig) -> bool:
    """Whether V4.1's indexer K cache is FP8 (``dsa_indexer_uses_fp4`` False): ``serving.indexer_kv_dtype`` ``auto``
    (vLLM's CUDA default, FP8: the ROCm MXFP4 default is DeepSeek-V4's only) or ``fp8``. On ``mxfp4`` V4.1 runs the
    MXFP4 indexer kernels, which this plugin does not plan for V4.1.

    :raises warmreg.ConfigError: for a value outside ``auto``, ``fp8``, ``mxfp4``.
    """
    value = config.get("serving.indexer_kv_dtype", str, plugin=PLUGIN, default="auto", choices=("auto", "fp8", "mxfp4"))
    return value != "mxfp4"


def indexer_block_size(platform: warmreg.Platform) -> int:
    """Uncompressed tokens a block of V4.1's indexer K cache holds at the kernels: ``DeepseekV41IndexerBackend.
    get_supported_kernel_block_sizes`` (64 on SM90 and SM12x, 128 elsewhere)."""
    return 64 if platform.is_cuda and platform.sm // 10 in (9, 12) else 128


def ring_capacity(config: warmreg.WarmConfig) -> int:
    """Rows of a ratio-2 compressor's ring: ``max(8, next_pow2(num_speculative_tokens + 2))``.

    :raises warmreg.ConfigError: for a negative ``serving.num_speculative_tokens``.
    """
    spec = config.get(
        "serving.num_speculative_tokens", int, plugin=PLUGIN, default=0,
        check=lambda v: None if v >= 0 else f"must be >= 0 (got {v})",
    )  # fmt: skip
    return max(8, warmreg.next_pow2(spec + 2))


def pcp_size(config: warmreg.WarmConfig) -> int:
    """``serving.prefill_context_parallel_size`` (default 1). Above 1 a ratio-2 compressor pools a chunk's first
    group from rows gathered across ranks and stores the ring with ``save_ring_rows`` (``DeepseekCompressor.forward``).

    :raises warmreg.ConfigError: for a size below 1.
    """
    return config.get(
        "serving.prefill_context_parallel_size", int, plugin=PLUGIN, default=1,
        check=lambda v: None if v >= 1 else f"must be >= 1 (got {v})",
    )  # fmt: skip


def compressed_record(config: warmreg.WarmConfig, model: DSV4, platform: warmreg.Platform) -> str:
    """The record V4.1's compressed cache stores on a CUDA ``platform``, a key of :data:`RECORDS` (the module
    docstring has vLLM's rules), under the attention class :func:`.v41.attention_kind` picks.

    :raises warmreg.ConfigError: from :func:`.v41.attention_kind`, or naming ``serving.kv_cache_dtype`` for a dtype
        the attention class refuses there (a plain-row name under a packing class, a packed one under FlashInfer's
        plain rows, ``nvfp4_ds_mla`` off SM100).
    """
    from .v41 import attention_kind  # here: .v41 imports the op modules that import this one

    name = config.get("serving.kv_cache_dtype", str, plugin=PLUGIN, default="auto", choices=V41_KV_CACHE_DTYPES)
    kind = attention_kind(config, model, platform)
    sm100 = platform.sm // 10 == 10
    if kind == "flashinfer":
        if name.endswith("_ds_mla"):
            raise warmreg.ConfigError(
                "serving.kv_cache_dtype", f"is {name!r}, a packed record; FlashInfer's V4.1 attention on {platform} "
                "stores plain rows", plugin=PLUGIN, fix="use auto, bfloat16 or fp8",
            )  # fmt: skip
        return "fp8" if name.startswith("fp8") else "bfloat16"
    if name in ("auto", "fp8"):
        name = "nvfp4_ds_mla" if kind == "mega" else "fp8_ds_mla"
    if not name.endswith("_ds_mla"):
        raise warmreg.ConfigError(
            "serving.kv_cache_dtype", f"is {name!r}; DeepSeek-V4.1's packed KV layouts take only fp8 caches",
            plugin=PLUGIN, fix="set it to fp8 (or fp8_ds_mla, nvfp4_ds_mla on SM100)",
        )  # fmt: skip
    if not sm100:
        if name == "nvfp4_ds_mla":
            raise warmreg.ConfigError(
                "serving.kv_cache_dtype", f"is nvfp4_ds_mla, which needs the V4.1 records FlashMLA decodes on SM100 only "
                f"(not {platform})", plugin=PLUGIN, fix="use fp8_ds_mla",
            )  # fmt: skip
        return "fp8_ds_mla"
    return "nvfp4" if name == "nvfp4_ds_mla" else "mxfp8"


def check_index_vector(kernel: str, name: str, t: torch.Tensor | None, length: int, dtype: torch.dtype) -> None:
    """``t`` is a contiguous 1-D ``dtype`` tensor of ``>= length`` entries.

    :raises warmreg.LaunchError: naming ``name``.
    """
    if t is None or t.dtype != dtype or t.ndim != 1 or t.shape[0] < length or (t.shape[0] > 1 and t.stride(0) != 1):
        got = "None" if t is None else f"{t.dtype} {tuple(t.shape)}"
        raise warmreg.LaunchError(
            kernel, f"{name} must be a contiguous 1-D {dtype} tensor of >= {length} entries (got {got})"
        )
