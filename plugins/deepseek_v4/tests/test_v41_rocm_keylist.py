"""DeepSeek-V4.1's gfx942 mono decode key lists: the reference under Triton's interpreter, a hand-picked token,
views, errors, the plan per target and setting, a real cross-compile for gfx942, and the V4.1 sweep driving it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from warmreg_deepseek_v4 import v41_rocm_keylist
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.v41_rocm_keylist import V41RocmKeylist, keylist_reference

import warmreg
from warmreg.testing import RegisterPlugin, assert_warmup_inputs_reproduce, config_loader
from warmreg.testing.sweep import run_steps

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
I32 = torch.int32
NAME = V41RocmKeylist.name


def _inputs(tokens: int, window: int, topk: int, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    slots = torch.randint(0, 9000, (tokens,), generator=g)
    slots[tokens // 2] = -1
    return {
        "slot_mapping": slots, "positions": torch.randint(0, 3000, (tokens,), generator=g),
        "swa_indices": torch.randint(0, 9000, (tokens + 2, 1, window), generator=g, dtype=I32),
        "swa_lens": torch.randint(0, window + 1, (tokens + 2,), generator=g, dtype=I32),
        "token_to_req": torch.randint(0, 3, (tokens + 2,), generator=g, dtype=I32),
        "topk": torch.randint(-1, 2000, (tokens + 2, topk), generator=g, dtype=I32),
        "comp_block_table": torch.randint(0, 700, (3, 40), generator=g, dtype=I32),
    }  # fmt: skip


def _run(d: dict[str, Any], ratio: int, block: int, keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    s = d["slot_mapping"].shape[0]
    kt, klen = torch.full(((s + 2) * keys,), -7, dtype=I32), torch.full((2 * s + 3,), -7, dtype=I32)
    topk = d["topk"] if ratio else None
    table = d["comp_block_table"] if ratio else None
    args = [d[k] for k in ("slot_mapping", "positions", "swa_indices", "swa_lens", "token_to_req")]
    V41RocmKeylist()(kt, klen, *args, ratio, topk, table, block)
    assert (kt[s * keys :] == -7).all() and (klen[2 * s :] == -7).all()  # nothing past S is written
    return kt[: s * keys].view(s, keys), klen[: 2 * s]


def test_hand_picked_token() -> None:
    """Position 9, ratio 2: five top-k entries (one -1), then the window's three slots, then -1; block 4."""
    d = {
        "slot_mapping": torch.tensor([5]), "positions": torch.tensor([9]),
        "swa_indices": torch.tensor([[[70, 71, 72, 73]]], dtype=I32), "swa_lens": torch.tensor([3], dtype=I32),
        "token_to_req": torch.tensor([0], dtype=I32), "topk": torch.tensor([[0, 5, -1, 9, 2, 3, 3, 3]], dtype=I32),
        "comp_block_table": torch.tensor([[10, 11, 12]], dtype=I32),
    }  # fmt: skip
    kt, klen = _run(d, 2, 4, 12)
    b31 = -(2**31)
    assert kt[0].tolist() == [40 + b31, 45 + b31, -1, 49 + b31, 42 + b31, 70, 71, 72, -1, -1, -1, -1]
    assert klen.tolist() == [8, 5]


@pytest.mark.parametrize(("tokens", "ratio", "window", "topk"), [(1, 2, 128, 512), (6, 2, 128, 512), (5, 1, 16, 40)])
def test_matches_reference(tokens: int, ratio: int, window: int, topk: int) -> None:
    """The mono geometry at ratios 2 and 1, a narrow one; a padded token has no keys; rows of larger buffers."""
    d = _inputs(tokens, window, topk, tokens + ratio)
    kt, klen = _run(d, ratio, 256 // ratio, window + topk)
    want_kt, want_klen = keylist_reference(**{**d, "ratio": ratio, "comp_block": 256 // ratio})
    assert torch.equal(kt, want_kt) and torch.equal(klen, want_klen)
    assert klen[tokens // 2] == 0 and (kt[tokens // 2] == -1).all()


def test_ratio_zero_lists_the_window_only() -> None:
    d = _inputs(3, 16, 512, 9)
    kt, klen = _run(d, 0, 1, 16 + 512)
    want_kt, want_klen = keylist_reference(*[d[k] for k in list(d)[:5]], 0)
    assert torch.equal(kt, want_kt) and torch.equal(klen, want_klen) and (klen[3:] == 0).all()


def test_launch_errors() -> None:
    d = _inputs(2, 128, 512, 1)
    kt, klen, args = torch.zeros(4 * 640, dtype=I32), torch.zeros(4, dtype=I32), [d[k] for k in list(d)[:5]]
    op = V41RocmKeylist()
    with pytest.raises(warmreg.LaunchError, match="needs ratio"):
        op(kt, klen, *args, 2)
    with pytest.raises(warmreg.LaunchError, match="slot_mapping must be"):
        op(kt, klen, args[0].int(), *args[1:], 2, d["topk"], d["comp_block_table"], 128)
    with pytest.raises(warmreg.LaunchError, match="swa_indices must be"):
        op(kt, klen, *args[:2], args[2].transpose(0, 2), *args[3:], 2, d["topk"], d["comp_block_table"], 128)
    with pytest.raises(warmreg.LaunchError, match="kt must be"):
        op(kt[:100], klen, *args, 2, d["topk"], d["comp_block_table"], 128)


def _config(**serving: Any) -> dict[str, Any]:
    config = example_config("deepseek_v41")
    config["serving"].update(
        {"attention_backend": "ROCM_FLASHMLA_SPARSE_DSV41", "monokernel": True, "tensor_parallel_size": 4, **serving}
    )
    return config


def test_one_key_a_ratio_on_gfx942() -> None:
    """The example's index sources are ratio 2 (layers 2, 8, 14) and ratio 1 (20 and up): one key each, the mono
    geometry."""
    plan = warmreg.plan(_config(), target="rocm:gfx942")
    keys = plan.kernel(NAME).keys
    assert [k.fields() for k in keys] == [
        {"ratio": r, "window": 128, "topk": 512, "block": 1024, "num_warps": 4} for r in (1, 2)
    ]
    assert_warmup_inputs_reproduce(V41RocmKeylist(), keys)


@pytest.mark.parametrize(
    ("target", "serving"),
    [
        ("rocm:gfx950", {}), ("rocm:gfx942", {"monokernel": False}), ("rocm:gfx942", {"tensor_parallel_size": 8}),
        ("rocm:gfx942", {"kv_cache_dtype": "bfloat16"}), ("cuda:100", {"attention_backend": "FLASHMLA_SPARSE_DSV41"}),
    ],
)  # fmt: skip
def test_not_planned_elsewhere(target: str, serving: dict[str, Any]) -> None:
    """gfx950's second launch builds its own key table; gfx942 builds the mono kernels for TP 4 and the fp8_ds_mla
    cache only; no mono decode without the flag or on CUDA."""
    assert NAME not in {k.name for k in warmreg.plan(_config(**serving), target=target).kernels}


def test_warm_cross_compiles_for_gfx942() -> None:
    plugin = RegisterPlugin(v41_rocm_keylist.register, model=DSV4.from_config)
    report = warmreg.warm(_config(), target="rocm:gfx942", plugins=[plugin], entry_points=False)
    assert report.ok and report.compiled == 2, [(r.kernel, r.error) for r in report.failed]  # ratios 1 and 2


def test_sweep_drives_the_key_lists() -> None:
    """gfx942, ``--monokernel``, TP 4, steps of at most 16 decode tokens: the key lists of the decode-only step match
    the reference, and every planned kernel is launched."""
    plan = warmreg.plan(_config(max_num_seqs=8), target="rocm:gfx942")
    run = run_steps(plan, 42)
    assert run["step_failures"] == [] and run["not_launched"] == [], (run["step_failures"], run["not_launched"])
    k = run["kernels"][NAME]
    assert k["launches"] >= 1 and k["misses"] == 0 and k["failures"] == 0, k
    assert k["checks"] and all(c.endswith("matches the PyTorch reference") for c in k["checks"]), k["checks"]
