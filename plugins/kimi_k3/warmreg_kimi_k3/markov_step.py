"""The DSpark Markov drafter's sequential sampling, two launches a draft step (vLLM 0.34
``models/kimi_k3/nvidia/specialized_decode/drafter/markov.py``: ``_markov_step_kernel``, ``_markov_select_kernel``,
``FusedMarkov.run``).

Step ``s`` of ``k``, for request row ``r < R`` with request state ``i = idx_map[r, s]``, temperature ``T = temp[i]``,
the previous token ``p`` (``input_ids[anchor_idx[r]]`` at step 0, else ``prev[r]``), Markov weights ``w1 [V1, D]``,
``w2 [V, D]`` (bf16, ``D`` the rank) and the base logits ``b[r, v]`` (bf16 or fp32, dtype ``dt``)::

    bias[r, v]   = dt(sum_d f32(w1[p, d]) * f32(w2[v, d]))        # one fp32 dot, rounded once to dt
    l[r, v]      = dt(f32(b[r, v]) + f32(bias[r, v]))             # one fp32 add, rounded once
    cache[i, s, v] = l[r, v]                                      # for i >= 0 (the replicated draft-logits cache)
    key[r, v]    = f32(l) / T - log(a[r, s, v])    if T != 0 else f32(l)
    tokens[r, s] = prev[r] = first argmax_v key[r, v]

with ``a`` the noise of ``warmreg_kimi_k3.markov_noise`` (read from ``noise`` when given, else drawn in place:
the same operations). The step launch (grid ``(cdiv(R, 16), cdiv(V, 256))``, 4 warps, 2 stages) keeps, per program
of 256 vocabulary entries (four ``[16, 64]`` tiles, ``tl.dot`` on the tensor cores), each row's first maximum and
its token in ``out_max`` / ``out_arg`` ``[rows, NB]``; the select launch (one program a row) takes the first of
the largest per-program maxima, as vLLM's two-level argmax, and writes ``tokens[r, s]`` and ``prev[r]``.

vLLM adds the logits with inline PTX (``add.rn.f32``) so that the compiler cannot fold the add into the dot's
accumulator; here the dot is first rounded to ``dt`` and back, which no contraction can cross, and the add is a
plain fp32 add: the same rounding, portable (the interpreter and ROCm run it).

Where it runs: the specialized decode's DSpark drafter (``specialized.dspark_draft``) on every draft step with
probabilistic drafts (``markov.why_not``: greedy drafts take vLLM's loop), bf16 Markov weights of a power-of-two
rank in ``[16, 512]``, fp32 Gumbel (vLLM's default; ``use_fp64_gumbel`` is no warmreg setting and the fp64 draw
is not reproduced here). The draft-logits cache is replicated (the drafter disables its batch sharding), so no
row mapping. SM100 family only.

Key (step): the logits dtype, ``D``, the tiles, whether the noise is read, the 16-byte alignment of the weights,
logits, cache and noise, the int classes of their row strides (vLLM specializes them; they decide whether rows
load in vectors), 4 warps / 2 stages. Unlike vLLM's, the step index is a runtime int (vLLM: the constexpr
``STEP``, ``k`` binaries of each): one binary serves every step. Key (select): ``NB`` rounded to a power of two and
the token dtype; the step is a runtime int here too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._markov import DRAFT_SALT, NOISE_ROWS, RB, VB, VT, gumbel_log_arg, step_seed
from .model import KimiK3
from .specialized import SM100_FAMILY, dspark_draft

__all__ = ["MarkovStep", "MarkovStepKey", "register"]

_INTS = ["idx_stride", "pos_stride", "num_rows", "vocab", "num_blocks", "step", "salt"]
_SCALARS = ["prev_tok_ptr", "input_ids_ptr", "anchor_idx_ptr", "idx_map_ptr", "pos_ptr", "temp_ptr", "seeds_ptr",
            "out_max_ptr", "out_arg_ptr"]  # fmt: skip


@triton.jit(do_not_specialize=_INTS, do_not_specialize_on_alignment=_SCALARS)
def _markov_step_kernel(
    prev_tok_ptr, input_ids_ptr, anchor_idx_ptr,  # the previous tokens: prev [rows] or input_ids[anchor_idx[r]]
    w1_ptr, w2_ptr,  # Markov weights [V1, RANK], [V, RANK]
    base_ptr, base_stride,  # this step's base logits [R, V]
    cache_ptr, cache_stride0, cache_stride1,  # draft logits [states, k, V]
    idx_map_ptr, idx_stride, pos_ptr, pos_stride, temp_ptr, seeds_ptr,
    out_max_ptr, out_arg_ptr,  # [rows, num_blocks] per-program maxima and their tokens
    noise_ptr, noise_stride0, noise_stride1,  # [R, k, V] fp32 noise (unread without NOISE)
    num_rows, vocab, num_blocks, step, salt,
    RANK: tl.constexpr,  # the Markov rank D (a power of two: the dot's K)
    VB: tl.constexpr,  # vocabulary entries a program owns (a multiple of VT)
    VT: tl.constexpr,  # vocabulary entries a tile multiplies (the dot's N)
    RB: tl.constexpr,  # request rows a program holds (the dot's M)
    NOISE: tl.constexpr,  # read the precomputed noise instead of drawing it
):  # fmt: skip
    blk = tl.program_id(1)
    rows = tl.program_id(0) * RB + tl.arange(0, RB)
    live = rows < num_rows
    rows64 = rows.to(tl.int64)
    if step == 0:
        anchor = tl.load(anchor_idx_ptr + rows, mask=live, other=0)
        prev = tl.load(input_ids_ptr + anchor, mask=live, other=0).to(tl.int64)
    else:
        prev = tl.load(prev_tok_ptr + rows64, mask=live, other=0).to(tl.int64)
    d = tl.arange(0, RANK)
    emb = tl.load(w1_ptr + prev[:, None] * RANK + d[None, :], mask=live[:, None], other=0.0)
    req = tl.load(idx_map_ptr + rows64 * idx_stride + step, mask=live, other=-1).to(tl.int64)
    has_req = req >= 0
    temp = tl.load(temp_ptr + req, mask=has_req, other=0.0).to(tl.float32)
    seed = step_seed(tl.load(seeds_ptr + req, mask=has_req, other=0), step)
    pos = (tl.load(pos_ptr + rows64 * pos_stride + step, mask=live, other=1) - 1).to(tl.int64) + salt
    noisy = temp != 0.0
    best = tl.full([RB], float("-inf"), tl.float32)
    best_tok = tl.zeros([RB], tl.int64)
    first = blk * VB
    for t in range(0, VB, VT):
        v = first + t + tl.arange(0, VT)
        in_vocab = v < vocab
        w = tl.load(w2_ptr + v[:, None].to(tl.int64) * RANK + d[None, :], mask=in_vocab[:, None], other=0.0,
                    eviction_policy="evict_last")  # fmt: skip
        tile = live[:, None] & in_vocab[None, :]
        base = tl.load(base_ptr + rows64[:, None] * base_stride + v[None, :], mask=tile, other=0.0,
                       eviction_policy="evict_first")  # fmt: skip
        dt = base.dtype
        bias = tl.dot(emb, tl.trans(w)).to(dt).to(tl.float32)  # rounded to dt: no add can fold into the dot
        logits = (base.to(tl.float32) + bias).to(dt)
        tl.store(cache_ptr + req[:, None] * cache_stride0 + step * cache_stride1 + v[None, :], logits,
                 mask=(live & has_req)[:, None] & in_vocab[None, :])  # fmt: skip
        if NOISE:
            arg = tl.load(noise_ptr + rows64[:, None] * noise_stride0 + step * noise_stride1 + v[None, :],
                          mask=tile & noisy[:, None], other=1.0)  # fmt: skip
        else:
            arg = gumbel_log_arg(seed[:, None], pos[:, None], v[None, :])
        lf = logits.to(tl.float32)
        lf = tl.where(noisy[:, None], lf / temp[:, None], lf)
        x = tl.where(noisy[:, None], lf + -tl.log(arg), lf)
        x = tl.where(in_vocab[None, :], x, float("-inf"))
        top, at = tl.max(x, axis=1, return_indices=True, return_indices_tie_break_left=True)
        better = top > best
        best = tl.where(better, top, best)
        best_tok = tl.where(better, (first + t + at).to(tl.int64), best_tok)
    tl.store(out_max_ptr + rows64 * num_blocks + blk, best, mask=live)
    tl.store(out_arg_ptr + rows64 * num_blocks + blk, best_tok, mask=live)


@attrs.frozen(kw_only=True)
class MarkovStepKey(warmreg.CompileKey):
    """What changes the binary of a Markov step."""

    logits_dtype: str  # the base logits and the cache
    rank: int
    vocab_block: int
    vocab_tile: int
    row_block: int
    noise: bool
    w1_aligned: bool
    w2_aligned: bool
    base_aligned: bool
    cache_aligned: bool
    noise_aligned: bool
    base_stride: warmreg.IntClass
    cache_stride0: warmreg.IntClass
    cache_stride1: warmreg.IntClass
    noise_stride0: warmreg.IntClass
    noise_stride1: warmreg.IntClass
    num_warps: int
    num_stages: int


class MarkovStep(warmreg.TritonKernel[MarkovStepKey]):
    """One draft step's logits, cache rows and per-program Gumbel maxima (the module docstring has the math).

    :param num_speculative_tokens: ``k`` (domains only).
    :param max_num_seqs: the most requests of a step (domains only).
    :param vocab_size: ``V`` (domains only).
    :param rank: the Markov rank ``D`` (domains only).
    :param dtype: the logits dtype (domains only).
    """

    name = "kimi_k3.markov_step"
    key_type = MarkovStepKey
    jit = _markov_step_kernel

    def __init__(self, *, num_speculative_tokens: int, max_num_seqs: int, vocab_size: int, rank: int, dtype: str):
        self.k, self.max_num_seqs, self.vocab, self.rank, self.dtype = (
            num_speculative_tokens, max_num_seqs, vocab_size, rank, dtype
        )  # fmt: skip

    def dispatch(
        self, *, w1: torch.Tensor, w2: torch.Tensor, base: torch.Tensor, cache: torch.Tensor,
        noise: torch.Tensor | None, out_max: torch.Tensor,
    ) -> MarkovStepKey:  # fmt: skip
        read = noise if noise is not None else out_max
        strides = (read.stride(0), read.stride(1)) if noise is not None else (0, 0)
        return MarkovStepKey(
            logits_dtype=warmreg.dtype_name(base.dtype), rank=w1.shape[1], vocab_block=VB, vocab_tile=VT, row_block=RB,
            noise=noise is not None, w1_aligned=warmreg.is_aligned(w1), w2_aligned=warmreg.is_aligned(w2),
            base_aligned=warmreg.is_aligned(base), cache_aligned=warmreg.is_aligned(cache),
            noise_aligned=warmreg.is_aligned(read), base_stride=warmreg.int_class(base.stride(0)),
            cache_stride0=warmreg.int_class(cache.stride(0)), cache_stride1=warmreg.int_class(cache.stride(1)),
            noise_stride0=warmreg.int_class(strides[0]), noise_stride1=warmreg.int_class(strides[1]), num_warps=4,
            num_stages=2,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        # FusedMarkov.run: base_logits[:, s] of the [R, k, V] lm_head output, the [states, k, V] cache, the
        # [R, k, V] noise view of steps with at most NOISE_ROWS sampled rows (else an unread spare pointer).
        k, v, dt = self.k, self.vocab, getattr(torch, self.dtype)
        base = warmreg.meta((1, k, v), dt)[:, 0]
        noises: list[torch.Tensor | None] = [warmreg.meta((1, k, v), torch.float32)] if k <= NOISE_ROWS else []
        if self.max_num_seqs * k > NOISE_ROWS:
            noises.append(None)
        return {
            "w1": [warmreg.meta((v, self.rank), torch.bfloat16)],
            "w2": [warmreg.meta((v, self.rank), torch.bfloat16)],
            "base": [base],
            "cache": [warmreg.meta((self.max_num_seqs, k, v), dt)],
            "noise": noises,
            "out_max": [warmreg.meta((1, triton.cdiv(v, VB)), torch.float32)],
        }

    def warmup_inputs(self, key: MarkovStepKey) -> Mapping[str, Any]:
        def strided(shape: tuple[int, ...], dt: torch.dtype, classes: tuple[warmreg.IntClass, ...], aligned: bool):
            stride = (*(warmreg.int_class_rep(c) for c in classes), 1)
            return warmreg.meta(shape, dt, stride=stride, offset=0 if aligned else 1)

        dt, d = getattr(torch, key.logits_dtype), key.rank
        ints = torch.int64
        noise = (
            strided((1, 1, 1), torch.float32, (key.noise_stride0, key.noise_stride1), key.noise_aligned)
            if key.noise
            else None
        )
        return {
            "prev": warmreg.meta((1,), ints), "input_ids": warmreg.meta((1,), torch.int32),
            "anchor_idx": warmreg.meta((1,), ints),
            "w1": warmreg.meta((1, d), torch.bfloat16, offset=0 if key.w1_aligned else 1),
            "w2": warmreg.meta((1, d), torch.bfloat16, offset=0 if key.w2_aligned else 1),
            "base": strided((1, 1), dt, (key.base_stride,), key.base_aligned),
            "cache": strided((1, 1, 1), dt, (key.cache_stride0, key.cache_stride1), key.cache_aligned),
            "idx_map": warmreg.meta((1, 1), ints), "sample_pos": warmreg.meta((1, 1), ints),
            "temperature": warmreg.meta((1,), torch.float32), "seeds": warmreg.meta((1,), ints),
            "out_max": warmreg.meta((1, 1), torch.float32, offset=0 if key.noise_aligned or key.noise else 1),
            "out_arg": warmreg.meta((1, 1), ints), "noise": noise, "step": 0,
        }  # fmt: skip

    @warmreg.kernel_launcher
    def __call__(
        self,
        prev: torch.Tensor,
        input_ids: torch.Tensor,
        anchor_idx: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        base: torch.Tensor,
        cache: torch.Tensor,
        idx_map: torch.Tensor,
        sample_pos: torch.Tensor,
        temperature: torch.Tensor,
        seeds: torch.Tensor,
        out_max: torch.Tensor,
        out_arg: torch.Tensor,
        noise: torch.Tensor | None = None,
        *,
        step: int,
    ) -> warmreg.LaunchSpec[MarkovStepKey]:
        """Step ``step`` of ``R = base.shape[0]`` requests: writes ``cache[idx_map[:, step]]``'s step row and the
        per-program maxima ``out_max`` / ``out_arg`` (returned).

        :param prev: int64 ``[>= R]``: the previous step's tokens (read for ``step > 0``).
        :param input_ids: the step's input ids (int32); ``anchor_idx`` (int64 ``[>= R]``) picks step 0's.
        :param w1: bf16 ``[V1, D]`` contiguous; ``w2``: bf16 ``[V, D]`` contiguous; ``D`` a power of two >= 16.
        :param base: bf16 or fp32 ``[R, V]`` with unit vocabulary stride (``base_logits[:, step]``).
        :param cache: ``[states, k, V']`` of base's dtype, ``V' >= V``, unit vocabulary stride.
        :param idx_map: int64 ``[R, k]`` (unit step stride); ``sample_pos`` likewise.
        :param temperature: fp32 ``[states]``; ``seeds``: int64 ``[states]``.
        :param out_max: fp32 ``[>= R, NB]`` contiguous rows, ``NB = cdiv(V, 256)``; ``out_arg``: int64, the same.
        :param noise: ``markov_noise``'s fp32 ``[R, k, V]``, or None to draw the noise here.
        :raises warmreg.LaunchError: for shapes, dtypes or layouts the kernel cannot take.
        """
        rows, vocab = base.shape if base.ndim == 2 else (0, 0)
        self._check(w1, w2, base, cache, out_max, out_arg, noise, step)
        key = self.dispatch(w1=w1, w2=w2, base=base, cache=cache, noise=noise, out_max=out_max)
        nb = out_max.shape[1]
        read, strides = (noise, (noise.stride(0), noise.stride(1))) if noise is not None else (out_max, (0, 0))
        kwargs = dict(
            prev_tok_ptr=prev, input_ids_ptr=input_ids, anchor_idx_ptr=anchor_idx, w1_ptr=w1, w2_ptr=w2,
            base_ptr=base, base_stride=base.stride(0), cache_ptr=cache, cache_stride0=cache.stride(0),
            cache_stride1=cache.stride(1), idx_map_ptr=idx_map, idx_stride=idx_map.stride(0), pos_ptr=sample_pos,
            pos_stride=sample_pos.stride(0), temp_ptr=temperature, seeds_ptr=seeds, out_max_ptr=out_max,
            out_arg_ptr=out_arg, noise_ptr=read, noise_stride0=strides[0], noise_stride1=strides[1], num_rows=rows,
            vocab=vocab, num_blocks=nb, step=step, salt=DRAFT_SALT, RANK=key.rank, VB=key.vocab_block,
            VT=key.vocab_tile, RB=key.row_block, NOISE=key.noise,
        )  # fmt: skip
        grid = (triton.cdiv(rows, key.row_block), nb) if rows else None
        return warmreg.LaunchSpec(key, grid, kwargs, (out_max, out_arg))

    def _check(self, w1: torch.Tensor, w2: torch.Tensor, base: torch.Tensor, cache: torch.Tensor,
               out_max: torch.Tensor, out_arg: torch.Tensor, noise: torch.Tensor | None, step: int) -> None:  # fmt: skip
        def fail(arg: str, message: str) -> None:
            raise warmreg.LaunchError(self.name, f"{arg} {message}")

        d = w1.shape[1] if w1.ndim == 2 else 0
        for arg, w in (("w1", w1), ("w2", w2)):
            if w.ndim != 2 or w.dtype != torch.bfloat16 or not w.is_contiguous() or w.shape[1] != d:
                fail(arg, f"must be contiguous bfloat16 [*, D] with one D (got {w.dtype} {tuple(w.shape)})")
        if d < 16 or d & (d - 1) or d > 512:
            fail("w1", f"rank must be a power of two in [16, 512] (got {d})")
        if base.ndim != 2 or base.dtype not in (torch.bfloat16, torch.float32) or base.stride(1) != 1:
            fail("base", f"must be bfloat16 or float32 [R, V] with unit vocabulary stride (got {base.dtype} "
                         f"{tuple(base.shape)} strides {base.stride()})")  # fmt: skip
        if w2.shape[0] != base.shape[1]:
            fail("w2", f"must have V = {base.shape[1]} rows (got {w2.shape[0]})")
        if cache.ndim != 3 or cache.dtype != base.dtype or cache.shape[2] < base.shape[1] or cache.stride(2) != 1:
            fail("cache", f"must be {base.dtype} [states, k, >= {base.shape[1]}] with unit vocabulary stride "
                          f"(got {cache.dtype} {tuple(cache.shape)})")  # fmt: skip
        if not 0 <= step < cache.shape[1]:
            fail("step", f"must be in [0, k = {cache.shape[1]}) (got {step})")
        nb = triton.cdiv(base.shape[1], VB)
        for arg, buf, dt in (("out_max", out_max, torch.float32), ("out_arg", out_arg, torch.int64)):
            if (
                buf.ndim != 2
                or buf.dtype != dt
                or buf.shape[0] < base.shape[0]
                or buf.shape[1] != nb
                or not buf.is_contiguous()
            ):
                fail(arg, f"must be contiguous {dt} [>= {base.shape[0]}, {nb}] (got {buf.dtype} {tuple(buf.shape)})")
        if noise is not None and (noise.ndim != 3 or noise.dtype != torch.float32 or noise.stride(2) != 1
                                  or noise.shape[0] < base.shape[0] or noise.shape[2] < base.shape[1]):  # fmt: skip
            fail(
                "noise",
                f"must be float32 [R, k, V] with unit vocabulary stride (got {noise.dtype} {tuple(noise.shape)})",
            )


def register(registry: warmreg.Registry, m: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the Markov step on the SM100 family for the specialized decode's DSpark drafter with
    probabilistic drafts (``specialized.dspark_draft``).

    :raises warmreg.ConfigError: for malformed specialized-decode settings.
    """
    draft = dspark_draft(config)
    if draft is None or not draft.probabilistic:
        return
    registry.add(
        MarkovStep(num_speculative_tokens=draft.num_speculative_tokens, max_num_seqs=draft.max_num_seqs,
                   vocab_size=draft.vocab_size, rank=draft.markov_rank, dtype=draft.dtype),
        when=SM100_FAMILY,
    )  # fmt: skip
