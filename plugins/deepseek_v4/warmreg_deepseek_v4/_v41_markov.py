"""What DeepSeek-V4.1's fused Markov sampler (:mod:`.v41_markov_sample`, :mod:`.v41_markov_select`) shares: the
block sizes, the draft noise (vLLM 0.34 ``v1/worker/gpu/sample/gumbel.py``: ``spec_step_seed``, ``murmur3_hash32``,
``murmur3_uniform32``, ``_DRAFT_NOISE_SALT``, as Triton device functions and in Python), and when vLLM builds the
sampler (``models/deepseek_v41/nvidia/dspark.py``: ``DSparkDeepseekV4ForCausalLM.__init__``).

The uniform of a draw is MurmurHash3 (x86, 32-bit) of four 32-bit words, ``seed`` low and high, ``pos`` low and the
``offset``, from ``h = 0`` (domain 0) with length 16, split into its high and low 16 bits so that both convert to
fp32 exactly: ``u = hi * 2**-16 + (lo + 0.5) * 2**-32`` (each product and the sum rounded to fp32). A speculative
step ``s`` draws with ``seed ^ (s << 32)``; a draft is keyed by its position before the predicted token plus
``2**30``.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

import warmreg

from .dspark import DSPARK, speculative_method
from .model import DSV4, PLUGIN

__all__ = [
    "BLOCK_SIZE",
    "DRAFT_NOISE_SALT",
    "LOG2E",
    "block_p",
    "fused_markov",
    "markov_rank",
    "num_blocks",
    "uniform32",
]

#: vocabulary entries a program of the sample kernel reduces (vLLM's ``_BLOCK_SIZE``)
BLOCK_SIZE = 2048
#: added to a draft's position before hashing (vLLM's ``_DRAFT_NOISE_SALT``)
DRAFT_NOISE_SALT = 1 << 30
LOG2E = math.log2(math.e)
_M32 = 0xFFFFFFFF


def num_blocks(vocab: int) -> int:
    """Programs a request of the sample kernel: ``cdiv(vocab, BLOCK_SIZE)``."""
    return triton.cdiv(vocab, BLOCK_SIZE)


def block_p(vocab: int) -> int:
    """Partial results a request (``BLOCK_P``): the block count rounded up to a power of two."""
    return triton.next_power_of_2(num_blocks(vocab))


@triton.jit
def _rotl(x, r: tl.constexpr):  # x uint32
    return (x << r) | (x >> (32 - r))


@triton.jit
def _mix(h, k):  # one MurmurHash3 body round on uint32 words
    k = _rotl(k * 0xCC9E2D51, 15) * 0x1B873593
    return _rotl(h ^ k, 13) * 5 + 0xE6546B64


@triton.jit
def draft_uniform(seed, step, pos, offset):
    """The fp32 uniform of a draft: ``seed`` int64 (the request's), ``step`` the speculative step, ``pos`` int64
    (already salted), ``offset`` int32."""
    seed = seed.to(tl.int64) ^ (step.to(tl.int64) << 32)
    pos = pos.to(tl.int64)
    h = (seed ^ seed).to(tl.uint32)  # 0, domain 0
    h = _mix(h, (seed & 0xFFFFFFFF).to(tl.uint32))
    h = _mix(h, ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
    h = _mix(h, (pos & 0xFFFFFFFF).to(tl.uint32))
    h = _mix(h, offset.to(tl.uint32)) ^ 16
    h = (h ^ (h >> 16)) * 0x85EBCA6B
    h = (h ^ (h >> 13)) * 0xC2B2AE35
    h = h ^ (h >> 16)
    hi = (h >> 16).to(tl.int32).to(tl.float32)
    lo = (h & 0xFFFF).to(tl.int32).to(tl.float32)
    return hi * 1.52587890625e-05 + (lo + 0.5) * 2.3283064365386963e-10


def _py_mix(h: int, k: int) -> int:
    k = (k * 0xCC9E2D51) & _M32
    k = ((k << 15) | (k >> 17)) & _M32
    k = (k * 0x1B873593) & _M32
    h ^= k
    h = ((h << 13) | (h >> 19)) & _M32
    return (h * 5 + 0xE6546B64) & _M32


def uniform32(seed: int, step: int, pos: int, offset: int) -> float:
    """Python twin of :func:`draft_uniform` (``pos`` already salted): the same fp32 value."""
    import numpy as np

    seed = (seed ^ (step << 32)) & 0xFFFFFFFFFFFFFFFF
    h = 0
    for word in (seed & _M32, seed >> 32, pos & _M32, offset & _M32):
        h = _py_mix(h, word)
    h ^= 16
    h = ((h ^ (h >> 16)) * 0x85EBCA6B) & _M32
    h = ((h ^ (h >> 13)) * 0xC2B2AE35) & _M32
    h ^= h >> 16
    hi, lo = np.float32(h >> 16), np.float32(h & 0xFFFF)
    return float(hi * np.float32(1.52587890625e-05) + (lo + np.float32(0.5)) * np.float32(2.3283064365386963e-10))


def fused_markov(model: DSV4, config: warmreg.WarmConfig) -> bool:
    """Whether vLLM 0.34 builds V4.1's ``FusedMarkovSampler``: a V4.1 DSpark draft (``serving.speculative_method``
    ``dspark``) with ``additional_config={"dspark_fused_markov": true}`` (warmreg's ``serving.dspark_fused_markov``,
    read from the warmreg config only: vLLM keeps it in ``additional_config``) and probabilistic drafts
    (``serving.draft_sample_method``). vLLM's other conditions, no adaptive verification, no FP64 Gumbel noise, no
    watermark and no batch-sharded sampling, are its defaults and have no warmreg setting: they are taken as met.

    :raises warmreg.ConfigError: for a malformed setting.
    """
    if not model.v41 or speculative_method(config) != DSPARK:
        return False
    on = config.get("serving.dspark_fused_markov", bool, plugin=PLUGIN, default=False)
    method = config.get("serving.draft_sample_method", str, plugin=PLUGIN, default="greedy")
    return on and method == "probabilistic"


def markov_rank(config: warmreg.WarmConfig) -> int:
    """The checkpoint's ``dspark_markov_rank`` (``text.dspark_markov_rank``: V4.1's DSpark weights ship in the target
    checkpoint), a power of two as vLLM asserts.

    :raises warmreg.ConfigError: when it is missing or not a power of two.
    """
    return config.get(
        "text.dspark_markov_rank", int, plugin=PLUGIN,
        check=lambda r: None if r > 0 and r & (r - 1) == 0 else f"must be a power of two (got {r})",
        fix="set the DSpark checkpoint's dspark_markov_rank",
    )  # fmt: skip
