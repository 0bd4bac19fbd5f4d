"""ROCm's KDA chunk metadata: exact equality with the PyTorch reference (and the CUDA builder's host metadata)
under Triton's interpreter, hand-picked lengths, errors, and the plan."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from warmreg_kimi_k3.kda_chunk_base import chunk_metadata
from warmreg_kimi_k3.rocm_chunk_metadata import ROCmChunkMetadata, block_n, rocm_chunk_metadata_reference

import warmreg
from warmreg.testing import OpCall, assert_warmup_inputs_reproduce, check_out, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
NAME = ROCmChunkMetadata.name


def _cu(lens: list[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], dtype=dtype)


def test_hand_picked_lengths() -> None:
    """1 and 64 tokens are one chunk, 65 two, an empty sequence none."""
    cu = _cu([1, 64, 0, 65])
    indices, offsets = ROCmChunkMetadata(max_prefills=8)(cu, cu.clone())
    assert indices.tolist() == [[0, 0], [1, 0], [3, 0], [3, 1]]
    assert offsets.tolist() == [0, 1, 2, 2, 4] and offsets.dtype == torch.int64 and indices.dtype == torch.int32


@pytest.mark.parametrize(
    "lens",
    [[7], [300, 1, 64, 129], [1] * 130, [3, 0, 600] * 45, [17000]],  # 130 and 135 sequences: BLOCK_N 256; 266 chunks
)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_matches_reference_and_the_host_builder(lens: list[int], dtype: torch.dtype) -> None:
    cu = _cu(lens, dtype)
    indices, offsets = ROCmChunkMetadata(max_prefills=256)(cu, cu.clone())
    want_indices, want_offsets = rocm_chunk_metadata_reference(cu)
    assert torch.equal(indices, want_indices) and torch.equal(offsets, want_offsets)
    host_indices, host_offsets = chunk_metadata(cu)  # CUDA's builder: the same metadata, built on the host
    assert torch.equal(indices.long(), host_indices.long()) and torch.equal(offsets, host_offsets.long())


def test_launch_errors() -> None:
    kernel, cu = ROCmChunkMetadata(max_prefills=8), _cu([3, 4])
    with pytest.raises(warmreg.LaunchError, match="cu_seqlens must be a 1-D"):
        kernel(cu.float(), cu.float())
    with pytest.raises(warmreg.LaunchError, match="contiguous"):
        kernel(torch.stack([cu, cu], 1)[:, 0], cu)
    with pytest.raises(warmreg.LaunchError, match="cu_seqlens_cpu"):
        kernel(cu, cu[:2])


def test_tiles_follow_the_prefill_count() -> None:
    assert [block_n(n) for n in (1, 127, 128, 255, 256, 511)] == [128, 128, 256, 256, 512, 512]


# -- the plan ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["rocm:gfx942", "rocm:gfx950", "rocm:gfx950+aiter"])
def test_a_key_per_tile_on_rocm(target: str) -> None:
    """256 requests: tiles 128, 256 and 512 (257 entries), whatever the KDA prefill backend."""
    keys = warmreg.plan(EXAMPLES / "kimi_k3.json", target=target).kernel(NAME).keys
    assert sorted(k.fields()["block_n"] for k in keys) == [128, 256, 512]
    assert {(k.fields()["index_dtype"], k.fields()["chunk_size"], k.fields()["block_t"], k.fields()["num_warps"])
            for k in keys} == {("int32", 64, 256, 4)}  # fmt: skip


def test_not_planned_on_cuda_and_capped_by_the_token_budget() -> None:
    for target in ("cuda:90", "cuda:100"):
        assert NAME not in {k.name for k in warmreg.plan(example_config("kimi_k3"), target=target).kernels}
    small = warmreg.plan(example_config("kimi_k3", max_num_batched_tokens=100), target="rocm:gfx942")
    assert sorted(k.fields()["block_n"] for k in small.kernel(NAME).keys) == [128]


@pytest.mark.parametrize("prefills", [1, 127, 128, 200, 256])
def test_runtime_shapes_are_planned(prefills: int) -> None:
    kp = warmreg.plan(EXAMPLES / "kimi_k3.json", target="rocm:gfx942").kernel(NAME)
    assert kp.kernel.dispatch(cu_seqlens=warmreg.meta((prefills + 1,), torch.int32)) in kp.keys
    assert_warmup_inputs_reproduce(kp.kernel, sorted(kp.keys))


# -- out= (the kit's check_out: returned and fully written, wrong buffers refused, nothing allocated) ------------
def test_out() -> None:
    def build() -> OpCall:
        cu = _cu([5, 130, 64, 1])
        return OpCall(ROCmChunkMetadata(max_prefills=8), (cu, cu.clone()), {})

    check_out(build)
