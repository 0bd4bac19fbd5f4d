"""Reading the serving engines' own config objects into warmreg's canonical settings.

One reader per engine, and each engine's vocabulary is mapped in that reader alone, so plugins only
ever see the **canonical** serving settings (:data:`warmreg.contract.config.SERVING_FIELDS`). Canonical is
vLLM's vocabulary, the one the example configs are written in:

* ``attention_backend``: a member name of vLLM's ``AttentionBackendEnum`` (``FLASHMLA_SPARSE_DSV4``,
  ``FLASHINFER_MLA_SPARSE_DSV4``, ``FLASHMLA``, ...), a string.
* ``kv_cache_dtype``: vLLM's ``CacheConfig.cache_dtype`` names (``fp8_ds_mla``: DeepSeek-V4's FP8 MLA
  page, 584 bytes a token in pages rounded up to 576 bytes; ``fp8`` / ``fp8_e4m3``: per-tensor FP8; ``auto``:
  the model dtype; ``bfloat16``). What a name becomes depends on the backend and the GPU (DeepSeek-V4's
  FlashInfer backend stores ``fp8`` as plain FP8 rows on SM10x and as fp8_ds_mla on SM12x): the plugins
  resolve it for their target; the reader writes back only what vLLM writes back whatever the GPU
  (FlashMLA's fp8_ds_mla).
* ``num_speculative_tokens``: the draft tokens a decode step proposes, the verified token *not*
  counted (vLLM's ``SpeculativeConfig.num_speculative_tokens``): a decode request carries 1 to
  1 + k tokens.
* ``speculative_method``: vLLM's ``SpeculativeConfig.method`` names (``mtp``: the target checkpoint's
  own MTP layers; ``eagle``, ``eagle3``, ``dspark``, ``dflash``, ``ngram``, ``draft_model``, ...).
* ``dtype``: a torch dtype name (``bfloat16``), never ``auto``.

:func:`read` returns an :class:`EngineRead`: the Hugging Face config's values (``to_dict()``, as the
engine hands them over: plugins read transformers' and SGLang's forms as well as the published
config.json), the canonical settings, where each came from, and the settings whose engine value has
no canonical counterpart. Those are not dropped: :meth:`warmreg.WarmConfig.get` raises for them,
naming the engine's field, its value and the values that are accepted, as soon as a plugin reads
one (a setting no plugin of the model reads, e.g. ``speculative_method`` for Kimi-K3, stops nothing).

A ``VllmConfig`` built before the engine started, or on vLLM's CPU platform, does not hold everything the
GPU deployment runs; what the reader cannot know it reads as it is (the README's "The engines' own config
objects" says what to pass with ``serving=``): vLLM takes ``max_num_seqs`` / ``max_num_batched_tokens``
defaults from the GPU (``EngineArgs.get_batch_defaults``; the CPU platform scales them by TP, and for MLA
models disables chunked prefill and sets ``max_num_batched_tokens`` to at least ``max_model_len``), and the
CPU platform forces the block size of MLA models other than DeepSeek-V4 to 16. The block size a hybrid
model (Kimi-K3) runs is raised after the model loads; its plugin computes it from the requested one.

This module imports nothing of torch or of the engines at import time; an engine's own module is
imported only to read an object of that engine (SGLang's ``model_config_of``).
"""

from __future__ import annotations

import enum
import importlib
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from ..values.errors import ConfigError

__all__ = [
    "SGLANG_ATTENTION_BACKENDS",
    "SGLANG_FIELDS",
    "SGLANG_KV_CACHE_DTYPES",
    "SGLANG_SPECULATIVE_METHODS",
    "VLLM_DSV4_BACKENDS",
    "VLLM_PATHS",
    "EngineRead",
    "read",
]


@attrs.frozen
class EngineRead:
    """What :func:`read` found in an engine config object.

    :param engine: the object's type name (``VllmConfig``, ``ServerArgs``), quoted in errors.
    :param model: the Hugging Face config's values (``hf_config.to_dict()``).
    :param serving: the canonical serving settings found.
    :param origins: canonical setting -> the engine field (and value) it was read from.
    :param unmapped: canonical setting -> why the engine's value has no canonical counterpart
        (naming the engine's field, the value and the accepted values).
    """

    engine: str
    model: dict[str, Any]
    serving: dict[str, Any]
    origins: dict[str, str]
    unmapped: dict[str, str]


def _dotted(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = obj.get(part) if isinstance(obj, Mapping) else getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _dtype_name(value: Any) -> Any:
    """``torch.bfloat16`` -> ``bfloat16`` (a string stays as it is)."""
    return value if isinstance(value, str) else str(value).rsplit(".", 1)[-1]


def _model_dict(hf: Any, engine: str) -> dict[str, Any]:
    if hasattr(hf, "to_dict"):
        return dict(hf.to_dict())
    if isinstance(hf, Mapping):
        return dict(hf)
    raise ConfigError(f"{engine}.hf_config", f"is a {type(hf).__name__}, not a Hugging Face config", fix="pass the engine's config object as the engine built it")


class _Reading:
    """Collects one object's canonical settings, their origins and the unmapped values."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.serving: dict[str, Any] = {}
        self.origins: dict[str, str] = {}
        self.unmapped: dict[str, str] = {}

    def set(self, name: str, value: Any, field: str, raw: Any = None) -> None:
        if value is None:
            return
        self.serving[name] = value
        shown = raw if raw is not None else value
        self.origins[name] = f"{self.engine}.{field} = {shown!r}" + (f", read as {value!r}" if raw is not None and raw != value else "")

    def refuse(self, name: str, field: str, value: Any, why: str, accepted: Any) -> None:
        self.unmapped[name] = f"comes from {self.engine}.{field} = {value!r}, {why} (accepted: {', '.join(map(str, accepted))})"

    def done(self, model: dict[str, Any]) -> EngineRead:
        return EngineRead(self.engine, model, self.serving, self.origins, self.unmapped)


# -- vLLM 0.33 (vllm.config.VllmConfig) -------------------------------------------------------------
#: Canonical setting -> the ``VllmConfig`` attribute path it is read from. vLLM's vocabulary is the
#: canonical one, so values are only unwrapped: an ``AttentionBackendEnum`` member to its name, a
#: ``torch.dtype`` to its name.
VLLM_PATHS: Mapping[str, str] = {
    "max_num_batched_tokens": "scheduler_config.max_num_batched_tokens",
    "max_num_seqs": "scheduler_config.max_num_seqs",
    "max_model_len": "model_config.max_model_len",
    "block_size": "cache_config.block_size",
    "kv_cache_dtype": "cache_config.cache_dtype",
    "dtype": "model_config.dtype",
    "attention_backend": "attention_config.backend",
    "tensor_parallel_size": "parallel_config.tensor_parallel_size",
    "num_speculative_tokens": "speculative_config.num_speculative_tokens",
    "speculative_method": "speculative_config.method",
    "indexer_kv_dtype": "attention_config.indexer_kv_dtype",
    "kda_prefill_backend": "additional_config.kda_prefill_backend",
    "kda_decode_backend": "additional_config.kda_decode_backend",
    "decode_context_parallel_size": "parallel_config.decode_context_parallel_size",
    "cp_kv_cache_interleave_size": "parallel_config.cp_kv_cache_interleave_size",
}


_DSV4_ARCH = "DeepseekV4ForCausalLM"

#: vLLM's DeepSeek-V4 attention backend when none is set, or the generic sparse FlashMLA one: the
#: FlashMLA path on every CUDA arch but SM12x, where vLLM takes FlashInfer's SM120 kernels
#: (vllm/models/deepseek_v4/nvidia/model.py, _select_dsv4_attn_cls; there pass
#: serving={"attention_backend": "FLASHINFER_MLA_SPARSE_DSV4"}). FLASHINFER_MLA_SPARSE(_SM120) it refuses.
VLLM_DSV4_BACKENDS: Mapping[str | None, str] = {None: "FLASHMLA_SPARSE_DSV4", "FLASHMLA_SPARSE": "FLASHMLA_SPARSE_DSV4"}
_VLLM_DSV4_REFUSED = ("FLASHINFER_MLA_SPARSE", "FLASHINFER_MLA_SPARSE_SM120")
#: Under FlashMLA vLLM stores DeepSeek-V4's cache in the fp8_ds_mla block format whatever FP8 name it
#: is given, and writes ``fp8_ds_mla`` back onto ``cache_config.cache_dtype`` when the model is built
#: (vllm/models/deepseek_v4/attention.py, _resolve_dsv4_kv_cache_dtype; a non-FP8 name it refuses).
_VLLM_DSV4_FLASHMLA_CACHE = {"auto": "fp8_ds_mla", "fp8": "fp8_ds_mla", "fp8_e4m3": "fp8_ds_mla", "fp8_ds_mla": "fp8_ds_mla"}


def _shown(value: Any) -> Any:
    """An enum member as ``Enum.NAME`` (its value is a class path), anything else as it is."""
    return f"{type(value).__name__}.{value.name}" if isinstance(value, enum.Enum) else value


def _read_vllm(obj: Any) -> EngineRead:
    engine = type(obj).__name__
    r = _Reading(engine)
    model = _model_dict(_dotted(obj, "model_config.hf_config"), engine)
    for name, path in VLLM_PATHS.items():
        raw = _dotted(obj, path)
        if raw is None:
            continue
        value = raw
        if name == "attention_backend" and not isinstance(raw, str):
            # vllm/v1/attention/backends/registry.py: AttentionBackendEnum, whose value is a class path
            value = getattr(raw, "name", raw)
        elif name == "dtype":
            value = _dtype_name(raw)  # ModelConfig.dtype is a torch.dtype
        elif name == "kv_cache_dtype":
            value = str(raw)
        r.set(name, value, path, _shown(raw) if value is not raw else None)
    if _DSV4_ARCH in (model.get("architectures") or ()):
        backend = r.serving.get("attention_backend")
        if backend in _VLLM_DSV4_REFUSED:
            del r.serving["attention_backend"]
            r.refuse(
                "attention_backend", VLLM_PATHS["attention_backend"], backend, "which vLLM refuses for DeepSeek-V4",
                ["FLASHMLA_SPARSE_DSV4", "FLASHINFER_MLA_SPARSE_DSV4", "ROCM_FLASHMLA_SPARSE_DSV4", "none (FlashMLA)"],
            )  # fmt: skip
        elif backend in VLLM_DSV4_BACKENDS:
            r.set("attention_backend", VLLM_DSV4_BACKENDS[backend], VLLM_PATHS["attention_backend"], str(backend))
        cache = r.serving.get("kv_cache_dtype")
        if r.serving.get("attention_backend") == "FLASHMLA_SPARSE_DSV4" and cache is not None:
            if cache in _VLLM_DSV4_FLASHMLA_CACHE:
                r.set("kv_cache_dtype", _VLLM_DSV4_FLASHMLA_CACHE[cache], VLLM_PATHS["kv_cache_dtype"], cache)
            else:
                del r.serving["kv_cache_dtype"]
                r.refuse(
                    "kv_cache_dtype", VLLM_PATHS["kv_cache_dtype"], cache,
                    "which vLLM's FlashMLA DeepSeek-V4 cache (fp8_ds_mla) refuses", _VLLM_DSV4_FLASHMLA_CACHE,
                )  # fmt: skip
    return r.done(model)


# -- SGLang 0.5.23 (sglang.srt.server_args.ServerArgs) ----------------------------------------------
#: The resolved ``ServerArgs`` fields the SGLang reader reads (the recording script records these).
SGLANG_FIELDS = (
    "model_path",
    "chunked_prefill_size",
    "max_running_requests",
    "context_length",
    "page_size",
    "kv_cache_dtype",
    "dtype",
    "attention_backend",
    "prefill_attention_backend",
    "decode_attention_backend",
    "dsv4_attn_backend",
    "tp_size",
    "dcp_size",
    "speculative_algorithm",
    "speculative_num_draft_tokens",
    "speculative_draft_model_path",
)

#: SGLang ``kv_cache_dtype`` -> canonical, by model. For DeepSeek-V4, SGLang's ``fp8_e4m3`` pool on CUDA
#: and ROCm is the V4 layout, "qk_nope_head_dim FP8 (448) + qk_rope_head_dim BF16 (64*2) + nope FP8
#: scales + scale_pad = 584 bytes/token" in pages rounded up to 576 bytes
#: (sglang/srt/mem_cache/deepseek_v4_memory_pool.py, DeepSeekV4SingleKVPool.create_buffer): byte for
#: byte vLLM's ``fp8_ds_mla``. ``auto`` resolves to ``fp8_e4m3`` for DeepSeek-V4
#: (sglang/srt/arg_groups/overrides.py, _deepseek_v4_kv_cache_dtype), which asserts the value is
#: fp8_e4m3 or bfloat16 (bfloat16 is its NPU pool). Other models: SGLang's names are vLLM's.
SGLANG_KV_CACHE_DTYPES: Mapping[str, Mapping[str, str]] = {
    _DSV4_ARCH: {"fp8_e4m3": "fp8_ds_mla", "auto": "fp8_ds_mla", "bfloat16": "bfloat16"},
    "*": {"auto": "auto", "bfloat16": "bfloat16", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"},
}

#: SGLang (``attention_backend``, ``dsv4_attn_backend``) -> canonical. SGLang runs DeepSeek-V4 only
#: on its ``dsv4`` backend (``compressed`` is its deprecated alias, sglang/srt/arg_groups/serving_hook.py).
#: On CUDA ``dsv4`` with ``dsv4_attn_backend`` ``flashmla`` (the default on SM90, and wherever the
#: model is not V4.1: deepseek_v4_hook._default_dsv4_attention_backend) is DeepseekV4AttnBackend
#: (layers/attention/deepseek_v4_trtllm_backend.create_deepseek_v4_attn_backend): FlashMLA's
#: ``flash_mla_with_kvcache`` decode and ``flash_mla_sparse_fwd`` prefill over the fp8_ds_mla pages
#: (layers/attention/deepseek_v4_backend.py), the kernels of vLLM's FLASHMLA_SPARSE_DSV4.
#: ``trtllm`` (uniform FP8 pools) and ``flashmla_mega`` (V4.1 packed layouts, SM100) have no vLLM
#: counterpart. On ROCm ``dsv4`` is DeepseekV4HipRadixBackend (vLLM's ROCM_FLASHMLA_SPARSE_DSV4); the
#: canonical name is the CUDA one because the DeepSeek-V4 kernels that depend on the backend are
#: CUDA-only. ``flashmla`` and ``cutlass_mla`` (other MLA models) are vLLM's FLASHMLA and CUTLASS_MLA.
SGLANG_ATTENTION_BACKENDS: Mapping[tuple[str, str | None], str] = {
    ("dsv4", "flashmla"): "FLASHMLA_SPARSE_DSV4",
    ("compressed", "flashmla"): "FLASHMLA_SPARSE_DSV4",
    ("flashmla", None): "FLASHMLA",
    ("cutlass_mla", None): "CUTLASS_MLA",
}

#: SGLang ``speculative_algorithm`` -> canonical ``speculative_method``. ``EAGLE`` with no draft model
#: of its own is the target checkpoint's MTP (NextN) layers, vLLM's ``mtp`` (SGLang's ``NEXTN`` is
#: ``EAGLE``); with a separate draft model it is vLLM's ``eagle``. DeepSeek-V4 takes only EAGLE
#: (topk 1) and DSPARK (arg_groups/deepseek_v4_hook.apply_deepseek_v4_defaults).
SGLANG_SPECULATIVE_METHODS: Mapping[str, str] = {
    "EAGLE": "mtp",  # or "eagle" with a separate draft model, see _speculative_method
    "EAGLE3": "eagle3",
    "DSPARK": "dspark",
    "DFLASH": "dflash",
    "NGRAM": "ngram",
    "STANDALONE": "draft_model",
}


def _speculative_method(algorithm: str, values: Mapping[str, Any]) -> str | None:
    method = SGLANG_SPECULATIVE_METHODS.get(algorithm)
    if algorithm == "EAGLE":
        draft = values.get("speculative_draft_model_path")
        if draft is not None and draft != values.get("model_path"):
            method = "eagle"
    return method


def _read_sglang(values: Mapping[str, Any], model_config: Any, hf: Any, engine: str) -> EngineRead:
    """Canonical settings from SGLang's resolved values (``ServerArgs.resolved_dict()``).

    :param model_config: SGLang's ``ModelConfig`` (``context_len``, ``dtype``), if known.
    """
    r = _Reading(engine)
    model = _model_dict(hf, engine)
    arch = next(iter(model.get("architectures") or ()), None)

    # A step's tokens: the prefill chunk budget (managers' PrefillAdder takes at most
    # chunked_prefill_size tokens a batch); -1 or None is chunked prefill off, which bounds nothing.
    chunk = values.get("chunked_prefill_size")
    if isinstance(chunk, int) and not isinstance(chunk, bool) and chunk <= 0:
        r.refuse("max_num_batched_tokens", "chunked_prefill_size", chunk, "chunked prefill off, so no step has a token bound", ["an int > 0"])
    else:
        r.set("max_num_batched_tokens", chunk, "chunked_prefill_size")
    r.set("max_num_seqs", values.get("max_running_requests"), "max_running_requests")
    # context_length resolves to None when it is the model's own: ModelConfig.context_len then holds it.
    if values.get("context_length") is not None:
        r.set("max_model_len", values["context_length"], "context_length")
    else:
        r.set("max_model_len", getattr(model_config, "context_len", None), "model_config.context_len")
    r.set("block_size", values.get("page_size"), "page_size")
    r.set("tensor_parallel_size", values.get("tp_size"), "tp_size")
    dcp = values.get("dcp_size")
    if dcp is not None and dcp != 1:
        # SGLang's DCP deals KV slots out one at a time: "Owner rule: slot % dcp_size == dcp_rank"
        # (sglang/srt/layers/dcp/layout.py), vLLM's cp_kv_cache_interleave_size 1.
        r.set("decode_context_parallel_size", dcp, "dcp_size")
        r.set("cp_kv_cache_interleave_size", 1, "dcp_size", dcp)

    dtype = values.get("dtype")
    if dtype == "auto":
        resolved = getattr(model_config, "dtype", None)  # ModelConfig._get_and_verify_dtype's torch.dtype
        if resolved is not None:
            r.set("dtype", _dtype_name(resolved), "model_config.dtype", resolved)
        else:
            r.refuse("dtype", "dtype", dtype, "which SGLang resolves in its ModelConfig, not given here", ["bfloat16", "float16", "float32"])
    elif dtype is not None:
        r.set("dtype", str(dtype), "dtype")

    kv = values.get("kv_cache_dtype")
    if kv is not None:
        table = SGLANG_KV_CACHE_DTYPES.get(arch or "", SGLANG_KV_CACHE_DTYPES["*"])
        if kv in table:
            r.set("kv_cache_dtype", table[kv], "kv_cache_dtype", kv)
        else:
            r.refuse("kv_cache_dtype", "kv_cache_dtype", kv, f"which has no canonical counterpart for {arch}", table)

    # (prefill, decode): the split fields fall back to attention_backend
    # (arg_groups/model_override_base.attention_backends_of).
    prefill = values.get("prefill_attention_backend") or values.get("attention_backend")
    decode = values.get("decode_attention_backend") or values.get("attention_backend")
    backend = decode or prefill
    if prefill and decode and prefill != decode:
        backend = None
        r.refuse(
            "attention_backend", "prefill_attention_backend, decode_attention_backend", (prefill, decode),
            "two backends, which one canonical name cannot say", ["one backend for prefill and decode"],
        )  # fmt: skip
    if backend is not None:
        sub = values.get("dsv4_attn_backend") if backend in ("dsv4", "compressed") else None
        canonical = SGLANG_ATTENTION_BACKENDS.get((backend, sub))
        field = "attention_backend" if sub is None else "attention_backend, dsv4_attn_backend"
        shown = backend if sub is None else (backend, sub)
        if canonical is None:
            accepted = [a if b is None else f"{a} with dsv4_attn_backend {b}" for a, b in SGLANG_ATTENTION_BACKENDS]
            r.refuse("attention_backend", field, shown, "which has no canonical counterpart", accepted)
        else:
            r.set("attention_backend", canonical, field, shown)

    algorithm = values.get("speculative_algorithm")
    if algorithm is not None:
        method = _speculative_method(str(algorithm), values)
        if method is None:
            r.refuse("speculative_method", "speculative_algorithm", algorithm, "which has no canonical counterpart", SGLANG_SPECULATIVE_METHODS)
        else:
            r.set("speculative_method", method, "speculative_algorithm", algorithm)
        drafts = values.get("speculative_num_draft_tokens")
        # The verify window counts the verified token: EAGLE topk 1 has num_steps + 1 of them
        # (speculative_hook), DSPARK gamma + 1 ("DSpark speculative_num_draft_tokens must equal gamma + 1").
        if isinstance(drafts, int) and not isinstance(drafts, bool):
            if drafts >= 1:
                r.set("num_speculative_tokens", drafts - 1, "speculative_num_draft_tokens", drafts)
            else:
                r.refuse("num_speculative_tokens", "speculative_num_draft_tokens", drafts, "a verify window of no token", ["an int >= 1"])
    return r.done(model)


def _resolved_server_args(obj: Any) -> tuple[dict[str, Any], Any]:
    """Resolve a real ``ServerArgs`` (if it is not yet) and return its resolved values and ModelConfig.

    SGLang 0.5.23 resolves only in ``resolve_once()``, and its attributes keep the raw input:
    the resolved values are ``resolved_dict()``'s; the model config is ``model_config_of(sa)``.
    """
    engine = type(obj).__name__
    try:
        obj.resolve_once()  # returns at once when resolution has finished
    except Exception as exc:
        first = (str(exc).splitlines() or [""])[0][:300]
        raise ConfigError(
            engine, f"does not resolve ({type(exc).__name__}: {first})",
            fix="build a ServerArgs that SGLang resolves (on a machine without a GPU: device='cpu'), or pass its resolved values",
        ) from exc  # fmt: skip
    values = dict(obj.resolved_dict())
    module = importlib.import_module("sglang.srt.arg_groups.model_override_base")
    model_config_of: Callable[[Any], Any] = module.model_config_of
    return values, model_config_of(obj)


def _is_server_args(obj: Any) -> bool:
    return callable(getattr(obj, "resolve_once", None)) and callable(getattr(obj, "resolved_dict", None))


def read(obj: Any) -> EngineRead | None:
    """Read an engine config object, or ``None`` if ``obj`` is not one.

    * vLLM: anything with ``model_config.hf_config`` and a ``scheduler_config`` (a ``VllmConfig``), read at :data:`VLLM_PATHS`.
    * SGLang: a ``ServerArgs`` (it has ``resolve_once`` and ``resolved_dict``), resolved if it is not
      yet, with ``model_config_of(server_args)``; or an object holding SGLang's resolved values as
      attributes beside an ``hf_config`` (and optionally SGLang's ``model_config``).

    :raises ConfigError: if a ``ServerArgs`` does not resolve.
    """
    if _dotted(obj, "model_config.hf_config") is not None and getattr(obj, "scheduler_config", None) is not None:
        return _read_vllm(obj)
    engine = type(obj).__name__
    if _is_server_args(obj):
        values, model_config = _resolved_server_args(obj)
        return _read_sglang(values, model_config, model_config.hf_config, engine)
    hf = getattr(obj, "hf_config", None) or _dotted(obj, "model_config.hf_config")
    if hf is not None:
        values = {name: getattr(obj, name, None) for name in SGLANG_FIELDS}
        return _read_sglang(values, getattr(obj, "model_config", None), hf, engine)
    return None
