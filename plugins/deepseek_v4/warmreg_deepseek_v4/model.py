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

from ._v41_engram import EngramLayout, engram_layout

__all__ = [
    "DSV4",
    "FP8_QUANT_METHODS",
    "KV_CACHE_DTYPES",
    "MODEL_TYPES",
    "PLUGIN",
    "V41_MODEL_TYPE",
    "compress_ratios",
    "fp8_checkpoint",
    "kv_cache_dtype",
    "mxfp8_checkpoint",
    "v41_compress_ratios",
]

PLUGIN = "warmreg-deepseek-v4"
#: DeepSeek-V4.1's ``model_type`` (vLLM 0.34 ``transformers_utils/configs/deepseek_v41.py: DeepseekV41Config``; its
#: architecture is ``DeepseekV41ForCausalLM``, ``model_executor/models/registry.py``). Its config.json nests the text
#: model under ``text_config`` and the vision tower under ``vision_config``; vLLM's config class flattens both onto
#: the top level (the vision fields as ``vision_*``), so a VllmConfig's hf_config is flat.
V41_MODEL_TYPE = "deepseek_v41"
#: The model types this plugin plans: DeepSeek-V4 and DeepSeek-V4.1.
MODEL_TYPES = ("deepseek_v4", V41_MODEL_TYPE)
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
    quant = _quantization_config(config)
    if quant is None:
        return False
    method = quant.get("quant_method")
    return getattr(method, "value", method) in FP8_QUANT_METHODS


def mxfp8_checkpoint(config: warmreg.WarmConfig | Mapping[str, Any] | Any) -> bool:
    """Whether the checkpoint's linear layers are MXFP8: an FP8 checkpoint (:func:`fp8_checkpoint`) whose
    ``quantization_config`` has ``weight_block_size`` [32, 32] and ``scale_fmt`` ``ue8m0``. vLLM 0.34's DeepSeek-V4.1
    quant config (``models/deepseek_v41/quant_config.py: DeepseekV4FP8Config.get_quant_method``) then gives every
    linear layer MXFP8 weights and dynamic MXFP8 activations (``kMxfp8Dynamic``).

    :param config: as for :func:`fp8_checkpoint`.
    :raises warmreg.ConfigError: if ``quantization_config`` is neither an object nor absent.
    """
    quant = _quantization_config(config)
    if quant is None or not fp8_checkpoint(config):
        return False
    block = quant.get("weight_block_size")
    return list(block or ()) == [32, 32] and quant.get("scale_fmt") == "ue8m0"


def _quantization_config(config: warmreg.WarmConfig | Mapping[str, Any] | Any) -> Mapping[str, Any] | None:
    """The checkpoint's ``quantization_config`` as a mapping (top level, else a V4.1 ``text_config``'s), or None."""
    if isinstance(config, warmreg.WarmConfig):
        model: Any = config.model
    elif isinstance(config, Mapping):
        model = config
    else:
        model = {k: getattr(config, k, None) for k in ("quantization_config", "text_config")}
    quant = model.get("quantization_config")
    text = model.get("text_config")
    if quant is None and isinstance(text, Mapping):
        quant = text.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, Mapping):
        if not hasattr(quant, "quant_method"):  # a quantization config object, e.g. transformers'
            raise warmreg.ConfigError("model.quantization_config", f"must be an object (got {quant!r})", plugin=PLUGIN)
        return {k: getattr(quant, k, None) for k in ("quant_method", "weight_block_size", "scale_fmt")}
    return quant


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


def v41_compress_ratios(text: Mapping[str, Any], layers: int) -> tuple[int, ...]:
    """DeepSeek-V4.1's per-layer compress ratios over ``layers`` layers (backbone and MTP), as published: 0 a
    sliding-window-only layer, 1 a full-length compressed cache, 2 a ratio-2 one. Layers past the list (MTP) are 0,
    as vLLM 0.34 reads them (``models/deepseek_v41/attention.py: DeepseekV4Attention.__init__``).

    :raises warmreg.ConfigError: naming ``text.compress_ratios`` if it is not a list of 0, 1 and 2.
    """
    raw = text.get("compress_ratios")
    if raw is None:
        return (0,) * layers
    if not isinstance(raw, Sequence) or isinstance(raw, str):
        raise warmreg.ConfigError("text.compress_ratios", "must be a list of ints", plugin=PLUGIN)
    for i, r in enumerate(raw):
        if not (isinstance(r, int) and not isinstance(r, bool) and r in (0, 1, 2)):
            problem = f"has ratio {r!r}; DeepSeek-V4.1 uses 0, 1 or 2"
            raise warmreg.ConfigError(f"text.compress_ratios[{i}]", problem, plugin=PLUGIN, fix="use 0, 1 or 2")
    return tuple(int(r) for r in raw[:layers]) + (0,) * max(0, layers - len(raw))


def _layer_ids(config: warmreg.WarmConfig, field: str) -> tuple[int, ...]:
    """The sorted layer ids of the V4.1 list ``text.<field>`` (empty if absent).

    :raises warmreg.ConfigError: if it is not a list of non-negative ints.
    """
    raw = config.text.get(field)
    if raw is None:
        return ()
    if not isinstance(raw, Sequence) or isinstance(raw, str):
        raise warmreg.ConfigError(f"text.{field}", "must be a list of layer ids", plugin=PLUGIN)
    for i, v in enumerate(raw):
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
            raise warmreg.ConfigError(f"text.{field}[{i}]", f"must be a layer id >= 0 (got {v!r})", plugin=PLUGIN)
    return tuple(sorted(set(raw)))


def _v41_vision(config: warmreg.WarmConfig) -> tuple[int, int]:
    """A V4.1 checkpoint's ``(vision_n_layers, vision_max_n_token)``: the flat ``vision_*`` fields vLLM's
    ``DeepseekV41Config`` writes, else ``vision_config.num_hidden_layers`` (default 0) and
    ``vision_config.max_image_tokens`` (default 1024), as that config class reads them.

    :raises warmreg.ConfigError: naming the field that is not an int.
    """
    if "vision_n_layers" in config.model:
        return (
            config.get("model.vision_n_layers", int, plugin=PLUGIN, default=0),
            config.get("model.vision_max_n_token", int, plugin=PLUGIN, default=1024),
        )
    vision = config.model.get("vision_config") or {}
    if not isinstance(vision, Mapping):
        raise warmreg.ConfigError("model.vision_config", "must be an object", plugin=PLUGIN)
    values = []
    for name, default in (("num_hidden_layers", 0), ("max_image_tokens", 1024)):
        value = vision.get(name, default)
        if not isinstance(value, int) or isinstance(value, bool):
            raise warmreg.ConfigError(f"model.vision_config.{name}", f"must be int (got {value!r})", plugin=PLUGIN)
        values.append(value)
    return values[0], values[1]


def _nonneg(value: int) -> str | None:
    return None if value >= 0 else f"must be >= 0 (got {value})"


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
    #: a DeepSeek-V4.1 checkpoint (``model_type`` :data:`V41_MODEL_TYPE`). Its ``ratios`` are as published
    #: (:func:`v41_compress_ratios`: 0 sliding window only, 1 and 2 compressed), not DeepSeek-V4's 1 / 4 / 128,
    #: so :attr:`has_c4` and :attr:`has_c128` are False; :attr:`v41_compressed_ratios` lists its compressed kinds.
    v41: bool = False
    #: V4.1: the backbone layers that own a compressor and compressed cache (``kv_source_layer_ids``); the other
    #: compressed layers reuse the latest source below them
    kv_source_layer_ids: tuple[int, ...] = ()
    #: V4.1: the backbone layers that run an indexer (``index_source_layer_ids``)
    index_source_layer_ids: tuple[int, ...] = ()
    #: backbone layers (``num_hidden_layers``; 0 where a V4 config leaves it out: V4 ops do not read it)
    num_hidden_layers: int = 0
    #: the checkpoint's linear layers are MXFP8 (:func:`mxfp8_checkpoint`)
    mxfp8_checkpoint: bool = False
    #: V4.1: its engram layers (``engram_layer_ids`` and the fields their kernels read), None without them
    engram: EngramLayout | None = None
    #: V4.1 two-level candidate filtering: the index layer that publishes each row's top candidate blocks
    #: (``candidate_source_layer_id``, -1: none), how many (``candidate_topk_blocks``, 0: none) and their size in
    #: compressed positions (``candidate_block_size``); vLLM's ``getattr`` defaults
    candidate_source_layer_id: int = -1
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0

    @classmethod
    def from_config(cls, config: warmreg.WarmConfig) -> DSV4:
        """Read and validate the model section: DeepSeek-V4's top-level fields, or for DeepSeek-V4.1
        (:data:`V41_MODEL_TYPE`) the text model's (``text.<field>``: ``text_config`` where the config nests it).

        :raises warmreg.ConfigError: naming the field.
        """
        if config.model_type == V41_MODEL_TYPE:
            return cls._from_v41(config)

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

    @classmethod
    def _from_v41(cls, config: warmreg.WarmConfig) -> DSV4:
        """A DeepSeek-V4.1 config, read as vLLM 0.34's ``DeepseekV41Config`` and ``DeepseekV4Attention`` read it."""

        def pos(field: str, default: int | None = None) -> int:
            check = lambda v: None if v > 0 else f"must be > 0 (got {v})"  # noqa: E731
            if default is None:
                return config.get(f"text.{field}", int, plugin=PLUGIN, check=check)
            return config.get(f"text.{field}", int, plugin=PLUGIN, check=check, default=default)

        layers = pos("num_hidden_layers")
        mtp = config.get("text.num_nextn_predict_layers", int, plugin=PLUGIN, default=0)
        vision_layers, vision_tokens = _v41_vision(config)
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
            rms_norm_eps=config.get("text.rms_norm_eps", float, plugin=PLUGIN),
            hc_mult=pos("hc_mult", 4),
            num_nextn_predict_layers=mtp,
            ratios=v41_compress_ratios(config.text, layers + mtp),
            vision_max_n_token=vision_tokens,
            dtype=config.get("serving.dtype", str, plugin=PLUGIN, default="bfloat16"),
            vision_n_layers=vision_layers,
            fp8_checkpoint=fp8_checkpoint(config),
            v41=True,
            kv_source_layer_ids=_layer_ids(config, "kv_source_layer_ids"),
            index_source_layer_ids=_layer_ids(config, "index_source_layer_ids"),
            num_hidden_layers=layers,
            mxfp8_checkpoint=mxfp8_checkpoint(config),
            engram=engram_layout(config, PLUGIN),
            candidate_source_layer_id=config.get(
                "text.candidate_source_layer_id", int, plugin=PLUGIN, default=-1,
                check=lambda v: None if v >= -1 else f"must be a layer id or -1 (got {v})",
            ),
            candidate_topk_blocks=config.get("text.candidate_topk_blocks", int, plugin=PLUGIN, default=0, check=_nonneg),
            candidate_block_size=config.get("text.candidate_block_size", int, plugin=PLUGIN, default=0, check=_nonneg),
        )  # fmt: skip

    @property
    def v41_compressed_ratios(self) -> tuple[int, ...]:
        """V4.1: the compress ratios of its kv-source layers (the layers that run a compressor), sorted; () for V4."""
        if not self.v41:
            return ()
        return tuple(sorted({self.ratios[i] for i in self.kv_source_layer_ids if i < len(self.ratios) and self.ratios[i]}))

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
