"""DeepSeek-V4.1's engram FP8 staging: exchanged packed table rows split into the MXFP8 values and swizzled scales
the engram layers' WKV GEMM reads (vLLM 0.34 ``models/deepseek_v41/common/engram.py``: ``_engram_unpack_fp8_kernel``,
launched by ``EngramBatch._stage``).

A packed row is one head's table row as stored: ``D`` e4m3 bytes then ``D / 32`` UE8M0 scale bytes (``D + D / 32``
bytes). After the exchange a replica holds, per source rank, ``[token][layer][local head]`` rows: ``packed`` is
``[ranks * N, layers, local_heads, D + D / 32]`` uint8 (``N = num_tokens``, the DP group's slot), or, with peer
tables (``PEER``), a table of the ranks' row addresses (int64 ``[ranks]``, rank ``q``'s rows at ``[rank * N + token]``
of its own buffer). For every layer ``l``, token ``t < ceil128(N)`` and head ``h < H`` (``H = ranks * local_heads``;
``q = h // local_heads``, ``k = h % local_heads``)::

    source row = packed[q * N + t, l, k]                            (PEER: rank q's buffer, row [rank * N + t, l, k])
    values[l, t, h * D : (h + 1) * D] = its D value bytes           if t < N (rows past N untouched)
    scales[l] at F8_128x4(t, h * D / 32 + j) = its scale byte j     j < D / 32; 0 for t >= N (the 128-row tile's pad)

with F8_128x4 of ``(row, group)`` over ``G = H * D / 32`` groups: ``(row // 128 * ceil(G / 4) + group // 4) * 512 +
row % 32 * 16 + row % 128 // 32 * 4 + group % 4``. ``values`` is uint8 ``[layers, >= N, H * D]`` (row stride
``H * D``, any layer stride), ``scales`` uint8 ``[layers, >= scale bytes]`` (any layer stride). Grid
``(ceil128(N) * H / 16, layers)``, 16 rows (a token's head) a program, Triton's default four warps, as in vLLM.

Where it runs: V4.1 engram layers whose tables are sharded over an engram data-parallel group (``EngramBatch.create``:
DP > 1, TP 1, ``D % 128 == 0``, no LoRA, FlashInfer MXFP8 WKV), once a step before the decoder layers (``prepare_
embeddings``), after the all-to-all or, below ``ENGRAM_A2A_MIN_SLOT`` tokens with CPU-offloaded tables, the peer
exchange (``PEER``). Warmreg has no data-parallel setting, so :func:`register` plans nothing; a deployment that runs
it registers :class:`EngramUnpackFp8` itself.

Key: ``D``, the tile, ``PEER`` and the warps. vLLM's head, layer and rank counts are constexprs; here they are runtime
integers, like the token count and the strides: one binary serves every layer count, split and rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._v41_mxfp8 import mxfp8_scale_bytes, mxfp8_scale_offset
from .model import DSV4

__all__ = ["EngramUnpackFp8", "EngramUnpackFp8Key", "engram_unpack_fp8_reference", "register"]

_BLOCK = 16
_NUM_WARPS = 4
_INTS = ["num_tokens", "values_stride", "scales_stride", "heads", "local_heads", "layers", "rank"]


@triton.jit(do_not_specialize=_INTS)
def _engram_unpack_fp8_kernel(
    packed_ptr,  # uint8 rows, or int64 [ranks] row addresses (PEER)
    values_ptr,  # uint8 [layers, >= N, H * D]
    scales_ptr,  # uint8 [layers, scale bytes]
    num_tokens,
    values_stride,
    scales_stride,
    heads,
    local_heads,
    layers,
    rank,
    DIM: tl.constexpr,  # values a head row
    BLOCK: tl.constexpr,  # rows (token, head) a program
    PEER: tl.constexpr,  # packed holds the ranks' row addresses
):
    row = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    layer = tl.program_id(1).to(tl.int64)
    token, head = row // heads, row % heads
    q, k = head // local_heads, head % local_heads
    if PEER:
        base = tl.load(packed_ptr + q).to(tl.pointer_type(tl.uint8))
        source = rank * num_tokens + token
    else:
        base = packed_ptr
        source = q * num_tokens + token
    width: tl.constexpr = DIM + DIM // 32
    src = base + ((source * layers + layer) * local_heads + k) * width
    live = token < num_tokens
    d = tl.arange(0, DIM)
    data = tl.load(src[:, None] + d[None, :], mask=live[:, None], other=0)
    tl.store(values_ptr + layer * values_stride + row[:, None] * DIM + d[None, :], data, mask=live[:, None])
    j = tl.arange(0, DIM // 32)
    scale = tl.load(src[:, None] + DIM + j[None, :], mask=live[:, None], other=0)
    groups = heads * (DIM // 32)
    group = head[:, None] * (DIM // 32) + j[None, :]
    t = token[:, None]
    at = (t // 128 * tl.cdiv(groups, 4) + group // 4) * 512 + t % 32 * 16 + t % 128 // 32 * 4 + group % 4
    tl.store(scales_ptr + layer * scales_stride + at, scale)


@attrs.frozen(kw_only=True)
class EngramUnpackFp8Key(warmreg.CompileKey):
    """What changes the binary of the FP8 staging: the head dim, the tile, the peer tables and the warps."""

    dim: int
    block: int
    peer: bool
    num_warps: int


class EngramUnpackFp8(warmreg.TritonKernel[EngramUnpackFp8Key]):
    """Split exchanged packed engram rows into MXFP8 values and F8_128x4 scales (the module docstring has the math).

    :param dim: the table's head dim ``D`` (domains only).
    """

    name = "deepseek_v4.v41_engram_unpack_fp8"
    key_type = EngramUnpackFp8Key
    jit = _engram_unpack_fp8_kernel

    def __init__(self, *, dim: int = 256) -> None:
        self.dim = dim

    def dispatch(self, *, values: torch.Tensor, heads: int, peer: bool) -> EngramUnpackFp8Key:
        return EngramUnpackFp8Key(dim=values.shape[2] // heads, block=_BLOCK, peer=bool(peer), num_warps=_NUM_WARPS)

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        return {"values": [warmreg.meta((1, 1, self.dim), torch.uint8)], "heads": [1], "peer": [False, True]}

    def warmup_inputs(self, key: EngramUnpackFp8Key) -> Mapping[str, Any]:
        rows = key.dim + key.dim // 32
        return {
            "packed": warmreg.meta((1,), torch.int64) if key.peer else warmreg.meta((1, 1, 1, rows), torch.uint8),
            "values": warmreg.meta((1, 1, key.dim), torch.uint8),
            "scales": warmreg.meta((1, mxfp8_scale_bytes(1, key.dim)), torch.uint8),
            "num_tokens": 1,
            "heads": 1,
            "local_heads": 1,
            "rank": 0,
            "peer": key.peer,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        packed: torch.Tensor,
        values: torch.Tensor,
        scales: torch.Tensor,
        *,
        num_tokens: int,
        heads: int,
        local_heads: int,
        rank: int = 0,
        peer: bool = False,
    ) -> warmreg.LaunchSpec[EngramUnpackFp8Key]:
        """Stage ``num_tokens`` tokens of every layer into ``values`` and ``scales`` (the caller's persistent
        buffers, written in place); returns ``(values, scales)``.

        :param packed: uint8 ``[ranks * N, layers, local_heads, D + D / 32]`` contiguous rows, or with ``peer`` the
            int64 ``[ranks]`` addresses of the ranks' row buffers (each of that layout, ``rank``'s rows read).
        :param values: uint8 ``[layers, >= N, heads * D]`` with contiguous rows of layers.
        :param scales: uint8 ``[layers, >= mxfp8_scale_bytes(N, heads * D)]`` with unit column stride.
        :param num_tokens: ``N``, the tokens a rank exchanged (the DP group's slot).
        :param heads: ``H``, the hash columns (every rank's heads).
        :param local_heads: heads a rank's row holds (``heads`` a multiple of it).
        :param rank: this replica's rank (read with ``peer`` only).
        :param peer: whether ``packed`` holds peer row addresses.
        :raises warmreg.LaunchError: naming the argument of another dtype, rank or layout, or too small.
        """
        _check(self.name, packed, values, scales, num_tokens, heads, local_heads, peer)
        key = self.dispatch(values=values, heads=heads, peer=peer)
        kwargs = dict(
            packed_ptr=packed, values_ptr=values, scales_ptr=scales, num_tokens=num_tokens,
            values_stride=values.stride(0), scales_stride=scales.stride(0), heads=heads, local_heads=local_heads,
            layers=values.shape[0], rank=rank, DIM=key.dim, BLOCK=key.block, PEER=key.peer,
        )  # fmt: skip
        rows = -(-num_tokens // 128) * 128 * heads
        grid = (triton.cdiv(rows, key.block), values.shape[0]) if rows and values.shape[0] else None
        return warmreg.LaunchSpec(key, grid, kwargs, (values, scales))


def _check(
    name: str, packed: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, tokens: int, heads: int,
    local_heads: int, peer: bool,
) -> None:  # fmt: skip
    """Raise :class:`warmreg.LaunchError` naming the argument the kernel cannot read as ``EngramBatch`` passes it."""
    if heads < 1 or local_heads < 1 or heads % local_heads or tokens < 0:
        raise warmreg.LaunchError(
            name, f"need heads ({heads}) a multiple of local_heads ({local_heads}) >= 1 and num_tokens ({tokens}) >= 0"
        )
    dim = values.shape[2] // heads if values.ndim == 3 else 0
    if (
        values.dtype != torch.uint8 or values.ndim != 3 or values.shape[2] != dim * heads or dim < 32 or dim & (dim - 1)
        or values.shape[1] < tokens or values.stride(2) != 1 or values.stride(1) != values.shape[2]
    ):  # fmt: skip
        raise warmreg.LaunchError(
            name,
            f"values must be uint8 [layers, >= {tokens}, heads * D] with contiguous rows, D a power of two >= 32 "
            f"(got {values.dtype} {tuple(values.shape)}, stride {values.stride()})",
        )
    need = mxfp8_scale_bytes(tokens, heads * dim)
    if scales.dtype != torch.uint8 or scales.ndim != 2 or scales.shape[0] != values.shape[0] or scales.shape[1] < need:
        raise warmreg.LaunchError(
            name, f"scales must be uint8 [{values.shape[0]}, >= {need}] (got {scales.dtype} {tuple(scales.shape)})"
        )
    if scales.shape[1] > 1 and scales.stride(1) != 1:
        raise warmreg.LaunchError(name, "scales must have a unit column stride")
    ranks = heads // local_heads
    row = (values.shape[0], local_heads, dim + dim // 32)
    if peer:
        if packed.dtype != torch.int64 or packed.shape != (ranks,):
            raise warmreg.LaunchError(
                name, f"packed must be int64 [{ranks}] peer addresses (got {tuple(packed.shape)})"
            )
    elif (
        packed.dtype != torch.uint8 or not packed.is_contiguous() or packed.shape[1:] != row
        or packed.shape[0] < ranks * tokens
    ):  # fmt: skip
        raise warmreg.LaunchError(
            name,
            f"packed must be contiguous uint8 [>= {ranks * tokens}, {', '.join(map(str, row))}] (got {packed.dtype} "
            f"{tuple(packed.shape)})",
        )


def engram_unpack_fp8_reference(
    packed: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, *, num_tokens: int, heads: int,
    local_heads: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """PyTorch reference of :class:`EngramUnpackFp8` without peer tables: staged copies of ``values`` and ``scales``."""
    values, scales = values.clone(), scales.clone()
    layers, n, dim = values.shape[0], num_tokens, values.shape[2] // heads
    ranks, tile = heads // local_heads, -(-num_tokens // 128) * 128
    rows = packed[: ranks * n].reshape(ranks, n, layers, local_heads, dim + dim // 32)
    rows = rows.permute(2, 1, 0, 3, 4).reshape(layers, n, heads, dim + dim // 32)  # [layer, token, head, bytes]
    values[:, :n] = rows[..., :dim].reshape(layers, n, heads * dim)
    groups = heads * (dim // 32)
    t = torch.arange(tile)[:, None]
    at = mxfp8_scale_offset(t, torch.arange(groups)[None, :], groups)
    padded = torch.zeros(layers, tile, groups, dtype=torch.uint8)
    padded[:, :n] = rows[..., dim:].reshape(layers, n, groups)
    for layer in range(layers):
        scales[layer, at.reshape(-1)] = padded[layer].reshape(-1)
    return values, scales


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register nothing: vLLM stages FP8 engram rows only under an engram data-parallel group (module docstring),
    which no warmreg setting expresses; a deployment that runs one registers :class:`EngramUnpackFp8` itself."""
