"""DeepSeek-V4's XPU BF16 sparse MLA attention against vLLM 0.34's own kernel, on identical engine-shaped inputs,
under Triton's interpreter.

Runs in the vLLM 0.34 venv (``bash scripts/engine-envs.sh test vllm-0.34``); skips, naming why, elsewhere. Each test
calls ``triton_bf16_mla_sparse_interface`` exactly as its two call sites do (``xpu_sparse_decode_fp8``: the flat
decode workspace ``unsqueeze(1)``, indices ``round_up(top + swa, 16)`` wide; ``DeepseekV4XPUSparseAttention.
_forward_prefill``: a chunk's query slice ``q[query_start:query_end]`` over ``kv[:chunk_size].reshape(-1, 1, 512)``,
indices ``round_up(top + window, 128)`` wide; both ``d_v=q.shape[-1]``, ``block_dpe=0``) and warmreg's drop-in on
clones of the same seeded tensors, and compares all three outputs and the inputs. Both kernels run inside
:func:`warmreg_deepseek_v4._interpreter_dot.bf16_dot_by_value` (Triton 3.8's interpreter multiplies bf16 bit patterns
in ``tl.dot``), and both do the same operations in the same order (fp32 dots, base-2 online softmax over 16-column
blocks, bf16 probabilities), so the comparison is bitwise: no tolerance. No kernel and no math is patched.
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

vllm_xpu = engine("vllm.v1.attention.ops.xpu_mla_sparse")
from warmreg_deepseek_v4._interpreter_dot import bf16_dot_by_value  # noqa: E402
from warmreg_deepseek_v4.xpu_sparse_mla import XPUSparseMla  # noqa: E402

BF16, I32 = torch.bfloat16, torch.int32
SCALE = 512**-0.5


def _compare(theirs: dict[str, torch.Tensor], ours: dict[str, torch.Tensor], call) -> None:  # type: ignore[no-untyped-def]
    with bf16_dot_by_value():
        want = call(lambda q, kv, idx: vllm_xpu.triton_bf16_mla_sparse_interface(
            q=q, kv=kv, indices=idx, sm_scale=SCALE, d_v=q.shape[-1], block_dpe=0), theirs)  # fmt: skip
        got = call(lambda q, kv, idx: XPUSparseMla()(q, kv, idx, SCALE), ours)
    for name, a, b in zip(("out", "max_logits", "lse"), got, want, strict=True):
        assert_same(a, b, name)
    for name in theirs:
        assert_same(ours[name], theirs[name], name)


@pytest.mark.parametrize(("tokens", "heads", "top", "swa"), [(3, 8, 0, 128), (4, 8, 512, 128), (2, 16, 256, 133)])
def test_decode_equals_vllm(tokens: int, heads: int, top: int, swa: int) -> None:
    """``xpu_sparse_decode_fp8``: SWA-only and C4 rows (Flash at TP 8), a C128 row with a DSpark-like SWA width whose
    total is not a multiple of 16 (16 heads: Pro at TP 8); top-k rows first, then SWA rows, ``-1`` past each length."""
    g = seeded(tokens * 100 + top + swa)
    total = top + swa
    width = max(16, (total + 15) // 16 * 16)
    workspace = torch.randn((tokens * total, 512), generator=g).to(BF16)
    tlen = torch.randint(0, top + 1, (tokens, 1), generator=g)
    slen = torch.randint(1, swa + 1, (tokens, 1), generator=g)
    pos = torch.arange(width)[None, :]
    tok = torch.arange(tokens)[:, None]
    idx = torch.where(pos < tlen, tok * top + pos, torch.where(pos < tlen + slen, tokens * top + tok * swa + pos - tlen,
                      -1)).to(I32)  # fmt: skip
    args = {"q": torch.randn((tokens, heads, 512), generator=g).to(BF16), "workspace": workspace, "idx": idx}
    theirs, ours = clones(**args), clones(**args)
    _compare(theirs, ours, lambda f, d: f(d["q"], d["workspace"].unsqueeze(1), d["idx"].unsqueeze(1)))


@pytest.mark.parametrize(("chunk", "width"), [(2, 640), (3, 128)])
def test_prefill_equals_vllm(chunk: int, width: int) -> None:
    """``_forward_prefill``: a chunk's query rows (a slice after 2 earlier rows) over the chunk's ``[chunk, M, 512]``
    workspace flattened, combined C4 rows (640) and SWA-only rows (128), indices into the flat rows, ``-1`` padding."""
    g = seeded(chunk * 7 + width)
    rows_per_req, tokens = 300, 5
    kv = torch.randn((chunk + 1, rows_per_req, 512), generator=g).to(BF16)
    idx = torch.randint(-1, chunk * rows_per_req, (tokens, width), generator=g, dtype=I32)
    idx[:, width // 2 :] = -1  # the combined row's unused tail
    args = {"q": torch.randn((tokens + 3, 8, 512), generator=g).to(BF16), "kv": kv, "idx": idx}
    theirs, ours = clones(**args), clones(**args)
    _compare(theirs, ours, lambda f, d: f(d["q"][2 : 2 + tokens], d["kv"][:chunk].reshape(-1, 1, 512),
                                          d["idx"].unsqueeze(1)))  # fmt: skip
