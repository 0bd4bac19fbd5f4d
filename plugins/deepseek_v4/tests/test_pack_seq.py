"""Ragged pack / unpack of the C4 indexer's padded decode: exact equality with the PyTorch references (Triton
interpreter on CPU), registration, warm coverage, a real cross-compile.

FP8 is compared as bytes (``.view(torch.uint8)``). The ``-inf`` pad has no e4m3fn encoding, so what the cast
writes is implementation-defined (PyTorch saturates to -448, a GPU's ``cvt`` may differ): FP8 pad slots are masked
out, as downstream the context lens mask them, and the pad itself is checked exactly with float32 and uint8 x.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import triton
from warmreg_deepseek_v4 import pack_seq, unpack_seq
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.pack_seq import PackSeq, pack_seq_reference
from warmreg_deepseek_v4.unpack_seq import UnpackSeq, unpack_seq_reference

import warmreg
from warmreg.testing import OpCall, RegisterPlugin, check_out, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
FLASH = EXAMPLES / "deepseek_v4_flash.json"
NAMES = {"deepseek_v4.pack_seq", "deepseek_v4.unpack_seq"}
#: Triton 3.6 and 3.7's interpreter cannot hold an e4m3fnuz tensor ("fail to convert fp8e4b8 to ir
#: type"); from 3.8 it can. The e4m3fnuz key is still planned and cross-compiled for gfx942 below.
FNUZ_INTERPRETED = tuple(int(p) for p in triton.__version__.split(".")[:2]) >= (3, 8)
FP8 = [
    torch.float8_e4m3fn,
    pytest.param(torch.float8_e4m3fnuz, marks=pytest.mark.skipif(not FNUZ_INTERPRETED, reason="Triton < 3.8's interpreter has no e4m3fnuz")),
]
LENGTHS = [[2], [2, 1, 2], [1] * 64, [0, 2], [65, 3], [0]]  # [1]*64: 256 rows are slow in the interpreter


def _fp8(n: int, d: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, d, generator=gen) * 100).to(dtype)


def _live(lengths: list[int], d: int) -> torch.Tensor:
    """bool ``[B, Lmax, d]``: the slots the pack copies (the rest are pad)."""
    t = torch.arange(max(lengths, default=0))
    return (t[None, :] < torch.tensor(lengths)[:, None])[..., None].expand(-1, -1, d)


@pytest.mark.parametrize("lengths", LENGTHS, ids=str)
@pytest.mark.parametrize("d", [512, 100])
@pytest.mark.parametrize("dtype", FP8)
def test_pack_fp8_matches_reference(lengths: list[int], d: int, dtype: torch.dtype) -> None:
    n = sum(lengths) + 3  # sum(lengths) < N: trailing rows are ignored
    x, lens = _fp8(n, d, dtype, len(lengths) + d), torch.tensor(lengths, dtype=torch.int32)
    got, want = PackSeq()(x, lens), pack_seq_reference(x, lens)
    assert got.shape == want.shape == (len(lengths), max(lengths), d) and got.dtype == dtype
    live = _live(lengths, d)
    assert torch.equal(got.view(torch.uint8)[live], want.view(torch.uint8)[live])


def test_pack_fp8_q_shape_and_host_lengths() -> None:
    """The indexer's call: q_fp8 ``[Td, H, D]`` (trailing dims flattened, kept in the output); host lengths."""
    lengths = [2, 1, 2]
    x = _fp8(6, 4 * 128, torch.float8_e4m3fn, 0).view(6, 4, 128)
    lens = torch.tensor(lengths, dtype=torch.int32)
    got = PackSeq()(x, lens, lengths_host=lengths)
    want = pack_seq_reference(x, lens)
    assert got.shape == (3, 2, 4, 128)
    live = _live(lengths, 4 * 128).reshape(3, 2, 4, 128)
    assert torch.equal(got.view(torch.uint8)[live], want.view(torch.uint8)[live])


@pytest.mark.parametrize(("dtype", "pad"), [(torch.float32, float("-inf")), (torch.uint8, 0.0)])
@pytest.mark.parametrize("lengths", [[2, 1, 2], [0, 2], [65, 3]], ids=str)
def test_pack_pad_is_exact(dtype: torch.dtype, pad: float, lengths: list[int]) -> None:
    """The pad itself, where the dtype holds it: -inf (float32) and the FP4 values' uint8 0."""
    x = torch.randint(1, 255, (sum(lengths) + 1, 100), dtype=torch.int32).to(dtype)
    lens = torch.tensor(lengths, dtype=torch.int32)
    got, want = PackSeq()(x, lens, pad_value=pad), pack_seq_reference(x, lens, pad_value=pad)
    assert torch.equal(got, want)
    assert bool((got[~_live(lengths, 100)] == pad).all())


@pytest.mark.parametrize("lengths", LENGTHS, ids=str)
@pytest.mark.parametrize("d", [512, 100])
def test_unpack_matches_reference(lengths: list[int], d: int) -> None:
    lmax = max(max(lengths), 2)  # the top-k is [B, next_n, topk]: Lmax can exceed every length
    gen = torch.Generator().manual_seed(d)
    packed = torch.randint(-1, 1 << 20, (len(lengths), lmax, d), generator=gen, dtype=torch.int32)
    lens = torch.tensor(lengths, dtype=torch.int32)
    got, want = UnpackSeq()(packed, lens), unpack_seq_reference(packed, lens)
    assert got.shape == (sum(lengths), d) and torch.equal(got, want)


def test_unpack_inverts_pack() -> None:
    lengths = [2, 1, 2, 0, 1]
    x = torch.randint(-1, 1000, (7, 100), dtype=torch.int32)
    lens = torch.tensor(lengths, dtype=torch.int32)
    packed = PackSeq()(x, lens, pad_value=0.0)
    assert torch.equal(UnpackSeq()(packed, lens), x[: sum(lengths)])


def test_empty_batches_and_bad_inputs() -> None:
    x = _fp8(4, 64, torch.float8_e4m3fn, 0)
    empty = torch.zeros(0, dtype=torch.int32)
    assert PackSeq()(x, empty).shape == (0, 0, 64)
    assert UnpackSeq()(torch.zeros(0, 2, 64, dtype=torch.int32), empty).shape == (0, 64)
    with pytest.raises(warmreg.LaunchError, match="summing to <= N=4"):
        PackSeq()(x, torch.tensor([3, 2], dtype=torch.int32))
    with pytest.raises(warmreg.LaunchError, match="int32"):
        PackSeq()(x, torch.tensor([1, 2]))
    with pytest.raises(warmreg.LaunchError, match="contiguous"):
        PackSeq()(x.t(), torch.tensor([1], dtype=torch.int32))
    with pytest.raises(warmreg.LaunchError, match="uint8 pad"):
        PackSeq()(x.view(torch.uint8), torch.tensor([1], dtype=torch.int32), pad_value=float("-inf"))
    with pytest.raises(warmreg.LaunchError, match=r"in \[0, Lmax=2\]"):
        UnpackSeq()(torch.zeros(2, 2, 64, dtype=torch.int32), torch.tensor([3, 1], dtype=torch.int32))


# -- registration and warm coverage -----------------------------------------------------------------
def _plan(config: object, target: str) -> warmreg.Plan:
    plugin = RegisterPlugin(pack_seq.register, unpack_seq.register, model=DSV4.from_config)
    return warmreg.plan(config, target=target, plugins=[plugin], entry_points=False)


@pytest.mark.parametrize(
    ("target", "fp8"),
    [("cuda:90", "float8_e4m3fn"), ("rocm:gfx942", "float8_e4m3fnuz"), ("rocm:gfx950", "float8_e4m3fn"), ("xpu:pvc", "float8_e4m3fn")],
)  # fmt: skip
def test_planned_where_the_indexer_pads(target: str, fp8: str) -> None:
    plan = _plan(FLASH, target)
    assert {k.name for k in plan.kernels} == NAMES
    (pack,) = plan.kernel("deepseek_v4.pack_seq").keys
    (unpack,) = plan.kernel("deepseek_v4.unpack_seq").keys
    assert (pack.dtype, pack.pad_value, pack.pad_is_uint8, pack.block_t, pack.block_d) == (fp8, "-inf", False, 64, 64)
    assert (pack.num_warps, pack.num_stages) == (4, 2)
    assert (unpack.dtype, unpack.block_t, unpack.block_d) == ("int32", 64, 64)


@pytest.mark.parametrize("target", ["cuda:100", "cuda:103"])
def test_not_planned_on_sm10x(target: str) -> None:
    assert not _plan(FLASH, target).kernels


@pytest.mark.parametrize("example", ["deepseek_v4_flash", "deepseek_v4_pro"])
def test_not_planned_without_speculation(example: str) -> None:
    assert not _plan(example_config(example, num_speculative_tokens=0), "cuda:90").kernels
    assert {k.name for k in _plan(example_config(example, num_speculative_tokens=3), "cuda:90").kernels} == NAMES


def test_runtime_keys_are_planned() -> None:
    """The indexer's runtime tensors (q_fp8 prefix, the fresh top-k) give the planned keys."""
    plan = _plan(FLASH, "cuda:90")
    q = warmreg.meta((8192, 64, 128), torch.float8_e4m3fn)[:37]
    assert PackSeq().dispatch(x=q, pad_value=float("-inf")) in plan.kernel("deepseek_v4.pack_seq").keys
    topk = warmreg.meta((2 * 19, 512), torch.int32).view(19, 2, 512)
    assert UnpackSeq().dispatch(packed=topk) in plan.kernel("deepseek_v4.unpack_seq").keys


def test_warm_cross_compiles() -> None:
    plugin = RegisterPlugin(pack_seq.register, unpack_seq.register, model=DSV4.from_config)
    report = warmreg.warm(FLASH, target="cuda:90", plugins=[plugin], entry_points=False, workers=2)
    assert report.ok, [(r.kernel, str(r.key), r.error) for r in report.failed]
    assert len(report.results) == 2


# -- out= (the kit's check_out: returned and fully written, wrong buffers refused, nothing allocated) ------------
def _pack_seq_call() -> OpCall:
    return OpCall(PackSeq(), (_fp8(6, 100, torch.float8_e4m3fn, 0), torch.tensor([2, 1, 2], dtype=torch.int32)))


def _unpack_seq_call() -> OpCall:
    packed = torch.randint(-1, 1 << 20, (3, 2, 100), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    return OpCall(UnpackSeq(), (packed, torch.tensor([2, 0, 1], dtype=torch.int32)))


@pytest.mark.parametrize("build", [_pack_seq_call, _unpack_seq_call], ids=["pack_seq", "unpack_seq"])
def test_out(build: Callable[[], OpCall]) -> None:
    check_out(build)
