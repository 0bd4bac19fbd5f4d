"""Reading the serving engines' own config objects into warmreg's canonical settings.

One reader per engine, and each engine's vocabulary is mapped in that reader alone, so plugins only
ever see the **canonical** serving settings (:data:`warmreg.engines.settings.SERVING_FIELDS`). Canonical is
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
* ``dtype``: a torch dtype name (``bfloat16``, ``float16``, ``float32``; the engines' ``half`` and ``float``
  read as torch's names), never ``auto``.

:func:`read` returns an :class:`EngineRead`: the Hugging Face config's values (``to_dict()``, as the
engine hands them over: plugins read transformers' and SGLang's forms as well as the published
config.json), the canonical settings, where each came from, and the settings whose engine value has
no canonical counterpart. Those are not dropped: :meth:`warmreg.WarmConfig.get` raises for them,
naming the engine's field, its value and the values that are accepted, as soon as a plugin reads
one (a setting no plugin of the model reads, e.g. ``speculative_method`` for Kimi-K3, stops nothing).
A value of a type the engine never holds (a list for a name; a bool, float or string for an int;
``-1`` for a dtype; an hf_config whose ``to_dict()`` is no mapping) is refused at once, a
``ConfigError`` naming the engine's field and the value: nothing is read as something else or dropped.

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

from typing import Any

from .reading import EngineRead, dotted
from .sglang import (
    SGLANG_ATTENTION_BACKENDS,
    SGLANG_FIELDS,
    SGLANG_KV_CACHE_DTYPES,
    SGLANG_SPECULATIVE_METHODS,
    is_server_args,
    read_sglang,
    resolved_server_args,
)
from .vllm import VLLM_DSV4_BACKENDS, VLLM_PATHS, read_vllm

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


def read(obj: Any) -> EngineRead | None:
    """Read an engine config object, or ``None`` if ``obj`` is not one.

    * vLLM: anything with ``model_config.hf_config`` and a ``scheduler_config`` (a ``VllmConfig``), read at :data:`VLLM_PATHS`.
    * SGLang: a ``ServerArgs`` (it has ``resolve_once`` and ``resolved_dict``), resolved if it is not
      yet, with ``model_config_of(server_args)``; or an object holding SGLang's resolved values as
      attributes beside an ``hf_config`` (and optionally SGLang's ``model_config``).

    :raises ConfigError: if a ``ServerArgs`` does not resolve, or a value read is of the wrong type (naming
        the engine's field and the value).
    """
    if dotted(obj, "model_config.hf_config") is not None and getattr(obj, "scheduler_config", None) is not None:
        return read_vllm(obj)
    engine = type(obj).__name__
    if is_server_args(obj):
        values, model_config = resolved_server_args(obj)
        return read_sglang(values, model_config, model_config.hf_config, engine, "model_config.hf_config")
    field = "hf_config" if getattr(obj, "hf_config", None) is not None else "model_config.hf_config"
    hf = dotted(obj, field)
    if hf is not None:
        values = {name: getattr(obj, name, None) for name in SGLANG_FIELDS}
        return read_sglang(values, getattr(obj, "model_config", None), hf, engine, field)
    return None
