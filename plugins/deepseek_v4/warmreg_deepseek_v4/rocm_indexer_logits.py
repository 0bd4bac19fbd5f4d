"""ROCm C4 indexer decode: the FP8 paged MQA logits over the block-flat indexer cache (vLLM 0.34
``v1/attention/ops/rocm_aiter_mla_sparse.py``: ``rocm_fp8_paged_mqa_logits_triton``, which launches
``_fp8_paged_mqa_logits_decode_kernel``).

Query row ``row = b * N + n`` (``N`` query positions a request: ``next_n``) of FP8 ``q [B, N, H, D]``, its fp32
weights ``w[row, :H]``, its visible keys ``L = clamp(ctx, 0, M)`` (``ctx = context_lens[row]`` when they are per row,
else ``context_lens[b] - N + n + 1``; ``M`` the logits' width) and the request's pages ``block_table[b]`` of ``P``
compressed tokens (block-flat: ``P * D`` FP8 bytes, then ``P`` fp32 scales)::

    logits[row, p] = scale[p] * sum_h w[row, h] * relu(sum_d k[p, d] * q[b, n, h, d])      for p < L

where ``k[p]`` / ``scale[p]`` are token ``p % P`` of page ``block_table[b, p // P]`` (a page past the table's width
reads as masked: its logits are not written). Positions ``p >= L`` are left as they are (vLLM's workspace buffer).
FP8 values are upcast exactly and the ``H`` dot products accumulate in fp32 (``tl.dot``), as in vLLM.

Grid ``(B * N, S)``: program ``(row, s)`` scores the 64-key tiles ``s, s + S, ...`` of the row. vLLM picks ``S =
max(1, min(CUs, cdiv(M, 64), 1024 // (B * N)))`` with the device's CU count (304 on gfx942, 256 on gfx950, 256 when
it cannot ask) and passes it as a constexpr; here the kernel reads it as ``tl.num_programs(1)``, so one binary serves
every batch and device (each key is scored by exactly one program whatever ``S`` is: the logits do not depend on it).

Where it runs: ``rocm_aiter_sparse_attn_indexer``'s decode (the FP8 indexer: ``SparseAttnIndexer.forward_hip``, on
ROCm with aiter or on gfx950), on gfx942 and gfx950, every C4 layer with decode tokens:
``rocm_fp8_paged_mqa_logits`` takes this kernel for the C4A block-flat cache when its page (``block_size // 4`` = 64)
is a multiple of 64 (other pages: a PyTorch path; other ratios: aiter). ``q`` is the indexer's FP8 Q of the decode
tokens reshaped ``[B, N, H, D]`` (or packed by ``pack_seq_triton`` when decode lengths differ), ``weights[:B * N]``,
``context_lens`` the indexer metadata's decode ``seq_lens`` (``[B]`` for ``N = 1``; ``[B, N]`` per row on the native
spec-decode path), ``max_model_len`` the compressed one (``max_model_len // 4``). On ROCm the indexer decodes natively
for ``next_n = 1 + num_speculative_tokens`` of 1 or 2 (``_supports_native_decode``) and flattens every decode token
into its own row otherwise (``N = 1``): a deployment sees ``N = 1``, and ``N = 2`` too with one draft token. vLLM
also flattens under ``speculative_config.enable_adaptive_verification``, which warmreg cannot see: its ``N = 2`` key
is then never launched (warmed for nothing). ``context_lens`` holds one length a row on every such path (vLLM's
``CTX_PER_ROW``); the per-request form is a key field too.

Key: heads, head dim, page, the 64-key tile, ``N``, per-row lengths, the FP8 flavour (e4m3fnuz on gfx942, e4m3fn on
gfx950), vLLM's ``num_warps=4, num_stages=2``, and which tensors' storage lies past 2 GB (ROCm's ``tt.pointer_range =
32``, as for :mod:`.rocm_indexer_gather`): the cache (a view of the KV pool) and ``out`` (a view of vLLM's workspace)
each both ways, 4 keys a value of ``N``; the others are small persistent buffers. Strides and sizes are runtime ints (``do_not_specialize``) and no
pointer is specialized on alignment (views of the workspace and of persistent buffers).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._checks import check_int32_table
from ._serving import mxfp4_indexer
from .backends import compressed_block_size
from .dspark import num_speculative_tokens
from .model import DSV4
from .rocm_indexer_gather import meta_past_2gb, over_2gb_names

__all__ = ["RocmIndexerLogits", "RocmIndexerLogitsKey", "indexer_logits_reference", "num_splits", "register"]

_BLOCK_KV = 64  # vLLM's BLOCK_KV: keys a tile (the page must be a multiple)
_FP8 = {False: torch.float8_e4m3fn, True: torch.float8_e4m3fnuz}


@triton.jit(
    do_not_specialize=[
        "stride_q_b", "stride_q_n", "stride_q_h", "stride_w_row", "stride_kv_block", "stride_scale_block",
        "scale_offset", "stride_table", "stride_logits", "max_blocks", "max_model_len",
    ],
    do_not_specialize_on_alignment=[
        "q_ptr", "values_ptr", "scales_ptr", "weights_ptr", "context_lens_ptr", "block_table_ptr", "logits_ptr"
    ],
)  # fmt: skip
def _indexer_logits_kernel(
    q_ptr,
    values_ptr,  # FP8: page p's keys from p * stride_kv_block
    scales_ptr,  # fp32: page p's scales from p * stride_scale_block + scale_offset
    weights_ptr,
    context_lens_ptr,
    block_table_ptr,
    logits_ptr,
    stride_q_b,
    stride_q_n,
    stride_q_h,
    stride_w_row,
    stride_kv_block,
    stride_scale_block,
    scale_offset,
    stride_table,
    stride_logits,
    max_blocks,
    max_model_len,
    NUM_HEADS: tl.constexpr,  # heads scored at once (one tl.dot operand)
    HEAD_DIM: tl.constexpr,  # the dot's K dim
    PAGE: tl.constexpr,  # compressed tokens a page: tiles never straddle pages
    BLOCK_KV: tl.constexpr,  # keys a tile
    NEXT_N: tl.constexpr,  # query positions a request
    CTX_PER_ROW: tl.constexpr,  # context_lens holds one length a row (else one a request)
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    b = row // NEXT_N
    n = row % NEXT_N
    if CTX_PER_ROW:
        visible = tl.load(context_lens_ptr + row)
    else:
        visible = tl.load(context_lens_ptr + b) - NEXT_N + n + 1
    visible = tl.minimum(tl.maximum(visible, 0), max_model_len)
    h = tl.arange(0, NUM_HEADS)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + b.to(tl.int64) * stride_q_b + n * stride_q_n + h[:, None] * stride_q_h + d[None, :])
    w = tl.load(weights_ptr + row.to(tl.int64) * stride_w_row + h).to(tl.float32)
    cols = tl.arange(0, BLOCK_KV)
    out_row = logits_ptr + row.to(tl.int64) * stride_logits
    for start in tl.range(split * BLOCK_KV, visible, tl.num_programs(1) * BLOCK_KV):
        pos = start + cols
        logical = start // PAGE
        in_table = logical < max_blocks
        live = tl.where(in_table, pos < visible, False)  # Triton 3.9's interpreter refuses tensor & scalar masks
        page = tl.load(block_table_ptr + b.to(tl.int64) * stride_table + logical, mask=in_table, other=0).to(tl.int64)
        j = pos - logical * PAGE
        k = tl.load(values_ptr + page * stride_kv_block + j[:, None] * HEAD_DIM + d[None, :], mask=live[:, None],
                    other=0.0)  # fmt: skip
        scale = tl.load(scales_ptr + page * stride_scale_block + scale_offset + j, mask=live, other=0.0)
        s = tl.dot(k, tl.trans(q))  # [BLOCK_KV, NUM_HEADS], fp32
        s = tl.maximum(s, 0.0)
        s = s * w[None, :]
        s = tl.sum(s, axis=1)
        s = s * scale
        tl.store(out_row + pos, s, mask=live)


@attrs.frozen(kw_only=True)
class RocmIndexerLogitsKey(warmreg.CompileKey):
    """What changes the binary of the paged logits: shapes a tile, ``N``, the lengths' form, the FP8 flavour, warps
    and stages, and which tensors' storage is past 2 GB (ROCm's 32-bit buffer offsets:
    :func:`~.rocm_indexer_gather.over_2gb_names`)."""

    num_heads: int
    head_dim: int
    page: int
    block_kv: int
    next_n: int
    ctx_per_row: bool
    fnuz: bool
    num_warps: int
    num_stages: int
    over_2gb: tuple[str, ...]


def _cu_count(device: torch.device) -> int:
    """The device's CU count, as vLLM's ``_decode_cu_count`` asks it (256 where it cannot)."""
    if device.type != "cuda":
        return 256
    return _device_cus(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _device_cus(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def num_splits(rows: int, max_model_len: int, cus: int) -> int:
    """vLLM's split count: ``max(1, min(cus, cdiv(max_model_len, 64), 1024 // rows))``."""
    return max(1, min(max(1, cus), triton.cdiv(max_model_len, _BLOCK_KV), 1024 // max(rows, 1)))


class RocmIndexerLogits(warmreg.TritonKernel[RocmIndexerLogitsKey]):
    """Score each decode query row against its request's paged FP8 keys; see the module docstring.

    :param num_heads: the indexer's heads (``index_n_heads``); ``head_dim`` its head dim.
    :param page: compressed tokens a page of the C4 indexer cache; ``next_ns`` the query positions a request a
        deployment launches; ``fnuz``: the cache and Q are e4m3fnuz (gfx942).
    """

    name = "deepseek_v4.rocm_indexer_logits"
    key_type = RocmIndexerLogitsKey
    jit = _indexer_logits_kernel

    def __init__(
        self, *, num_heads: int = 64, head_dim: int = 128, page: int = 64, next_ns: Iterable[int] = (1,),
        fnuz: bool = False,
    ) -> None:  # fmt: skip
        self.num_heads, self.head_dim, self.page, self.next_ns, self.fnuz = (
            num_heads,
            head_dim,
            page,
            tuple(next_ns),
            fnuz,
        )

    def dispatch(
        self,
        *,
        q_fp8: torch.Tensor,
        kv_cache: torch.Tensor,
        weights: torch.Tensor,
        context_lens: torch.Tensor,
        block_table: torch.Tensor,
        out: torch.Tensor,
    ) -> RocmIndexerLogitsKey:
        batch, next_n, heads, dim = q_fp8.shape
        big = over_2gb_names(
            q_fp8=q_fp8, kv_cache=kv_cache, weights=weights, context_lens=context_lens, block_table=block_table, out=out
        )
        return RocmIndexerLogitsKey(
            num_heads=heads, head_dim=dim, page=kv_cache.shape[1], block_kv=_BLOCK_KV, next_n=next_n,
            ctx_per_row=not (next_n > 1 and context_lens.numel() == batch), fnuz=q_fp8.dtype == torch.float8_e4m3fnuz,
            num_warps=4, num_stages=2, over_2gb=big,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        h, d, n = self.num_heads, self.head_dim, max(self.next_ns)
        return {
            "q_fp8": [warmreg.meta((1, m, h, d), _FP8[self.fnuz]) for m in self.next_ns],
            # a view of the KV pool: at or below 2 GB (a small pool) or above it (usually)
            "kv_cache": [meta_past_2gb((1, self.page, 1, d + 4), torch.uint8, big) for big in (False, True)],
            "weights": [warmreg.meta((n, h), torch.float32)],
            "context_lens": [warmreg.meta((1, n), torch.int32)],
            "block_table": [warmreg.meta((1, 4), torch.int32)],
            # a view of vLLM's one workspace buffer, whose size warmreg cannot see
            "out": [meta_past_2gb((n, 256), torch.float32, big) for big in (False, True)],
        }

    def warmup_inputs(self, key: RocmIndexerLogitsKey) -> Mapping[str, Any]:
        n, h, d, p = key.next_n, key.num_heads, key.head_dim, key.page

        def big(name: str) -> bool:
            return name in key.over_2gb

        return {
            "q_fp8": meta_past_2gb((1, n, h, d), _FP8[key.fnuz], big("q_fp8")),
            "kv_cache": meta_past_2gb((2, p, 1, d + 4), torch.uint8, big("kv_cache")),
            "weights": meta_past_2gb((n, h), torch.float32, big("weights")),
            "context_lens": meta_past_2gb((1, n) if key.ctx_per_row else (1,), torch.int32, big("context_lens")),
            "block_table": meta_past_2gb((1, 4), torch.int32, big("block_table")),
            "out": meta_past_2gb((n, 256), torch.float32, big("out")),
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        q_fp8: torch.Tensor,
        kv_cache: torch.Tensor,
        weights: torch.Tensor,
        context_lens: torch.Tensor,
        block_table: torch.Tensor,
        *,
        out: torch.Tensor,
        splits: int | None = None,
    ) -> warmreg.LaunchSpec[RocmIndexerLogitsKey]:
        """Write the visible logits of every row into ``out`` (vLLM's workspace); returns ``out``.

        :param q_fp8: FP8 ``[B, N, H, D]`` with a contiguous last dim.
        :param kv_cache: uint8 ``[num_blocks, P, 1, D + 4]`` block-flat C4 indexer cache, each page contiguous (any
            page stride, a multiple of 4).
        :param weights: fp32 ``[>= B * N, H]`` with a contiguous last dim.
        :param context_lens: contiguous int32 ``[B * N]`` / ``[B, N]`` (per row) or ``[B]`` (per request).
        :param block_table: int32 ``[>= B, W]`` with contiguous rows.
        :param out: fp32 ``[B * N, M]`` with a contiguous last dim: the logits (``M`` the compressed max model len).
        :param splits: the programs a row (default: vLLM's choice for this device).
        :raises warmreg.LaunchError: for wrong dtypes, ranks, lengths or layouts.
        """
        self._check(q_fp8, kv_cache, weights, context_lens, block_table, out)
        batch, next_n, _, dim = q_fp8.shape
        num_blocks, page = kv_cache.shape[0], kv_cache.shape[1]
        flat = kv_cache.reshape(num_blocks, -1) if num_blocks else kv_cache.new_empty(0, page * (dim + 4))
        values, scales = flat.view(q_fp8.dtype), flat.view(torch.float32)
        key = self.dispatch(
            q_fp8=q_fp8, kv_cache=kv_cache, weights=weights, context_lens=context_lens, block_table=block_table, out=out
        )
        rows = batch * next_n
        s = splits if splits is not None else num_splits(rows, out.shape[1], _cu_count(out.device))
        kwargs = dict(
            q_ptr=q_fp8, values_ptr=values, scales_ptr=scales, weights_ptr=weights, context_lens_ptr=context_lens,
            block_table_ptr=block_table, logits_ptr=out, stride_q_b=q_fp8.stride(0), stride_q_n=q_fp8.stride(1),
            stride_q_h=q_fp8.stride(2), stride_w_row=weights.stride(0), stride_kv_block=values.stride(0),
            stride_scale_block=scales.stride(0), scale_offset=page * dim // 4, stride_table=block_table.stride(0),
            stride_logits=out.stride(0), max_blocks=block_table.shape[1], max_model_len=out.shape[1],
            NUM_HEADS=key.num_heads, HEAD_DIM=key.head_dim, PAGE=key.page, BLOCK_KV=key.block_kv, NEXT_N=key.next_n,
            CTX_PER_ROW=key.ctx_per_row,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (rows, s) if rows else None, kwargs, out)

    def _check(self, q: torch.Tensor, kv: torch.Tensor, w: torch.Tensor, lens: torch.Tensor, table: torch.Tensor,
               out: torch.Tensor) -> None:  # fmt: skip
        if q.ndim != 4 or q.dtype not in _FP8.values() or q.stride(3) != 1 or q.shape[3] % 4:
            raise warmreg.LaunchError(self.name, f"q_fp8 must be FP8 [B, N, H, D] with a contiguous last dim and D a "
                                      f"multiple of 4 (got {q.dtype} {tuple(q.shape)}, strides {q.stride()})")  # fmt: skip
        batch, next_n, heads, dim = q.shape
        if (
            kv.dtype != torch.uint8 or kv.ndim != 4 or kv.shape[2:] != (1, dim + 4) or kv.shape[1] % _BLOCK_KV
            or kv.stride(3) != 1 or kv.stride(1) != dim + 4 or kv.stride(0) % 4
        ):  # fmt: skip
            raise warmreg.LaunchError(self.name, f"kv_cache must be uint8 [num_blocks, P, 1, {dim + 4}], P a multiple "
                                      f"of {_BLOCK_KV}, with contiguous pages (got {kv.dtype} {tuple(kv.shape)}, "
                                      f"strides {kv.stride()})")  # fmt: skip
        if w.dtype != torch.float32 or w.ndim != 2 or w.shape[0] < batch * next_n or w.shape[1] != heads or (
            w.stride(1) != 1
        ):  # fmt: skip
            raise warmreg.LaunchError(self.name, f"weights must be float32 [>= {batch * next_n}, {heads}] with a "
                                      f"contiguous last dim (got {w.dtype} {tuple(w.shape)})")  # fmt: skip
        if lens.dtype != torch.int32 or not lens.is_contiguous() or lens.numel() not in (batch, batch * next_n):
            raise warmreg.LaunchError(self.name, f"context_lens must be contiguous int32 with {batch} or "
                                      f"{batch * next_n} entries (got {lens.dtype} {tuple(lens.shape)})")  # fmt: skip
        check_int32_table(self.name, "block_table", table, batch)
        if out.dtype != torch.float32 or out.ndim != 2 or out.shape[0] != batch * next_n or out.stride(1) != 1:
            raise warmreg.LaunchError(self.name, f"out must be float32 [{batch * next_n}, M] with a contiguous last "
                                      f"dim (got {out.dtype} {tuple(out.shape)})")  # fmt: skip


def indexer_logits_reference(
    q_fp8: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """PyTorch reference of :class:`RocmIndexerLogits`: a copy of ``out`` with every row's visible logits written."""
    batch, next_n, _, dim = q_fp8.shape
    page, width, total = kv_cache.shape[1], block_table.shape[1], out.shape[1]
    flat = kv_cache.reshape(kv_cache.shape[0], -1)
    lens, result = context_lens.reshape(-1).long(), out.clone()
    per_row = not (next_n > 1 and lens.numel() == batch)
    for row in range(batch * next_n):
        b, n = divmod(row, next_n)
        visible = int(lens[row]) if per_row else int(lens[b]) - next_n + n + 1
        visible = min(max(visible, 0), total, width * page)
        if not visible:
            continue
        pos = torch.arange(visible)
        pages = block_table[b, pos // page].long()
        j = pos % page
        k = flat[pages[:, None], j[:, None] * dim + torch.arange(dim)].view(q_fp8.dtype).float()
        scale = flat[pages[:, None], page * dim + 4 * j[:, None] + torch.arange(4)].contiguous().view(torch.float32)
        s = (k @ q_fp8[b, n].float().T).clamp_min(0) * weights[row].float()
        result[row, :visible] = s.sum(dim=1) * scale[:, 0]
    return result


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the logits on gfx942 / gfx950 where the ROCm indexer runs (aiter on, or gfx950) for a model with C4
    layers on the FP8 indexer and a page that is a multiple of 64; ``N = 1``, and 2 with one draft token."""
    if not model.has_c4 or not platform.is_rocm or mxfp4_indexer(config, model, platform):
        registry.add(RocmIndexerLogits(), when=False)
        return
    page, spec = compressed_block_size(config, 4), num_speculative_tokens(config)
    kernel = RocmIndexerLogits(
        num_heads=model.index_n_heads, head_dim=model.index_head_dim, page=page, next_ns=(1, 2) if spec == 1 else (1,),
        fnuz=platform.fp8_fnuz,
    )  # fmt: skip
    on = page > 1 and page % _BLOCK_KV == 0
    where = warmreg.rocm_arch_in("gfx942", "gfx950") & (warmreg.has_feature("aiter") | warmreg.rocm_arch_in("gfx950"))
    registry.add(kernel, when=where if on else False)
