"""Kimi-K3's MLA decode under decode context parallelism with the all-to-all combine, against vLLM 0.34's own kernels
(issue 37), under the interpreter: the pack of a rank's partial output and lse, and the unpack and combine.

Runs in the vLLM venv (``VLLM_TARGET_DEVICE=cpu CUDA_VISIBLE_DEVICES= build/engine-venvs/vllm-0.34/bin/python -m pytest
tests/engines/test_vllm034_kernels_kimi_dcp_a2a.py``); skips, naming why, elsewhere. vLLM's side is
``vllm/v1/attention/ops/dcp.py: _dcp_a2a_pack_send(cp_attn_out, cp_attn_lse, send_buffer, N, H/N, D, pack, seq_lens,
query_start_loc)`` and ``_dcp_a2a_unpack_combine(recv_buffer, D, pack, return_lse, is_lse_base_on_e, out)`` as
``dcp_a2a_lse_reduce`` calls them (from ``dcp_a2a_v_up_proj_lse_reduce``, ``MLADCPManager.v_up_proj_combine`` of
``nvidia/mla.py``): the latent output ``[B, H, 512]`` below 8 tokens, the up-projected ``[B, H, 128]`` written
transposed by the bmm (head-strided) from 8, written into ``out`` = the attention output rows; the decode's int32
``seq_lens`` / ``query_start_loc`` (empty shards, CUDA-graph padding rows). A step of no local sequence is not
compared: vLLM's kernel then reads ``seq_lens[-1]``, out of bounds, which faults under the interpreter (the plugin's
tests check that every row is masked there, as vLLM's are whatever that read returns). The
all-to-all between them is a permutation of the ranks' send buffers, stood in for by the concatenation of the
buffers of several seeded ranks. Every buffer either side writes is compared bitwise: the same copies, bit
operations and fp32 arithmetic in the same order. Nothing is patched.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# First: skips where vLLM is not installed, else sets TRITON_INTERPRET and CUDA_VISIBLE_DEVICES before any
# kernel module is imported.
from vllm_kernels import assert_same, clones, engine, seeded  # isort: skip

import pytest
import torch
import vllm

if not vllm.__version__.startswith("0.34"):
    pytest.skip(f"these compare vLLM 0.34's kernels; this venv has vLLM {vllm.__version__}", allow_module_level=True)

vllm_dcp = engine("vllm.v1.attention.ops.dcp")
from warmreg_kimi_k3.dcp_a2a_combine import DCPA2AUnpackCombine  # noqa: E402
from warmreg_kimi_k3.dcp_a2a_pack import DCPA2APackSend  # noqa: E402

INF = float("inf")
CASES = [  # tokens, heads per rank, group, D, seq_lens, query_start_loc
    (1, 16, 2, 512, [9], [0, 1]),
    (5, 12, 4, 512, [3, 0, 7], [0, 2, 3, 4]),  # an empty shard, a padded row
    (12, 8, 8, 128, [5, 4, 0, 2, 6], [0, 2, 4, 6, 8, 10]),  # two padded rows
    (9, 4, 4, 128, [1] * 9, list(range(10))),
]


def _partial(tokens: int, heads: int, world: int, d: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    g = seeded(seed)
    if d == 128:  # the bmm's (H, B, V) result written into (B, H, V): head-strided
        out = torch.randn(heads * world, tokens, d, generator=g).to(dtype).transpose(0, 1)
    else:
        out = torch.randn(tokens, heads * world, d, generator=g).to(dtype)
    lse = torch.randn(tokens, heads * world, generator=g) * 4
    lse[0, 0], lse[-1, -1] = float("nan"), INF
    return {"out": out, "lse": lse}


def _seq_lens(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("tokens", "heads", "world", "d", "seq_lens", "starts"), CASES)
def test_pack_send_matches_vllm(
    dtype: torch.dtype, tokens: int, heads: int, world: int, d: int, seq_lens: list[int], starts: list[int]
) -> None:
    part = _partial(tokens, heads, world, d, dtype, seed=tokens * world)
    mask = {"seq_lens": _seq_lens(seq_lens), "qsl": torch.tensor(starts, dtype=torch.int32)}
    pack = vllm_dcp._dcp_a2a_lse_pack_dim(dtype)
    ours, theirs = clones(**part, **mask), clones(**part, **mask)
    send = torch.full((world, tokens, heads, d + pack), 7.0, dtype=dtype)
    vllm_dcp._dcp_a2a_pack_send(
        theirs["out"], theirs["lse"], send, world, heads, d, pack, seq_lens=theirs["seq_lens"],
        query_start_loc=theirs["qsl"],
    )  # fmt: skip
    kernel = DCPA2APackSend(dtype=str(dtype).removeprefix("torch."), world_size=world, head_dims={d: 256}, heads=heads)
    got = kernel(ours["out"], ours["lse"], world, ours["seq_lens"], ours["qsl"])
    assert_same(got, send, "send buffer")
    for name in part | mask:
        assert_same(ours[name], theirs[name], f"{name} (unwritten)")


@pytest.mark.parametrize("base_e", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("tokens", "heads", "world", "d", "seq_lens", "starts"), CASES)
def test_unpack_combine_matches_vllm(
    base_e: bool,
    dtype: torch.dtype,
    tokens: int,
    heads: int,
    world: int,
    d: int,
    seq_lens: list[int],
    starts: list[int],
) -> None:
    pack = vllm_dcp._dcp_a2a_lse_pack_dim(dtype)
    ranks = []
    for r in range(world):  # each rank's send buffer; the all-to-all hands rank 0 every rank's slice 0
        part = _partial(tokens, heads, world, d, dtype, seed=100 * r + tokens)
        send = torch.empty((world, tokens, heads, d + pack), dtype=dtype)
        vllm_dcp._dcp_a2a_pack_send(
            part["out"], part["lse"], send, world, heads, d, pack,
            seq_lens=_seq_lens(seq_lens), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        )  # fmt: skip
        ranks.append(send[0])
    recv = torch.stack(ranks)
    ours, theirs = clones(recv=recv), clones(recv=recv)
    kernel = DCPA2AUnpackCombine(
        dtype=str(dtype).removeprefix("torch."), world_size=world, head_dims=(d,), is_base_e=base_e, heads=heads
    )
    # with vLLM's out (the attention output rows, as dcp_a2a_v_up_proj_lse_reduce passes them) and without
    attn_out = {
        "ours": torch.full((tokens, heads * d), 3.0, dtype=dtype),
        "theirs": torch.full((tokens, heads * d), 3.0, dtype=dtype),
    }
    want = vllm_dcp._dcp_a2a_unpack_combine(
        theirs["recv"], d, pack, False, base_e, attn_out["theirs"].view(tokens, -1, d)
    )
    got = kernel(ours["recv"], is_lse_base_on_e=base_e, out=attn_out["ours"].view(tokens, -1, d))
    assert_same(got, want, "combined output")
    assert_same(attn_out["ours"], attn_out["theirs"], "attention output rows")
    want_out, want_lse = vllm_dcp._dcp_a2a_unpack_combine(theirs["recv"], d, pack, True, base_e)
    got_out, got_lse = kernel(ours["recv"], return_lse=True, is_lse_base_on_e=base_e)
    assert_same(got_out, want_out, "combined output (fresh)")
    assert_same(got_lse, want_lse, "global lse")
    assert_same(ours["recv"], theirs["recv"], "receive buffer (unwritten)")
