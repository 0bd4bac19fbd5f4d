"""``attn_res`` against its PyTorch reference under Triton's interpreter (CPU tensors), and its plan.

Hidden sizes are small (128, and 96 for a masked tile): the interpreter runs each program in numpy.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from warmreg_kimi_k3.attn_res import AttnRes, attn_res_reference, call_sites

import warmreg
from warmreg.testing import OpCall, assert_warmup_inputs_reproduce, check_out

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "kimi_k3_attn_res.json"  # kimi_k3.json sets no block size
ATTN_RES = AttnRes.name
# The output and the updated prefix are cast to bf16 once, from fp32 sums (the dot products, the norms, the
# softmax and the mix) whose order differs between the kernel and the reference: one bf16 rounding step apart
# at most (8 mantissa bits: rtol 1.6e-2 covers one ulp with margin; atol for outputs near 0). The prefix is
# pre + delta cast to bf16 once; the interpreter's fp32 -> bf16 cast does not round to nearest-even as torch
# does (one ulp apart in about a quarter of the elements on random inputs, seen), so prefix and delta are
# multiples of 1/16 below 8 in magnitude: their sum is exact in bf16, and the updated prefix and the written
# block (a copy of it) must match exactly.
TOL = {"atol": 1e-2, "rtol": 1.6e-2}


def _kernel(hidden: int = 128) -> AttnRes:
    return AttnRes(hidden_size=hidden, num_layers=4, block_size=2, eps=1e-5, output_norm_eps=1e-6)


def _inputs(
    tokens: int, hidden: int, rows: int, *, delta: bool, norm: bool, strided: bool = False, seed: int = 0
) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=gen)).to(torch.bfloat16)

    if strided:  # blocks a view of a wider buffer: stride_block_r = hidden + 32, stride_block_m = rows * that
        blocks = randn(tokens, rows, hidden + 32)[:, :, :hidden]
    else:
        blocks = randn(tokens, rows, hidden)

    def exact(*shape: int) -> torch.Tensor:  # sums of two of these are exact in bf16 (see TOL)
        return (torch.randn(*shape, generator=gen) * 16).round().clamp(-127, 127).div(16).to(torch.bfloat16)

    return {
        "prefix": exact(tokens, hidden),
        "delta": exact(tokens, hidden) if delta else None,
        "blocks": blocks,
        "norm_weight": (1 + randn(hidden, scale=0.2).float()).to(torch.bfloat16),
        "qk_weight": randn(hidden, scale=0.3),  # logits of a few units: a softmax neither flat nor one-hot
        "output_norm_weight": (1 + randn(hidden, scale=0.2).float()).to(torch.bfloat16) if norm else None,
        "output_norm_eps": 1e-6 if norm else None,
    }


def _check(kernel: AttnRes, inputs: dict[str, Any], num_blocks: int, write: int) -> None:
    want, want_prefix, want_blocks = attn_res_reference(
        **inputs, num_blocks=num_blocks, block_write_idx=write, eps=1e-5
    )
    out = kernel(**inputs, num_blocks=num_blocks, block_write_idx=write, eps=1e-5)
    assert out.shape == inputs["prefix"].shape and out.dtype == torch.bfloat16 and out.is_contiguous()
    torch.testing.assert_close(out, want, **TOL)
    torch.testing.assert_close(inputs["prefix"], want_prefix, atol=0, rtol=0)  # the in-place prefix update
    torch.testing.assert_close(inputs["blocks"], want_blocks, atol=0, rtol=0)  # the block write (only)
    if write >= 0:  # the written block is the updated prefix; the other blocks are untouched
        assert torch.equal(inputs["blocks"][:, write], inputs["prefix"])
        others = [r for r in range(inputs["blocks"].shape[1]) if r != write]
        assert torch.equal(inputs["blocks"][:, others], want_blocks[:, others])


@pytest.mark.parametrize("num_blocks", [0, 1, 2, 5])
@pytest.mark.parametrize("write", ["none", "first", "last"])
@pytest.mark.parametrize(("delta", "norm"), [(True, True), (True, False), (False, True), (False, False)])
def test_decode_matches_reference(num_blocks: int, write: str, delta: bool, norm: bool) -> None:
    """T = 1 (the (4, 8) tile for more than one block). "last" writes block num_blocks, as the model's
    block-write layers do (or the last source block when there is none beyond); "first" writes block 0."""
    idx = {"none": -1, "first": 0, "last": num_blocks}[write]
    inputs = _inputs(1, 128, max(num_blocks, idx + 1, 1), delta=delta, norm=norm, seed=num_blocks)
    _check(_kernel(), inputs, num_blocks, idx)


@pytest.mark.parametrize("num_blocks", [1, 2, 5])
def test_write_into_a_source_block_is_read_back(num_blocks: int) -> None:
    """A write index below num_blocks: that source is the freshly written block (the kernel keeps it in
    registers; the reference stores, then reads)."""
    inputs = _inputs(2, 128, num_blocks, delta=True, norm=True, seed=7)
    _check(_kernel(), inputs, num_blocks, num_blocks - 1)


@pytest.mark.parametrize("tokens", [3, 17])
@pytest.mark.parametrize("strided", [False, True])
def test_strided_blocks_and_a_masked_hidden(tokens: int, strided: bool) -> None:
    """hidden 96 (BLOCK_D 128: a masked tile) and blocks whose rows are not hidden apart."""
    kernel = _kernel(96)
    inputs = _inputs(tokens, 96, 6, delta=True, norm=True, strided=strided, seed=tokens)
    key = kernel.dispatch(**_dispatch_args(inputs, 5, 2))
    assert (key.stride_block_r, key.stride_block_m) == ((128, 6 * 128) if strided else (96, 6 * 96))
    assert key.block_d == 128
    _check(kernel, inputs, 5, 2)


def _dispatch_args(inputs: dict[str, Any], num_blocks: int, write: int) -> dict[str, Any]:
    return {
        "prefix": inputs["prefix"], "delta": inputs["delta"], "blocks": inputs["blocks"],
        "norm_weight": inputs["norm_weight"], "output_norm_weight": inputs["output_norm_weight"],
        "num_blocks": num_blocks, "block_write_idx": write, "eps": 1e-5,
        "output_norm_eps": inputs["output_norm_eps"], "launch_pdl": False,
    }  # fmt: skip


@pytest.mark.slow  # 256 rows through the interpreter: about 20 s
def test_prefill_tile_at_256_tokens() -> None:
    """The T class boundary: 255 tokens take the (4, 8) tile, 256 the (1, 4) tile, and 256 matches the
    reference. (The 256-row launch is 256 interpreted programs at hidden 32, a few seconds.)"""
    kernel = _kernel(32)
    for tokens, tile in ((255, (4, 8)), (256, (1, 4))):
        inputs = _inputs(tokens, 32, 5, delta=True, norm=True, seed=tokens)
        key = kernel.dispatch(**_dispatch_args(inputs, 5, -1))
        assert (key.block_l, key.num_warps, key.num_stages) == (*tile, 2)
    _check(kernel, inputs, 5, -1)


def test_empty_batch_and_launch_errors() -> None:
    kernel = _kernel()
    empty = _inputs(0, 128, 2, delta=True, norm=False)
    assert kernel(**empty, num_blocks=2, block_write_idx=-1, eps=1e-5).shape == (0, 128)
    inputs = _inputs(1, 128, 2, delta=True, norm=True)
    with pytest.raises(warmreg.LaunchError, match="too few"):
        kernel(**inputs, num_blocks=3, block_write_idx=-1, eps=1e-5)
    with pytest.raises(warmreg.LaunchError, match="block_write_idx"):
        kernel(**inputs, num_blocks=1, block_write_idx=-2, eps=1e-5)
    with pytest.raises(warmreg.LaunchError, match="output_norm_eps"):
        kernel(**{**inputs, "output_norm_eps": None}, num_blocks=1, block_write_idx=-1, eps=1e-5)
    with pytest.raises(warmreg.LaunchError, match="one floating dtype"):
        kernel(**{**inputs, "delta": inputs["delta"].float()}, num_blocks=1, block_write_idx=-1, eps=1e-5)
    with pytest.raises(warmreg.LaunchError, match="aligned"):
        kernel(**{**inputs, "prefix": torch.zeros(129, dtype=torch.bfloat16)[1:].view(1, 128)},
               num_blocks=1, block_write_idx=-1, eps=1e-5)  # fmt: skip


# -- the plan ------------------------------------------------------------------------------------------------------
def _example(**text: Any) -> dict[str, Any]:
    data = json.loads(EXAMPLE.read_text())
    data.pop("description")
    data["model"]["text_config"].update(text)
    return data


def _base_keys() -> int:
    """The keys of ``kimi_k3.json``: the attn_res example without attn_res."""
    return warmreg.plan(EXAMPLE.with_name("kimi_k3.json"), target="cuda:90").num_keys


def _expected_sites(layers: int, bsz: int) -> set[tuple[int, int, bool, bool]]:
    """(num_blocks, write idx, delta, output norm) over the layers, written out from the model's call sites
    (``KimiDecoderLayer._pre_attn_norm`` / ``_post_attn_norm`` and ``KimiLinearModel.forward`` in vLLM 0.33)."""
    out = {(math.ceil(layers / bsz), -1, True, False)}  # the model output
    for i in range(layers):
        nb, writes = math.ceil(i / bsz), i % bsz == 0
        out.add((nb, i // bsz if writes else -1, i > 0, True))  # before attention: layer 0 has no delta
        # before the MLP: a block-write layer's attention output is the new prefix, without a delta
        out.add((nb + int(writes), -1, not writes, True))
    return out


def test_call_sites_of_the_example() -> None:
    """Layer 0's attention input and the MLP input of every block-write layer have no delta (HAS_DELTA off: other
    binaries), as vLLM's own warmup profiles list them (``get_attn_res_triton_warmup_profiles``)."""
    sites = {(s.num_blocks, s.block_write_idx, s.has_delta, s.apply_output_norm) for s in call_sites(93, 12)}
    assert sites == _expected_sites(93, 12)
    assert (0, 0, False, True) in sites and {(nb, -1, False, True) for nb in range(1, 9)} <= sites
    # writes 0..7 (0 without a delta), (1..8, no write) with and without a delta, the output (8, no norm)
    assert len(sites) == 25


def test_plan_for_sm90_has_every_call_site_at_both_tiles() -> None:
    plan = warmreg.plan(EXAMPLE, target="cuda:90")
    keys = plan.kernel(ATTN_RES).keys
    sites = _expected_sites(93, 12)
    # Both tile classes (max_num_batched_tokens 8192 >= 256), one binary when num_blocks <= 1 (same tile).
    expected = sum(1 if nb <= 1 else 2 for nb, *_ in sites)
    assert len(keys) == expected == 46
    assert {(k.num_blocks, k.block_write_idx, k.has_delta, k.apply_output_norm) for k in keys} == sites
    key = next(k for k in keys if k.num_blocks == 8 and not k.apply_output_norm and k.block_l == 4)
    assert key.fields() == {
        "dtype": "bfloat16", "weight_dtype": "bfloat16", "hidden_size": 7168, "block_d": 8192,
        "num_blocks": 8, "block_write_idx": -1, "has_delta": True, "write_block": False,
        "apply_output_norm": False, "eps": 1e-5, "output_norm_eps": 0.0,
        "stride_prefix_m": 7168, "stride_delta_m": 7168, "stride_block_m": 8 * 7168, "stride_block_r": 7168,
        "stride_out_m": 7168, "block_l": 4, "num_warps": 8, "num_stages": 2, "launch_pdl": True,
    }  # fmt: skip
    assert plan.num_keys == _base_keys() + expected  # and kimi_k3.json's keys (no attn_res there)


def test_runtime_shapes_are_planned() -> None:
    """Real sizes the domains did not sample (7 and 8192 tokens, rows sliced from a bigger buffer) hit the plan."""
    kp = warmreg.plan(EXAMPLE, target="cuda:90").kernel(ATTN_RES)
    for tokens in (7, 255, 300, 8192):
        pre_buf, res_buf = warmreg.meta((8192, 7168), torch.bfloat16), warmreg.meta((8192, 8, 7168), torch.bfloat16)
        for nb, write, delta, norm in _expected_sites(93, 12):
            key = kp.kernel.dispatch(
                prefix=pre_buf[:tokens], delta=warmreg.meta((tokens, 7168), torch.bfloat16) if delta else None,
                blocks=res_buf[:tokens], norm_weight=warmreg.meta((7168,), torch.bfloat16),
                output_norm_weight=warmreg.meta((7168,), torch.bfloat16) if norm else None,
                num_blocks=nb, block_write_idx=write, eps=1e-5, output_norm_eps=1e-5 if norm else None,
                launch_pdl=True,
            )  # fmt: skip
            assert key in kp.keys, key


def test_sm10x_leaves_the_blocks_to_the_cpp_op() -> None:
    """Every example call site has num_blocks <= 8 at hidden 7168: the C++ op on SM10x, nothing to warm."""
    assert ATTN_RES not in {k.name for k in warmreg.plan(EXAMPLE, target="cuda:100").kernels}
    # A block size of 8 gives 12 blocks: the call sites above 8 blocks are Triton's there.
    keys = warmreg.plan(_example(attn_res_block_size=8), target="cuda:100").kernel(ATTN_RES).keys
    assert keys and all(k.num_blocks > 8 for k in keys)


@pytest.mark.parametrize("target", ["rocm:gfx942", "rocm:gfx950+aiter"])
def test_rocm_plans_every_call_site_without_pdl(target: str) -> None:
    """ROCm has no C++ op: every call site at both tiles, as on SM90, with PDL off (unquantized projections: no
    fused FP8 output)."""
    sm90 = {attrs.evolve(k, launch_pdl=False) for k in warmreg.plan(EXAMPLE, target="cuda:90").kernel(ATTN_RES).keys}
    keys = set(warmreg.plan(EXAMPLE, target=target).kernel(ATTN_RES).keys)
    assert len(keys) == 46 and keys == sm90
    assert ATTN_RES not in {k.name for k in warmreg.plan(EXAMPLE, target="xpu:pvc").kernels}


def test_no_block_size_no_attn_res() -> None:
    data = _example()
    del data["model"]["text_config"]["attn_res_block_size"]
    plan = warmreg.plan(data, target="cuda:90")
    assert ATTN_RES not in {k.name for k in plan.kernels} and plan.num_keys == _base_keys()


@pytest.mark.parametrize("bad", [0, -3, 1.5, True, "12"])
def test_bad_block_size_is_a_config_error(bad: object) -> None:
    with pytest.raises(warmreg.ConfigError, match=r"attn_res_block_size"):
        warmreg.plan(_example(attn_res_block_size=bad), target="cuda:90")


def test_eps_reaches_the_key() -> None:
    (eps,) = {k.eps for k in warmreg.plan(_example(rms_norm_eps=1e-6), target="cuda:90").kernel(ATTN_RES).keys}
    assert eps == 1e-6


def test_warmup_inputs_reproduce_every_key() -> None:
    kp = warmreg.plan(EXAMPLE, target="cuda:90").kernel(ATTN_RES)
    kernel = kp.kernel
    assert_warmup_inputs_reproduce(kernel, kp.keys)


# -- out= (the kit's check_out: returned and fully written, wrong buffers refused, nothing allocated) ------------
def test_out() -> None:
    def build() -> OpCall:  # fresh inputs per launch: the op updates prefix and blocks in place
        inputs = _inputs(3, 96, 6, delta=True, norm=True, seed=3)
        return OpCall(_kernel(96), (), {**inputs, "num_blocks": 5, "block_write_idx": 2, "eps": 1e-5})

    check_out(build)
