"""The DSpark Markov drafter's Gumbel noise of every draft step, ahead of the logits (vLLM 0.34
``models/kimi_k3/nvidia/specialized_decode/drafter/markov.py``: ``_markov_noise_kernel``, ``FusedMarkov.fork_noise``).

For ``R`` requests and ``k`` draft steps, with the request state ``i = idx_map[r, s]``, the sampled token's position
``P = pos[r, s]`` and the vocabulary ``V``::

    noise[r, s, v] = -log1p(-u(step_seed(seeds[i], s), P - 1 + 2**30, v))     for v < V

(``warmreg_kimi_k3._markov`` has ``u``; ``seeds[i]`` reads 0 for ``i < 0``). It is the noise up to its last log:
the step kernel takes ``-log`` of it beside the logits, so the keys round as ``gumbel_noised_argmax``'s. ``noise``
is ``[R, k, V]`` fp32 with unit stride over the vocabulary (vLLM: a view of a persistent ``[32 * V]`` buffer).
Grid ``(cdiv(V, 1024), R * k)``, 4 warps, as vLLM's.

Where it runs: the specialized decode's DSpark drafter (``specialized.dspark_draft``) with probabilistic drafts,
once per draft step when ``1 <= R * k <= 32`` (``FusedMarkov.noise_rows``; fp32 Gumbel, vLLM's default
``use_fp64_gumbel`` off, the fp64 draw has no noise kernel), on a side stream beside the lm_head. SM100 family only.

Key: the index dtypes and ``BLOCK``. Unlike vLLM's kernel, ``k`` (vLLM: the constexpr ``K``) and the salt are
runtime values, no integer is specialized and only the noise pointer is specialized on alignment: one binary.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._markov import DRAFT_SALT, NOISE_ROWS, gumbel_log_arg, gumbel_log_arg_reference, step_seed, step_seed_reference
from .model import KimiK3
from .specialized import SM100_FAMILY, dspark_draft

__all__ = ["NOISE_BLOCK", "MarkovNoise", "MarkovNoiseKey", "markov_noise_reference", "register"]

#: Vocabulary entries a program draws (vLLM's ``NOISE_BLOCK``).
NOISE_BLOCK = 1024
_INTS = ["noise_stride0", "noise_stride1", "idx_stride", "pos_stride", "vocab", "k", "salt"]


@triton.jit(do_not_specialize=_INTS, do_not_specialize_on_alignment=["idx_map_ptr", "pos_ptr", "seeds_ptr"])
def _markov_noise_kernel(
    noise_ptr,  # [R, k, V] fp32, unit vocabulary stride
    noise_stride0,
    noise_stride1,
    idx_map_ptr,  # [R, k] request state of each sampled row
    idx_stride,
    pos_ptr,  # [R, k] the sampled token's position
    pos_stride,
    seeds_ptr,  # [states] int64 request seeds
    vocab,
    k,
    salt,
    BLOCK: tl.constexpr,  # vocabulary entries a program draws
):
    v = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    flat = tl.program_id(1)
    row = (flat // k).to(tl.int64)
    step = flat % k
    req = tl.load(idx_map_ptr + row * idx_stride + step).to(tl.int64)
    seed = step_seed(tl.load(seeds_ptr + req, mask=req >= 0, other=0), step)
    pos = (tl.load(pos_ptr + row * pos_stride + step) - 1).to(tl.int64) + salt
    tl.store(noise_ptr + row * noise_stride0 + step * noise_stride1 + v, gumbel_log_arg(seed, pos, v), mask=v < vocab)


@attrs.frozen(kw_only=True)
class MarkovNoiseKey(warmreg.CompileKey):
    """What changes the binary of the draft noise: the index dtypes and the tile."""

    idx_dtype: str
    pos_dtype: str
    noise_aligned: bool
    block: int
    num_warps: int


class MarkovNoise(warmreg.TritonKernel[MarkovNoiseKey]):
    """The draft steps' Gumbel noise up to its last log (the module docstring has the math).

    :param num_speculative_tokens: ``k`` (domains only).
    """

    name = "kimi_k3.markov_noise"
    key_type = MarkovNoiseKey
    jit = _markov_noise_kernel

    def __init__(self, *, num_speculative_tokens: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens

    def dispatch(self, *, idx_map: torch.Tensor, sample_pos: torch.Tensor, out: torch.Tensor) -> MarkovNoiseKey:
        return MarkovNoiseKey(
            idx_dtype=warmreg.dtype_name(idx_map.dtype), pos_dtype=warmreg.dtype_name(sample_pos.dtype),
            noise_aligned=warmreg.is_aligned(out), block=NOISE_BLOCK, num_warps=4,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        # vLLM's sample_idx_mapping and sample_pos: int64 views of persistent buffers (DFlashSpeculator's, which
        # DSpark's extends); the noise starts its buffer.
        k = self.num_speculative_tokens
        return {
            "idx_map": [warmreg.meta((1, k), torch.int64)],
            "sample_pos": [warmreg.meta((1, k), torch.int64)],
            "out": [warmreg.meta((1, k, 64), torch.float32)],
        }

    def warmup_inputs(self, key: MarkovNoiseKey) -> Mapping[str, Any]:
        noise = warmreg.meta((1, 1, 64), torch.float32, offset=0 if key.noise_aligned else 1)
        return {
            "idx_map": warmreg.meta((1, 1), getattr(torch, key.idx_dtype)),
            "sample_pos": warmreg.meta((1, 1), getattr(torch, key.pos_dtype)),
            "seeds": warmreg.meta((1,), torch.int64),
            "vocab": 64,
            "out": noise,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        idx_map: torch.Tensor,
        sample_pos: torch.Tensor,
        seeds: torch.Tensor,
        *,
        vocab: int | None = None,
        out: torch.Tensor | None = None,
    ) -> warmreg.LaunchSpec[MarkovNoiseKey]:
        """The ``[R, k, V]`` fp32 noise of ``R`` requests' ``k`` draft steps (``out``, or a fresh tensor).

        :param idx_map: int32 or int64 ``[R, k]``, unit step stride: each sampled row's request state (< 0: none).
        :param sample_pos: int32 or int64 ``[R, k]``, unit step stride: the sampled token's position.
        :param seeds: int64 ``[states]``: each request state's seed.
        :param vocab: ``V`` (> 0).
        :param out: a contiguous ``[R, k, V]`` fp32 output (vLLM: a view of its persistent buffer), or None.
        :raises warmreg.LaunchError: for shapes, dtypes or strides the kernel cannot take.
        """
        if vocab is None or vocab <= 0:
            raise warmreg.LaunchError(self.name, f"vocab must be > 0 (got {vocab})")
        self._check(idx_map, sample_pos, seeds)
        out = warmreg.output(self.name, "out", out, (*idx_map.shape, vocab), torch.float32, idx_map.device)
        key = self.dispatch(idx_map=idx_map, sample_pos=sample_pos, out=out)
        rows, k, v = out.shape
        kwargs = dict(
            noise_ptr=out, noise_stride0=out.stride(0), noise_stride1=out.stride(1), idx_map_ptr=idx_map,
            idx_stride=idx_map.stride(0), pos_ptr=sample_pos, pos_stride=sample_pos.stride(0), seeds_ptr=seeds,
            vocab=v, k=k, salt=DRAFT_SALT, BLOCK=key.block,
        )  # fmt: skip
        grid = (triton.cdiv(v, key.block), rows * k) if rows * k and v else None
        return warmreg.LaunchSpec(key, grid, kwargs, out)

    def _check(self, idx_map: torch.Tensor, pos: torch.Tensor, seeds: torch.Tensor) -> None:
        ints = (torch.int32, torch.int64)
        if idx_map.ndim != 2 or idx_map.dtype not in ints or (idx_map.shape[1] > 1 and idx_map.stride(1) != 1):
            raise warmreg.LaunchError(
                self.name, f"idx_map must be int32 or int64 [R, k] with unit step stride (got {idx_map.dtype} "
                f"{tuple(idx_map.shape)} strides {idx_map.stride()})",
            )  # fmt: skip
        if pos.shape != idx_map.shape or pos.dtype not in ints or (pos.shape[1] > 1 and pos.stride(1) != 1):
            raise warmreg.LaunchError(
                self.name, f"sample_pos must be int32 or int64 {tuple(idx_map.shape)} with unit step stride "
                f"(got {pos.dtype} {tuple(pos.shape)})",
            )  # fmt: skip
        if seeds.ndim != 1 or seeds.dtype != torch.int64:
            raise warmreg.LaunchError(
                self.name, f"seeds must be int64 [states] (got {seeds.dtype} {tuple(seeds.shape)})"
            )


def markov_noise_reference(
    idx_map: torch.Tensor, sample_pos: torch.Tensor, seeds: torch.Tensor, vocab: int
) -> torch.Tensor:
    """PyTorch reference of :class:`MarkovNoise`: ``[R, k, V]`` fp32."""
    k = idx_map.shape[1]
    req = idx_map.long()
    seed = torch.where(req >= 0, seeds[req.clamp(min=0)], torch.zeros_like(req))
    seed = step_seed_reference(seed, torch.arange(k)[None, :])
    pos = (sample_pos.long() - 1) + DRAFT_SALT
    return gumbel_log_arg_reference(seed[..., None], pos[..., None], torch.arange(vocab))


def register(registry: warmreg.Registry, m: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the draft noise on the SM100 family for the specialized decode's DSpark drafter with probabilistic
    drafts, when a step of up to 32 sampled rows can happen (``max_num_seqs * k >= 1`` always: one request).

    :raises warmreg.ConfigError: for malformed specialized-decode settings (``specialized.dspark_draft``).
    """
    draft = dspark_draft(config)
    if draft is None or not draft.probabilistic or draft.num_speculative_tokens > NOISE_ROWS:
        return
    registry.add(MarkovNoise(num_speculative_tokens=draft.num_speculative_tokens), when=SM100_FAMILY)
