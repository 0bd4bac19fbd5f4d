"""ROCm DeepSeek-V4 in-tree sparse MLA prefill over a bf16 workspace, on ragged KV indices (vLLM 0.34
``v1/attention/ops/rocm_aiter_mla_sparse.py``: ``_sparse_attn_prefill_ragged_kernel``, launched by
``_rocm_sparse_attn_prefill_ragged_triton`` from ``rocm_sparse_attn_prefill``).

Query ``t`` (``q [T, H, D]``, bf16) attends to the workspace rows ``kv [N, D]`` named by its stretch
``indices[indptr[t]:indptr[t+1]]`` of the ragged stream; an entry outside ``[0, N)`` is skipped. With the head's sink
``z_h`` (``attn_sink``, fp32; without one, ``z_h = -inf``)::

    s_j  = (q[t, h] . kv[j]) * scale                       (bf16 products, fp32 sums: tl.dot)
    m    = max(max_j s_j, z_h);   l = sum_j exp(s_j - m) + exp(z_h - m)
    out[t, h, :] = l > 0 ? (sum_j bf16(exp(s_j - m')) kv[j]) * exp(m' - m) / max(l, 1e-30) : 0

as an online softmax over tiles of ``BLOCK_K`` keys (``m'`` the running maximum of a tile, each tile's probabilities
rounded to the KV dtype for the second ``tl.dot``, as in vLLM), ``BLOCK_H = 16`` heads a program: grid
``(T, cdiv(H, 16))``. Keys are the full ``D`` lanes (NoPE and RoPE: vLLM's ``kv`` holds both), values the same rows.
The output is written in the output's dtype (the layer output, bf16). No log-sum-exp is returned.

Where it runs: ``DeepseekV4ROCMAiterMLAAttention._forward_prefill`` (``models/deepseek_v4/amd/rocm.py``), every
prefill chunk of every layer type, unless prefill takes aiter's sparse MLA
(:func:`._rocm_attention.aiter_sparse_mla_prefill`): ``rocm_sparse_attn_prefill(q=q[query_start:query_end],
kv=workspace.view(-1, 1, D), indices=combined_indices, topk_length=combined_lens, scale=head_dim**-0.5, ...,
attn_sink=self.attn_sink, output=output[query_start:query_end])``, which compacts the combined rows
(``build_ragged_indices_from_dense``, :mod:`.rocm_ragged`) and launches this kernel. Chunks of 1,024 or more queries
go to aiter's OPUS prefill on gfx950 with aiter's MLA, of 512 or more to aiter's ``pa_prefill_sparse`` on gfx942 with
it: smaller chunks still launch this kernel, so every ROCm in-tree prefill plans it. vLLM always passes the sink
(``attn_sink[:H]``, fp32) and a ``D``-wide output.

Key: the q, KV and output dtypes, the sink flag, the output width and the blocks (vLLM's constexprs: ``BLOCK_H`` 16,
``BLOCK_D = next_pow2(D)``, ``BLOCK_K`` 16 for ``D >= 256`` else 32) and the warps (4). Strides, the head count,
``D`` and ``N`` are runtime ints (``do_not_specialize``; vLLM specializes them), the scale a float. Every pointer is
a whole-row slice of an aligned buffer (aligned). Offsets into ``kv`` are 64-bit.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._rocm_attention import aiter_sparse_mla_prefill
from ._serving import serving_int
from .model import DSV4

__all__ = ["RocmSparseAttnPrefill", "RocmSparseAttnPrefillKey", "register", "rocm_sparse_attn_prefill_reference"]

_BLOCK_H = 16
_NUM_WARPS = 4
_NEG = tl.constexpr(-3.4028234663852886e38)  # the running maximum's start: fp32's lowest


@triton.jit(
    do_not_specialize=[
        "q_stride_t", "q_stride_h", "kv_stride_n", "out_stride_t", "out_stride_h", "num_heads", "head_dim", "num_kv",
    ]
)  # fmt: skip
def _rocm_sparse_prefill_kernel(
    q_ptr,
    kv_ptr,
    indices_ptr,
    indptr_ptr,
    sink_ptr,
    out_ptr,
    q_stride_t,
    q_stride_h,
    kv_stride_n,
    out_stride_t,
    out_stride_h,
    num_heads,
    head_dim,
    num_kv,
    scale,
    HAS_SINK: tl.constexpr,  # fold the per-head sink into the denominator
    OUT_DV: tl.constexpr,  # output lanes stored (the output's width)
    BLOCK_H: tl.constexpr,  # heads a program
    BLOCK_D: tl.constexpr,  # next_pow2(head_dim)
    BLOCK_K: tl.constexpr,  # keys a tile
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_ok = heads < num_heads
    dim_ok = dims < head_dim
    q_rows = q_ptr + t * q_stride_t + heads[:, None].to(tl.int64) * q_stride_h + dims[None, :]
    q = tl.load(q_rows, mask=head_ok[:, None] & dim_ok[None, :], other=0.0)
    run_max = tl.full((BLOCK_H,), _NEG, dtype=tl.float32)
    run_sum = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
    first = tl.load(indptr_ptr + t)
    count = tl.load(indptr_ptr + t + 1) - first
    lanes = tl.arange(0, BLOCK_K)
    for k0 in tl.range(0, count, BLOCK_K):
        inside = k0 + lanes < count
        slot = tl.load(indices_ptr + first + k0 + lanes, mask=inside, other=-1)
        live = inside & (slot >= 0) & (slot < num_kv)
        rows = tl.where(live, slot, 0).to(tl.int64) * kv_stride_n
        kv = tl.load(kv_ptr + rows[:, None] + dims[None, :], mask=live[:, None] & dim_ok[None, :], other=0.0)
        both = head_ok[:, None] & live[None, :]
        scores = tl.where(both, tl.dot(q, tl.trans(kv)) * scale, _NEG)
        new_max = tl.maximum(run_max, tl.max(scores, axis=1))
        decay = tl.exp(run_max - new_max)
        p = tl.where(both, tl.exp(scores - new_max[:, None]), 0.0)
        run_sum = run_sum * decay + tl.sum(p, axis=1)
        acc = acc * decay[:, None] + tl.dot(p.to(kv.dtype), kv)
        run_max = new_max
    if HAS_SINK:
        sink = tl.load(sink_ptr + heads, mask=head_ok, other=_NEG).to(tl.float32)
        top = tl.maximum(run_max, sink)
        decay = tl.exp(run_max - top)
        total = run_sum * decay + tl.exp(sink - top)
        out = tl.where(total[:, None] > 0.0, (acc * decay[:, None]) / tl.maximum(total, 1.0e-30)[:, None], 0.0)
    else:
        out = tl.where(run_sum[:, None] > 0.0, acc / tl.maximum(run_sum, 1.0e-30)[:, None], 0.0)
    out_rows = out_ptr + t * out_stride_t + heads[:, None].to(tl.int64) * out_stride_h + dims[None, :]
    tl.store(out_rows, out, mask=head_ok[:, None] & (dims[None, :] < OUT_DV))


@attrs.frozen(kw_only=True)
class RocmSparseAttnPrefillKey(warmreg.CompileKey):
    """What changes the binary of the sparse prefill: dtypes, the sink flag, the output width, blocks and warps."""

    q_dtype: str
    kv_dtype: str
    out_dtype: str
    has_sink: bool
    out_dv: int
    block_h: int
    block_d: int
    block_k: int
    num_warps: int


class RocmSparseAttnPrefill(warmreg.TritonKernel[RocmSparseAttnPrefillKey]):
    """Sparse MLA prefill of a chunk over its bf16 workspace, ragged indices (see the module docstring)."""

    name = "deepseek_v4.rocm_sparse_attn_prefill"
    key_type = RocmSparseAttnPrefillKey
    jit = _rocm_sparse_prefill_kernel

    def dispatch(
        self, *, q: torch.Tensor, kv: torch.Tensor, attn_sink: torch.Tensor | None = None
    ) -> RocmSparseAttnPrefillKey:
        dim = q.shape[-1]
        return RocmSparseAttnPrefillKey(
            q_dtype=warmreg.dtype_name(q.dtype), kv_dtype=warmreg.dtype_name(kv.dtype),
            out_dtype=warmreg.dtype_name(q.dtype), has_sink=attn_sink is not None, out_dv=dim, block_h=_BLOCK_H,
            block_d=warmreg.next_pow2(dim), block_k=16 if dim >= 256 else 32, num_warps=_NUM_WARPS,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        model = DSV4.from_config(config)
        heads = model.num_attention_heads // serving_int(config, "tensor_parallel_size", 1)
        return {  # q and the workspace are bf16; the layer always has its fp32 sink
            "q": [warmreg.meta((1, heads, model.head_dim), torch.bfloat16)],
            "kv": [warmreg.meta((1, model.head_dim), torch.bfloat16)],
            "attn_sink": [warmreg.meta((heads,), torch.float32)],
        }

    def warmup_inputs(self, key: RocmSparseAttnPrefillKey) -> Mapping[str, Any]:
        q = warmreg.meta((1, 1, key.out_dv), getattr(torch, key.q_dtype))
        return {
            "q": q, "kv": warmreg.meta((1, key.out_dv), getattr(torch, key.kv_dtype)),
            "indices": warmreg.meta((1,), torch.int32), "indptr": warmreg.meta((2,), torch.int32),
            "attn_sink": warmreg.meta((1,), torch.float32) if key.has_sink else None, "scale": 0.5,
        }  # fmt: skip

    @warmreg.kernel_launcher
    def __call__(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        indices: torch.Tensor,
        indptr: torch.Tensor,
        attn_sink: torch.Tensor | None = None,
        *,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> warmreg.LaunchSpec[RocmSparseAttnPrefillKey]:
        """The attention output ``[T, H, D]`` in ``q``'s dtype (fresh, or ``out``: vLLM's ``output[start:end]``).

        :param q: ``[T, H, D]`` float queries, last dim contiguous (any row and head strides).
        :param kv: ``[N, D]`` float workspace rows of ``q``'s width, last dim contiguous.
        :param indices: int32 ``[>= indptr[T]]`` contiguous ragged stream of workspace rows.
        :param indptr: int32 ``[T + 1]`` contiguous offsets of each query's stretch.
        :param attn_sink: float32 ``[>= H]`` contiguous per-head sinks, or None.
        :param scale: the softmax scale (``head_dim ** -0.5``).
        :param out: the output to write instead of a fresh one, exactly as it would be allocated.
        :raises warmreg.LaunchError: for wrong dtypes, ranks, lengths or layouts, or an ``out`` unlike the fresh one.
        """
        self._check(q, kv, indices, indptr, attn_sink)
        key = self.dispatch(q=q, kv=kv, attn_sink=attn_sink)
        result = warmreg.output(self.name, "out", out, tuple(q.shape), q.dtype, q.device)
        tokens, heads, dim = q.shape
        kwargs = dict(
            q_ptr=q, kv_ptr=kv, indices_ptr=indices, indptr_ptr=indptr, sink_ptr=attn_sink, out_ptr=result,
            q_stride_t=q.stride(0), q_stride_h=q.stride(1), kv_stride_n=kv.stride(0), out_stride_t=result.stride(0),
            out_stride_h=result.stride(1), num_heads=heads, head_dim=dim, num_kv=kv.shape[0], scale=float(scale),
            HAS_SINK=key.has_sink, OUT_DV=key.out_dv, BLOCK_H=key.block_h, BLOCK_D=key.block_d, BLOCK_K=key.block_k,
        )  # fmt: skip
        grid = (tokens, triton.cdiv(heads, key.block_h)) if tokens and heads else None
        return warmreg.LaunchSpec(key, grid, kwargs, result)

    def _check(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        indices: torch.Tensor,
        indptr: torch.Tensor,
        attn_sink: torch.Tensor | None,
    ) -> None:
        if not q.dtype.is_floating_point or q.ndim != 3 or q.stride(2) != 1:
            raise warmreg.LaunchError(self.name, f"q must be a float [T, H, D] tensor with a contiguous last dim (got "
                                      f"{q.dtype} {tuple(q.shape)}, strides {q.stride()})")  # fmt: skip
        if not kv.dtype.is_floating_point or kv.ndim != 2 or kv.shape[1] != q.shape[2] or kv.stride(1) != 1:
            raise warmreg.LaunchError(self.name, f"kv must be a float [N, {q.shape[2]}] tensor with a contiguous last "
                                      f"dim (got {kv.dtype} {tuple(kv.shape)})")  # fmt: skip
        for name, t, n in (("indptr", indptr, q.shape[0] + 1), ("indices", indices, 0)):
            if t.dtype != torch.int32 or t.ndim != 1 or t.shape[0] < n or (t.shape[0] > 1 and t.stride(0) != 1):
                raise warmreg.LaunchError(self.name, f"{name} must be a contiguous int32 [>= {n}] tensor (got "
                                          f"{t.dtype} {tuple(t.shape)})")  # fmt: skip
        if attn_sink is not None and (
            attn_sink.dtype != torch.float32
            or attn_sink.ndim != 1
            or attn_sink.shape[0] < q.shape[1]
            or (attn_sink.shape[0] > 1 and attn_sink.stride(0) != 1)
        ):
            raise warmreg.LaunchError(self.name, f"attn_sink must be a contiguous float32 [>= {q.shape[1]}] tensor "
                                      f"(got {attn_sink.dtype} {tuple(attn_sink.shape)})")  # fmt: skip


def rocm_sparse_attn_prefill_reference(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    indptr: torch.Tensor,
    attn_sink: torch.Tensor | None = None,
    *,
    scale: float,
) -> torch.Tensor:
    """PyTorch reference of :class:`RocmSparseAttnPrefill` (a loop over queries, an exact softmax in fp32; the
    kernel's bf16 probabilities differ by a rounding): ``[T, H, D]`` in ``q``'s dtype."""
    tokens, heads, _ = q.shape
    out = torch.zeros(q.shape, dtype=torch.float32)
    sink = attn_sink[:heads].float() if attn_sink is not None else torch.full((heads,), float("-inf"))
    for t in range(tokens):
        slots = indices[int(indptr[t]) : int(indptr[t + 1])].long()
        rows = kv[slots[(slots >= 0) & (slots < kv.shape[0])]].float()
        scores = q[t].float() @ rows.T * scale  # [H, n]
        top = torch.maximum(scores.max(dim=1).values if rows.shape[0] else sink, sink)
        if not rows.shape[0]:
            continue  # no key: exp(sink - sink) / 1 times an empty sum, or nothing at all
        weights = torch.exp(scores - top[:, None])
        out[t] = (weights @ rows) / (weights.sum(dim=1) + torch.exp(sink - top))[:, None]
    return out.to(q.dtype)


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the sparse prefill on ROCm unless prefill takes aiter's sparse MLA (see the module docstring)."""
    on = not aiter_sparse_mla_prefill(config, model, platform)
    registry.add(RocmSparseAttnPrefill(), when=warmreg.is_rocm if on else False)
