"""Shared pieces of the DSpark Markov draft ops (``markov_noise``, ``markov_step``): vLLM 0.34's draft Gumbel noise
as Triton device functions and as PyTorch references, and the constants of its launches.

The noise is vLLM's ``gumbel_noised_argmax`` draw (``v1/worker/gpu/sample/gumbel.py``): a 32-bit murmur3 of the
request seed (its speculative step in the high 32 bits, ``spec_step_seed``), the position before the sampled token
plus the draft salt ``2**30``, and the token id; the uniform ``u = (h + 0.5) * 2**-32`` built from its two 16-bit
halves in fp32 (both convert exactly, so the sum rounds once); and the noise ``-log(-log1p(-u))`` whose inner
``log1p(-u)`` is a degree-8 series below ``u = 0.25`` and ``log(max(1 - u, 2**-24))`` above. Every operation is
spelled here as the same fp32 / uint32 operation in the same order, so the bits agree.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["DRAFT_SALT", "NOISE_ROWS", "RB", "VB", "VT", "gumbel_log_arg_reference", "step_seed_reference"]

#: vLLM's ``_DRAFT_NOISE_SALT``: added to the position of draft draws so they differ from the target's.
DRAFT_SALT = 1 << 30
#: Vocabulary entries a step program owns, rows it holds, entries a tile multiplies (vLLM's ``VB``, ``RB``, ``VT``).
VB, RB, VT = 256, 16, 64
#: Sampled rows (requests x draft steps) up to which vLLM precomputes the noise (``NOISE_ROWS``).
NOISE_ROWS = 32
_M32 = 0xFFFFFFFF


@triton.jit
def _rotl(x, r: tl.constexpr):
    return (x << r) | (x >> (32 - r))


@triton.jit
def _round(h, word):
    word = _rotl(word * 0xCC9E2D51, 15) * 0x1B873593
    return _rotl(h ^ word, 13) * 5 + 0xE6546B64


@triton.jit
def _hash(seed, pos, v):
    """murmur3 over (seed lo, seed hi, pos lo, v) with a zero start (domain 0), length 16, then the finalizer."""
    h = (seed ^ seed).to(tl.uint32)  # a zero that keeps seed's shape
    h = _round(h, (seed & 0xFFFFFFFF).to(tl.uint32))
    h = _round(h, ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
    h = _round(h, (pos & 0xFFFFFFFF).to(tl.uint32))
    h = _round(h, v.to(tl.uint32)) ^ 16
    h = (h ^ (h >> 16)) * 0x85EBCA6B
    h = (h ^ (h >> 13)) * 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def step_seed(seed, step):
    """The request seed with the draft step in its high 32 bits (vLLM's ``spec_step_seed``)."""
    return seed ^ (step.to(tl.int64) << 32)


@triton.jit
def gumbel_log_arg(seed, pos, v):
    """``-log1p(-u)`` of the draw at (seed, pos, token ``v``): the noise is ``-log`` of it."""
    h = _hash(seed.to(tl.int64), pos.to(tl.int64), v)
    u = (h >> 16).to(tl.int32).to(tl.float32) * 1.52587890625e-05 + (
        (h & 0xFFFF).to(tl.int32).to(tl.float32) + 0.5
    ) * 2.3283064365386963e-10
    p = 1.0 / 8.0
    p = 1.0 / 7.0 + u * p
    p = 1.0 / 6.0 + u * p
    p = 1.0 / 5.0 + u * p
    p = 1.0 / 4.0 + u * p
    p = 1.0 / 3.0 + u * p
    p = 1.0 / 2.0 + u * p
    p = 1.0 + u * p
    inner = tl.where(u < 0.25, -u * p, tl.log(tl.maximum(1.0 - u, 5.960464477539063e-08)))
    return -inner


def step_seed_reference(seeds: torch.Tensor, step: int | torch.Tensor) -> torch.Tensor:
    """PyTorch :func:`step_seed` of int64 ``seeds``."""
    return seeds.long() ^ (torch.as_tensor(step, dtype=torch.int64) << 32)


def _round_reference(h: torch.Tensor, word: torch.Tensor) -> torch.Tensor:
    word = (word * 0xCC9E2D51) & _M32
    word = ((word << 15) | (word >> 17)) & _M32
    word = (word * 0x1B873593) & _M32
    h = h ^ word
    h = ((h << 13) | (h >> 19)) & _M32
    return (h * 5 + 0xE6546B64) & _M32


def gumbel_log_arg_reference(seed: torch.Tensor, pos: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """PyTorch :func:`gumbel_log_arg` (uint32 arithmetic on int64 masked to 32 bits, fp32 float math); the
    arguments broadcast together.

    :param seed: int64 step seeds (:func:`step_seed_reference`).
    :param pos: int64 salted positions.
    :param v: token ids.
    """
    seed, pos, v = torch.broadcast_tensors(seed.long(), pos.long(), v.long())
    h = torch.zeros_like(seed)
    for word in (seed & _M32, (seed >> 32) & _M32, pos & _M32, v & _M32):
        h = _round_reference(h, word)
    h = h ^ 16
    h = ((h ^ (h >> 16)) * 0x85EBCA6B) & _M32
    h = ((h ^ (h >> 13)) * 0xC2B2AE35) & _M32
    h = h ^ (h >> 16)
    hi = (h >> 16).to(torch.float32) * torch.tensor(1.52587890625e-05, dtype=torch.float32)
    lo = ((h & 0xFFFF).to(torch.float32) + 0.5) * torch.tensor(2.3283064365386963e-10, dtype=torch.float32)
    u = hi + lo
    p = torch.full_like(u, 1.0 / 8.0)
    for c in (7, 6, 5, 4, 3, 2):
        p = torch.tensor(1.0 / c, dtype=torch.float32) + u * p
    p = 1.0 + u * p
    direct = torch.log(torch.clamp(1.0 - u, min=5.960464477539063e-08))
    return -torch.where(u < 0.25, -u * p, direct)
