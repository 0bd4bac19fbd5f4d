"""DeepSeek-V4's ROCm single-pass sparse MLA decode (``rocm_sparse_attn_decode_ragged``) against vLLM 0.34's own
``_sparse_attn_decode_ragged_kernel`` (``v1/attention/ops/rocm_aiter_mla_sparse.py``), on identical engine-shaped
inputs, under Triton's interpreter.

Runs in the vLLM 0.34 venv (``bash scripts/engine-envs.sh test vllm-0.34``); skips, naming why, elsewhere. Each test
calls vLLM's Python entry point exactly as ``DeepseekV4ROCMAiterMLAAttention._forward_decode`` does on gfx1250 and
RDNA (``rocm_sparse_attn_decode(q=q[:num_decode_tokens], ..., output=output[:num_decode_tokens],
inv_rope_positions=None, ...)``: ``fuse_decode_inv_rope`` is off there) and warmreg's op on clones of the same seeded
tensors, then compares every buffer either side writes (vLLM's entry point copies its fresh bf16 output into
``output``; warmreg's op writes the same rows through ``out=``).

Tolerance: both kernels run the same online softmax (tiles of 16 keys, fp32 ``tl.dot`` accumulation, ``exp``,
probabilities rounded to bf16 for the value dot, the sink folded in last) in the same order, so the outputs are
compared bitwise; a reordering of the fp32 sums would stay within one bf16 step of these outputs of magnitude ~1
(``atol 2e-2``, ``rtol 2**-7``), the bound the plugin's tests allow against the exact softmax. Both kernels' bf16
dots and products run with the interpreter computing on operand values (Triton 3.8's interpreter computes on raw bf16
bits: :mod:`warmreg_deepseek_v4._interpreter_dot`), on both sides alike. The caches hold every e4m3 code, NaN codes
included: the interpreter reads them as +-480 on both sides (compiled code reads NaN and scrubs it to 0).

Patched, and nothing else: the one platform query ``vllm/platforms/rocm.py`` makes at import (answered ``gfx950``,
amdsmi being absent), the module's arch flags ``_ON_GFX942`` / ``_ON_GFX950`` (both False: gfx1250 / RDNA) and the
platform's ``is_fp8_fnuz`` (gfx940's True, gfx1250's False), and ``Tensor.is_cpu`` answered False while vLLM's entry
point runs (it asserts its tensors are on a GPU). No kernel and no math is patched.
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
from warmreg_deepseek_v4.rocm_sparse_attn_decode_ragged import RocmSparseAttnDecodeRagged  # noqa: E402

BF16, I32, U8 = torch.bfloat16, torch.int32, torch.uint8


def _fp8_pages(g: torch.Generator, pages: int, bs: int) -> torch.Tensor:
    """``[pages, bs, 584]`` fp8_ds_mla pages at the allocated stride: every e4m3 code, bf16 RoPE, scales 2**-11..2**-4."""
    flat = torch.randint(0, 256, (pages, page_bytes(bs)), generator=g, dtype=U8)
    tokens = flat[:, : bs * 576].view(pages, bs, 576)
    tokens[..., 448:] = torch.randn(pages, bs, 64, generator=g).to(BF16).view(U8)
    flat[:, bs * 576 : bs * 584] = torch.randint(116, 124, (pages, bs * 8), generator=g).to(U8)
    return flat[:, : bs * 584].view(pages, bs, 584)


def _ragged(g: torch.Generator, lens: list[int], rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A ragged slot stream (a few slots -1 or past the cache's rows: skipped) and its int32 ``indptr``."""
    indptr = torch.tensor([0, *lens], dtype=I32).cumsum(0).to(I32)
    return torch.randint(-1, rows + 2, (max(int(indptr[-1]), 1),), generator=g, dtype=I32), indptr


@pytest.mark.parametrize(
    ("tokens", "heads", "extra", "fnuz"), [(3, 8, True, False), (2, 16, False, False), (4, 19, True, True)]
)
def test_single_pass_decode_equals_vllm(tokens: int, heads: int, extra: bool, fnuz: bool) -> None:
    """``_forward_decode``'s ``rocm_sparse_attn_decode(q=q[:num_decode_tokens], kv_cache, swa_k_cache, swa_only, ...,
    swa_ragged_indices, swa_ragged_indptr, topk_ragged_indices, topk_ragged_indptr, attn_sink, scale, 512, 448, 64,
    output=output[:num_decode_tokens], inv_rope_positions=None)`` off gfx942 and gfx950: a C4-like layer (SWA and
    compressed streams, one row without compressed keys), an SWA-only layer, and 19 heads (a partial second head
    block) with a FNUZ SWA cache (gfx940, ``gfx94``: vLLM's ``is_fp8_fnuz``); the layer's fp32 sink with one padded
    head at ``-inf``."""
    g = seeded(tokens * heads + extra)
    main, compressed = _fp8_pages(g, 5, 16), _fp8_pages(g, 4, 64)
    mi, mp = _ragged(g, [int(x) for x in torch.randint(1, 90, (tokens,), generator=g)], 80)
    ei, ep = _ragged(g, [0, *(int(x) for x in torch.randint(1, 260, (tokens - 1,), generator=g))], 256)
    sink = torch.randn(heads, generator=g)
    sink[-1] = float("-inf")
    args = {"q": torch.randn(tokens + 2, heads, 512, generator=g).to(BF16), "main": main, "compressed": compressed,
            "mi": mi, "mp": mp, "ei": ei, "ep": ep, "sink": sink,
            "output": torch.zeros(tokens + 2, heads, 512, dtype=BF16)}  # fmt: skip
    theirs, ours = clones(**args), clones(**args)
    fp8 = mock.patch.object(vllm_sparse.current_platform, "is_fp8_fnuz", return_value=fnuz)
    arch = mock.patch.multiple(vllm_sparse, _ON_GFX942=False, _ON_GFX950=False)
    with bf16_dot_by_value(), fp8, arch, mock.patch.object(torch.Tensor, "is_cpu", property(lambda self: False)):
        rotated = vllm_sparse.rocm_sparse_attn_decode(
            q=theirs["q"][:tokens], kv_cache=theirs["compressed"] if extra else None, swa_k_cache=theirs["main"],
            swa_only=not extra, topk_indices=None, topk_lens=None, swa_indices=theirs["mi"][:1].view(1, 1),
            swa_lens=theirs["mp"][:1], swa_ragged_indices=theirs["mi"], swa_ragged_indptr=theirs["mp"],
            topk_ragged_indices=theirs["ei"] if extra else None, topk_ragged_indptr=theirs["ep"] if extra else None,
            attn_sink=theirs["sink"], scale=512**-0.5, head_dim=512, nope_head_dim=448, rope_head_dim=64,
            output=theirs["output"][:tokens], extra_cache_nan_free=False, adaptive_splits=False,
            inv_rope_positions=None, inv_rope_cos_sin_cache=None,
        )  # fmt: skip
    assert rotated == 0
    extra_args = (ours["compressed"], ours["ei"], ours["ep"]) if extra else ()
    with bf16_dot_by_value():
        RocmSparseAttnDecodeRagged()(
            ours["q"][:tokens], ours["main"], ours["mi"], ours["mp"], *extra_args, attn_sink=ours["sink"][:heads],
            scale=512**-0.5, fnuz_main=fnuz, out=ours["output"][:tokens],
        )  # fmt: skip
    assert theirs["output"][:tokens].abs().sum() > 0 and not theirs["output"].isnan().any()
    assert_same(ours["output"], theirs["output"], "output")
    for name in ("q", "main", "compressed", "mi", "mp", "ei", "ep", "sink"):
        assert_same(ours[name], theirs[name], f"{name} (unchanged)")
