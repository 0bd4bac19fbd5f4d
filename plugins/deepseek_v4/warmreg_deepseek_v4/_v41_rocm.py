"""What DeepSeek-V4.1's ROCm kernels read from a deployment (vLLM 0.34 ``models/deepseek_v41/amd``): the attention
backend it accepts, the ``--monokernel`` switch and the batch sizes its decode helpers take.

* ``models/deepseek_v41/__init__.py`` imports the ``amd`` model on ROCm; its decoder layer builds
  ``DeepseekV41ROCMAiterMLAAttention`` (``amd/model.py: _select_dsv4_attn_cls``), refusing any attention backend other
  than ``ROCM_FLASHMLA_SPARSE_DSV41`` (or the deprecated ``ROCM_FLASHMLA_SPARSE_DSV4``) and prefill context
  parallelism (:func:`check_rocm_deployment`).
* ``--monokernel`` (``KernelConfig.monokernel``; warmreg's ``serving.monokernel``, default false) switches on the mono
  decode layer and the decode helpers of ``amd/ops``: ``ops.enabled()`` on gfx942 only (the one-launch top-k pack),
  ``ops.monokernel_cdna3_or_4()`` on gfx942 and gfx950 (the one-launch SWA decode metadata). ``MonoDecodeLayer._create``
  refuses the flag off CDNA3/CDNA4 or at a tensor-parallel size other than 2, 4 or 8 (:func:`monokernel`); its MoE
  check (``_unsupported_moe``) reads expert weights warmreg does not model.
* :func:`max_decode_tokens`: the most decode tokens a step holds (``max_num_seqs`` requests of ``1 +
  num_speculative_tokens`` tokens, within ``max_num_batched_tokens``), which bounds the helpers' batch tiles.
"""

from __future__ import annotations

import warmreg

from ._serving import serving_int
from .dspark import num_speculative_tokens
from .model import DSV4, PLUGIN

__all__ = [
    "MONOKERNEL_ARCHS", "ROCM_V41_BACKENDS", "check_rocm_deployment", "compressed_layers", "max_decode_tokens",
    "monokernel",
]  # fmt: skip

#: The attention backends vLLM 0.34 builds V4.1's ROCm attention for (``_select_dsv4_attn_cls``).
ROCM_V41_BACKENDS = ("ROCM_FLASHMLA_SPARSE_DSV41", "ROCM_FLASHMLA_SPARSE_DSV4")
#: The ROCm architectures ``--monokernel`` runs on (``CDNA_VERSIONS``: CDNA3 gfx942, CDNA4 gfx950).
MONOKERNEL_ARCHS = ("gfx942", "gfx950")


def check_rocm_deployment(config: warmreg.WarmConfig) -> None:
    """Refuse what V4.1's ROCm model refuses: an attention backend outside :data:`ROCM_V41_BACKENDS` (an unset one is
    vLLM's choice, ROCm's V4.1 backend) and prefill context parallelism.

    :raises warmreg.ConfigError: naming ``serving.attention_backend`` or ``serving.prefill_context_parallel_size``.
    """
    backend = config.get("serving.attention_backend", str, plugin=PLUGIN, default=ROCM_V41_BACKENDS[0])
    if backend not in ROCM_V41_BACKENDS:
        raise warmreg.ConfigError(
            "serving.attention_backend",
            f"is {backend!r}, which vLLM 0.34 does not run DeepSeek-V4.1 on (ROCm)",
            plugin=PLUGIN,
            fix=f"use {ROCM_V41_BACKENDS[0]} on ROCm",
        )
    if serving_int(config, "prefill_context_parallel_size", 1) > 1:
        raise warmreg.ConfigError(
            "serving.prefill_context_parallel_size",
            "is above 1: vLLM 0.34 runs DeepSeek-V4.1 prefill context parallelism on CUDA only",
            plugin=PLUGIN,
            fix="set it to 1 on ROCm",
        )


def monokernel(config: warmreg.WarmConfig, platform: warmreg.Platform) -> bool:
    """``serving.monokernel`` on a ROCm ``platform`` (False elsewhere: the mono decode is the ``amd`` model's).

    :raises warmreg.ConfigError: for the flag on a ROCm arch outside :data:`MONOKERNEL_ARCHS` or at a tensor-parallel
        size other than 2, 4 or 8 (``MonoDecodeLayer._create`` refuses both at startup).
    """
    on = config.get("serving.monokernel", bool, plugin=PLUGIN, default=False)
    if not (on and platform.is_rocm):
        return False
    tp = serving_int(config, "tensor_parallel_size", 1)
    if platform.arch not in MONOKERNEL_ARCHS or tp not in (2, 4, 8):
        raise warmreg.ConfigError(
            "serving.monokernel",
            f"is true on {platform} at tensor-parallel size {tp}: vLLM 0.34's mono decode needs "
            f"{' or '.join(MONOKERNEL_ARCHS)} and tensor-parallel size 2, 4 or 8",
            plugin=PLUGIN,
            fix="turn serving.monokernel off there",
        )
    return True


def max_decode_tokens(config: warmreg.WarmConfig) -> int:
    """The most decode tokens one step holds: ``min(max_num_batched_tokens, max_num_seqs * (1 +
    num_speculative_tokens))``."""
    per_request = 1 + num_speculative_tokens(config)
    return min(serving_int(config, "max_num_batched_tokens"), serving_int(config, "max_num_seqs") * per_request)


def compressed_layers(model: DSV4) -> bool:
    """Whether a backbone layer has a compressed ratio (1 or 2): those layers' decode reads the top-k as cache slots
    (``_forward_decode`` with ``swa_only`` False)."""
    return model.v41 and any(r > 0 for r in model.ratios[: model.num_hidden_layers])
