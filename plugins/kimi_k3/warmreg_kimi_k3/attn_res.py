"""Kimi-K3's attention residuals (``attn_res``): the softmax mix of block summaries before each sublayer.

This is the Triton kernel of ``vllm/models/kimi_k3/nvidia/ops/attn_res.py: _attn_res_kernel``, launched by
the decoder layers of ``vllm/models/kimi_k3/nvidia/model.py`` when the text config sets
``attn_res_block_size`` (``bsz``). The layers are grouped into blocks of ``bsz``; ``blocks[m, s]`` holds the
summary of block ``s`` and ``prefix[m]`` the running sum of the current block. Call sites, per decoder layer
``layer_idx`` (0-based), with ``num_blocks = cdiv(layer_idx, bsz)`` and ``is_block_write_layer =
layer_idx % bsz == 0``:

* before attention: ``delta`` = the previous sublayer's output (none on the first layer, whose prefix is the
  embeddings), ``block_write_idx = layer_idx // bsz`` on a block-write layer (else -1), output norm = the
  layer's ``input_layernorm``;
* before the MLP: ``num_blocks + is_block_write_layer`` sources, no block write, output norm =
  ``post_attention_layernorm``; ``delta`` = the attention output, except on a block-write layer, where the
  attention output becomes the new block's prefix and there is no delta (``KimiDecoderLayer._post_attn_norm``;
  vLLM's own warmup list, ``get_attn_res_triton_warmup_profiles``, holds these no-delta launches too);
* at the model output (after the last layer): ``cdiv(num_hidden_layers, bsz)`` sources, the last MLP's
  output as ``delta``, no block write, no output norm (the final norm is the model's own);
* auxiliary hidden-state captures (EAGLE-3 style drafters): no delta, no output norm. No plugin config
  names those layers yet, so they are not planned (see :func:`call_sites`). Nor is pipeline parallelism,
  whose later ranks start their first layer without a delta too.

Math, one program per token row ``m``, in fp32, operation for operation as vLLM's kernel (so that the outputs are
the engine's bytes: the same products, the means as sums times the fp32 constant ``1 / hidden``, the same online
softmax)::

    pre = fp32(prefix[m])
    if HAS_DELTA:   pre = fp32(cast(pre + fp32(delta[m]), prefix dtype));  prefix[m] = pre   # in place
    if WRITE_BLOCK: blocks[m, block_write_idx] = pre
    if num_blocks == 0: mixed = pre
    else:
        w = fp32(norm_weight) * fp32(qk_weight)
        sources v_s: blocks[m, s] for s < num_blocks (after the write), then prefix[m] (after the update)
        logit_s = sum_d(v_s[d] * w[d]) * rsqrt(sum_d(v_s ** 2) * (1 / hidden) + eps)
        mixed = sum_s softmax(logit)_s * v_s          # online softmax over tiles of BLOCK_L sources
    out = mixed * rsqrt(sum(mixed ** 2) * (1 / hidden) + output_norm_eps) * fp32(output_norm_weight)
          if APPLY_OUTPUT_NORM else mixed
    output[m] = cast(out, prefix dtype)                # a fresh [T, hidden] tensor

Tiles, as vLLM picks them: ``(BLOCK_L, num_warps) = (1, 4)`` from 256 tokens or with at most one block, else
``(4, 8)``. The (1, 4) "prefill" tile is vLLM's loop: the updated prefix is stored, then read back as the last
source after a barrier, rather than kept in registers across a loop that is not unrolled. The (4, 8) "decode" tile
keeps the prefix in registers, unrolls its few tiles and reads the weights before waiting on the previous kernel
(PDL): 4-45 % faster than vLLM's at 1 and 64 tokens on the H200. Its arithmetic is vLLM's, but on the GPU the
compiled unrolled tiles round a few elements differently (at 64 tokens at most 2 of 458,752 outputs one bf16 step
apart, none at one token; the interpreter is bitwise; ``benchmarks/kernels_attn_res.py``). The
barrier of the prefill tile also follows a block write without a delta, unlike vLLM's (whose kernel could read a
written source block back before the write lands; no model call site reads the block it writes).

Dispatch in vLLM: on SM10x (Blackwell) the native C++ op ``kimi_k3_attn_res`` replaces this kernel when
``hidden == 7168``, the rows are dense, ``0 <= num_blocks <= 8`` and ``-1 <= block_write_idx <`` the
number of blocks (and the op was built, CUDA >= 13); everywhere else (SM90 always) Triton runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as tl_cuda

import warmreg

from .model import PLUGIN, KimiK3, attn_res_block_size, local_pdl, positive_text_int, rms_norm_eps

__all__ = [
    "CPP_HIDDEN",
    "CPP_MAX_BLOCKS",
    "PREFILL_TOKENS",
    "AttnRes",
    "AttnResKey",
    "CallSite",
    "attn_res_reference",
    "call_sites",
    "register",
]

#: From this many tokens on, vLLM picks the (BLOCK_L 1, 4 warps) tile: prefill and decode are other binaries.
PREFILL_TOKENS = 256
#: The native SM10x op covers 0..8 sources (num_blocks) ...
CPP_MAX_BLOCKS = 8
#: ... of this hidden size only.
CPP_HIDDEN = 7168


@triton.jit
def _softmax_step(v, exists, w, m_i, l_i, mixed, HIDDEN: tl.constexpr, EPS: tl.constexpr):
    """One tile of the online softmax: the sources ``v`` ``[BLOCK_L, BLOCK_D]`` (fp32) whose ``exists`` is set."""
    rstd = tl.rsqrt(tl.sum(v * v, axis=1) * (1.0 / HIDDEN) + EPS)
    logit = tl.where(exists, tl.sum(v * w[None, :], axis=1) * rstd, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(logit, axis=0))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(logit - m_new)
    return m_new, l_i * alpha + tl.sum(p, axis=0), mixed * alpha + tl.sum(p[:, None] * v, axis=0)


@triton.jit
def _attn_res_kernel(
    prefix_ptr,  # [T, D]: the running block sum, updated in place when HAS_DELTA
    delta_ptr,  # [T, D]: the previous sublayer's output (None when HAS_DELTA is False)
    blocks_ptr,  # [T, R, D]: the block summaries
    norm_w_ptr,  # [D]: the sources' RMSNorm weight
    qk_w_ptr,  # [D]: the pseudo-query of the mix
    out_norm_w_ptr,  # [D]: the output RMSNorm weight (None when APPLY_OUTPUT_NORM is False)
    out_ptr,  # [T, D]: fresh
    STRIDE_PREFIX_M: tl.constexpr,  # row strides of fixed engine buffers: constants, as vLLM declares them
    STRIDE_DELTA_M: tl.constexpr,  # (0 without a delta)
    STRIDE_BLOCK_M: tl.constexpr,  # R * D for the engine's [T, R, D] residual buffer
    STRIDE_BLOCK_R: tl.constexpr,  # between the blocks of one row
    STRIDE_OUT_M: tl.constexpr,  # D: the output is fresh
    NUM_BLOCKS: tl.constexpr,  # sources before the prefix: fixed per call site, a constant trip count
    HIDDEN: tl.constexpr,  # the model's hidden size: both means multiply by its fp32 reciprocal, as vLLM's
    BLOCK_WRITE_IDX: tl.constexpr,  # the block this call writes (-1: none); fixed per call site
    EPS: tl.constexpr,  # the sources' RMSNorm epsilon: a constexpr float in vLLM, so each value is a binary
    OUTPUT_NORM_EPS: tl.constexpr,  # likewise for the output norm (0.0 when APPLY_OUTPUT_NORM is False)
    HAS_DELTA: tl.constexpr,  # add delta to the prefix (and store it) first
    WRITE_BLOCK: tl.constexpr,  # store the updated prefix into blocks[:, BLOCK_WRITE_IDX]
    APPLY_OUTPUT_NORM: tl.constexpr,  # RMSNorm the mix (the sublayer's input norm, fused)
    BLOCK_L: tl.constexpr,  # sources per tile: 4 (the decode tile, 8 warps) or 1 (the prefill tile, 4 warps)
    BLOCK_D: tl.constexpr,  # next_pow2(HIDDEN): one tile covers a row
    USE_PDL: tl.constexpr,  # wait on the previous kernel before reading activations; matches launch_pdl
):
    m = tl.program_id(0).to(tl.int64)  # T * R * D can pass 2**31
    offs_d = tl.max_contiguous(tl.arange(0, BLOCK_D), BLOCK_D)
    mask_d = offs_d < HIDDEN
    DECODE_TILE: tl.constexpr = BLOCK_L > 1
    if DECODE_TILE and NUM_BLOCKS > 0:  # parameters: read while the previous kernel finishes
        w = tl.load(norm_w_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        w = w * tl.load(qk_w_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    if USE_PDL:  # prefix, delta and blocks come from the previous kernels
        tl_cuda.gdc_wait()
    pre = tl.load(prefix_ptr + m * STRIDE_PREFIX_M + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    if HAS_DELTA:
        pre += tl.load(delta_ptr + m * STRIDE_DELTA_M + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        pre = pre.to(prefix_ptr.dtype.element_ty).to(tl.float32)  # the sources see what is stored
        tl.store(prefix_ptr + m * STRIDE_PREFIX_M + offs_d, pre.to(prefix_ptr.dtype.element_ty), mask=mask_d)
    if WRITE_BLOCK:
        tl.store(
            blocks_ptr + m * STRIDE_BLOCK_M + BLOCK_WRITE_IDX * STRIDE_BLOCK_R + offs_d,
            pre.to(blocks_ptr.dtype.element_ty),
            mask=mask_d,
        )
    if NUM_BLOCKS == 0:
        mixed = pre
    else:
        m_i = tl.full((), float("-inf"), tl.float32)
        l_i = tl.zeros((), tl.float32)
        mixed = tl.zeros((BLOCK_D,), tl.float32)
        NUM_TILES: tl.constexpr = (NUM_BLOCKS + BLOCK_L) // BLOCK_L  # cdiv(NUM_BLOCKS + 1, BLOCK_L)
        if DECODE_TILE:
            # 8 warps: 32 registers a thread per fp32 row vector, so the updated prefix stays in registers (it is
            # source NUM_BLOCKS, and the written block if that is a source) and the few tiles are unrolled.
            for tile in tl.static_range(NUM_TILES):
                src = tile * BLOCK_L + tl.arange(0, BLOCK_L)
                from_mem = src < NUM_BLOCKS
                take_pre = src == NUM_BLOCKS
                if WRITE_BLOCK:
                    from_mem = from_mem & (src != BLOCK_WRITE_IDX)
                    take_pre = take_pre | (src == BLOCK_WRITE_IDX)
                ptrs = blocks_ptr + m * STRIDE_BLOCK_M + src[:, None] * STRIDE_BLOCK_R + offs_d[None, :]
                v = tl.load(ptrs, mask=from_mem[:, None] & mask_d[None, :], other=0.0, eviction_policy="evict_first")
                v = tl.where(take_pre[:, None], pre[None, :], v.to(tl.float32))
                m_i, l_i, mixed = _softmax_step(v, src <= NUM_BLOCKS, w, m_i, l_i, mixed, HIDDEN, EPS)
        else:
            # 4 warps: 64 registers a thread per fp32 row vector, and a third one live across the loop spills. As
            # in vLLM's kernel the prefix is read back from memory as the last source (after a barrier), the
            # weights are loaded only now, and the loop is not unrolled.
            if HAS_DELTA or WRITE_BLOCK:
                tl.debug_barrier()  # the stores above happen before any thread reads them back
            w = tl.load(norm_w_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
            w = w * tl.load(qk_w_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
            for tile in range(NUM_TILES):
                src = tile * BLOCK_L + tl.arange(0, BLOCK_L)
                exists = src <= NUM_BLOCKS
                block_ptrs = blocks_ptr + m * STRIDE_BLOCK_M + src[:, None] * STRIDE_BLOCK_R + offs_d[None, :]
                prefix_ptrs = prefix_ptr + m * STRIDE_PREFIX_M + src[:, None] * 0 + offs_d[None, :]
                ptrs = tl.where((src == NUM_BLOCKS)[:, None], prefix_ptrs, block_ptrs)
                v = tl.load(ptrs, mask=exists[:, None] & mask_d[None, :], other=0.0, eviction_policy="evict_first")
                m_i, l_i, mixed = _softmax_step(v.to(tl.float32), exists, w, m_i, l_i, mixed, HIDDEN, EPS)
        mixed /= l_i
    out = mixed
    if USE_PDL:
        tl_cuda.gdc_launch_dependents()
    if APPLY_OUTPUT_NORM:
        rstd_out = tl.rsqrt(tl.sum(tl.where(mask_d, mixed * mixed, 0.0), axis=0) * (1.0 / HIDDEN) + OUTPUT_NORM_EPS)
        out = mixed * rstd_out * tl.load(out_norm_w_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * STRIDE_OUT_M + offs_d, out.to(out_ptr.dtype.element_ty), mask=mask_d)


@attrs.frozen(kw_only=True)
class AttnResKey(warmreg.CompileKey):
    """What changes the binary of ``attn_res``: every kernel argument but the pointers is a constexpr."""

    dtype: str  # prefix, delta, blocks and the output
    weight_dtype: str  # the three norm / query weights
    hidden_size: int  # HIDDEN
    block_d: int  # BLOCK_D = next_pow2(hidden_size)
    num_blocks: int  # NUM_BLOCKS
    block_write_idx: int  # BLOCK_WRITE_IDX (-1: none)
    has_delta: bool  # HAS_DELTA (delta passed as None otherwise)
    write_block: bool  # WRITE_BLOCK = block_write_idx >= 0
    apply_output_norm: bool  # APPLY_OUTPUT_NORM (output_norm_weight passed as None otherwise)
    eps: float  # EPS
    output_norm_eps: float  # OUTPUT_NORM_EPS (0.0 without an output norm)
    stride_prefix_m: int
    stride_delta_m: int  # 0 without a delta
    stride_block_m: int
    stride_block_r: int
    stride_out_m: int
    block_l: int  # BLOCK_L: 1 if T >= 256 or num_blocks <= 1, else 4
    num_warps: int  # 4 with BLOCK_L 1, else 8
    num_stages: int  # 2, as vLLM launches it
    launch_pdl: bool  # USE_PDL and the launch option (SM >= 90)


@attrs.frozen
class CallSite:
    """One distinct launch of the model's forward: what reaches the key besides the tensors."""

    num_blocks: int
    block_write_idx: int
    has_delta: bool
    apply_output_norm: bool


def call_sites(num_layers: int, block_size: int) -> list[CallSite]:
    """The distinct call sites of one forward over ``num_layers`` decoder layers, sorted.

    Per layer the attention input and the MLP input, then the model output (see the module docstring).
    The auxiliary captures (no delta, no output norm) are left out: they exist only with a drafter that
    asks for auxiliary hidden states at named layers, which no config here describes.
    """
    sites = set()
    for layer in range(num_layers):
        num_blocks = -(-layer // block_size)
        write = layer % block_size == 0
        # input_layernorm: the first layer has no previous sublayer output (the embeddings are the prefix)
        sites.add(CallSite(num_blocks, layer // block_size if write else -1, layer > 0, True))
        # post_attention_layernorm: a block-write layer starts the new block's prefix at the attention output
        sites.add(CallSite(num_blocks + write, -1, not write, True))
    sites.add(CallSite(-(-num_layers // block_size), -1, True, False))  # the model output
    return sorted(sites, key=attrs.astuple)


def _is_sm10x(platform: warmreg.Platform) -> bool:
    return platform.is_cuda and 100 <= platform.sm < 110


def _cpp_takes(site: CallSite, hidden: int) -> bool:
    """Whether vLLM's SM10x dispatch sends this call site to the C++ op (dense rows assumed, as the engine's)."""
    return hidden == CPP_HIDDEN and 0 <= site.num_blocks <= CPP_MAX_BLOCKS


def _tile(tokens: int, num_blocks: int) -> tuple[int, int]:
    """``(BLOCK_L, num_warps)`` as vLLM picks them."""
    return (1, 4) if tokens >= PREFILL_TOKENS or num_blocks <= 1 else (4, 8)


class AttnRes(warmreg.TritonKernel[AttnResKey]):
    """``attn_res`` for one deployment: the configuration only shapes :meth:`domains`.

    :param hidden_size: the model's hidden size.
    :param num_layers: decoder layers (``text.num_hidden_layers``).
    :param block_size: ``text.attn_res_block_size``: layers per block.
    :param eps: the sources' RMSNorm epsilon (``text.rms_norm_eps``).
    :param output_norm_eps: the layers' input / post-attention norm epsilon (``text.rms_norm_eps``).
    :param dtype: activation dtype name (``serving.dtype``); the weights are in it too.
    :param max_num_batched_tokens: the most tokens a step carries: bounds the tile classes planned.
    :param plugin: the registering plugin, named in config errors.
    """

    name = "kimi_k3.attn_res"
    key_type = AttnResKey
    jit = _attn_res_kernel

    def __init__(
        self,
        *,
        hidden_size: int,
        num_layers: int,
        block_size: int,
        eps: float,
        output_norm_eps: float,
        dtype: str = "bfloat16",
        max_num_batched_tokens: int = 1,
        plugin: str = PLUGIN,
    ) -> None:
        self.hidden_size, self.num_layers, self.block_size = hidden_size, num_layers, block_size
        self.eps, self.output_norm_eps = eps, output_norm_eps
        self.dtype = getattr(torch, dtype)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.plugin = plugin
        #: Blocks in the engine's residual buffer ``[T, max_blocks, hidden]``: one per block-write layer.
        self.max_blocks = -(-num_layers // block_size)
        self.call_sites = call_sites(num_layers, block_size)

    def dispatch(
        self,
        *,
        prefix: torch.Tensor,
        delta: torch.Tensor | None,
        blocks: torch.Tensor,
        norm_weight: torch.Tensor,
        output_norm_weight: torch.Tensor | None,
        num_blocks: int,
        block_write_idx: int,
        eps: float,
        output_norm_eps: float | None,
        launch_pdl: bool,
    ) -> AttnResKey:
        hidden = prefix.shape[1]
        block_l, num_warps = _tile(prefix.shape[0], num_blocks)
        norm = output_norm_weight is not None
        return AttnResKey(
            dtype=warmreg.dtype_name(prefix.dtype),
            weight_dtype=warmreg.dtype_name(norm_weight.dtype),
            hidden_size=hidden,
            block_d=warmreg.next_pow2(hidden),
            num_blocks=num_blocks,
            block_write_idx=block_write_idx,
            has_delta=delta is not None,
            write_block=block_write_idx >= 0,
            apply_output_norm=norm,
            eps=float(eps),
            output_norm_eps=float(output_norm_eps) if norm and output_norm_eps is not None else 0.0,
            stride_prefix_m=prefix.stride(0),
            stride_delta_m=0 if delta is None else delta.stride(0),
            stride_block_m=blocks.stride(0),
            stride_block_r=blocks.stride(1),
            stride_out_m=hidden,
            block_l=block_l,
            num_warps=num_warps,
            num_stages=2,
            launch_pdl=bool(launch_pdl),
        )

    # -- the deployment's input space --------------------------------------------------------------
    def _token_counts(self) -> list[int]:
        """One count per tile class, within ``max_num_batched_tokens``: 1 (decode) and 256 (prefill)."""
        return [t for t in (1, PREFILL_TOKENS) if t <= self.max_num_batched_tokens]

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> list[dict[str, Any]]:  # type: ignore[override]
        """Every call site of the forward at both tile classes; on SM10x only those the C++ op does not take."""
        d, dt = self.hidden_size, self.dtype
        sites = [s for s in self.call_sites if not (_is_sm10x(platform) and _cpp_takes(s, d))]
        points = []
        for tokens in self._token_counts():
            # Engine buffers: prefix and delta [T, D]; the residual buffer [T, max_blocks, D].
            prefix = warmreg.meta((tokens, d), dt)
            blocks = warmreg.meta((tokens, self.max_blocks, d), dt)
            for s in sites:
                points.append(
                    {
                        "prefix": prefix,
                        "delta": warmreg.meta((tokens, d), dt) if s.has_delta else None,
                        "blocks": blocks,
                        "norm_weight": warmreg.meta((d,), dt),
                        "output_norm_weight": warmreg.meta((d,), dt) if s.apply_output_norm else None,
                        "num_blocks": s.num_blocks,
                        "block_write_idx": s.block_write_idx,
                        "eps": self.eps,
                        "output_norm_eps": self.output_norm_eps if s.apply_output_norm else None,
                        "launch_pdl": platform.supports_pdl,
                    }
                )
        return points

    def warmup_inputs(self, key: AttnResKey) -> Mapping[str, Any]:
        dt, wdt, d = getattr(torch, key.dtype), getattr(torch, key.weight_dtype), key.hidden_size
        # A token count of the key's tile class: decode (1) unless the key has the prefill tile at > 1 source.
        tokens = PREFILL_TOKENS if (key.block_l, key.num_warps) == (1, 4) and key.num_blocks > 1 else 1
        rows = max(key.num_blocks, key.block_write_idx + 1, 1)
        return {
            "prefix": warmreg.meta((tokens, d), dt, stride=(key.stride_prefix_m, 1)),
            "delta": warmreg.meta((tokens, d), dt, stride=(key.stride_delta_m, 1)) if key.has_delta else None,
            "blocks": warmreg.meta((tokens, rows, d), dt, stride=(key.stride_block_m, key.stride_block_r, 1)),
            "norm_weight": warmreg.meta((d,), wdt),
            "qk_weight": warmreg.meta((d,), wdt),
            "num_blocks": key.num_blocks,
            "block_write_idx": key.block_write_idx,
            "eps": key.eps,
            "output_norm_weight": warmreg.meta((d,), wdt) if key.apply_output_norm else None,
            "output_norm_eps": key.output_norm_eps if key.apply_output_norm else None,
            "launch_pdl": key.launch_pdl,
        }

    # -- the launch code ----------------------------------------------------------------------------
    @warmreg.kernel_launcher
    def __call__(
        self,
        prefix: torch.Tensor,
        delta: torch.Tensor | None,
        blocks: torch.Tensor,
        norm_weight: torch.Tensor,
        qk_weight: torch.Tensor,
        num_blocks: int,
        block_write_idx: int,
        eps: float,
        output_norm_weight: torch.Tensor | None = None,
        output_norm_eps: float | None = None,
        launch_pdl: bool | None = None,
        *,
        out: torch.Tensor | None = None,
    ) -> warmreg.LaunchSpec[AttnResKey]:
        """Mix the block summaries and the (updated) prefix; returns the ``[T, hidden]`` output (``out``, or a
        fresh tensor).

        ``prefix`` is updated in place when ``delta`` is given, and ``blocks[:, block_write_idx]`` written
        when ``block_write_idx >= 0`` (the math is in the module docstring).

        :param prefix: ``[T, D]``, last dim contiguous.
        :param delta: ``[T, D]`` like ``prefix``, or None.
        :param blocks: ``[T, R, D]`` with ``R > max(num_blocks - 1, block_write_idx)``, last dim contiguous.
        :param norm_weight: ``[D]`` contiguous, the sources' RMSNorm weight.
        :param qk_weight: ``[D]`` contiguous, the mix's pseudo-query.
        :param num_blocks: sources before the prefix (``>= 0``).
        :param block_write_idx: the block to write, or -1.
        :param eps: the sources' RMSNorm epsilon.
        :param output_norm_weight: ``[D]``, or None for no output norm.
        :param output_norm_eps: the output norm's epsilon (required with ``output_norm_weight``).
        :param launch_pdl: programmatic dependent launch (default: the local GPU supports it).
        :param out: a preallocated output, contiguous ``[T, hidden]`` of prefix's dtype (then nothing is allocated).
        :raises LaunchError: for shapes, dtypes, layouts, indices or devices the kernel cannot take, or an ``out``
            that is not the output's shape, dtype and layout.
        """
        self._check(prefix, delta, blocks, norm_weight, qk_weight, num_blocks, block_write_idx,
                    output_norm_weight, output_norm_eps)  # fmt: skip
        launch_pdl = local_pdl(launch_pdl)
        key = self.dispatch(
            prefix=prefix, delta=delta, blocks=blocks, norm_weight=norm_weight, output_norm_weight=output_norm_weight,
            num_blocks=num_blocks, block_write_idx=block_write_idx, eps=eps, output_norm_eps=output_norm_eps,
            launch_pdl=launch_pdl,
        )  # fmt: skip
        out = warmreg.output(self.name, "out", out, prefix.shape, prefix.dtype, prefix.device)
        kwargs = dict(
            prefix_ptr=prefix, delta_ptr=delta, blocks_ptr=blocks, norm_w_ptr=norm_weight, qk_w_ptr=qk_weight,
            out_norm_w_ptr=output_norm_weight, out_ptr=out,
            STRIDE_PREFIX_M=key.stride_prefix_m, STRIDE_DELTA_M=key.stride_delta_m,
            STRIDE_BLOCK_M=key.stride_block_m, STRIDE_BLOCK_R=key.stride_block_r, STRIDE_OUT_M=key.stride_out_m,
            NUM_BLOCKS=key.num_blocks, HIDDEN=key.hidden_size, BLOCK_WRITE_IDX=key.block_write_idx,
            EPS=key.eps, OUTPUT_NORM_EPS=key.output_norm_eps, HAS_DELTA=key.has_delta,
            WRITE_BLOCK=key.write_block, APPLY_OUTPUT_NORM=key.apply_output_norm,
            BLOCK_L=key.block_l, BLOCK_D=key.block_d, USE_PDL=key.launch_pdl,
        )  # fmt: skip
        grid = (prefix.shape[0],) if prefix.shape[0] else None
        return warmreg.LaunchSpec(key, grid, kwargs, out)

    def _check(
        self,
        prefix: torch.Tensor,
        delta: torch.Tensor | None,
        blocks: torch.Tensor,
        norm_weight: torch.Tensor,
        qk_weight: torch.Tensor,
        num_blocks: int,
        block_write_idx: int,
        output_norm_weight: torch.Tensor | None,
        output_norm_eps: float | None,
    ) -> None:
        def fail(problem: str, fix: str | None = None) -> None:
            raise warmreg.LaunchError(self.name, problem, fix=fix)

        if prefix.ndim != 2 or prefix.stride(1) != 1:
            fail(
                f"prefix {tuple(prefix.shape)} must be [T, hidden] with a contiguous last dim (strides {prefix.stride()})"
            )
        t, d = prefix.shape
        if delta is not None and (delta.shape != prefix.shape or delta.stride(1) != 1):
            fail(f"delta {tuple(delta.shape)} must be [T, hidden] = {(t, d)} with a contiguous last dim")
        if blocks.ndim != 3 or blocks.shape[0] != t or blocks.shape[2] != d or blocks.stride(2) != 1:
            fail(f"blocks {tuple(blocks.shape)} must be [T, R, hidden] with T, hidden = {(t, d)}, last dim contiguous")
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            fail(f"num_blocks must be an int >= 0 (got {num_blocks!r})")
        if isinstance(block_write_idx, bool) or not isinstance(block_write_idx, int) or block_write_idx < -1:
            fail(f"block_write_idx must be an int >= -1 (got {block_write_idx!r})")
        if max(num_blocks, block_write_idx + 1) > blocks.shape[1]:
            fail(
                f"blocks has {blocks.shape[1]} blocks: too few for num_blocks {num_blocks}, block_write_idx {block_write_idx}",
                fix="pass the whole residual buffer [T, max_blocks, hidden]",
            )
        weights = (("norm_weight", norm_weight), ("qk_weight", qk_weight), ("output_norm_weight", output_norm_weight))
        for name, w in weights:
            if w is not None and (w.shape != (d,) or not w.is_contiguous()):
                fail(f"{name} must be [hidden] = [{d}] and contiguous (got {tuple(w.shape)})")
        if output_norm_weight is not None and output_norm_eps is None:
            fail("output_norm_eps is required with output_norm_weight")
        acts = [x for x in (prefix, delta, blocks) if x is not None]
        if not prefix.dtype.is_floating_point or any(x.dtype != prefix.dtype for x in acts):
            fail(f"prefix, delta and blocks must share one floating dtype (got {[x.dtype for x in acts]})")
        ws = [w for _, w in weights if w is not None]
        if any(w.dtype != norm_weight.dtype for w in ws):
            fail(f"the weights must share one dtype (got {[w.dtype for w in ws]})")
        if not all(warmreg.is_aligned(x) for x in (*acts, *ws)):
            fail("every tensor must start 16-byte aligned (the keys assume the engine's own buffers)",
                 fix="pass the buffers themselves or row slices of them, not views at an odd offset")  # fmt: skip
        devices = {x.device for x in (*acts, *ws)}
        if len(devices) > 1:
            fail(f"all inputs must be on one device (got {sorted(map(str, devices))})")


def attn_res_reference(
    prefix: torch.Tensor,
    delta: torch.Tensor | None,
    blocks: torch.Tensor,
    norm_weight: torch.Tensor,
    qk_weight: torch.Tensor,
    num_blocks: int,
    block_write_idx: int,
    eps: float,
    output_norm_weight: torch.Tensor | None = None,
    output_norm_eps: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyTorch reference of the module docstring's math, with ``torch.softmax`` over the stacked sources.

    :returns: ``(output, prefix, blocks)``: the output in prefix's dtype and copies of ``prefix`` and
        ``blocks`` with the in-place updates applied; the inputs are not modified.
    """
    prefix, blocks = prefix.clone(), blocks.clone()
    pre = prefix.float()
    if delta is not None:
        pre = (pre + delta.float()).to(prefix.dtype).float()
        prefix.copy_(pre)
    if block_write_idx >= 0:
        blocks[:, block_write_idx] = pre.to(blocks.dtype)
    if num_blocks == 0:
        mixed = pre
    else:
        v = torch.cat([blocks[:, :num_blocks].float(), pre[:, None]], dim=1)  # [T, num_blocks + 1, D]
        w = norm_weight.float() * qk_weight.float()
        logits = (v * w).sum(-1) * torch.rsqrt(v.pow(2).mean(-1) + eps)
        mixed = (torch.softmax(logits, dim=1)[..., None] * v).sum(1)
    if output_norm_weight is not None:
        assert output_norm_eps is not None
        mixed = mixed * torch.rsqrt(mixed.pow(2).mean(-1, keepdim=True) + output_norm_eps) * output_norm_weight.float()
    return mixed.to(prefix.dtype), prefix, blocks


def register(registry: warmreg.Registry, m: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register ``attn_res`` on CUDA and ROCm when ``text.attn_res_block_size`` is set (absent: the model has plain
    residuals and never launches it).

    ROCm (``vllm/models/kimi_k3/amd/linear.py: _apply_attn_res`` -> ``amd/ops/attn_res.py: attn_res``) always runs
    its Triton copy of the kernel at the same call sites, tiles and math, without PDL (the prefix source kept in
    registers, as this op's decode tile does). Its fused FP8 output quantization (``QUANT_MAX``, a per-token
    scale) runs only where the next layer's input quant key is FP8 per-token dynamic, i.e. for a quantized
    checkpoint: like the rest of this plugin, unquantized projections are assumed, so that variant is not planned.

    On SM10x vLLM runs the C++ op for every call site with ``num_blocks <= 8`` at hidden 7168, so only the
    other call sites are planned there, and nothing at all when none is left (as for the example, whose
    block size 12 gives 8 blocks over 93 layers). SM90 and other CUDA archs plan every call site.

    :raises warmreg.ConfigError: for a malformed ``attn_res_block_size``, ``num_hidden_layers``,
        ``hidden_size`` or ``rms_norm_eps``.
    """
    block_size = attn_res_block_size(config)
    if block_size is None:
        return
    hidden = positive_text_int(config, "hidden_size")
    layers = positive_text_int(config, "num_hidden_layers")
    eps = rms_norm_eps(config)
    kernel = AttnRes(
        hidden_size=hidden,
        num_layers=layers,
        block_size=block_size,
        eps=eps,
        output_norm_eps=eps,
        dtype=m.dtype,
        max_num_batched_tokens=config.get("serving.max_num_batched_tokens", int, plugin=PLUGIN),
        plugin=PLUGIN,
    )
    sm10x = warmreg.sm_at_least(100) & warmreg.sm_below(110)
    all_cpp = all(_cpp_takes(s, hidden) for s in kernel.call_sites)
    cuda = warmreg.is_cuda & ~sm10x if all_cpp else warmreg.is_cuda
    registry.add(kernel, when=cuda | warmreg.is_rocm)
