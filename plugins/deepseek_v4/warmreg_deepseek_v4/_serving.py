"""Serving settings that several DeepSeek-V4 kernels read, each read and checked one way."""

from __future__ import annotations

import warmreg

from .model import DSV4, PLUGIN

__all__ = ["INDEXER_KV_DTYPES", "dcp_world_size", "indexer_kv_dtype", "max_model_len", "mxfp4_indexer", "serving_int"]

#: ``serving.indexer_kv_dtype`` values DeepSeek-V4 accepts, in vLLM's names (vLLM 0.33
#: ``v1/attention/backends/mla/indexer.py``: ``DSA_INDEXER_KV_DTYPES`` plus ``"auto"``).
INDEXER_KV_DTYPES = ("auto", "fp8", "mxfp4")
#: CDNA4, the one ROCm generation vLLM 0.33 runs the MXFP4 indexer on (``get_cdna_version() == 4``).
MXFP4_ROCM_ARCHS = frozenset({"gfx950"})


def serving_int(config: warmreg.WarmConfig, field: str, default: int | None = None) -> int:
    """The int ``serving.<field>`` (required when ``default`` is None).

    :raises warmreg.ConfigError: if it is missing (and has no default) or not an int.
    """
    if default is None:
        return config.get(f"serving.{field}", int, plugin=PLUGIN)
    return config.get(f"serving.{field}", int, plugin=PLUGIN, default=default)


def max_model_len(config: warmreg.WarmConfig) -> int:
    """``serving.max_model_len`` (required; WarmConfig checks serving ints are > 0)."""
    return serving_int(config, "max_model_len")


def dcp_world_size(config: warmreg.WarmConfig, model: DSV4) -> int:
    """``serving.decode_context_parallel_size`` (default 1).

    :raises warmreg.ConfigError: for DCP with C4 layers, which the DeepSeek-V4 C4 indexer does not support.
    """
    dcp = serving_int(config, "decode_context_parallel_size", 1)
    if dcp > 1 and model.has_c4:
        raise warmreg.ConfigError(
            "serving.decode_context_parallel_size",
            "must be 1: the DeepSeek-V4 C4 indexer does not support DCP",
            plugin=PLUGIN,
        )
    return dcp


def _is_sm10x(platform: warmreg.Platform) -> bool:
    """CUDA's SM10x family (B200 / GB200 / B300): vLLM's ``is_device_capability_family(100)``."""
    return platform.is_cuda and platform.sm // 10 == 10


def indexer_kv_dtype(config: warmreg.WarmConfig, model: DSV4, platform: warmreg.Platform) -> str:
    """The C4 indexer's K cache format on ``platform``: ``"fp8"`` or ``"mxfp4"``, resolved as vLLM 0.33 does.

    ``serving.indexer_kv_dtype`` (default ``"auto"``) is one of :data:`INDEXER_KV_DTYPES`. ``"auto"`` is ``"fp8"``
    (``AttentionConfig.resolve_indexer_kv_dtype("fp8")`` in ``dsa_indexer_uses_fp4``) except where vLLM's ROCm
    platform hook ``platforms/rocm.py: _maybe_default_dsv4_mxfp4_indexer`` rewrites it to ``"mxfp4"`` first: a
    ``deepseek_v4`` model on CDNA4 (gfx950) with aiter enabled (the target's ``+aiter`` feature, as for the aiter
    Q/KV RMSNorm), ``indexer_sparse_logits`` off and DCP = PCP = 1. warmreg sees the model type, the arch, aiter
    (``+aiter``) and DCP (``serving.decode_context_parallel_size``, which a C4 model must leave at 1 anyway); it
    cannot see ``attention_config.indexer_sparse_logits`` (a DeepSeek-V4.1 feature: assumed off) or
    ``prefill_context_parallel_size`` (assumed 1). With either set, vLLM keeps FP8: set ``"fp8"`` explicitly.

    ``"mxfp4"`` is checked as ``dsa_indexer_uses_fp4`` checks it, once the model has C4 layers (without them no
    indexer reads the setting): CUDA needs the SM10x family (Hopper and SM120 are refused), ROCm needs CDNA4 and
    aiter, and XPU is refused (it reports no device capability, so vLLM's SM10x check fails there too).

    :raises warmreg.ConfigError: for a value outside :data:`INDEXER_KV_DTYPES`, or ``"mxfp4"`` on a platform
        that cannot serve it, naming ``serving.indexer_kv_dtype`` and the fix.
    """
    field = "serving.indexer_kv_dtype"
    value = config.get(field, str, plugin=PLUGIN, default="auto", choices=INDEXER_KV_DTYPES)
    rocm_mxfp4 = (warmreg.rocm_arch_in(*MXFP4_ROCM_ARCHS) & warmreg.has_feature("aiter"))(platform)
    if value == "auto":
        return "mxfp4" if rocm_mxfp4 and serving_int(config, "decode_context_parallel_size", 1) == 1 else "fp8"
    if value == "fp8" or not model.has_c4:
        return value
    if platform.is_cuda and not _is_sm10x(platform):
        problem = f"is 'mxfp4', which needs a Blackwell datacenter GPU (sm_10x: B200, GB200, B300); {platform} is not"
        raise warmreg.ConfigError(
            field, problem, plugin=PLUGIN, fix="set it to 'fp8' (or 'auto'), or target cuda:100 / cuda:103"
        )
    if platform.is_rocm and not rocm_mxfp4:
        missing = "is not CDNA4" if platform.arch not in MXFP4_ROCM_ARCHS else "does not enable aiter (+aiter)"
        problem = f"is 'mxfp4', which on ROCm runs on aiter's kernels on CDNA4 (gfx950); {platform} {missing}"
        raise warmreg.ConfigError(
            field, problem, plugin=PLUGIN, fix="set it to 'fp8' (or 'auto'), or target rocm:gfx950+aiter"
        )
    if platform.is_xpu:
        problem = "is 'mxfp4', which vLLM 0.33 runs only on CUDA sm_10x and ROCm gfx950 with aiter"
        raise warmreg.ConfigError(field, problem, plugin=PLUGIN, fix="set it to 'fp8' (or 'auto')")
    return value


def mxfp4_indexer(config: warmreg.WarmConfig, model: DSV4, platform: warmreg.Platform) -> bool:
    """Whether the C4 indexer runs on an MXFP4 K cache on ``platform`` (:func:`indexer_kv_dtype` is ``"mxfp4"``)."""
    return model.has_c4 and indexer_kv_dtype(config, model, platform) == "mxfp4"
