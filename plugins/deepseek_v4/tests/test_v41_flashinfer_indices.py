"""DeepSeek-V4.1's FlashInfer mixed sparse indices: against the PyTorch reference under Triton's interpreter (SWA-only
and compressed layers, local decode indices, packed pages, replay starts), hand-picked rows, errors, out=, and the
plan of examples/deepseek_v41.json under FlashInfer's backend."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from warmreg_deepseek_v4 import v41_flashinfer_indices
from warmreg_deepseek_v4.model import DSV4
from warmreg_deepseek_v4.v41_flashinfer_indices import V41FlashinferMixedIndices, v41_flashinfer_mixed_reference

import warmreg
from warmreg.testing import OpCall, RegisterPlugin, assert_warmup_inputs_reproduce, check_out, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
I32 = torch.int32
NAME = V41FlashinferMixedIndices.name
W = 8


def _flashinfer(**serving: Any) -> dict[str, Any]:
    config = example_config("deepseek_v41")
    config["serving"].update({"attention_backend": "FLASHINFER_MLA_SPARSE_DSV41", "kv_cache_dtype": "fp8", **serving})
    return config


def _batch(seed: int, top_k: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Two decode requests (1 and 2 tokens), then two prefill requests (3 and 4 tokens), block tables of 16-token
    SWA pages and 4-token compressed pages, the second prefill request replaying from position 21."""
    g = torch.Generator().manual_seed(seed)
    qsl = torch.tensor([0, 1, 3, 6, 10], dtype=I32)
    seqs = torch.tensor([20, 33, 12, 30], dtype=I32)
    t2r = torch.tensor([0, 1, 1, 2, 2, 2, 3, 3, 3, 3], dtype=I32)
    dswa = torch.randint(-1, 200, (3, W), generator=g, dtype=I32)
    dtopk = torch.randint(-1, 15, (3, 12), generator=g, dtype=I32)  # local compressed indices (< 4 pages * 4)
    ptopk = torch.randint(-1, 15, (7, 12), generator=g, dtype=I32)
    swa_bt, c_bt = (
        torch.randint(0, 40, (4, 3), generator=g, dtype=I32),
        torch.randint(0, 40, (4, 5), generator=g, dtype=I32),
    )
    replay = torch.tensor([0, 0, 0, 21], dtype=I32)
    valid = torch.tensor([True, False, True])
    args = (dswa, dtopk, None, ptopk, qsl, seqs, t2r, swa_bt, c_bt, replay)
    kwargs = dict(swa_block_size=16, compressed_block_size=4, compress_ratio=2, top_k=top_k,
                  decode_compressed_indices_are_local=True, decode_is_valid_token=valid, swa_block_span=20,
                  compressed_block_span=6)  # fmt: skip
    return args, kwargs


@pytest.mark.parametrize("top_k", [12, 0])
def test_compressed_layer_matches_reference(top_k: int) -> None:
    args, kwargs = _batch(top_k, top_k)
    got = V41FlashinferMixedIndices(window_size=W)(*args, **kwargs)
    want = v41_flashinfer_mixed_reference(*args, window_size=W, **kwargs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[0].shape == (10, W + 12)


def test_swa_only_and_global_decode_indices_match_reference() -> None:
    args, kwargs = _batch(5, 0)
    swa_only = (args[0], None, None, args[3][:, :0], *args[4:8], None, args[9])
    kw = dict(kwargs, compress_ratio=0, decode_compressed_indices_are_local=False, decode_is_valid_token=None)
    got = V41FlashinferMixedIndices(window_size=W)(*swa_only, **kw)
    want = v41_flashinfer_mixed_reference(*swa_only, window_size=W, **kw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[0].shape == (10, W)
    lens = torch.tensor([5, 0, 9], dtype=I32)  # global decode indices with their lengths
    glob = (args[0], args[1][:, :10], lens, *args[3:])
    kw = dict(kwargs, decode_compressed_indices_are_local=False, decode_is_valid_token=None)
    got = V41FlashinferMixedIndices(window_size=W)(*glob, **kw)
    want = v41_flashinfer_mixed_reference(*glob, window_size=W, **kw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[1][:3].tolist() == [13, 8, 17]


def test_hand_picked_prefill_row() -> None:
    """Prefill token 9 (request 3: seq 30, 4 tokens, pos 29, replay from 21): window from max(22, 21) = 22, 8 slots
    page(22) .. page(29) of 16-token pages; ratio 2: min(30 // 2, 12) = 12 candidates."""
    args, kwargs = _batch(9, 12)
    rows, lens = V41FlashinferMixedIndices(window_size=W)(*args, **dict(kwargs, swa_block_span=16))
    page = int(args[7][3, 1])
    assert rows[9, :W].tolist() == [page * 16 + p % 16 for p in range(22, 30)] and lens[9] == W + 12
    # token 6 (request 3, pos 26): the window starts at the replay start 21, 6 slots, then -1
    assert rows[6, :W].tolist() == [page * 16 + p % 16 for p in range(21, 27)] + [-1, -1] and lens[6] == W + 12


def test_errors_name_the_argument() -> None:
    args, kwargs = _batch(1, 12)
    op = V41FlashinferMixedIndices(window_size=W)
    with pytest.raises(warmreg.LaunchError, match="decode_swa_indices must be int32"):
        op(args[0].long(), *args[1:], **kwargs)
    with pytest.raises(warmreg.LaunchError, match="needs >= 8 columns"):
        op(args[0][:, :4], *args[1:], **kwargs)
    with pytest.raises(warmreg.LaunchError, match="need decode_is_valid_token"):
        op(*args, **dict(kwargs, decode_is_valid_token=None))
    with pytest.raises(warmreg.LaunchError, match=r"token_to_req_indices must be int32 \[>= 10\]"):
        op(*args[:6], args[6][:5], *args[7:], **kwargs)


def test_out_conformance() -> None:
    args, kwargs = _batch(2, 12)
    check_out(lambda: OpCall(V41FlashinferMixedIndices(window_size=W), args, kwargs))


# -- the plan ----------------------------------------------------------------------------------------------------------
def test_example_plans_five_keys_on_sm100() -> None:
    """SWA-only layers: no top-k; the ratio-2 (2-19) and ratio-1 (20-42) layers each: local decode top-k of the
    512-wide buffer, prefill top-k or none."""
    plan = warmreg.plan(_flashinfer(), target="cuda:100")
    got = {(k.fields()["compress_ratio"], k.fields()["top_k"], k.fields()["decode_compressed_topk"],
            k.fields()["decode_indices_local"], k.fields()["num_warps"]) for k in plan.kernel(NAME).keys}  # fmt: skip
    assert got == {
        (0, 0, 0, False, 1), (1, 0, 512, True, 4), (1, 512, 512, True, 4), (2, 0, 512, True, 4), (2, 512, 512, True, 4)
    }  # fmt: skip
    assert_warmup_inputs_reproduce(plan.kernel(NAME).kernel, plan.kernel(NAME).keys)
    buf, t2r = warmreg.meta((8192, 512), I32), warmreg.meta((8192,), I32)
    dswa, qsl, seqs = warmreg.meta((8192, 128), I32), warmreg.meta((257,), I32), warmreg.meta((256,), I32)
    bt, valid = warmreg.meta((256, 8192), I32), warmreg.meta((8192,), torch.bool)
    for nd, npf in ((3, 0), (0, 5), (2, 7)):  # decode-only, prefill-only and mixed steps of a ratio-2 layer
        prefill = buf[nd : nd + npf] if npf else buf[:0, :0]
        decode = buf[:nd] if nd else prefill[:0]
        call = OpCall(plan.kernel(NAME).kernel, (dswa[:nd], decode, None, prefill, qsl[:4], seqs[:3], t2r[: nd + npf],
                      bt[:3], bt[:3], seqs[:3]), {"swa_block_size": 64, "compressed_block_size": 64, "compress_ratio": 2,
                      "top_k": prefill.shape[1], "decode_compressed_indices_are_local": True,
                      "decode_is_valid_token": valid[:nd]})  # fmt: skip
        assert call.launch_code().key in plan.kernel(NAME).keys


def test_planned_only_for_flashinfer_off_sm120() -> None:
    assert NAME not in {k.name for k in warmreg.plan(_flashinfer(), target="cuda:120").kernels}
    assert NAME not in {k.name for k in warmreg.plan(EXAMPLES / "deepseek_v41.json", target="cuda:100").kernels}


def test_warm_cross_compiles() -> None:
    plugin = RegisterPlugin(v41_flashinfer_indices.register, model=DSV4.from_config)
    report = warmreg.warm(_flashinfer(), target="cuda:100", plugins=[plugin], entry_points=False)
    assert report.ok and report.compiled == 5, [(r.kernel, r.error) for r in report.failed]
