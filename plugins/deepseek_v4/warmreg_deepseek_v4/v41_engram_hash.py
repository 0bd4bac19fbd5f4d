"""DeepSeek-V4.1's engram n-gram hash ids (vLLM 0.34 ``models/deepseek_v41/common/engram.py``:
``NgramHashState.forward`` / ``_hash_ids_kernel``).

Every engram layer looks up rows keyed by hashes of the n-grams ending at each position, over a compressed vocab
(``token_map``). For token ``t`` of a flattened step of ``T`` tokens, request ``r`` = the number of
``query_start_loc[1:]`` entries ``<= t`` (clamped to ``R - 1``; padding boundaries repeat), its chunk starts at
``c = positions[min(query_start_loc[r], T - 1)]`` and ``p = positions[t]``. For each layer ``l`` and shift
``s < N`` (``N = max_ngram_size``), with ``q = p - s``::

    src_s = q >= c ? (dead[t - s] ? -1 : token_map[ids[t - s]])                    # the current chunk
          : (0 <= c - 1 - q < D and lb[r, c - 1 - q] >= 0)
              ? (lb_dead[r, c - 1 - q] ? -1 : token_map[lb[r, c - 1 - q]])          # the runner's look-back
              : pad_id
    blocked_s = blocked_{s-1} or q < 0 or src_s == -1                              # a dead token ends the n-gram
    h_s = h_{s-1} XOR ((blocked_s ? pad_id : src_s) * multipliers[l, s])           # int64, h_{-1} = 0
    out[t, l, (s - 1) * H + k] = h_s % primes[l, s - 1, k] + offsets[l, (s - 1) * H + k]   for s >= 1, k < H

``D = lookback_token_ids.shape[1]`` (``N - 1`` in vLLM). Every value is non-negative (token ids, ``pad_id`` and the
odd multipliers vLLM bounds so products cannot overflow), so ``%`` needs no sign convention. ``out`` is a fresh int32
``[T, L, (N - 1) * H]`` (the int64 bucket is narrowed on store, as in vLLM). Grid ``(cdiv(T, 32), L)``: 32 tokens a
program, four warps, as in vLLM.

Where it runs: every V4.1 CUDA step with engram layers (``text.engram_layer_ids``): ``DeepseekV4Model.forward``
(``nvidia/model.py``) hashes the whole flattened batch once, with ``image_sentinel_mask`` as the dead masks and the
sparse-SWA metadata's ``query_start_loc``, before the decoder layers (profile runs take ``dummy_hashes``, no kernel).
vLLM passes int32 ``input_ids`` (int64 under a native mega-MoE backend, which warmreg has no setting for), int64
positions, int32 ``query_start_loc``, the runner's int32 ``[max_reqs, N - 1]`` look-back window, bool masks and
int32 / int64 / int64 / int64 token map, multipliers, primes and offsets.

Key: the dtypes, ``N``, the head tile ``next_pow2(H)``, the token tile and the warps. Unlike vLLM's kernel, which
specializes its strides, sizes and pointers' alignment (one binary per layout class), every size, stride and the
head count are runtime integers that are not specialized, and no pointer is specialized on alignment.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from .model import DSV4

__all__ = ["BLOCK_T", "DEAD_ID", "EngramHash", "EngramHashKey", "engram_hash_reference", "register"]

#: Tokens a program (vLLM's ``BLOCK_T``).
BLOCK_T = 32
#: The source id of a token that takes no part in an n-gram (vLLM's ``DEAD_ID``).
DEAD_ID = -1
_NUM_WARPS = 4
_INTS = [
    "num_tokens", "num_reqs", "num_heads", "pad_id", "lookback_depth", "ids_stride", "dead_stride", "pos_stride",
    "qsl_stride", "lb_stride_r", "lb_stride_c", "lbd_stride_r", "lbd_stride_c",
]  # fmt: skip
_PTRS = [
    "ids_ptr", "token_map_ptr", "dead_ptr", "pos_ptr", "qsl_ptr", "mult_ptr", "primes_ptr", "offsets_ptr", "lb_ptr",
    "lb_dead_ptr", "out_ptr",
]  # fmt: skip


@triton.jit(do_not_specialize=_INTS, do_not_specialize_on_alignment=_PTRS)
def _engram_hash_kernel(
    ids_ptr,  # [T] token ids
    token_map_ptr,  # [vocab] int32 compressed ids
    dead_ptr,  # [T] bool: True takes no part in an n-gram
    pos_ptr,  # [T] positions
    qsl_ptr,  # [R + 1] query_start_loc
    mult_ptr,  # [L, N] int64
    primes_ptr,  # [L, N - 1, H] int64
    offsets_ptr,  # [L, (N - 1) * H] int64
    lb_ptr,  # [>= R, D] look-back token ids, -1 unknown
    lb_dead_ptr,  # [>= R, D] bool
    out_ptr,  # [T, L, (N - 1) * H] int32, contiguous
    num_tokens,
    num_reqs,
    num_heads,
    pad_id,
    lookback_depth,
    ids_stride,
    dead_stride,
    pos_stride,
    qsl_stride,
    lb_stride_r,
    lb_stride_c,
    lbd_stride_r,
    lbd_stride_c,
    N: tl.constexpr,  # max_ngram_size: the shifts are unrolled
    BLOCK_H: tl.constexpr,  # next_pow2(num_heads)
    BLOCK_T: tl.constexpr,  # tokens a program
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    layer = tl.program_id(1)
    num_layers = tl.num_programs(1)
    live = t < num_tokens
    # r = #{query_start_loc[j + 1] <= t}: a lock-step binary search over the request ends.
    lo = tl.zeros((BLOCK_T,), tl.int32)
    hi = tl.zeros((BLOCK_T,), tl.int32) + num_reqs
    while tl.max((lo < hi).to(tl.int32), 0) > 0:
        open_ = lo < hi
        mid = (lo + hi) // 2
        end = tl.load(qsl_ptr + (mid + 1).to(tl.int64) * qsl_stride, mask=open_, other=0)
        after = t >= end
        lo = tl.where(open_ & after, mid + 1, lo)
        hi = tl.where(open_ & ~after, mid, hi)
    req = tl.minimum(lo, num_reqs - 1).to(tl.int64)
    first = tl.minimum(tl.load(qsl_ptr + req * qsl_stride), num_tokens - 1).to(tl.int64)
    chunk_start = tl.load(pos_ptr + first * pos_stride).to(tl.int64)
    pos = tl.load(pos_ptr + t.to(tl.int64) * pos_stride, mask=live, other=0).to(tl.int64)
    k = tl.arange(0, BLOCK_H)
    head_live = k < num_heads
    blocked = tl.zeros((BLOCK_T,), tl.int1)
    h = tl.zeros((BLOCK_T,), tl.int64)
    for s in tl.static_range(N):
        q = pos - s
        here = live & (q >= chunk_start)
        bt = tl.maximum(t - s, 0).to(tl.int64)
        tok = tl.load(ids_ptr + bt * ids_stride, mask=here, other=0)
        src_here = tl.load(token_map_ptr + tok, mask=here, other=0).to(tl.int64)
        dead_here = tl.load(dead_ptr + bt * dead_stride, mask=here, other=0) != 0
        src_here = tl.where(dead_here, -1, src_here)
        col = chunk_start - 1 - q
        window = live & (q < chunk_start) & (col >= 0) & (col < lookback_depth)
        col = tl.where(window, col, 0)
        lb_tok = tl.load(lb_ptr + req * lb_stride_r + col * lb_stride_c, mask=window, other=-1).to(tl.int64)
        known = window & (lb_tok >= 0)
        src_lb = tl.load(token_map_ptr + tl.where(known, lb_tok, 0), mask=known, other=0).to(tl.int64)
        dead_lb = tl.load(lb_dead_ptr + req * lbd_stride_r + col * lbd_stride_c, mask=known, other=0) != 0
        src_lb = tl.where(dead_lb, -1, src_lb)
        src = tl.where(q >= chunk_start, src_here, tl.where(known, src_lb, pad_id))
        blocked = blocked | (q < 0) | (src == -1)
        value = tl.where(blocked, pad_id, src).to(tl.int64)
        h = h ^ (value * tl.load(mult_ptr + layer * N + s))
        if s > 0:
            cols = (s - 1) * num_heads + k
            param = layer * (N - 1) * num_heads + cols
            prime = tl.load(primes_ptr + param, mask=head_live, other=1)
            offset = tl.load(offsets_ptr + param, mask=head_live, other=0)
            bucket = h[:, None] % prime[None, :] + offset[None, :]
            dst = (t.to(tl.int64) * num_layers + layer)[:, None] * ((N - 1) * num_heads) + cols[None, :]
            tl.store(out_ptr + dst, bucket.to(tl.int32), mask=live[:, None] & head_live[None, :])


@attrs.frozen(kw_only=True)
class EngramHashKey(warmreg.CompileKey):
    """What changes the binary of the hash: the dtypes, the n-gram size, the head tile, the token tile, the warps."""

    ids_dtype: str
    positions_dtype: str
    qsl_dtype: str
    lookback_dtype: str
    max_ngram: int
    block_h: int
    block_t: int
    num_warps: int


class EngramHash(warmreg.TritonKernel[EngramHashKey]):
    """The ``[T, L, (N - 1) * H]`` bucket ids of every token's n-grams (the module docstring has the math).

    :param n_layers: engram layers ``L`` (domains only).
    :param max_ngram_size: ``N`` (domains only).
    :param n_heads: ``H`` (domains only).
    """

    name = "deepseek_v4.v41_engram_hash"
    key_type = EngramHashKey
    jit = _engram_hash_kernel

    def __init__(self, *, n_layers: int, max_ngram_size: int, n_heads: int) -> None:
        self.n_layers, self.max_ngram_size, self.n_heads = n_layers, max_ngram_size, n_heads

    def dispatch(
        self, *, input_ids: torch.Tensor, positions: torch.Tensor, query_start_loc: torch.Tensor,
        lookback_token_ids: torch.Tensor, primes: torch.Tensor,
    ) -> EngramHashKey:  # fmt: skip
        _, n_minus_1, heads = primes.shape
        return EngramHashKey(
            ids_dtype=warmreg.dtype_name(input_ids.dtype), positions_dtype=warmreg.dtype_name(positions.dtype),
            qsl_dtype=warmreg.dtype_name(query_start_loc.dtype),
            lookback_dtype=warmreg.dtype_name(lookback_token_ids.dtype), max_ngram=n_minus_1 + 1,
            block_h=warmreg.next_pow2(heads), block_t=BLOCK_T, num_warps=_NUM_WARPS,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        n, h, layers = self.max_ngram_size, self.n_heads, self.n_layers
        return {
            "input_ids": [warmreg.meta((16,), torch.int32)],  # no size is in the key
            "positions": [warmreg.meta((16,), torch.int64)],
            "query_start_loc": [warmreg.meta((3,), torch.int32)],
            "lookback_token_ids": [warmreg.meta((2, n - 1), torch.int32)],
            "primes": [warmreg.meta((layers, n - 1, h), torch.int64)],
        }

    def warmup_inputs(self, key: EngramHashKey) -> Mapping[str, Any]:
        n, h, depth = key.max_ngram, key.block_h, key.max_ngram - 1
        return {
            "input_ids": warmreg.meta((4,), getattr(torch, key.ids_dtype)),
            "positions": warmreg.meta((4,), getattr(torch, key.positions_dtype)),
            "query_start_loc": warmreg.meta((2,), getattr(torch, key.qsl_dtype)),
            "dead_mask": warmreg.meta((4,), torch.bool),
            "lookback_token_ids": warmreg.meta((1, depth), getattr(torch, key.lookback_dtype)),
            "lookback_dead_mask": warmreg.meta((1, depth), torch.bool),
            "token_map": warmreg.meta((64,), torch.int32),
            "multipliers": warmreg.meta((1, n), torch.int64),
            "primes": warmreg.meta((1, n - 1, h), torch.int64),
            "offsets": warmreg.meta((1, (n - 1) * h), torch.int64),
            "pad_id": 2,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        query_start_loc: torch.Tensor,
        dead_mask: torch.Tensor,
        lookback_token_ids: torch.Tensor,
        lookback_dead_mask: torch.Tensor,
        *,
        token_map: torch.Tensor,
        multipliers: torch.Tensor,
        primes: torch.Tensor,
        offsets: torch.Tensor,
        pad_id: int,
        out: torch.Tensor | None = None,
    ) -> warmreg.LaunchSpec[EngramHashKey]:
        """The int32 ``[T, L, (N - 1) * H]`` bucket ids (``out``, or a fresh tensor); vLLM's
        ``NgramHashState.forward`` arguments, its buffers as keywords.

        :param input_ids: int32 or int64 ``[T]``, any stride.
        :param positions: int32 or int64 ``[T]``, any stride.
        :param query_start_loc: int32 or int64 ``[R + 1]``, any stride (``R >= 1``).
        :param dead_mask: bool ``[T]``, any stride: True for a token outside every n-gram (image spans).
        :param lookback_token_ids: int32 or int64 ``[>= R, D]``, any strides: the ``D`` ids before each request's
            chunk, nearest first, ``-1`` unknown.
        :param lookback_dead_mask: bool, ``lookback_token_ids``' shape, any strides.
        :param token_map: int32 ``[vocab]``: token id -> compressed id.
        :param multipliers: int64 contiguous ``[L, N]``.
        :param primes: int64 contiguous ``[L, N - 1, H]``.
        :param offsets: int64 contiguous ``[L, (N - 1) * H]``.
        :param pad_id: the compressed id of the pad token.
        :param out: a buffer instead of a fresh one: int32 contiguous ``[T, L, (N - 1) * H]``.
        :raises warmreg.LaunchError: naming the argument whose dtype or shape the kernel cannot take.
        """
        self._check(input_ids, positions, query_start_loc, dead_mask, lookback_token_ids, lookback_dead_mask)
        self._check_params(token_map, multipliers, primes, offsets)
        key = self.dispatch(
            input_ids=input_ids, positions=positions, query_start_loc=query_start_loc,
            lookback_token_ids=lookback_token_ids, primes=primes,
        )  # fmt: skip
        layers, n_minus_1, heads = primes.shape
        tokens = input_ids.shape[0]
        out = warmreg.output(self.name, "out", out, (tokens, layers, n_minus_1 * heads), torch.int32, input_ids.device)
        kwargs = dict(
            ids_ptr=input_ids, token_map_ptr=token_map, dead_ptr=dead_mask, pos_ptr=positions, qsl_ptr=query_start_loc,
            mult_ptr=multipliers, primes_ptr=primes, offsets_ptr=offsets, lb_ptr=lookback_token_ids,
            lb_dead_ptr=lookback_dead_mask, out_ptr=out, num_tokens=tokens, num_reqs=query_start_loc.shape[0] - 1,
            num_heads=heads, pad_id=pad_id, lookback_depth=lookback_token_ids.shape[1], ids_stride=input_ids.stride(0),
            dead_stride=dead_mask.stride(0), pos_stride=positions.stride(0), qsl_stride=query_start_loc.stride(0),
            lb_stride_r=lookback_token_ids.stride(0), lb_stride_c=lookback_token_ids.stride(1),
            lbd_stride_r=lookback_dead_mask.stride(0), lbd_stride_c=lookback_dead_mask.stride(1),
            N=key.max_ngram, BLOCK_H=key.block_h, BLOCK_T=key.block_t,
        )  # fmt: skip
        grid = (triton.cdiv(tokens, key.block_t), layers) if tokens and layers else None
        return warmreg.LaunchSpec(key, grid, kwargs, out)

    def _check(
        self, input_ids: torch.Tensor, positions: torch.Tensor, query_start_loc: torch.Tensor, dead_mask: torch.Tensor,
        lookback_token_ids: torch.Tensor, lookback_dead_mask: torch.Tensor,
    ) -> None:  # fmt: skip
        ints = (torch.int32, torch.int64)
        tokens = input_ids.shape[0] if input_ids.ndim == 1 else -1
        for name, t in (("input_ids", input_ids), ("positions", positions)):
            if t.ndim != 1 or t.dtype not in ints or t.shape[0] != tokens:
                raise warmreg.LaunchError(
                    self.name, f"{name} must be int32 or int64 [T] (got {t.dtype} {tuple(t.shape)})"
                )
        if dead_mask.shape != (tokens,) or dead_mask.dtype != torch.bool:
            raise warmreg.LaunchError(
                self.name, f"dead_mask must be bool [{tokens}] (got {dead_mask.dtype} {tuple(dead_mask.shape)})"
            )
        if query_start_loc.ndim != 1 or query_start_loc.shape[0] < 2 or query_start_loc.dtype not in ints:
            raise warmreg.LaunchError(
                self.name,
                f"query_start_loc must be int32 or int64 [R + 1], R >= 1 (got {tuple(query_start_loc.shape)})",
            )
        reqs = query_start_loc.shape[0] - 1
        lb = lookback_token_ids
        if lb.ndim != 2 or lb.dtype not in ints or lb.shape[0] < reqs or lb.shape[1] < 1:
            raise warmreg.LaunchError(
                self.name,
                f"lookback_token_ids must be int32 or int64 [>= {reqs}, D >= 1] (got {lb.dtype} {tuple(lb.shape)})",
            )
        if lookback_dead_mask.shape != lb.shape or lookback_dead_mask.dtype != torch.bool:
            raise warmreg.LaunchError(
                self.name, f"lookback_dead_mask must be bool {tuple(lb.shape)} (got {tuple(lookback_dead_mask.shape)})"
            )

    def _check_params(
        self, token_map: torch.Tensor, multipliers: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor
    ) -> None:
        if token_map.ndim != 1 or token_map.dtype != torch.int32:
            raise warmreg.LaunchError(self.name, f"token_map must be int32 [vocab] (got {token_map.dtype})")
        if primes.ndim != 3 or primes.dtype != torch.int64 or not primes.is_contiguous():
            raise warmreg.LaunchError(
                self.name, f"primes must be int64 contiguous [L, N - 1, H] (got {tuple(primes.shape)})"
            )
        layers, n_minus_1, heads = primes.shape
        checks = (
            ("multipliers", multipliers, (layers, n_minus_1 + 1)),
            ("offsets", offsets, (layers, n_minus_1 * heads)),
        )
        for name, t, shape in checks:
            if t.shape != shape or t.dtype != torch.int64 or not t.is_contiguous():
                raise warmreg.LaunchError(
                    self.name, f"{name} must be int64 contiguous {shape} (got {t.dtype} {tuple(t.shape)})"
                )


def engram_hash_reference(
    input_ids: torch.Tensor, positions: torch.Tensor, query_start_loc: torch.Tensor, dead_mask: torch.Tensor,
    lookback_token_ids: torch.Tensor, lookback_dead_mask: torch.Tensor, *, token_map: torch.Tensor,
    multipliers: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor, pad_id: int,
) -> torch.Tensor:  # fmt: skip
    """PyTorch reference of :class:`EngramHash` (the module docstring's math, per token)."""
    layers, n_minus_1, heads = primes.shape
    tokens, reqs, depth = input_ids.shape[0], query_start_loc.shape[0] - 1, lookback_token_ids.shape[1]
    out = torch.empty(tokens, layers, n_minus_1 * heads, dtype=torch.int32)
    qsl, pos, ids = query_start_loc.long().tolist(), positions.long().tolist(), input_ids.long().tolist()
    tmap, lb, mult = token_map.tolist(), lookback_token_ids.long().tolist(), multipliers.tolist()
    dead, lb_dead = dead_mask.tolist(), lookback_dead_mask.tolist()
    flat_primes, flat_offsets = primes.reshape(layers, -1).tolist(), offsets.tolist()
    for t in range(tokens):
        r = min(sum(1 for e in qsl[1:] if e <= t), reqs - 1)
        c, p = pos[min(qsl[r], tokens - 1)], pos[t]
        for layer in range(layers):
            blocked, h = False, 0
            for s in range(n_minus_1 + 1):
                q, col = p - s, c - 1 - p + s
                if q >= c:
                    src = -1 if dead[t - s] else tmap[ids[t - s]]
                elif 0 <= col < depth and lb[r][col] >= 0:
                    src = -1 if lb_dead[r][col] else tmap[lb[r][col]]
                else:
                    src = pad_id
                blocked = blocked or q < 0 or src == -1
                h = ((h ^ ((pad_id if blocked else src) * mult[layer][s])) + 2**63) % 2**64 - 2**63  # int64 wrap
                for k in range(heads if s else 0):
                    j = (s - 1) * heads + k
                    out[t, layer, j] = (h % flat_primes[layer][j] + flat_offsets[layer][j] + 2**31) % 2**32 - 2**31
    return out


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the hash for a V4.1 deployment with engram layers, on CUDA (``DeepseekV4Model.forward``, every step)."""
    layout = model.engram
    if layout is None:
        return
    kernel = EngramHash(n_layers=len(layout.layer_ids), max_ngram_size=layout.max_ngram_size, n_heads=layout.n_heads)
    registry.add(kernel, when=warmreg.is_cuda if model.v41 else False)
