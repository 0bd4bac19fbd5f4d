"""The attention-backend policy of a DeepSeek-V4 deployment, read by the registrations and domains of
the sparse-attention kernels.

* Which backend runs: :func:`attention_backend` (``serving.attention_backend``). On CUDA DeepSeek-V4
  runs only on :data:`SPARSE_BACKENDS`, vLLM 0.33's ``FLASHMLA_SPARSE_DSV4`` and
  ``FLASHINFER_MLA_SPARSE_DSV4``; which index kernels launch depends on which of the two it is.
* The attention caches' layout (:func:`kv_cache_layout`): what ``serving.kv_cache_dtype`` becomes under the
  backend on the target, refusing the pairs vLLM's backends refuse; and whether FlashInfer's SM10x kernel does
  the inverse RoPE + FP8 quant of its output itself (:func:`flashinfer_rope_quant`).
* The KV-manager block the sparse backends support: 256 tokens (:func:`cache_block_size`), so a
  ratio-``cr`` compressed cache holds ``256 // cr`` compressed tokens per page
  (:func:`compressed_block_size`: 64 for C4, 2 for C128).
* The width of a C128 (HCA) layer's index rows: :func:`c128_active_width` of a step, every width
  :func:`c128_widths` of a deployment, up to :func:`c128_max_width`.

Every function raises :class:`warmreg.ConfigError` naming the field it could not read.
"""

from __future__ import annotations

from collections.abc import Mapping

import triton

import warmreg

from .model import DSV4, PLUGIN, SPARSE_BLOCK_SIZE, kv_cache_dtype

__all__ = [
    "FLASHINFER_KV_CACHE_DTYPES",
    "FLASHINFER_SPARSE",
    "FLASHMLA_SPARSE",
    "KV_LAYOUTS",
    "ROPE_QUANT_HEADS",
    "SPARSE_BACKENDS",
    "attention_backend",
    "c128_active_width",
    "c128_max_width",
    "c128_widths",
    "cache_block_size",
    "compressed_block_size",
    "flashinfer_rope_quant",
    "kv_cache_layout",
]

FLASHMLA_SPARSE = "FLASHMLA_SPARSE_DSV4"
FLASHINFER_SPARSE = "FLASHINFER_MLA_SPARSE_DSV4"
#: The attention backends that run DeepSeek-V4's sparse MLA (and so launch the index kernels).
SPARSE_BACKENDS = (FLASHMLA_SPARSE, FLASHINFER_SPARSE)


def attention_backend(config: warmreg.WarmConfig) -> str:
    """The deployment's attention backend (``serving.attention_backend``).

    :raises warmreg.ConfigError: if it is missing: which index kernels run depends on it.
    """
    return config.get(
        "serving.attention_backend",
        str,
        plugin=PLUGIN,
        fix=f"set serving.attention_backend (DeepSeek-V4 sparse backends: {', '.join(SPARSE_BACKENDS)})",
    )


#: The cache layouts :func:`kv_cache_layout` returns: DeepSeek-V4's ``fp8_ds_mla`` pages (uint8: 448 FP8 NoPE +
#: 64 bf16 RoPE + UE8M0 scales, 584 bytes a token), or plain ``[blocks, block_size, 512]`` rows of per-tensor FP8
#: E4M3 (``fp8``) or of the model dtype (``bfloat16``).
KV_LAYOUTS = ("fp8_ds_mla", "fp8", "bfloat16")
#: ``serving.kv_cache_dtype`` -> layout under ``FLASHINFER_MLA_SPARSE_DSV4``, by CUDA family (vLLM 0.33
#: ``models/deepseek_v4/nvidia/flashinfer_sparse.py``: ``supports_combination``, and the attention class
#: ``_select_dsv4_attn_cls`` builds). SM10x (``DeepseekV4FlashInferMLAAttention``, ``use_fp8_ds_mla_layout``
#: False) "uses the plain per-tensor FP8 KV layout, not fp8_ds_mla": ``auto`` / ``bfloat16`` are bf16 rows,
#: ``fp8`` / ``fp8_e4m3`` FP8 rows. SM12x (``DeepseekV4FlashInferSM120Attention``, ``use_fp8_ds_mla_layout``
#: True) takes only the FP8 names and stores them as fp8_ds_mla (``_resolve_dsv4_kv_cache_dtype``). Any other
#: family is refused: ``supports_compute_capability`` is SM10x and SM12x only.
FLASHINFER_KV_CACHE_DTYPES: Mapping[int, Mapping[str, str]] = {
    10: {"auto": "bfloat16", "bfloat16": "bfloat16", "fp8": "fp8", "fp8_e4m3": "fp8"},
    12: {"fp8": "fp8_ds_mla", "fp8_e4m3": "fp8_ds_mla", "fp8_ds_mla": "fp8_ds_mla"},
}
#: The other attention classes (FlashMLA on CUDA, ROCm's and XPU's DeepSeek-V4 attention) keep
#: ``use_fp8_ds_mla_layout`` True: every FP8 name and ``auto`` become fp8_ds_mla, which vLLM writes back onto
#: ``cache_config.cache_dtype``; ``bfloat16`` raises ("fp8_ds_mla layout only supports fp8 kv-cache").
_FP8_DS_MLA_KV_CACHE_DTYPES = {
    "auto": "fp8_ds_mla",
    "fp8": "fp8_ds_mla",
    "fp8_e4m3": "fp8_ds_mla",
    "fp8_ds_mla": "fp8_ds_mla",
}


def kv_cache_layout(config: warmreg.WarmConfig, platform: warmreg.Platform | None) -> str:
    """The layout of the deployment's attention caches on ``platform``, one of :data:`KV_LAYOUTS`: what vLLM 0.33
    makes of ``serving.kv_cache_dtype`` under ``serving.attention_backend`` (see
    :data:`FLASHINFER_KV_CACHE_DTYPES`; every other backend stores fp8_ds_mla pages).

    :param platform: the target, or None where it is not known: then only a layout that does not depend on it
        (every backend but FlashInfer's) is returned.
    :raises warmreg.ConfigError: naming ``serving.attention_backend`` for FlashInfer's backend on a CUDA target
        outside SM10x and SM12x (or with no target), or ``serving.kv_cache_dtype`` for a cache dtype the backend
        refuses on the target; each error names the target and the fix.
    """
    name = kv_cache_dtype(config)
    backend = attention_backend(config)
    # an engine config's value names the engine field it came from (warmreg.engines)
    came = "".join(f" ({config.origins[k]})" for k in ("kv_cache_dtype", "attention_backend") if k in config.origins)
    if backend != FLASHINFER_SPARSE or (platform is not None and not platform.is_cuda):
        if name not in _FP8_DS_MLA_KV_CACHE_DTYPES:
            where = f" on {platform}" if platform is not None else ""
            raise warmreg.ConfigError(
                "serving.kv_cache_dtype",
                f"is {name!r}, which {backend}{where} stores only as fp8_ds_mla pages, from an FP8 name or auto{came}",
                plugin=PLUGIN,
                fix="set it to fp8_ds_mla (or fp8, auto); a bf16 cache runs on FLASHINFER_MLA_SPARSE_DSV4 on SM10x",
            )
        return _FP8_DS_MLA_KV_CACHE_DTYPES[name]
    if platform is None:
        raise warmreg.ConfigError(
            "serving.attention_backend",
            f"is {FLASHINFER_SPARSE}, whose cache layout depends on the target (SM10x: plain rows, SM12x: fp8_ds_mla)"
            f"{came}",
            plugin=PLUGIN,
            fix="pass the target platform",
        )
    family = platform.sm // 10
    layouts = FLASHINFER_KV_CACHE_DTYPES.get(family)
    if layouts is None:
        raise warmreg.ConfigError(
            "serving.attention_backend",
            f"is {FLASHINFER_SPARSE}, which runs only on SM10x and SM12x GPUs; {platform} is not one{came}",
            plugin=PLUGIN,
            fix=f"use {FLASHMLA_SPARSE} on {platform}, or target cuda:100 / cuda:120",
        )
    if name not in layouts:
        why = {10: "on SM10x it uses the plain per-tensor FP8 KV layout, not fp8_ds_mla",
               12: "on SM12x it takes only FP8 caches (stored as fp8_ds_mla)"}[family]  # fmt: skip
        other = f", or use {FLASHMLA_SPARSE} for fp8_ds_mla pages" if family == 10 else ""
        raise warmreg.ConfigError(
            "serving.kv_cache_dtype",
            f"is {name!r}, which {FLASHINFER_SPARSE} refuses on {platform}: {why}{came}",
            plugin=PLUGIN,
            fix=f"set it to one of {', '.join(layouts)} on {platform}{other}",
        )
    return layouts[name]


#: The one shape FlashInfer's TRTLLM-gen RopeQuant epilogue takes: 128 query heads a rank
#: (``models/deepseek_v4/nvidia/ops/o_proj.py``: ``_ROPE_QUANT_NUM_HEADS``).
ROPE_QUANT_HEADS = 128


def flashinfer_rope_quant(model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> bool:
    """Whether FlashInfer's SM10x attention kernel does the inverse RoPE + FP8 quant of its output itself, so the
    Triton ``fused_inv_rope_fp8_quant`` of the ``wo_a`` projection never runs (vLLM 0.33
    ``DeepseekV4FlashInferMLAAttention.__init__``: ``rope_quant_unsupported_reason``): FLASHINFER_MLA_SPARSE_DSV4 on
    SM10x, 128 query heads a rank (``num_attention_heads / tensor_parallel_size``), the per-tensor FP8 cache
    (:func:`kv_cache_layout` ``fp8``) and an FP8 checkpoint (an FP8 ``wo_a``).

    :raises warmreg.ConfigError: as :func:`kv_cache_layout`.
    """
    if not (platform.is_cuda and platform.sm // 10 == 10 and attention_backend(config) == FLASHINFER_SPARSE):
        return False
    tp = config.get("serving.tensor_parallel_size", int, plugin=PLUGIN, default=1)
    heads = model.num_attention_heads // tp if model.num_attention_heads % tp == 0 else 0
    return heads == ROPE_QUANT_HEADS and model.fp8_checkpoint and kv_cache_layout(config, platform) == "fp8"


def _is_sparse_block(value: int) -> str | None:
    if value == SPARSE_BLOCK_SIZE:
        return None
    return f"must be {SPARSE_BLOCK_SIZE} for the DeepSeek-V4 sparse backends (got {value})"


def cache_block_size(config: warmreg.WarmConfig) -> int:
    """The KV manager's block size ``serving.block_size`` (default and only accepted value: 256).

    :raises warmreg.ConfigError: for any other value: the sparse backends support only 256.
    """
    return config.get("serving.block_size", int, plugin=PLUGIN, default=SPARSE_BLOCK_SIZE, check=_is_sparse_block)


def compressed_block_size(config: warmreg.WarmConfig, compress_ratio: int) -> int:
    """Compressed tokens per page of a ratio-``compress_ratio`` cache: ``block_size // compress_ratio``.

    :raises warmreg.ConfigError: if ``serving.block_size`` is not the 256 the sparse backends support.
    """
    return cache_block_size(config) // compress_ratio


def c128_max_width(max_model_len: int) -> int:
    """``Wmax = round_up(cdiv(max_model_len, 128), 128)``: the widest C128 row (and the buffers' width)."""
    return triton.cdiv(triton.cdiv(max_model_len, 128), 128) * 128


def c128_active_width(max_seq_len: int, max_model_len: int) -> int:
    """The step's C128 width ``W = min(max(next_pow2(max(max_seq_len // 128, 1)), 128), Wmax)``.

    Always a multiple of 128 (FlashMLA decode needs ``extra_topk % B_TOPK == 0``).
    """
    return min(max(warmreg.next_pow2(max(max_seq_len // 128, 1)), 128), c128_max_width(max_model_len))


def c128_widths(max_model_len: int) -> list[int]:
    """Every width :func:`c128_active_width` can return: powers of two from 128 below ``Wmax``, then ``Wmax``."""
    top = c128_max_width(max_model_len)
    return sorted({min(w, top) for w in warmreg.powers_of_two(128, warmreg.next_pow2(top))})
