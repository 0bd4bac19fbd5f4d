"""DeepSeek-V4.1's indexer key store: against the PyTorch reference under Triton's interpreter (FP8 with float32 and
MX scales, MXFP4), which rows are written, padded pages, errors, and the plan of examples/deepseek_v41.json.

Tolerances: the interpreter truncates fp32 to bf16 where the reference (and the GPU) rounds to nearest even, so a
normed value may differ by one bf16 step (2^-8 relative) before quantization. Scales therefore agree within one
power of two and quantized values are compared dequantized: FP8 E4M3 within 2^-4 relative (half its 3-bit mantissa
step) plus the bf16 step, MXFP4 within its coarsest grid step (one unit at the block's scale). The comparison with
vLLM's own kernel (tests/engines/test_vllm034_kernels_dsv41_indices.py) is bitwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from warmreg_deepseek_v4 import v41_indexer_k_store
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.v41_indexer_k_store import V41IndexerKStore, row_bytes, v41_indexer_k_store_reference

import warmreg
from warmreg.testing import OpCall, RegisterPlugin, assert_warmup_inputs_reproduce, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
NAME = V41IndexerKStore.name
BS, HEAD = 4, 128


def _v41(**serving: Any) -> dict[str, Any]:
    config = example_config("deepseek_v41")
    config["serving"].update(serving)
    return config


def _inputs(seed: int, fp4: bool, ratio: int = 2) -> tuple[tuple[Any, ...], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    T = 7
    k_pre = (torch.randn(T + 1, HEAD, generator=g) * 3).bfloat16()[1:]  # an offset view
    positions = torch.tensor([0, 1, 2, 3, 5, 8, 11])
    cos_sin = torch.randn(16, 64, generator=g)
    weight = (torch.rand(HEAD, generator=g) + 0.5).bfloat16()
    row = row_bytes(HEAD, fp4)
    pages = torch.full((3, BS * row + 40), 0xAB, dtype=torch.uint8)  # padded pages: the tail is never written
    cache = pages[:, : BS * row].unflatten(1, (BS, row))
    slots = torch.tensor([5, 0, 9, -1, 2, 7, 11])
    return (k_pre, positions, cos_sin, weight, 1e-6, cache, slots), slots


def _codes_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """e4m3fn bytes equal up to Triton 3.8's interpreter: a code may move by one (bf16 truncation), or by 8 where the
    reference's rounding carries into the next binade (the interpreter drops the carry)."""
    g, w = got.int(), want.int()
    carry = ((w & 0x7) == 0) & ((w & 0x7F) - (g & 0x7F) == 8)
    bad = ~(((g & 0x80) == (w & 0x80)) & (((g - w).abs() <= 1) | carry))
    assert not bad.any(), f"{int(bad.sum())} codes differ: got {g[bad][:8].tolist()}, want {w[bad][:8].tolist()}"


def _nibbles_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """E2M1 codes (two a byte) with the same sign and magnitudes one grid step apart at most (bf16 truncation)."""
    g = torch.stack([got.int() & 15, got.int() >> 4], -1)
    w = torch.stack([want.int() & 15, want.int() >> 4], -1)
    same_sign = ((g & 8) == (w & 8)) | ((g & 7) == 0) | ((w & 7) == 0)
    assert (same_sign & ((g & 7) - (w & 7)).abs().le(1)).all()


@pytest.mark.parametrize(("fp4", "mx"), [(False, False), (False, True), (True, False)])
def test_matches_reference(fp4: bool, mx: bool) -> None:
    args, slots = _inputs(3, fp4)
    want = v41_indexer_k_store_reference(*args[:5], args[5].clone(), args[6], compress_ratio=2, use_fp4_cache=fp4,
                                         mx_scale=mx)  # fmt: skip
    got = V41IndexerKStore()(*args, compress_ratio=2, use_fp4_cache=fp4, mx_scale=mx)
    written = [int(s) for s, p in zip(slots, args[1], strict=True) if s >= 0 and (p + 1) % 2 == 0]
    assert written == [0, 2, 11]  # positions 1, 5 and 11 end a group; slot -1 at position 3 is skipped
    span = BS * got.shape[2]  # a page's bytes (the padding after them is not the cache's)
    flat = tuple(c.as_strided((3, span), (c.stride(0), 1)) for c in (got, want))
    vb, written_bytes = HEAD // 2 if fp4 else HEAD, torch.zeros_like(flat[0], dtype=torch.bool)
    for s in written:
        page, j = divmod(s, BS)
        values, scales = slice(j * vb, (j + 1) * vb), slice(BS * vb + 4 * j, BS * vb + 4 * j + 4)
        written_bytes[page, values] = written_bytes[page, scales] = True
        assert torch.equal(flat[0][page, scales], flat[1][page, scales])  # powers of two: equal
        (_nibbles_close if fp4 else _codes_close)(flat[0][page, values], flat[1][page, values])
    assert (flat[0][~written_bytes] == 0xAB).all()  # the other rows and their scales: untouched


def test_fp8_scale_is_the_power_of_two_above_amax() -> None:
    """A key of 448 * 2^3 / rms-normalized: every value exact, the scale 2^e with e = ceil(log2(amax / 448))."""
    k_pre = torch.zeros(1, HEAD, dtype=torch.bfloat16)
    k_pre[0, 0] = 1.0  # normed: sqrt(128) at dim 0, 0 elsewhere (RoPE dims untouched: cos 1, sin 0)
    cos_sin = torch.cat([torch.ones(4, 32), torch.zeros(4, 32)], dim=1)
    cache = torch.zeros(1, BS, 132, dtype=torch.uint8)
    V41IndexerKStore()(k_pre, torch.tensor([1]), cos_sin, torch.ones(HEAD, dtype=torch.bfloat16), 0.0, cache,
                       torch.tensor([1]), compress_ratio=2, use_fp4_cache=False)  # fmt: skip
    page = cache.view(-1)  # slot 1: values at bytes [128, 256), its scale at 4 * 128 + 4
    assert page[BS * HEAD + 4 : BS * HEAD + 8].view(torch.float32).item() == 2.0**-5  # ceil(log2(11.3125 / 448))
    # e4m3(11.3125 * 32 = 362) = 352, the other dims 0
    assert page[HEAD : 2 * HEAD].view(torch.float8_e4m3fn).float().tolist() == [352.0] + [0.0] * 127


def test_errors_name_the_argument() -> None:
    args, _ = _inputs(1, False)
    op = V41IndexerKStore()
    with pytest.raises(warmreg.LaunchError, match="k_pre must be bf16"):
        op(args[0].float(), *args[1:], compress_ratio=2, use_fp4_cache=False)
    with pytest.raises(warmreg.LaunchError, match="k_cache must be uint8"):
        op(*args, compress_ratio=2, use_fp4_cache=True)
    with pytest.raises(warmreg.LaunchError, match="kv_slot_mapping must be contiguous 1-D int64"):
        op(*args[:6], args[6].int(), compress_ratio=2, use_fp4_cache=False)
    with pytest.raises(warmreg.LaunchError, match="compress_ratio must be 1 or 2"):
        op(*args, compress_ratio=4, use_fp4_cache=False)


# -- the plan ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("target", "mx"), [("cuda:90", False), ("cuda:100", True)])
def test_example_plans_the_kv_source_indexers(target: str, mx: bool) -> None:
    """The owning index sources 2, 8 and 14 compress at ratio 2, 20 to 36 at ratio 1: one key each."""
    plan = warmreg.plan(EXAMPLES / "deepseek_v41.json", target=target)
    got = {
        (k.fields()["compress_ratio"], k.fields()["use_fp4_cache"], k.fields()["mx_scale"])
        for k in plan.kernel(NAME).keys
    }
    assert got == {(1, False, mx), (2, False, mx)}
    assert_warmup_inputs_reproduce(plan.kernel(NAME).kernel, plan.kernel(NAME).keys)
    cache = warmreg.meta((1000, 128, 132), torch.uint8, stride=(128 * 132 + 64, 132, 1))
    latent = warmreg.meta((8192, 128), torch.bfloat16)
    for t, ratio in ((1, 2), (77, 2), (1, 1), (77, 1)):
        call = OpCall(plan.kernel(NAME).kernel, (latent[:t], warmreg.meta((t,), torch.int64), warmreg.meta((2**20, 64), torch.float32),
                      warmreg.meta((128,), torch.bfloat16), 1e-6, cache, warmreg.meta((t,), torch.int64)),
                      {"compress_ratio": ratio, "use_fp4_cache": False, "mx_scale": mx})  # fmt: skip
        assert call.launch_code().key in plan.kernel(NAME).keys


def test_mxfp4_cache_only_on_sm100_and_owners_only() -> None:
    keys = warmreg.plan(_v41(indexer_kv_dtype="mxfp4"), target="cuda:100").kernel(NAME).keys
    assert {(k.fields()["compress_ratio"], k.fields()["use_fp4_cache"], k.fields()["mx_scale"]) for k in keys} == {
        (1, True, False), (2, True, False)
    }  # fmt: skip
    with pytest.raises(warmreg.ConfigError, match=r"serving\.indexer_kv_dtype"):
        warmreg.plan(_v41(indexer_kv_dtype="mxfp4"), target="cuda:90")
    config = _v41()
    config["model"]["text_config"]["kv_source_layer_ids"] = [3, 9]  # no index source owns its keys
    assert NAME not in {k.name for k in warmreg.plan(config, target="cuda:90").kernels}


def test_warm_cross_compiles() -> None:
    plugin = RegisterPlugin(v41_indexer_k_store.register, model=DSV4.from_config)
    report = warmreg.warm(_v41(), target="cuda:100", plugins=[plugin], entry_points=False)
    assert report.ok and report.compiled == 2, [(r.kernel, r.error) for r in report.failed]
