"""XPU sparse MLA attention over BF16 workspace rows (vLLM 0.34 ``v1/attention/ops/xpu_mla_sparse.py``:
``_bf16_mla_sparse_kernel``, launched by ``triton_bf16_mla_sparse_interface``).

For query token ``t``, head ``h`` and its index row ``idx = indices[t, 0, :]`` (``-1`` or ``>= rows`` for none), with
``kv`` the ``[rows, 1, D]`` BF16 workspace (``D = 512``: DeepSeek-V4's whole head, ``block_dpe = 0``) and ``c = scale *
log2(e)``::

    s[j]           = c * (q[t, h] . kv[idx[j]])               valid j  (a masked j scores -1e30)
    out[t, h]      = bf16(sum_j 2^(s[j] - m) kv[idx[j]] / sum_j 2^(s[j] - m))    m = max_j s[j] (at least -1e30)
    max_logits[t, h] = m * ln 2;   lse[t, h] = max_logits[t, h] + ln(sum_j 2^(s[j] - m))

computed as vLLM does: a program a token and 16 heads, the row in 16-column blocks with an online softmax in base 2
(fp32 accumulators; keys loaded ``[D, 16]`` for the score dot and values ``[16, D]``; the scores' probabilities
rounded to bf16 for the value dot), a finite ``-1e30`` start so that a block of masked columns never makes NaN (a row
with none valid gives a zero output). Outputs: ``out`` BF16 ``[T, H, D]`` and float32 ``max_logits`` and ``lse``
``[T, H]``, returned as vLLM's ``(out, max_logits, lse)``.

Where it runs: every XPU DeepSeek-V4 attention layer (``models/deepseek_v4/xpu/xpu_sparse.py:
DeepseekV4XPUSparseAttention``), every step: decode tokens through ``xpu_sparse_decode_fp8``, whose index rows are
``round_up(top + swa, 16)`` wide (``top``: the compressed top-k width, 0 on SWA-only layers; ``swa``: the decode SWA
width, the sliding window, or DSpark's non-causal ``round_up(window + N, 64)`` on the draft's SWA-only layers), and
prefill chunks through ``_forward_prefill``, whose rows are ``combine_topk_swa_indices``'s ``round_up(top + window,
128)``. ``top`` is ``index_topk`` on C4 layers and each C128 width (:func:`.backends.c128_widths`) on C128 layers. Both
read the ``fp8_ds_mla`` caches (XPU's only layout here); DeepSeek-V4.1 runs on CUDA and ROCm only.

Key: the row width (vLLM's constexpr ``index_topk``), the heads a rank (``kv_group_num``: no head padding on XPU,
``get_padded_num_q_heads``), the head and tiles, the warps. Token counts, strides and the scale are runtime values
(``do_not_specialize``), and no pointer is specialized on alignment (query and output rows are slices).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._checks import out_parts
from ._serving import max_model_len
from .backends import c128_widths
from .dspark import DSparkDraft
from .fp8_ds_mla import HEAD_DIM, check_model_layout, uses_fp8_ds_mla
from .model import DSV4, PLUGIN

__all__ = ["XPUSparseMla", "XPUSparseMlaKey", "register", "xpu_sparse_mla_reference", "xpu_sparse_mla_widths"]

_BLOCK_H = 16
_BLOCK_N = 16
_NUM_WARPS = 4
_LN2 = math.log(2.0)  # vLLM's LOGE2
_LOG2E = math.log2(math.e)  # vLLM's LOG2E
_NONE = -1.0e30
_NONE_F: tl.constexpr = tl.constexpr(_NONE)  # the finite "no score" of vLLM's kernel


@triton.jit(
    do_not_specialize=["num_rows", "sm_scale", "q_stride_t", "q_stride_h", "kv_stride", "out_stride_t",
                       "out_stride_h", "lse_stride", "idx_stride"],
    do_not_specialize_on_alignment=["q_ptr", "kv_ptr", "idx_ptr", "out_ptr", "lse_ptr", "max_ptr"],
)  # fmt: skip
def _xpu_sparse_mla_kernel(
    q_ptr,
    kv_ptr,
    idx_ptr,
    out_ptr,
    lse_ptr,
    max_ptr,
    num_rows,
    sm_scale,
    q_stride_t,
    q_stride_h,
    kv_stride,
    out_stride_t,
    out_stride_h,
    lse_stride,
    idx_stride,
    HEADS: tl.constexpr,  # query heads a rank (vLLM's kv_group_num with one KV head)
    WIDTH: tl.constexpr,  # index columns a row (vLLM's index_topk), a multiple of BLOCK_N
    D: tl.constexpr,  # head dim, keys and values alike
    BLOCK_H: tl.constexpr,  # heads a program
    BLOCK_N: tl.constexpr,  # index columns a step
    LN2: tl.constexpr,  # ln 2: base-2 statistics back to natural log
):
    t = tl.program_id(0).to(tl.int64)
    GROUP: tl.constexpr = BLOCK_H if HEADS > BLOCK_H else HEADS
    heads = tl.program_id(1) * GROUP + tl.arange(0, BLOCK_H)
    live_h = (heads < (tl.program_id(1) + 1) * GROUP) & (heads < HEADS)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + t * q_stride_t + heads[:, None] * q_stride_h + d[None, :], mask=live_h[:, None], other=0.0)
    m = tl.full([BLOCK_H], _NONE_F, tl.float32)
    total = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    for start in range(0, WIDTH, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        rows = tl.load(idx_ptr + t * idx_stride + cols, mask=cols < WIDTH, other=-1)
        ok = (rows >= 0) & (rows < num_rows)
        base = kv_ptr + rows.to(tl.int64) * kv_stride
        k = tl.load(base[None, :] + d[:, None], mask=ok[None, :], other=0.0)  # [D, BLOCK_N]: the dot's own layout
        kv = tl.load(base[:, None] + d[None, :], mask=ok[:, None], other=0.0)  # [BLOCK_N, D]: the same rows as values
        s = tl.dot(q, k.to(q.dtype)) * sm_scale
        s = tl.where(live_h[:, None] & ok[None, :], s, _NONE_F)
        m_new = tl.maximum(tl.max(s, 1), m)
        shrink = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        acc = acc * shrink[:, None] + tl.dot(p.to(kv.dtype), kv)
        total = total * shrink + tl.sum(p, 1)
        m = m_new
    acc = acc / total[:, None]
    top = m * LN2
    out = out_ptr + t * out_stride_t + heads[:, None] * out_stride_h + d[None, :]
    tl.store(out, acc.to(tl.bfloat16), mask=live_h[:, None])
    tl.store(lse_ptr + t * lse_stride + heads, top + tl.log2(total) * LN2, mask=live_h)
    tl.store(max_ptr + t * lse_stride + heads, top, mask=live_h)


@attrs.frozen(kw_only=True)
class XPUSparseMlaKey(warmreg.CompileKey):
    """What changes the binary: the row width, the heads a rank, the head, the tiles and the warps."""

    width: int
    heads: int
    head_dim: int
    block_h: int
    block_n: int
    num_warps: int


class XPUSparseMla(warmreg.TritonKernel[XPUSparseMlaKey]):
    """BF16 sparse MLA attention over gathered workspace rows; see the module docstring.

    :param heads: query heads a rank (domains only).
    :param widths: every index-row width a deployment attends with (domains only).
    """

    name = "deepseek_v4.xpu_sparse_mla"
    key_type = XPUSparseMlaKey
    jit = _xpu_sparse_mla_kernel

    def __init__(self, *, heads: int = 16, widths: Iterable[int] = (128,)) -> None:
        self.heads, self.widths = heads, tuple(sorted(set(widths)))

    def dispatch(self, *, q: torch.Tensor, indices: torch.Tensor) -> XPUSparseMlaKey:
        return XPUSparseMlaKey(width=indices.shape[-1], heads=q.shape[1], head_dim=q.shape[2], block_h=_BLOCK_H,
                               block_n=_BLOCK_N, num_warps=_NUM_WARPS)  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        return {
            "q": [warmreg.meta((1, self.heads, HEAD_DIM), torch.bfloat16)],
            "indices": [warmreg.meta((1, 1, w), torch.int32) for w in self.widths],
        }

    def warmup_inputs(self, key: XPUSparseMlaKey) -> Mapping[str, Any]:
        return {
            "q": warmreg.meta((1, key.heads, key.head_dim), torch.bfloat16),
            "kv": warmreg.meta((key.width, 1, key.head_dim), torch.bfloat16),
            "indices": warmreg.meta((1, 1, key.width), torch.int32),
            "sm_scale": 0.04,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        indices: torch.Tensor,
        sm_scale: float,
        *,
        out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> warmreg.LaunchSpec[XPUSparseMlaKey]:
        """``(out, max_logits, lse)`` as vLLM's ``triton_bf16_mla_sparse_interface(q, kv, indices, sm_scale,
        d_v=q.shape[-1], block_dpe=0)`` returns them.

        :param q: bf16 ``[T, H, 512]``, head rows contiguous (any token and head strides).
        :param kv: bf16 ``[rows, 1, 512]`` workspace rows, contiguous within a row.
        :param indices: int32 ``[T, 1, W]`` rows into ``kv`` (``W`` a multiple of 16), contiguous within a row.
        :param sm_scale: the softmax scale (natural base; the launch multiplies by ``log2(e)`` as vLLM does).
        :param out: the three outputs to write instead of fresh ones: bf16 ``[T, H, 512]``, float32 ``[T, H]`` twice.
        :raises warmreg.LaunchError: for wrong dtypes, ranks, shapes or layouts, or an ``out`` unlike the fresh ones.
        """
        self._check(q, kv, indices)
        tokens, heads, dim = q.shape
        o, mx, lse = out_parts(self.name, out, 3)
        device = q.device
        o = warmreg.output(self.name, "out[0]", o, (tokens, heads, dim), torch.bfloat16, device)
        mx = warmreg.output(self.name, "out[1]", mx, (tokens, heads), torch.float32, device)
        lse = warmreg.output(self.name, "out[2]", lse, (tokens, heads), torch.float32, device)
        key = self.dispatch(q=q, indices=indices)
        kwargs = dict(
            q_ptr=q, kv_ptr=kv, idx_ptr=indices, out_ptr=o, lse_ptr=lse, max_ptr=mx, num_rows=kv.shape[0],
            sm_scale=sm_scale * _LOG2E, q_stride_t=q.stride(0), q_stride_h=q.stride(1), kv_stride=kv.stride(0),
            out_stride_t=o.stride(0), out_stride_h=o.stride(1), lse_stride=lse.stride(0), idx_stride=indices.stride(0),
            HEADS=key.heads, WIDTH=key.width, D=key.head_dim, BLOCK_H=key.block_h, BLOCK_N=key.block_n, LN2=_LN2,
        )  # fmt: skip
        group = min(key.block_h, key.heads)
        grid = (tokens, triton.cdiv(heads, group)) if tokens and heads else None
        return warmreg.LaunchSpec(key, grid, kwargs, (o, mx, lse))

    def _check(self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor) -> None:
        if q.dtype != torch.bfloat16 or q.ndim != 3 or q.shape[2] != HEAD_DIM or q.stride(2) != 1:
            raise warmreg.LaunchError(self.name, f"q must be bf16 [T, H, {HEAD_DIM}] with contiguous head rows (got "
                                      f"{q.dtype} {tuple(q.shape)}, strides {q.stride()})")  # fmt: skip
        if kv.dtype != torch.bfloat16 or kv.ndim != 3 or kv.shape[1:] != (1, HEAD_DIM) or kv.stride(2) != 1:
            raise warmreg.LaunchError(self.name, f"kv must be bf16 [rows, 1, {HEAD_DIM}] with contiguous rows (got "
                                      f"{kv.dtype} {tuple(kv.shape)})")  # fmt: skip
        width = indices.shape[-1] if indices.ndim == 3 else 0
        if (
            indices.dtype != torch.int32
            or indices.ndim != 3
            or indices.shape[:2] != (q.shape[0], 1)
            or width < _BLOCK_N
            or width % _BLOCK_N
            or (width > 1 and indices.stride(2) != 1)
        ):
            raise warmreg.LaunchError(self.name, f"indices must be int32 [{q.shape[0]}, 1, W] with W a multiple of "
                                      f"{_BLOCK_N} and contiguous rows (got {indices.dtype} {tuple(indices.shape)})")  # fmt: skip
        if not q.device == kv.device == indices.device:
            raise warmreg.LaunchError(self.name, "q, kv and indices must be on one device")


def xpu_sparse_mla_reference(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyTorch reference of :class:`XPUSparseMla` in float32 (one softmax over the whole row): ``(out bf16, max_logits,
    lse)``. It differs from the kernel's blockwise bf16 probabilities by rounding only."""
    rows = indices[:, 0, :].long()
    ok = (rows >= 0) & (rows < kv.shape[0])
    keys = kv[:, 0, :].float()[rows.clamp(0, max(kv.shape[0] - 1, 0))] * ok[..., None]  # [T, W, D]
    s = torch.einsum("thd,twd->thw", q.float(), keys) * (sm_scale * _LOG2E)
    s = torch.where(ok[:, None, :], s, torch.full_like(s, _NONE))
    m = s.amax(-1).clamp(min=_NONE)
    p = torch.exp2(s - m[..., None])
    total = p.sum(-1)
    out = torch.einsum("thw,twd->thd", p, keys) / total[..., None]
    return out.to(torch.bfloat16), m * _LN2, m * _LN2 + torch.log2(total) * _LN2


def xpu_sparse_mla_widths(model: DSV4, config: warmreg.WarmConfig) -> list[int]:
    """Every index-row width an XPU deployment attends with: decode ``round_up(top + swa, 16)``, prefill
    ``round_up(top + window, 128)`` (see the module docstring).

    :raises warmreg.ConfigError: for DSpark fields that do not fit (:meth:`.dspark.DSparkDraft.from_config`).
    """
    window = model.sliding_window
    tops = ([0] if 1 in model.ratios else []) + ([model.index_topk] if model.has_c4 else [])
    tops += c128_widths(max_model_len(config)) if model.has_c128 else []
    decode = {triton.cdiv(top + window, 16) * 16 for top in tops}
    widths = decode | {triton.cdiv(top + window, 128) * 128 for top in tops}
    draft = DSparkDraft.from_config(config, model)
    if draft is not None:  # the draft's SWA-only layers: non-causal decode rows, prefill rows as the target's
        widths |= {triton.cdiv(draft.index_width, 16) * 16, triton.cdiv(draft.window, 128) * 128}
    return sorted(widths)


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the attention on XPU over the ``fp8_ds_mla`` caches (DeepSeek-V4 only).

    :raises warmreg.ConfigError: if ``serving.tensor_parallel_size`` does not divide the heads, the head does not fit
        the layout (448 + 64), or DSpark fields do not fit.
    """
    if model.v41 or not platform.is_xpu or not uses_fp8_ds_mla(config, platform):
        return
    check_model_layout(model)
    tp = config.get("serving.tensor_parallel_size", int, plugin=PLUGIN, default=1)
    if model.num_attention_heads % tp:
        raise warmreg.ConfigError(
            "serving.tensor_parallel_size", f"must divide num_attention_heads {model.num_attention_heads} (got {tp})",
            plugin=PLUGIN,
        )  # fmt: skip
    kernel = XPUSparseMla(heads=model.num_attention_heads // tp, widths=xpu_sparse_mla_widths(model, config))
    registry.add(kernel, when=warmreg.is_xpu)
