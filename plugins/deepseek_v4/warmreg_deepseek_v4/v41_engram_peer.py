"""DeepSeek-V4.1's engram peer lookup: this rank's table heads looked up for every peer's tokens into packed rows
(vLLM 0.34 ``models/deepseek_v41/nvidia/ops/engram_peer.py``: ``_peer_lookup_kernel``, launched by
``EngramPeerExchange.exchange``).

Under an engram data-parallel group of ``P`` ranks whose buffers are symmetric memory, each rank publishes its
tokens' hash ids (int32 ``[N, layers, H]`` per rank, ``N`` the group's slot, -1 past its tokens) and looks up, for
every peer's tokens, the ``h = H / P`` heads it owns (``rank * h .. (rank + 1) * h``) in its own table shard. For
output row ``o < P * N * layers * h``, with ``token = o // (layers * h)`` (peer ``p = token // N``, its token ``t =
token % N``), ``l = o // h % layers`` and ``k = o % h``::

    i = ids_p[t, l, rank * h + k]                                   (ids_p at the address id_ptrs[p])
    out row o = weight_l[i - start_l] (D bytes), scales_l[i - start_l] (D / 32 bytes)   if start_l <= i < end_l
    out row o = D + D / 32 zero bytes                                                   otherwise

with layer ``l``'s table from ``metadata[l] = (weight address, scales address, start_l, end_l)`` (int64 ``[layers,
4]``; the weights e4m3 rows of ``D`` bytes, the scales UE8M0 rows of ``D / 32``). ``out`` is uint8 ``[P * N, layers,
h, D + D / 32]`` rows (contiguous; the rows the peers' FP8 staging, :mod:`.v41_engram_unpack` with peer tables,
reads). Grid ``(cdiv(P * N * layers * h, 16),)``, 16 rows a program, Triton's default four warps, as in vLLM.

Where it runs: V4.1 engram layers with an engram DP group of 2, 4 or 8 fully connected SM100-family ranks whose
hash columns divide by it, CPU-offloaded tables and FP8 staging (``EngramBatch``), at steps whose slot is below
``ENGRAM_A2A_MIN_SLOT``. Warmreg has no data-parallel setting, so :func:`register` plans nothing; a deployment that
runs it registers :class:`EngramPeerLookup` itself.

Key: ``D``, the tile and the warps. vLLM's head, layer, group-size and rank counts are constexprs; here they are
runtime integers like the slot: one binary serves every group.
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

__all__ = ["EngramPeerLookup", "EngramPeerLookupKey", "engram_peer_lookup_reference", "register"]

_BLOCK = 16
_NUM_WARPS = 4
_INTS = ["num_tokens", "heads", "layers", "group", "rank"]


@triton.jit(do_not_specialize=_INTS)
def _engram_peer_lookup_kernel(
    metadata_ptr,  # int64 [layers, 4]: weight address, scales address, vocab start, vocab end
    id_ptrs_ptr,  # int64 [P]: each rank's int32 [N, layers, H] hash ids
    out_ptr,  # uint8 [P * N, layers, h, D + D / 32]
    num_tokens,
    heads,
    layers,
    group,
    rank,
    DIM: tl.constexpr,  # bytes of a table row's values
    BLOCK: tl.constexpr,  # output rows a program
):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    local_heads = heads // group
    live = o < num_tokens * group * layers * local_heads
    token = o // (layers * local_heads)
    layer = o // local_heads % layers
    k = o % local_heads
    ids = tl.load(id_ptrs_ptr + token // num_tokens, mask=live, other=0).to(tl.pointer_type(tl.int32))
    at = (token % num_tokens * layers + layer) * heads + rank * local_heads + k
    index = tl.load(ids + at, mask=live, other=-1).to(tl.int64)
    table = metadata_ptr + layer * 4
    start = tl.load(table + 2, mask=live, other=0)
    end = tl.load(table + 3, mask=live, other=0)
    owned = live & (index >= start) & (index < end)
    row = tl.where(owned, index - start, 0)
    weight = tl.load(table, mask=live, other=0).to(tl.pointer_type(tl.uint8))
    scales = tl.load(table + 1, mask=live, other=0).to(tl.pointer_type(tl.uint8))
    d = tl.arange(0, DIM)
    j = tl.arange(0, DIM // 32)
    dst = out_ptr + o[:, None] * (DIM + DIM // 32)
    values = tl.load(weight[:, None] + row[:, None] * DIM + d[None, :], mask=owned[:, None], other=0)
    tl.store(dst + d[None, :], values, mask=live[:, None])
    scale = tl.load(scales[:, None] + row[:, None] * (DIM // 32) + j[None, :], mask=owned[:, None], other=0)
    tl.store(dst + DIM + j[None, :], scale, mask=live[:, None])


@attrs.frozen(kw_only=True)
class EngramPeerLookupKey(warmreg.CompileKey):
    """What changes the binary of the peer lookup: the head dim, the tile and the warps."""

    dim: int
    block: int
    num_warps: int


class EngramPeerLookup(warmreg.TritonKernel[EngramPeerLookupKey]):
    """This rank's heads of every peer's tokens into packed rows (the module docstring has the math).

    :param dim: the table's head dim ``D`` (domains only).
    """

    name = "deepseek_v4.v41_engram_peer_lookup"
    key_type = EngramPeerLookupKey
    jit = _engram_peer_lookup_kernel

    def __init__(self, *, dim: int = 256) -> None:
        self.dim = dim

    def dispatch(self, *, out: torch.Tensor) -> EngramPeerLookupKey:
        return EngramPeerLookupKey(dim=out.shape[3] * 32 // 33, block=_BLOCK, num_warps=_NUM_WARPS)

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        return {"out": [warmreg.meta((2, 1, 1, self.dim + self.dim // 32), torch.uint8)]}

    def warmup_inputs(self, key: EngramPeerLookupKey) -> Mapping[str, Any]:
        return {
            "metadata": warmreg.meta((1, 4), torch.int64),
            "id_ptrs": warmreg.meta((2,), torch.int64),
            "out": warmreg.meta((2, 1, 1, key.dim + key.dim // 32), torch.uint8),
            "num_tokens": 1,
            "heads": 2,
            "rank": 0,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        metadata: torch.Tensor,
        id_ptrs: torch.Tensor,
        out: torch.Tensor,
        *,
        num_tokens: int,
        heads: int,
        rank: int,
    ) -> warmreg.LaunchSpec[EngramPeerLookupKey]:
        """Look up ``num_tokens`` tokens of every peer into ``out``'s first ``P * num_tokens`` rows (the caller's
        symmetric buffer, written in place); returns ``out``.

        :param metadata: int64 ``[layers, 4]``, contiguous: each layer's weight and scales addresses and vocab range.
        :param id_ptrs: int64 ``[P]``: the addresses of the ranks' int32 ``[>= num_tokens, layers, heads]`` ids.
        :param out: uint8 ``[>= P * num_tokens, layers, heads / P, D + D / 32]``, contiguous, ``D`` a power of two.
        :param num_tokens: ``N``, the group's slot.
        :param heads: ``H``, the hash columns (a multiple of ``P``).
        :param rank: this rank in the group.
        :raises warmreg.LaunchError: naming the argument of another dtype, rank or layout.
        """
        _check(self.name, metadata, id_ptrs, out, num_tokens, heads, rank)
        key = self.dispatch(out=out)
        group, layers = id_ptrs.shape[0], metadata.shape[0]
        kwargs = dict(
            metadata_ptr=metadata, id_ptrs_ptr=id_ptrs, out_ptr=out, num_tokens=num_tokens, heads=heads,
            layers=layers, group=group, rank=rank, DIM=key.dim, BLOCK=key.block,
        )  # fmt: skip
        rows = group * num_tokens * layers * (heads // group)
        return warmreg.LaunchSpec(key, (triton.cdiv(rows, key.block),) if rows else None, kwargs, out)


def _check(
    name: str, metadata: torch.Tensor, id_ptrs: torch.Tensor, out: torch.Tensor, tokens: int, heads: int, rank: int
) -> None:  # fmt: skip
    """Raise :class:`warmreg.LaunchError` naming the argument the kernel cannot read as ``exchange`` passes it."""
    if metadata.dtype != torch.int64 or metadata.ndim != 2 or metadata.shape[1] != 4 or not metadata.is_contiguous():
        raise warmreg.LaunchError(name, f"metadata must be contiguous int64 [layers, 4] (got {tuple(metadata.shape)})")
    if id_ptrs.dtype != torch.int64 or id_ptrs.ndim != 1 or not id_ptrs.is_contiguous() or id_ptrs.shape[0] < 1:
        raise warmreg.LaunchError(name, f"id_ptrs must be contiguous int64 [P >= 1] (got {tuple(id_ptrs.shape)})")
    group = id_ptrs.shape[0]
    if heads % group or not 0 <= rank < group or tokens < 0:
        raise warmreg.LaunchError(
            name, f"need heads ({heads}) a multiple of the group's {group} ranks, 0 <= rank ({rank}) < {group}, "
            f"num_tokens ({tokens}) >= 0",
        )  # fmt: skip
    dim = out.shape[3] * 32 // 33 if out.ndim == 4 else 0
    if (
        out.dtype != torch.uint8 or out.ndim != 4 or not out.is_contiguous() or dim < 32 or dim & (dim - 1)
        or out.shape[3] != dim + dim // 32 or out.shape[0] < group * tokens
        or out.shape[1:3] != (metadata.shape[0], heads // group)
    ):  # fmt: skip
        raise warmreg.LaunchError(
            name,
            f"out must be contiguous uint8 [>= {group * tokens}, {metadata.shape[0]}, {heads // group}, D + D / 32] "
            f"with D a power of two >= 32 (got {out.dtype} {tuple(out.shape)})",
        )


def engram_peer_lookup_reference(
    ids: list[torch.Tensor], tables: list[tuple[torch.Tensor, torch.Tensor, int, int]], out: torch.Tensor, *,
    num_tokens: int, rank: int,
) -> torch.Tensor:  # fmt: skip
    """PyTorch reference of :class:`EngramPeerLookup` on the tensors behind the addresses: each rank's ids, each
    layer's ``(weight, scales, start, end)``; a copy of ``out`` with its first ``P * num_tokens`` rows looked up."""
    out, local = out.clone(), out.shape[2]
    for p, peer_ids in enumerate(ids):
        heads = peer_ids[:num_tokens, :, rank * local : (rank + 1) * local].long()  # [N, layers, h]
        for layer, (weight, scales, start, end) in enumerate(tables):
            i = heads[:, layer]
            owned = (i >= start) & (i < end)
            row = torch.where(owned, i - start, 0)
            packed = torch.cat([weight.view(torch.uint8)[row], scales.view(torch.uint8)[row]], -1)
            out[p * num_tokens : (p + 1) * num_tokens, layer] = torch.where(owned[..., None], packed, 0)
    return out


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register nothing: vLLM's peer exchange needs an engram data-parallel group (module docstring), which no warmreg
    setting expresses; a deployment that runs it registers :class:`EngramPeerLookup` itself."""
