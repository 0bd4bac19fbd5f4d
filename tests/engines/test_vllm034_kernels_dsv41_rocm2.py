"""DeepSeek-V4.1's ROCm ops against vLLM 0.34's own kernels under Triton's interpreter: the TP-sharded engram gate
of gfx942 / gfx950, ``RocmEngram._post_wkv`` (``models/deepseek_v41/amd/engram.py``: ``_engram_gate_partials_kernel``,
the all-gather, ``_engram_gate_finish_kernel``), called as ``Engram.forward`` calls it, on a module built without its
constructor (which builds a process group and the ``wkv`` GEMM): the attributes ``_post_wkv`` reads are set by hand;
and gfx950's MXFP8 prefill rows, ``rocm_inverse_rope_mxfp8_rows`` (``v1/attention/ops/rocm_aiter_mla_sparse.py``:
``_inverse_rope_mxfp8_quant_kernel``) called as ``DeepseekV41ROCMAiterMLAAttention._forward_prefill`` calls it, into
row slices of the step's ``mxfp8_out`` buffers.

Every rank's ``send`` rows, the updated streams, the e4m3 rows and their E8M0 scales are compared bitwise: both sides
run the same fp32 operations in the same order under the interpreter (the rank sums in rank order) and convert to
bf16 / e4m3 the same way.

Patched, and only that: ``vllm/platforms/rocm.py``'s one platform query at import (answered ``gfx942``, as in
``test_vllm034_kernels_dsv4_rocm.py``) and the engram module's two tensor-parallel calls,
``get_tensor_model_parallel_rank`` (the rank being emulated) and ``tensor_model_parallel_all_gather`` (a first pass
per rank records that rank's ``send``; a last pass answers the concatenation of every rank's rows along tokens, which
is what the all-gather along ``dim=0`` returns). No kernel code and no math is patched.

Runs in the vLLM 0.34 venv (``bash scripts/engine-envs.sh test vllm-0.34``); skips, naming why, elsewhere.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))

# First: skips where vLLM is not installed, else sets TRITON_INTERPRET and CUDA_VISIBLE_DEVICES before any
# kernel module is imported.
from vllm_kernels import assert_same, clones, engine, seeded  # isort: skip

import pytest
import torch
import vllm
from torch import nn

if not vllm.__version__.startswith("0.34"):
    pytest.skip(f"these compare vLLM 0.34's kernels; this venv has vLLM {vllm.__version__}", allow_module_level=True)

with mock.patch.object(
    torch.cuda, "get_device_properties", lambda *a, **k: SimpleNamespace(gcnArchName="gfx942:sramecc+")
):
    engine("vllm.platforms.rocm")
vllm_engram = engine("vllm.models.deepseek_v41.amd.engram")
vllm_sparse = engine("vllm.v1.attention.ops.rocm_aiter_mla_sparse")
from warmreg_deepseek_v4.v41_engram_gate import CLAMP  # noqa: E402
from warmreg_deepseek_v4.v41_rocm_engram_gate import EngramGateFinish, EngramGatePartials  # noqa: E402
from warmreg_deepseek_v4.v41_rocm_inverse_rope_mxfp8 import RocmInverseRopeMxfp8  # noqa: E402

BF16 = torch.bfloat16


def _layer(c: int, d: int, p: int) -> nn.Module:
    """vLLM's ROCm engram with the attributes ``_post_wkv`` reads: ``p`` ranks sharing ``wkv``."""
    layer = vllm_engram.RocmEngram.__new__(vllm_engram.RocmEngram)
    nn.Module.__init__(layer)
    g = seeded(3)
    layer.q_weight = nn.Parameter(torch.randn(c, d, generator=g).to(BF16), requires_grad=False)
    layer.k_weight = nn.Parameter(torch.randn(c, d, generator=g).to(BF16), requires_grad=False)
    layer.hc_mult, layer.dim, layer.eps, layer.clamp_value, layer.kv_shards = c, d, 1e-6, CLAMP, p
    return layer


def _post_wkv(layer: nn.Module, hidden: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor | None, rank: int, gather):  # type: ignore[no-untyped-def]
    with (
        mock.patch.object(vllm_engram, "get_tensor_model_parallel_rank", lambda: rank),
        mock.patch.object(vllm_engram, "tensor_model_parallel_all_gather", gather),
    ):
        return layer._post_wkv(hidden, kv, mask, hidden.shape[0])


@pytest.mark.parametrize(
    ("t", "c", "d", "p", "masked"), [(5, 4, 96, 2, True), (3, 4, 80, 4, True), (4, 2, 64, 2, False)]
)
def test_post_wkv(t: int, c: int, d: int, p: int, masked: bool) -> None:
    """Streams ``[T, C, D]`` (a column view, as the mHC post's output may be), each rank's ``wkv`` shard, the image
    mask (and none); slices of 48, 20 (not a power of two) and 32."""
    layer, w, g = _layer(c, d, p), d // p, seeded(t + d)
    base = dict(
        hidden=torch.randn(t, c, d + 8, generator=g).to(BF16)[:, :, 4 : d + 4],
        kv=torch.randn(p, t, (c + 1) * w, generator=g).to(BF16),
        mask=torch.rand(t, generator=g) < 0.7,
    )
    theirs, ours = clones(**base), clones(**base)
    mask_t = theirs["mask"] if masked else None
    sends: list[torch.Tensor] = []

    def record(send: torch.Tensor, dim: int) -> torch.Tensor:
        sends.append(send.clone())
        return send.repeat(p, 1)  # this pass's output is dropped

    for r in range(p):
        _post_wkv(layer, theirs["hidden"], theirs["kv"][r], mask_t, r, record)
    want = _post_wkv(layer, theirs["hidden"], theirs["kv"][0], mask_t, 0, lambda send, dim: torch.cat(sends))

    dims = dict(hidden_size=d, hc_mult=c, tp_size=p, dtype="bfloat16")
    weights = dict(q_weight=layer.q_weight.data, k_weight=layer.k_weight.data)
    ours_sends = [EngramGatePartials(**dims)(ours["hidden"], ours["kv"][r], r * w, **weights) for r in range(p)]
    for r in range(p):
        assert_same(ours_sends[r], sends[r], f"rank {r}'s send rows")
    mask_o = ours["mask"] if masked else None
    got = EngramGateFinish(**dims)(ours["hidden"], torch.cat(ours_sends), mask_o, tp_size=p, eps=layer.eps)
    assert_same(got, want, "updated streams")
    for name in base:
        assert_same(ours[name], theirs[name], name)


@pytest.mark.parametrize(("decode", "prefill", "heads"), [(2, 5, 8), (0, 3, 3)])
def test_inverse_rope_mxfp8_rows(decode: int, prefill: int, heads: int) -> None:
    """V4.1's 512-wide heads (448 NoPE + 64 RoPE), the prefill rows after ``decode`` decode tokens of a step (the
    outputs' row slices, the positions' tail), 8 and 3 local heads; large and tiny rows (scales near both ends)."""
    g, d = seeded(prefill + heads), 512
    o = torch.randn(prefill, heads, d, generator=g) * 3
    o[0, 0] *= 1e4
    o[-1, -1] *= 1e-30
    cache = torch.randn(50, 64, generator=g)
    t = decode + prefill
    base = dict(
        o=o.to(BF16), positions=torch.randint(0, 50, (t,), generator=g), cache=cache,
        data=torch.zeros(t, heads * d, dtype=torch.float8_e4m3fn), scale=torch.full((t, heads * d // 32), 7, dtype=torch.uint8),
    )  # fmt: skip
    theirs, ours = clones(**base), clones(**base)
    vllm_sparse.rocm_inverse_rope_mxfp8_rows(
        theirs["o"],
        theirs["positions"][decode:],
        theirs["cache"],
        64,
        theirs["data"][decode:],
        theirs["scale"][decode:],
    )
    RocmInverseRopeMxfp8()(
        ours["o"], ours["positions"][decode:], ours["cache"], rope_head_dim=64,
        out=(ours["data"][decode:], ours["scale"][decode:]),
    )  # fmt: skip
    assert_same(ours["data"].view(torch.uint8), theirs["data"].view(torch.uint8), "e4m3 rows")
    for name in base:
        assert_same(ours[name], theirs[name], name)
