"""DeepSeek-V4.1's fused Markov sampler, first kernel of a draft step: bias the base logits, cache them and reduce
each vocabulary block (vLLM 0.34 ``models/deepseek_v41/nvidia/ops/fused_markov.py``: ``_markov_sample_kernel``,
launched by ``FusedMarkovSampler.__call__``).

For request ``r < R`` and vocabulary block ``b`` (``BLOCK_SIZE = 2048`` entries ``j``) of step ``s``, with
``row = r * NUM_STEPS + s``, ``i = idx_mapping[row]`` (``-1``: an inert row) and ``t = temperature[i]`` (0 when
inert)::

    x[j]          = cache_dtype(fp32(base_logits[row, j]) + fp32(bias[r, j]))      (-inf past VOCAB)
    cache[i, s, j] = x[j]                                                  when i >= 0
    t != 0:  partial_max[r, b] = max_j x[j] * log2(e) / t
             partial_sum[r, b] = sum_j exp2(x[j] * log2(e) / t - partial_max[r, b])
    t == 0:  partial_max[r, b] = max_j x[j],  partial_sum[r, b] = float(argmax_j x[j])   (the vocabulary index)

``base_logits`` ``[R * NUM_STEPS, VOCAB]`` rows ordered (request, step) with unit column stride, ``bias``
``[R, VOCAB]`` (the Markov bias GEMM's output), ``cache`` the draft-logits cache ``[max_num_reqs, NUM_STEPS, VOCAB]``
(contiguous), all three in the head dtype (vLLM's ``head_dtype``: the model dtype); ``idx_mapping`` int64,
``temperature`` fp32, the partials fp32 ``[>= R, BLOCK_P]`` (``BLOCK_P = next_pow2(cdiv(VOCAB, 2048))``). The grid is
``(R, cdiv(VOCAB, 2048))`` with 2 warps, as vLLM's.

Where it runs: every draft step of a V4.1 DSpark deployment on CUDA with the fused sampler on
(:func:`._v41_markov.fused_markov`), once per speculative step.

Key: the three logits dtypes, ``NUM_STEPS``, ``VOCAB``, ``BLOCK_SIZE``, ``BLOCK_P`` and the warps; the row strides and
the step are runtime ints (not specialized).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._v41_markov import BLOCK_SIZE, LOG2E, block_p, fused_markov, num_blocks
from .dspark import num_speculative_tokens
from .model import DSV4, PLUGIN

__all__ = ["MarkovSample", "MarkovSampleKey", "markov_sample_reference", "register"]

_NUM_WARPS = 2
_LOG2E = tl.constexpr(LOG2E)


@triton.jit(do_not_specialize=["base_stride", "bias_stride", "step"])
def _markov_sample_kernel(
    base_ptr,  # [R * NUM_STEPS, VOCAB], unit column stride
    base_stride,
    bias_ptr,  # [R, VOCAB], unit column stride
    bias_stride,
    step,
    idx_mapping_ptr,  # int64 [>= R * NUM_STEPS]
    temperature_ptr,  # fp32 [max_num_reqs]
    cache_ptr,  # [max_num_reqs, NUM_STEPS, VOCAB], contiguous
    partial_max_ptr,  # fp32 [>= R, BLOCK_P]
    partial_sum_ptr,
    NUM_STEPS: tl.constexpr,  # draft steps: the cache's middle extent
    VOCAB: tl.constexpr,  # the cache's row length
    BLOCK_SIZE: tl.constexpr,  # vocabulary entries a program
    BLOCK_P: tl.constexpr,  # partials a request
):
    r = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    cols = b * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    inside = cols < VOCAB
    row = r * NUM_STEPS + step
    base = tl.load(base_ptr + row * base_stride + cols, mask=inside, other=-float("inf")).to(tl.float32)
    bias = tl.load(bias_ptr + r * bias_stride + cols, mask=inside, other=0.0).to(tl.float32)
    x = (base + bias).to(cache_ptr.dtype.element_ty)  # one rounding, as the loop's ``base + bias``
    slot = tl.load(idx_mapping_ptr + row).to(tl.int64)
    live = slot >= 0
    tl.store(cache_ptr + (slot * NUM_STEPS + step) * VOCAB + cols, x, mask=tl.where(live, inside, False))
    t = tl.load(temperature_ptr + slot, mask=live, other=0.0).to(tl.float32)
    x = x.to(tl.float32)
    at = r * BLOCK_P + b
    if t != 0.0:
        scaled = x * (_LOG2E / t)
        top = tl.max(scaled, axis=0)
        tl.store(partial_max_ptr + at, top)
        tl.store(partial_sum_ptr + at, tl.sum(tl.exp2(scaled - top), axis=0))
    else:
        top, j = tl.max(x, axis=0, return_indices=True)
        tl.store(partial_max_ptr + at, top)
        tl.store(partial_sum_ptr + at, (b * BLOCK_SIZE + j).to(tl.float32))  # exact below 2**24


@attrs.frozen(kw_only=True)
class MarkovSampleKey(warmreg.CompileKey):
    """What changes the binary of the Markov sample step: the logits dtypes, the sizes and the warps."""

    base_dtype: str
    bias_dtype: str
    cache_dtype: str
    num_steps: int
    vocab: int
    block_size: int
    block_p: int
    num_warps: int


class MarkovSample(warmreg.TritonKernel[MarkovSampleKey]):
    """Bias, cache and block-reduce one draft step's logits (the module docstring has the math).

    :param num_steps: draft steps (``num_speculative_tokens``; domains only).
    :param vocab: the vocabulary (domains only).
    :param dtype: the head dtype of the logits, the bias and the cache (domains only).
    """

    name = "deepseek_v4.v41_markov_sample"
    key_type = MarkovSampleKey
    jit = _markov_sample_kernel

    def __init__(self, *, num_steps: int, vocab: int, dtype: str) -> None:
        self.num_steps, self.vocab, self.dtype = num_steps, vocab, dtype

    def dispatch(self, *, base_logits: torch.Tensor, bias: torch.Tensor, cache: torch.Tensor) -> MarkovSampleKey:
        return MarkovSampleKey(
            base_dtype=warmreg.dtype_name(base_logits.dtype), bias_dtype=warmreg.dtype_name(bias.dtype),
            cache_dtype=warmreg.dtype_name(cache.dtype), num_steps=cache.shape[1], vocab=cache.shape[2],
            block_size=BLOCK_SIZE, block_p=block_p(cache.shape[2]), num_warps=_NUM_WARPS,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        dtype = getattr(torch, self.dtype)
        return {
            "base_logits": [warmreg.meta((self.num_steps, self.vocab), dtype)],
            "bias": [warmreg.meta((1, self.vocab), dtype)],
            "cache": [warmreg.meta((1, self.num_steps, self.vocab), dtype)],
        }

    def warmup_inputs(self, key: MarkovSampleKey) -> Mapping[str, Any]:
        steps, vocab = key.num_steps, key.vocab
        return {
            "base_logits": warmreg.meta((steps, vocab), getattr(torch, key.base_dtype)),
            "bias": warmreg.meta((1, vocab), getattr(torch, key.bias_dtype)),
            "step": 0,
            "idx_mapping": warmreg.meta((steps,), torch.int64),
            "temperature": warmreg.meta((1,), torch.float32),
            "cache": warmreg.meta((1, steps, vocab), getattr(torch, key.cache_dtype)),
            "partial_max": warmreg.meta((1, key.block_p), torch.float32),
            "partial_sum": warmreg.meta((1, key.block_p), torch.float32),
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        base_logits: torch.Tensor,
        bias: torch.Tensor,
        step: int,
        idx_mapping: torch.Tensor,
        temperature: torch.Tensor,
        cache: torch.Tensor,
        partial_max: torch.Tensor,
        partial_sum: torch.Tensor,
    ) -> warmreg.LaunchSpec[MarkovSampleKey]:
        """Write step ``step``'s biased logits into ``cache`` and the block partials; returns
        ``(cache, partial_max, partial_sum)``, all written in place. ``R = bias.shape[0]`` requests.

        :param base_logits: ``[R * NUM_STEPS, VOCAB]`` (unit column stride), rows ordered (request, step).
        :param bias: ``[R, VOCAB]`` (unit column stride): the Markov bias of each request's previous token.
        :param step: the speculative step, ``0 <= step < NUM_STEPS``.
        :param idx_mapping: int64 ``[>= R * NUM_STEPS]``, contiguous: each row's request state, ``-1`` inert.
        :param temperature: fp32 ``[max_num_reqs]``, contiguous, by request state.
        :param cache: ``[max_num_reqs, NUM_STEPS, VOCAB]``, contiguous: the draft-logits cache.
        :param partial_max: fp32 ``[>= R, BLOCK_P]``, contiguous.
        :param partial_sum: fp32, as ``partial_max``.
        :raises warmreg.LaunchError: naming the argument of another dtype, rank, shape or layout.
        """
        _check(self.name, base_logits, bias, step, idx_mapping, temperature, cache, partial_max, partial_sum)
        key = self.dispatch(base_logits=base_logits, bias=bias, cache=cache)
        kwargs = dict(
            base_ptr=base_logits, base_stride=base_logits.stride(0), bias_ptr=bias, bias_stride=bias.stride(0),
            step=step, idx_mapping_ptr=idx_mapping, temperature_ptr=temperature, cache_ptr=cache,
            partial_max_ptr=partial_max, partial_sum_ptr=partial_sum, NUM_STEPS=key.num_steps, VOCAB=key.vocab,
            BLOCK_SIZE=key.block_size, BLOCK_P=key.block_p,
        )  # fmt: skip
        reqs = bias.shape[0]
        grid = (reqs, num_blocks(key.vocab)) if reqs else None
        return warmreg.LaunchSpec(key, grid, kwargs, (cache, partial_max, partial_sum))


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _check(
    name: str, base: torch.Tensor, bias: torch.Tensor, step: int, idx: torch.Tensor, temp: torch.Tensor,
    cache: torch.Tensor, pmax: torch.Tensor, psum: torch.Tensor,
) -> None:  # fmt: skip
    """Raise :class:`warmreg.LaunchError` naming the argument the kernel cannot read as vLLM's sampler passes it."""
    if cache.ndim != 3 or cache.dtype not in _FLOATS or not cache.is_contiguous() or cache.shape[2] < 1:
        raise warmreg.LaunchError(
            name,
            f"cache must be a contiguous float [reqs, steps, vocab] tensor (got {cache.dtype} {tuple(cache.shape)})",
        )
    steps, vocab = cache.shape[1], cache.shape[2]
    reqs = bias.shape[0] if bias.ndim == 2 else -1
    for arg, t, rows in (("bias", bias, reqs), ("base_logits", base, reqs * steps)):
        if t.ndim != 2 or t.dtype not in _FLOATS or t.shape != (rows, vocab) or (vocab > 1 and t.stride(1) != 1):
            raise warmreg.LaunchError(
                name, f"{arg} must be float [{rows}, {vocab}] with unit column stride (got {t.dtype} {tuple(t.shape)})"
            )
    if idx.dtype != torch.int64 or idx.ndim != 1 or idx.shape[0] < reqs * steps or not idx.is_contiguous():
        raise warmreg.LaunchError(
            name, f"idx_mapping must be contiguous int64 of >= {reqs * steps} rows (got {idx.dtype} {tuple(idx.shape)})"
        )
    if temp.dtype != torch.float32 or temp.ndim != 1 or not temp.is_contiguous():
        raise warmreg.LaunchError(
            name, f"temperature must be contiguous 1-D fp32 (got {temp.dtype} {tuple(temp.shape)})"
        )
    for arg, t in (("partial_max", pmax), ("partial_sum", psum)):
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
    if not 0 <= step < steps:
        raise warmreg.LaunchError(name, f"step must be in 0..{steps - 1} (got {step})")


def markov_sample_reference(
    base_logits: torch.Tensor, bias: torch.Tensor, step: int, idx_mapping: torch.Tensor, temperature: torch.Tensor,
    cache: torch.Tensor, partial_max: torch.Tensor, partial_sum: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """PyTorch reference of :class:`MarkovSample`: updated copies of ``(cache, partial_max, partial_sum)``."""
    cache, pmax, psum = cache.clone(), partial_max.clone(), partial_sum.clone()
    steps, vocab = cache.shape[1], cache.shape[2]
    nb = num_blocks(vocab)
    pad = nb * BLOCK_SIZE - vocab
    for r in range(bias.shape[0]):
        row = r * steps + step
        x = (base_logits[row].float() + bias[r].float()).to(cache.dtype)
        slot = int(idx_mapping[row])
        if slot >= 0:
            cache[slot, step] = x
        t = float(temperature[slot]) if slot >= 0 else 0.0
        blocks = torch.nn.functional.pad(x.float(), (0, pad), value=-float("inf")).view(nb, BLOCK_SIZE)
        if t != 0.0:
            scaled = blocks * (torch.tensor(LOG2E, dtype=torch.float32) / torch.tensor(t, dtype=torch.float32))
            top = scaled.max(dim=1).values
            pmax[r, :nb], psum[r, :nb] = top, torch.exp2(scaled - top[:, None]).sum(dim=1)
        else:
            top, j = blocks.max(dim=1).values, blocks.argmax(dim=1)  # argmax: the first of equal maxima, as Triton's
            pmax[r, :nb] = top
            psum[r, :nb] = (torch.arange(nb) * BLOCK_SIZE + j).float()
    return cache, pmax, psum


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the sample step on CUDA for a V4.1 DSpark deployment with the fused Markov sampler
    (:func:`._v41_markov.fused_markov`): one key, the head dtype (the model dtype) throughout.

    :raises warmreg.ConfigError: for malformed DSpark settings or a missing ``vocab_size``.
    """
    if not fused_markov(model, config):
        return
    vocab = config.get(
        "text.vocab_size", int, plugin=PLUGIN, check=lambda v: None if v > 0 else f"must be > 0 (got {v})"
    )
    op = MarkovSample(num_steps=num_speculative_tokens(config), vocab=vocab, dtype=model.dtype)
    registry.add(op, when=warmreg.is_cuda)
