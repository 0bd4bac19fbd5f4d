"""Quantize-and-insert into the ``fp8_ds_mla`` paged K cache (vLLM 0.33
``models/deepseek_v4/common/ops/cache_utils.py``: ``quantize_and_insert_k_cache``, the Triton writer of the XPU SWA
cache).

The inverse of :mod:`.cache`'s gather; the layout and the exact FP8 bit conversions are in
:mod:`.fp8_ds_mla`. vLLM launches it only for the XPU SWA insert (CUDA and ROCm use a C++ op); the
tests use it to build caches.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._quant import pow2_scale_reference
from .fp8_ds_mla import (
    HEAD_DIM,
    NOPE,
    NOPE_DIM,
    NQB,
    QB,
    QUANT_BLOCK,
    ROPE,
    SCALE_BYTES,
    SCALES,
    TOKEN,
    TOKEN_BYTES,
    cache_problem,
    check_model_layout,
    f32_to_e4m3,
    page_bytes,
    paged_caches,
    uses_fp8_ds_mla,
    value_in_class,
)
from .model import DSV4, PLUGIN, SWA_PAGE_SIZE

__all__ = [
    "AMAX_FLOOR",
    "WRITER_FP8_MAX",
    "QuantInsertKCache",
    "QuantInsertKey",
    "quant_insert_k_reference",
    "register",
]


@triton.jit(do_not_specialize_on_alignment=["slot_mapping_ptr"])
def _quant_insert_k_kernel(
    k_ptr,
    k_cache_ptr,
    slot_mapping_ptr,
    k_stride,
    block_stride,
    CACHE_BLOCK_SIZE: tl.constexpr,  # tokens per page: locates the token and the scale area
    USE_FNUZ: tl.constexpr,  # write e4m3fnuz bytes with vLLM's FNUZ max 224 instead of OCP e4m3fn (max 448)
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t)
    # tl.where(c, True, False) is c as an int1 scalar: Triton 3.9's interpreter splats a bare scalar comparison
    # with its operands' integer dtype and rejects that as a mask; compiled, it folds to the same IR as c.
    live = tl.where(slot >= 0, True, False)  # -1: a padded or replayed token, not written
    page = tl.where(live, slot, 0) // CACHE_BLOCK_SIZE
    j = tl.where(live, slot, 0) % CACHE_BLOCK_SIZE
    base = k_cache_ptr + page * block_stride
    token = base + j * TOKEN
    src = k_ptr + t.to(tl.int64) * k_stride
    rows = tl.arange(0, 8)[:, None]
    cols = tl.arange(0, QB)[None, :]
    nope = (rows < NQB) & live
    x = tl.load(src + rows * QB + cols, mask=nope, other=0.0).to(tl.float32)
    # UE8M0 scale: the least 2**e with fp8_max * 2**e >= max(amax, 1e-4) (vLLM's floor: an all-zero block
    # gets 2**-22), from the exponent and mantissa bits
    amax_bits = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4).to(tl.int32, bitcast=True)
    FP8_EXP: tl.constexpr = 7 if USE_FNUZ else 8  # 224 = 1.75 * 2**7, 448 = 1.75 * 2**8
    e = (amax_bits >> 23) - FP8_EXP + ((amax_bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    # an infinite amax: vLLM's scale is inf (byte 255) and x / inf is +-0, NaN at an infinity (clamped below)
    inf = amax_bits >= 0x7F800000
    s = tl.where(inf, 255, tl.minimum(tl.maximum(e, 0), 255))  # the UE8M0 byte: 2**(s - 127)
    inv = tl.where(inf, 0.0, ((254 - s) << 23).to(tl.float32, bitcast=True))  # 2**(127 - s); exact for s <= 253
    fp8_max = 224.0 if USE_FNUZ else 448.0
    q = x * inv[:, None]
    # the GPU's NaN-ignoring max then min takes the NaN to -fp8_max, as in vLLM's kernel; said explicitly, since
    # Triton 3.6's interpreter lowers that max to np.maximum, which keeps the NaN
    q = tl.where(q != q, -fp8_max, tl.minimum(tl.maximum(q, -fp8_max), fp8_max))
    tl.store(token + rows * QB + cols, f32_to_e4m3(q, USE_FNUZ), mask=nope)
    r8 = tl.arange(0, 8)
    tl.store(
        base + CACHE_BLOCK_SIZE * TOKEN + j * SCALES + r8, tl.where(r8 < NQB, s, 0).to(tl.uint8), mask=live & (r8 < 8)
    )
    r = tl.arange(0, ROPE)
    rope = tl.load(src + NOPE + r, mask=live & (r < ROPE))
    tl.store((token + NOPE).to(tl.pointer_type(tl.bfloat16)) + r, rope.to(tl.bfloat16), mask=live & (r < ROPE))


@attrs.frozen(kw_only=True)
class QuantInsertKey(warmreg.CompileKey):
    """What changes the binary of the quantize-and-insert writer."""

    dtype: str  # k's dtype (bf16)
    cache_block_size: int
    block_stride: str  # int class of the page stride
    use_fnuz: bool
    k_stride: str  # int class of k's row stride
    k_aligned: bool  # k may be a view into a wider projection
    num_warps: int


class QuantInsertKCache(warmreg.TritonKernel[QuantInsertKey]):
    """Quantize ``k [T, 512]`` into ``fp8_ds_mla`` pages (the inverse of :class:`DequantGatherKCache`).

    For token ``t`` with ``slot = slot_mapping[t] >= 0`` (page ``slot // bs``, row ``j = slot % bs``),
    per block ``q < 7`` of 64 NoPE values::

        s = clamp(ceil(log2(max(amax(|k[t, 64q:64q+64]|), 1e-4) / fp8_max)) + 127, 0, 255)   # UE8M0 byte
        token j bytes [64q, 64q+64) = e4m3(clamp(k * 2**(127 - s), -fp8_max, fp8_max))  (RNE)
        scale byte q = s;  scale byte 7 = 0;  token j bytes [448, 576) = k[t, 448:512] as bf16

    As vLLM's writer: the amax is floored at ``1e-4`` (an all-zero block gets scale byte 105), ``fp8_max``
    is 448 (e4m3fn) or, on a FNUZ platform, ``get_fp8_min_max()``'s 224 (not e4m3fnuz's 240), and a block
    holding an infinity gets byte 255 and ``k / inf`` (zeros; the NaN at the infinity clamps to -fp8_max).
    The ceiling is computed exactly from the bits of ``amax`` (no rounded division; for bf16 inputs the same
    as vLLM's ``ceil(log2(amax / fp8_max))``). Grid ``(S,)``, one program per ``slot_mapping`` entry: under
    DP padding ``slot_mapping`` (``S``) is shorter than ``k`` (``T``).

    :param block_size: tokens per page of the cache written (64: the SWA cache).
    :param page_strides: page strides the cache can have (default: :func:`page_bytes` of ``block_size``).
    :param plugin: the registering plugin, named in config errors.
    """

    name = "deepseek_v4.quant_insert_k_cache"
    key_type = QuantInsertKey
    jit = _quant_insert_k_kernel

    def __init__(
        self, *, block_size: int = SWA_PAGE_SIZE, page_strides: tuple[int, ...] = (), plugin: str = PLUGIN
    ) -> None:
        self.block_size = block_size
        self.page_strides = page_strides or (page_bytes(block_size),)
        self.plugin = plugin

    def dispatch(self, *, k: torch.Tensor, k_cache: torch.Tensor, block_size: int, use_fnuz: bool) -> QuantInsertKey:
        return QuantInsertKey(
            dtype=str(k.dtype).removeprefix("torch."),
            cache_block_size=block_size,
            block_stride=warmreg.int_class(k_cache.stride(0)),
            use_fnuz=use_fnuz,
            k_stride=warmreg.int_class(k.stride(0)),
            k_aligned=warmreg.is_aligned(k),
            num_warps=4,
        )

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        tokens = warmreg.token_counts(config, plugin=self.plugin)
        return {
            "k": [warmreg.meta((t, HEAD_DIM), torch.bfloat16) for t in tokens],
            "k_cache": [warmreg.meta((2, s), torch.uint8) for s in self.page_strides],
            "block_size": [self.block_size],
            "use_fnuz": [platform.fp8_fnuz],  # the SWA cache follows the platform's FP8
        }

    def warmup_inputs(self, key: QuantInsertKey) -> Mapping[str, Any]:
        bs = key.cache_block_size
        k_stride = value_in_class(key.k_stride, HEAD_DIM)
        page_stride = value_in_class(key.block_stride, bs * (TOKEN_BYTES + SCALE_BYTES))
        return {
            "k": warmreg.meta(
                (1, HEAD_DIM), getattr(torch, key.dtype), stride=(k_stride, 1), offset=0 if key.k_aligned else 1
            ),
            "k_cache": warmreg.meta((1, page_stride), torch.uint8),
            "slot_mapping": warmreg.meta((1,), torch.int64),
            "block_size": bs,
            "use_fnuz": key.use_fnuz,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        k: torch.Tensor,
        k_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        block_size: int,
        use_fnuz: bool = False,
    ) -> warmreg.LaunchSpec[QuantInsertKey]:
        """Write ``k`` into the cache pages named by ``slot_mapping`` (in place; returns ``k_cache``).

        :param k: ``[T, 512]`` bf16, last dim contiguous (a row-strided view is fine).
        :param k_cache: uint8 pages ``[num_pages, ...]``, 16-byte aligned; ``stride(0)`` is the page stride.
        :param slot_mapping: int64 ``[S]``, ``S <= T`` (shorter under DP padding: the tokens past it are not
            written); ``page * block_size + row``, or -1 to skip the token.
        :raises warmreg.LaunchError: for wrong dtypes, shapes or layouts.
        """
        if k.ndim != 2 or k.shape[1] != HEAD_DIM or k.stride(1) != 1 or k.dtype != torch.bfloat16:
            raise warmreg.LaunchError(
                self.name, f"k must be bf16 [T, {HEAD_DIM}] with a contiguous last dim (got {k.dtype} {tuple(k.shape)})"
            )
        if slot_mapping.dtype != torch.int64 or slot_mapping.ndim != 1 or slot_mapping.shape[0] > k.shape[0]:
            raise warmreg.LaunchError(
                self.name,
                f"slot_mapping must be int64 [<= {k.shape[0]}] (got {slot_mapping.dtype} {tuple(slot_mapping.shape)})",
            )
        problem = cache_problem(k_cache, block_size)
        if problem:
            raise warmreg.LaunchError(self.name, problem, fix="check block_size against the cache group")
        key = self.dispatch(k=k, k_cache=k_cache, block_size=block_size, use_fnuz=use_fnuz)
        kwargs = dict(
            k_ptr=k, k_cache_ptr=k_cache, slot_mapping_ptr=slot_mapping, k_stride=k.stride(0),
            block_stride=k_cache.stride(0), CACHE_BLOCK_SIZE=key.cache_block_size, USE_FNUZ=key.use_fnuz,
        )  # fmt: skip
        tokens = slot_mapping.shape[0]
        return warmreg.LaunchSpec(key, (tokens,) if tokens else None, kwargs, k_cache)


#: vLLM's writer: ``torch.finfo(e4m3fn).max``, or ``get_fp8_min_max()`` on a FNUZ platform (224, not 240).
WRITER_FP8_MAX = {False: 448.0, True: 224.0}
#: vLLM's writer floors each block's amax here before the scale.
AMAX_FLOOR = 1e-4


def quant_insert_k_reference(
    k: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor, *, block_size: int, use_fnuz: bool = False
) -> torch.Tensor:
    """PyTorch reference of :class:`QuantInsertKCache` (writes ``k_cache`` in place and returns it)."""
    fp8 = torch.float8_e4m3fnuz if use_fnuz else torch.float8_e4m3fn
    fp8_max = WRITER_FP8_MAX[use_fnuz]
    for t in range(slot_mapping.shape[0]):
        slot = int(slot_mapping[t])
        if slot < 0:
            continue
        page, j = k_cache[slot // block_size].view(-1), slot % block_size
        x = k[t, :NOPE_DIM].float().view(-1, QUANT_BLOCK)
        amax = x.abs().amax(dim=1)
        e, _ = pow2_scale_reference(amax.nan_to_num(posinf=0.0), AMAX_FLOOR, fp8_max)
        inf = amax.isinf()
        s = torch.where(inf, 255, (e + 127).clamp(0, 255))
        q = x * torch.where(inf, 0.0, torch.ldexp(torch.ones(s.shape), 127 - s))[:, None]
        # the GPU's clamp (max then min, NaN-ignoring) takes NaN (an infinity times 0) to -fp8_max
        q = torch.where(q.isnan(), -fp8_max, q.clamp(-fp8_max, fp8_max)).to(fp8)
        page[j * TOKEN_BYTES : j * TOKEN_BYTES + NOPE_DIM] = q.view(torch.uint8).reshape(-1)
        page[j * TOKEN_BYTES + NOPE_DIM : (j + 1) * TOKEN_BYTES] = k[t, NOPE_DIM:].contiguous().view(torch.uint8)
        scales = page[block_size * TOKEN_BYTES + j * SCALE_BYTES :][:SCALE_BYTES]
        scales[: NOPE_DIM // QUANT_BLOCK] = s.to(torch.uint8)
        scales[-1] = 0
    return k_cache


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the writer for the XPU SWA insert (CUDA and ROCm use a C++ op); nothing for another
    ``kv_cache_dtype``.

    :raises warmreg.ConfigError: if the model's head does not fit the layout (448 + 64).
    """
    if not uses_fp8_ds_mla(config, platform):
        return
    check_model_layout(model)
    swa = paged_caches(model, config)[0]
    registry.add(QuantInsertKCache(block_size=swa.block_size, page_strides=swa.page_strides), when=warmreg.is_xpu)
