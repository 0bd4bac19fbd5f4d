"""DeepSeek-V4's ROCm C4 indexer ops against vLLM 0.34's own kernels, on identical engine-shaped inputs, under Triton's
interpreter: the prefill gather of the FP8 K rows and scales out of the paged indexer cache, the decode's FP8
paged MQA logits, and ROCm's head-512 compressor of the attention caches.

Runs in the vLLM 0.34 venv (``bash scripts/engine-envs.sh test vllm-0.34``); skips, naming why, elsewhere. Each test
calls vLLM's Python entry point exactly as its call site does (``cp_gather_indexer_k_quant_cache_triton`` from
``rocm_aiter_sparse_attn_indexer``'s prefill, ``cache_layout="NORMAL"`` for the C4 cache; ``rocm_fp8_paged_mqa_logits``
from its decode, ``compress_ratio=4``; ``compress_norm_rope_store_triton`` with ``head_dim=512`` from ROCm's
``DeepseekCompressor.forward``) and warmreg's drop-in on copies of the same seeded tensors, then compares every
buffer either side writes, bitwise: the gather copies bytes, and the logits kernels run the same operations in the
same order (an FP8 ``tl.dot`` with fp32 accumulation, ReLU, weights, the head sum, the scale) on the same tiles;
the compressor's too (softmax pooling, RMSNorm, RoPE), where vLLM's bf16 and e4m3fn casts meet warmreg's exact
encoders: Triton 3.8's interpreter truncates to bf16 and rounds to e4m3fn wrongly (127.6 -> 64) where a GPU rounds to
nearest even, so that test routes the interpreter's casts to or from bf16 / e4m3fn through torch (round to nearest
even, satfinite: :func:`_hardware_casts`, as ``test_vllm034_kernels_kimi_dsa_mxfp4.py`` does) and vLLM's kernel writes
its GPU bytes.

Patched, none of them a kernel or its math: the module flags ``_ON_GFX950`` / ``_ON_GFX942`` (False off ROCm), by which
``cp_gather_indexer_k_quant_cache_triton`` picks its kernel (each test runs both) and ``rocm_fp8_paged_mqa_logits``
takes the Triton path; ``current_platform.fp8_dtype`` (the CPU platform answers e4m3fn; gfx942's is e4m3fnuz), by
which vLLM views the cache's bytes; and ``current_workspace_manager``, whose workspace (a CUDA-graph-stable buffer)
is a NaN-filled CPU tensor here, so that the entries neither side writes are compared too; and the compressor
module's ``_ON_GFX950`` (its ``SANITIZE_CACHE_NANS``), run both ways.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))

# First: skips where vLLM is not installed, else sets TRITON_INTERPRET and CUDA_VISIBLE_DEVICES before any
# kernel module is imported.
from vllm_kernels import assert_same, engine, seeded  # isort: skip

import numpy as np
import pytest
import torch
import triton.language as tl
import vllm
from triton.runtime import interpreter as _interp

if not vllm.__version__.startswith("0.34"):
    pytest.skip(f"these compare vLLM 0.34's kernels; this venv has vLLM {vllm.__version__}", allow_module_level=True)

vllm_sparse = engine("vllm.v1.attention.ops.rocm_aiter_mla_sparse")
vllm_compress = engine("vllm.models.deepseek_v4.common.ops.fused_compress_quant_cache")
from warmreg_deepseek_v4.fp8_ds_mla import page_bytes  # noqa: E402
from warmreg_deepseek_v4.rocm_compress_insert import RocmSparseCompressInsert  # noqa: E402
from warmreg_deepseek_v4.rocm_indexer_gather import RocmIndexerKGather  # noqa: E402
from warmreg_deepseek_v4.rocm_indexer_logits import RocmIndexerLogits  # noqa: E402

I32, U8 = torch.int32, torch.uint8
HEAD_DIM, PAGE = 128, 64  # Flash's indexer head dim; C4 pages hold 256 // 4 compressed tokens


def _chunk(seed: int, lens: list[int], width: int, pages: int, stride: int) -> dict[str, torch.Tensor]:
    """A prefill chunk as the indexer metadata builder hands it over: requests' compressed lengths ``lens``, their
    ``cu_seq_lens`` and ``token_to_seq``, block-table rows (a null page, one past the pool), the cache's backing
    pages (``stride`` bytes each) and the workspace's ``k_fp8`` / ``k_scale`` (garbage past what is written)."""
    g = seeded(seed)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=I32)
    total = int(cu[-1])
    table = torch.randint(0, pages, (len(lens), width), generator=g, dtype=I32)
    table[0, -1], table[-1, 0] = -1, pages
    return {
        "backing": torch.randint(0, 256, (pages * stride,), generator=g, dtype=torch.int64).to(U8),
        "block_table": table,
        "cu_seq_lens": cu,
        "token_to_seq": torch.cat([torch.full((n,), r, dtype=I32) for r, n in enumerate(lens)]),
        "workspace": torch.randint(0, 256, (total + 3, HEAD_DIM), generator=g, dtype=torch.int64).to(U8),
        "scales": torch.randint(0, 256, (total + 3, 4), generator=g, dtype=torch.int64).to(U8),
    }


@pytest.mark.parametrize("gfx950", [False, True])
@pytest.mark.parametrize(
    ("lens", "width", "stride"),
    [
        ([5, 70, 1], 2, 64 * 132 + 192),
        ([130, 3], 2, 64 * 132),
        ([2, 1, 65], 2, 64 * 132 + 192),
        ([200, 64, 9], 4, 64 * 132),
    ],
)
def test_gather_equals_vllm(gfx950: bool, lens: list[int], width: int, stride: int) -> None:
    """Flash's C4 indexer pages (64 tokens of 132 bytes, padded to 576-byte units where the caches are
    ``fp8_ds_mla``); a request past its table's width (130 rows, 2 pages), a null page and one past the pool (scale
    0, bytes untouched); the workspace rows past the chunk untouched."""
    pages = 7
    inputs = _chunk(sum(lens) + width, lens, width, pages, stride)
    fp8 = vllm_sparse.FP8_DTYPE
    sides = []
    for _ in range(2):
        c = {k: v.clone() for k, v in inputs.items()}
        cache = c["backing"].as_strided((pages, PAGE, HEAD_DIM + 4), (stride, HEAD_DIM + 4, 1))
        total = int(c["cu_seq_lens"][-1])
        k_fp8, k_scale = c["workspace"].view(fp8)[:total], c["scales"][:total]
        sides.append((c, cache, k_fp8, k_scale))
    (theirs, t_cache, t_k, t_scale), (ours, o_cache, o_k, o_scale) = sides
    with mock.patch.object(vllm_sparse, "_ON_GFX950", gfx950):
        vllm_sparse.cp_gather_indexer_k_quant_cache_triton(
            t_cache, t_k, t_scale, theirs["block_table"], theirs["cu_seq_lens"], token_to_seq=theirs["token_to_seq"],
            cache_layout="NORMAL",
        )  # fmt: skip
    RocmIndexerKGather()(o_cache, o_k, o_scale, ours["block_table"], ours["cu_seq_lens"], ours["token_to_seq"])
    for name in ("workspace", "scales", "backing"):
        assert_same(ours[name], theirs[name], name)
    assert not torch.equal(theirs["workspace"], inputs["workspace"]), "the gather wrote nothing"


class _Workspace:
    """The workspace manager's one call here: a fresh NaN-filled buffer of each requested shape and dtype."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []

    def get_simultaneous(self, *specs: tuple[tuple[int, ...], torch.dtype]) -> tuple[torch.Tensor, ...]:
        self.buffers += [torch.full(shape, float("nan"), dtype=dtype) for shape, dtype in specs]
        return tuple(self.buffers[-len(specs) :])


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
@pytest.mark.parametrize(
    ("seqs", "next_n", "compressed_len", "stride"),
    [([250, 70, 0], 1, 260, 64 * 132 + 192), ([130, 3], 2, 192, 64 * 132), ([9, 400, 66, 1], 2, 512, 64 * 132)],
)
def test_paged_logits_equal_vllm(arch: str, seqs: list[int], next_n: int, compressed_len: int, stride: int) -> None:
    """Decode rows as the indexer metadata hands them over: ``N = 1`` (lengths ``[B]``) and the native spec-decode
    ``N = 2`` (lengths ``[B, N]``, ``L - N + 1 + j`` clamped at 0); a request past its table's width (its tail
    unwritten), one with no visible key; Flash's 64 heads of 128, 64-token pages, padded or not; the compressed max
    model len as the logits' width. Every logit and every unwritten (NaN) entry the same."""
    g = seeded(sum(seqs) + next_n + len(arch))
    fnuz = arch == "gfx942"
    fp8 = torch.float8_e4m3fnuz if fnuz else torch.float8_e4m3fn
    batch, heads, pages, width = len(seqs), 64, 8, 4
    backing = torch.zeros(pages * stride, dtype=U8)
    flat = backing.as_strided((pages, PAGE * (HEAD_DIM + 4)), (stride, 1))
    flat[:, : PAGE * HEAD_DIM] = (torch.randn(pages, PAGE * HEAD_DIM, generator=g) * 2).to(fp8).view(U8)
    flat[:, PAGE * HEAD_DIM :] = (torch.rand(pages, PAGE, generator=g) + 0.5).view(U8).reshape(pages, -1)
    cache = backing.as_strided((pages, PAGE, HEAD_DIM + 4), (stride, HEAD_DIM + 4, 1))
    q = (torch.randn(batch * next_n, heads, HEAD_DIM, generator=g) * 2).to(fp8)
    weights = torch.randn(batch * next_n + 3, heads, generator=g)  # the indexer's buffer: rows past the decode rows
    lens = torch.tensor(seqs, dtype=I32)
    if next_n > 1:
        lens = (lens[:, None] - next_n + 1 + torch.arange(next_n)).clamp_min(0).to(I32)
    table = torch.randint(0, pages, (batch, width), generator=g, dtype=I32)
    workspace = _Workspace()
    flag = "_ON_GFX942" if fnuz else "_ON_GFX950"
    with (
        mock.patch.object(vllm_sparse, flag, True),
        mock.patch.object(vllm_sparse.current_platform, "fp8_dtype", lambda: fp8),
        mock.patch.object(vllm_sparse, "current_workspace_manager", lambda: workspace),
    ):
        theirs = vllm_sparse.rocm_fp8_paged_mqa_logits(
            q.clone().reshape(batch, next_n, heads, HEAD_DIM), cache.unsqueeze(-2), weights.clone()[: batch * next_n],
            lens.clone(), table.clone(), None, max_model_len=compressed_len, compress_ratio=4,
        )  # fmt: skip
    assert theirs is workspace.buffers[0]
    out = torch.full((batch * next_n, compressed_len), float("nan"))
    ours = RocmIndexerLogits()(
        q.clone().reshape(batch, next_n, heads, HEAD_DIM), cache.unsqueeze(-2), weights.clone()[: batch * next_n],
        lens.clone(), table.clone(), out=out,
    )  # fmt: skip
    assert ours is out
    assert_same(ours, theirs, "logits")
    assert (~theirs.isnan()).sum() > 0, "nothing was scored"


_TORCH_FLOAT = {tl.float8e4nv: torch.float8_e4m3fn, tl.bfloat16: torch.bfloat16, tl.float32: torch.float32}


def _torch_convert(data: np.ndarray, src: Any, dst: Any) -> np.ndarray:
    """The interpreter's storage of ``data`` (fp8 as uint8, bf16 as uint16) converted from ``src`` to ``dst``."""
    x = torch.from_numpy(np.ascontiguousarray(data).reshape(-1).copy()).view(_TORCH_FLOAT[src])
    if dst == tl.float8e4nv:  # satfinite: finite overflow and infinities saturate
        x = x.float().clamp(-448.0, 448.0)
    y = x.to(_TORCH_FLOAT[dst])
    store = torch.uint8 if dst == tl.float8e4nv else torch.int16 if dst == tl.bfloat16 else _TORCH_FLOAT[dst]
    return y.view(store).numpy().view(_interp._get_np_dtype(dst)).reshape(np.shape(data))


def _by_torch(src: Any, dst: Any) -> bool:
    return src in _TORCH_FLOAT and dst in _TORCH_FLOAT and any(d in (tl.float8e4nv, tl.bfloat16) for d in (src, dst))


@pytest.fixture
def _hardware_casts() -> Iterator[None]:
    """Float conversions to or from bf16 / e4m3fn through torch while the test runs."""
    builder = _interp.InterpreterBuilder
    interp_cast, interp_fp_to_fp = builder.cast_impl, builder.create_fp_to_fp

    def cast(self: Any, src: Any, dst_type: Any) -> Any:
        s, d = src.dtype.scalar, dst_type.scalar
        if _by_torch(s, d):
            return _interp.TensorHandle(_torch_convert(src.data, s, d), d)
        return interp_cast(self, src, dst_type)

    def fp_to_fp(self: Any, src: Any, dst_type: Any, rounding_mode: Any) -> Any:
        s, d = src.dtype.scalar, dst_type.scalar
        if _by_torch(s, d):
            return _interp.TensorHandle(_torch_convert(src.data, s, d), d)
        return interp_fp_to_fp(self, src, dst_type, rounding_mode)

    with mock.patch.object(builder, "cast_impl", cast), mock.patch.object(builder, "create_fp_to_fp", fp_to_fp):
        yield


@pytest.mark.usefixtures("_hardware_casts")
@pytest.mark.parametrize("gfx950", [False, True])
@pytest.mark.parametrize("ratio", [4, 128])
def test_sparse_compressor_equals_vllm(ratio: int, gfx950: bool) -> None:
    """The C4 compressor (overlapping windows, 4-token state pages) and the C128 one's decode rows (8-token state
    pages), Flash's 64-token ``fp8_ds_mla`` pages at the allocated (padded) stride; closing and non-closing tokens,
    a null state slot and a null compressed slot. Every byte of the cache storage."""
    g = seeded(ratio + gfx950)
    width, sbs, spages, pages = (2 if ratio == 4 else 1) * 512, (4 if ratio == 4 else 8), 48, 4
    positions = torch.tensor([3, 7, 8, 11, 2, 15, 19] if ratio == 4 else [127, 126, 255, 383, 127, 0, 511])
    stride = page_bytes(PAGE)
    inputs = {
        "state_cache": torch.randn(spages, sbs, 2 * width, generator=g),
        "token_to_req_indices": torch.tensor([0, 0, 0, 1, 1, 1, 2], dtype=I32),
        "positions": positions,
        "slot_mapping": torch.tensor([1, 2, -1, 4, 5, 6, 7]),
        "block_table": torch.randint(0, spages, (3, 80), generator=g, dtype=I32),
        "norm_weight": (torch.randn(512, generator=g) * 0.1 + 1).to(torch.bfloat16),
        "cos_sin_cache": torch.rand(600, 64, generator=g) * 2 - 1,
        "backing": torch.randint(0, 256, (pages * stride,), generator=g, dtype=torch.int64).to(U8),
        "kv_slot_mapping": torch.tensor([3, 70, 5, 133, 9, -1, 200]),
    }
    theirs, ours = ({k: v.clone() for k, v in inputs.items()} for _ in range(2))
    args = ("state_cache", "token_to_req_indices", "positions", "slot_mapping", "block_table")

    def cache(d: dict[str, torch.Tensor]) -> torch.Tensor:
        return d["backing"].as_strided((pages, PAGE, 584), (stride, 584, 1))

    with mock.patch.object(vllm_compress, "_ON_GFX950", gfx950):
        vllm_compress.compress_norm_rope_store_triton(
            state_cache=theirs["state_cache"], num_actual=7, token_to_req_indices=theirs["token_to_req_indices"],
            positions=theirs["positions"], slot_mapping=theirs["slot_mapping"], block_table=theirs["block_table"],
            block_size=sbs, state_width=width, cos_sin_cache=theirs["cos_sin_cache"], kv_cache=cache(theirs),
            k_cache_metadata=SimpleNamespace(slot_mapping=theirs["kv_slot_mapping"]), pdl_kwargs={}, head_dim=512,
            rope_head_dim=64, compress_ratio=ratio, overlap=ratio == 4, use_fp4_cache=False,
            rms_norm_weight=theirs["norm_weight"], rms_norm_eps=1e-6, quant_block=64, token_stride=576, scale_dim=8,
        )  # fmt: skip
    RocmSparseCompressInsert()(
        *(ours[n] for n in args), ours["norm_weight"], ours["cos_sin_cache"], cache(ours), ours["kv_slot_mapping"],
        1e-6, compress_ratio=ratio, sanitize_nans=gfx950,
    )  # fmt: skip
    assert_same(ours["backing"], theirs["backing"], "cache bytes")
    assert not torch.equal(theirs["backing"], inputs["backing"]), "nothing was written"
