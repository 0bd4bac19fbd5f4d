"""Decode context parallelism: one rank's partial MLA decode output rescaled by the all-gathered log-sum-exps.

This is ``vllm/v1/attention/ops/dcp.py: CorrectAttnCPOutKernel.kernel``, launched by ``correct_attn_out`` from
``cp_lse_ag_out_rs`` (the all-gather + reduce-scatter combine), which ``MLADCPManager`` picks for the MLA layers of
``vllm/models/kimi_k3/nvidia/mla.py`` when ``decode_context_parallel_size > 1`` and ``dcp_comm_backend`` is
``"ag_rs"`` (vLLM's default for Kimi-K3: only a few models call ``set_dcp_defaults(comm_backend="a2a")``). Each DCP
rank attends to its shard of the KV cache; after ``impl.forward_mqa`` its latent output ``out [B, H, D]`` (``D`` the
``kv_lora_rank``) and ``lse [B, H]`` are combined: the lses of the ``N`` ranks are all-gathered into ``lses [N, B,
H]``, this kernel rescales the rank's output in place and writes the global lse, and a reduce-scatter over the heads
sums the ranks' rescaled outputs.

Math, one program per token ``b`` and head ``h``, in fp32, with ``exp`` / ``log`` natural when ``IS_BASE_E`` (the
attention backend's ``lse_base_on_e``) and base 2 otherwise, and ``r`` this rank's index::

    l_n = lses[n, b, h], with NaN and +inf taken as -inf
    m = max_n l_n  (0 when every l_n is -inf)
    lse = log(sum_n exp(l_n - m)) + m                                   -> vlse[b, h]
    f = exp(x) with x = lses[r, b, h] - lse, NaN and +inf taken as -inf  (so f is 0 there)
    out[b, h, :] = out[b, h, :] * f, exactly 0 where f == 0            (in place, cast to out's dtype)

The op rescales ``out`` in place and returns the global lse, a contiguous ``[B, H]`` of the lses' dtype (vLLM
returns ``(out, lse)``, its lse with the ``(B, H)`` strides of ``lses``: the same tensor for the contiguous
all-gathered lses of every call site). Unlike
vLLM's kernel, whose six strides and rank index are specialized ints, they are runtime ints here and no pointer is
specialized on alignment: one binary a deployment (vLLM's key holds the stride classes of the contiguous layouts it
warms). ``D`` must be contiguous (vLLM's latent output always is).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from .dcp_a2a_pack import dcp_comm_backend
from .model import PLUGIN, KimiK3, positive_text_int, tensor_parallel_size
from .specialized import decode_context_parallel_size

__all__ = [
    "BASE_2_BACKENDS", "DCPCorrectAttnOut", "DCPCorrectAttnOutKey", "dcp_correct_attn_out_reference", "lse_base_on_e",
    "register",
]  # fmt: skip

#: MLA backends whose lse is base 2 (``lse_base_on_e = False``: ``v1/attention/backends/mla``); the others' is base e.
BASE_2_BACKENDS = ("FLASHINFER_MLA_SPARSE", "FLASHINFER_MLA_SPARSE_SM120", "TOKENSPEED_MLA")
_INTS = ["out_stride_b", "out_stride_h", "lses_stride_n", "lses_stride_b", "lses_stride_h", "num_heads", "lse_idx"]


@triton.jit(do_not_specialize=_INTS, do_not_specialize_on_alignment=["out_ptr", "lses_ptr", "vlse_ptr"])
def _dcp_correct_attn_out_kernel(
    out_ptr,  # [B, H, D], D contiguous: rescaled in place
    lses_ptr,  # [N, B, H] the ranks' lses
    vlse_ptr,  # [B, H] contiguous: the global lse
    out_stride_b,
    out_stride_h,
    lses_stride_n,
    lses_stride_b,
    lses_stride_h,
    num_heads,  # H: vlse's row stride
    lse_idx,  # this rank's index in the DCP group
    HEAD_DIM: tl.constexpr,  # kv_lora_rank (a power of two)
    N: tl.constexpr,  # the DCP group size (a power of two: vLLM's tile is the group)
    IS_BASE_E: tl.constexpr,  # natural-log lses (else base 2)
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    lse = tl.load(lses_ptr + tl.arange(0, N) * lses_stride_n + b * lses_stride_b + h * lses_stride_h).to(tl.float32)
    lse = tl.where((lse != lse) | (lse == float("inf")), -float("inf"), lse)
    top = tl.max(lse, axis=0)
    top = tl.where(top == -float("inf"), 0, top)
    lse -= top
    if IS_BASE_E:
        total = tl.log(tl.sum(tl.exp(lse), axis=0))
    else:
        total = tl.log2(tl.sum(tl.exp2(lse), axis=0))
    total += top
    tl.store(vlse_ptr + b * num_heads + h, total)
    mine = tl.load(lses_ptr + lse_idx * lses_stride_n + b * lses_stride_b + h * lses_stride_h).to(tl.float32)
    x = mine - total
    x = tl.where((x != x) | (x == float("inf")), -float("inf"), x)
    factor = tl.exp(x) if IS_BASE_E else tl.exp2(x)
    ptrs = out_ptr + b * out_stride_b + h * out_stride_h + tl.arange(0, HEAD_DIM)
    value = tl.load(ptrs) * factor
    tl.store(ptrs, tl.where(factor == 0.0, 0.0, value))


@attrs.frozen(kw_only=True)
class DCPCorrectAttnOutKey(warmreg.CompileKey):
    """What changes the binary: the dtypes, ``D``, the group size and the lse base (no stride, rank or size)."""

    out_dtype: str
    lse_dtype: str
    head_dim: int
    world_size: int
    is_base_e: bool
    num_warps: int


class DCPCorrectAttnOut(warmreg.TritonKernel[DCPCorrectAttnOutKey]):
    """A DCP rank's partial output rescaled in place, and the global lse (the module docstring has the math).

    :param dtype: the latent output's dtype (the model's; domains only).
    :param head_dim: ``kv_lora_rank`` (domains only).
    :param world_size: the DCP group size (domains only).
    :param is_base_e: the attention backend's ``lse_base_on_e`` (domains only).
    :param heads: the heads of the latent output (domains only; not in the key).
    """

    name = "kimi_k3.dcp_correct_attn_out"
    key_type = DCPCorrectAttnOutKey
    jit = _dcp_correct_attn_out_kernel

    def __init__(self, *, dtype: str, head_dim: int, world_size: int, is_base_e: bool, heads: int = 16) -> None:
        self.dtype, self.head_dim, self.world_size, self.is_base_e = dtype, head_dim, world_size, is_base_e
        self.heads = heads

    def dispatch(self, *, attn_out: torch.Tensor, lses: torch.Tensor, is_lse_base_on_e: bool) -> DCPCorrectAttnOutKey:
        return DCPCorrectAttnOutKey(
            out_dtype=warmreg.dtype_name(attn_out.dtype), lse_dtype=warmreg.dtype_name(lses.dtype),
            head_dim=attn_out.shape[-1],
            world_size=lses.shape[0], is_base_e=bool(is_lse_base_on_e), num_warps=4,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        n, h, d = self.world_size, self.heads, self.head_dim
        return {
            "attn_out": [warmreg.meta((8, h, d), getattr(torch, self.dtype))],
            "lses": [warmreg.meta((n, 8, h), torch.float32)],
            "is_lse_base_on_e": [self.is_base_e],
        }

    def warmup_inputs(self, key: DCPCorrectAttnOutKey) -> Mapping[str, Any]:
        return {
            "attn_out": warmreg.meta((1, 1, key.head_dim), getattr(torch, key.out_dtype)),
            "lses": warmreg.meta((key.world_size, 1, 1), getattr(torch, key.lse_dtype)),
            "cp_rank": 0,
            "is_lse_base_on_e": key.is_base_e,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        attn_out: torch.Tensor,
        lses: torch.Tensor,
        cp_rank: int,
        *,
        is_lse_base_on_e: bool = True,
        out: torch.Tensor | None = None,
    ) -> warmreg.LaunchSpec[DCPCorrectAttnOutKey]:
        """Rescale ``attn_out`` in place and return the global lse ``[B, H]`` (``out``, or a fresh tensor): vLLM's
        ``correct_attn_out(out, lses, cp_rank, ctx, is_lse_base_on_e)``, whose ``out`` may be ``[B, 1, H, D]`` and
        whose ``lses`` may carry a 1-sized extra dim.

        :param attn_out: the rank's partial output ``[B, H, D]``, ``D`` a power of two and contiguous, any float
            dtype; updated in place.
        :param lses: ``[N, B, H]`` float, ``N`` a power of two, any strides.
        :param cp_rank: this rank's index in the DCP group (``0 <= cp_rank < N``).
        :param is_lse_base_on_e: natural-log lses (else base 2).
        :param out: a preallocated contiguous ``[B, H]`` global lse of the dtype of ``lses``.
        :raises warmreg.LaunchError: for shapes, dtypes, layouts or a rank the kernel cannot take, or a wrong
            ``out``.
        """
        attn_out, lses = _three_d(attn_out, lses)
        self._check(attn_out, lses, cp_rank)
        key = self.dispatch(attn_out=attn_out, lses=lses, is_lse_base_on_e=is_lse_base_on_e)
        b, h, _ = attn_out.shape
        lse = warmreg.output(self.name, "out", out, (b, h), lses.dtype, lses.device)
        kwargs = dict(
            out_ptr=attn_out, lses_ptr=lses, vlse_ptr=lse, out_stride_b=attn_out.stride(0),
            out_stride_h=attn_out.stride(1), lses_stride_n=lses.stride(0), lses_stride_b=lses.stride(1),
            lses_stride_h=lses.stride(2), num_heads=h, lse_idx=cp_rank, HEAD_DIM=key.head_dim, N=key.world_size,
            IS_BASE_E=key.is_base_e,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (b, h) if b and h else None, kwargs, lse)

    def _check(self, out: torch.Tensor, lses: torch.Tensor, cp_rank: int) -> None:
        d, n = out.shape[-1], lses.shape[0] if lses.ndim == 3 else 0
        if out.ndim != 3 or not out.dtype.is_floating_point or d != warmreg.next_pow2(d) or out.stride(2) != 1:
            raise warmreg.LaunchError(
                self.name, f"out must be a float [B, H, D] (or [B, 1, H, D]) with D a power of two and unit stride "
                f"over D (got {out.dtype} {tuple(out.shape)}, strides {out.stride()})",
            )  # fmt: skip
        if lses.ndim != 3 or lses.shape[1:] != out.shape[:2] or not lses.dtype.is_floating_point:
            raise warmreg.LaunchError(
                self.name, f"lses must be a float [N, B, H] with [B, H] = {tuple(out.shape[:2])} "
                f"(got {lses.dtype} {tuple(lses.shape)})",
            )  # fmt: skip
        if n != warmreg.next_pow2(n) or not 0 <= cp_rank < n:
            raise warmreg.LaunchError(
                self.name, f"the group size N = {n} must be a power of two and cp_rank ({cp_rank}) in [0, N)"
            )
        if out.device != lses.device:
            raise warmreg.LaunchError(self.name, f"inputs on {out.device} and {lses.device}: use one device")


def _three_d(out: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's normalisation: ``out [B, 1, H, D]`` and ``lses [N, B, H, 1]`` / ``[N, 1, B, H]`` as 3-D views."""
    if out.ndim == 4 and out.shape[1] == 1:
        out = out.squeeze(1)
    if lses.ndim == 4 and lses.shape[-1] == 1:
        lses = lses.squeeze(-1)
    if lses.ndim == 4 and lses.shape[1] == 1:
        lses = lses.squeeze(1)
    return out, lses


def dcp_correct_attn_out_reference(
    attn_out: torch.Tensor, lses: torch.Tensor, cp_rank: int, *, is_lse_base_on_e: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of :class:`DCPCorrectAttnOut`: ``(rescaled attn_out, global lse)`` as new tensors."""
    out, lses = _three_d(attn_out, lses)
    exp, log = (torch.exp, torch.log) if is_lse_base_on_e else (torch.exp2, torch.log2)
    inf = float("inf")
    lse = lses.float()
    lse = torch.where(lse.isnan() | (lse == inf), -inf, lse)
    top = lse.amax(0)
    top = torch.where(top == -inf, 0.0, top)
    total = log(exp(lse - top).sum(0)) + top
    x = lses[cp_rank].float() - total
    x = torch.where(x.isnan() | (x == inf), -inf, x)
    factor = exp(x)
    scaled = torch.where(factor[..., None] == 0, 0.0, out.float() * factor[..., None])
    return scaled.to(out.dtype), total.to(lses.dtype)


def lse_base_on_e(config: warmreg.WarmConfig) -> bool:
    """Whether the MLA attention backend's lse is natural-log (``lse_base_on_e``): all but :data:`BASE_2_BACKENDS`."""
    backend = config.get("serving.attention_backend", str, plugin=PLUGIN, default="FLASHMLA")
    return backend.upper() not in BASE_2_BACKENDS


def register(registry: warmreg.Registry, m: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the DCP correction on CUDA when ``serving.decode_context_parallel_size > 1`` and
    ``serving.dcp_comm_backend`` is ``ag_rs`` (its Kimi-K3 default: every MLA layer's decode combine; ``a2a`` is
    :mod:`warmreg_kimi_k3.dcp_a2a_pack` and :mod:`warmreg_kimi_k3.dcp_a2a_combine`).

    :raises warmreg.ConfigError: for a DCP size that is not a power of two (vLLM's kernel tiles the group), an
        unknown ``serving.dcp_comm_backend``, or a missing ``text.kv_lora_rank`` / ``text.num_attention_heads``.
    """
    dcp = decode_context_parallel_size(config)
    if dcp <= 1 or dcp_comm_backend(config) != "ag_rs":
        return
    if dcp != warmreg.next_pow2(dcp):
        raise warmreg.ConfigError(
            "serving.decode_context_parallel_size", f"is {dcp}: vLLM's DCP correction tiles the group, which must "
            "be a power of two", plugin=PLUGIN, fix="serve with a DCP size of 2, 4, 8, ...",
        )  # fmt: skip
    heads = positive_text_int(config, "num_attention_heads") // tensor_parallel_size(config)
    kernel = DCPCorrectAttnOut(
        dtype=m.dtype, head_dim=positive_text_int(config, "kv_lora_rank"), world_size=dcp,
        is_base_e=lse_base_on_e(config), heads=max(heads, 1),
    )  # fmt: skip
    registry.add(kernel, when=warmreg.is_cuda)
