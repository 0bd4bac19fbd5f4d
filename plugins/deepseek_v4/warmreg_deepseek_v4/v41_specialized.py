"""Whether a DeepSeek-V4.1 deployment takes vLLM 0.34's specialized decode on NVIDIA GPUs, and what it requires.

vLLM builds the specialized decode (a decode executor over the stock backbone that runs FULL-graph decode steps) when
``additional_config={"decode_backend": "latency_specialized"}`` (``models/deepseek_v41/nvidia/specialized_decode/
__init__.py: specialized_decode_config``; ``auto``, the default, keeps the stock decode, any other value is refused).
``unsupported`` then lists every requirement the deployment misses, and vLLM refuses to start on any:

* a GB300 (``current_platform.is_device_capability(103)``: ``cuda:103`` only);
* tensor parallel size 4, no pipeline, data, expert, decode- or prefill-context parallelism, no micro-batching;
* DSpark speculative decoding (``speculative_config.method == "dspark"``) without adaptive verification;
* the ``FLASHINFER_MLA_SPARSE_DSV41`` attention backend, an ``fp8`` / ``fp8_e4m3`` KV cache, and the MXFP4 indexer
  (``attention_config.indexer_kv_dtype == "mxfp4"``) with sparse logits;
* FULL CUDA graphs for decode batches only, no ``torch.compile`` of the model, no sleep mode, no runtime weight
  updates, LoRA, KV transfer or batch invariance, DeepGEMM and NVLink multicast.

:func:`specialized_decode` checks those warmreg reads (the target, the parallel sizes, the speculative method, the
backend, the KV cache and indexer dtypes) and refuses a deployment that misses one, as vLLM does; the others
(adaptive verification, ``indexer_sparse_logits``, the CUDA-graph mode, compilation, sleep mode, weight transfer,
LoRA, KV transfer, batch invariance, DeepGEMM, multicast) are not warmreg settings and are taken as vLLM requires
them, since vLLM refuses to start otherwise.

Settings (canonical names): ``serving.decode_backend`` (``auto``, the default, or ``latency_specialized``; vLLM's
``additional_config.decode_backend``), with ``serving.tensor_parallel_size``, ``serving.speculative_method``,
``serving.attention_backend``, ``serving.kv_cache_dtype`` and ``serving.indexer_kv_dtype``.
"""

from __future__ import annotations

import warmreg

from ._serving import serving_int
from .model import DSV4, PLUGIN

__all__ = ["DECODE_BACKENDS", "specialized_decode", "specialized_decode_misses"]

#: ``serving.decode_backend`` values vLLM 0.34 accepts (``specialized_decode_config``).
DECODE_BACKENDS = ("auto", "latency_specialized")


def specialized_decode_misses(config: warmreg.WarmConfig, platform: warmreg.Platform) -> list[str]:
    """The requirements of the specialized decode that a deployment on ``platform`` misses, among those warmreg reads
    (vLLM's ``unsupported``, in its words); empty when none is missed."""
    tp = serving_int(config, "tensor_parallel_size", 1)
    dcp = serving_int(config, "decode_context_parallel_size", 1)
    pcp = serving_int(config, "prefill_context_parallel_size", 1)
    method = config.get("serving.speculative_method", str, plugin=PLUGIN, default=None)
    drafts = serving_int(config, "num_speculative_tokens", 0)
    backend = config.get("serving.attention_backend", str, plugin=PLUGIN, default=None)
    cache = config.get("serving.kv_cache_dtype", str, plugin=PLUGIN, default="auto")
    indexer = config.get("serving.indexer_kv_dtype", str, plugin=PLUGIN, default="auto")
    requirements = {
        f"a GB300 (SM103) GPU (the target is {platform})": platform.is_cuda and platform.sm == 103,
        f"tensor parallel size 4 without decode or prefill context parallelism (TP {tp}, DCP {dcp}, PCP {pcp})": (
            tp == 4 and dcp == 1 and pcp == 1
        ),
        f"DSpark speculative decoding (speculative_method {method!r}, {drafts} tokens)": (
            method == "dspark" and drafts > 0
        ),
        f"the FLASHINFER_MLA_SPARSE_DSV41 attention backend, an fp8 KV cache and the MXFP4 indexer (backend {backend!r},"
        f" kv_cache_dtype {cache!r}, indexer_kv_dtype {indexer!r})": (
            backend == "FLASHINFER_MLA_SPARSE_DSV41" and cache in ("fp8", "fp8_e4m3") and indexer == "mxfp4"
        ),
    }
    return [need for need, ok in requirements.items() if not ok]


def specialized_decode(config: warmreg.WarmConfig, model: DSV4, platform: warmreg.Platform) -> bool:
    """Whether a V4.1 deployment runs the specialized decode: ``serving.decode_backend`` ``latency_specialized`` on a
    DeepSeek-V4.1 model (False for ``auto`` and for DeepSeek-V4, whose model has no specialized decode).

    :raises warmreg.ConfigError: for a value vLLM refuses, or ``latency_specialized`` on a deployment that misses a
        requirement (:func:`specialized_decode_misses`), which vLLM refuses to start.
    """
    value = config.get("serving.decode_backend", str, plugin=PLUGIN, default="auto", choices=DECODE_BACKENDS)
    if value == "auto" or not model.v41:
        return False
    missing = specialized_decode_misses(config, platform)
    if missing:
        raise warmreg.ConfigError(
            "serving.decode_backend", f"is 'latency_specialized', which vLLM 0.34 builds only with {'; '.join(missing)}",
            plugin=PLUGIN, fix="set it to 'auto', or meet the listed requirements",
        )  # fmt: skip
    return True
