"""A typed view of the DeepSeek-V4 config values the kernels need (the published ``config.json`` of DeepSeek-V4-Flash and -Pro).

Every value is read through :meth:`warmreg.WarmConfig.get`, so a missing or invalid field names
itself, this plugin and the fix. The model section may be in any of the forms the engines hand
over: the published config.json, transformers' ``DeepseekV4Config.to_dict()`` (vLLM: ``layer_types``
and ``compress_rates``, ``quant_method`` rewritten to ``deepseek_v4_fp8``) or SGLang's
``_DeepseekV4ConfigAlias.to_dict()``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

import warmreg

__all__ = ["DSV4", "FP8_QUANT_METHODS", "KV_CACHE_DTYPES", "PLUGIN", "compress_ratios", "fp8_checkpoint", "kv_cache_dtype"]

PLUGIN = "warmreg-deepseek-v4"
#: The DeepSeek-V4 sparse backends support only a KV-manager block size of 256 (vLLM 0.33 forces it for
#: DeepSeek-V4 in ``DeepseekV4ForCausalLMConfig``; a VllmConfig built for it reports 256).
SPARSE_BLOCK_SIZE = 256
SWA_PAGE_SIZE = 64
#: ``serving.kv_cache_dtype`` values this plugin knows, vLLM 0.33's ``--kv-cache-dtype`` names that a DeepSeek-V4
#: attention backend declares (``supported_kv_cache_dtypes`` of ``DeepseekV4SparseMLABackend`` and
#: ``DeepseekV4FlashInferMLASparseBackend``): ``fp8_ds_mla`` (DeepSeek-V4's FP8 MLA page), ``auto``, ``bfloat16``,
#: ``fp8`` and ``fp8_e4m3`` (per-tensor FP8 E4M3). Which of them a backend takes on a target, and the cache layout
#: each becomes there, is :func:`warmreg_deepseek_v4.backends.kv_cache_layout`.
KV_CACHE_DTYPES = ("fp8_ds_mla", "auto", "bfloat16", "fp8", "fp8_e4m3")


def kv_cache_dtype(config: warmreg.WarmConfig) -> str:
    """``serving.kv_cache_dtype`` (default ``fp8_ds_mla``), one of :data:`KV_CACHE_DTYPES`, as it is given: the
    layout it becomes depends on the backend and the target (:func:`warmreg_deepseek_v4.backends.kv_cache_layout`).

    :raises warmreg.ConfigError: for any other value, listing the known ones.
    """
    return config.get("serving.kv_cache_dtype", str, plugin=PLUGIN, default="fp8_ds_mla", choices=KV_CACHE_DTYPES)


#: ``quantization_config.quant_method`` of an FP8 checkpoint: the published config.json says ``fp8``;
#: vLLM rewrites it in place to its ``deepseek_v4_fp8`` config (a subclass of its Fp8Config,
#: ``DeepseekV4ForCausalLMConfig.verify_and_update_model_config``), so a VllmConfig's hf_config says that.
FP8_QUANT_METHODS = ("fp8", "deepseek_v4_fp8")


def fp8_checkpoint(config: warmreg.WarmConfig | Mapping[str, Any] | Any) -> bool:
    """Whether the checkpoint's linear weights (so ``wo_a``) are FP8: ``quantization_config.quant_method``
    is one of :data:`FP8_QUANT_METHODS`.

    :param config: a :class:`warmreg.WarmConfig`, a config.json dict, or a Hugging Face config object
        (transformers' ``DeepseekV4Config``, SGLang's ``_DeepseekV4ConfigAlias``).
    :raises warmreg.ConfigError: if ``quantization_config`` is neither an object nor absent.
    """
    if isinstance(config, warmreg.WarmConfig):
        model: Any = config.model
    elif isinstance(config, Mapping):
        model = config
    else:
        model = {"quantization_config": getattr(config, "quantization_config", None)}
    quant = model.get("quantization_config")
    if quant is None:
        return False
    if not isinstance(quant, Mapping):
        if not hasattr(quant, "quant_method"):  # a quantization config object, e.g. transformers'
            raise warmreg.ConfigError("model.quantization_config", f"must be an object (got {quant!r})", plugin=PLUGIN)
        quant = {"quant_method": quant.quant_method}
    method = quant.get("quant_method")
    return getattr(method, "value", method) in FP8_QUANT_METHODS


def _ratio(value: Any) -> str | None:
    return (
        None
        if isinstance(value, int) and value in (0, 1, 4, 128)
        else f"has ratio {value!r}; DeepSeek-V4 uses 0, 4 or 128"
    )


def compress_ratios(model: Mapping[str, Any]) -> tuple[int, ...]:
    """Per-layer compress ratios, MTP layers included, with 0 read as 1 (SWA-only).

    Reads the legacy ``compress_ratios`` list, or ``compress_rates`` mapped over ``layer_types``
    (transformers' normalized form), as vLLM's ``get_compress_ratios`` does.
    """
    if "compress_ratios" in model:
        raw = model["compress_ratios"]
        if not isinstance(raw, Sequence) or isinstance(raw, str):
            raise warmreg.ConfigError("model.compress_ratios", "must be a list of ints", plugin=PLUGIN)
        for i, r in enumerate(raw):
            problem = _ratio(r)
            if problem:
                raise warmreg.ConfigError(f"model.compress_ratios[{i}]", problem, plugin=PLUGIN, fix="use 0, 4 or 128")
        ratios = [max(1, int(r)) for r in raw]
    elif "layer_types" in model:
        rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128, "sliding_attention": 1}
        rates.update({k: int(v) for k, v in dict(model.get("compress_rates") or {}).items()})
        try:
            ratios = [rates[t] for t in model["layer_types"]]
        except KeyError as exc:
            raise warmreg.ConfigError("model.layer_types", f"has unknown layer type {exc}", plugin=PLUGIN) from exc
        ratios += [1] * int(model.get("num_nextn_predict_layers", 0) or 0)
    else:
        raise warmreg.ConfigError(
            "model.compress_ratios",
            "is missing",
            plugin=PLUGIN,
            fix="use the model's published config.json (it lists compress_ratios)",
        )
    return tuple(ratios)


@attrs.frozen(kw_only=True)
class DSV4:
    """The DeepSeek-V4 values kernels read, validated once per config."""

    hidden_size: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    num_attention_heads: int
    o_groups: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    sliding_window: int
    rms_norm_eps: float
    hc_mult: int
    num_nextn_predict_layers: int
    ratios: tuple[int, ...]
    vision_max_n_token: int
    dtype: str
    #: the vision tower's depth: > 0 marks a vision checkpoint (DeepSeek-V4-Flash-Vision-Exp), 0 a text one
    vision_n_layers: int = 0
    #: the checkpoint's linear weights are FP8 (:func:`fp8_checkpoint`)
    fp8_checkpoint: bool = False

    @classmethod
    def from_config(cls, config: warmreg.WarmConfig) -> DSV4:
        """Read and validate the model section.

        :raises warmreg.ConfigError: naming the field.
        """

        def pos(field: str) -> int:
            return config.get(
                f"model.{field}", int, plugin=PLUGIN, check=lambda v: None if v > 0 else f"must be > 0 (got {v})"
            )

        return cls(
            hidden_size=pos("hidden_size"),
            head_dim=pos("head_dim"),
            qk_rope_head_dim=pos("qk_rope_head_dim"),
            q_lora_rank=pos("q_lora_rank"),
            num_attention_heads=pos("num_attention_heads"),
            o_groups=pos("o_groups"),
            index_n_heads=pos("index_n_heads"),
            index_head_dim=pos("index_head_dim"),
            index_topk=pos("index_topk"),
            sliding_window=pos("sliding_window"),
            rms_norm_eps=config.get("model.rms_norm_eps", float, plugin=PLUGIN),
            hc_mult=config.get("model.hc_mult", int, plugin=PLUGIN, default=4),
            num_nextn_predict_layers=config.get("model.num_nextn_predict_layers", int, plugin=PLUGIN, default=0),
            ratios=compress_ratios(config.model),
            vision_max_n_token=config.get("model.vision_max_n_token", int, plugin=PLUGIN, default=0),
            dtype=config.get("serving.dtype", str, plugin=PLUGIN, default="bfloat16"),
            vision_n_layers=config.get("model.vision_n_layers", int, plugin=PLUGIN, default=0),
            fp8_checkpoint=fp8_checkpoint(config),
        )

    @property
    def has_c4(self) -> bool:
        """Whether any layer compresses by 4 (CSA: indexer + top-k)."""
        return 4 in self.ratios

    @property
    def has_c128(self) -> bool:
        """Whether any layer compresses by 128 (HCA)."""
        return 128 in self.ratios

    @property
    def image_tokens(self) -> int:
        """How far an image span widens the sparse-SWA rows: ``vision_max_n_token`` on a vision checkpoint
        (``vision_n_layers > 0``), else 0 (vLLM 0.34 ``DeepseekSparseSWAMetadataBuilder.max_image_tokens``)."""
        return self.vision_max_n_token if self.vision_n_layers > 0 else 0

    @property
    def nope_dim(self) -> int:
        """The quantized NoPE part of a head (448 = 512 - 64)."""
        return self.head_dim - self.qk_rope_head_dim
