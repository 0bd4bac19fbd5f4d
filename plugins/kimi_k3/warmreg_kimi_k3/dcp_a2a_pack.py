"""Decode context parallelism, all-to-all combine: one rank's partial MLA output and lse packed into the send buffer.

This is ``vllm/v1/attention/ops/dcp.py: _dcp_a2a_pack_send_kernel``, launched by ``_dcp_a2a_pack_send`` from
``dcp_a2a_lse_reduce``. ``MLADCPManager`` picks that combine for the MLA layers of ``vllm/models/kimi_k3/nvidia/mla.py``
when ``decode_context_parallel_size > 1``, ``parallel_config.dcp_comm_backend == "a2a"`` and no direct
symmetric-memory workspace is made (``get_direct_dcp_a2a_workspace`` returns ``None``: the environment variable
``VLLM_USE_DIRECT_DCP_A2A=0``, or a dtype other than bf16 / fp16; warmreg's flag ``serving.direct_dcp_a2a``). Kimi-K3
builds the manager with ``use_pcp=False``, so the decode goes through ``dcp_a2a_v_up_proj_lse_reduce`` with
``W_UV_dcp``: below 8 decode tokens the latent output ``[B, H, L]`` (``L = kv_lora_rank``) is combined, from 8 the
up-projected ``[B, H, V]`` (``V = v_head_dim``); the empty-shard mask is always on (``seq_lens`` and
``query_start_loc`` of the decode).

Math, one program per token ``b`` and local head ``j`` (``H = N * P`` heads, ``P`` per rank, ``N`` the group), with
``pack`` the lse's width in the output dtype (2 for 16-bit dtypes: the fp32 bits split into low and high halves, 1
for fp32)::

    empty(b) = b >= query_start_loc[S] or seq_lens[s(b)] == 0,  s(b) = min(#{i < S: query_start_loc[i+1] <= b}, S-1)
    for r in 0..N-1, h = r * P + j:
        send[r, b, j, :D] = out[b, h, :]
        l = -inf if empty(b) else float(lse[b, h])
        send[r, b, j, D:D+pack] = l (fp32 bits as two 16-bit words, low first; or l itself for fp32)

with ``S = len(seq_lens)``. vLLM specializes ``P``, and the arange bound ``NUM_SEQS_POW2 = next_pow2(max(S, 1))`` is a
per-step constexpr; here ``P``, the sizes and the strides are runtime ints and no pointer is specialized on
alignment, so the key is the dtypes, ``N``, ``D``, the mask and ``NUM_SEQS_POW2``. vLLM reads ``seq_lens[-1]`` for a
step of no local sequences (every row empty either way); this kernel masks that read.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from .model import PLUGIN, KimiK3, positive_text_int, tensor_parallel_size
from .specialized import decode_context_parallel_size

__all__ = [
    "DCPA2APackSend", "DCPA2APackSendKey", "V_UP_PROJ_FIRST_MIN_TOKENS", "A2APlan", "a2a_plan", "dcp_a2a_pack_send_reference",
    "dcp_comm_backend", "lse_pack_dim", "register",
]  # fmt: skip

#: ``dcp_a2a_v_up_proj_lse_reduce``: from this many decode tokens the ranks exchange ``V`` values per head, not ``L``.
V_UP_PROJ_FIRST_MIN_TOKENS = 8
_INTS = ["num_seqs", "h_per_rank", "out_stride_b", "out_stride_h", "lse_stride_b", "lse_stride_h", "send_stride_n",
         "send_stride_b", "send_stride_h"]  # fmt: skip


@triton.jit(do_not_specialize=_INTS, do_not_specialize_on_alignment=["out_ptr", "lse_ptr", "send_ptr"])
def _dcp_a2a_pack_send_kernel(
    out_ptr,  # [B, N * P, D], D contiguous: the rank's partial output
    lse_ptr,  # [B, N * P] float: its lse
    send_ptr,  # [N, B, P, D + pack] of out's dtype, unit stride over the last dim
    seq_lens_ptr,  # [S] int: the decode's local KV lengths
    query_start_loc_ptr,  # [S + 1] int: query-token offsets
    num_seqs,  # S
    h_per_rank,  # P
    out_stride_b,
    out_stride_h,
    lse_stride_b,
    lse_stride_h,
    send_stride_n,
    send_stride_b,
    send_stride_h,
    N: tl.constexpr,  # the DCP group size: the rank loop is unrolled
    HEAD_DIM: tl.constexpr,  # D, a power of two (the arange)
    LSE_PACK_DIM: tl.constexpr,  # 2: the fp32 lse as two 16-bit words; 1: one fp32
    HAS_MASK: tl.constexpr,  # empty shards and padded rows get lse -inf
    NUM_SEQS_POW2: tl.constexpr,  # the arange over the request boundaries
):
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    empty = False
    if HAS_MASK:
        s = tl.arange(0, NUM_SEQS_POW2)
        ends = tl.load(query_start_loc_ptr + 1 + s, mask=s < num_seqs, other=2**31 - 1)
        seq = tl.minimum(tl.sum((ends <= b).to(tl.int32), axis=0), num_seqs - 1)
        rows = tl.load(query_start_loc_ptr + num_seqs)
        length = tl.load(seq_lens_ptr + tl.maximum(seq, 0), mask=seq >= 0, other=0)
        empty = (b >= rows) | (length == 0)
    for r in tl.static_range(N):
        h = r * h_per_rank + j
        base = send_ptr + r * send_stride_n + b * send_stride_b + j * send_stride_h
        tl.store(base + d, tl.load(out_ptr + b * out_stride_b + h * out_stride_h + d))
        lse = tl.load(lse_ptr + b * lse_stride_b + h * lse_stride_h).to(tl.float32)
        if HAS_MASK:
            lse = tl.where(empty, -float("inf"), lse)
        if LSE_PACK_DIM == 1:
            tl.store(base + HEAD_DIM, lse.to(send_ptr.dtype.element_ty))
        else:
            bits = lse.to(tl.uint32, bitcast=True)
            tl.store(base + HEAD_DIM, (bits & 0xFFFF).to(tl.uint16).to(send_ptr.dtype.element_ty, bitcast=True))
            tl.store(base + HEAD_DIM + 1, (bits >> 16).to(tl.uint16).to(send_ptr.dtype.element_ty, bitcast=True))


@attrs.frozen(kw_only=True)
class DCPA2APackSendKey(warmreg.CompileKey):
    """What changes the binary: the dtypes, ``N``, ``D``, the mask and the request arange (no size or stride)."""

    out_dtype: str
    lse_dtype: str
    index_dtype: str | None
    world_size: int
    head_dim: int
    has_mask: bool
    num_seqs_pow2: int
    num_warps: int


def lse_pack_dim(dtype: torch.dtype) -> int:
    """vLLM's ``_dcp_a2a_lse_pack_dim``: the fp32 lse's width in ``dtype`` (2 for 16-bit dtypes, 1 for 32-bit).

    :raises ValueError: for another width.
    """
    bits = torch.finfo(dtype).bits
    if bits not in (16, 32):
        raise ValueError(f"cannot pack an fp32 lse into {dtype}")
    return 2 if bits == 16 else 1


class DCPA2APackSend(warmreg.TritonKernel[DCPA2APackSendKey]):
    """A DCP rank's partial output and lse packed per destination rank (the module docstring has the math).

    :param dtype: the combined output's dtype (the model's; domains only).
    :param world_size: the DCP group size (domains only).
    :param head_dims: ``D`` of each combine this deployment runs, with the most decode requests it may carry:
        ``{L: up to 7 tokens' requests, V: max_num_seqs}`` (domains only).
    :param heads: heads per rank ``P`` (domains only; not in the key).
    """

    name = "kimi_k3.dcp_a2a_pack_send"
    key_type = DCPA2APackSendKey
    jit = _dcp_a2a_pack_send_kernel

    def __init__(self, *, dtype: str, world_size: int, head_dims: Mapping[int, int], heads: int = 16) -> None:
        self.dtype, self.world_size, self.heads = dtype, world_size, heads
        self.head_dims = dict(head_dims)

    def dispatch(
        self, *, cp_attn_out: torch.Tensor, cp_attn_lse: torch.Tensor, world_size: int, seq_lens: torch.Tensor | None
    ) -> DCPA2APackSendKey:
        num_seqs = 0 if seq_lens is None else seq_lens.shape[0]
        return DCPA2APackSendKey(
            out_dtype=warmreg.dtype_name(cp_attn_out.dtype), lse_dtype=warmreg.dtype_name(cp_attn_lse.dtype),
            index_dtype=None if seq_lens is None else warmreg.dtype_name(seq_lens.dtype), world_size=world_size,
            head_dim=cp_attn_out.shape[-1], has_mask=seq_lens is not None,
            num_seqs_pow2=warmreg.next_pow2(max(num_seqs, 1)), num_warps=4,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Iterable[Mapping[str, Any]]:
        n, h, dtype = self.world_size, self.heads, getattr(torch, self.dtype)
        for d, most in sorted(self.head_dims.items()):
            for pow2 in sorted({warmreg.next_pow2(max(s, 1)) for s in range(most + 1)}):
                yield {
                    "cp_attn_out": warmreg.meta((8, n * h, d), dtype), "cp_attn_lse": warmreg.meta((8, n * h), torch.float32),
                    "world_size": n, "seq_lens": warmreg.meta((pow2,), torch.int32),
                    "query_start_loc": warmreg.meta((pow2 + 1,), torch.int32),
                }  # fmt: skip

    def warmup_inputs(self, key: DCPA2APackSendKey) -> Mapping[str, Any]:
        index = getattr(torch, key.index_dtype) if key.index_dtype else None
        s = key.num_seqs_pow2
        return {
            "cp_attn_out": warmreg.meta((1, key.world_size, key.head_dim), getattr(torch, key.out_dtype)),
            "cp_attn_lse": warmreg.meta((1, key.world_size), getattr(torch, key.lse_dtype)),
            "world_size": key.world_size,
            "seq_lens": None if index is None else warmreg.meta((s,), index),
            "query_start_loc": None if index is None else warmreg.meta((s + 1,), index),
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        cp_attn_out: torch.Tensor,
        cp_attn_lse: torch.Tensor,
        world_size: int,
        seq_lens: torch.Tensor | None = None,
        query_start_loc: torch.Tensor | None = None,
        *,
        out: torch.Tensor | None = None,
    ) -> warmreg.LaunchSpec[DCPA2APackSendKey]:
        """Pack and return the send buffer ``[N, B, H/N, D + pack]`` (``out``, or a fresh tensor): vLLM's
        ``_dcp_a2a_pack_send(cp_attn_out, cp_attn_lse, send_buffer, N, H/N, D, pack, seq_lens, query_start_loc)``,
        whose ``H/N``, ``D`` and ``pack`` follow from the shapes and dtype.

        :param cp_attn_out: ``[B, H, D]`` float, ``D`` a power of two and contiguous, ``H`` a multiple of ``N``.
        :param cp_attn_lse: ``[B, H]`` float, any strides.
        :param world_size: the DCP group size ``N``.
        :param seq_lens: ``[S]`` int local KV lengths (with ``query_start_loc``: the empty-shard mask).
        :param query_start_loc: ``[S + 1]`` int query-token offsets, of ``seq_lens``' dtype.
        :param out: a preallocated contiguous send buffer of ``cp_attn_out``'s dtype.
        :raises warmreg.LaunchError: for shapes, dtypes or layouts the kernel cannot take, a mask given half, or a
            wrong ``out``.
        """
        self._check(cp_attn_out, cp_attn_lse, world_size, seq_lens, query_start_loc)
        key = self.dispatch(cp_attn_out=cp_attn_out, cp_attn_lse=cp_attn_lse, world_size=world_size, seq_lens=seq_lens)
        b, h, d = cp_attn_out.shape
        p, pack = h // world_size, lse_pack_dim(cp_attn_out.dtype)
        send = warmreg.output(
            self.name, "out", out, (world_size, b, p, d + pack), cp_attn_out.dtype, cp_attn_out.device
        )
        kwargs = dict(
            out_ptr=cp_attn_out, lse_ptr=cp_attn_lse, send_ptr=send, seq_lens_ptr=seq_lens,
            query_start_loc_ptr=query_start_loc, num_seqs=0 if seq_lens is None else seq_lens.shape[0], h_per_rank=p,
            out_stride_b=cp_attn_out.stride(0), out_stride_h=cp_attn_out.stride(1), lse_stride_b=cp_attn_lse.stride(0),
            lse_stride_h=cp_attn_lse.stride(1), send_stride_n=send.stride(0), send_stride_b=send.stride(1),
            send_stride_h=send.stride(2), N=world_size, HEAD_DIM=d, LSE_PACK_DIM=pack, HAS_MASK=key.has_mask,
            NUM_SEQS_POW2=key.num_seqs_pow2,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (b, p) if b and p else None, kwargs, send)

    def _check(
        self, out: torch.Tensor, lse: torch.Tensor, n: int, seq_lens: torch.Tensor | None, qsl: torch.Tensor | None
    ) -> None:
        d = out.shape[-1] if out.ndim else 0
        if (
            out.ndim != 3
            or out.dtype not in (torch.float16, torch.bfloat16, torch.float32)
            or d != warmreg.next_pow2(d)
        ):
            raise warmreg.LaunchError(
                self.name, f"cp_attn_out must be a float16/bfloat16/float32 [B, H, D] with D a power of two "
                f"(got {out.dtype} {tuple(out.shape)})",
            )  # fmt: skip
        if out.stride(2) != 1:
            raise warmreg.LaunchError(self.name, f"cp_attn_out must have unit stride over D (strides {out.stride()})")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1 or out.shape[1] % n:
            raise warmreg.LaunchError(
                self.name, f"world_size ({n!r}) must be a positive int dividing H = {out.shape[1]}"
            )
        if lse.ndim != 2 or lse.shape != out.shape[:2] or not lse.dtype.is_floating_point:
            raise warmreg.LaunchError(
                self.name,
                f"cp_attn_lse must be a float [B, H] = {tuple(out.shape[:2])} (got {lse.dtype} {tuple(lse.shape)})",
            )
        if (seq_lens is None) != (qsl is None):
            raise warmreg.LaunchError(self.name, "seq_lens and query_start_loc must be given together (the mask)")
        if seq_lens is not None and qsl is not None and (
            seq_lens.ndim != 1 or qsl.shape != (seq_lens.shape[0] + 1,) or seq_lens.dtype != qsl.dtype
            or seq_lens.dtype not in (torch.int32, torch.int64)
        ):  # fmt: skip
            raise warmreg.LaunchError(
                self.name, f"seq_lens must be an int [S] and query_start_loc an [S + 1] of its dtype (got {seq_lens.dtype} "
                f"{tuple(seq_lens.shape)} and {qsl.dtype} {tuple(qsl.shape)})",
            )  # fmt: skip
        devices = {t.device for t in (out, lse, seq_lens, qsl) if t is not None}
        if len(devices) > 1:
            raise warmreg.LaunchError(self.name, f"inputs on {sorted(map(str, devices))}: use one device")


def dcp_a2a_pack_send_reference(
    cp_attn_out: torch.Tensor,
    cp_attn_lse: torch.Tensor,
    world_size: int,
    seq_lens: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
) -> torch.Tensor:
    """PyTorch reference of :class:`DCPA2APackSend`: the send buffer ``[N, B, H/N, D + pack]``."""
    b, h, d = cp_attn_out.shape
    p, pack = h // world_size, lse_pack_dim(cp_attn_out.dtype)
    lse = cp_attn_lse.float()
    if seq_lens is not None and query_start_loc is not None:
        rows = torch.arange(b, device=lse.device)
        if seq_lens.shape[0]:
            seq = (query_start_loc[1:, None] <= rows).sum(0).clamp_max(seq_lens.shape[0] - 1)
            empty = (rows >= query_start_loc[-1]) | (seq_lens[seq] == 0)
        else:
            empty = torch.ones(b, dtype=torch.bool, device=lse.device)
        lse = lse.masked_fill(empty[:, None], -float("inf"))
    send = torch.empty(world_size, b, p, d + pack, dtype=cp_attn_out.dtype, device=cp_attn_out.device)
    send[..., :d] = cp_attn_out.view(b, world_size, p, d).transpose(0, 1)
    words = lse.view(b, world_size, p).transpose(0, 1)
    if pack == 1:
        send[..., d] = words.to(send.dtype)
    else:
        send[..., d:].view(torch.int32).copy_(words.contiguous().view(torch.int32)[..., None])
    return send


def dcp_comm_backend(config: warmreg.WarmConfig) -> str:
    """``serving.dcp_comm_backend``: ``ag_rs`` (vLLM's default for Kimi-K3) or ``a2a``.

    :raises warmreg.ConfigError: for another name.
    """
    backend = config.get("serving.dcp_comm_backend", str, plugin=PLUGIN, default="ag_rs")
    if backend not in ("ag_rs", "a2a"):
        raise warmreg.ConfigError(
            "serving.dcp_comm_backend", f"is {backend!r}, which vLLM 0.34 does not know", plugin=PLUGIN,
            fix="use ag_rs (all-gather + reduce-scatter) or a2a (all-to-all)",
        )  # fmt: skip
    return backend


@attrs.frozen(kw_only=True)
class A2APlan:
    """What the Triton all-to-all combine of a deployment launches (``None`` from :func:`a2a_plan` where it does not).

    :param world_size: the DCP group size.
    :param heads: heads per rank (``num_attention_heads / TP``).
    :param head_dims: each combined head dim, with the most decode requests a step of it carries.
    """

    world_size: int
    heads: int
    head_dims: Mapping[int, int] = attrs.field(converter=lambda m: dict(sorted(m.items())))


def a2a_plan(m: KimiK3, config: warmreg.WarmConfig) -> A2APlan | None:
    """The Triton all-to-all combine when vLLM runs it: DCP > 1, ``dcp_comm_backend`` ``a2a`` and no direct
    workspace (``serving.direct_dcp_a2a``, vLLM's ``VLLM_USE_DIRECT_DCP_A2A``, default on for bf16 / fp16 as
    ``direct_cp_enabled`` on one CUDA node; a float32 model never has one).

    :raises warmreg.ConfigError: for an unknown backend, heads the group does not divide, a direct workspace asked
        for a float32 model (vLLM's ``DirectDCPA2AWorkspace`` refuses it), or a missing model field.
    """
    n = decode_context_parallel_size(config)
    if n <= 1 or dcp_comm_backend(config) != "a2a":
        return None
    sixteen = m.dtype in ("bfloat16", "float16")
    direct = config.get("serving.direct_dcp_a2a", bool, plugin=PLUGIN, default=sixteen)
    if direct and not sixteen:
        raise warmreg.ConfigError(
            "serving.direct_dcp_a2a", f"is true for a {m.dtype} model: vLLM's direct DCP all-to-all takes bf16 / fp16 "
            "only", plugin=PLUGIN, fix="set serving.direct_dcp_a2a to false (VLLM_USE_DIRECT_DCP_A2A=0)",
        )  # fmt: skip
    if direct:
        return None
    heads = positive_text_int(config, "num_attention_heads") // tensor_parallel_size(config)
    seqs = config.get("serving.max_num_seqs", int, plugin=PLUGIN)
    per_seq = 1 + config.get("serving.num_speculative_tokens", int, plugin=PLUGIN, default=0)
    tokens = min(config.get("serving.max_num_batched_tokens", int, plugin=PLUGIN), seqs * per_seq)
    first = V_UP_PROJ_FIRST_MIN_TOKENS
    dims = {positive_text_int(config, "kv_lora_rank"): min(first - 1, tokens, seqs)}
    if tokens >= first:  # dcp_a2a_v_up_proj_lse_reduce: up-projected first
        v = positive_text_int(config, "v_head_dim")
        dims[v] = max(dims.get(v, 0), min(tokens, seqs))
    return A2APlan(world_size=n, heads=max(heads, 1), head_dims=dims)


def register(registry: warmreg.Registry, m: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the pack on CUDA where :func:`a2a_plan` finds the Triton all-to-all combine (every MLA layer's decode:
    ``nvidia/mla.py`` -> ``MLADCPManager.v_up_proj_combine`` -> ``dcp_a2a_v_up_proj_lse_reduce``).

    :raises warmreg.ConfigError: as :func:`a2a_plan`.
    """
    plan = a2a_plan(m, config)
    if plan is not None:
        kernel = DCPA2APackSend(dtype=m.dtype, world_size=plan.world_size, head_dims=plan.head_dims, heads=plan.heads)
        registry.add(kernel, when=warmreg.is_cuda)
