"""The DSA fused prologue (FP8 indexer cache): the PyTorch reference under Triton's interpreter, the fp8_ds_mla
entry byte by byte, profile runs without caches, strided views, errors, the plan and ``out=``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from warmreg_kimi_k3.dsa import DSALayout
from warmreg_kimi_k3.dsa_prologue import DSAFusedPrologue, dsa_prologue_reference, mla_entry_bytes

import warmreg
from warmreg.testing import OpCall, assert_warmup_inputs_reproduce, check_out, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
NAME = DSAFusedPrologue.name
Q, KV, R, D, TOPK = 96, 256, 64, 128, 40  # Q not a power of two (Kimi-K3: 1536), two 128-column latent tiles
ENTRY = mla_entry_bytes(KV, R)
LAYOUT = DSALayout(
    layers=(4,), index_topk=TOPK, index_head_dim=D, index_num_heads=3, index_k_norm_type="layernorm",
    indexer_fp4=False, fused_k_insert=True, fused_prologue=True, q_lora_rank=Q, kv_lora_rank=KV,
    qk_rope_head_dim=R, eps=1e-5, dtype="bfloat16",
)  # fmt: skip


def _codes_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """e4m3fn bytes equal up to Triton 3.8's interpreter: it truncates fp32 to bf16 (the norms' outputs) and its
    fp32 -> e4m3fn conversion is not round-to-nearest-even, so a code may be one step off, and a value that rounds
    up into the next binade loses the carry (code - 8 where the reference's mantissa is 0). The GPU rounds both to
    nearest even; the differential test against vLLM's kernel is exact."""
    g, w = got.view(torch.uint8).int(), want.view(torch.uint8).int()
    same_sign = (g & 0x80) == (w & 0x80)
    bad = ~(same_sign & (((g - w).abs() <= 1) | (((w & 0x7) == 0) & (w - g == 8))))
    assert not bad.any(), f"{int(bad.sum())} codes differ: got {g[bad][:8].tolist()}, want {w[bad][:8].tolist()}"


def _args(t: int, mla_slots: list[int], index_slots: list[int], seed: int = 0) -> list:
    """vLLM's fused path: q_c, kv_c, k_pe, index_k are column slices of one projection output."""
    g = torch.Generator().manual_seed(seed)
    proj = (torch.randn(t, Q + KV + R + D + 3, generator=g) * 2).bfloat16()
    q_c, kv_c, k_pe, index_k, _ = proj.split([Q, KV, R, D, 3], -1)
    return [
        q_c, kv_c, k_pe, index_k,
        (torch.randn(Q, generator=g) * 0.2 + 1).bfloat16(), (torch.randn(KV, generator=g) * 0.2 + 1).bfloat16(),
        torch.randn(D, generator=g) * 0.3 + 1, torch.randn(D, generator=g) * 0.1, 1e-5,
        torch.full((t + 1, TOPK), 9, dtype=torch.int32),
        torch.zeros(3, 64, ENTRY, dtype=torch.uint8), torch.tensor(mla_slots, dtype=torch.int64),
        torch.zeros(3, 64, D + 4, dtype=torch.uint8), torch.tensor(index_slots, dtype=torch.int64),
    ]  # fmt: skip


def _clone(args: list) -> list:
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def _compare_mla(got: torch.Tensor, want: torch.Tensor) -> None:
    """The fp8_ds_mla entries: latent codes (close), tile scales and k_pe (exact: k_pe is copied, and the scales
    are powers of two of the tiles' amax)."""
    _codes_close(got[..., :KV], want[..., :KV])
    assert torch.equal(got[..., KV:], want[..., KV:])


@pytest.mark.parametrize("mx", [False, True])
@pytest.mark.parametrize(
    ("t", "mla_slots", "index_slots"),
    [(1, [0], [5]), (5, [1, 65, -1, 3, 190], [7, 9, 100]), (3, [2, 4], [-1, 0, 1, 2])],  # padded rows, -1 slots
)
def test_matches_reference(t: int, mla_slots: list[int], index_slots: list[int], mx: bool) -> None:
    mine = _args(t, mla_slots, index_slots, seed=t)
    ref = _clone(mine)
    q_out, kv_out = DSAFusedPrologue(layout=LAYOUT, max_num_batched_tokens=8)(*mine, mx_scale=mx, launch_pdl=False)
    want_q, want_kv = dsa_prologue_reference(*ref, mx_scale=mx)
    torch.testing.assert_close(q_out, want_q, atol=1e-2, rtol=1.6e-2)  # bf16: the interpreter truncates
    torch.testing.assert_close(kv_out, want_kv, atol=1e-2, rtol=1.6e-2)
    assert torch.equal(mine[9], ref[9]) and (mine[9][:t] == -1).all() and (mine[9][t:] == 9).all()
    _compare_mla(mine[10], ref[10])
    assert torch.equal(mine[12].flatten(1)[:, 64 * D :], ref[12].flatten(1)[:, 64 * D :])  # index scales
    _codes_close(mine[12].flatten(1)[:, : 64 * D], ref[12].flatten(1)[:, : 64 * D])


def test_the_fp8_ds_mla_entry() -> None:
    """Token 0 at slot 65 (block 1, row 1): 256 latent codes, 2 float32 tile scales, then k_pe's 64 bf16 values; a
    kv row of +-1 after the norm has amax 1 per tile, scale 2**ceil(log2(1/448)) = 2**-8, codes of +-256."""
    args = _args(1, [65], [-1])
    args[1] = torch.tensor([[1.0, -1.0] * (KV // 2)]).bfloat16()
    args[5] = torch.ones(KV, dtype=torch.bfloat16)
    DSAFusedPrologue(layout=LAYOUT, max_num_batched_tokens=8)(*args, mx_scale=False, launch_pdl=False)
    entry = args[10][1, 1]
    assert torch.equal(entry[:KV].view(torch.float8_e4m3fn).float(), torch.tensor([256.0, -256.0] * (KV // 2)))
    assert entry[KV : KV + 8].view(torch.float32).tolist() == [2.0**-8, 2.0**-8]
    assert torch.equal(entry[KV + 8 :].view(torch.bfloat16), args[2][0])
    assert (args[10][1, [0, 2]] == 0).all() and (args[10][[0, 2]] == 0).all() and (args[12] == 0).all()


def test_profile_run_without_caches() -> None:
    """vLLM's dummy runs pass None caches: both norms and the top-k fill still run, nothing is inserted."""
    args = _args(4, [0], [0])
    args[10:] = [None, None, None, None]
    q_out, kv_out = DSAFusedPrologue(layout=LAYOUT, max_num_batched_tokens=8)(*args, mx_scale=True, launch_pdl=False)
    assert q_out.shape == (4, Q) and kv_out.shape == (4, KV) and (args[9][:4] == -1).all()


def test_strided_caches_one_key() -> None:
    """MLA and index pages inside one packed block row (block strides past the page) take the same binary and
    write the same entries as plain caches."""
    kernel = DSAFusedPrologue(layout=LAYOUT, max_num_batched_tokens=8)
    plain = _args(3, [0, 64, 130], [1, 70, 129])
    packed = _clone(plain)
    row = torch.zeros(3, 64 * (ENTRY + D + 4), dtype=torch.uint8)
    packed[10] = row[:, : 64 * ENTRY].view(3, 64, ENTRY)
    packed[12] = row[:, 64 * ENTRY :].view(3, 64, D + 4)
    kernel(*plain, mx_scale=False, launch_pdl=False)
    kernel(*packed, mx_scale=False, launch_pdl=False)
    assert torch.equal(packed[10], plain[10]) and torch.equal(packed[12], plain[12])
    keys = {
        kernel.dispatch(q_c=a[0], kv_c=a[1], k_pe=a[2], index_k=a[3], q_norm_weight=a[4], k_norm_weight=a[6],
                        topk_indices_buffer=a[9], mla_slot_mapping=a[11], index_slot_mapping=a[13], mx_scale=False,
                        launch_pdl=False)
        for a in (plain, packed)
    }  # fmt: skip
    assert len(keys) == 1


def test_empty_step_and_errors() -> None:
    kernel = DSAFusedPrologue(layout=LAYOUT, max_num_batched_tokens=8)
    args = _args(2, [0, 1], [0, 1])
    q_out, kv_out = kernel(*[a[:0] if i < 4 else a for i, a in enumerate(args)], launch_pdl=False)
    assert q_out.shape == (0, Q) and kv_out.shape == (0, KV)
    bad = {
        "q_c, kv_c": (1, args[1][:, :200]),  # kv width not a multiple of 128
        "q_norm_weight": (4, args[4][:10]),
        "topk_indices_buffer": (9, args[9].long()),
        "mla_cache": (10, args[10][:, :, :300]),
        "index_slot_mapping": (13, args[13].float()),
    }
    for match, (i, value) in bad.items():
        call = list(args)
        call[i] = value
        with pytest.raises(warmreg.LaunchError, match=match):
            kernel(*call, launch_pdl=False)


@pytest.mark.parametrize(("target", "mx"), [("cuda:90", False), ("cuda:100", True)])
def test_one_key_per_target(target: str, mx: bool) -> None:
    kp = warmreg.plan(example_config("kimi_k3_dsa"), target=target).kernel(NAME)
    (key,) = kp.keys
    assert key.fields() == {
        "dtype": "bfloat16", "norm_dtype": "bfloat16", "k_norm_dtype": "float32", "mla_slot_dtype": "int64",
        "index_slot_dtype": "int64", "q_dim": 1536, "q_block": 2048, "kv_dim": 512, "rope_dim": 64, "index_dim": 128,
        "topk": 2048, "topk_block": 1024, "mx_scale": mx, "launch_pdl": True, "num_warps": 4,
    }  # fmt: skip
    assert_warmup_inputs_reproduce(kp.kernel, kp.keys)
    assert mla_entry_bytes(512, 64) == 656  # vLLM's fp8_ds_mla row


@pytest.mark.parametrize(
    ("example", "target", "serving"),
    [
        ("kimi_k3_dsa", "cuda:90", {"kv_cache_dtype": "auto"}),  # a bf16 MLA cache: projections not packed
        ("kimi_k3_dsa", "cuda:90", {"attention_backend": "TRITON_MLA"}),  # no fp8_ds_mla
        ("kimi_k3_dsa", "cuda:90", {"decode_context_parallel_size": 2}),
        ("kimi_k3_dsa", "cuda:100", {"indexer_kv_dtype": "mxfp4"}),  # the MXFP4 prologue instead
        ("kimi_k3_dsa", "rocm:gfx950", {}),
        ("kimi_k3", "cuda:90", {}),
    ],
)
def test_not_planned(example: str, target: str, serving: dict[str, object]) -> None:
    names = {k.name for k in warmreg.plan(example_config(example, **serving), target=target).kernels}
    assert NAME not in names


def test_out() -> None:
    def build() -> OpCall:
        return OpCall(DSAFusedPrologue(layout=LAYOUT, max_num_batched_tokens=8), tuple(_args(3, [0, 5, 64], [1, 2, 3])),
                      {"mx_scale": False, "launch_pdl": False})  # fmt: skip

    check_out(build, tuple_error=r"out must be a tuple of 2 buffers")
