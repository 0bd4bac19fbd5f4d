"""``out=`` on every DeepSeek-V4 op that allocates its outputs (Triton interpreter on CPU).

Each case builds an op's inputs with the helpers of the op's own test module. With ``out`` given, an op returns
the caller's tensors themselves, written as without ``out`` although they start as garbage (NaN, 7777, 0x7F
bytes), and its launch code allocates nothing; one bad buffer raises a ``LaunchError`` naming the parameter.
The inverse RoPE + quant returns transposed views of its group-major buffers, so there the views are checked to
lie on the caller's buffers. The ops that took persistent buffers before (larger than needed, rows past T
untouched) keep that contract, tested in their own modules; here their launch with buffers allocates nothing.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import test_dspark_inputs as dspark_inputs_tests
import torch
import triton
from test_dspark_swa_indices import PAGE as DSPARK_PAGE
from test_dspark_swa_indices import _draft
from test_flashinfer_indices import WINDOW as FI_WINDOW
from test_flashinfer_indices import _layer_inputs
from test_flashinfer_indices import _step as _fi_step
from test_indexer import q_inputs as fp8_q_inputs
from test_inv_rope_quant import make_inputs as inv_rope_inputs
from test_inv_rope_quant import scale_storage
from test_metadata import _batch as _metadata_batch
from test_metadata import _chunk, _rand
from test_mtp_norm import BF16_TOL, _rows, _weights
from test_mxfp4 import q_inputs as mxfp4_q_inputs
from test_pack_seq import _fp8
from test_sparse_mla import MAX_MODEL_LEN as C128_MAX_MODEL_LEN
from test_sparse_mla import _batch as _mla_batch
from test_sparse_mla import _block_table as _mla_block_table
from test_sparse_mla import _topk
from test_swa_indices import PAGE, WINDOW, _c4_topk, _gather_lens, _step
from test_swa_indices import _block_table as _swa_block_table
from torch.overrides import TorchFunctionMode
from warmreg_deepseek_v4.combine_indices import CombineTopkSwaIndices
from warmreg_deepseek_v4.compressed_slot_mapping import CompressedSlotMapping
from warmreg_deepseek_v4.dspark import dspark_swa_index_width
from warmreg_deepseek_v4.dspark_inputs import DSparkInputs
from warmreg_deepseek_v4.dspark_swa_indices import DSparkSwaIndices
from warmreg_deepseek_v4.flashinfer_indices import FlashInferMixedSparseIndices
from warmreg_deepseek_v4.global_topk import GlobalTopkIndices
from warmreg_deepseek_v4.indexer_chunk_metadata import IndexerPrefillChunkMetadata
from warmreg_deepseek_v4.indexer_q import IndexerQRopeQuant
from warmreg_deepseek_v4.indexer_q_mxfp4 import IndexerQRopeMxfp4
from warmreg_deepseek_v4.inv_rope_quant import InvRopeFP8Quant
from warmreg_deepseek_v4.mtp_input_norm import MTPInputRMSNorm
from warmreg_deepseek_v4.mtp_shared_head_norm import MTPSharedHeadRMSNorm
from warmreg_deepseek_v4.pack_seq import PackSeq
from warmreg_deepseek_v4.sparse_mla import C128ATopkMetadata
from warmreg_deepseek_v4.swa_indices import DecodeSwaIndices
from warmreg_deepseek_v4.swa_prefill_metadata import SparseSWAPrefillMetadata
from warmreg_deepseek_v4.uniform_decode import PrepareUniformDecode
from warmreg_deepseek_v4.unpack_seq import UnpackSeq

import warmreg

I32 = torch.int32
EXACT = (0.0, 0.0)  # (rtol, atol)
BF16 = (BF16_TOL["rtol"], BF16_TOL["atol"])  # the MTP norm tests'


class Case(NamedTuple):
    """One op's launch: the kernel, its inputs, the float tolerance of its tests (index ops: exact)."""

    kernel: Any  # a warmreg.TritonKernel
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    tol: tuple[float, float] = EXACT

    def __call__(self, **extra: Any) -> Any:
        return self.kernel(*self.args, **self.kwargs, **extra)


# -- the ops that allocate their outputs, with inputs from their own test modules ---------------------------------
def _pack_seq() -> Case:
    return Case(PackSeq(), (_fp8(6, 100, torch.float8_e4m3fn, 0), torch.tensor([2, 1, 2], dtype=I32)), {})


def _unpack_seq() -> Case:
    packed = torch.randint(-1, 1 << 20, (3, 2, 100), generator=torch.Generator().manual_seed(0), dtype=I32)
    return Case(UnpackSeq(), (packed, torch.tensor([2, 0, 1], dtype=I32)), {})


def _global_topk() -> Case:
    b = _mla_batch(5, decodes=5, prefills=0)
    args = (_topk(5, 5, 40, 20 * 64), b.token_to_req, _mla_block_table(3, b.num_reqs, 20), b.slot_mapping >= 0)
    return Case(GlobalTopkIndices(), args, {"block_size": 64})


def _swa_indices() -> Case:
    s = _step(7, decodes=7, prefills=0, replay=True)
    block_table = _swa_block_table(7, s.seq_lens.shape[0], triton.cdiv(2000 + 1, PAGE))
    args = (s.positions, s.token_to_req, s.is_valid, block_table, s.replay_start)
    return Case(DecodeSwaIndices(), args, dict(num_tokens=6, window_size=WINDOW, index_width=WINDOW, block_size=PAGE, token_offset=1))


def _combine_indices() -> Case:
    s = _step(8, decodes=0, prefills=4)
    gather = _gather_lens(s, slice(0, 4))
    n_rows = int((s.seq_lens // 4).max())
    args = (_c4_topk(4, s.positions, 24), s.query_start_loc, s.seq_lens, gather)
    kw = dict(num_tokens=s.positions.shape[0], compress_ratio=4, M=n_rows + int(gather.max()), N=n_rows)
    return Case(CombineTopkSwaIndices(window_size=WINDOW, workers=2), args, kw)


def _swa_prefill_metadata() -> Case:
    gen = torch.Generator().manual_seed(3)
    qsl, seq_lens = _metadata_batch(gen, decodes=3, prefills=2, max_model_len=40)
    kw = dict(num_decodes=3, num_prefills=2, window_size=8)
    return Case(SparseSWAPrefillMetadata(), (seq_lens, qsl, _rand(gen, (5,), 40)), kw)


def _indexer_chunk_metadata() -> Case:
    chunk = _chunk(torch.Generator().manual_seed(4), 4, 4, max_model_len=60)
    total = int(chunk["query_start_loc"][-1])
    kw = dict(chunk, compress_ratio=4, query_slice_start=1, query_slice_stop=total - 1)
    return Case(IndexerPrefillChunkMetadata(), (), kw)


def _indexer_q() -> Case:
    torch.manual_seed(3)
    return Case(IndexerQRopeQuant(), (), dict(fp8_q_inputs(3, heads=2), fp8_dtype=torch.float8_e4m3fn, explicit_fma=False))


def _indexer_q_mxfp4() -> Case:
    torch.manual_seed(3)
    return Case(IndexerQRopeMxfp4(), (), mxfp4_q_inputs(3, 2))


def _mtp_input_norm() -> Case:
    gen = torch.Generator().manual_seed(3)
    embeds, prev = _rows(3, 40, gen, 1), _rows(3, 3 * 40, gen, 1)
    args = (embeds, torch.tensor([5, 0, 7]), prev, *_weights(40, gen), 1e-6)
    return Case(MTPInputRMSNorm(hidden=40, hc_mult=3), args, {}, BF16)


def _mtp_shared_head_norm() -> Case:
    gen = torch.Generator().manual_seed(2)
    return Case(MTPSharedHeadRMSNorm(hidden=72), (_rows(2, 72, gen, 5), _weights(72, gen)[0], 1e-6), {}, BF16)


def _inv_rope_quant(packed_scales: bool) -> Callable[[], Case]:
    def case() -> Case:
        torch.manual_seed(5)
        o, positions, cos_sin = inv_rope_inputs(5)  # T = 5: three TMA padding rows of scales
        kw = dict(tma_aligned_scales=packed_scales, launch_pdl=False)
        return Case(InvRopeFP8Quant(), (o, positions, cos_sin, 2), kw)

    return case


RETURNS_OUT: dict[str, Callable[[], Case]] = {
    "pack_seq": _pack_seq,
    "unpack_seq": _unpack_seq,
    "global_topk": _global_topk,
    "swa_indices": _swa_indices,
    "combine_indices": _combine_indices,
    "swa_prefill_metadata": _swa_prefill_metadata,
    "indexer_chunk_metadata": _indexer_chunk_metadata,
    "indexer_q": _indexer_q,
    "indexer_q_mxfp4": _indexer_q_mxfp4,
    "mtp_input_norm": _mtp_input_norm,
    "mtp_shared_head_norm": _mtp_shared_head_norm,
}
#: Ops returning views of their out buffers: the inverse RoPE + quant (group-major values, MN-major scales).
RETURNS_VIEWS = {"inv_rope_quant": _inv_rope_quant(False), "inv_rope_quant_packed": _inv_rope_quant(True)}


def _garbage(t: torch.Tensor) -> torch.Tensor:
    """A fresh buffer like ``t`` (contiguous) holding what no kernel writes: NaN, 7777, 0x7F bytes."""
    buf = torch.empty(t.shape, dtype=t.dtype)
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.uint8):
        buf.view(torch.uint8).fill_(0x7F)
    elif t.dtype.is_floating_point:
        buf.fill_(float("nan"))
    else:
        buf.fill_(7777)
    return buf


def _like(result: Any) -> Any:
    """Garbage buffers nested as ``result`` is (a tensor, or tuples of them)."""
    return tuple(_like(r) for r in result) if isinstance(result, tuple) else _garbage(result)


def _leaves(x: Any) -> list[Any]:
    return [leaf for item in x for leaf in _leaves(item)] if isinstance(x, tuple) else [x]


def _names(x: Any, name: str = "out") -> list[str]:
    """The parameter name of each leaf of ``x`` as an op's error names it: ``out``, ``out[1]``, ``out[0][1]``."""
    if not isinstance(x, tuple):
        return [name]
    return [leaf for i, item in enumerate(x) for leaf in _names(item, f"{name}[{i}]")]


def _inv_rope_out(values: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Garbage buffers for the inverse RoPE + quant's outputs: ``[G, T, hpg * D]`` and ``[G, K, round_up(T, 4)]``."""
    return _garbage(values.transpose(0, 1)), _garbage(scale_storage(scale).view(scale.shape[1], scale.shape[2], -1))


def _same(got: torch.Tensor, want: torch.Tensor, tol: tuple[float, float]) -> None:
    if got.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        got, want = got.view(torch.uint8), want.view(torch.uint8)  # FP8 codes, exactly
    torch.testing.assert_close(got, want, rtol=tol[0], atol=tol[1])


# -- (a) the caller's tensors come back, written as without out ---------------------------------------------------
@pytest.mark.parametrize("op", RETURNS_OUT)
def test_out_is_returned_and_fully_written(op: str) -> None:
    case = RETURNS_OUT[op]()
    want = case()
    out = _like(want)
    got = case(out=out)
    assert len(_leaves(got)) == len(_leaves(out))
    for g, o, w in zip(_leaves(got), _leaves(out), _leaves(want)):
        assert g is o
        _same(g, w, case.tol)


@pytest.mark.parametrize("op", RETURNS_VIEWS)
def test_inv_rope_quant_returns_views_of_out(op: str) -> None:
    case = RETURNS_VIEWS[op]()
    want_values, want_scale = case()
    values, storage = _inv_rope_out(want_values, want_scale)
    got_values, got_scale = case(out=(values, storage))
    assert got_values.data_ptr() == values.data_ptr() and got_values.untyped_storage().data_ptr() == values.data_ptr()
    assert got_scale is not None and got_scale.untyped_storage().data_ptr() == storage.data_ptr()
    assert got_scale.stride() == want_scale.stride()  # MN-major, as fresh
    _same(got_values, want_values, EXACT)
    _same(got_scale, want_scale, EXACT)
    _same(storage.flatten(), scale_storage(want_scale), EXACT)  # the padding rows' zero scales too


def test_inv_rope_quant_without_quantize_takes_no_scales() -> None:
    o, positions, cos_sin = inv_rope_inputs(3)
    kernel = InvRopeFP8Quant()
    want, _ = kernel(o, positions, cos_sin, 2, quantize=False, launch_pdl=False)
    values = _garbage(want.transpose(0, 1))
    got, scale = kernel(o, positions, cos_sin, 2, quantize=False, launch_pdl=False, out=(values, None))
    assert scale is None and got.untyped_storage().data_ptr() == values.data_ptr()
    _same(got, want, EXACT)
    with pytest.raises(warmreg.LaunchError, match=re.escape("out[1] must be None")):
        kernel(o, positions, cos_sin, 2, quantize=False, launch_pdl=False, out=(values, torch.zeros(4)))


# -- (b) a bad buffer is refused, naming the parameter -----------------------------------------------------------
def _wrong_dtype(t: torch.Tensor) -> torch.Tensor:
    return torch.zeros(t.shape, dtype=torch.float64 if t.dtype != torch.float64 else torch.float32)


@pytest.mark.parametrize("op", RETURNS_OUT)
def test_bad_out_names_the_parameter(op: str) -> None:
    case = RETURNS_OUT[op]()
    good = _like(case())
    leaves, names = _leaves(good), _names(good)
    for i in {0, len(leaves) - 1}:  # the first buffer of the wrong dtype, the last of the wrong shape
        bad = _rebuild(good, {i: _wrong_dtype(leaves[i]) if i == 0 else _garbage(leaves[i][..., :-1])})
        with pytest.raises(warmreg.LaunchError, match=re.escape(f"{names[i]} is ")):
            case(out=bad)
    if isinstance(good, tuple):
        with pytest.raises(warmreg.LaunchError, match=r"out must be a tuple of \d buffers"):
            case(out=good[:-1])


def _rebuild(x: Any, replace: dict[int, torch.Tensor], start: int = 0) -> Any:
    """``x`` with its leaves numbered in ``replace`` swapped (leaves counted from ``start``)."""
    if not isinstance(x, tuple):
        return replace.get(start, x)
    items, i = [], start
    for item in x:
        items.append(_rebuild(item, replace, i))
        i += len(_leaves(item))
    return tuple(items)


# -- with out, the launch code allocates nothing ------------------------------------------------------------------
class _Allocations(TorchFunctionMode):
    """Records the tensor factories called under it (what launch code allocates)."""

    FACTORIES = frozenset(
        "empty zeros ones full empty_like zeros_like ones_like full_like empty_strided tensor arange cat clone "
        "new_empty new_zeros new_ones new_full new_tensor new_empty_strided".split()
    )

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in self.FACTORIES:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _uniform_decode() -> tuple[Case, Any]:
    seq_lens, table = torch.tensor([9, 3], dtype=I32), _rand(torch.Generator().manual_seed(0), (2, 9))
    bufs = (torch.full((8,), -5, dtype=I32), torch.full((8, 5), -5, dtype=I32), torch.full((8,), -5, dtype=I32))
    return Case(PrepareUniformDecode(), (seq_lens, table), {"max_decode_len": 2}), bufs


def _c128a() -> tuple[Case, Any]:
    b = _mla_batch(7, decodes=3, prefills=2)
    block_table = _mla_block_table(2, b.num_reqs, triton.cdiv(C128_MAX_MODEL_LEN // 128, 2))
    kw = dict(num_decode_tokens=b.num_decode_tokens, max_compressed_tokens=256, block_size=2)
    bufs = (torch.full((16, 384), 99, dtype=I32), torch.full((16,), 99, dtype=I32), torch.full((16, 384), 99, dtype=I32))
    return Case(C128ATopkMetadata(), (b.positions, b.token_to_req, block_table, b.slot_mapping), kw), bufs


def _compressed_slot_mapping() -> tuple[Case, Any]:
    gen = torch.Generator().manual_seed(1)
    qsl, seq_lens = _metadata_batch(gen, decodes=3, prefills=2, max_model_len=600)
    n = int(qsl[-1])
    args = (torch.randint(0, 10**6, (n,), generator=gen), qsl, seq_lens, _rand(gen, (5, 3)))
    kw = dict(num_tokens=n, block_size=64, compress_ratio=4)
    return Case(CompressedSlotMapping(compress_ratios=(4,)), args, kw), torch.zeros(n + 4, dtype=torch.int64)


def _flashinfer_indices() -> tuple[Case, Any]:
    step = _fi_step(3, decodes=3, prefills=2)
    args, kw = _layer_inputs(step, 4)
    T = step.positions.shape[0]
    return Case(FlashInferMixedSparseIndices(window_size=FI_WINDOW), args, kw), (
        torch.full((T + 4, 64), 77, dtype=I32),
        torch.full((T + 4,), 77, dtype=I32),
    )


def _dspark_swa_indices() -> tuple[Case, Any]:
    d, width = _draft([5, 300], 5), dspark_swa_index_width(128, 5)
    kw = dict(num_tokens=10, window_size=128, index_width=width, block_size=DSPARK_PAGE)
    bufs = (torch.full((12, 1, width), 7, dtype=I32), torch.full((12,), 7, dtype=I32))
    return Case(DSparkSwaIndices(), (d.qsl, d.seq_lens, d.token_to_req, d.is_valid, d.block_table), kw), bufs


def _dspark_inputs() -> tuple[Case, Any]:
    t = dspark_inputs_tests
    step = t._step([1, 1 + t.N], seed=3)
    kw: dict[str, Any] = dict(
        block_size=t.PAGE, parallel_drafting_token_id=t.NOISE, num_query_per_req=t.N, num_speculative_steps=t.N,
        max_num_reqs=t.MAX_REQS, max_num_tokens=t.MAX_TOKENS, num_reqs=step.pop("num_reqs"), max_query_len=1 + t.N,
        max_model_len=step.pop("max_model_len"),
    )  # fmt: skip
    return Case(DSparkInputs(), tuple(step.values()), kw), t._stale(t.MAX_TOKENS)


def _exact(build: Callable[[], Case]) -> Callable[[], tuple[Case, Any]]:
    """A case whose ``out`` mirrors the fresh outputs (``None``: made from them)."""
    return lambda: (build(), None)


#: Every allocating op with an ``out`` it takes: exact buffers, or the persistent ones of the ops that had them.
WITH_OUT: dict[str, Callable[[], tuple[Case, Any]]] = {
    **{op: _exact(build) for op, build in {**RETURNS_OUT, **RETURNS_VIEWS}.items()},
    "uniform_decode": _uniform_decode,
    "c128a_topk_metadata": _c128a,
    "compressed_slot_mapping": _compressed_slot_mapping,
    "flashinfer_indices": _flashinfer_indices,
    "dspark_swa_indices": _dspark_swa_indices,
    "dspark_inputs": _dspark_inputs,
}


@pytest.mark.parametrize("op", WITH_OUT)
def test_launch_with_out_allocates_nothing(op: str) -> None:
    case, out = WITH_OUT[op]()
    launch_code = inspect.unwrap(type(case.kernel).__call__)  # the decorated method: the LaunchSpec, no launch
    with _Allocations() as fresh:
        outputs = launch_code(case.kernel, *case.args, **case.kwargs).outputs
    assert fresh.calls  # the probe sees the fresh outputs
    if out is None:
        out = _inv_rope_out(*outputs) if op in RETURNS_VIEWS else _like(outputs)
    with _Allocations() as given:
        spec = launch_code(case.kernel, *case.args, **case.kwargs, out=out)
    assert not given.calls, given.calls
    assert isinstance(spec, warmreg.LaunchSpec)


# -- the persistent-buffer ops: out= is their keywords as one tuple ----------------------------------------------
@pytest.mark.parametrize("op", ["uniform_decode", "c128a_topk_metadata"])
def test_out_tuple_is_the_buffer_keywords(op: str) -> None:
    case, bufs = WITH_OUT[op]()
    names = {"uniform_decode": ("decode_seq_lens", "expanded_block_table", "decode_lens")}.get(
        op, ("global_decode", "decode_lens", "prefill_local")
    )
    keyed = tuple(b.clone() for b in bufs)
    want = case(**dict(zip(names, keyed)))
    got = case(out=bufs)
    for g, w, b, k in zip(got, want, bufs, keyed):
        assert g.data_ptr() == b.data_ptr() and torch.equal(g, w) and torch.equal(b, k)
    with pytest.raises(warmreg.LaunchError, match=f"out and {names[1]} are both given"):
        case(out=bufs, **{names[1]: keyed[1]})
    with pytest.raises(warmreg.LaunchError, match=names[0]):
        case(out=(bufs[0].long(), *bufs[1:]))
