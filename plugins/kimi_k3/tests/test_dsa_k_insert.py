"""The DSA indexer key insert (FP8 cache): the PyTorch reference under Triton's interpreter, hand-picked slots and
pages, strided views, errors, the plan and ``dsa_layout``'s reading of ``dsa_config``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from warmreg_kimi_k3.dsa import DSALayout, dsa_layout
from warmreg_kimi_k3.dsa_k_insert import DSAKNormQuantInsert, dsa_k_insert_reference
from warmreg_kimi_k3.model import KimiK3

import warmreg
from warmreg.testing import assert_warmup_inputs_reproduce, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
NAME = DSAKNormQuantInsert.name
D, TOPK = 128, 40
LAYOUT = DSALayout(
    layers=(4,), index_topk=TOPK, index_head_dim=D, index_num_heads=3, index_k_norm_type="layernorm",
    indexer_fp4=False, fused_k_insert=True, fused_prologue=False, q_lora_rank=96, kv_lora_rank=256,
    qk_rope_head_dim=64, eps=1e-5, dtype="bfloat16",
)  # fmt: skip


def assert_fp8_codes_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """e4m3fn bytes equal up to Triton 3.8's interpreter: it truncates fp32 to bf16 (the key's norm output, so a
    code may move by one) and drops the carry when fp32 -> e4m3fn rounds up into the next binade (32 - 0.4 gives 16,
    not 32: code - 8 where the reference has mantissa 0). The GPU rounds both to nearest even; the differential test
    against vLLM's kernel (tests/engines/test_vllm034_kernels_kimi_dsa.py) is exact."""
    g, w = got.view(torch.uint8).int(), want.view(torch.uint8).int()
    same_sign = (g & 0x80) == (w & 0x80)
    step = (g - w).abs() <= 1
    carry = ((w & 0x7) == 0) & ((w & 0x7F) - (g & 0x7F) == 8)
    bad = ~(same_sign & (step | carry))
    assert not bad.any(), f"{int(bad.sum())} codes differ: got {g[bad][:8].tolist()}, want {w[bad][:8].tolist()}"
    assert (g != w).float().mean() < 0.1, "too many codes off by one"


def split_cache(cache: torch.Tensor, block_size: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``[blocks, block_size, d + 4]`` cache's FP8 values ``[blocks, block_size * d]`` and scale words."""
    pages = cache.view(torch.uint8).flatten(1)
    return pages[:, : block_size * d], pages[:, block_size * d :].contiguous().view(torch.int32)


def _inputs(t: int, seed: int, slots: list[int], blocks: int = 3, bs: int = 64) -> tuple:
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(t, D + 8, generator=g) * 3).bfloat16()[:, 8:]  # a column view of the wkv_index output
    w, b = torch.randn(D, generator=g) * 0.5 + 1, torch.randn(D, generator=g) * 0.1
    cache = torch.zeros(blocks, bs, D + 4, dtype=torch.uint8)
    topk = torch.full((t + 2, TOPK), 7, dtype=torch.int32)
    return k, w, b, 1e-5, torch.tensor(slots, dtype=torch.int64), cache, topk


def _run(args: tuple, t: int, mx: bool) -> tuple[tuple, tuple]:
    mine = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    ref = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    assert DSAKNormQuantInsert(layout=LAYOUT, max_num_batched_tokens=8)(*mine, t, mx_scale=mx) is None
    dsa_k_insert_reference(*ref, t, mx_scale=mx)
    return mine, ref


@pytest.mark.parametrize("mx", [False, True])
@pytest.mark.parametrize(("t", "slots"), [(1, [5]), (6, [3, -1, 70, 0, 191]), (4, [2, 64])])  # padded rows: t > S
def test_matches_reference(t: int, slots: list[int], mx: bool) -> None:
    mine, ref = _run(_inputs(t, t, slots), t, mx)
    assert torch.equal(mine[6], ref[6])  # top-k rows: -1 over [:t], untouched past it
    assert (mine[6][:t] == -1).all() and (mine[6][t:] == 7).all()
    (got_q, got_s), (want_q, want_s) = split_cache(mine[5], 64, D), split_cache(ref[5], 64, D)
    assert torch.equal(got_s, want_s)
    assert_fp8_codes_close(got_q, want_q)


def test_scale_words() -> None:
    """A key of +-1 after the norm: amax 1, scale 2**ceil(log2(1/448)) = 2**-8; fp32 or UE8M0 x4 (0x77777777)."""
    _, _, _, eps, slots, cache, topk = _inputs(1, 0, [65])
    k = torch.tensor([[1.0, -1.0] * (D // 2)]).bfloat16()
    for mx, word in ((False, torch.tensor([2.0**-8]).view(torch.int32).item()), (True, 0x77777777)):
        mine, _ = _run((k, torch.ones(D), torch.zeros(D), eps, slots, cache, topk), 1, mx)
        _, scales = split_cache(mine[5], 64, D)
        assert scales[1, 1].item() == word and (scales[[0, 2]] == 0).all() and (scales[1, [0, 2]] == 0).all()
        values, _ = split_cache(mine[5], 64, D)
        assert torch.equal(
            values[1, D : 2 * D].view(torch.float8_e4m3fn).float(), torch.tensor([256.0, -256.0] * (D // 2))
        )


def test_strided_pages_and_empty_step() -> None:
    """Index pages inside a packed block row (page stride > page bytes) take one binary; T = 0 launches nothing."""
    kernel = DSAKNormQuantInsert(layout=LAYOUT, max_num_batched_tokens=8)
    k, w, b, eps, slots, _, topk = _inputs(3, 1, [0, 65, 130])
    row = torch.zeros(3, 64 * (D + 4) + 512, dtype=torch.uint8)  # another page of the block row after ours
    packed = row[:, : 64 * (D + 4)].view(3, 64, D + 4)
    plain = torch.zeros(3, 64, D + 4, dtype=torch.uint8)
    kernel(k, w, b, eps, slots, packed, topk.clone(), 3, mx_scale=False)
    kernel(k, w, b, eps, slots, plain, topk.clone(), 3, mx_scale=False)
    assert torch.equal(packed, plain) and (row[:, 64 * (D + 4) :] == 0).all()
    keys = {kernel.dispatch(k=x, norm_weight=w, slot_mapping=slots, topk_indices_buffer=topk, mx_scale=False)
            for x in (k, k.contiguous())}  # fmt: skip
    assert len(keys) == 1
    before = topk.clone()
    assert kernel(k[:0], w, b, eps, slots[:0], plain, topk, 0, mx_scale=False) is None
    assert torch.equal(topk, before)


def test_launch_errors() -> None:
    kernel = DSAKNormQuantInsert(layout=LAYOUT, max_num_batched_tokens=8)
    k, w, b, eps, slots, cache, topk = _inputs(2, 2, [0, 1])
    cases = [
        ("k must", (k[:, :100], w, b, eps, slots, cache, topk, 2)),
        ("norm_weight", (k, w[:64], b, eps, slots, cache, topk, 2)),
        ("slot_mapping", (k, w, b, eps, slots.float(), cache, topk, 2)),
        ("topk_indices_buffer", (k, w, b, eps, slots, cache, topk.long(), 2)),
        ("num_tokens", (k, w, b, eps, slots, cache, topk, 3)),
        ("kv_cache", (k, w, b, eps, slots, cache[:, :, :D], topk, 2)),
        ("kv_cache", (k, w, b, eps, slots, cache.float(), topk, 2)),
    ]
    for match, args in cases:
        with pytest.raises(warmreg.LaunchError, match=match):
            kernel(*args, mx_scale=False)


# -- dsa_config and the plan -------------------------------------------------------------------------------------
def _with_dsa(change: dict[str, object], **serving: object) -> warmreg.WarmConfig:
    """The DSA example with ``change`` in its ``dsa_config`` and ``serving`` settings."""
    raw = example_config("kimi_k3_dsa", **serving)
    raw["model"]["text_config"]["dsa_config"].update(change)
    return warmreg.WarmConfig.load(raw)


def _layout(target: str = "cuda:90", **serving: object) -> DSALayout | None:
    config = _with_dsa({}, **serving)
    return dsa_layout(KimiK3.from_config(config), config, warmreg.Platform.parse(target))


def test_the_example_layout() -> None:
    lay = _layout()
    assert lay is not None and lay.layers[:3] == (4, 8, 12) and len(lay.layers) == 24
    assert (lay.index_topk, lay.index_head_dim, lay.index_num_heads, lay.padded_index_num_heads) == (2048, 128, 32, 32)
    assert lay.fused_k_insert and lay.fused_prologue and not lay.indexer_fp4
    assert not _layout(kv_cache_dtype="auto").fused_prologue  # type: ignore[union-attr]
    assert not _layout(attention_backend="TRITON_MLA").fused_prologue  # type: ignore[union-attr]
    assert not _layout(decode_context_parallel_size=2).fused_prologue  # type: ignore[union-attr]
    assert _layout("cuda:100", indexer_kv_dtype="mxfp4").indexer_fp4  # type: ignore[union-attr]
    assert _layout("rocm:gfx950") is None  # vLLM's DSA layers are CUDA-only
    assert "dsa_config" not in example_config("kimi_k3")["model"]["text_config"]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"index_rope_dim": 64}, "index_rope_dim"),  # Kimi-K3's MLA is NoPE-only: vLLM refuses indexer RoPE
        ({"index_num_heads": 96}, "index_num_heads"),
        ({"index_k_norm_type": "l2"}, "index_k_norm_type"),
        ({"index_topk_freq": 2}, "index_topk_freq"),
        ({"dsa_layers": "all"}, "dsa_layers"),
        ({"index_head_dim": 0}, "index_head_dim"),
    ],
)
def test_dsa_config_vllm_refuses(change: dict[str, object], field: str) -> None:
    config = _with_dsa(change)
    with pytest.raises(warmreg.ConfigError, match=field):
        dsa_layout(KimiK3.from_config(config), config, warmreg.Platform.parse("cuda:90"))


def test_mxfp4_needs_sm10x_and_the_fused_insert() -> None:
    with pytest.raises(warmreg.ConfigError, match="indexer_kv_dtype"):
        _layout("cuda:90", indexer_kv_dtype="mxfp4")
    config = _with_dsa({"index_k_norm_type": "rmsnorm"}, indexer_kv_dtype="mxfp4")
    with pytest.raises(warmreg.ConfigError, match="fused"):
        dsa_layout(KimiK3.from_config(config), config, warmreg.Platform.parse("cuda:100"))


@pytest.mark.parametrize(("target", "mx"), [("cuda:90", False), ("cuda:100", True)])
def test_planned_without_the_fused_prologue(target: str, mx: bool) -> None:
    """With a bf16 MLA cache the projections stay unpacked: the key insert runs, one key per target."""
    (key,) = warmreg.plan(example_config("kimi_k3_dsa", kv_cache_dtype="auto"), target=target).kernel(NAME).keys
    assert key.fields() == {
        "k_dtype": "bfloat16", "norm_dtype": "float32", "slot_dtype": "int64", "topk_dtype": "int32",
        "head_dim": 128, "topk": 2048, "topk_block": 1024, "mx_scale": mx, "num_warps": 1,
    }  # fmt: skip
    kp = warmreg.plan(example_config("kimi_k3_dsa", kv_cache_dtype="auto"), target=target).kernel(NAME)
    assert_warmup_inputs_reproduce(kp.kernel, kp.keys)


@pytest.mark.parametrize("serving", [{}, {"indexer_kv_dtype": "mxfp4"}])
def test_not_planned(serving: dict[str, str]) -> None:
    """The fused prologue takes the insert over (the example); MXFP4 has its own kernels; no DSA, no insert."""
    names = {k.name for k in warmreg.plan(example_config("kimi_k3_dsa", **serving), target="cuda:100").kernels}
    assert NAME not in names
    for example, target in (("kimi_k3", "cuda:90"), ("kimi_k3_dsa", "rocm:gfx942")):
        assert not {k.name for k in warmreg.plan(example_config(example), target=target).kernels} & {NAME}
