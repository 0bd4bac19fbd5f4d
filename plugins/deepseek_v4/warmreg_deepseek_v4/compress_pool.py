"""Softmax-gated pooling of the C4 indexer's compressor states on ROCm's MXFP4 path (vLLM 0.33
``models/deepseek_v4/amd/rocm.py``: ``compress_pool``, ``_compress_pool_kernel``).

``DeepseekV4RocmMxfp4Compressor._compress_norm_rope_store`` runs it on every step with tokens, once per C4 layer,
then aiter's ``rocm_mxfp4_indexer_k_store`` (RMSNorm + RoPE + MXFP4 into aiter's pre-shuffled pages; aiter's, not
ours) reads ``pooled_k``. It is :mod:`.indexer_kv`'s compress stopped before the RMSNorm.

Grid ``(T,)``, ``T = pooled_k.shape[0]``. A token pools only if ``kv_slot_mapping[t] >= 0`` and
``(pos + 1) % cr == 0``; the other rows of ``pooled_k`` are left as they were. With the window
``L = (1 + overlap) * cr`` ending at ``pos`` (``p_i = pos - L + 1 + i``, valid when ``p_i >= 0``), state rows read
through the state block table, the older ``cr`` positions from the first half of each state (kv ``[0, hd)``, score
``[SW, SW + hd)``) and the newer from the second::

    pooled_k[t] = bf16(sum_i softmax_i(score_i) * kv_i)      (per column, fp32; invalid positions excluded)

The window's last position is ``pos`` itself, so no column is all ``-inf``.

ROCm buffer ops: Triton's AMD backend gives every pointer whose storage (``untyped_storage()``, not the view) is at
most ``2**31 - 1`` bytes a ``tt.pointer_range = 32`` specialization (32-bit buffer offsets), part of the binary's
key; CUDA ignores it. The state cache is a view of the KV pool, usually far above 2 GB but below it on a small
pool, so the key's ``over_2gb`` names the pointers past it and the domains give the state cache both variants, as
vLLM's warmup inputs do (storage at 0 and at 2**32 bytes): 2 keys. The other tensors are views of persistent
buffers sized by the config (``pooled_k`` of the ``[max_num_batched_tokens, head_dim]`` bf16 workspace, the ids of
``[max_num_batched_tokens]`` step buffers, the state block table of ``[max_num_seqs, cdiv(max_model_len, 4)]``),
so the domains give them those sizes and their variant follows the config (below 2 GB for the examples).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._checks import is_pow2, unspecialized_int32_problem
from ._serving import mxfp4_indexer
from .model import DSV4, PLUGIN

__all__ = ["CompressPool", "CompressPoolKey", "POINTER_RANGE_BYTES", "compress_pool_reference", "register"]

#: Storage sizes above this lose ROCm's ``tt.pointer_range = 32`` specialization (Triton's ``is_within_2gb``).
POINTER_RANGE_BYTES = 2**31 - 1
#: The tensor arguments, in the kernel's order; ``over_2gb`` names a subset.
_TENSORS = ("state_cache", "token_to_req_indices", "positions", "kv_slot_mapping", "block_table", "pooled_k")


@triton.jit(
    do_not_specialize=["state_stride0", "state_stride1", "block_table_stride", "block_size", "pooled_k_stride"],
    do_not_specialize_on_alignment=[
        "state_ptr",  # rows at runtime strides: alignment buys no vector width
        "token_to_req_ptr",
        "positions_ptr",
        "kv_slot_mapping_ptr",
        "block_table_ptr",
        "pooled_k_ptr",  # rows at an unspecialized stride
    ],
)
def _compress_pool_kernel(
    state_ptr,
    token_to_req_ptr,
    positions_ptr,
    kv_slot_mapping_ptr,
    block_table_ptr,
    pooled_k_ptr,
    state_stride0,
    state_stride1,
    block_table_stride,
    block_size,
    pooled_k_stride,
    HEAD_SIZE: tl.constexpr,  # pooled_k.shape[1]: the indexer head (128)
    STATE_WIDTH: tl.constexpr,  # state_cache.shape[-1] // 2: kv state columns, then score + APE (256)
    COMPRESS_RATIO: tl.constexpr,  # 4: a state closes every COMPRESS_RATIO positions
    OVERLAP: tl.constexpr,  # the window spans 2 * COMPRESS_RATIO positions over two state halves
):
    WINDOW: tl.constexpr = 2 * COMPRESS_RATIO if OVERLAP else COMPRESS_RATIO
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t)
    if (tl.load(kv_slot_mapping_ptr + t) >= 0) & ((pos + 1) % COMPRESS_RATIO == 0):
        i = tl.arange(0, WINDOW)
        p = pos - WINDOW + 1 + i
        valid = p >= 0
        req = tl.load(token_to_req_ptr + t).to(tl.int64)
        page = tl.load(block_table_ptr + req * block_table_stride + p // block_size, mask=valid, other=0)
        rows = state_ptr + page.to(tl.int64) * state_stride0 + (p % block_size) * state_stride1
        if OVERLAP:  # older window: first half of its state; current window: second half
            rows += tl.where(i >= COMPRESS_RATIO, HEAD_SIZE, 0)
        ptrs = rows[:, None] + tl.arange(0, HEAD_SIZE)[None, :]
        score = tl.load(ptrs + STATE_WIDTH, mask=valid[:, None], other=float("-inf"))
        kv = tl.load(ptrs, mask=valid[:, None], other=0.0)
        prob = tl.exp(score - tl.max(score, axis=0)[None, :])
        pooled = tl.sum(prob / tl.sum(prob, axis=0)[None, :] * kv, axis=0)
        tl.store(pooled_k_ptr + t * pooled_k_stride + tl.arange(0, HEAD_SIZE), pooled.to(tl.bfloat16))


@attrs.frozen(kw_only=True)
class CompressPoolKey(warmreg.CompileKey):
    """What changes the binary of the ROCm indexer compressor pooling."""

    head_size: int
    state_width: int
    compress_ratio: int
    overlap: bool
    #: tensor arguments whose storage exceeds 2**31 - 1 bytes (no ROCm ``tt.pointer_range = 32``), in kernel order
    over_2gb: tuple[str, ...]
    num_warps: int


def _over_2gb(**tensors: torch.Tensor) -> tuple[str, ...]:
    return tuple(n for n in _TENSORS if tensors[n].untyped_storage().nbytes() > POINTER_RANGE_BYTES)


def _meta(shape: tuple[int, ...], dtype: torch.dtype, over_2gb: bool) -> torch.Tensor:
    """A meta tensor of ``shape``, its storage past 2 GB when ``over_2gb`` (an offset of 2**31 bytes: aligned)."""
    return warmreg.meta(shape, dtype, offset=2**31 // dtype.itemsize if over_2gb else 0)


class CompressPool(warmreg.TritonKernel[CompressPoolKey]):
    """Pool each closing token's compressor-state window into a bf16 row (see the module docstring).

    :param head_dim: indexer head dim (128).
    :param compress_ratio: 4 (the indexer runs on C4 layers only).
    :param state_block_size: compressor state page size (4 for C4).
    """

    name = "deepseek_v4.compress_pool"
    key_type = CompressPoolKey
    jit = _compress_pool_kernel

    def __init__(self, *, head_dim: int = 128, compress_ratio: int = 4, state_block_size: int = 4) -> None:
        self.head_dim, self.compress_ratio, self.state_block_size = head_dim, compress_ratio, state_block_size

    def dispatch(
        self,
        *,
        state_cache: torch.Tensor,
        token_to_req_indices: torch.Tensor,
        positions: torch.Tensor,
        kv_slot_mapping: torch.Tensor,
        block_table: torch.Tensor,
        pooled_k: torch.Tensor,
        compress_ratio: int,
    ) -> CompressPoolKey:
        head, width = pooled_k.shape[1], state_cache.shape[-1] // 2
        over_2gb = _over_2gb(
            state_cache=state_cache, token_to_req_indices=token_to_req_indices, positions=positions,
            kv_slot_mapping=kv_slot_mapping, block_table=block_table, pooled_k=pooled_k,
        )  # fmt: skip
        return CompressPoolKey(
            head_size=head,
            state_width=width,
            compress_ratio=compress_ratio,
            overlap=width == 2 * head,
            over_2gb=over_2gb,
            num_warps=1,
        )

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        width = (2 if self.compress_ratio == 4 else 1) * self.head_dim
        rows = config.get("serving.max_num_batched_tokens", int, plugin=PLUGIN)
        seqs = config.get("serving.max_num_seqs", int, plugin=PLUGIN)
        blocks = triton.cdiv(config.get("serving.max_model_len", int, plugin=PLUGIN), self.state_block_size)
        state = (2, self.state_block_size, 2 * width)
        ids = warmreg.meta((rows,), torch.int64)
        return {
            # a view of the KV pool: at or below 2 GB (a small pool) or above it (usually)
            "state_cache": [_meta(state, torch.float32, False), _meta(state, torch.float32, True)],
            "token_to_req_indices": [warmreg.meta((rows,), torch.int32)],
            "positions": [ids],
            "kv_slot_mapping": [ids],
            "block_table": [warmreg.meta((seqs, blocks), torch.int32)],
            # pooled_k[:T] of the persistent [max_num_batched_tokens, head] workspace
            "pooled_k": [warmreg.meta((rows, self.head_dim), torch.bfloat16)],
            "compress_ratio": [self.compress_ratio],
        }

    def warmup_inputs(self, key: CompressPoolKey) -> Mapping[str, Any]:
        def big(name: str) -> bool:
            return name in key.over_2gb

        return {
            "state_cache": _meta((2, 4, 2 * key.state_width), torch.float32, big("state_cache")),
            "token_to_req_indices": _meta((1,), torch.int32, big("token_to_req_indices")),
            "positions": _meta((1,), torch.int64, big("positions")),
            "kv_slot_mapping": _meta((1,), torch.int64, big("kv_slot_mapping")),
            "block_table": _meta((1, 1), torch.int32, big("block_table")),
            "block_size": 4,
            "pooled_k": _meta((1, key.head_size), torch.bfloat16, big("pooled_k")),
            "compress_ratio": key.compress_ratio,
        }

    def _check(
        self,
        state_cache: torch.Tensor,
        token_to_req_indices: torch.Tensor,
        positions: torch.Tensor,
        kv_slot_mapping: torch.Tensor,
        block_table: torch.Tensor,
        pooled_k: torch.Tensor,
        compress_ratio: int,
    ) -> None:
        t = pooled_k.shape[0] if pooled_k.ndim == 2 else -1
        problems = []
        head = pooled_k.shape[1] if t >= 0 else -1
        if t < 0 or pooled_k.dtype != torch.bfloat16 or not is_pow2(head) or (head > 1 and pooled_k.stride(1) != 1):
            problems.append(f"pooled_k must be bfloat16 [T, power-of-two head] with contiguous rows (got {pooled_k.dtype} {tuple(pooled_k.shape)})")
        for name, ids, dtype in (
            ("positions", positions, torch.int64),
            ("kv_slot_mapping", kv_slot_mapping, torch.int64),
            ("token_to_req_indices", token_to_req_indices, torch.int32),
        ):
            if ids.ndim != 1 or ids.dtype != dtype or ids.shape[0] < t or (ids.shape[0] > 1 and ids.stride(0) != 1):
                problems.append(f"{name} must be a contiguous {dtype} [>= {t}] (got {ids.dtype} {tuple(ids.shape)})")
        if block_table.dtype != torch.int32 or block_table.ndim != 2 or block_table.stride(1) != 1:
            problems.append("block_table must be int32 [num_reqs, blocks] with contiguous rows")
        width = state_cache.shape[-1] // 2 if state_cache.ndim == 3 else -1
        if state_cache.dtype != torch.float32 or width not in (head, 2 * head) or state_cache.stride(-1) != 1:
            problems.append(
                f"state_cache must be float32 [pages, page_size, 2 * (1 or 2) * {head}] (got {state_cache.dtype} {tuple(state_cache.shape)})"
            )
        if not is_pow2(compress_ratio) or (width == 2 * head and compress_ratio != 4):
            problems.append(f"compress_ratio {compress_ratio} must be a power of two, and 4 with overlapping states")
        if (problem := unspecialized_int32_problem(*(state_cache.stride(0), state_cache.stride(1), block_table.stride(0), pooled_k.stride(0)))) is not None:
            problems.append(problem)
        if problems:
            raise warmreg.LaunchError(self.name, "; ".join(problems))

    @warmreg.kernel_launcher
    def __call__(
        self,
        state_cache: torch.Tensor,
        token_to_req_indices: torch.Tensor,
        positions: torch.Tensor,
        kv_slot_mapping: torch.Tensor,
        block_table: torch.Tensor,
        block_size: int,
        pooled_k: torch.Tensor,
        *,
        compress_ratio: int = 4,
    ) -> warmreg.LaunchSpec[CompressPoolKey]:
        """Pool the closing tokens' windows into ``pooled_k`` (in place; returned).

        :param state_cache: float32 ``[pages, block_size, 2 * STATE_WIDTH]`` compressor states.
        :param token_to_req_indices: int32 ``[>= T]``.
        :param positions: int64 ``[>= T]``.
        :param kv_slot_mapping: int64 ``[>= T]``: the indexer cache slot, ``-1`` where nothing is written.
        :param block_table: int32 ``[num_reqs, blocks]``: state pages of each request.
        :param block_size: state page size (``state_cache.shape[1]``, 4 for C4).
        :param pooled_k: bfloat16 ``[T, head_dim]``, rows at any stride; ``T`` is the grid.
        :raises warmreg.LaunchError: for shapes, dtypes or layouts the kernel cannot serve.
        """
        self._check(state_cache, token_to_req_indices, positions, kv_slot_mapping, block_table, pooled_k, compress_ratio)
        if block_size != state_cache.shape[1]:
            raise warmreg.LaunchError(self.name, f"block_size {block_size} must be state_cache.shape[1] = {state_cache.shape[1]}")
        key = self.dispatch(
            state_cache=state_cache, token_to_req_indices=token_to_req_indices, positions=positions,
            kv_slot_mapping=kv_slot_mapping, block_table=block_table, pooled_k=pooled_k, compress_ratio=compress_ratio,
        )  # fmt: skip
        kwargs = dict(
            state_ptr=state_cache, token_to_req_ptr=token_to_req_indices, positions_ptr=positions,
            kv_slot_mapping_ptr=kv_slot_mapping, block_table_ptr=block_table, pooled_k_ptr=pooled_k,
            state_stride0=state_cache.stride(0), state_stride1=state_cache.stride(1),
            block_table_stride=block_table.stride(0), block_size=int(block_size), pooled_k_stride=pooled_k.stride(0),
            HEAD_SIZE=key.head_size, STATE_WIDTH=key.state_width, COMPRESS_RATIO=key.compress_ratio, OVERLAP=key.overlap,
        )  # fmt: skip
        t = pooled_k.shape[0]
        return warmreg.LaunchSpec(key, (t,) if t else None, kwargs, pooled_k)


def compress_pool_reference(
    state_cache: torch.Tensor,
    token_to_req_indices: torch.Tensor,
    positions: torch.Tensor,
    kv_slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    pooled_k: torch.Tensor,
    *,
    compress_ratio: int = 4,
) -> torch.Tensor:
    """PyTorch reference of :class:`CompressPool`; writes ``pooled_k`` in place and returns it."""
    head = pooled_k.shape[1]
    width = state_cache.shape[-1] // 2
    overlap = width == 2 * head
    window = (2 if overlap else 1) * compress_ratio
    for t in range(pooled_k.shape[0]):
        pos = int(positions[t])
        if int(kv_slot_mapping[t]) < 0 or (pos + 1) % compress_ratio:
            continue
        ps = torch.arange(pos - window + 1, pos + 1)
        ok = ps >= 0
        pages = block_table[int(token_to_req_indices[t]), ps.clamp(min=0) // block_size].long()
        rows = state_cache[pages, ps.clamp(min=0) % block_size]  # [window, 2 * width]
        cols = torch.arange(head) + torch.where(torch.arange(window) >= compress_ratio, head, 0)[:, None] * overlap
        score = rows.gather(1, width + cols).masked_fill(~ok[:, None], float("-inf"))
        kv = rows.gather(1, cols) * ok[:, None]
        pooled_k[t] = (torch.softmax(score, dim=0) * kv).sum(dim=0).to(torch.bfloat16)
    return pooled_k


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the pooling on ROCm when the C4 indexer runs on an MXFP4 K cache (gfx950 with aiter; see
    :func:`._serving.indexer_kv_dtype`), with head ``index_head_dim`` and the C4 state pages.

    :raises warmreg.ConfigError: for a ``serving.indexer_kv_dtype`` the platform cannot serve.
    """
    rocm_mxfp4 = platform.is_rocm and mxfp4_indexer(config, model, platform)
    registry.add(CompressPool(head_dim=model.index_head_dim), when=warmreg.is_rocm if rocm_mxfp4 else False)
