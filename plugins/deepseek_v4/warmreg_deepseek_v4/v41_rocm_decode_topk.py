"""DeepSeek-V4.1 ROCm decode: the two-launch top-k stream (vLLM 0.34 ``models/deepseek_v41/amd/rocm.py``:
``_compute_global_topk_ragged_indices_and_indptr_old``, launching ``_compute_topk_lens_kernel`` then
``_pack_global_topk_ragged_kernel``).

V4.1's ROCm model carries its own copies of DeepSeek-V4's two kernels, the same source, the same launch (a program a
token with 1024-column count tiles; ``(T, cdiv(K, 128))`` pack programs), the same math: warmreg serves them with
DeepSeek-V4's ops, :class:`.rocm_decode_topk.RocmTopkLens` and :class:`.rocm_decode_topk.RocmPackTopkRagged` (one key
each). This module registers them with V4.1's predicates.

Where it runs: ``_decode_topk_ragged`` of every compressed layer (ratio 1 or 2) of a decode step, once a step for
each ratio (the index source memoizes it), through ``compute_global_topk_ragged_indices_and_indptr``, on the batches
the one-launch pack (:mod:`.v41_rocm_topk_pack`) does not take: every batch without ``--monokernel`` or off gfx942,
and under it a batch of more than 16 decode tokens (planned when a step can hold more,
:func:`._v41_rocm.max_decode_tokens`). The compressed block is ``block_size // ratio`` (a runtime int).
"""

from __future__ import annotations

import warmreg

from ._v41_rocm import compressed_layers, max_decode_tokens, monokernel
from .model import DSV4
from .rocm_decode_topk import RocmPackTopkRagged, RocmTopkLens
from .v41_rocm_topk_pack import MAX_ROWS

__all__ = ["register", "two_launch_predicate"]


def two_launch_predicate(
    model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform
) -> warmreg.Predicate | bool:
    """Where the two launches run: ROCm with compressed layers, except gfx942 under ``--monokernel`` when no decode
    step exceeds the one-launch pack's 16 tokens.

    :raises warmreg.ConfigError: from :func:`._v41_rocm.monokernel`.
    """
    if not compressed_layers(model):
        return False
    if monokernel(config, platform) and max_decode_tokens(config) <= MAX_ROWS:
        return warmreg.rocm_arch_in("gfx950")
    return warmreg.is_rocm


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register DeepSeek-V4's ROCm count and pack for V4.1 (see the module docstring).

    :raises warmreg.ConfigError: from :func:`._v41_rocm.monokernel`.
    """
    when = two_launch_predicate(model, config, platform)
    for kernel in (RocmTopkLens(), RocmPackTopkRagged()):
        registry.add(kernel, when=when)
