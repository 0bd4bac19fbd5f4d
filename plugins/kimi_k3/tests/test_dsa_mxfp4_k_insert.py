"""The MXFP4 key insert of the DSA indexer under Triton's interpreter: the cache bytes and the top-k fill against
the PyTorch reference, the LayerNorm + MXFP4 math and the byte layout on hand-picked keys, strided views, padding
and missing slots, errors. The plan is in ``test_dsa_mxfp4_plan.py``.

Tolerance: the scale bytes, the top-k rows and every byte the kernel must leave alone are compared exactly. The
packed nibbles may differ by one code in a few places: the kernel's LayerNorm sums in the interpreter's order
(numpy) and torch's reference in its own, so a mean or variance one fp32 ulp apart can move a value across a bf16
rounding step and then across an E2M1 midpoint. The hand-picked keys, whose sums are exact, are compared exactly.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from warmreg_kimi_k3._mxfp4 import entry_bytes
from warmreg_kimi_k3.dsa_mxfp4_k_insert import MXFP4KeyInsert, mxfp4_key_insert_reference

import warmreg

D, TOPK = 128, 2048
ENTRY = entry_bytes(D)  # 68


def _paged_cache(blocks: int, block_size: int, *, pad: int = 32) -> torch.Tensor:
    """uint8 ``[blocks, block_size, 68]`` pages of a packed block row: ``pad`` foreign bytes after each page."""
    page = block_size * ENTRY + pad
    return torch.zeros(blocks * page, dtype=torch.uint8).as_strided((blocks, block_size, ENTRY), (page, ENTRY, 1))


def _inputs(tokens: int, slots: list[int], *, seed: int = 0, block_size: int = 16) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    proj = (torch.randn(tokens, D + 32, generator=gen) * 3 + 0.5).to(torch.bfloat16)  # wkv_index: [index_k | w]
    return {
        "k": proj[:, :D],
        "norm_weight": torch.rand(D, generator=gen) + 0.5,
        "norm_bias": torch.randn(D, generator=gen) * 0.1,
        "norm_eps": 1e-5,
        "slot_mapping": torch.tensor(slots, dtype=torch.int64),
        "kv_cache": _paged_cache(4, block_size),
        "topk_indices_buffer": torch.randint(0, 99, (tokens + 3, TOPK), generator=gen, dtype=torch.int32),
        "num_tokens": tokens,
    }


def _insert_and_reference(inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole cache storage and the top-k buffer as the kernel wrote them, and as the reference wrote copies."""
    cache = inputs["kv_cache"]
    nbytes = cache.untyped_storage().nbytes()
    storage = cache.as_strided((nbytes,), (1,), 0).clone()
    theirs = {
        **inputs, "kv_cache": storage.as_strided(cache.shape, cache.stride(), cache.storage_offset()),
        "topk_indices_buffer": inputs["topk_indices_buffer"].clone(),
    }  # fmt: skip
    got_cache, got_topk = MXFP4KeyInsert()(**inputs)
    assert got_cache is cache and got_topk is inputs["topk_indices_buffer"]
    mxfp4_key_insert_reference(**theirs)
    return cache.as_strided((nbytes,), (1,), 0), storage, got_topk, theirs["topk_indices_buffer"]


def _assert_cache_close(got: torch.Tensor, want: torch.Tensor, block_size: int) -> None:
    """Scale bytes and bytes outside the entries exact; the packed nibbles one code apart at most, nearly all
    equal (the module docstring says why)."""
    g, w = got.view(4, -1), want.view(4, -1)
    values = block_size * D // 2
    assert torch.equal(g[:, values:], w[:, values:]), "scale bytes or bytes outside the entries"
    nib = [torch.stack([x[:, :values] & 15, x[:, :values] >> 4]).int() for x in (g, w)]
    assert int(((nib[0] & 7) - (nib[1] & 7)).abs().max()) <= 1
    assert float((nib[0] == nib[1]).float().mean()) > 0.99


@pytest.mark.parametrize(
    ("tokens", "slots", "block_size"),
    [(6, [0, 17, 18, 40, 63, 5], 16), (5, [7, -1, 12], 13)],
    ids=["regular", "padding-rows-and-no-slot"],
)
def test_matches_reference(tokens: int, slots: list[int], block_size: int) -> None:
    """Rows past the slot mapping (padding) and negative slots are not inserted; every top-k row is filled."""
    inputs = _inputs(tokens, slots, seed=tokens, block_size=block_size)
    got, want, topk, want_topk = _insert_and_reference(inputs)
    assert torch.equal(topk, want_topk) and topk[:tokens].eq(-1).all() and topk[tokens:].ne(-1).all()
    _assert_cache_close(got, want, block_size)
    written = {s for s in slots if s >= 0}
    cache = inputs["kv_cache"]
    for s in range(4 * block_size):
        entry = cache[s // block_size].reshape(-1)
        scales = entry[block_size * 64 + s % block_size * 4 :][:4]
        assert bool(scales.ne(0).all()) == (s in written), s  # every written block's scale byte is >= 1


def test_layer_norm_and_layout_on_exact_keys() -> None:
    """Keys of +-1 (mean 0, variance 1: the LayerNorm is the weight's sign flip, exactly) with eps 0; the weight
    picks the values of each block: the E2M1 grid at amax 6 (byte 127), zeros (byte 1), one bf16 step above 6
    (byte 128), and amax 0.375 (byte 123, 2**-4: 0.375 -> 6). Slot 21 of 16-token blocks: block 1, entry 5."""
    signs = torch.tensor([1.0, -1.0]).repeat(64)
    w = torch.zeros(D)
    w[:16] = torch.tensor([0.0, 0.5, 1, 1.5, 2, 3, 4, 6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    w[64:96] = 6.03125
    w[96:128] = 0.375
    inputs = _inputs(1, [21])
    inputs.update(k=signs.to(torch.bfloat16)[None], norm_weight=w, norm_bias=torch.zeros(D), norm_eps=0.0)
    MXFP4KeyInsert()(**inputs)
    block = inputs["kv_cache"][1].reshape(-1)
    packed, scales = block[5 * 64 : 6 * 64], block[16 * 64 + 5 * 4 : 16 * 64 + 6 * 4]
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).flatten()  # element order: +w, -w, +w, ...
    assert codes[:16].tolist() == [0, 8 | 1, 2, 8 | 3, 4, 8 | 5, 6, 8 | 7, 0, 8 | 2, 2, 8 | 4, 4, 8 | 6, 6, 8 | 7]
    assert codes[16:64].eq(0).all()  # -1 * 0 + 0 is +0.0
    assert codes[64:66].tolist() == [5, 8 | 5] and codes[96:98].tolist() == [7, 8 | 7]  # 3.015625 -> 3; 6
    assert scales.tolist() == [127, 1, 128, 123]
    assert int(inputs["kv_cache"].ne(0).sum()) == int(packed.ne(0).sum()) + 4  # nothing else written


def test_layouts_share_one_binary() -> None:
    """A contiguous key, a column view of the projection, a contiguous cache and a page-strided one, int32 slots
    or a longer mapping: every launch equals the reference; the dtypes alone make the key."""
    kernel, keys = MXFP4KeyInsert(), set()
    base = _inputs(4, [3, 9, 30, 2], seed=7)
    variants = [
        base,
        {**base, "k": base["k"].contiguous()},
        {**base, "kv_cache": torch.zeros(4, 16, ENTRY, dtype=torch.uint8)},
        {**base, "slot_mapping": torch.tensor([3, 9, 30, 2, 50, 51])},
    ]
    for inputs in variants:
        got, want, topk, want_topk = _insert_and_reference(inputs)
        assert torch.equal(topk, want_topk)
        _assert_cache_close(got, want, 16)
        keys.add(kernel.dispatch(k=inputs["k"], norm_weight=inputs["norm_weight"],
                                 slot_mapping=inputs["slot_mapping"], topk_indices_buffer=inputs["topk_indices_buffer"]))  # fmt: skip
    assert len(keys) == 1
    int32_slots = {**base, "slot_mapping": base["slot_mapping"].int()}
    _assert_cache_close(*_insert_and_reference(int32_slots)[:2], 16)


def test_empty_batch_and_launch_errors() -> None:
    kernel, inputs = MXFP4KeyInsert(), _inputs(3, [0, 1, 2])
    before = inputs["topk_indices_buffer"].clone()
    kernel(**{**inputs, "num_tokens": 0})
    assert torch.equal(inputs["topk_indices_buffer"], before) and not inputs["kv_cache"].any()
    bad = [
        ("kv_cache", torch.zeros(4, 16, 132, dtype=torch.uint8), "kv_cache must be uint8"),  # an FP8 cache's entries
        ("kv_cache", torch.zeros(4, 16, ENTRY, dtype=torch.int8), "kv_cache must be uint8"),
        ("kv_cache", torch.zeros(4, ENTRY, 16, dtype=torch.uint8).transpose(1, 2), "kv_cache must be uint8"),
        ("k", inputs["k"][:, :96], "power of two"),
        ("k", inputs["k"].t(), "k must be a 2-D"),
        ("num_tokens", 4, "num_tokens"),
        ("topk_indices_buffer", inputs["topk_indices_buffer"][:2], "topk_indices_buffer"),
        ("topk_indices_buffer", inputs["topk_indices_buffer"].long(), "topk_indices_buffer"),
        ("slot_mapping", inputs["slot_mapping"][None], "slot_mapping"),
        ("norm_bias", inputs["norm_bias"].to(torch.bfloat16), "norm_bias"),
        ("norm_weight", inputs["norm_weight"][:64], "norm_weight"),
    ]
    for arg, value, match in bad:
        with pytest.raises(warmreg.LaunchError, match=match):
            kernel(**{**inputs, arg: value})
