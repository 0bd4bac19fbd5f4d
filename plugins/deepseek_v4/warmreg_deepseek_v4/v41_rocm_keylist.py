"""DeepSeek-V4.1 mono decode on gfx942: an index layer's attention key lists between vLLM's indexer and the second
mono launch (vLLM 0.34 ``models/deepseek_v41/amd/mono/keylist.py``: ``launch`` / ``_keylist_kernel``).

For token ``t < S`` with SWA slot ``slot[t]``, position ``p``, its dense window row ``swa[t, :W]`` and length
``swa_len[t]``, its local top-k row ``topk[t, :K]`` of the layer's compressed cache (ratio ``r``, block table ``bt``
of ``B`` rows a block, request ``q = token_to_req[t]``), ``KEYS = K + W``::

    live = slot[t] >= 0;   nswa = live ? swa_len[t] : 0;   ntopk = live ? min((p + 1) // r, K) : 0  (0 for r = 0)
    kt[t * KEYS + k] = k < ntopk:          topk[t, k] >= 0 ? (bt[q, l // B] * B + l % B) | 1 << 31 : -1  (l = topk[t, k])
                       ntopk <= k < ntopk + nswa:   swa[t, k - ntopk]
                       else:                        -1                                                   (k < KEYS)
    klen[t] = ntopk + nswa;   klen[S + t] = ntopk

(bit 31 tells the second launch to read the compressed cache; the slot arithmetic is int32, as vLLM's.) One program
a token, a ``next_pow2(KEYS)`` tile, 4 warps, as vLLM's ``launch``.

Where it runs: ``--monokernel`` on gfx942 (``serving.monokernel``), on the layers the mono decode runs whole
(``MonoDecodeLayer._create``: tensor-parallel size 4 on gfx942, the ``fp8_ds_mla`` KV cache, V4.1-Flash's MoE routing
of 384 / 6 experts, which warmreg does not read and takes as the checkpoint's), every decode step of an index source
layer (``index_source_layer_ids`` with a compressed ratio): ``runner.py`` calls it after vLLM's indexer wrote the
layer's top-k, since gfx942's second launch has no key-table build. The mono kernels' geometry is V4.1-Flash's
(``attention/plan.py``: ``WINDOW`` 128, ``TOPK`` 512).

Key: the ratio, the window and top-k widths (constexprs, and the rows' strides: vLLM asserts contiguous rows), the
tile and the warps. ``S``, ``B`` and the block table's stride are runtime ints (``do_not_specialize``) and no pointer
is specialized on alignment.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._serving import serving_int
from ._v41 import index_ratios
from ._v41_rocm import monokernel
from .model import DSV4, kv_cache_dtype

__all__ = ["MONO_TOPK", "MONO_WINDOW", "V41RocmKeylist", "V41RocmKeylistKey", "keylist_reference", "register"]

#: The mono kernels' window and top-k (``amd/mono/attention/plan.py``: V4.1-Flash's geometry).
MONO_WINDOW, MONO_TOPK = 128, 512
_NUM_WARPS = 4
_POINTERS = [
    "slot_ptr",
    "pos_ptr",
    "swa_lens_ptr",
    "swa_idx_ptr",
    "topk_ptr",
    "t2r_ptr",
    "bt_ptr",
    "kt_ptr",
    "klen_ptr",
]


@triton.jit(do_not_specialize=["bt_stride", "comp_block", "num_tokens"], do_not_specialize_on_alignment=_POINTERS)
def _keylist_kernel(
    slot_ptr,  # [S] int64 SWA slots (-1: a padded token)
    pos_ptr,  # [S] int64 positions
    swa_lens_ptr,  # [>= S] int32
    swa_idx_ptr,  # [>= S, WINDOW] int32, contiguous rows
    topk_ptr,  # [>= S, TOPK] int32, contiguous rows (unused for RATIO 0)
    t2r_ptr,  # [>= S] int32
    bt_ptr,  # [R, *] int32 compressed block table (unused for RATIO 0)
    bt_stride,
    comp_block,
    kt_ptr,  # [>= S * KEYS] int32
    klen_ptr,  # [>= 2 S] int32
    num_tokens,
    RATIO: tl.constexpr,  # the layer's compress ratio (0: window keys only)
    WINDOW: tl.constexpr,  # the dense window row's width
    TOPK: tl.constexpr,  # the top-k row's width
    KEYS: tl.constexpr,  # TOPK + WINDOW: a token's keys at most
    BLOCK: tl.constexpr,  # next_pow2(KEYS)
):
    t = tl.program_id(0)
    k = tl.arange(0, BLOCK)
    live = tl.load(slot_ptr + t) >= 0
    nswa = tl.where(live, tl.load(swa_lens_ptr + t), 0)
    ntopk = 0
    if RATIO > 0:
        p = tl.load(pos_ptr + t).to(tl.int32)
        ntopk = tl.where(live, tl.minimum((p + 1) // RATIO, TOPK), 0)
    n = ntopk + nswa
    window_col = tl.minimum(tl.maximum(k - ntopk, 0), WINDOW - 1)
    keys = tl.where(k < n, tl.load(swa_idx_ptr + t * WINDOW + window_col), -1)
    if RATIO > 0:
        head = k < ntopk
        local = tl.load(topk_ptr + t * TOPK + k, mask=head, other=-1)
        row = tl.maximum(local, 0)
        req = tl.load(t2r_ptr + t)
        page = tl.load(bt_ptr + req * bt_stride + row // comp_block, mask=head, other=0)
        slot = (page * comp_block + row % comp_block) | -2147483648
        keys = tl.where(head, tl.where(local >= 0, slot, -1), keys)
    tl.store(kt_ptr + t * KEYS + k, keys, mask=k < KEYS)
    tl.store(klen_ptr + t, n)
    tl.store(klen_ptr + num_tokens + t, ntopk)


@attrs.frozen(kw_only=True)
class V41RocmKeylistKey(warmreg.CompileKey):
    """What changes the binary: the ratio, the window and top-k widths, the tile, the warps."""

    ratio: int
    window: int
    topk: int
    block: int
    num_warps: int


def _check(name: str, t: torch.Tensor, what: str, dtype: torch.dtype, rows: int, width: int | None = None) -> None:
    shape_ok = t.shape[0] >= rows and (t.ndim == 1 if width is None else t.ndim >= 2 and t.shape[-1] == width)
    dense = t.is_contiguous() if t.shape[0] > 1 else True
    if t.dtype != dtype or not shape_ok or not dense:
        want = f"[>= {rows}]" if width is None else f"[>= {rows}, ..., {width}]"
        raise warmreg.LaunchError(
            name, f"{what} must be a contiguous {dtype} {want} tensor (got {t.dtype} {tuple(t.shape)})"
        )


class V41RocmKeylist(warmreg.TritonKernel[V41RocmKeylistKey]):
    """An index layer's key lists and lengths for the mono decode's second launch; see the module docstring.

    :param ratios: the index source layers' compress ratios (domains only).
    """

    name = "deepseek_v4.v41_rocm_keylist"
    key_type = V41RocmKeylistKey
    jit = _keylist_kernel

    def __init__(self, ratios: Iterable[int] = (2,)) -> None:
        self.ratios = tuple(ratios)

    def dispatch(self, *, swa_indices: torch.Tensor, ratio: int, topk: torch.Tensor | None) -> V41RocmKeylistKey:
        window = swa_indices.shape[-1]
        width = topk.shape[-1] if ratio and topk is not None else MONO_TOPK
        return V41RocmKeylistKey(
            ratio=ratio, window=window, topk=width, block=triton.next_power_of_2(width + window), num_warps=_NUM_WARPS
        )

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        return {
            "swa_indices": [warmreg.meta((1, 1, MONO_WINDOW), torch.int32)],
            "ratio": self.ratios,
            "topk": [warmreg.meta((1, MONO_TOPK), torch.int32)],
        }

    def warmup_inputs(self, key: V41RocmKeylistKey) -> Mapping[str, Any]:
        i32, keys = torch.int32, key.topk + key.window
        return {
            "kt": warmreg.meta((keys,), i32), "klen": warmreg.meta((2,), i32),
            "slot_mapping": warmreg.meta((1,), torch.int64), "positions": warmreg.meta((1,), torch.int64),
            "swa_indices": warmreg.meta((1, 1, key.window), i32), "swa_lens": warmreg.meta((1,), i32),
            "token_to_req": warmreg.meta((1,), i32), "ratio": key.ratio, "topk": warmreg.meta((1, key.topk), i32),
            "comp_block_table": warmreg.meta((1, 16), i32), "comp_block": 128,
        }  # fmt: skip

    @warmreg.kernel_launcher
    def __call__(
        self,
        kt: torch.Tensor,
        klen: torch.Tensor,
        slot_mapping: torch.Tensor,
        positions: torch.Tensor,
        swa_indices: torch.Tensor,
        swa_lens: torch.Tensor,
        token_to_req: torch.Tensor,
        ratio: int,
        topk: torch.Tensor | None = None,
        comp_block_table: torch.Tensor | None = None,
        comp_block: int = 1,
    ) -> warmreg.LaunchSpec[V41RocmKeylistKey]:
        """Write ``kt[:S * KEYS]`` and ``klen[:2 S]`` (vLLM's ``keylist.launch``, same arguments); returns ``(kt,
        klen)``.

        :param kt: int32 ``[>= S * KEYS]``; ``klen``: int32 ``[>= 2 S]`` (contiguous, written).
        :param slot_mapping: int64 ``[S]``; ``positions``: int64 ``[>= S]``; ``swa_lens``, ``token_to_req``: int32
            ``[>= S]``; ``swa_indices``: int32 ``[>= S, 1, W]`` dense window rows, contiguous.
        :param ratio: the layer's compress ratio; above 0 it needs ``topk`` (int32 ``[>= S, K]``, contiguous),
            ``comp_block_table`` (int32 ``[R, *]``, contiguous rows) and ``comp_block`` (>= 1).
        :raises warmreg.LaunchError: for wrong dtypes, shapes or layouts, a negative ratio, or a missing top-k input.
        """
        name, i32 = self.name, torch.int32
        s = slot_mapping.shape[0]
        _check(name, slot_mapping, "slot_mapping", torch.int64, s)
        _check(name, positions, "positions", torch.int64, s)
        _check(name, swa_lens, "swa_lens", i32, s)
        _check(name, token_to_req, "token_to_req", i32, s)
        if (
            swa_indices.dtype != i32
            or swa_indices.ndim < 2
            or swa_indices.shape[0] < s
            or not swa_indices.is_contiguous()
        ):
            raise warmreg.LaunchError(name, f"swa_indices must be a contiguous int32 [>= {s}, 1, W] tensor (got "
                                      f"{swa_indices.dtype} {tuple(swa_indices.shape)})")  # fmt: skip
        if ratio < 0 or (ratio and (topk is None or comp_block_table is None or comp_block < 1)):
            raise warmreg.LaunchError(name, f"ratio {ratio} needs ratio >= 0, and above 0 topk, comp_block_table and "
                                      f"comp_block >= 1 (got comp_block {comp_block})")  # fmt: skip
        key = self.dispatch(swa_indices=swa_indices, ratio=ratio, topk=topk)
        if ratio and topk is not None and comp_block_table is not None:
            _check(name, topk, "topk", i32, s, key.topk)
            if comp_block_table.dtype != i32 or comp_block_table.ndim != 2 or comp_block_table.stride(-1) != 1:
                raise warmreg.LaunchError(name, "comp_block_table must be an int32 [R, P] table with contiguous rows")
            bt, bt_stride = comp_block_table, comp_block_table.stride(0)
        else:
            topk, bt, bt_stride = swa_lens, swa_lens, 0
        _check(name, kt, "kt", i32, s * (key.topk + key.window))
        _check(name, klen, "klen", i32, 2 * s)
        kwargs = dict(
            slot_ptr=slot_mapping, pos_ptr=positions, swa_lens_ptr=swa_lens, swa_idx_ptr=swa_indices, topk_ptr=topk,
            t2r_ptr=token_to_req, bt_ptr=bt, bt_stride=bt_stride, comp_block=comp_block, kt_ptr=kt, klen_ptr=klen,
            num_tokens=s, RATIO=key.ratio, WINDOW=key.window, TOPK=key.topk, KEYS=key.topk + key.window,
            BLOCK=key.block,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (s,) if s else None, kwargs, (kt, klen))


def keylist_reference(
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    swa_indices: torch.Tensor,
    swa_lens: torch.Tensor,
    token_to_req: torch.Tensor,
    ratio: int,
    topk: torch.Tensor | None = None,
    comp_block_table: torch.Tensor | None = None,
    comp_block: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference: ``(kt [S, KEYS], klen [2 S])`` int32 (``KEYS`` = the top-k width + the window, or
    ``MONO_TOPK`` + the window at ratio 0)."""
    s, window = slot_mapping.shape[0], swa_indices.shape[-1]
    width = topk.shape[-1] if ratio and topk is not None else MONO_TOPK
    live = slot_mapping >= 0
    nswa = torch.where(live, swa_lens[:s].long(), 0)
    ntopk = torch.where(live, ((positions[:s] + 1) // ratio).clamp(max=width), 0) if ratio else torch.zeros_like(nswa)
    k = torch.arange(width + window)[None, :]
    rows = swa_indices.reshape(swa_indices.shape[0], window)[:s].long()
    col = (k - ntopk[:, None]).clamp(0, window - 1)
    keys = torch.where(k < (ntopk + nswa)[:, None], rows.gather(1, col), -1)
    if ratio and topk is not None and comp_block_table is not None:
        head = k < ntopk[:, None]
        local = torch.where(head[:, :width], topk[:s, :width].long(), -1)
        local = torch.cat([local, torch.full((s, window), -1, dtype=torch.long)], dim=1)
        row = local.clamp(min=0)
        page = comp_block_table.long()[token_to_req[:s].long()[:, None], row // comp_block]
        slot = (page * comp_block + row % comp_block) | -(2**31)
        keys = torch.where(head, torch.where(local >= 0, slot, -1), keys)
    kt = ((keys + 2**31) % 2**32 - 2**31).to(torch.int32)
    return kt, torch.cat([ntopk + nswa, ntopk]).to(torch.int32)


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the key lists on gfx942 with ``--monokernel`` at tensor-parallel size 4 and the ``fp8_ds_mla`` cache,
    for the index source layers' compressed ratios.

    :raises warmreg.ConfigError: from :func:`._v41_rocm.monokernel`.
    """
    ratios = index_ratios(model)
    on = (
        monokernel(config, platform)
        and serving_int(config, "tensor_parallel_size", 1) == 4
        and kv_cache_dtype(config) in ("auto", "fp8", "fp8_e4m3", "fp8_ds_mla")
        and bool(ratios)
    )
    registry.add(V41RocmKeylist(ratios or (2,)), when=warmreg.rocm_arch_in("gfx942") if on else False)
