"""DeepSeek-V4's ROCm attention ops against vLLM 0.34's own kernels, on identical engine-shaped inputs, under Triton's
interpreter: the inverse GPT-J RoPE of the attention output and the in-tree sparse prefill
(``v1/attention/ops/rocm_aiter_mla_sparse.py``).

Runs in the vLLM 0.34 venv (``bash scripts/engine-envs.sh test vllm-0.34``); skips, naming why, elsewhere. Each test
calls vLLM's Python entry point exactly as its call site does (``rocm_inverse_rope_rows_`` from ``forward_mqa`` on
``output[rotated:end, :n_local_heads]``, ``_fused_inverse_rope_gptj`` as ``rocm_inv_rope_einsum`` calls it,
``rocm_sparse_attn_prefill`` from ``_forward_prefill`` on the chunk's workspace) and warmreg's drop-in on clones of
the same seeded tensors, then compares every buffer either side writes.

Tolerances: the inverse RoPE is compared bitwise (the same fp32 products and sums, the same bf16 conversion). The
sparse prefill is an attention: both sides run the same online softmax (tiles of 16 keys, fp32 ``tl.dot``
accumulation, ``exp``, probabilities rounded to bf16 for the second dot) in the same order, so it is compared bitwise
too; a reordering of the fp32 sums (another tile or head block) would stay within one bf16 step of these outputs of
magnitude ~1 (``atol 1e-2``, ``rtol 2**-7``), the bound the plugin's tests allow against the exact softmax. Both
kernels' bf16 dots run with the interpreter multiplying operand values (Triton 3.8's interpreter multiplies raw bf16
bits: :mod:`warmreg_deepseek_v4._interpreter_dot`), on both sides alike.

``vllm/platforms/rocm.py`` resolves the GPU's arch at import (amdsmi, else ``torch.cuda.get_device_properties``);
on this CPU machine that one platform query is answered ``gfx950`` while the module is imported. vLLM's ragged
prefill wrapper asserts its tensors are not on the CPU (``assert not q.is_cpu``): the prefill test answers
``Tensor.is_cpu`` False while vLLM's entry point runs, and nothing else; no kernel and no math is patched.
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

if not vllm.__version__.startswith("0.34"):
    pytest.skip(f"these compare vLLM 0.34's kernels; this venv has vLLM {vllm.__version__}", allow_module_level=True)

# The platform query vllm/platforms/rocm.py makes at import (amdsmi is absent here): answered gfx950.
with mock.patch.object(
    torch.cuda, "get_device_properties", lambda *a, **k: SimpleNamespace(gcnArchName="gfx950:sramecc+")
):
    engine("vllm.platforms.rocm")
vllm_sparse = engine("vllm.v1.attention.ops.rocm_aiter_mla_sparse")
from warmreg_deepseek_v4._interpreter_dot import bf16_dot_by_value  # noqa: E402
from warmreg_deepseek_v4.fp8_ds_mla import page_bytes  # noqa: E402
from warmreg_deepseek_v4.rocm_inverse_rope import RocmInverseRope  # noqa: E402
from warmreg_deepseek_v4.rocm_ragged import rocm_ragged_from_dense  # noqa: E402
from warmreg_deepseek_v4.rocm_sparse_attn_decode import decode_gfx942  # noqa: E402
from warmreg_deepseek_v4.rocm_sparse_attn_decode_gfx950 import decode_gfx950  # noqa: E402
from warmreg_deepseek_v4.rocm_sparse_attn_prefill import RocmSparseAttnPrefill  # noqa: E402

BF16, I32, U8 = torch.bfloat16, torch.int32, torch.uint8


def _cos_sin(positions: int, rope: int, g: torch.Generator) -> torch.Tensor:
    """An fp32 ``[P, rope]`` cache, cosines then sines (``DeepseekV4ScalingRotaryEmbedding.cos_sin_cache``)."""
    angles = torch.rand(positions, rope // 2, generator=g) * 6.3
    return torch.cat((angles.cos(), angles.sin()), dim=1)


# -- the inverse RoPE --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("tokens", "rotated", "end", "heads"), [(9, 3, 9, 8), (5, 0, 5, 16), (6, 2, 4, 3)])
def test_inverse_rope_rows_equals_vllm(tokens: int, rotated: int, end: int, heads: int) -> None:
    """``forward_mqa``'s standalone pass: rows ``[rotated, end)`` (the in-tree prefill's, after the decode rows the
    reduce rotated) of ``output[:, :n_local_heads]``, in place; a buffer wider in heads than the rank's heads."""
    g = seeded(tokens * 31 + heads)
    output = (torch.randn(tokens, heads + 2, 512, generator=g) * 4).to(BF16)
    args = {"output": output, "positions": torch.randint(0, 300, (tokens,), generator=g),
            "cache": _cos_sin(300, 64, g)}  # fmt: skip
    theirs, ours = clones(**args), clones(**args)
    vllm_sparse.rocm_inverse_rope_rows_(
        theirs["output"][rotated:end, :heads], theirs["positions"][rotated:end], theirs["cache"], 64
    )
    RocmInverseRope()(ours["output"][rotated:end, :heads], ours["positions"][rotated:end], ours["cache"],
                      rope_head_dim=64, inplace=True)  # fmt: skip
    assert_same(ours["output"], theirs["output"], "output")


def test_inverse_rope_fresh_output_equals_vllm() -> None:
    """``rocm_inv_rope_einsum(..., inverse_rope=True)``'s ``_fused_inverse_rope_gptj(o, positions, cos_sin_cache,
    rope_head_dim)``: a fresh bf16 output."""
    g = seeded(5)
    args = {"o": (torch.randn(4, 8, 512, generator=g) * 2).to(BF16), "positions": torch.randint(0, 50, (4,), generator=g),
            "cache": _cos_sin(50, 64, g)}  # fmt: skip
    theirs, ours = clones(**args), clones(**args)
    want = vllm_sparse._fused_inverse_rope_gptj(theirs["o"], theirs["positions"], theirs["cache"], 64)
    got = RocmInverseRope()(ours["o"], ours["positions"], ours["cache"], rope_head_dim=64)
    assert_same(got, want, "out")
    assert_same(ours["o"], theirs["o"], "o (unchanged)")


# -- the in-tree sparse prefill ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("tokens", "start", "end", "heads", "width", "rows"), [(7, 2, 7, 8, 640, 300), (4, 0, 3, 16, 128, 90)]
)
def test_sparse_prefill_equals_vllm(tokens: int, start: int, end: int, heads: int, width: int, rows: int) -> None:
    """``_forward_prefill``'s ``rocm_sparse_attn_prefill(q=q[start:end], kv=workspace.view(-1, 1, 512),
    indices=combined_indices, topk_length=combined_lens, ..., attn_sink=self.attn_sink, output=output[start:end])``:
    combined rows as ROCm's combine leaves them (live entries, then -1; a few past the workspace), the layer's fp32
    sink (one head at -inf: a padded slot). warmreg compacts with its ragged op, then runs its prefill; vLLM's
    entry point does both. Compared bitwise: the same tile order and the same fp32 operations on both sides (the
    module docstring's tolerance is the bound, bitwise is what holds)."""
    g = seeded(tokens * width + heads)
    lens = torch.randint(0, width + 1, (tokens,), generator=g, dtype=I32)
    dense = torch.randint(0, rows + 4, (tokens, width), generator=g, dtype=I32)
    dense[torch.arange(width)[None, :] >= lens[:, None]] = -1
    sink = torch.randn(heads, generator=g)
    sink[-1] = float("-inf")
    args = {"q": torch.randn(tokens, heads, 512, generator=g).to(BF16), "kv": torch.randn(rows, 512, generator=g).to(BF16),
            "dense": dense, "lens": lens, "sink": sink, "output": torch.zeros(tokens, heads, 512, dtype=BF16)}  # fmt: skip
    theirs, ours = clones(**args), clones(**args)
    n = end - start
    with bf16_dot_by_value(), mock.patch.object(torch.Tensor, "is_cpu", property(lambda self: False)):
        vllm_sparse.rocm_sparse_attn_prefill(
            q=theirs["q"][start:end], kv=theirs["kv"].view(-1, 1, 512), indices=theirs["dense"][:n],
            topk_length=theirs["lens"][:n], scale=512**-0.5, head_dim=512, nope_head_dim=448, rope_head_dim=64,
            attn_sink=theirs["sink"], output=theirs["output"][start:end],
        )  # fmt: skip
    with bf16_dot_by_value():
        indices, indptr = rocm_ragged_from_dense(ours["dense"][:n], ours["lens"][:n], rows)
        RocmSparseAttnPrefill()(ours["q"][start:end], ours["kv"], indices, indptr, ours["sink"][:heads],
                                scale=512**-0.5, out=ours["output"][start:end])  # fmt: skip
    assert theirs["output"][start:end].abs().sum() > 0, "vLLM's prefill wrote nothing: another branch ran"
    assert_same(ours["output"], theirs["output"], "output")


# -- the gfx942 sparse decode: partial pass and reduce -----------------------------------------------------------------
def _fp8_pages(g: torch.Generator, pages: int, bs: int, fnuz: bool) -> torch.Tensor:
    """``[pages, bs, 584]`` fp8_ds_mla pages at the allocated stride: every e4m3 code but a few NaNs, bf16 RoPE."""
    flat = torch.randint(0, 256, (pages, page_bytes(bs)), generator=g, dtype=U8)
    tokens = flat[:, : bs * 576].view(pages, bs, 576)
    tokens[..., 448:] = torch.randn(pages, bs, 64, generator=g).to(BF16).view(U8)
    flat[:, bs * 576 : bs * 584] = torch.randint(116, 124, (pages, bs * 8), generator=g).to(U8)
    return flat[:, : bs * 584].view(pages, bs, 584)


def _ragged(g: torch.Generator, lens: list[int], rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    indptr = torch.tensor([0, *lens], dtype=I32).cumsum(0).to(I32)
    return torch.randint(-1, rows + 2, (max(int(indptr[-1]), 1),), generator=g, dtype=I32), indptr


@pytest.mark.parametrize(("tokens", "heads", "extra"), [(3, 8, True), (2, 16, False), (4, 8, True)])
def test_sparse_decode_gfx942_equals_vllm(tokens: int, heads: int, extra: bool) -> None:
    """``_forward_decode``'s ``rocm_sparse_attn_decode(q=q[:num_decode_tokens], kv_cache, swa_k_cache, swa_only, ...,
    swa_ragged_indices, swa_ragged_indptr, topk_ragged_indices, topk_ragged_indptr, attn_sink, scale, 512, 448, 64,
    output=output[:num_decode_tokens], inv_rope_positions=positions, inv_rope_cos_sin_cache=...)`` on gfx942 (the
    module's ``_ON_GFX942`` / ``_ON_GFX950`` and the platform's FNUZ answer say so): the SWA cache FNUZ, the compressed
    one OCP, both with NaN codes (scrubbed to 0); a C4-like extra stream or an SWA-only layer; the CU count vLLM reads
    (256 where no device answers, warmreg's launch given the same). Within one bf16 step (see the module docstring:
    the reduce sums the splits' weights in another order)."""
    g = seeded(tokens * heads + extra)
    main, compressed = _fp8_pages(g, 5, 16, True), _fp8_pages(g, 4, 64, False)
    mi, mp = _ragged(g, [int(x) for x in torch.randint(1, 90, (tokens,), generator=g)], 80)
    ei, ep = _ragged(g, [int(x) for x in torch.randint(0, 260, (tokens,), generator=g)], 256)
    args = {"q": torch.randn(tokens + 2, heads, 512, generator=g).to(BF16), "main": main, "compressed": compressed,
            "mi": mi, "mp": mp, "ei": ei, "ep": ep, "sink": torch.randn(heads, generator=g),
            "positions": torch.randint(0, 50, (tokens + 2,), generator=g), "cache": _cos_sin(50, 64, g),
            "output": torch.zeros(tokens + 2, heads, 512, dtype=BF16)}  # fmt: skip
    theirs, ours = clones(**args), clones(**args)
    fnuz = mock.patch.object(vllm_sparse.current_platform, "is_fp8_fnuz", return_value=True)
    arch = mock.patch.multiple(vllm_sparse, _ON_GFX942=True, _ON_GFX950=False)
    with bf16_dot_by_value(), fnuz, arch, mock.patch.object(torch.Tensor, "is_cpu", property(lambda self: False)):
        rotated = vllm_sparse.rocm_sparse_attn_decode(
            q=theirs["q"][:tokens], kv_cache=theirs["compressed"] if extra else None, swa_k_cache=theirs["main"],
            swa_only=not extra, topk_indices=None, topk_lens=None, swa_indices=theirs["mi"][:1].view(1, 1),
            swa_lens=theirs["mp"][:1], swa_ragged_indices=theirs["mi"], swa_ragged_indptr=theirs["mp"],
            topk_ragged_indices=theirs["ei"] if extra else None, topk_ragged_indptr=theirs["ep"] if extra else None,
            attn_sink=theirs["sink"], scale=512**-0.5, head_dim=512, nope_head_dim=448, rope_head_dim=64,
            output=theirs["output"][:tokens], extra_cache_nan_free=False, adaptive_splits=False,
            inv_rope_positions=theirs["positions"][:tokens], inv_rope_cos_sin_cache=theirs["cache"],
        )  # fmt: skip
    assert rotated == tokens
    with bf16_dot_by_value():
        decode_gfx942(
            ours["q"][:tokens], (ours["main"], ours["mi"], ours["mp"]),
            (ours["compressed"], ours["ei"], ours["ep"]) if extra else None, ours["sink"], scale=512**-0.5,
            fnuz=True, positions=ours["positions"][:tokens], cos_sin_cache=ours["cache"], out=ours["output"][:tokens],
            cu=256,
        )  # fmt: skip
    assert theirs["output"][:tokens].abs().sum() > 0 and not theirs["output"].isnan().any()
    assert_same(ours["output"][tokens:], theirs["output"][tokens:], "output past the decode rows")
    torch.testing.assert_close(ours["output"].float(), theirs["output"].float(), atol=1e-2, rtol=2**-7)


@pytest.mark.parametrize(
    ("tokens", "extra", "trust", "adaptive"), [(3, True, True, False), (2, False, False, False), (3, True, False, False),
                                               (16, True, True, True)]
)  # fmt: skip
def test_sparse_decode_gfx950_equals_vllm(tokens: int, extra: bool, trust: bool, adaptive: bool) -> None:
    """The same call on gfx950 (``_ON_GFX950``; OCP caches; the reduce writes ``output`` directly): a trusted
    compressed cache (``extra_cache_nan_free``, fp8_ds_mla without a KV connector: its NaN codes replaced by finite
    ones on both sides, as the canonical writer leaves it), a scrubbed one, an SWA-only layer, and adaptive splits
    under CUDA-graph capture (16 queries: 16 workgroups, more than 4 splits; short segments work on 4 splits).
    Within one bf16 step."""
    g = seeded(tokens * 7 + extra + 2 * trust)
    main, compressed = _fp8_pages(g, 5, 16, False), _fp8_pages(g, 4, 64, False)
    if trust:  # a trusted cache holds no NaN code (e4m3fn 0x7f / 0xff): the canonical writer never stores one
        pages = compressed.as_strided((compressed.shape[0], compressed.stride(0)), (compressed.stride(0), 1))
        pages[(pages & 0x7F) == 0x7F] = 0x3F
    hi = 40 if adaptive else 90
    mi, mp = _ragged(g, [int(x) for x in torch.randint(1, hi, (tokens,), generator=g)], 80)
    ei, ep = _ragged(g, [int(x) for x in torch.randint(0, 3 * hi, (tokens,), generator=g)], 256)
    args = {"q": torch.randn(tokens + 1, 8, 512, generator=g).to(BF16), "main": main, "compressed": compressed,
            "mi": mi, "mp": mp, "ei": ei, "ep": ep, "sink": torch.randn(8, generator=g),
            "positions": torch.randint(0, 50, (tokens + 1,), generator=g), "cache": _cos_sin(50, 64, g),
            "output": torch.zeros(tokens + 1, 8, 512, dtype=BF16)}  # fmt: skip
    theirs, ours = clones(**args), clones(**args)
    fnuz = mock.patch.object(vllm_sparse.current_platform, "is_fp8_fnuz", return_value=False)
    arch = mock.patch.multiple(vllm_sparse, _ON_GFX942=False, _ON_GFX950=True)
    with bf16_dot_by_value(), fnuz, arch, mock.patch.object(torch.Tensor, "is_cpu", property(lambda self: False)):
        rotated = vllm_sparse.rocm_sparse_attn_decode(
            q=theirs["q"][:tokens], kv_cache=theirs["compressed"] if extra else None, swa_k_cache=theirs["main"],
            swa_only=not extra, topk_indices=None, topk_lens=None, swa_indices=theirs["mi"][:1].view(1, 1),
            swa_lens=theirs["mp"][:1], swa_ragged_indices=theirs["mi"], swa_ragged_indptr=theirs["mp"],
            topk_ragged_indices=theirs["ei"] if extra else None, topk_ragged_indptr=theirs["ep"] if extra else None,
            attn_sink=theirs["sink"], scale=512**-0.5, head_dim=512, nope_head_dim=448, rope_head_dim=64,
            output=theirs["output"][:tokens], extra_cache_nan_free=trust, adaptive_splits=adaptive,
            inv_rope_positions=theirs["positions"][:tokens], inv_rope_cos_sin_cache=theirs["cache"],
        )  # fmt: skip
    assert rotated == tokens
    with bf16_dot_by_value():
        decode_gfx950(
            ours["q"][:tokens], (ours["main"], ours["mi"], ours["mp"]),
            (ours["compressed"], ours["ei"], ours["ep"]) if extra else None, ours["sink"], scale=512**-0.5,
            trust_extra=trust, adaptive=adaptive, positions=ours["positions"][:tokens], cos_sin_cache=ours["cache"],
            out=ours["output"][:tokens], cu=256,
        )  # fmt: skip
    assert theirs["output"][:tokens].abs().sum() > 0 and not theirs["output"].isnan().any()
    assert_same(ours["output"][tokens:], theirs["output"][tokens:], "output past the decode rows")
    torch.testing.assert_close(ours["output"].float(), theirs["output"].float(), atol=1e-2, rtol=2**-7)
