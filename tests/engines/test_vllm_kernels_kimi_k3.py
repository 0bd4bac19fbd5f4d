"""Kimi-K3 ops against vLLM 0.33's own kernels, on identical engine-shaped inputs, under the interpreter.

Runs in the vLLM venv (``bash scripts/engine-envs.sh test vllm``); skips, naming why, elsewhere. Each test
calls the engine's Python entry point exactly as ``vllm/models/kimi_k3/nvidia/kda.py`` calls it and warmreg's
op on clones of the same seeded tensors, then compares every output and every state it writes.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))

# First: skips where vLLM is not installed, else sets TRITON_INTERPRET and CUDA_VISIBLE_DEVICES before any
# kernel module is imported.
from vllm_kernels import assert_same, clones, engine, seeded  # isort: skip

import pytest
import torch
import triton.language as tl

FUSED_RECURRENT = "vllm.models.kimi_k3.nvidia.ops.third_party.kda.fused_recurrent"
vllm_fr = engine(FUSED_RECURRENT)
CONV = "vllm.model_executor.layers.mamba.ops.causal_conv1d"
engine(CONV)  # the skip check; the Triton entry points come from vllm_conv below
vllm_meta = engine("vllm.models.kimi_k3.nvidia.kda_metadata")
vllm_attn_res = engine("vllm.models.kimi_k3.nvidia.ops.attn_res")
vllm_fla_kda = engine("vllm.third_party.flash_linear_attention.ops.kda")
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.v1.attention.backends.utils import compute_causal_conv1d_metadata  # noqa: E402
from warmreg_kimi_k3.attn_res import AttnRes, attn_res_reference  # noqa: E402
from warmreg_kimi_k3.backends import KDALayout  # noqa: E402
from warmreg_kimi_k3.causal_conv1d import CausalConv1d, conv1d_chunks, projection_row_stride  # noqa: E402
from warmreg_kimi_k3.causal_conv1d_update import CausalConv1dUpdate  # noqa: E402
from warmreg_kimi_k3.gated_rmsnorm import GatedRMSNorm, projection_width  # noqa: E402
from warmreg_kimi_k3.kda_packed_decode import KDAPackedDecode  # noqa: E402
from warmreg_kimi_k3.kda_spec_metadata import StageSpecDecodeMetadata  # noqa: E402
from warmreg_kimi_k3.kda_state_indices import AlignedStateIndices  # noqa: E402


def _min(*values: Any) -> Any:
    """Python's ``min`` as Triton's code generator reads it inside a kernel (``tl.minimum`` of tensors): the
    interpreter runs kernel source as Python, where the builtin cannot compare a tensor."""
    if all(isinstance(v, (int, float)) for v in values):
        return min(*values)
    first, *rest = values
    for v in rest:
        first = tl.minimum(first, v)
    return first


class _GridOnCopy:
    """vLLM's prefill conv launches with a grid function that writes into its argument (``META["batch_ptr"] =
    ...``). Triton's compiled launch hands it a copy of the arguments; the interpreter hands the arguments
    themselves, so the write replaces a converted pointer with a tensor. This evaluates the grid on a copy, as the
    compiled path does, then launches with the resulting grid."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> Any:
            params = inspect.signature(self.kernel.fn).parameters
            meta = dict(zip(params, args)) | kwargs
            return self.kernel[grid(meta) if callable(grid) else grid](*args, **kwargs)

        return launch


def _triton_conv_module() -> ModuleType:
    """A private copy of vLLM's ``causal_conv1d`` module with its Triton entry points. On a CPU platform (this venv:
    ``VLLM_TARGET_DEVICE=cpu``) the module rebinds ``causal_conv1d_fn`` / ``causal_conv1d_update`` to its CPU
    kernels when it is imported, so the copy is executed with ``current_platform.is_cpu()`` answering False. Its
    prefill kernel calls Python's ``min`` on a tensor (``segment_len = min(BLOCK_M, seqlen - token_offset)``),
    which only the compiler maps to ``tl.minimum``; the copy's globals map it for the interpreter (:func:`_min`),
    and its launch evaluates the grid on a copy of the arguments (:class:`_GridOnCopy`)."""
    spec = importlib.util.find_spec(CONV)
    assert spec is not None and spec.origin is not None
    copy = importlib.util.spec_from_file_location("_vllm_causal_conv1d_triton", spec.origin)
    assert copy is not None and copy.loader is not None
    mod = importlib.util.module_from_spec(copy)
    mod.min = _min  # type: ignore[attr-defined]  # before the decorators run: the interpreter keeps their globals
    with mock.patch.object(current_platform, "is_cpu", lambda: False):
        copy.loader.exec_module(mod)
    mod._causal_conv1d_fwd_kernel = _GridOnCopy(mod._causal_conv1d_fwd_kernel)  # type: ignore[attr-defined]
    return mod


vllm_conv = _triton_conv_module()

H, D = 2, 128  # Kimi-K3's KDA head dim (linear_attn_config.head_dim), two heads on this rank
SLOTS = 7


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize(
    ("indices", "row"),
    [
        ([3], 3 * H * D),  # one sequence, the conv output's own rows
        ([4, 0, 2, 6, 0], 3 * H * D + 2 * H),  # padded rows (null slot 0), rows of a wider projection
    ],
)
def test_packed_decode_equals_vllm(indices: list[int], row: int, lower_bound: float | None) -> None:
    """``fused_recurrent_kda_packed_decode`` (plain decode after ``causal_conv1d_update``): bitwise equal
    outputs, including the zero rows of null slots, and bitwise equal states in vLLM's [S, H, V, K] pool."""
    layout = KDALayout(num_heads=H, head_dim=D, conv_width=4, lower_bound=lower_bound, tensor_parallel_size=1,
                       num_speculative_tokens=0, dtype="bfloat16")  # fmt: skip
    g = seeded(0)
    batch = len(indices)
    proj = torch.randn(batch, row, generator=g).bfloat16()
    args: dict[str, Any] = {
        "mixed_qkv": proj[:, : 3 * H * D],
        "raw_g": torch.randn(1, batch, H, D, generator=g).bfloat16(),
        "raw_beta": torch.randn(1, batch, H, generator=g).bfloat16(),
        "A_log": torch.rand(H, generator=g).mul(1.5).add(0.5).log(),
        "dt_bias": torch.randn(H * D, generator=g) * 0.5,
        "initial_state": torch.randn(SLOTS, H, D, D, generator=g) * 0.1,
        "state_indices": torch.tensor(indices, dtype=torch.int32),
        "lower_bound": lower_bound,
    }
    theirs, ours = clones(**args), clones(**args)
    want, _ = vllm_fr.fused_recurrent_kda_packed_decode(**theirs)
    got = KDAPackedDecode(layout=layout)(**ours, launch_pdl=False)
    assert_same(got, want, "o")
    assert_same(ours["initial_state"], theirs["initial_state"], "state pool")


# -- the short convolutions ------------------------------------------------------------------------------------------
W = 4  # linear_attn_config.short_conv_kernel_size
SPEC = 2  # speculative tokens: the conv state keeps W - 1 + SPEC rows
P = H * D  # channels of each of q, k, v on this rank
CONV_LAYOUT = KDALayout(num_heads=H, head_dim=D, conv_width=W, lower_bound=-5.0, tensor_parallel_size=1,
                        num_speculative_tokens=SPEC, dtype="bfloat16")  # fmt: skip


def _conv_pool(lines: int, dim_first: bool, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pages, conv_state)``: one KV page a line (the conv state, then the float32 recurrent state's bytes), and
    the conv state as the layer hands it to the kernels, ``[lines, 3P, W - 1 + SPEC]``: vLLM's default (state_len,
    dim) block transposed, or the (dim, state_len) block of ``VLLM_SSM_CONV_STATE_LAYOUT=DS``
    (``is_conv_state_dim_first()``)."""
    rows, conv_dim = W - 1 + SPEC, 3 * P
    page = rows * conv_dim + H * D * D * 4 // 2
    pages = torch.randn(lines, page, generator=g).bfloat16()
    if dim_first:
        return pages, pages[:, : rows * conv_dim].view(lines, conv_dim, rows)
    return pages, pages[:, : rows * conv_dim].view(lines, rows, conv_dim).transpose(1, 2)


def _indices(lines: list[int], stride: int) -> torch.Tensor:
    """Cache lines as the builder passes them: ``block_table[:, 0]`` of a ``1 + SPEC``-wide table (stride > 1) or a
    gathered copy (stride 1)."""
    table = torch.full((len(lines), stride), 99, dtype=torch.int32)
    table[:, 0] = torch.tensor(lines, dtype=torch.int32)
    return table[:, 0]


@pytest.mark.parametrize("stride", [1, 1 + SPEC], ids=["gathered", "block_table"])
@pytest.mark.parametrize("dim_first", [False, True], ids=["SD", "DS"])
def test_prefill_conv1d_equals_vllm(dim_first: bool, stride: int) -> None:
    """``causal_conv1d_fn`` as ``KimiK3DeltaAttention._forward``'s ``_prefill_conv`` calls it (q, k and v in turn:
    transposed column views of the packed projection, their weight rows and conv-state channels, no bias, silu,
    the builder's chunk metadata): bitwise equal outputs in the rows of live sequences (vLLM's output is an
    ``empty_like``: a null line's rows hold whatever was there) and bitwise equal pages, the null line's included.
    Sequences shorter than the state (1, 2 tokens) with and without history, one spanning three chunks."""
    lens, lines = [5, 1, 19, 2, 9, 3], [3, 0, 5, 1, 6, 2]  # line 0: the null block (a padded request)
    init = torch.tensor([True, True, False, True, True, False])
    g = seeded(1)
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    proj = torch.randn(int(qsl[-1]), projection_row_stride(CONV_LAYOUT), generator=g).bfloat16()
    weight = torch.randn(3 * P, W, generator=g) * 0.5  # conv1d.weight [3P, 1, W] viewed [3P, W], float32
    pages, state = _conv_pool(8, dim_first, g)
    theirs_pages, ours_pages = pages.clone(), pages.clone()
    theirs_state = theirs_pages.as_strided(state.shape, state.stride())
    ours_state = ours_pages.as_strided(state.shape, state.stride())
    idx = _indices(lines, stride)
    nums_dict, batch_ptr, chunk_offsets = compute_causal_conv1d_metadata(qsl, device=torch.device("cpu"))
    meta = SimpleNamespace(nums_dict=nums_dict, batch_ptr=batch_ptr, token_chunk_offset_ptr=chunk_offsets)
    op, chunks = CausalConv1d(layout=CONV_LAYOUT, max_num_seqs=8), conv1d_chunks(qsl)
    live = torch.cat([torch.arange(int(qsl[s]), int(qsl[s + 1])) for s, line in enumerate(lines) if line != 0])
    for c, name in enumerate("qkv"):
        cols = slice(c * P, (c + 1) * P)
        x = proj[:, cols]
        want = vllm_conv.causal_conv1d_fn(
            x.transpose(0, 1), weight[cols], None, activation="silu", conv_states=theirs_state[:, cols],
            has_initial_state=init.clone(), cache_indices=idx.clone(), query_start_loc=qsl.clone(), metadata=meta,
        ).transpose(0, 1)  # fmt: skip
        got = op(x, weight[cols], None, ours_state[:, cols], qsl.clone(), idx.clone(), init.clone(), chunks=chunks,
                 activation="silu", launch_pdl=False)  # fmt: skip
        assert_same(got[live], want[live], f"{name} rows of live sequences")
    assert_same(ours_pages, theirs_pages, "KV pages (conv states)")
    changed = (ours_pages != pages).any(dim=1)
    assert changed.tolist() == [line in lines and line != 0 for line in range(8)]  # every live line, only those


@pytest.mark.parametrize("case", ["decode", "spec", "spec_gathered"])
@pytest.mark.parametrize("dim_first", [False, True], ids=["SD", "DS"])
def test_conv1d_update_equals_vllm(dim_first: bool, case: str) -> None:
    """``causal_conv1d_update`` at both of ``_forward``'s call sites: plain decode (``x`` the rows of the packed
    projection's q/k/v columns, ``conv_state_indices`` with null slots, ``validate_data=True``) and speculative
    decode (varlen ``x`` from row 0 of the projection or a gathered ``[T, 3P]`` copy, ``spec_state_indices[:, 0]``,
    ``num_accepted_tokens`` 1..1+SPEC, ``max_query_len`` 1 + SPEC, a null slot and a zero-token padded request).
    Both write into the same pre-filled ``out``: bitwise equal outputs (a skipped request's rows keep the fill)
    and bitwise equal pages."""
    g = seeded(2)
    conv_dim = 3 * P
    pages, state = _conv_pool(8, dim_first, g)
    theirs_pages, ours_pages = pages.clone(), pages.clone()
    theirs_state = theirs_pages.as_strided(state.shape, state.stride())
    ours_state = ours_pages.as_strided(state.shape, state.stride())
    weight = torch.randn(conv_dim, W, generator=g) * 0.5
    spec_args: dict[str, Any] = {}
    lens: list[int] = []
    if case == "decode":
        lines = [4, 0, 2, 6, 0]
        idx = _indices(lines, 1 + SPEC)
        x = torch.randn(len(lines), projection_row_stride(CONV_LAYOUT), generator=g).bfloat16()[:, :conv_dim]
    else:
        lens, lines, accepted = [3, 1, 0, 2, 3], [3, 0, 5, 1, 6], [1, 2, 1, 3, 2]  # request 2: zero tokens
        idx = _indices(lines, 1 + SPEC)
        qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        rows = int(qsl[-1])
        if case == "spec":
            x = torch.randn(rows, projection_row_stride(CONV_LAYOUT), generator=g).bfloat16()[:, :conv_dim]
        else:
            x = torch.randn(rows, conv_dim, generator=g).bfloat16()
        spec_args = {"num_accepted_tokens": torch.tensor(accepted, dtype=torch.int32), "query_start_loc": qsl,
                     "max_query_len": 1 + SPEC}  # fmt: skip
    fill = torch.randn(x.shape, generator=g).bfloat16()
    theirs_out, ours_out = fill.clone(), fill.clone()
    want = vllm_conv.causal_conv1d_update(
        x, theirs_state, weight, None, activation="silu", conv_state_indices=idx.clone(),
        **clones(**spec_args), validate_data=case == "decode", out=theirs_out,
    )  # fmt: skip
    got = CausalConv1dUpdate(layout=CONV_LAYOUT, plain_decode=True, max_num_seqs=8)(
        x, ours_state, weight, None, "silu", idx.clone(), **clones(**spec_args), launch_pdl=False, out=ours_out
    )
    assert want.data_ptr() == theirs_out.data_ptr() and got.data_ptr() == ours_out.data_ptr()
    assert_same(ours_out, theirs_out, "out")
    assert_same(ours_pages, theirs_pages, "KV pages (conv states)")
    written = [line for line, n in zip(lines, lens if case != "decode" else [1] * len(lines)) if line and n]
    assert (ours_pages != pages).any(dim=1).tolist() == [line in written for line in range(8)]


# -- the gated output norm -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overlap", [False, True], ids=["packed_row", "overlap_row"])
@pytest.mark.parametrize("tokens", [1, 7])
def test_gated_rmsnorm_equals_vllm(tokens: int, overlap: bool) -> None:
    """``self.o_norm(core_attn_out, g2)``: ``FusedRMSNormGated(head_dim, activation="sigmoid").forward_cuda`` (the
    CUDA path of the custom op: ``rms_norm_gated`` -> ``layer_norm_gated_fwd_kernel``, 16 rows a program) on the
    layer's ``[1, T, H, D]`` output and the gate columns of the packed projection (its padded row, or the ``4HD``
    row of the projection-overlap path). Three heads: ``T * H`` rows leave a partial 16-row tile. Bitwise equal
    (vLLM writes into x; warmreg returns a fresh tensor)."""
    heads = 3
    g = seeded(3)
    width = 4 * heads * D if overlap else projection_width(heads, D)
    proj = torch.randn(tokens, width, generator=g).bfloat16()
    g2 = proj[:, 3 * heads * D : 4 * heads * D].view(tokens, heads, D)  # rearrange("... (h d) -> ... h d")
    x = (torch.randn(1, tokens, heads, D, generator=g) * 0.3).bfloat16()
    weight = (1 + 0.1 * torch.randn(D, generator=g)).bfloat16()
    with set_current_vllm_config(VllmConfig()):
        o_norm = vllm_fla_kda.FusedRMSNormGated(D, activation="sigmoid")
    o_norm.weight.data = weight.clone()  # the model's parameter is in its dtype
    want = o_norm.forward_cuda(x.clone(), g2)
    got = GatedRMSNorm(num_heads=heads, head_dim=D)(x.clone(), g2, weight, o_norm.eps)
    assert_same(got, want, "o")


# -- the metadata builder's kernels ----------------------------------------------------------------------------------
class _OnCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: the builder's launchers assert ``is_cuda`` before their Triton launch,
    which the interpreter runs on CPU tensors."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


@pytest.mark.parametrize("spec", [0, 3])
def test_aligned_state_indices_equals_vllm(spec: int) -> None:
    """``_mamba_get_block_table_tensor(block_table, seq_lens, kv_cache_spec, "align")`` (the V1 builder's
    prefix-caching state slots): 35 requests (two programs) of a wider persistent block table, sequence lengths 0, 1
    and at block boundaries; exactly equal indices."""
    g, block, width, rows = seeded(4), 16, 12, 35
    table = torch.randint(1, 1000, (40, width), generator=g, dtype=torch.int32)[:rows]
    slots = 1 + spec
    seq_lens = torch.randint(0, (width - slots) * block + 1, (rows,), generator=g, dtype=torch.int32)
    seq_lens[:6] = torch.tensor([0, 1, block, block + 1, 2 * block, (width - slots + 1) * block])
    want = vllm_meta._mamba_get_block_table_tensor(
        table.as_subclass(_OnCuda), seq_lens.as_subclass(_OnCuda),
        SimpleNamespace(block_size=block, num_speculative_blocks=spec), "align",
    )  # fmt: skip
    got = AlignedStateIndices(max_num_seqs=rows, num_speculative_tokens=spec)(
        table, seq_lens, block_size=block, num_state_slots=slots, launch_pdl=False
    )
    assert_same(got, torch.Tensor(want), "state indices")


@pytest.mark.parametrize(("n", "batch"), [(1, 4), (3, 3), (5, 37)])
def test_stage_spec_decode_metadata_equals_vllm(n: int, batch: int) -> None:
    """``stage_spec_decode_metadata`` as the builder calls it before a full-graph replay: the real requests' rows of
    the block table (``block_table[:n, :1 + SPEC]``, a view), their query offsets and accepted counts, staged into
    slices ``[:B]`` of persistent buffers filled with junk; B = n, B > n, and B + 1 > 32 rows (two programs).
    Exactly equal buffers, their tails past ``B`` included (nothing may be written there)."""
    g, slots = seeded(5), 1 + SPEC
    table = torch.randint(1, 1000, (n + 2, 9), generator=g, dtype=torch.int32)
    lens = torch.randint(1, slots + 1, (n,), generator=g)
    qsl = torch.tensor([0, *lens.cumsum(0).tolist(), 99], dtype=torch.int32)[: n + 1]
    accepted = torch.randint(1, slots + 1, (n,), generator=g, dtype=torch.int32)
    bufs = {"state": torch.full((40, slots), -7, dtype=torch.int32), "qsl": torch.full((41,), -7, dtype=torch.int32),
            "accepted": torch.full((40,), -7, dtype=torch.int32)}  # fmt: skip
    theirs, ours = clones(**bufs), clones(**bufs)
    vllm_meta.stage_spec_decode_metadata(
        table[:n, :slots].as_subclass(_OnCuda), qsl, accepted, theirs["state"][:batch], theirs["qsl"][: batch + 1],
        theirs["accepted"][:batch], num_spec_decodes=n,
    )  # fmt: skip
    StageSpecDecodeMetadata(max_num_seqs=40, num_speculative_tokens=SPEC)(
        table[:n, :slots], qsl, accepted, ours["state"][:batch], ours["qsl"][: batch + 1], ours["accepted"][:batch],
        num_spec_decodes=n, launch_pdl=False,
    )  # fmt: skip
    for name in bufs:
        assert_same(ours[name], theirs[name], f"staged {name}")


# -- attention residuals ---------------------------------------------------------------------------------------------
def _steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance of two bf16 tensors in representable steps."""
    x, y = a.reshape(-1).view(torch.int16).int(), b.reshape(-1).view(torch.int16).int()
    return (torch.where(x < 0, -(x + 32768), x) - torch.where(y < 0, -(y + 32768), y)).abs()


# (num_blocks, block_write_idx, has_delta, output norm): call sites of Kimi-K3's forward (attn_res.call_sites)
ATTN_RES_SITES = {
    "layer0_attention": (0, 0, False, True),  # the embeddings as prefix, block 0 written
    "attention_write": (3, 3, True, True),
    "attention": (1, -1, True, True),
    "mlp_after_write": (4, -1, False, True),  # a block-write layer's attention output is the new prefix
    "mlp": (8, -1, True, True),
    "output": (8, -1, True, False),
}


@pytest.mark.parametrize(
    ("tokens", "hidden", "site"),
    [
        *((t, 7168, s) for t, s in ((1, "layer0_attention"), (8, "attention"), (5, "attention_write"),
                                     (8, "mlp_after_write"), (8, "mlp"), (8, "output"))),
        pytest.param(256, 96, "attention_write", marks=pytest.mark.slow),  # the prefill tile past one block
    ],
)  # fmt: skip
def test_attn_res_equals_vllm(tokens: int, hidden: int, site: str) -> None:
    """``attn_res`` (``vllm/models/kimi_k3/nvidia/ops/attn_res.py``, which runs ``_attn_res_kernel`` off SM10x) at
    the decode and prefill call sites of the forward, the model's hidden size 7168 (BLOCK_D 8192, masked), the
    engine's ``[T, blocks, hidden]`` residual buffer; the (4, 8) decode tile below 256 tokens with more than one
    block, the (1, 4) prefill tile otherwise (at 256 tokens with hidden 96, and at one block or none). Bitwise equal
    output, updated prefix and residual buffer; both outputs the same distance from the PyTorch reference (a
    different summation order, so not equal to it)."""
    nb, write, has_delta, norm = ATTN_RES_SITES[site]
    g = seeded(6)
    randn = lambda *shape, scale=1.0, shift=0.0: (shift + scale * torch.randn(*shape, generator=g)).bfloat16()  # noqa: E731
    args: dict[str, Any] = {
        "prefix": randn(tokens, hidden), "delta": randn(tokens, hidden, scale=0.1) if has_delta else None,
        "blocks": randn(tokens, 8, hidden), "norm_weight": randn(hidden, scale=0.2, shift=1.0),
        "qk_weight": randn(hidden, scale=0.3 if hidden < 1024 else 0.02),  # logits of a few units
        "output_norm_weight": randn(hidden, scale=0.2, shift=1.0) if norm else None,
    }  # fmt: skip
    eps, out_eps = 1e-5, 1e-5 if norm else 0.0  # the model passes output_norm_eps=0.0 at the model output
    theirs, ours, ref = clones(**args), clones(**args), clones(**args)
    want = vllm_attn_res.attn_res(**theirs, num_blocks=nb, block_write_idx=write, eps=eps, output_norm_eps=out_eps)
    op = AttnRes(hidden_size=hidden, num_layers=93, block_size=12, eps=eps, output_norm_eps=1e-5)
    got = op(**ours, num_blocks=nb, block_write_idx=write, eps=eps, output_norm_eps=out_eps if norm else None,
             launch_pdl=False)  # fmt: skip
    assert_same(got, want, "output")
    assert_same(ours["prefix"], theirs["prefix"], "prefix (updated in place)")
    assert_same(ours["blocks"], theirs["blocks"], "residual buffer (block write)")
    ref_out = attn_res_reference(**ref, num_blocks=nb, block_write_idx=write, eps=eps,
                                 output_norm_eps=out_eps if norm else None)[0]  # fmt: skip
    assert torch.equal(_steps(got, ref_out), _steps(want, ref_out))
