"""SGLang 0.5.23: a ``ServerArgs`` (or its resolved values) read into the canonical settings."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from ..values.errors import ConfigError
from .reading import DSV4_ARCH, EngineRead, Reading, model_dict

__all__ = ["SGLANG_ATTENTION_BACKENDS", "SGLANG_FIELDS", "SGLANG_KV_CACHE_DTYPES", "SGLANG_SPECULATIVE_METHODS", "is_server_args", "read_sglang", "resolved_server_args"]


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
    DSV4_ARCH: {"fp8_e4m3": "fp8_ds_mla", "auto": "fp8_ds_mla", "bfloat16": "bfloat16"},
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


#: The resolved ``ServerArgs`` fields SGLang holds as ints; the other :data:`SGLANG_FIELDS` are strings.
_SGLANG_INTS = frozenset(
    {"chunked_prefill_size", "max_running_requests", "context_length", "page_size", "tp_size", "dcp_size", "speculative_num_draft_tokens"}
)


def read_sglang(values: Mapping[str, Any], model_config: Any, hf: Any, engine: str, hf_field: str = "hf_config") -> EngineRead:
    """Canonical settings from SGLang's resolved values (``ServerArgs.resolved_dict()``).

    :param model_config: SGLang's ``ModelConfig`` (``context_len``, ``dtype``), if known.
    :param hf_field: where ``hf`` was found, quoted in errors.
    :raises ConfigError: for a value of the wrong type (a list, NaN, ``"2"`` or a bool for an int, an int
        for a name), naming the ``ServerArgs`` field; for an hf_config whose values are not a mapping.
    """
    r = Reading(engine)
    model = model_dict(hf, engine, hf_field)
    typed = {
        name: r.count(values.get(name), name) if name in _SGLANG_INTS else r.name(values.get(name), name)
        for name in SGLANG_FIELDS
    }  # fmt: skip
    _sizes(r, typed, model_config)
    _dtypes(r, typed, model_config, next(iter(model.get("architectures") or ()), None))
    _attention_backend(r, typed)
    _speculation(r, typed)
    return r.done(model)


def _sizes(r: Reading, values: Mapping[str, Any], model_config: Any) -> None:
    """The step's tokens and requests, the context, the page, TP and DCP."""
    # A step's tokens: the prefill chunk budget (managers' PrefillAdder takes at most
    # chunked_prefill_size tokens a batch); -1 or None is chunked prefill off, which bounds nothing.
    chunk = values.get("chunked_prefill_size")
    if chunk is not None and chunk <= 0:
        r.refuse("max_num_batched_tokens", "chunked_prefill_size", chunk, "chunked prefill off, so no step has a token bound", ["an int > 0"])
    else:
        r.set("max_num_batched_tokens", chunk, "chunked_prefill_size")
    r.set("max_num_seqs", values.get("max_running_requests"), "max_running_requests")
    # context_length resolves to None when it is the model's own: ModelConfig.context_len then holds it.
    if values.get("context_length") is not None:
        r.set("max_model_len", values["context_length"], "context_length")
    else:
        r.set("max_model_len", r.count(getattr(model_config, "context_len", None), "model_config.context_len"), "model_config.context_len")
    r.set("block_size", values.get("page_size"), "page_size")
    r.set("tensor_parallel_size", values.get("tp_size"), "tp_size")
    dcp = values.get("dcp_size")
    if dcp is not None and dcp != 1:
        # SGLang's DCP deals KV slots out one at a time: "Owner rule: slot % dcp_size == dcp_rank"
        # (sglang/srt/layers/dcp/layout.py), vLLM's cp_kv_cache_interleave_size 1.
        r.set("decode_context_parallel_size", dcp, "dcp_size")
        r.set("cp_kv_cache_interleave_size", 1, "dcp_size", dcp)


def _dtypes(r: Reading, values: Mapping[str, Any], model_config: Any, arch: str | None) -> None:
    """The activation dtype (``auto`` as SGLang's ModelConfig resolved it) and the KV-cache dtype."""
    dtype = values.get("dtype")
    if dtype == "auto":
        resolved = getattr(model_config, "dtype", None)  # ModelConfig._get_and_verify_dtype's torch.dtype
        if resolved is not None:
            r.set("dtype", r.dtype(resolved, "model_config.dtype"), "model_config.dtype", resolved)
        else:
            r.refuse("dtype", "dtype", dtype, "which SGLang resolves in its ModelConfig, not given here", ["bfloat16", "float16", "float32"])
    elif dtype is not None:
        name = r.dtype(dtype, "dtype")  # SGLang's half and float are torch's float16 and float32
        r.set("dtype", name, "dtype", dtype if name != dtype else None)

    kv = values.get("kv_cache_dtype")
    if kv is not None:
        table = SGLANG_KV_CACHE_DTYPES.get(arch or "", SGLANG_KV_CACHE_DTYPES["*"])
        if kv in table:
            r.set("kv_cache_dtype", table[kv], "kv_cache_dtype", kv)
        else:
            r.refuse("kv_cache_dtype", "kv_cache_dtype", kv, f"which has no canonical counterpart for {arch}", table)


def _attention_backend(r: Reading, values: Mapping[str, Any]) -> None:
    """One canonical backend for prefill and decode, or the pair refused."""
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


def _speculation(r: Reading, values: Mapping[str, Any]) -> None:
    """The speculative method and the draft tokens of a decode step."""
    algorithm = values.get("speculative_algorithm")
    if algorithm is None:
        return
    method = _speculative_method(algorithm, values)
    if method is None:
        r.refuse("speculative_method", "speculative_algorithm", algorithm, "which has no canonical counterpart", SGLANG_SPECULATIVE_METHODS)
    else:
        r.set("speculative_method", method, "speculative_algorithm", algorithm)
    drafts = values.get("speculative_num_draft_tokens")
    # The verify window counts the verified token: EAGLE topk 1 has num_steps + 1 of them
    # (speculative_hook), DSPARK gamma + 1 ("DSpark speculative_num_draft_tokens must equal gamma + 1").
    if drafts is None:
        r.refuse("num_speculative_tokens", "speculative_num_draft_tokens", drafts, "which SGLang resolves from the speculative settings, not given here", ["an int >= 1"])
    elif drafts >= 1:
        r.set("num_speculative_tokens", drafts - 1, "speculative_num_draft_tokens", drafts)
    else:
        r.refuse("num_speculative_tokens", "speculative_num_draft_tokens", drafts, "a verify window of no token", ["an int >= 1"])


def resolved_server_args(obj: Any) -> tuple[dict[str, Any], Any]:
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


def is_server_args(obj: Any) -> bool:
    return callable(getattr(obj, "resolve_once", None)) and callable(getattr(obj, "resolved_dict", None))
