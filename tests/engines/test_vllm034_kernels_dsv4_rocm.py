"""DeepSeek-V4's ROCm index and metadata ops against vLLM 0.34's own kernels, on identical engine-shaped inputs, under
Triton's interpreter: the dense-to-ragged compaction, aiter's prefill top-k slots and localization, the C4 decode
top-k stream, and ROCm's own prefill combine.

Runs in the vLLM 0.34 venv (``bash scripts/engine-envs.sh test vllm-0.34``); skips, naming why, elsewhere. Each test
calls vLLM's Python entry point exactly as its call site does (``build_ragged_indices_from_dense`` from the ROCm
metadata builders and the in-tree prefill, ``build_prefill_topk_ragged_indices`` from ``_forward_prefill_aiter``,
``_localize_aiter_prefill_topk`` from ``_launch_aiter_top_k_per_row_prefill``,
``compute_global_topk_ragged_indices_and_indptr`` and ``combine_topk_swa_indices`` from ``amd/rocm.py``'s decode and
prefill) and warmreg's drop-in on clones of the same seeded tensors, then compares every buffer either side writes,
bitwise: all are index kernels. A ragged stream is compared over its written prefix (``[:indptr[-1]]``): both sides
allocate it with ``torch.empty`` and write only that prefix.

``vllm/platforms/rocm.py`` resolves the GPU's arch at import (amdsmi, else ``torch.cuda.get_device_properties``);
on this CPU machine that one platform query is answered ``gfx950`` while the module is imported, so
``models/deepseek_v4/amd/rocm.py`` (which imports it) loads. No kernel and no math is patched.
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
vllm_rocm = engine("vllm.models.deepseek_v4.amd.rocm")
from warmreg_deepseek_v4.rocm_combine_indices import RocmCombineTopkSwaIndices  # noqa: E402
from warmreg_deepseek_v4.rocm_decode_topk import rocm_global_topk_ragged  # noqa: E402
from warmreg_deepseek_v4.rocm_localize_topk import RocmLocalizeTopk  # noqa: E402
from warmreg_deepseek_v4.rocm_prefill_topk import rocm_prefill_topk_ragged  # noqa: E402
from warmreg_deepseek_v4.rocm_ragged import rocm_ragged_from_dense  # noqa: E402

I32 = torch.int32


def _same_ragged(ours: tuple[torch.Tensor, torch.Tensor], theirs: tuple[torch.Tensor, torch.Tensor], what: str) -> None:
    assert_same(ours[1], theirs[1], f"{what} indptr")
    assert ours[0].shape == theirs[0].shape, f"{what}: stream of {ours[0].shape} vs the engine's {theirs[0].shape}"
    n = int(theirs[1][-1])
    assert_same(ours[0][:n], theirs[0][:n], f"{what} stream")


# -- build_ragged_indices_from_dense ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("rows", "width", "num_rows", "wide"),
    [(7, 128, -1, 0), (5, 640, 3000, 0), (3, 8320, 50_000, 0), (70, 8, -1, 0), (4, 256, -1, 512)],
)
def test_ragged_from_dense_equals_vllm(rows: int, width: int, num_rows: int, wide: int) -> None:
    """The decode SWA rows (width 128, ``swa_lens``), combined prefill rows (640: C4 at top-k 512; 8320: the widest
    C128, past the 1024 tile) bounded by the workspace rows, 70 narrow rows (several rows a count program), and the
    C128 decode rows: a column slice ``[:T, :W]`` of the ``[max_tokens, Wmax]`` buffer, viewed ``[T, 1, W]``."""
    g = seeded(rows * width + wide)
    dense = torch.randint(-2, 2 * max(num_rows, width), (rows, max(wide, width)), generator=g, dtype=I32)
    args = {"dense": dense, "lengths": torch.randint(0, width + 3, (rows,), generator=g, dtype=I32)}
    theirs, ours = clones(**args), clones(**args)

    def rows_of(d: dict[str, torch.Tensor]) -> torch.Tensor:
        return d["dense"][:, :width].view(rows, 1, width) if wide else d["dense"]

    want = vllm_sparse.build_ragged_indices_from_dense(rows_of(theirs), theirs["lengths"], num_rows=num_rows)
    got = rocm_ragged_from_dense(rows_of(ours), ours["lengths"], num_rows)
    _same_ragged(got, want, "ragged")
    for name in args:
        assert_same(ours[name], theirs[name], name)


# -- build_prefill_topk_ragged_indices ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("ratio", "width"), [(4, 512), (128, 256), (4, 40)])
def test_prefill_topk_ragged_equals_vllm(ratio: int, width: int) -> None:
    """``_forward_prefill_aiter``: the prefill rows of the C4 layer's ``topk_indices_buffer`` (or C128's
    ``prefill_local``, a column slice), batch-wide SWA metadata (3 decode tokens first: ``token_offset``), the
    layer's block table and ``num_rows`` = the cache's rows; positions reach past the compressed count."""
    g = seeded(ratio + width)
    qsl = torch.tensor([0, 1, 2, 3, 8, 20], dtype=I32)
    seq = torch.tensor([50, 700, 9, 400 * ratio, 13 * ratio], dtype=I32)
    t2r = torch.repeat_interleave(torch.arange(5, dtype=I32), (qsl[1:] - qsl[:-1]).long())
    block = 256 // ratio
    args = {
        "buffer": torch.randint(-1, 500, (24, 2 * width), generator=g, dtype=I32),
        "t2r": t2r, "qsl": qsl, "seq": seq, "valid": torch.rand(20, generator=g) > 0.1,
        "table": torch.randint(0, 900, (5, 500 // block + 1), generator=g, dtype=I32),
    }  # fmt: skip
    theirs, ours = clones(**args), clones(**args)

    def call(fn, d):  # type: ignore[no-untyped-def]
        rows = d["buffer"][3:20, :width] if ratio == 128 else d["buffer"][3:20, :width].contiguous()
        return fn(rows, d["t2r"], d["qsl"], d["seq"], d["valid"], d["table"], block, ratio, (1 << 20) // ratio + 1 if
                  ratio == 4 else 300, 3, 900 * block)  # fmt: skip

    want = call(lambda *a: vllm_sparse.build_prefill_topk_ragged_indices(*a[:6], block_size=a[6], compress_ratio=a[7],
                num_compressed=a[8], token_offset=a[9], num_rows=a[10]), theirs)  # fmt: skip
    got = call(rocm_prefill_topk_ragged, ours)
    _same_ragged(got, want, "prefill top-k")
    for name in args:
        assert_same(ours[name], theirs[name], name)


# -- _localize_aiter_prefill_topk -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("rows", "topk"), [(6, 512), (3, 1024), (5, 300)])
def test_localize_equals_vllm(rows: int, topk: int) -> None:
    """A prefill chunk's rows ``topk_indices_buffer[a:b, :topk]`` and its ``cu_seqlen_ks``; rows around untouched."""
    g = seeded(rows + topk)
    args = {
        "buffer": torch.randint(-1, 9000, (rows + 5, topk), generator=g, dtype=I32),
        "starts": torch.randint(0, 4000, (rows,), generator=g, dtype=I32),
    }
    theirs, ours = clones(**args), clones(**args)
    vllm_sparse._localize_aiter_prefill_topk(theirs["buffer"][2 : 2 + rows, :topk], theirs["starts"])
    RocmLocalizeTopk()(ours["buffer"][2 : 2 + rows, :topk], ours["starts"])
    for name in args:
        assert_same(ours[name], theirs[name], name)


# -- compute_global_topk_ragged_indices_and_indptr --------------------------------------------------------------------
@pytest.mark.parametrize(("tokens", "topk"), [(6, 512), (4, 1024), (3, 37)])
def test_decode_topk_ragged_equals_vllm(tokens: int, topk: int) -> None:
    """``_forward_decode`` of a C4 layer: ``topk_indices_buffer[:num_decode_tokens]`` (-1 tails, one -1 inside a row),
    ``token_to_req_indices``, ``block_table[:num_decodes]`` (64-token compressed pages), ``is_valid_token``."""
    g = seeded(tokens + topk)
    buffer = torch.randint(0, 64 * 9, (tokens + 3, topk), generator=g, dtype=I32)
    buffer[0, topk // 3 :] = -1
    buffer[1, 2] = -1
    args = {
        "buffer": buffer, "t2r": torch.randint(0, 3, (tokens + 3,), generator=g, dtype=I32),
        "table": torch.randint(0, 700, (5, 9), generator=g, dtype=I32), "valid": torch.rand(tokens + 3, generator=g) > 0.2,
    }  # fmt: skip
    theirs, ours = clones(**args), clones(**args)
    want = vllm_rocm.compute_global_topk_ragged_indices_and_indptr(
        theirs["buffer"][:tokens], theirs["t2r"], theirs["table"][:3], 64, theirs["valid"][:tokens]
    )
    got = rocm_global_topk_ragged(ours["buffer"][:tokens], ours["t2r"], ours["table"][:3], 64, ours["valid"][:tokens])
    assert_same(got[2], want[2], "topk_lens")
    _same_ragged(got[:2], want[:2], "decode top-k")
    for name in args:
        assert_same(ours[name], theirs[name], name)


# -- combine_topk_swa_indices (ROCm's copy) ----------------------------------------------------------------------------
@pytest.mark.parametrize(("ratio", "topk", "image"), [(4, 512, False), (128, 256, False), (1, 0, False), (4, 64, True)])
def test_rocm_combine_equals_vllm(ratio: int, topk: int, image: bool) -> None:
    """``_forward_prefill``'s chunk: top-k rows of the chunk (SWA-only: the indexer buffer's, with top-k 0), the
    ``query_start_loc`` slice after 2 decode requests (not rebased), ``seq_lens`` / ``gather_lens`` slices (a prefix
    resumed: gather shorter than seq), window 128, workspace ``M`` / ``N``; a vision batch with visibility counts.
    Top-k entries reach past ``N`` (ROCm's kernel drops them)."""
    g = seeded(ratio + topk + image)
    width = topk or 512
    qsl = torch.tensor([0, 1, 2, 9, 10, 30], dtype=I32)
    seq = torch.tensor([99, 99, 600, 4, 1000], dtype=I32)
    gather = torch.tensor([99, 99, 300, 4, 150], dtype=I32)
    args = {
        "topk": torch.randint(-1, 400, (28, width), generator=g, dtype=I32), "qsl": qsl, "seq": seq, "gather": gather,
        "left": torch.randint(0, 40, (28,), generator=g, dtype=I32), "right": torch.randint(0, 30, (28,), generator=g, dtype=I32),
    }  # fmt: skip
    theirs, ours = clones(**args), clones(**args)
    extra = {"max_image_tokens": 32} if image else {}

    def vis(d: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
        return d[name] if image else None

    want = vllm_rocm.combine_topk_swa_indices(
        theirs["topk"], theirs["qsl"][2:], theirs["seq"][2:], theirs["gather"][2:], 128, ratio, topk, 1200, 350,
        left_visible=vis(theirs, "left"), right_visible=vis(theirs, "right"), **extra,
    )  # fmt: skip
    got = RocmCombineTopkSwaIndices(window_size=128)(
        ours["topk"], ours["qsl"][2:], ours["seq"][2:], ours["gather"][2:], compress_ratio=ratio, topk=topk, M=1200,
        N=350, left_visible=vis(ours, "left"), right_visible=vis(ours, "right"), **extra,
    )  # fmt: skip
    assert_same(got[0], want[0], "combined_indices")
    assert_same(got[1], want[1], "combined_lens")
    for name in args:
        assert_same(ours[name], theirs[name], name)
