"""DeepSeek-V4.1's prefill combine of top-k and SWA indices: against its PyTorch reference under Triton's interpreter,
hand-picked rows (out-of-pool candidates, a window cut by the gathered rows, SWA-only layers), views, errors, out=,
and the plan of examples/deepseek_v41.json."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from warmreg_deepseek_v4 import v41_combine_indices
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.v41_combine_indices import V41CombineTopkSwa, v41_combine_topk_swa_reference

import warmreg
from warmreg.testing import OpCall, RegisterPlugin, assert_warmup_inputs_reproduce, check_out, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
I32 = torch.int32
NAME = V41CombineTopkSwa.name


def _v41(**serving: Any) -> dict[str, Any]:
    config = example_config("deepseek_v41")
    config["serving"].update(serving)
    return config


def _batch(
    seed: int, qlens: list[int], seqs: list[int], gathers: list[int], width: int, n: int
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    qsl = torch.tensor([5, *(5 + sum(qlens[: i + 1]) for i in range(len(qlens)))], dtype=I32)  # not rebased
    T = sum(qlens)
    topk = torch.randint(-1, n + 3, (T, width), generator=g, dtype=I32)  # -1, in-pool and out-of-pool candidates
    return topk, qsl, torch.tensor(seqs, dtype=I32), torch.tensor(gathers, dtype=I32)


@pytest.mark.parametrize(("ratio", "top_k"), [(2, 24), (1, 24), (0, 0)])
def test_matches_reference(ratio: int, top_k: int) -> None:
    """Three requests (one a late chunk whose window is cut by its gathered rows), window 8, a 24-wide top-k."""
    topk, qsl, seqs, gathers = _batch(ratio, [3, 5, 1], [3, 40, 9], [3, 6, 9], 24, n=20)
    op = V41CombineTopkSwa(window_size=8, index_topk=24, ratios=[ratio])
    got = op(topk, qsl, seqs, gathers, top_k=top_k, compress_ratio=ratio, M=40, N=20)
    want = v41_combine_topk_swa_reference(topk, qsl, seqs, gathers, window_size=8, top_k=top_k, compress_ratio=ratio,
                                          M=40, N=20)  # fmt: skip
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[0].shape == (9, 128)


def test_hand_picked_rows() -> None:
    """Request 1 at pos 39 (qlen 2, seq 40, 6 rows gathered from 34): topk_len min(40 // 2, 4) = 4, candidates 3
    (in pool), 20 (= N: out of pool), -1, 7; the window from max(39 - 7, 34) = 34, 6 rows: N + 0 .. 5."""
    topk = torch.tensor([[0, 0, 0, 0], [1, 2, 3, 4], [3, 20, -1, 7]], dtype=I32)
    qsl, seqs, gathers = (
        torch.tensor([0, 1, 3], dtype=I32),
        torch.tensor([1, 40], dtype=I32),
        torch.tensor([1, 6], dtype=I32),
    )
    rows, lens = V41CombineTopkSwa(window_size=8)(topk, qsl, seqs, gathers, top_k=4, compress_ratio=2, M=100, N=20)
    # token 0: pos 0, (0 + 1) // 2 = 0 candidates, window [0, 0]: N + 0
    assert rows[0, :2].tolist() == [20, -1] and lens[0] == 1
    # token 2 (request 1, pos 39): 4 candidates then 6 window rows at 100 + 20 + (34 - 34) + s
    assert rows[2, :10].tolist() == [103, -1, -1, 107, 120, 121, 122, 123, 124, 125] and lens[2] == 10
    assert (rows[2, 10:] == -1).all()
    # token 1 (request 1, pos 38): min(39 // 2, 4) = 4 candidates, the window 34..38 (5 rows)
    assert rows[1, :9].tolist() == [101, 102, 103, 104, 120, 121, 122, 123, 124] and lens[1] == 9


def test_negative_positions_clamp_to_empty() -> None:
    """A warmup batch's query longer than its sequence puts pos below 0: both lengths clamp at 0, the row stays -1."""
    topk = torch.zeros((3, 4), dtype=I32)
    qsl, seqs, gathers = torch.tensor([0, 3], dtype=I32), torch.tensor([1], dtype=I32), torch.tensor([1], dtype=I32)
    rows, lens = V41CombineTopkSwa(window_size=8)(topk, qsl, seqs, gathers, top_k=4, compress_ratio=2, M=8, N=2)
    assert lens.tolist() == [0, 0, 1] and (rows[:2] == -1).all()


def test_offset_views_and_empty_chunk() -> None:
    """A chunk's rows of the shared top-k buffer (an offset view) and a slice of query_start_loc."""
    topk, qsl, seqs, gathers = _batch(7, [2, 4, 3], [12, 30, 3], [8, 8, 3], 16, n=15)
    buffer = torch.full((20, 16), -1, dtype=I32)
    buffer[5:14] = topk
    op = V41CombineTopkSwa(window_size=8)
    got = op(buffer[7:14], qsl[1:], seqs[1:], gathers[1:], top_k=16, compress_ratio=1, M=30, N=15)
    want = v41_combine_topk_swa_reference(topk[2:], qsl[1:], seqs[1:], gathers[1:], window_size=8, top_k=16,
                                          compress_ratio=1, M=30, N=15)  # fmt: skip
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    empty = op(buffer[:0], qsl[:1], seqs[:0], gathers[:0], top_k=16, compress_ratio=1, M=30, N=15)
    assert empty[0].shape == (0, 128) and empty[1].shape == (0,)


def test_errors_name_the_argument() -> None:
    op, qsl, one = V41CombineTopkSwa(window_size=8), torch.tensor([0, 1], dtype=I32), torch.ones(1, dtype=I32)
    topk = torch.zeros((1, 4), dtype=I32)
    with pytest.raises(warmreg.LaunchError, match="topk_indices must be int32"):
        op(topk.long(), qsl, one, one, top_k=4, compress_ratio=2, M=1, N=1)
    with pytest.raises(warmreg.LaunchError, match="seq_lens must be contiguous 1-D int32"):
        op(topk, qsl, one.long(), one, top_k=4, compress_ratio=2, M=1, N=1)
    with pytest.raises(warmreg.LaunchError, match=r"top_k \(4\) must be .* 0 exactly when compress_ratio \(0\)"):
        op(topk, qsl, one, one, top_k=4, compress_ratio=0, M=1, N=1)
    with pytest.raises(warmreg.LaunchError, match="within topk_indices' 4 columns"):
        op(topk, qsl, one, one, top_k=8, compress_ratio=2, M=1, N=1)


def test_out_conformance() -> None:
    topk, qsl, seqs, gathers = _batch(3, [2, 3], [9, 20], [4, 8], 8, n=10)
    check_out(lambda: OpCall(V41CombineTopkSwa(window_size=8), (topk, qsl, seqs, gathers),
                             {"top_k": 8, "compress_ratio": 2, "M": 30, "N": 10}))  # fmt: skip


# -- the plan ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["cuda:90", "cuda:100"])
def test_example_plans_one_key_a_layer_type(target: str) -> None:
    """FlashMLA's split-KV backend: the SWA-only layers (0, 1 and the MTP layer) with no top-k, the ratio-2 layers
    (2-19) and the ratio-1 layers (20-42) with the 512-wide buffer; rows of round_up(k + 128, 128)."""
    plan = warmreg.plan(EXAMPLES / "deepseek_v41.json", target=target)
    keys = {(k.fields()["compress_ratio"], k.fields()["top_k"], k.fields()["width"], k.fields()["block"])
            for k in plan.kernel(NAME).keys}  # fmt: skip
    assert keys == {(0, 0, 128, 128), (1, 512, 640, 1024), (2, 512, 640, 1024)}
    assert_warmup_inputs_reproduce(plan.kernel(NAME).kernel, plan.kernel(NAME).keys)
    buffer, qsl, lens = warmreg.meta((8192, 512), I32), warmreg.meta((257,), I32), warmreg.meta((256,), I32)
    out = (warmreg.meta((8192, 640), I32)[:100], warmreg.meta((8192,), I32)[:100])
    call = OpCall(plan.kernel(NAME).kernel, (buffer[3:103], qsl[4:9], lens[3:7], lens[3:7]),
                  {"top_k": 512, "compress_ratio": 2, "M": 9000, "N": 4000, "out": out})  # fmt: skip
    assert call.launch_code().key in plan.kernel(NAME).keys


def test_planned_on_mega_not_on_flashinfer() -> None:
    mega = _v41(attention_backend="FLASHMLA_MEGA_ATTN_DSV41", tensor_parallel_size=2, kv_cache_dtype="auto")
    assert NAME in {k.name for k in warmreg.plan(mega, target="cuda:100").kernels}
    flashinfer = _v41(attention_backend="FLASHINFER_MLA_SPARSE_DSV41", kv_cache_dtype="fp8")
    assert NAME not in {k.name for k in warmreg.plan(flashinfer, target="cuda:100").kernels}
    config = _v41()
    config["model"]["text_config"]["compress_ratios"] = [1] * 43  # the MTP layer past the list stays SWA-only
    plan = warmreg.plan(config, target="cuda:90")
    assert {k.fields()["compress_ratio"] for k in plan.kernel(NAME).keys} == {0, 1}


def test_warm_cross_compiles() -> None:
    plugin = RegisterPlugin(v41_combine_indices.register, model=DSV4.from_config)
    report = warmreg.warm(_v41(), target="cuda:90", plugins=[plugin], entry_points=False)
    assert report.ok and report.compiled == 3, [(r.kernel, r.error) for r in report.failed]
