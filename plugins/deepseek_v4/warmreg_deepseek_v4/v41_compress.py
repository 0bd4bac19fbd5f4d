"""DeepSeek-V4.1's compressor: state saving, softmax-gated pooling and RMSNorm in one kernel (vLLM 0.34
``models/deepseek_v41/common/ops/fused_compress_quant_cache.py``: ``fused_save_compress_norm``,
``_fused_save_compress_norm_kernel`` with its ``_store_latent``; launched by ``DeepseekCompressor.forward``).

V4.1 compresses by ``R = 1`` (every token is a group, no gate) or ``R = 2`` (pairs). The input ``kv_score`` is the
fp32 ``[T, 512 R]`` output of the fused ``wkv``/``wgate`` projection: for ``R = 2`` the 512 KV values then the 512
gate scores of each token. Token ``t`` at position ``p = positions[t]`` closes a group when ``(p + 1) % R == 0``;
then, with ``w`` the bf16 ``[512]`` norm weight::

    R = 1:  pooled = kv_score[t]
    R = 2:  pooled = sum_i kv_i * softmax_i(score)        over the group's two rows (previous, t), per dim
    latent[t] = bfloat16(pooled * rsqrt(sum(pooled^2) / 512 + eps) * w)

and ``latent`` rows of other tokens are not written. For ``R = 2`` the previous row of a chunk's first token comes
from the request's ring ``state_cache`` (fp32 ``[blocks, capacity, 1024]``): position ``p`` lives in row
``p % capacity`` of the request's block, and ``slot_mapping[t] = block * capacity + p % capacity`` (``-1``: no
ring, nothing written). After pooling, each request stores its chunk's last ``min(len, capacity)`` raw rows to the
ring. With prefill context parallelism (``HAS_PREV_ROWS``: ``serving.prefill_context_parallel_size > 1``, ratio 2)
the previous row may come from ``prev_rows`` gathered across ranks (``prev_row_indices[r] >= 0``), and the ring is
written by :mod:`.v41_ring_rows` instead.

Grid ``num_reqs + cdiv(T, R)`` (``T = slot_mapping.numel()``, ``num_reqs = 0`` for ``R = 1``): one program per
request (the group its chunk's first token closes, then the ring tail) followed by one per group of packed tokens;
four warps, no PDL on CUDA, as vLLM launches it. The request program loads the two rows as one joined pointer
tile (vLLM's ``_JOIN_ROW_PTRS``, true on CUDA; ROCm's separate-row form is not reproduced).

Key: ``R``, the ring capacity (a constexpr: a power of two, ``max(8, next_pow2(num_speculative_tokens + 2))``),
``HAS_PREV_ROWS``. Unlike vLLM's kernel, the row and ring strides are unspecialized runtime ints (vLLM makes
them constexprs), with the 64-byte row alignment vLLM asserts restated as hints; the scalar-read index vectors are
not specialized on alignment; ``eps`` is a runtime float (vLLM: a constexpr; the same fp32 addition).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._v41 import check_index_vector, pcp_size, ring_capacity, v41_register_predicate
from .model import DSV4

__all__ = ["V41SaveCompressNorm", "V41SaveCompressNormKey", "register", "v41_save_compress_norm_reference"]

HEAD = 512
_INTS = ["num_tokens", "num_reqs", "raw_stride", "prev_stride", "state_stride", "state_row_stride", "eps"]
_SCALAR_POINTERS = ["positions_ptr", "slots_ptr", "qsl_ptr", "req_ptr", "prev_idx_ptr"]


@triton.jit
def _norm_store(pooled, t, w_ptr, latent_ptr, eps):
    """RMSNorm of the pooled fp32 ``[512]`` row into bf16 ``latent[t]``."""
    d = tl.arange(0, 512)
    w = tl.load(w_ptr + d).to(tl.float32)
    rms = tl.rsqrt(tl.sum(pooled * pooled, 0) / 512 + eps)
    tl.store(latent_ptr + t.to(tl.int64) * 512 + d, (pooled * rms * w).to(tl.bfloat16))


@triton.jit(do_not_specialize=_INTS, do_not_specialize_on_alignment=_SCALAR_POINTERS)
def _v41_save_compress_norm_kernel(
    raw_ptr,  # fp32 [T, 512 R] kv (then score) rows
    positions_ptr,
    state_ptr,  # fp32 ring [blocks, capacity, 1024] (R = 2), else None
    slots_ptr,  # [T] ring slots (R = 2) or cache slots (R = 1); -1: nothing written
    qsl_ptr,  # [num_reqs + 1] chunk offsets (R = 2), else None
    req_ptr,  # [T] request of each token (R = 2), else None
    w_ptr,  # bf16 [512] norm weight
    latent_ptr,  # bf16 [T, 512]
    prev_ptr,  # fp32 rows gathered across PCP ranks (HAS_PREV_ROWS), else raw_ptr
    prev_idx_ptr,  # [num_reqs] row in prev_ptr before each chunk, -1: the ring (HAS_PREV_ROWS), else slots_ptr
    num_tokens,
    num_reqs,
    raw_stride,
    prev_stride,
    state_stride,
    state_row_stride,
    eps,
    STATE_BLOCK: tl.constexpr,  # ring capacity, a power of two (1 for R = 1)
    COMPRESS_RATIO: tl.constexpr,  # 1 or 2: the layer's ratio
    HAS_PREV_ROWS: tl.constexpr,  # PCP: predecessors may come from prev_ptr; the ring is written elsewhere
):
    pid = tl.program_id(0)
    d = tl.arange(0, 512)
    if COMPRESS_RATIO == 2:
        if pid < num_reqs:
            start = tl.load(qsl_ptr + pid)
            end = tl.load(qsl_ptr + pid + 1)
            if start >= end:
                return
            slot = tl.load(slots_ptr + start)
            if slot < 0:
                return
            p = tl.load(positions_ptr + start)
            if (p + 1) % 2 == 0:
                block = state_ptr + (slot // STATE_BLOCK).to(tl.int64) * state_stride
                prev = block + ((p - 1) % STATE_BLOCK) * state_row_stride
                if HAS_PREV_ROWS:
                    prev_idx = tl.load(prev_idx_ptr + pid)
                    if prev_idx >= 0:
                        prev = prev_ptr + prev_idx.to(tl.int64) * prev_stride
                cur = raw_ptr + start.to(tl.int64) * raw_stride
                rows = tl.multiple_of(tl.join(prev, cur)[:, None], (16, 16))
                kv = tl.load(rows + d[None, :])
                score = tl.load(rows + 512 + d[None, :])
                tl.debug_barrier()  # every lane has read the ring before the tail store below overwrites it
                _norm_store(tl.sum(kv * tl.softmax(score, 0), 0), start, w_ptr, latent_ptr, eps)
            if not HAS_PREV_ROWS:
                n = tl.minimum(end - start, STATE_BLOCK)
                for k in tl.range(0, n):
                    tok = end - n + k
                    s = tl.load(slots_ptr + tok)
                    if s >= 0:
                        dst = (
                            state_ptr
                            + (s // STATE_BLOCK).to(tl.int64) * state_stride
                            + (s % STATE_BLOCK) * state_row_stride
                        )
                        src = raw_ptr + tok.to(tl.int64) * raw_stride
                        tl.store(dst + d, tl.load(src + d))
                        tl.store(dst + 512 + d, tl.load(src + 512 + d))
            return
    # a group program: the token (R = 1) or the group-closing token of a pair (R = 2)
    t = (pid - num_reqs) * COMPRESS_RATIO
    if COMPRESS_RATIO == 2:
        t += (tl.load(positions_ptr + t) + 1) % 2
    slot = tl.load(slots_ptr + t, t < num_tokens, other=-1)
    if slot < 0:
        return
    if COMPRESS_RATIO == 1:
        pooled = tl.load(raw_ptr + t.to(tl.int64) * raw_stride + d)
    else:
        if t == tl.load(qsl_ptr + tl.load(req_ptr + t)):
            return  # a chunk's first token: its request program pooled it
        rows = tl.multiple_of(raw_ptr + (t.to(tl.int64) - 1 + tl.arange(0, 2)[:, None]) * raw_stride, (16, 16))
        kv = tl.load(rows + d[None, :])
        score = tl.load(rows + 512 + d[None, :])
        pooled = tl.sum(kv * tl.softmax(score, 0), 0)
    _norm_store(pooled, t, w_ptr, latent_ptr, eps)


@attrs.frozen(kw_only=True)
class V41SaveCompressNormKey(warmreg.CompileKey):
    """What changes the binary of V4.1's compressor kernel."""

    compress_ratio: int
    state_block: int  # ring capacity (1 for R = 1)
    has_prev_rows: bool  # PCP
    num_warps: int
    launch_pdl: bool  # always False, as vLLM launches it on CUDA


def _rows_problem(name: str, t: torch.Tensor | None, width: int) -> str | None:
    if t is None:
        return None
    if t.dtype != torch.float32 or t.ndim < 2 or t.shape[-1] != width or t.stride(-1) != 1:
        return f"{name} must be float32 [..., {width}] with contiguous rows (got {t.dtype} {tuple(t.shape)})"
    if any(s % 16 for s in t.stride()[:-1]) or not warmreg.is_aligned(t):
        return f"{name} rows must be 64-byte aligned (strides {t.stride()})"
    return None


class V41SaveCompressNorm(warmreg.TritonKernel[V41SaveCompressNormKey]):
    """V4.1's compressor: ring save, pooling and RMSNorm into the bf16 latent (the module docstring has the math).

    :param compress_ratios: the model's V4.1 compressor ratios (domains only).
    :param capacity: the ring capacity (domains only).
    :param pcp: prefill context parallelism: ratio 2 reads gathered rows (domains only).
    """

    name = "deepseek_v4.v41_save_compress_norm"
    key_type = V41SaveCompressNormKey
    jit = _v41_save_compress_norm_kernel

    def __init__(self, *, compress_ratios: tuple[int, ...] = (1, 2), capacity: int = 8, pcp: bool = False) -> None:
        self.compress_ratios, self.capacity, self.pcp = compress_ratios, capacity, pcp

    def dispatch(
        self, *, compress_ratio: int, state_cache: torch.Tensor | None, prev_rows: torch.Tensor | None = None
    ) -> V41SaveCompressNormKey:
        ring = compress_ratio == 2 and state_cache is not None
        return V41SaveCompressNormKey(
            compress_ratio=compress_ratio, state_block=state_cache.shape[1] if ring else 1,  # type: ignore[union-attr]
            has_prev_rows=ring and prev_rows is not None, num_warps=4, launch_pdl=False,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        ring = warmreg.meta((2, self.capacity, 2 * HEAD), torch.float32)
        prev = warmreg.meta((2, 2 * HEAD), torch.float32)
        return {
            "compress_ratio": sorted(self.compress_ratios),
            "state_cache": [ring],
            "prev_rows": [prev if self.pcp else None],
        }

    def warmup_inputs(self, key: V41SaveCompressNormKey) -> Mapping[str, Any]:
        r = key.compress_ratio
        ring = warmreg.meta((2, key.state_block, 2 * HEAD), torch.float32) if r == 2 else None
        prev = (
            (warmreg.meta((2, 2 * HEAD), torch.float32), warmreg.meta((1,), torch.int64)) if key.has_prev_rows else None
        )
        return {
            "kv_score": warmreg.meta((2, HEAD * r), torch.float32),
            "positions": warmreg.meta((2,), torch.int64),
            "state_cache": ring,
            "slot_mapping": warmreg.meta((2,), torch.int64),
            "query_start_loc": warmreg.meta((2,), torch.int32) if r == 2 else None,
            "token_to_req_indices": warmreg.meta((2,), torch.int32) if r == 2 else None,
            "norm_weight": warmreg.meta((HEAD,), torch.bfloat16),
            "eps": 1e-6,
            "compress_ratio": r,
            "prev_rows": prev[0] if prev else None,
            "prev_row_indices": prev[1] if prev else None,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        kv_score: torch.Tensor,
        positions: torch.Tensor,
        state_cache: torch.Tensor | None,
        slot_mapping: torch.Tensor,
        query_start_loc: torch.Tensor | None,
        token_to_req_indices: torch.Tensor | None,
        norm_weight: torch.Tensor,
        *,
        eps: float,
        compress_ratio: int,
        prev_rows: torch.Tensor | None = None,
        prev_row_indices: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> warmreg.LaunchSpec[V41SaveCompressNormKey]:
        """Pool, normalize and (``R = 2``) save the ring; returns the bf16 ``[kv_score.shape[0], 512]`` latent
        (fresh, or ``out``), written only at valid group-closing rows (as ``fused_save_compress_norm``'s
        ``latent_out``).

        :param kv_score: float32 ``[>= T, 512 R]``, contiguous 64-byte aligned rows.
        :param positions: int64 ``[>= T]``, contiguous.
        :param state_cache: float32 ring ``[blocks, capacity, 1024]`` (``R = 2``; ignored for ``R = 1``).
        :param slot_mapping: int64 ``[T]`` ring slots (``R = 2``) or cache slots (``R = 1``), contiguous.
        :param query_start_loc: int32 ``[num_reqs + 1]`` (``R = 2``); ``token_to_req_indices`` int32 ``[T]``.
        :param norm_weight: bf16 ``[512]``, contiguous.
        :param eps: the RMSNorm epsilon (``rms_norm_eps``).
        :param compress_ratio: 1 or 2.
        :param prev_rows: float32 ``[rows, 1024]`` gathered across PCP ranks, with int ``prev_row_indices
            [>= num_reqs]`` (``R = 2`` under PCP), or neither.
        :param out: the latent buffer to write instead of a fresh one: exactly bf16 ``[kv_score.shape[0], 512]``,
            contiguous, 16-byte aligned.
        :raises warmreg.LaunchError: naming the argument that breaks these rules.
        """
        if compress_ratio not in (1, 2):
            raise warmreg.LaunchError(self.name, f"compress_ratio must be 1 or 2 (got {compress_ratio})")
        r, has_prev = compress_ratio, prev_rows is not None
        problem = _rows_problem("kv_score", kv_score, HEAD * r)
        problem = problem or (_rows_problem("state_cache", state_cache, 2 * HEAD) if r == 2 else None)
        problem = problem or (_rows_problem("prev_rows", prev_rows, 2 * HEAD) if r == 2 else None)
        if problem:
            raise warmreg.LaunchError(self.name, problem)
        T = slot_mapping.numel()
        check_index_vector(self.name, "slot_mapping", slot_mapping, T, torch.int64)
        check_index_vector(self.name, "positions", positions, T, torch.int64)
        if kv_score.ndim != 2 or kv_score.shape[0] < T:
            raise warmreg.LaunchError(self.name, f"kv_score must be 2-D with >= {T} rows (got {tuple(kv_score.shape)})")
        if norm_weight.shape != (HEAD,) or not norm_weight.is_contiguous():
            raise warmreg.LaunchError(
                self.name, f"norm_weight must be a contiguous [{HEAD}] (got {tuple(norm_weight.shape)})"
            )
        num_reqs = 0
        if r == 2:
            if state_cache is None or query_start_loc is None or token_to_req_indices is None:
                raise warmreg.LaunchError(
                    self.name, "compress_ratio 2 needs state_cache, query_start_loc, token_to_req_indices"
                )
            num_reqs = query_start_loc.numel() - 1
            check_index_vector(self.name, "query_start_loc", query_start_loc, num_reqs + 1, torch.int32)
            check_index_vector(self.name, "token_to_req_indices", token_to_req_indices, T, torch.int32)
            if has_prev and (prev_row_indices is None or prev_row_indices.numel() < num_reqs):
                raise warmreg.LaunchError(self.name, f"prev_rows needs prev_row_indices of >= {num_reqs} entries")
        else:
            state_cache = query_start_loc = token_to_req_indices = prev_rows = prev_row_indices = None
            has_prev = False
        key = self.dispatch(compress_ratio=r, state_cache=state_cache, prev_rows=prev_rows)
        latent = warmreg.output(self.name, "out", out, (kv_score.shape[0], HEAD), torch.bfloat16, kv_score.device)
        kwargs = dict(
            raw_ptr=kv_score, positions_ptr=positions, state_ptr=state_cache, slots_ptr=slot_mapping,
            qsl_ptr=query_start_loc, req_ptr=token_to_req_indices, w_ptr=norm_weight, latent_ptr=latent,
            prev_ptr=prev_rows if has_prev else kv_score, prev_idx_ptr=prev_row_indices if has_prev else slot_mapping,
            num_tokens=T, num_reqs=num_reqs, raw_stride=kv_score.stride(0),
            prev_stride=prev_rows.stride(0) if has_prev and prev_rows is not None else 1,
            state_stride=state_cache.stride(0) if state_cache is not None else 1,
            state_row_stride=state_cache.stride(1) if state_cache is not None else 1, eps=float(eps),
            STATE_BLOCK=key.state_block, COMPRESS_RATIO=r, HAS_PREV_ROWS=has_prev,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (num_reqs + triton.cdiv(T, r),) if T else None, kwargs, latent)


def v41_save_compress_norm_reference(
    kv_score: torch.Tensor,
    positions: torch.Tensor,
    state_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    token_to_req_indices: torch.Tensor | None,
    norm_weight: torch.Tensor,
    *,
    eps: float,
    compress_ratio: int,
    latent: torch.Tensor,
) -> None:
    """PyTorch reference of :class:`V41SaveCompressNorm` (no PCP): writes ``latent`` and, ``R = 2``, ``state_cache``
    in place, as the kernel does (a loop over requests and tokens)."""
    T, w = slot_mapping.numel(), norm_weight.float()

    def store(t: int, pooled: torch.Tensor) -> None:
        rms = torch.rsqrt((pooled * pooled).sum() / HEAD + eps)
        latent[t] = (pooled * rms * w).to(torch.bfloat16)

    def pool(prev: torch.Tensor, cur: torch.Tensor) -> torch.Tensor:
        kv, score = torch.stack([prev[:HEAD], cur[:HEAD]]), torch.stack([prev[HEAD:], cur[HEAD:]])
        return (kv * torch.softmax(score, 0)).sum(0)

    if compress_ratio == 1:
        for t in range(T):
            if int(slot_mapping[t]) >= 0:
                store(t, kv_score[t].float())
        return
    assert state_cache is not None and query_start_loc is not None and token_to_req_indices is not None
    cap, starts = state_cache.shape[1], {int(s) for s in query_start_loc[:-1]}
    old = state_cache.clone()
    for t in range(T):  # groups closed inside a chunk
        slot, p = int(slot_mapping[t]), int(positions[t])
        if slot >= 0 and (p + 1) % 2 == 0 and t not in starts:
            store(t, pool(kv_score[t - 1], kv_score[t]))
    for b in range(query_start_loc.numel() - 1):
        start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        if start >= end or int(slot_mapping[start]) < 0:
            continue
        slot, p = int(slot_mapping[start]), int(positions[start])
        if (p + 1) % 2 == 0:
            store(start, pool(old[slot // cap, (p - 1) % cap], kv_score[start]))
        for tok in range(end - min(end - start, cap), end):
            s = int(slot_mapping[tok])
            if s >= 0:
                state_cache[s // cap, s % cap] = kv_score[tok]


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the compressor for a DeepSeek-V4.1 model on CUDA (every layer with a compressor runs it each step
    with attention metadata: ``DeepseekCompressor.forward``), over the model's compressor ratios (1 and/or 2); with
    prefill context parallelism (:func:`._v41.pcp_size`) ratio 2 reads gathered rows.

    :raises warmreg.ConfigError: for an invalid ``serving.num_speculative_tokens`` or PCP size.
    """
    when, ratios = v41_register_predicate(model, config)
    kernel = V41SaveCompressNorm(compress_ratios=ratios, capacity=ring_capacity(config), pcp=pcp_size(config) > 1)
    registry.add(kernel, when=when)
