"""DeepSeek-V4.1 ROCm DSpark drafts with ``--monokernel``: the sequential Markov sampling, one launch a draft step and
one for the last step's tokens (vLLM 0.34 ``models/deepseek_v41/amd/ops/fused_markov.py``: ``sample_sequential`` ->
``_markov_step_kernel``, ``_markov_last_kernel``).

Draft step ``s`` of row (request) ``r < R``, vocabulary block ``b`` of ``BLOCK = 256`` tokens ``v``, rank ``K``::

    prev[r]    = s == 0 ? input_ids[anchor_idx[r]] : arg[r, first argmax_j max[r, j]]     (the previous step's maxima)
                 (program 0 of step s > 0 writes it: tokens[r, s - 1] = prev[r])
    bias[v]    = bf16(sum_k fp32(w2[v, k]) * fp32(w1[prev[r], k]))                         (fp32 sum in K_CHUNK = 64 chunks)
    x[v]       = bf16(fp32(base[r, v]) + fp32(bias[v]));    i = idx_map[r, s];   cache[i, s, v] = x[v]  (i >= 0)
    t          = temperature[i] (0 when i < 0);  y[v] = t != 0 ? x[v] / t + g[v] : x[v]   (-inf past the vocabulary)
    g[v]       = -log(-log1p_neg(u)),  u = draft_uniform(seeds[i], s, pos[r, s] - 1 + 2**30, v)
    max[r, b]  = max_v y[v];   arg[r, b] = the first v reaching it                       (written to this step's scratch)

and the last launch, one program a row: ``tokens[r, S - 1] = arg[r, first argmax_j max[r, j]]``. The block maxima
alternate between two scratch pairs (fp32 ``[8, nb]`` and int64 ``[8, nb]``, ``nb = cdiv(vocab, 256)``): step ``s``
writes pair ``s % 2`` and reads the other. ``u`` is vLLM's ``murmur3_uniform32`` of the step-mixed seed
(:func:`._v41_markov.draft_uniform`), ``log1p_neg`` its ``_log1p_neg_stable`` (a degree-8 series below 0.25). The
weights (``markov_w1`` / ``markov_w2`` ``[vocab, K]``), the base logits (``[R, S, vocab]`` rows, a step's ``[R, vocab]``
view) and the draft logits cache (``[max_num_reqs, S, vocab]``) are bf16; ``input_ids`` int32, ``anchor_idx``,
``idx_map``, ``pos``, ``seeds`` and ``tokens`` int64, ``temperature`` fp32. The step grid is ``(nb,)`` with 4 warps,
the last ``(R,)`` with Triton's default 4.

Where it runs: ``DSparkSpeculator._sample_sequential`` asks the draft model's ``sample_sequential``
(``models/deepseek_v41/amd/dspark.py``) every decode step of a V4.1 DSpark deployment on ROCm, which launches these
when ``ops.monokernel_cdna3_or_4()`` (``--monokernel`` on gfx942 or gfx950: warmreg's ``serving.monokernel``) and
``_why_not`` passes: probabilistic drafts (a draft logits cache: ``serving.draft_sample_method`` ``probabilistic``),
``1 <= R <= 8`` requests on gfx942 (5 on gfx950, ``MAX_ROWS_GFX950``), bf16 weights and logits. vLLM's other
conditions (no top-k drafts, watermark, reduced draft vocabulary, confidence head, acceptance estimator or FP64 Gumbel
noise) are its defaults and have no warmreg setting: they are taken as met, as for CUDA's fused sampler.

Keys: the step's ``STEP`` and ``ROWS``, the rank, ``BLOCKS_POW2 = next_pow2(nb)`` and the warps (the last launch:
``STEP = S - 1`` and ``BLOCKS_POW2``). Strides, the vocabulary and ``nb`` are runtime ints (not specialized), and no
pointer is specialized on alignment (a step's base logits are a column view).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._serving import serving_int
from ._v41_markov import DRAFT_NOISE_SALT, draft_uniform, markov_rank, uniform32
from ._v41_rocm import monokernel
from .dspark import DSPARK, num_speculative_tokens, speculative_method
from .model import DSV4, PLUGIN

__all__ = [
    "BLOCK", "MAX_ROWS", "MAX_ROWS_GFX950", "V41RocmMarkovLast", "V41RocmMarkovLastKey", "V41RocmMarkovStep",
    "V41RocmMarkovStepKey", "markov_sequential_reference", "register", "rocm_fused_markov", "rows_on",
]  # fmt: skip

#: Vocabulary tokens a step program (vLLM's ``BLOCK``).
BLOCK = 256
#: The rank columns multiplied at a time (vLLM's ``K_CHUNK``).
K_CHUNK = 64
#: The most rows a step takes on gfx942 (``MAX_ROWS``) and gfx950 (``MAX_ROWS_GFX950``).
MAX_ROWS, MAX_ROWS_GFX950 = 8, 5
_NUM_WARPS = 4
_SALT = tl.constexpr(DRAFT_NOISE_SALT)
_STEP_PTRS = [
    "prev_max_ptr", "prev_arg_ptr", "input_ids_ptr", "anchor_idx_ptr", "tokens_ptr", "w1_ptr", "w2_ptr", "base_ptr",
    "cache_ptr", "idx_map_ptr", "pos_ptr", "temp_ptr", "seeds_ptr", "out_max_ptr", "out_arg_ptr",
]  # fmt: skip


@triton.jit
def _log1p_neg(u):  # log(1 - u): a degree-8 series below 0.25 (vLLM's _log1p_neg_stable), else a clamped log
    p = 1.0 / 8.0
    p = 1.0 / 7.0 + u * p
    p = 1.0 / 6.0 + u * p
    p = 1.0 / 5.0 + u * p
    p = 1.0 / 4.0 + u * p
    p = 1.0 / 3.0 + u * p
    p = 1.0 / 2.0 + u * p
    p = 1.0 + u * p
    return tl.where(u < 0.25, -u * p, tl.log(tl.maximum(1.0 - u, 5.960464477539063e-08)))


@triton.jit(
    do_not_specialize=[
        "tokens_stride", "base_stride", "cache_stride0", "cache_stride1", "idx_stride", "pos_stride", "vocab",
        "num_blocks",
    ],
    do_not_specialize_on_alignment=_STEP_PTRS,
)  # fmt: skip
def _markov_step_kernel(
    prev_max_ptr,  # fp32 [>= ROWS, num_blocks]: the previous step's block maxima
    prev_arg_ptr,  # int64 [>= ROWS, num_blocks]: their token ids
    input_ids_ptr,  # int32
    anchor_idx_ptr,  # int64 [>= ROWS]
    tokens_ptr,  # int64 draft_tokens [max_num_reqs, S]
    tokens_stride,
    w1_ptr,  # bf16 [vocab, RANK] contiguous
    w2_ptr,  # bf16 [vocab, RANK] contiguous
    base_ptr,  # bf16 [ROWS, vocab] unit column stride
    base_stride,
    cache_ptr,  # bf16 [max_num_reqs, S, vocab] unit column stride
    cache_stride0,
    cache_stride1,
    idx_map_ptr,  # int64 [ROWS, S] unit column stride
    idx_stride,
    pos_ptr,  # int64 [ROWS, S] unit column stride
    pos_stride,
    temp_ptr,  # fp32 [max_num_reqs]
    seeds_ptr,  # int64 [max_num_reqs]
    out_max_ptr,  # fp32 [>= ROWS, num_blocks]
    out_arg_ptr,  # int64 [>= ROWS, num_blocks]
    vocab,
    num_blocks,
    STEP: tl.constexpr,  # the draft step: step 0 reads the anchor token, a later one the previous maxima
    ROWS: tl.constexpr,  # the rows, unrolled
    RANK: tl.constexpr,  # the Markov rank
    BLOCK: tl.constexpr,  # vocabulary tokens a program
    K_CHUNK: tl.constexpr,  # rank columns a product
    BLOCKS_POW2: tl.constexpr,  # next_pow2(num_blocks): the maxima a row reduces
):
    b = tl.program_id(0)
    v = b * BLOCK + tl.arange(0, BLOCK)
    inside = v < vocab
    j = tl.arange(0, BLOCKS_POW2)
    for r in tl.static_range(ROWS):
        if STEP == 0:
            prev = tl.load(input_ids_ptr + tl.load(anchor_idx_ptr + r)).to(tl.int64)
        else:
            best = tl.argmax(
                tl.load(prev_max_ptr + r * num_blocks + j, mask=j < num_blocks, other=float("-inf")), axis=0,
                tie_break_left=True,
            )  # fmt: skip
            prev = tl.load(prev_arg_ptr + r * num_blocks + best)
            if b == 0:
                tl.store(tokens_ptr + r * tokens_stride + (STEP - 1), prev)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in tl.static_range(0, RANK, K_CHUNK):
            k = k0 + tl.arange(0, K_CHUNK)
            w = tl.load(w2_ptr + v[:, None].to(tl.int64) * RANK + k[None, :], mask=inside[:, None], other=0.0)
            e = tl.load(w1_ptr + prev * RANK + k).to(tl.float32)
            acc += tl.sum(w.to(tl.float32) * e[None, :], axis=1)
        base = tl.load(base_ptr + r * base_stride + v, mask=inside, other=0.0).to(tl.float32)
        x = (base + acc.to(tl.bfloat16).to(tl.float32)).to(tl.bfloat16)
        req = tl.load(idx_map_ptr + r * idx_stride + STEP)
        live = req >= 0
        tl.store(cache_ptr + req * cache_stride0 + STEP * cache_stride1 + v, x, mask=tl.where(live, inside, False))
        temp = tl.load(temp_ptr + req, mask=live, other=0.0)
        seed = tl.load(seeds_ptr + req, mask=live, other=0)
        y = tl.where(inside, x.to(tl.float32), float("-inf"))
        if temp != 0.0:
            pos = tl.load(pos_ptr + r * pos_stride + STEP) - 1 + _SALT
            u = draft_uniform(seed, tl.full([], STEP, tl.int64), pos, v)
            y = tl.where(inside, y / temp - tl.log(-_log1p_neg(u)), float("-inf"))
        top, at = tl.max(y, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(out_max_ptr + r * num_blocks + b, top)
        tl.store(out_arg_ptr + r * num_blocks + b, (b * BLOCK + at).to(tl.int64))


@triton.jit(do_not_specialize=["tokens_stride", "num_blocks"], do_not_specialize_on_alignment=["tokens_ptr"])
def _markov_last_kernel(
    prev_max_ptr,  # fp32 [>= R, num_blocks]: the last step's block maxima
    prev_arg_ptr,  # int64 [>= R, num_blocks]
    tokens_ptr,  # int64 draft_tokens [max_num_reqs, S]
    tokens_stride,
    num_blocks,
    STEP: tl.constexpr,  # the last step, S - 1: the column written
    BLOCKS_POW2: tl.constexpr,  # next_pow2(num_blocks)
):
    r = tl.program_id(0)
    j = tl.arange(0, BLOCKS_POW2)
    m = tl.load(prev_max_ptr + r * num_blocks + j, mask=j < num_blocks, other=float("-inf"))
    best = tl.argmax(m, axis=0, tie_break_left=True)
    tl.store(tokens_ptr + r * tokens_stride + STEP, tl.load(prev_arg_ptr + r * num_blocks + best))


@attrs.frozen(kw_only=True)
class V41RocmMarkovStepKey(warmreg.CompileKey):
    """What changes the step binary: the step, the rows, the rank, the block maxima a row reduces, the warps."""

    step: int
    rows: int
    rank: int
    blocks_pow2: int
    num_warps: int


@attrs.frozen(kw_only=True)
class V41RocmMarkovLastKey(warmreg.CompileKey):
    """What changes the last launch's binary: the column it writes and the block maxima a row reduces."""

    step: int
    blocks_pow2: int


def _tensor(name: str, what: str, t: torch.Tensor, dtype: torch.dtype, ndim: int, unit: bool = True) -> None:
    if t.dtype != dtype or t.ndim != ndim or (unit and t.shape[-1] > 1 and t.stride(-1) != 1):
        raise warmreg.LaunchError(name, f"{what} must be a {dtype} {ndim}-d tensor" + (" with unit last stride" if unit
                                  else "") + f" (got {t.dtype} {tuple(t.shape)}, strides {t.stride()})")  # fmt: skip


def _scratch(name: str, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], rows: int, nb: int) -> None:
    for m, a in pairs:
        for what, t, dt in (("block maxima", m, torch.float32), ("block token ids", a, torch.int64)):
            if t.dtype != dt or t.ndim != 2 or t.shape[0] < rows or t.shape[1] != nb or not t.is_contiguous():
                raise warmreg.LaunchError(name, f"the {what} must be a contiguous {dt} [>= {rows}, {nb}] tensor "
                                          f"(got {t.dtype} {tuple(t.shape)})")  # fmt: skip


def _blocks(vocab: int) -> tuple[int, int]:
    nb = triton.cdiv(vocab, BLOCK)
    return nb, triton.next_power_of_2(nb)


def rows_on(platform: warmreg.Platform) -> int:
    """The most rows a step takes on ``platform``: 5 on gfx950, else 8 (``_why_not``)."""
    return MAX_ROWS_GFX950 if platform.arch == "gfx950" else MAX_ROWS


class V41RocmMarkovStep(warmreg.TritonKernel[V41RocmMarkovStepKey]):
    """One DSpark draft step's Markov bias, logits cache and block Gumbel-max; see the module docstring."""

    name = "deepseek_v4.v41_rocm_markov_step"
    key_type = V41RocmMarkovStepKey
    jit = _markov_step_kernel

    def __init__(self, *, steps: int = 1, rank: int = 256, vocab: int = 129280, max_rows: int = MAX_ROWS) -> None:
        """:param steps: draft steps ``S``; ``rank``: the Markov rank; ``vocab``: the vocabulary; ``max_rows``: the
        most requests a step holds (``max_num_seqs``; the platform caps it at 8 or 5)."""
        self.steps, self.rank, self.vocab, self.max_rows = steps, rank, vocab, max_rows

    def dispatch(
        self, *, step: int, idx_map: torch.Tensor, w2: torch.Tensor, base_logits: torch.Tensor
    ) -> V41RocmMarkovStepKey:
        return V41RocmMarkovStepKey(
            step=step, rows=idx_map.shape[0], rank=w2.shape[1], blocks_pow2=_blocks(base_logits.shape[1])[1],
            num_warps=_NUM_WARPS,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Iterable[Mapping[str, Any]]:
        s, vocab, bf = self.steps, self.vocab, torch.bfloat16
        return [
            {
                "step": step, "idx_map": warmreg.meta((r, s), torch.int64), "w2": warmreg.meta((vocab, self.rank), bf),
                "base_logits": warmreg.meta((r, vocab), bf, stride=(s * vocab, 1)),
            }
            for step in range(s)
            for r in range(1, min(self.max_rows, rows_on(platform)) + 1)
        ]  # fmt: skip

    def warmup_inputs(self, key: V41RocmMarkovStepKey) -> Mapping[str, Any]:
        r, s, vocab = key.rows, key.step + 1, key.blocks_pow2 * BLOCK
        bf, i64, f32 = torch.bfloat16, torch.int64, torch.float32
        scratch = (warmreg.meta((MAX_ROWS, key.blocks_pow2), f32), warmreg.meta((MAX_ROWS, key.blocks_pow2), i64))
        return {
            "src": scratch, "dest": scratch, "input_ids": warmreg.meta((r * (s + 1),), torch.int32),
            "anchor_idx": warmreg.meta((r,), i64), "tokens": warmreg.meta((r, s), i64),
            "w1": warmreg.meta((vocab, key.rank), bf), "w2": warmreg.meta((vocab, key.rank), bf),
            "base_logits": warmreg.meta((r, vocab), bf, stride=(s * vocab, 1)), "cache": warmreg.meta((r, s, vocab), bf),
            "idx_map": warmreg.meta((r, s), i64), "sample_pos": warmreg.meta((r, s), i64),
            "temperature": warmreg.meta((r,), f32), "seeds": warmreg.meta((r,), i64), "step": key.step,
        }  # fmt: skip

    @warmreg.kernel_launcher
    def __call__(
        self,
        src: tuple[torch.Tensor, torch.Tensor],
        dest: tuple[torch.Tensor, torch.Tensor],
        input_ids: torch.Tensor,
        anchor_idx: torch.Tensor,
        tokens: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        base_logits: torch.Tensor,
        cache: torch.Tensor,
        idx_map: torch.Tensor,
        sample_pos: torch.Tensor,
        temperature: torch.Tensor,
        seeds: torch.Tensor,
        step: int,
    ) -> warmreg.LaunchSpec[V41RocmMarkovStepKey]:
        """Launch draft step ``step`` (vLLM's ``sample_sequential`` loop body, same arguments); returns ``dest``.

        :param src: the previous step's scratch pair ``(maxima fp32, token ids int64)``, each contiguous
            ``[>= R, nb]`` (read when ``step > 0``); ``dest``: this step's pair (written).
        :param input_ids: int32 (step 0 reads ``input_ids[anchor_idx[r]]``); ``anchor_idx``: int64 ``[>= R]``.
        :param tokens: int64 ``[>= R, > step - 1]`` draft tokens with unit column stride (column ``step - 1`` written).
        :param w1: bf16 ``[vocab', K]`` contiguous (the Markov embedding); ``w2``: bf16 ``[vocab, K]`` contiguous.
        :param base_logits: bf16 ``[R, vocab]``, unit column stride (the step's column of ``[R, S, vocab]``).
        :param cache: bf16 ``[max_num_reqs, S, vocab]`` with unit last stride (row ``idx_map[r, step]``, column
            ``step`` written).
        :param idx_map: int64 ``[R, S]`` (``-1``: an inert row); ``sample_pos``: int64 ``[R, S]``, both unit column
            stride; ``temperature``: fp32 and ``seeds``: int64, by request state.
        :param step: the draft step, ``0 <= step < S``.
        :raises warmreg.LaunchError: for wrong dtypes, ranks or layouts, ``R`` outside 1..8, a rank that is not a
            multiple of 64 or a step out of range.
        """
        name, i64 = self.name, torch.int64
        _tensor(name, "idx_map", idx_map, i64, 2)
        rows, steps = idx_map.shape
        for what, t, dt, nd in (
            ("w1", w1, torch.bfloat16, 2), ("w2", w2, torch.bfloat16, 2), ("base_logits", base_logits, torch.bfloat16, 2),
            ("cache", cache, torch.bfloat16, 3), ("sample_pos", sample_pos, i64, 2), ("tokens", tokens, i64, 2),
        ):  # fmt: skip
            _tensor(name, what, t, dt, nd)
        for what, t, dt in (("input_ids", input_ids, torch.int32), ("anchor_idx", anchor_idx, i64),
                            ("temperature", temperature, torch.float32), ("seeds", seeds, i64)):  # fmt: skip
            _tensor(name, what, t, dt, 1, unit=False)
        rank, vocab = w2.shape[1], base_logits.shape[1]
        if not 1 <= rows <= MAX_ROWS or not 0 <= step < steps or rank % K_CHUNK or w1.shape[1] != rank:
            raise warmreg.LaunchError(name, f"rows must be 1..{MAX_ROWS}, step 0..{steps - 1}, the rank a multiple of "
                                      f"{K_CHUNK} in both weights (got {rows}, {step}, {tuple(w1.shape)}, "
                                      f"{tuple(w2.shape)})")  # fmt: skip
        if not (w1.is_contiguous() and w2.is_contiguous()) or w2.shape[0] < vocab or base_logits.shape[0] < rows:
            raise warmreg.LaunchError(name, f"w1 and w2 must be contiguous, w2 [>= {vocab}, K], base_logits [>= {rows}, "
                                      f"vocab] (got {tuple(w2.shape)}, {tuple(base_logits.shape)})")  # fmt: skip
        nb, _ = _blocks(vocab)
        _scratch(name, (src, dest), rows, nb)
        key = self.dispatch(step=step, idx_map=idx_map, w2=w2, base_logits=base_logits)
        kwargs = dict(
            prev_max_ptr=src[0], prev_arg_ptr=src[1], input_ids_ptr=input_ids, anchor_idx_ptr=anchor_idx,
            tokens_ptr=tokens, tokens_stride=tokens.stride(0), w1_ptr=w1, w2_ptr=w2, base_ptr=base_logits,
            base_stride=base_logits.stride(0), cache_ptr=cache, cache_stride0=cache.stride(0),
            cache_stride1=cache.stride(1), idx_map_ptr=idx_map, idx_stride=idx_map.stride(0), pos_ptr=sample_pos,
            pos_stride=sample_pos.stride(0), temp_ptr=temperature, seeds_ptr=seeds, out_max_ptr=dest[0],
            out_arg_ptr=dest[1], vocab=vocab, num_blocks=nb, STEP=step, ROWS=rows, RANK=rank, BLOCK=BLOCK,
            K_CHUNK=K_CHUNK, BLOCKS_POW2=key.blocks_pow2,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (nb,), kwargs, dest)


class V41RocmMarkovLast(warmreg.TritonKernel[V41RocmMarkovLastKey]):
    """The last draft step's tokens from its block maxima; see the module docstring."""

    name = "deepseek_v4.v41_rocm_markov_last"
    key_type = V41RocmMarkovLastKey
    jit = _markov_last_kernel

    def __init__(self, *, steps: int = 1, vocab: int = 129280) -> None:
        """:param steps: draft steps ``S`` (the launch writes column ``S - 1``); ``vocab``: the vocabulary."""
        self.steps, self.vocab = steps, vocab

    def dispatch(self, *, tokens: torch.Tensor, vocab: int) -> V41RocmMarkovLastKey:
        return V41RocmMarkovLastKey(step=tokens.shape[1] - 1, blocks_pow2=_blocks(vocab)[1])

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Iterable[Mapping[str, Any]]:
        return [{"tokens": warmreg.meta((MAX_ROWS, self.steps), torch.int64), "vocab": self.vocab}]

    def warmup_inputs(self, key: V41RocmMarkovLastKey) -> Mapping[str, Any]:
        nb = key.blocks_pow2
        return {
            "last": (warmreg.meta((MAX_ROWS, nb), torch.float32), warmreg.meta((MAX_ROWS, nb), torch.int64)),
            "tokens": warmreg.meta((MAX_ROWS, key.step + 1), torch.int64), "rows": 1, "vocab": nb * BLOCK,
        }  # fmt: skip

    @warmreg.kernel_launcher
    def __call__(
        self, last: tuple[torch.Tensor, torch.Tensor], tokens: torch.Tensor, rows: int, vocab: int
    ) -> warmreg.LaunchSpec[V41RocmMarkovLastKey]:
        """Write ``tokens[r, S - 1]`` for ``r < rows`` from the last step's scratch pair; returns ``tokens``.

        :param last: the last step's ``(maxima fp32, token ids int64)``, contiguous ``[>= rows, cdiv(vocab, 256)]``.
        :param tokens: int64 ``[>= rows, S]`` with unit column stride; ``rows``: 1..8; ``vocab``: the vocabulary.
        :raises warmreg.LaunchError: for wrong dtypes or layouts, or ``rows`` out of range.
        """
        name = self.name
        _tensor(name, "tokens", tokens, torch.int64, 2)
        if not 1 <= rows <= min(MAX_ROWS, tokens.shape[0]) or vocab < 1:
            raise warmreg.LaunchError(name, f"rows must be 1..{MAX_ROWS} within tokens and vocab >= 1 (got {rows}, "
                                      f"{vocab}, tokens {tuple(tokens.shape)})")  # fmt: skip
        nb, _ = _blocks(vocab)
        _scratch(name, (last,), rows, nb)
        key = self.dispatch(tokens=tokens, vocab=vocab)
        kwargs = dict(prev_max_ptr=last[0], prev_arg_ptr=last[1], tokens_ptr=tokens, tokens_stride=tokens.stride(0),
                      num_blocks=nb, STEP=key.step, BLOCKS_POW2=key.blocks_pow2)  # fmt: skip
        return warmreg.LaunchSpec(key, (rows,), kwargs, tokens)


def markov_sequential_reference(
    input_ids: torch.Tensor,
    anchor_idx: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    base_logits: torch.Tensor,
    cache: torch.Tensor,
    idx_map: torch.Tensor,
    sample_pos: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of all ``S`` steps (``base_logits`` ``[R, S, vocab]``): ``(tokens int64 [R, S], cache)``
    with ``cache`` a written copy. The bias is summed in fp32 in one order: a sum the kernel's chunked order rounds
    differently can change its last bf16 bit."""
    rows, steps, vocab = base_logits.shape
    cache, tokens = cache.clone(), torch.zeros(rows, steps, dtype=torch.int64)
    prev = input_ids.long()[anchor_idx[:rows].long()]
    for s in range(steps):
        bias = (w2[:vocab].float() @ w1[prev].float().T).T.to(torch.bfloat16).float()
        x = (base_logits[:, s].float() + bias).to(torch.bfloat16)
        for r in range(rows):
            i = int(idx_map[r, s])
            t = float(temperature[i]) if i >= 0 else 0.0
            if i >= 0:
                cache[i, s, :vocab] = x[r]
            y = x[r].float()
            if t != 0.0:
                pos = int(sample_pos[r, s]) - 1 + DRAFT_NOISE_SALT
                u = torch.tensor([uniform32(int(seeds[i]), s, pos, v) for v in range(vocab)], dtype=torch.float32)
                p = torch.full_like(u, 1.0 / 8.0)
                for c in (7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0):
                    p = 1.0 / c + u * p
                log1p = torch.where(u < 0.25, -u * p, torch.log(torch.clamp(1.0 - u, min=5.960464477539063e-08)))
                y = y / torch.tensor(t, dtype=torch.float32) - torch.log(-log1p)
            tokens[r, s] = int(torch.argmax(y))
        prev = tokens[:, s]
    return tokens, cache


def rocm_fused_markov(model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> bool:
    """Whether vLLM 0.34 runs V4.1's ROCm fused Markov sampling: a V4.1 DSpark draft with probabilistic drafts
    (``serving.draft_sample_method``) under ``--monokernel`` on gfx942 / gfx950 (:func:`._v41_rocm.monokernel`).

    :raises warmreg.ConfigError: from :func:`._v41_rocm.monokernel` or a malformed setting.
    """
    if not (model.v41 and platform.is_rocm and speculative_method(config) == DSPARK):
        return False
    method = config.get("serving.draft_sample_method", str, plugin=PLUGIN, default="greedy")
    return method == "probabilistic" and monokernel(config, platform)


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the step and last launches under :func:`rocm_fused_markov`: every step, 1..min(max_num_seqs, 8 or 5)
    rows, the checkpoint's Markov rank and ``text.vocab_size``.

    :raises warmreg.ConfigError: for malformed DSpark settings, a missing rank or ``vocab_size``.
    """
    if not rocm_fused_markov(model, config, platform):
        return
    vocab = config.get(
        "text.vocab_size", int, plugin=PLUGIN, check=lambda v: None if v > 0 else f"must be > 0 (got {v})"
    )
    steps, seqs = num_speculative_tokens(config), serving_int(config, "max_num_seqs")
    arch = warmreg.rocm_arch_in("gfx942", "gfx950")
    registry.add(V41RocmMarkovStep(steps=steps, rank=markov_rank(config), vocab=vocab, max_rows=seqs), when=arch)
    registry.add(V41RocmMarkovLast(steps=steps, vocab=vocab), when=arch)
