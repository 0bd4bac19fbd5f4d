"""DeepSeek-V4.1's specialized-decode key store (FP32 ``k_pre``, MXFP4 pages): against the PyTorch reference under
Triton's interpreter, a hand-computed key, the shared store's bytes for bf16-exact rows, which rows are written,
padded pages, errors, and the plan: only under ``serving.decode_backend`` ``latency_specialized``, on ``cuda:103``.

Tolerances: the interpreter truncates fp32 to bf16 where the reference (and the GPU) rounds to nearest even, so a
loaded or normed value may differ by one bf16 step (2^-8 relative) before quantization: scale bytes are equal (the
block maxima stay inside their binade for these inputs) and E2M1 codes agree in sign and within one grid step. The
comparison with vLLM's own kernel (tests/engines/test_vllm034_kernels_dsv41_specialized.py) is bitwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from warmreg_deepseek_v4 import v41_specialized_k_store
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.v41_indexer_k_store import V41IndexerKStore
from warmreg_deepseek_v4.v41_specialized_k_store import V41SpecializedKStore, v41_specialized_k_store_reference

import warmreg
from warmreg.testing import OpCall, RegisterPlugin, assert_warmup_inputs_reproduce, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
NAME = V41SpecializedKStore.name
BS, HEAD, ROW = 4, 128, 68  # MXFP4 rows: 64 nibble bytes + 4 scales
#: What vLLM's specialized decode requires, as serving settings (v41_specialized's docstring).
SPECIALIZED = {
    "decode_backend": "latency_specialized", "tensor_parallel_size": 4, "speculative_method": "dspark",
    "num_speculative_tokens": 5, "attention_backend": "FLASHINFER_MLA_SPARSE_DSV41", "kv_cache_dtype": "fp8",
    "indexer_kv_dtype": "mxfp4",
}  # fmt: skip


def _v41(**serving: Any) -> dict[str, Any]:
    config = example_config("deepseek_v41")
    config["serving"].update(serving)
    return config


def _inputs(seed: int, bf16_exact: bool = False) -> tuple[tuple[Any, ...], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    T = 7
    k_pre = torch.randn(T + 1, HEAD + 8, generator=g) * 3  # the GEMM's fp32 accumulation
    if bf16_exact:
        k_pre = k_pre.bfloat16().float()
    k_pre = k_pre[1:, 3 : 3 + HEAD]  # an offset view with a padded row stride
    positions = torch.tensor([0, 1, 2, 3, 5, 8, 11])
    cos_sin = torch.randn(16, 64, generator=g)
    weight = (torch.rand(HEAD, generator=g) + 0.5).bfloat16()
    pages = torch.full((3, BS * ROW + 40), 0xAB, dtype=torch.uint8)  # padded pages: the tail is never written
    cache = pages[:, : BS * ROW].unflatten(1, (BS, ROW))
    slots = torch.tensor([5, 0, 9, -1, 2, 7, 11])
    return (k_pre, positions, cos_sin, weight, 1e-6, cache, slots), slots


def _nibbles_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """E2M1 codes (two a byte) with the same sign and magnitudes one grid step apart at most (bf16 truncation)."""
    g = torch.stack([got.int() & 15, got.int() >> 4], -1)
    w = torch.stack([want.int() & 15, want.int() >> 4], -1)
    same_sign = ((g & 8) == (w & 8)) | ((g & 7) == 0) | ((w & 7) == 0)
    assert (same_sign & ((g & 7) - (w & 7)).abs().le(1)).all()


@pytest.mark.parametrize("ratio", [2, 1])
def test_matches_reference(ratio: int) -> None:
    args, slots = _inputs(3 + ratio)
    want = v41_specialized_k_store_reference(*args[:5], args[5].clone(), args[6], ratio)
    got = V41SpecializedKStore()(*args, ratio)
    written = [int(s) for s, p in zip(slots, args[1], strict=True) if s >= 0 and (p + 1) % ratio == 0]
    assert written == ([0, 2, 11] if ratio == 2 else [5, 0, 9, 2, 7, 11])  # slot -1 (position 3) is skipped
    flat = tuple(c.as_strided((3, BS * ROW), (c.stride(0), 1)) for c in (got, want))
    written_bytes = torch.zeros_like(flat[0], dtype=torch.bool)
    for s in written:
        page, j = divmod(s, BS)
        values, scales = slice(j * 64, (j + 1) * 64), slice(BS * 64 + 4 * j, BS * 64 + 4 * j + 4)
        written_bytes[page, values] = written_bytes[page, scales] = True
        assert torch.equal(flat[0][page, scales], flat[1][page, scales])
        _nibbles_close(flat[0][page, values], flat[1][page, values])
    assert (flat[0][~written_bytes] == 0xAB).all()  # the other rows, their scales and the page padding: untouched


def test_bf16_exact_rows_write_the_shared_stores_bytes() -> None:
    """The module docstring's claim: for a GEMM row that is exactly bf16, the FP32 store writes what the shared MXFP4
    store writes for that bf16 row (same kernel operations after the load: bitwise, interpreter or not)."""
    args, _ = _inputs(11, bf16_exact=True)
    ours = V41SpecializedKStore()(*args[:5], args[5].clone(), args[6], 2)
    shared = V41IndexerKStore()(args[0].bfloat16(), *args[1:5], args[5].clone(), args[6], compress_ratio=2,
                                use_fp4_cache=True)  # fmt: skip
    assert torch.equal(ours, shared)


def test_one_hot_key_by_hand() -> None:
    """k_pre = e_0: normed to sqrt(128) -> bf16 11.3125 at dim 0 (RoPE dims untouched: cos 1, sin 0). Block 0:
    k = ceil(log2(11.3125 / 6)) = 1, 11.3125 / 2 = 5.66 -> E2M1 6 (code 7); the zero blocks: k = -126 (amax floor)."""
    k_pre = torch.zeros(1, HEAD)
    k_pre[0, 0] = 1.0
    cos_sin = torch.cat([torch.ones(4, 32), torch.zeros(4, 32)], dim=1)
    cache = torch.zeros(1, BS, ROW, dtype=torch.uint8)
    V41SpecializedKStore()(k_pre, torch.tensor([1]), cos_sin, torch.ones(HEAD, dtype=torch.bfloat16), 0.0, cache,
                           torch.tensor([1]), 2)  # fmt: skip
    page = cache.view(-1)  # slot 1: nibbles at bytes [64, 128), its scales at 4 * 64 + 4
    assert page[64:128].tolist() == [7] + [0] * 63
    assert page[BS * 64 + 4 : BS * 64 + 8].tolist() == [128, 1, 1, 1]
    assert page[:64].eq(0).all() and page[BS * 64 : BS * 64 + 4].eq(0).all()  # slot 0: untouched


def test_empty_step_launches_nothing() -> None:
    args, _ = _inputs(1)
    before = args[5].clone()
    V41SpecializedKStore()(args[0], args[1], *args[2:6], args[6][:0], 2)
    assert torch.equal(args[5], before)


def test_errors_name_the_argument() -> None:
    args, _ = _inputs(1)
    op = V41SpecializedKStore()
    with pytest.raises(warmreg.LaunchError, match="k_pre must be float32"):
        op(args[0].bfloat16(), *args[1:], 2)
    with pytest.raises(warmreg.LaunchError, match="k_cache must be uint8"):
        op(*args[:5], torch.zeros(3, BS, 132, dtype=torch.uint8), args[6], 2)  # an FP8 page
    with pytest.raises(warmreg.LaunchError, match="kv_slot_mapping must be contiguous 1-D int64"):
        op(*args[:6], args[6].int(), 2)
    with pytest.raises(warmreg.LaunchError, match="positions must be int64"):
        op(args[0], args[1][:3], *args[2:], 2)
    with pytest.raises(warmreg.LaunchError, match="compress_ratio must be 1 or 2"):
        op(*args, 4)


# -- the plan ----------------------------------------------------------------------------------------------------------
def test_specialized_decode_plans_the_key_store_on_gb300() -> None:
    """One key a ratio of the owning index sources: 2 (layers 2, 8, 14) and 1 (20 to 36)."""
    plan = warmreg.plan(_v41(**SPECIALIZED), target="cuda:103")
    assert [key.fields() for key in sorted(plan.kernel(NAME).keys, key=lambda k: k.compress_ratio)] == [
        {"head_dim": 128, "rope_dim": 64, "compress_ratio": ratio, "weight_dtype": "bfloat16",
         "cos_sin_dtype": "float32", "num_warps": 1, "launch_pdl": False}
        for ratio in (1, 2)
    ]  # fmt: skip
    assert_warmup_inputs_reproduce(plan.kernel(NAME).kernel, plan.kernel(NAME).keys)
    cache = warmreg.meta((1000, 128, ROW), torch.uint8, stride=(128 * 132 + 64, ROW, 1))
    for t, ratio in ((1, 2), (6, 2), (8, 2), (1, 1), (8, 1)):  # the low-batch steps: up to LOW_BATCH_MAX_ROWS rows
        gemm = warmreg.meta((t, 128), torch.float32)
        call = OpCall(plan.kernel(NAME).kernel, (gemm, warmreg.meta((t,), torch.int64), warmreg.meta((2**20, 64), torch.float32),
                      warmreg.meta((128,), torch.bfloat16), 1e-6, cache, warmreg.meta((t,), torch.int64), ratio), {})  # fmt: skip
        assert call.launch_code().key in plan.kernel(NAME).keys


def test_stock_decode_plans_nothing() -> None:
    for target in ("cuda:90", "cuda:100"):
        assert NAME not in {k.name for k in warmreg.plan(EXAMPLES / "deepseek_v41.json", target=target).kernels}
    auto = _v41(**{**SPECIALIZED, "decode_backend": "auto"})
    assert NAME not in {k.name for k in warmreg.plan(auto, target="cuda:103").kernels}


@pytest.mark.parametrize(
    ("target", "change", "missing"),
    [
        ("cuda:100", {}, "GB300"),
        ("cuda:103", {"tensor_parallel_size": 8}, "tensor parallel size 4"),
        ("cuda:103", {"speculative_method": "mtp"}, "DSpark"),
        ("cuda:103", {"indexer_kv_dtype": "fp8"}, "MXFP4 indexer"),
        ("cuda:103", {"kv_cache_dtype": "auto"}, "fp8 KV cache"),
    ],
)
def test_vllm_refusals_are_config_errors(target: str, change: dict[str, Any], missing: str) -> None:
    with pytest.raises(warmreg.ConfigError, match=rf"serving\.decode_backend.*{missing}"):
        warmreg.plan(_v41(**{**SPECIALIZED, **change}), target=target)


def test_unknown_decode_backend_is_refused() -> None:
    with pytest.raises(warmreg.ConfigError, match=r"serving\.decode_backend"):
        warmreg.plan(_v41(**{**SPECIALIZED, "decode_backend": "fast"}), target="cuda:103")


def test_warm_cross_compiles() -> None:
    plugin = RegisterPlugin(v41_specialized_k_store.register, model=DSV4.from_config)
    report = warmreg.warm(_v41(**SPECIALIZED), target="cuda:103", plugins=[plugin], entry_points=False)
    assert report.ok and report.compiled == 2, [(r.kernel, r.error) for r in report.failed]
