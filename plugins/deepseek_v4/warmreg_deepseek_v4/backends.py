"""The attention-backend policy of a DeepSeek-V4 deployment, read by the registrations and domains of
the sparse-attention kernels.

* Which backend runs: :func:`attention_backend` (``serving.attention_backend``). On CUDA DeepSeek-V4
  runs only on :data:`SPARSE_BACKENDS`, vLLM 0.33's ``FLASHMLA_SPARSE_DSV4`` and
  ``FLASHINFER_MLA_SPARSE_DSV4``; which index kernels launch depends on which of the two it is.
* The KV-manager block the sparse backends support: 256 tokens (:func:`cache_block_size`), so a
  ratio-``cr`` compressed cache holds ``256 // cr`` compressed tokens per page
  (:func:`compressed_block_size`: 64 for C4, 2 for C128).
* The width of a C128 (HCA) layer's index rows: :func:`c128_active_width` of a step, every width
  :func:`c128_widths` of a deployment, up to :func:`c128_max_width`.

Every function raises :class:`warmreg.ConfigError` naming the field it could not read.
"""

from __future__ import annotations

import triton

import warmreg

from .model import PLUGIN, SPARSE_BLOCK_SIZE

__all__ = [
    "FLASHINFER_SPARSE",
    "FLASHMLA_SPARSE",
    "SPARSE_BACKENDS",
    "attention_backend",
    "c128_active_width",
    "c128_max_width",
    "c128_widths",
    "cache_block_size",
    "compressed_block_size",
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
