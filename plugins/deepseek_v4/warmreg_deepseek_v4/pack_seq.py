"""Pack ragged rows into a padded batch (vLLM 0.33 ``v1/attention/ops/common.py``: ``pack_seq_triton``, the
``PackSeqTritonKernel`` that ``SparseAttnIndexer`` registers), on the decode path of the C4 indexer.

The decode part of the indexer (``sparse_attn_indexer`` on CUDA / XPU, ``rocm_aiter_sparse_attn_indexer`` on
ROCm with the FP8 indexer) takes its padded path when the native decode kernel serves a batch whose decode
lengths differ (``decode_metadata.requires_padding``, or ``num_decode_tokens % num_decode_rows != 0``): with MTP
(``next_n = 1 + num_speculative_tokens``) the decode split mixes ``next_n``-token spec requests with shorter
ones. It packs the FP8 indexer Q ``q_fp8[:Td]`` (``[Td, index_n_heads, index_head_dim]`` seen as
``[Td, H * D]``) into ``[B, Lmax, H * D]``; :mod:`~warmreg_deepseek_v4.unpack_seq` undoes it on the top-k.

Grid ``(B, cdiv(Lmax, BLOCK_T), cdiv(D, BLOCK_D))``, ``start_b = lengths[0] + ... + lengths[b - 1]`` (a serial
loop over the earlier lengths)::

    out[b, t, d] = PAD                  for t < Lmax, d < D
    out[b, t, d] = x[start_b + t, d]    for t < lengths[b]

``PAD`` is ``PAD_VALUE`` cast to the output dtype (as uint8 when ``PAD_IS_UINT8``). The FP8 pad is ``-inf``,
which e4m3fn cannot hold: what the cast writes is implementation-defined, and downstream the context lens mask
those slots. Rows of ``x`` past ``sum(lengths)`` are ignored. Addressing is row-major contiguous (no strides):
``(b * Lmax + t) * D`` stays below 2**31 for DeepSeek-V4 (``256 * 2 * 8192``).

Where it is registered (C4 layers present and ``num_speculative_tokens >= 1``: with 1-token decode rows every
batch is uniform): CUDA below SM100 (SM90 + DeepGEMM: the native ``next_n`` kernel), ROCm (FP8 indexer) and XPU.
SM10x decodes through DeepGEMM's varlen metadata (one row per token), which never pads. The FP4 variants
(``uint8`` values with pad 0, and ``int32`` scales with a float pad 0) pack an MXFP4 indexer cache, which
DeepSeek-V4 rejects off SM10x on CUDA and serves through ``rocm_mxfp4_sparse_attn_indexer`` on ROCm: dead code
for DeepSeek-V4, so they are not registered (the launcher still accepts ``uint8`` with ``pad_value=0``). With an
MXFP4 indexer cache (``serving.indexer_kv_dtype``) nothing is registered: SM10x never pads, and the ROCm MXFP4
indexer's metadata builder (``RocmMxfp4IndexerMetadataBuilder``) forces flattened one-token decode rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._serving import mxfp4_indexer
from .dspark import num_speculative_tokens
from .model import DSV4, PLUGIN

__all__ = [
    "FP8_PAD",
    "PackSeq",
    "PackSeqKey",
    "pack_seq_reference",
    "padded_decode",
    "padded_decode_platforms",
    "ragged_tile",
    "register",
]

#: The pad of the FP8 indexer Q (``SparseAttnIndexer``'s ``pad_value`` off the FP4 cache).
FP8_PAD = float("-inf")
TILE_T, TILE_D = 64, 64  # SparseAttnIndexer's BLOCK_T / BLOCK_D

#: The platforms whose C4 indexer decodes through the native ``next_n`` kernel and pads non-uniform batches:
#: CUDA below SM100 (SM90 + DeepGEMM), ROCm (FP8 indexer), XPU.
padded_decode_platforms = (warmreg.is_cuda & warmreg.sm_below(100)) | warmreg.is_rocm | warmreg.is_xpu


def padded_decode(model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> bool:
    """Whether the C4 indexer can pad a decode batch of unequal decode lengths: C4 layers present,
    ``serving.num_speculative_tokens >= 1`` (default 0: one-token decode rows are always uniform; with DSpark,
    ``dspark_block_size``: :func:`~.dspark.num_speculative_tokens`), and an FP8 indexer cache (an MXFP4 one
    decodes through DeepGEMM's varlen path on SM10x and through ``rocm_mxfp4_sparse_attn_indexer``, flattened,
    on ROCm: neither pads).

    :raises warmreg.ConfigError: for a ``serving.indexer_kv_dtype`` the platform cannot serve.
    """
    spec = model.has_c4 and num_speculative_tokens(config) >= 1
    return spec and not mxfp4_indexer(config, model, platform)


@triton.jit
def ragged_tile(lengths_ptr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's batch entry ``b``, row and column offsets, ``start_b`` and ``lengths[b]`` (pack and unpack)."""
    pid_b = tl.program_id(0)
    off_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    off_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    start = 0
    for i in range(pid_b):  # serial over the earlier lengths, as the engine's kernels
        start += tl.load(lengths_ptr + i)
    return pid_b, off_t, off_d, start, tl.load(lengths_ptr + pid_b)


@triton.jit(do_not_specialize=["N", "D", "Lmax"], do_not_specialize_on_alignment=["lengths_ptr"])
def _pack_seq_kernel(
    x_ptr,
    out_ptr,
    lengths_ptr,
    N,
    D,
    Lmax,
    PAD_VALUE: tl.constexpr,  # -inf (FP8 Q) or 0 (FP4 cache): the engine's per-indexer constant
    PAD_IS_UINT8: tl.constexpr,  # write the pad as uint8 (FP4 values) instead of an fp32 cast to out's dtype
    BLOCK_T: tl.constexpr,  # rows per program (64)
    BLOCK_D: tl.constexpr,  # columns per program (64)
):
    pid_b, off_t, off_d, in_start, seq_len = ragged_tile(lengths_ptr, BLOCK_T, BLOCK_D)
    t_mask = off_t < Lmax
    valid = (off_t < seq_len) & t_mask
    d_mask = off_d[None, :] < D
    out_ptrs = out_ptr + (pid_b * Lmax + off_t)[:, None] * D + off_d[None, :]
    if PAD_IS_UINT8:
        pad = tl.full([BLOCK_T, BLOCK_D], PAD_VALUE, tl.uint8)
    else:
        pad = tl.full([BLOCK_T, BLOCK_D], PAD_VALUE, tl.float32)
    tl.store(out_ptrs, pad.to(out_ptr.dtype.element_ty), mask=t_mask[:, None] & d_mask)
    x = tl.load(x_ptr + (in_start + off_t)[:, None] * D + off_d[None, :], mask=valid[:, None] & d_mask)
    tl.store(out_ptrs, x, mask=valid[:, None] & d_mask)


@attrs.frozen(kw_only=True)
class PackSeqKey(warmreg.CompileKey):
    """What changes the binary of the ragged pack: N, D and Lmax are not specialized."""

    dtype: str  # x and out (float8_e4m3fn; float8_e4m3fnuz on gfx942)
    pad_value: str  # repr of PAD_VALUE ("-inf")
    pad_is_uint8: bool
    block_t: int
    block_d: int
    x_aligned: bool  # x is loaded as tiles; a prefix of the Q buffer is aligned, an offset view is not
    num_warps: int
    num_stages: int


class PackSeq(warmreg.TritonKernel[PackSeqKey]):
    """Pack ``x [N, D]`` rows into ``[B, Lmax, D]`` by ``lengths`` (see the module docstring).

    :param width: ``D`` of the FP8 indexer Q, ``index_n_heads * index_head_dim`` (domains only).
    """

    name = "deepseek_v4.pack_seq"
    key_type = PackSeqKey
    jit = _pack_seq_kernel

    def __init__(self, *, width: int = 64 * 128) -> None:
        self.width = width

    def dispatch(self, *, x: torch.Tensor, pad_value: float) -> PackSeqKey:
        return PackSeqKey(
            dtype=warmreg.dtype_name(x.dtype),
            pad_value=repr(float(pad_value)),
            pad_is_uint8=x.dtype == torch.uint8,
            block_t=TILE_T,
            block_d=TILE_D,
            x_aligned=warmreg.is_aligned(x),
            num_warps=4,
            num_stages=2,
        )

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        fp8 = torch.float8_e4m3fnuz if platform.fp8_fnuz else torch.float8_e4m3fn
        tokens = [t for t in warmreg.token_counts(config, plugin=PLUGIN) if t]
        # q_fp8[:Td]: a prefix of the indexer Q RoPE + quant's fresh [T, H, D] output, seen as [Td, H * D]
        return {"x": [warmreg.meta((t, self.width), fp8) for t in tokens], "pad_value": [FP8_PAD]}

    def warmup_inputs(self, key: PackSeqKey) -> Mapping[str, Any]:
        return {
            "x": warmreg.meta((2, key.block_d), getattr(torch, key.dtype), offset=0 if key.x_aligned else 1),
            "lengths": warmreg.meta((1,), torch.int32),
            "lengths_host": [2],
            "pad_value": float(key.pad_value),
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        x: torch.Tensor,
        lengths: torch.Tensor,
        *,
        pad_value: float = FP8_PAD,
        lengths_host: list[int] | None = None,
        out: torch.Tensor | None = None,
    ) -> warmreg.LaunchSpec[PackSeqKey]:
        """Pack ``x`` by ``lengths``; returns ``[B, Lmax, *x.shape[1:]]`` of ``x``'s dtype (fresh, or ``out``).

        :param x: ``[N, ...]``, contiguous (trailing dims flattened into ``D``).
        :param lengths: int32 ``[B]`` rows per batch entry, contiguous, ``sum(lengths) <= N``.
        :param pad_value: the pad (``-inf`` for FP8; ``0`` for uint8).
        :param lengths_host: ``lengths`` as host ints if the caller has them (else read from the device:
            ``Lmax`` is a host value, as in the engine's wrapper).
        :param out: the output to write instead of a fresh one: exactly ``[B, Lmax, *x.shape[1:]]`` of ``x``'s
            dtype, contiguous, 16-byte aligned; every slot is written (pad included).
        :raises warmreg.LaunchError: for a non-contiguous ``x``, bad ``lengths``, a uint8 pad that is not an
            integer in ``[0, 255]``, or an ``out`` unlike the fresh output.
        """
        if x.ndim < 1 or not x.is_contiguous():
            raise warmreg.LaunchError(self.name, f"x must be a contiguous [N, ...] tensor (got {tuple(x.shape)})")
        if lengths.dtype != torch.int32 or lengths.ndim != 1 or (lengths.shape[0] > 1 and lengths.stride(0) != 1):
            raise warmreg.LaunchError(
                self.name, f"lengths must be a contiguous 1-D int32 tensor (got {lengths.dtype} {tuple(lengths.shape)})"
            )
        host = [int(n) for n in (lengths.tolist() if lengths_host is None else lengths_host)]
        if len(host) != lengths.shape[0] or min(host, default=0) < 0 or sum(host) > x.shape[0]:
            raise warmreg.LaunchError(
                self.name, f"lengths {host} must be {lengths.shape[0]} non-negative counts summing to <= N={x.shape[0]}"
            )
        if x.dtype == torch.uint8 and not (float(pad_value).is_integer() and 0 <= pad_value <= 255):
            raise warmreg.LaunchError(self.name, f"a uint8 pad must be an integer in [0, 255] (got {pad_value})")
        key = self.dispatch(x=x, pad_value=pad_value)
        b, lmax, d = len(host), max(host, default=0), x.shape[1:].numel()
        out = warmreg.output(self.name, "out", out, (b, lmax, *x.shape[1:]), x.dtype, x.device)
        kwargs = dict(
            x_ptr=x, out_ptr=out, lengths_ptr=lengths, N=x.shape[0], D=d, Lmax=lmax,
            PAD_VALUE=float(key.pad_value), PAD_IS_UINT8=key.pad_is_uint8, BLOCK_T=key.block_t, BLOCK_D=key.block_d,
        )  # fmt: skip
        grid = (b, (lmax + key.block_t - 1) // key.block_t, (d + key.block_d - 1) // key.block_d)
        return warmreg.LaunchSpec(key, grid if b and lmax and d else None, kwargs, out)


def pack_seq_reference(x: torch.Tensor, lengths: torch.Tensor, *, pad_value: float = FP8_PAD) -> torch.Tensor:
    """PyTorch reference of :class:`PackSeq`: ``[B, Lmax, ...]`` of x's dtype.

    The pad is filled in fp32 and cast to x's dtype (uint8: filled as is), as the kernel stores it; for ``-inf``
    into an FP8 dtype that cast is PyTorch's, and may differ from Triton's (the module docstring).
    """
    ns = [int(n) for n in lengths.tolist()]
    shape = (len(ns), max(ns, default=0), *x.shape[1:])
    if x.dtype.is_floating_point:
        out = torch.full(shape, pad_value, dtype=torch.float32, device=x.device).to(x.dtype)
    else:
        out = torch.full(shape, int(pad_value), dtype=x.dtype, device=x.device)
    start = 0
    for b, n in enumerate(ns):
        out[b, :n] = x[start : start + n]
        start += n
    return out


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the pack of the C4 indexer's padded decode on :data:`padded_decode_platforms` (see the module
    docstring), when :func:`padded_decode` holds. The FP4 variants are not registered (dead code for DeepSeek-V4)."""
    kernel = PackSeq(width=model.index_n_heads * model.index_head_dim)
    registry.add(kernel, when=padded_decode_platforms if padded_decode(model, config, platform) else False)
