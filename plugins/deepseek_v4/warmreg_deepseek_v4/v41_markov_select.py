"""DeepSeek-V4.1's fused Markov sampler, second kernel of a draft step: draw each request's draft token from the
block partials by inverse CDF and gather its Markov embedding (vLLM 0.34
``models/deepseek_v41/nvidia/ops/fused_markov.py``: ``_markov_select_kernel``, launched by
``FusedMarkovSampler.__call__`` after ``_markov_sample_kernel``, :mod:`.v41_markov_sample`).

For request ``r < R`` of step ``s`` with ``row = r * NUM_STEPS + s``, ``i = idx_mapping[row]``, ``t = temperature[i]``
(0 when ``i < 0``), the partials ``m[b]``, ``q[b]`` of its ``B = cdiv(VOCAB, 2048)`` blocks (``b < BLOCK_P``; past
``B``: ``-inf`` and 0)::

    t == 0:  token = q[argmax_b m[b]]                            (the block argmax the sample kernel kept; ties left)
    t != 0:  w[b] = q[b] * exp2(m[b] - max m)  (0 where q[b] <= 0),   c = cumsum(w)
             u    = uniform32(seeds[i] ^ (s << 32), sample_pos[row] - 1 + 2**30, VOCAB) * sum(w)
             k    = min(#{b : c[b] <= u}, last b with w[b] > 0)
             u'   = (u - (c[k] - w[k])) * exp2(max m - m[k])
             v[j] = exp2(fp32(cache[i, s, k * 2048 + j]) * log2(e) / t - m[k])   (0 past VOCAB)
             token = k * 2048 + min(#{j : cumsum(v)[j] <= u'}, last j with v[j] > 0)
    draft_tokens[r, s] = token,   embed[r, :] = embed_weight[token, :]

``uniform32`` is :func:`._v41_markov.draft_uniform`. ``draft_tokens`` int64 ``[max_num_reqs, NUM_STEPS]`` (its row
stride a runtime int), ``embed_weight`` ``[VOCAB, RANK]`` (``markov_w1``, contiguous, the draft dtype) and ``embed``
``[>= R, RANK]`` (the sampler's scratch, the next step's bias GEMM input, same dtype); ``sample_pos``,
``idx_mapping`` and ``seeds`` int64, ``temperature`` fp32, ``cache`` the draft-logits cache of the sample step. One
program a request with the default 4 warps, as vLLM's.

Where it runs: with :mod:`.v41_markov_sample`, once per speculative step of a V4.1 DSpark draft with the fused
sampler (:func:`._v41_markov.fused_markov`).

Key: the cache and embedding dtypes, ``NUM_STEPS``, ``VOCAB``, ``RANK``, ``BLOCK_SIZE``, ``BLOCK_P`` and the warps.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import numpy as np
import torch
import triton
import triton.language as tl

import warmreg

from ._v41_markov import (
    BLOCK_SIZE,
    DRAFT_NOISE_SALT,
    LOG2E,
    block_p,
    draft_uniform,
    fused_markov,
    markov_rank,
    num_blocks,
    uniform32,
)
from .dspark import num_speculative_tokens
from .model import DSV4, PLUGIN

__all__ = ["MarkovSelect", "MarkovSelectKey", "markov_select_reference", "register"]

_NUM_WARPS = 4
_LOG2E = tl.constexpr(LOG2E)
_SALT = tl.constexpr(DRAFT_NOISE_SALT)


@triton.jit(do_not_specialize=["step", "tokens_stride"])
def _markov_select_kernel(
    step,
    idx_mapping_ptr,  # int64 [>= R * NUM_STEPS]
    sample_pos_ptr,  # int64 [>= R * NUM_STEPS]
    temperature_ptr,  # fp32 [max_num_reqs]
    seeds_ptr,  # int64 [max_num_reqs]
    cache_ptr,  # [max_num_reqs, NUM_STEPS, VOCAB], contiguous
    tokens_ptr,  # int64 [max_num_reqs, NUM_STEPS], unit column stride
    tokens_stride,
    weight_ptr,  # [VOCAB, RANK], contiguous (markov_w1)
    embed_ptr,  # [>= R, RANK], contiguous
    partial_max_ptr,  # fp32 [>= R, BLOCK_P]
    partial_sum_ptr,
    NUM_STEPS: tl.constexpr,  # the cache's middle extent
    VOCAB: tl.constexpr,  # the cache's row length and the hash offset
    RANK: tl.constexpr,  # the embedding width (a power of two)
    BLOCK_SIZE: tl.constexpr,  # vocabulary entries a block
    BLOCK_P: tl.constexpr,  # partials a request
):
    r = tl.program_id(0).to(tl.int64)
    row = r * NUM_STEPS + step
    slot = tl.load(idx_mapping_ptr + row).to(tl.int64)
    live = slot >= 0
    t = tl.load(temperature_ptr + slot, mask=live, other=0.0).to(tl.float32)
    p = tl.arange(0, BLOCK_P)
    in_p = p < (VOCAB + BLOCK_SIZE - 1) // BLOCK_SIZE
    m = tl.load(partial_max_ptr + r * BLOCK_P + p, mask=in_p, other=-float("inf"))
    q = tl.load(partial_sum_ptr + r * BLOCK_P + p, mask=in_p, other=0.0)
    if t != 0.0:
        seed = tl.load(seeds_ptr + slot, mask=live, other=0)
        pos = tl.load(sample_pos_ptr + row) - 1 + _SALT  # the position before the drafted token
        top = tl.max(m, axis=0)
        w = tl.where(q > 0, q * tl.exp2(m - top), 0.0)
        c = tl.cumsum(w, axis=0)
        u = draft_uniform(seed, step, pos, tl.full((), VOCAB, tl.int32)) * tl.sum(w, axis=0)
        last_b = tl.max(tl.where(w > 0, p, 0), axis=0)  # a rounding overshoot takes the last live block
        k = tl.minimum(tl.sum((c <= u).to(tl.int32)), last_b)
        at_k = p == k
        m_k = tl.sum(tl.where(at_k, m, 0.0))
        u = (u - tl.sum(tl.where(at_k, c - w, 0.0))) * tl.exp2(top - m_k)  # what is left, in block k's units
        j = tl.arange(0, BLOCK_SIZE)
        cols = k * BLOCK_SIZE + j
        x = tl.load(cache_ptr + (slot * NUM_STEPS + step) * VOCAB + cols, mask=cols < VOCAB, other=-float("inf"))
        v = tl.exp2(x.to(tl.float32) * (_LOG2E / t) - m_k)  # the weights the sample kernel summed
        last_j = tl.max(tl.where(v > 0, j, 0), axis=0)
        n = tl.sum((tl.cumsum(v, axis=0) <= u).to(tl.int32))
        token = (k * BLOCK_SIZE + tl.minimum(n, last_j)).to(tl.int64)
    else:
        best = tl.argmax(m, axis=0, tie_break_left=True)
        token = tl.sum(tl.where(p == best, q, 0.0)).to(tl.int64)
    tl.store(tokens_ptr + r * tokens_stride + step, token)
    d = tl.arange(0, RANK)
    tl.store(embed_ptr + r * RANK + d, tl.load(weight_ptr + token * RANK + d))


@attrs.frozen(kw_only=True)
class MarkovSelectKey(warmreg.CompileKey):
    """What changes the binary of the Markov select step: the cache and embedding dtypes, the sizes and the warps."""

    cache_dtype: str
    embed_dtype: str
    num_steps: int
    vocab: int
    rank: int
    block_size: int
    block_p: int
    num_warps: int


class MarkovSelect(warmreg.TritonKernel[MarkovSelectKey]):
    """Draw one draft step's tokens and gather their Markov embeddings (the module docstring has the math).

    :param num_steps: draft steps (``num_speculative_tokens``; domains only).
    :param vocab: the vocabulary (domains only).
    :param rank: the Markov rank (domains only).
    :param dtype: the head dtype of the cache and the draft dtype of the embeddings, the model dtype (domains only).
    """

    name = "deepseek_v4.v41_markov_select"
    key_type = MarkovSelectKey
    jit = _markov_select_kernel

    def __init__(self, *, num_steps: int, vocab: int, rank: int, dtype: str) -> None:
        self.num_steps, self.vocab, self.rank, self.dtype = num_steps, vocab, rank, dtype

    def dispatch(self, *, cache: torch.Tensor, embed_weight: torch.Tensor) -> MarkovSelectKey:
        return MarkovSelectKey(
            cache_dtype=warmreg.dtype_name(cache.dtype), embed_dtype=warmreg.dtype_name(embed_weight.dtype),
            num_steps=cache.shape[1], vocab=cache.shape[2], rank=embed_weight.shape[1], block_size=BLOCK_SIZE,
            block_p=block_p(cache.shape[2]), num_warps=_NUM_WARPS,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        dtype = getattr(torch, self.dtype)
        return {
            "cache": [warmreg.meta((1, self.num_steps, self.vocab), dtype)],
            "embed_weight": [warmreg.meta((self.vocab, self.rank), dtype)],
        }

    def warmup_inputs(self, key: MarkovSelectKey) -> Mapping[str, Any]:
        steps, vocab, embed = key.num_steps, key.vocab, getattr(torch, key.embed_dtype)
        return {
            "step": 0,
            "idx_mapping": warmreg.meta((steps,), torch.int64),
            "sample_pos": warmreg.meta((steps,), torch.int64),
            "temperature": warmreg.meta((1,), torch.float32),
            "seeds": warmreg.meta((1,), torch.int64),
            "cache": warmreg.meta((1, steps, vocab), getattr(torch, key.cache_dtype)),
            "draft_tokens": warmreg.meta((1, steps), torch.int64),
            "embed_weight": warmreg.meta((vocab, key.rank), embed),
            "embed": warmreg.meta((1, key.rank), embed),
            "partial_max": warmreg.meta((1, key.block_p), torch.float32),
            "partial_sum": warmreg.meta((1, key.block_p), torch.float32),
            "num_reqs": 1,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        step: int,
        idx_mapping: torch.Tensor,
        sample_pos: torch.Tensor,
        temperature: torch.Tensor,
        seeds: torch.Tensor,
        cache: torch.Tensor,
        draft_tokens: torch.Tensor,
        embed_weight: torch.Tensor,
        embed: torch.Tensor,
        partial_max: torch.Tensor,
        partial_sum: torch.Tensor,
        *,
        num_reqs: int,
    ) -> warmreg.LaunchSpec[MarkovSelectKey]:
        """Write the drafted tokens of step ``step`` into ``draft_tokens[:num_reqs, step]`` and their embeddings into
        ``embed[:num_reqs]``; returns ``(draft_tokens, embed)``, written in place.

        :param step: the speculative step, ``0 <= step < NUM_STEPS``.
        :param idx_mapping: int64 ``[>= num_reqs * NUM_STEPS]``, contiguous: each row's request state, ``-1`` inert.
        :param sample_pos: int64, as ``idx_mapping``: each row's predicted position.
        :param temperature: fp32 ``[max_num_reqs]``, contiguous, by request state.
        :param seeds: int64 ``[max_num_reqs]``, contiguous, by request state.
        :param cache: ``[max_num_reqs, NUM_STEPS, VOCAB]``, contiguous: the draft-logits cache the sample step wrote.
        :param draft_tokens: int64 ``[>= num_reqs, NUM_STEPS]`` with unit column stride.
        :param embed_weight: ``[VOCAB, RANK]``, contiguous, ``RANK`` a power of two.
        :param embed: ``[>= num_reqs, RANK]``, contiguous, ``embed_weight``'s dtype.
        :param partial_max: fp32 ``[>= num_reqs, BLOCK_P]``, contiguous, from the sample step.
        :param partial_sum: fp32, as ``partial_max``.
        :param num_reqs: requests (``R``, the grid).
        :raises warmreg.LaunchError: naming the argument of another dtype, rank, shape or layout.
        """
        _check(self.name, step, num_reqs, (idx_mapping, sample_pos, temperature, seeds), cache, draft_tokens,
               embed_weight, embed, (partial_max, partial_sum))  # fmt: skip
        key = self.dispatch(cache=cache, embed_weight=embed_weight)
        kwargs = dict(
            step=step, idx_mapping_ptr=idx_mapping, sample_pos_ptr=sample_pos, temperature_ptr=temperature,
            seeds_ptr=seeds, cache_ptr=cache, tokens_ptr=draft_tokens, tokens_stride=draft_tokens.stride(0),
            weight_ptr=embed_weight, embed_ptr=embed, partial_max_ptr=partial_max, partial_sum_ptr=partial_sum,
            NUM_STEPS=key.num_steps, VOCAB=key.vocab, RANK=key.rank, BLOCK_SIZE=key.block_size, BLOCK_P=key.block_p,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (num_reqs,) if num_reqs else None, kwargs, (draft_tokens, embed))


def _check(
    name: str, step: int, reqs: int, vectors: tuple[torch.Tensor, ...], cache: torch.Tensor, tokens: torch.Tensor,
    weight: torch.Tensor, embed: torch.Tensor, partials: tuple[torch.Tensor, torch.Tensor],
) -> None:  # fmt: skip
    """Raise :class:`warmreg.LaunchError` naming the argument the kernel cannot read as vLLM's sampler passes it."""
    if cache.ndim != 3 or not cache.dtype.is_floating_point or not cache.is_contiguous() or cache.shape[2] < 1:
        raise warmreg.LaunchError(
            name,
            f"cache must be a contiguous float [reqs, steps, vocab] tensor (got {cache.dtype} {tuple(cache.shape)})",
        )
    steps, vocab = cache.shape[1], cache.shape[2]
    if not 0 <= step < steps or reqs < 0:
        raise warmreg.LaunchError(name, f"step must be in 0..{steps - 1} and num_reqs >= 0 (got {step}, {reqs})")
    for arg, t, dtype, least in zip(
        ("idx_mapping", "sample_pos", "temperature", "seeds"), vectors,
        (torch.int64, torch.int64, torch.float32, torch.int64), (reqs * steps, reqs * steps, 0, 0),
    ):  # fmt: skip
        if t.dtype != dtype or t.ndim != 1 or t.shape[0] < least or not t.is_contiguous():
            raise warmreg.LaunchError(
                name, f"{arg} must be contiguous 1-D {dtype} of >= {least} entries (got {t.dtype} {tuple(t.shape)})"
            )
    if (
        tokens.dtype != torch.int64
        or tokens.ndim != 2
        or tokens.shape[0] < reqs
        or tokens.shape[1] != steps
        or tokens.stride(1) != 1
    ):
        raise warmreg.LaunchError(
            name,
            f"draft_tokens must be int64 [>= {reqs}, {steps}] with unit column stride (got {tokens.dtype} {tuple(tokens.shape)})",
        )
    rank = weight.shape[1] if weight.ndim == 2 else 0
    if weight.ndim != 2 or weight.shape[0] != vocab or rank & (rank - 1) or rank < 1 or not weight.is_contiguous():
        raise warmreg.LaunchError(
            name, f"embed_weight must be contiguous [{vocab}, power-of-two rank] (got {tuple(weight.shape)})"
        )
    if (
        embed.dtype != weight.dtype
        or embed.ndim != 2
        or embed.shape[0] < reqs
        or embed.shape[1] != rank
        or not embed.is_contiguous()
    ):
        raise warmreg.LaunchError(
            name,
            f"embed must be contiguous {weight.dtype} [>= {reqs}, {rank}] (got {embed.dtype} {tuple(embed.shape)})",
        )
    for arg, t in zip(("partial_max", "partial_sum"), partials):
        if (
            t.dtype != torch.float32
            or t.ndim != 2
            or t.shape[0] < reqs
            or t.shape[1] != block_p(vocab)
            or not t.is_contiguous()
        ):
            raise warmreg.LaunchError(
                name, f"{arg} must be contiguous fp32 [>= {reqs}, {block_p(vocab)}] (got {t.dtype} {tuple(t.shape)})"
            )


def _count_le(weights: np.ndarray, target: np.float32) -> int:
    """``#{j : cumsum(weights)[j] <= target}`` with a sequential fp32 cumsum."""
    return int((np.cumsum(weights, dtype=np.float32) <= target).sum())


def markov_select_reference(
    step: int, idx_mapping: torch.Tensor, sample_pos: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
    cache: torch.Tensor, draft_tokens: torch.Tensor, embed_weight: torch.Tensor, embed: torch.Tensor,
    partial_max: torch.Tensor, partial_sum: torch.Tensor, *, num_reqs: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """PyTorch reference of :class:`MarkovSelect` (NumPy for the fp32 sums): updated copies of
    ``(draft_tokens, embed)``."""
    tokens, out = draft_tokens.clone(), embed.clone()
    steps, vocab = cache.shape[1], cache.shape[2]
    nb, f32 = num_blocks(vocab), np.float32
    for r in range(num_reqs):
        row = r * steps + step
        slot = int(idx_mapping[row])
        t = f32(temperature[slot]) if slot >= 0 else f32(0.0)
        m, q = partial_max[r, :nb].numpy(), partial_sum[r, :nb].numpy()
        if t == 0:
            token = int(q[int(np.argmax(m))])
        else:
            pos = int(sample_pos[row]) - 1 + DRAFT_NOISE_SALT
            top = m.max()
            w = np.where(q > 0, q * np.exp2(m - top), f32(0.0)).astype(f32)
            u = f32(uniform32(int(seeds[slot]), step, pos, vocab)) * w.sum(dtype=f32)
            last_b = int(np.nonzero(w > 0)[0].max(initial=0))
            k = min(_count_le(w, u), last_b)
            u = (u - (np.cumsum(w, dtype=f32)[k] - w[k])) * np.exp2(top - m[k])
            x = cache[slot, step, k * BLOCK_SIZE : (k + 1) * BLOCK_SIZE].float().numpy()
            v = np.exp2(x * (f32(LOG2E) / t) - m[k]).astype(f32)
            last_j = int(np.nonzero(v > 0)[0].max(initial=0))
            token = k * BLOCK_SIZE + min(_count_le(v, u), last_j)
        tokens[r, step] = token
        out[r] = embed_weight[token]
    return tokens, out


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the select step beside the sample step (:func:`.v41_markov_sample.register`): CUDA, a V4.1 DSpark
    deployment with the fused Markov sampler; one key, the model dtype for the cache and the embeddings.

    :raises warmreg.ConfigError: for malformed DSpark settings, a missing ``vocab_size`` or a Markov rank that is not
        a power of two.
    """
    if not fused_markov(model, config):
        return
    vocab = config.get(
        "text.vocab_size", int, plugin=PLUGIN, check=lambda v: None if v > 0 else f"must be > 0 (got {v})"
    )
    op = MarkovSelect(
        num_steps=num_speculative_tokens(config), vocab=vocab, rank=markov_rank(config), dtype=model.dtype
    )
    registry.add(op, when=warmreg.is_cuda)
