"""DeepSeek-V4.1's FlashInfer mixed sparse indices (vLLM 0.34 ``models/deepseek_v41/common/ops/cache_utils.py``:
``build_flashinfer_mixed_sparse_indices`` and ``_build_flashinfer_mixed_sparse_indices_kernel``; launched by
``nvidia/flashinfer_sparse.py: DeepseekV4FlashInferMLAAttention._build_sparse_index_metadata`` every step, on every
layer; the SWA-only layers share one launch a step).

One row per token of a decode-first batch (``ND`` decode tokens, then the prefill tokens), ``SW`` SWA columns then
``PK = round_up(max(TOP_K, DK), 4)`` compressed ones (``DK`` the decode top-k width), all FlashInfer storage offsets:
``remap(v, bs, span) = v < 0 ? -1 : (v // bs) * span + v % bs`` (``span`` = a page's stride in tokens, ``bs`` for
unpacked pages). ``page(bt, r, l, bs) = bt[r, l // bs] * bs + l % bs`` maps a request's local index to a slot.

Decode token ``t < ND`` (``r = token_to_req[t]``)::

    out[t, :SW]      = remap(decode_swa[t, :SW], swa_bs, swa_span)
    out[t, SW + j]   = remap(v_j, c_bs, c_span),  v_j = j < DK ? decode_topk[t, j] : -1;  LOCAL: v_j >= 0 ? page(cbt, r, v_j, c_bs) : -1
    lens[t]          = SW + (DK == 0 ? 0 : LOCAL ? valid[t] * #{j : v_j >= 0} : HAS_LENS ? decode_lens[t] : DK)

Prefill token ``t`` (``r = token_to_req[t]``, ``pos = seq[r] - qlen[r] + t - qsl[r]``, ``R`` the layer's ratio)::

    start = max(pos - (W - 1), 0, replay_start[r]);   swa_len = pos - start + 1
    topk_len = R > 0 ? min((pos + 1) // R, TOP_K) : 0
    out[t, s]      = s < swa_len ? remap(page(swa_bt, r, start + s, swa_bs), swa_bs, swa_span) : -1      (s < SW)
    out[t, SW + j] = j < topk_len and l >= 0 ? remap(page(cbt, r, l, c_bs), c_bs, c_span) : -1  (l = prefill_topk[t - ND, j])
    lens[t]        = SW + topk_len

Unlike DeepSeek-V4's kernel (:mod:`.flashinfer_indices`): each prefill window starts no lower than the request's
``replay_start`` (SWA bounded replay), no image width widens the rows, and no DSpark non-causal decode rows exist.

Key: the constexprs vLLM passes (``W``, ``SW``, ``R``, ``TOP_K``, ``PK``, ``DK``, the decode-index mode, whether
decode lens are given, both tiles) and its warps (4 when a tile reaches 256, else 1). Strides, page sizes, spans,
``ND`` and the prefill top-k width are ``do_not_specialize`` as in vLLM, and no pointer is specialized on alignment
(rows sit at runtime strides). Unused inputs are passed as ``None`` (constexpr) where vLLM passes a stand-in tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch

import warmreg

from ._checks import out_parts
from ._v41_flashinfer_kernel import v41_flashinfer_mixed_kernel, v41_flashinfer_mixed_reference
from .model import DSV4

__all__ = ["V41FlashinferMixedIndices", "V41FlashinferMixedKey", "register", "v41_flashinfer_mixed_reference"]


@attrs.frozen(kw_only=True)
class V41FlashinferMixedKey(warmreg.CompileKey):
    """What changes the binary of V4.1's FlashInfer mixed sparse indices: vLLM's constexprs and warps."""

    window_size: int
    swa_index_width: int
    compress_ratio: int
    top_k: int
    padded_top_k: int
    decode_compressed_topk: int
    decode_indices_local: bool  # decode top-k rows are local indices mapped through the compressed block table
    has_decode_lens: bool  # decode compressed lengths are read from a tensor
    window_block: int
    topk_block: int
    num_warps: int


class V41FlashinferMixedIndices(warmreg.TritonKernel[V41FlashinferMixedKey]):
    """FlashInfer's V4.1 sparse-index matrix of a decode-first batch (see the module docstring).

    :param window_size: the sliding window (``sliding_window``).
    :param index_topk: the top-k buffer's width (domains only).
    :param ratios: the compress ratios of the model's layers (domains only).
    """

    name = "deepseek_v4.v41_flashinfer_mixed_sparse_indices"
    key_type = V41FlashinferMixedKey
    jit = v41_flashinfer_mixed_kernel

    def __init__(self, *, window_size: int, index_topk: int = 512, ratios: Iterable[int] = (0,)) -> None:
        self.window_size, self.index_topk, self.ratios = window_size, index_topk, tuple(sorted(set(ratios)))

    def dispatch(
        self,
        *,
        decode_swa_indices: torch.Tensor,
        decode_compressed_indices: torch.Tensor | None,
        decode_compressed_topk_lens: torch.Tensor | None,
        compress_ratio: int,
        top_k: int,
        decode_compressed_indices_are_local: bool = False,
    ) -> V41FlashinferMixedKey:
        sw = decode_swa_indices.shape[1]
        dk = decode_compressed_indices.shape[1] if decode_compressed_indices is not None else 0
        padded = (max(top_k, dk) + 3) // 4 * 4
        window_block, topk_block = warmreg.next_pow2(max(sw, 1)), warmreg.next_pow2(max(padded, 1))
        return V41FlashinferMixedKey(
            window_size=self.window_size, swa_index_width=sw, compress_ratio=compress_ratio, top_k=top_k,
            padded_top_k=padded, decode_compressed_topk=dk, decode_indices_local=decode_compressed_indices_are_local and dk > 0,
            has_decode_lens=decode_compressed_topk_lens is not None, window_block=window_block, topk_block=topk_block,
            num_warps=4 if max(window_block, topk_block) >= 256 else 1,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        k = self.index_topk
        return {
            # causal decode rows: the window (no DSpark rows in V4.1's plan)
            "decode_swa_indices": [warmreg.meta((1, self.window_size), torch.int32)],
            "decode_compressed_indices": [None, warmreg.meta((1, k), torch.int32)],
            "decode_compressed_topk_lens": [None],  # V4.1's attention never passes decode lens
            "compress_ratio": list(self.ratios),
            "top_k": sorted({0, k}),  # a compressed layer: 0 on a decode-only step, k with prefill tokens
            "decode_compressed_indices_are_local": [False, True],
        }

    def when(self, *, compress_ratio: int, top_k: int, decode_compressed_indices: torch.Tensor | None,
             decode_compressed_indices_are_local: bool, **_: Any) -> bool:  # fmt: skip
        """An SWA-only layer passes no top-k at all; a compressed one its local decode top-k, whole buffer rows."""
        if compress_ratio == 0:
            return top_k == 0 and decode_compressed_indices is None and not decode_compressed_indices_are_local
        return decode_compressed_indices is not None and decode_compressed_indices_are_local

    def warmup_inputs(self, key: V41FlashinferMixedKey) -> Mapping[str, Any]:
        one, dk = warmreg.meta((1,), torch.int32), key.decode_compressed_topk
        local = key.decode_indices_local
        return {
            "decode_swa_indices": warmreg.meta((1, key.swa_index_width), torch.int32),
            "decode_compressed_indices": warmreg.meta((1, dk), torch.int32) if dk else None,
            "decode_compressed_topk_lens": one if key.has_decode_lens else None,
            "prefill_topk_indices": warmreg.meta((1, key.top_k), torch.int32),
            "query_start_loc": warmreg.meta((2,), torch.int32), "seq_lens": one,
            "token_to_req_indices": warmreg.meta((2,), torch.int32), "swa_block_table": warmreg.meta((1, 1), torch.int32),
            "compressed_block_table": warmreg.meta((1, 1), torch.int32) if local else None, "replay_start": one,
            "swa_block_size": 64, "compressed_block_size": 64, "compress_ratio": key.compress_ratio, "top_k": key.top_k,
            "decode_compressed_indices_are_local": local,
            "decode_is_valid_token": warmreg.meta((1,), torch.bool) if local else None,
        }  # fmt: skip

    @warmreg.kernel_launcher
    def __call__(
        self,
        decode_swa_indices: torch.Tensor,
        decode_compressed_indices: torch.Tensor | None,
        decode_compressed_topk_lens: torch.Tensor | None,
        prefill_topk_indices: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        token_to_req_indices: torch.Tensor,
        swa_block_table: torch.Tensor,
        compressed_block_table: torch.Tensor | None,
        replay_start: torch.Tensor,
        *,
        swa_block_size: int,
        compressed_block_size: int,
        compress_ratio: int,
        top_k: int,
        decode_compressed_indices_are_local: bool = False,
        decode_is_valid_token: torch.Tensor | None = None,
        swa_block_span: int | None = None,
        compressed_block_span: int | None = None,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> warmreg.LaunchSpec[V41FlashinferMixedKey]:
        """The sparse-index matrix, as ``build_flashinfer_mixed_sparse_indices`` with the same arguments (the window
        is the instance's); returns ``(sparse_indices [T, SW + PK], sparse_topk_lens [T])`` int32 (fresh, or ``out``).

        :param decode_swa_indices: int32 ``[ND, SW]`` SWA slots of the decode tokens (``SW >= window``), unit column
            stride.
        :param decode_compressed_indices: int32 ``[ND, DK]`` compressed indices of the decode tokens (global slots, or
            local ones with ``decode_compressed_indices_are_local``), or ``None`` (``DK = 0``).
        :param decode_compressed_topk_lens: int32 ``[>= ND]`` decode compressed lengths, or ``None``.
        :param prefill_topk_indices: int32 ``[NP, k]`` local top-k of the prefill tokens (``k`` may be 0).
        :param query_start_loc: int32 ``[reqs + 1]``; ``seq_lens``, ``replay_start`` int32 ``[>= reqs]``.
        :param token_to_req_indices: int32 ``[>= ND + NP]``.
        :param swa_block_table: int32 ``[reqs, w]``; ``compressed_block_table`` int32 ``[reqs, w']`` or ``None``
            (the SWA one is used), both with unit column stride.
        :param swa_block_size: SWA tokens a page; ``compressed_block_size``: compressed tokens a page.
        :param compress_ratio: the layer's ratio (0 for SWA-only); ``top_k``: prefill top-k columns (``<= k``).
        :param decode_is_valid_token: bool ``[>= ND]``, required with local decode indices.
        :param swa_block_span: a SWA page's stride in tokens (default ``swa_block_size``); ``compressed_block_span``
            likewise.
        :param out: the two outputs to write instead of fresh ones: exactly int32 ``[T, SW + PK]`` and ``[T]``,
            contiguous, 16-byte aligned.
        :raises warmreg.LaunchError: for wrong dtypes, ranks or lengths, or an ``out`` unlike the fresh outputs.
        """
        local = decode_compressed_indices_are_local and decode_compressed_indices is not None
        _check(self.name, decode_swa_indices, decode_compressed_indices, prefill_topk_indices, token_to_req_indices,
               (query_start_loc, seq_lens, replay_start, swa_block_table, compressed_block_table,
                decode_compressed_topk_lens), local, decode_is_valid_token, top_k, self.window_size)  # fmt: skip
        nd, npf = decode_swa_indices.shape[0], prefill_topk_indices.shape[0]
        key = self.dispatch(
            decode_swa_indices=decode_swa_indices, decode_compressed_indices=decode_compressed_indices,
            decode_compressed_topk_lens=decode_compressed_topk_lens, compress_ratio=compress_ratio, top_k=top_k,
            decode_compressed_indices_are_local=local,
        )  # fmt: skip
        dk = key.decode_compressed_topk
        T, device = nd + npf, decode_swa_indices.device
        out_rows, out_lens = out_parts(self.name, out, 2)
        rows = warmreg.output(
            self.name, "out[0]", out_rows, (T, key.swa_index_width + key.padded_top_k), torch.int32, device
        )
        lens = warmreg.output(self.name, "out[1]", out_lens, (T,), torch.int32, device)
        cbt = compressed_block_table if compressed_block_table is not None else swa_block_table
        decode_topk = decode_compressed_indices if dk else None  # constexpr None when no column is read
        kwargs = dict(
            out_ptr=rows, out_stride=rows.stride(0), lens_ptr=lens, decode_swa_ptr=decode_swa_indices,
            decode_swa_stride=decode_swa_indices.stride(0), decode_topk_ptr=decode_topk,
            decode_topk_stride=decode_topk.stride(0) if decode_topk is not None else 0,
            decode_lens_ptr=decode_compressed_topk_lens, decode_valid_ptr=decode_is_valid_token if key.decode_indices_local else None,
            prefill_topk_ptr=prefill_topk_indices, prefill_topk_stride=prefill_topk_indices.stride(0),
            query_start_loc_ptr=query_start_loc, seq_lens_ptr=seq_lens, token_to_req_ptr=token_to_req_indices,
            replay_start_ptr=replay_start, swa_bt_ptr=swa_block_table, swa_bt_stride=swa_block_table.stride(0),
            swa_block_size=swa_block_size, swa_span=swa_block_size if swa_block_span is None else swa_block_span,
            c_bt_ptr=cbt, c_bt_stride=cbt.stride(0), c_block_size=compressed_block_size,
            c_span=compressed_block_size if compressed_block_span is None else compressed_block_span,
            num_decode_tokens=nd, prefill_topk_width=prefill_topk_indices.shape[1], WINDOW_SIZE=key.window_size,
            SWA_INDEX_WIDTH=key.swa_index_width, COMPRESS_RATIO=key.compress_ratio, TOP_K=key.top_k,
            PADDED_TOP_K=key.padded_top_k, DECODE_TOPK=key.decode_compressed_topk, DECODE_LOCAL=key.decode_indices_local,
            HAS_DECODE_LENS=key.has_decode_lens, WINDOW_BLOCK=key.window_block, TOPK_BLOCK=key.topk_block,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (T,) if T else None, kwargs, (rows, lens))


def _check(
    name: str, dswa: torch.Tensor, dtopk: torch.Tensor | None, ptopk: torch.Tensor, t2r: torch.Tensor,
    vectors: tuple[torch.Tensor | None, ...], local: bool, valid: torch.Tensor | None, top_k: int, window: int,
) -> None:  # fmt: skip
    """Raise :class:`warmreg.LaunchError` naming the argument the kernel cannot read as vLLM's caller passes it."""
    nd = dswa.shape[0] if dswa.ndim == 2 else -1
    for arg, t in (("decode_swa_indices", dswa), ("decode_compressed_indices", dtopk), ("prefill_topk_indices", ptopk)):
        if t is not None and (t.dtype != torch.int32 or t.ndim != 2 or (t.shape[1] > 1 and t.stride(1) != 1)):
            raise warmreg.LaunchError(name, f"{arg} must be int32 [rows, k] with unit column stride (got {t.dtype} "
                                            f"{tuple(t.shape)})")  # fmt: skip
    if dswa.shape[1] < window or (dtopk is not None and dtopk.shape[0] != nd):
        raise warmreg.LaunchError(
            name, f"decode_swa_indices needs >= {window} columns, decode_compressed_indices {nd} rows"
        )
    names = ("query_start_loc", "seq_lens", "replay_start", "swa_block_table", "compressed_block_table",
             "decode_compressed_topk_lens")  # fmt: skip
    for arg, t in zip(names, vectors, strict=True):
        if t is not None and (t.dtype != torch.int32 or (t.stride(-1) != 1 and t.shape[-1] > 1)):
            raise warmreg.LaunchError(name, f"{arg} must be int32 with a unit last stride (got {t.dtype})")
    if t2r.dtype != torch.int32 or t2r.ndim != 1 or t2r.shape[0] < nd + ptopk.shape[0]:
        raise warmreg.LaunchError(name, f"token_to_req_indices must be int32 [>= {nd + ptopk.shape[0]}]")
    if local and (valid is None or valid.dtype != torch.bool or valid.shape[0] < nd):
        raise warmreg.LaunchError(name, f"local decode indices need decode_is_valid_token, bool [>= {nd}]")
    if not 0 <= top_k <= ptopk.shape[1] and ptopk.shape[0] > 0:
        raise warmreg.LaunchError(
            name, f"top_k ({top_k}) must be within prefill_topk_indices' {ptopk.shape[1]} columns"
        )


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the mixed sparse indices where V4.1 builds them: FlashInfer's attention class off SM12x on CUDA
    (``DeepseekV4FlashInferMLAAttention``; SM12x runs its own class, which launches the global top-k instead), every
    layer ratio of the model (the MTP layers past ``compress_ratios`` included, as SWA-only).

    :raises warmreg.ConfigError: from :func:`.v41.attention_kind`.
    """
    from .v41 import attention_kind  # v41 imports this module

    if not platform.is_cuda or not model.v41:
        return
    used = attention_kind(config, model, platform) == "flashinfer"
    kernel = V41FlashinferMixedIndices(
        window_size=model.sliding_window, index_topk=model.index_topk, ratios=model.ratios
    )
    registry.add(kernel, when=warmreg.is_cuda if used else False)
