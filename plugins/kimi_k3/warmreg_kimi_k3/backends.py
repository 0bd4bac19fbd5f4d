"""Which KDA kernels a Kimi-K3 deployment runs: vLLM's backend resolution, in one place for every op module.

vLLM's Kimi-K3 KDA layer (``vllm/models/kimi_k3/nvidia/kda.py: KimiK3DeltaAttention.__init__``) resolves three
backends once per layer, from ``additional_config`` (warmreg's ``serving.kda_prefill_backend`` and
``serving.kda_decode_backend``) and the layer's layout; every later launch follows the result:

* **prefill** (``resolve_kda_prefill_backend``): ``"flashkda"`` (CUDA C++), ``"flashinfer"`` (FlashInfer's
  ``recurrent_kda``) or ``"triton"`` (``chunk_kda_with_fused_gate``); on ROCm (``vllm/models/kimi_k3/amd/kda.py``)
  ``"gluon"``, ``"fused"`` (C++) or ``"triton"``. Every prefill backend still runs the Triton short convolution
  and gathers the initial states first: only the chunked recurrence differs.
* **decode** (``resolve_kda_decode_backend``): ``"native"`` (``ops.fused_kda_decode``: conv, gate, recurrence and
  output norm in one C++ kernel), ``"flashinfer"`` (FlashInfer's fused decode, the same fusion) or ``"triton"``
  (``causal_conv1d_update`` then ``fused_recurrent_kda_packed_decode``, then the gated RMSNorm).
* **speculative decode** (``resolve_kda_spec_decode_backend``, ``additional_config.kda_spec_decode_backend``, not a
  warmreg setting, so always its ``"auto"``): ``"flashinfer"`` (FlashInfer's packed fused kernel, for batches of
  speculative rows only) or ``"native"`` (``causal_conv1d_update`` with ``num_accepted_tokens`` then
  ``fused_recurrent_kda``, or under RecoverSSM the verify: :mod:`warmreg_kimi_k3.recoverssm`).

States: the conv state is in the model dtype (``mamba_cache_dtype`` ``auto``) and the recurrent state float32
(``mamba_ssm_cache_dtype`` ``auto``, ``MambaStateDtypeCalculator.kda_state_dtype``); neither cache dtype is a warmreg
setting.

The MLA layers' KV block size (:func:`kv_block_size`) is not the requested ``--block-size`` either: once the model is
loaded vLLM raises it until one attention page holds one KDA state page (``Platform.update_block_size_for_backend``,
``_align_hybrid_block_size``), and every later launch (the slot mapping's ``block_size`` among them) uses the raised
one. The vLLM checks that ask whether an optional C++ op was built (``torch.ops._C.fused_kda_decode``,
``vllm._flashkda_C``, ``torch.ops._C.fused_kda_chunk``) are taken as true; FlashInfer's kernels count as
present only with the target feature ``flashinfer`` (``cuda:100+flashinfer``), aiter's Gluon prefill only with
``aiter`` (``rocm:gfx950+aiter``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

import warmreg

from .model import PLUGIN, KimiK3, positive, tensor_parallel_size
from .recoverssm import use_recoverssm

__all__ = [
    "DECODE_BACKENDS",
    "FLASHINFER_DECODE_HEADS",
    "MLA_KERNEL_BLOCK_SIZES",
    "NATIVE_DECODE_HEADS",
    "PREFILL_BACKENDS",
    "RECURRENT_STATE_DTYPE",
    "ROCM_FUSED_DECODE_HEADS",
    "KDALayout",
    "kda_decode_backend",
    "kda_layout",
    "kda_prefill_backend",
    "kda_spec_decode_backend",
    "kda_state_page_bytes",
    "kv_block_size",
    "mla_token_bytes",
]

#: ``--kda-prefill-backend`` (``vllm/engine/arg_utils.py``): "flashkda" is CUDA-only, "fused" ROCm-only.
PREFILL_BACKENDS = ("auto", "triton", "flashkda", "flashinfer", "fused")
#: ``--kda-decode-backend`` (``vllm/engine/arg_utils.py``).
DECODE_BACKENDS = ("auto", "native", "flashinfer", "triton")
#: The recurrent state's dtype (``mamba_ssm_cache_dtype`` ``auto``).
RECURRENT_STATE_DTYPE = "float32"
#: Heads per rank ``ops.fused_kda_decode`` is built for (``is_fused_kda_decode_supported``).
NATIVE_DECODE_HEADS = (12, 24, 48, 96)
#: Heads per rank ROCm's HIP fused decode is built for (``amd/ops/kda_decode.py: SUPPORTED_NUM_HEADS``).
ROCM_FUSED_DECODE_HEADS = (12, 24, 48, 96)
#: Heads per rank FlashInfer's fused decode kernels take (``is_flashinfer_fused_kda_decode_supported``).
FLASHINFER_DECODE_HEADS = (12, 24, 32, 48, 96)
#: The only head dim and conv width the fused decode kernels and FlashKDA take.
_FUSED_HEAD_DIM, _FUSED_CONV_WIDTH = 128, 4


@attrs.frozen(kw_only=True)
class KDALayout:
    """What the KDA layers of one rank look like, as the backend checks and the KDA kernels read it.

    :param num_heads: KDA heads on one rank (``linear_attn_config.num_heads / tensor_parallel_size``).
    :param head_dim: ``linear_attn_config.head_dim`` (K = V).
    :param conv_width: ``linear_attn_config.short_conv_kernel_size``.
    :param lower_bound: ``linear_attn_config.gate_lower_bound``, or None (the softplus gate).
    :param tensor_parallel_size: ranks the heads are split over.
    :param num_speculative_tokens: draft tokens per step (0: no speculation).
    :param dtype: the activation dtype name (also the conv state's).
    """

    num_heads: int
    head_dim: int
    conv_width: int
    lower_bound: float | None
    tensor_parallel_size: int
    num_speculative_tokens: int
    dtype: str

    @property
    def projection_size(self) -> int:
        """Channels of each of q, k and v on one rank (``local_projection_size`` in vLLM)."""
        return self.num_heads * self.head_dim


def _linear_attn_int(config: warmreg.WarmConfig, name: str, value: Any) -> int:
    """A positive int of ``text.linear_attn_config`` (``value``, read by the caller), or a ConfigError naming it."""
    problem = positive(value) if value is not None else "is missing"
    if problem:
        raise warmreg.ConfigError(
            f"text.linear_attn_config.{name}", problem, plugin=PLUGIN, fix=f"correct it in {config.source}"
        )
    return int(value)


def _gate_lower_bound(config: warmreg.WarmConfig, value: Any) -> float | None:
    """``text.linear_attn_config.gate_lower_bound`` (``value``): None (absent or null: the softplus gate) or a
    float < 0, else a ConfigError naming it."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value < 0:
        raise warmreg.ConfigError(
            "text.linear_attn_config.gate_lower_bound",
            f"must be a number < 0 or null (got {value!r})",
            plugin=PLUGIN,
            fix=f"correct it in {config.source}",
        )
    return float(value)


def kda_layout(model: KimiK3, config: warmreg.WarmConfig) -> KDALayout | None:
    """The KDA layout of a deployment, or None when it has no KDA layers (no ``linear_attn_config`` or empty
    ``kda_layers``).

    Reads ``text.linear_attn_config.{kda_layers, num_heads, head_dim, short_conv_kernel_size, gate_lower_bound}``
    (vLLM reads the conv width as ``kda_config["short_conv_kernel_size"]``, so it is required), and
    ``serving.tensor_parallel_size`` / ``serving.num_speculative_tokens``.

    :raises warmreg.ConfigError: for a malformed ``linear_attn_config`` or a tensor-parallel size that does not
        divide the KDA head count.
    """
    linear = config.text.get("linear_attn_config")
    if linear is None:
        return None
    if not isinstance(linear, Mapping):
        raise warmreg.ConfigError(
            "text.linear_attn_config", f"must be an object (got {linear!r})", plugin=PLUGIN,
            fix=f"correct it in {config.source}",
        )  # fmt: skip
    if not linear.get("kda_layers"):
        return None
    heads = _linear_attn_int(config, "num_heads", linear.get("num_heads"))
    tp = tensor_parallel_size(config)
    if heads % tp:
        raise warmreg.ConfigError(
            "text.linear_attn_config.num_heads",
            f"({heads}) is not divisible by serving.tensor_parallel_size ({tp})",
            plugin=PLUGIN,
            fix="use a tensor-parallel size that divides the KDA head count",
        )
    return KDALayout(
        num_heads=heads // tp,
        head_dim=_linear_attn_int(config, "head_dim", linear.get("head_dim")),
        conv_width=_linear_attn_int(config, "short_conv_kernel_size", linear.get("short_conv_kernel_size")),
        lower_bound=_gate_lower_bound(config, linear.get("gate_lower_bound")),
        tensor_parallel_size=tp,
        num_speculative_tokens=config.get("serving.num_speculative_tokens", int, plugin=PLUGIN, default=0),
        dtype=model.dtype,
    )


def _refuse(field: str, problem: str) -> warmreg.ConfigError:
    return warmreg.ConfigError(
        f"serving.{field}", problem, plugin=PLUGIN, fix="pick auto, or a backend this layout and GPU support"
    )


def _cuda_family(platform: warmreg.Platform, *majors: int) -> bool:
    return platform.is_cuda and platform.sm // 10 in majors


def _setting(config: warmreg.WarmConfig, name: str, choices: tuple[str, ...]) -> str:
    return config.get(f"serving.{name}", str, plugin=PLUGIN, default="auto", choices=choices)


def kda_prefill_backend(model: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> str:
    """The KDA prefill backend vLLM resolves for this deployment: ``"flashkda"``, ``"flashinfer"`` or ``"triton"``
    on CUDA, ``"gluon"``, ``"fused"`` or ``"triton"`` on ROCm.

    CUDA (``vllm/models/kimi_k3/nvidia/kda.py: resolve_kda_prefill_backend``): FlashKDA needs SM 9.x, 10.x or 12.x,
    head_dim 128, bf16 activations, a bf16 or fp32 recurrent state and a gate lower bound; FlashInfer SM 10.0 or
    10.3, the same but a bf16 recurrent state (so never with the fp32 default), and FlashInfer installed.
    ``"auto"`` picks FlashKDA when it is supported, else Triton (never FlashInfer). ROCm
    (``vllm/models/kimi_k3/amd/kda.py: KimiK3DeltaAttention.__init__``): ``"auto"`` picks aiter's Gluon kernel on
    CDNA4 (gfx950) with an fp32 state, a lower bound and aiter, else ``"fused"`` on gfx950, else Triton.

    :raises warmreg.ConfigError: for an unknown ``serving.kda_prefill_backend``, or a backend vLLM refuses on this
        layout and platform (it fails to start there).
    """
    choice = _setting(config, "kda_prefill_backend", PREFILL_BACKENDS)
    has_flashinfer, has_aiter = warmreg.has_feature("flashinfer")(platform), warmreg.has_feature("aiter")(platform)
    layout = kda_layout(model, config)
    bounded = layout is not None and layout.lower_bound is not None
    if platform.is_rocm:
        if choice in ("flashkda", "flashinfer"):
            raise _refuse("kda_prefill_backend", f"{choice!r} is CUDA-only; ROCm takes auto, triton or fused")
        gfx950 = platform.arch == "gfx950"
        if choice == "fused" and not gfx950:
            raise _refuse("kda_prefill_backend", f"'fused' needs gfx950 (got {platform.arch})")
        if choice != "auto":
            return choice
        if gfx950 and bounded and RECURRENT_STATE_DTYPE == "float32" and has_aiter:
            return "gluon"
        return "fused" if gfx950 else "triton"
    if choice == "fused":
        raise _refuse("kda_prefill_backend", "'fused' is ROCm-only")
    shape_ok = layout is not None and layout.head_dim == _FUSED_HEAD_DIM and model.dtype == "bfloat16" and bounded
    flashkda = shape_ok and _cuda_family(platform, 9, 10, 12)
    flashinfer = (
        shape_ok and platform.is_cuda and platform.sm in (100, 103) and RECURRENT_STATE_DTYPE == "bfloat16"
        and has_flashinfer
    )  # fmt: skip
    if choice == "flashinfer" and not flashinfer:
        raise _refuse("kda_prefill_backend", "FlashInfer KDA prefill needs SM100/SM103, FlashInfer, bf16 activations "
                      "and recurrent state (warmreg assumes vLLM's default float32 state), head_dim 128, a gate bound")  # fmt: skip
    if choice == "flashkda" and not flashkda:
        raise _refuse("kda_prefill_backend", "FlashKDA needs SM90/SM10x/SM12x, bf16 activations, head_dim 128 and "
                      "linear_attn_config.gate_lower_bound")  # fmt: skip
    if choice == "flashinfer":
        return "flashinfer"
    return "flashkda" if flashkda and choice in ("auto", "flashkda") else "triton"


def kda_decode_backend(model: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> str:
    """The KDA decode backend vLLM resolves for this deployment: ``"native"``, ``"flashinfer"`` or ``"triton"``
    (and ``"aiter"`` on ROCm).

    CUDA (``vllm/models/kimi_k3/nvidia/kda.py: resolve_kda_decode_backend``): the native fused decode needs heads
    per rank in :data:`NATIVE_DECODE_HEADS`, head_dim 128, conv width 4, **no speculative tokens**, bf16
    activations and conv state, an fp32 recurrent state, and SM 9.0 or the SM 10.x / 12.x families; FlashInfer's
    fused decode the SM 10.x family, heads in :data:`FLASHINFER_DECODE_HEADS`, the same shapes, FlashInfer
    installed and the default (state-length, dim) conv-state layout. ``"auto"`` picks native when it is supported,
    else Triton (never FlashInfer), so with speculative decoding (``num_speculative_tokens > 0``) every backend
    but ``"triton"`` is refused and ``"auto"`` is Triton. ROCm (``vllm/models/kimi_k3/amd/kda.py:
    KimiK3DeltaAttention.__init__``) ignores the setting: ``"aiter"`` (aiter's Gluon decode, plain and speculative:
    ``is_kda_gluon_decode_available``, aiter on CDNA4, i.e. ``rocm:gfx950+aiter``), else ``"native"`` (the HIP fused
    decode, plain decodes only: :data:`ROCM_FUSED_DECODE_HEADS` heads per rank, head_dim 128, conv width 4, no
    speculative tokens, bf16, on gfx942 or gfx950), else ``"triton"``.

    :raises warmreg.ConfigError: for an unknown ``serving.kda_decode_backend``, or native / flashinfer where vLLM
        refuses them.
    """
    choice = _setting(config, "kda_decode_backend", DECODE_BACKENDS)
    has_flashinfer = warmreg.has_feature("flashinfer")(platform)  # first: the feature is known to plan either way
    has_aiter = warmreg.has_feature("aiter")(platform)
    layout = kda_layout(model, config)
    fusable = (
        layout is not None and layout.head_dim == _FUSED_HEAD_DIM and layout.conv_width == _FUSED_CONV_WIDTH
        and layout.num_speculative_tokens == 0 and model.dtype == "bfloat16"
    )  # fmt: skip
    if platform.is_rocm:
        if has_aiter and platform.arch == "gfx950" and RECURRENT_STATE_DTYPE == "float32":
            return "aiter"
        hip = fusable and layout is not None and layout.num_heads in ROCM_FUSED_DECODE_HEADS
        return "native" if hip and platform.arch in ("gfx942", "gfx950") else "triton"
    if choice == "triton" or not platform.is_cuda:
        return "triton"
    native = fusable and layout is not None and layout.num_heads in NATIVE_DECODE_HEADS
    native = native and (platform.sm == 90 or _cuda_family(platform, 10, 12))
    if choice in ("auto", "native") and native:
        return "native"
    if choice == "native":
        raise _refuse("kda_decode_backend", "native fused KDA decode needs SM90/SM10x/SM12x, bf16, heads per rank in "
                      f"{NATIVE_DECODE_HEADS}, head_dim 128, conv width 4 and no speculative tokens")  # fmt: skip
    flashinfer = fusable and layout is not None and layout.num_heads in FLASHINFER_DECODE_HEADS
    flashinfer = flashinfer and _cuda_family(platform, 10) and has_flashinfer
    if choice == "flashinfer" and not flashinfer:
        raise _refuse("kda_decode_backend", "FlashInfer fused KDA decode needs SM10x, FlashInfer, bf16, heads per rank "
                      f"in {FLASHINFER_DECODE_HEADS}, head_dim 128, conv width 4 and no speculative tokens")  # fmt: skip
    return "flashinfer" if choice == "flashinfer" else "triton"


def kda_spec_decode_backend(model: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> str:
    """The speculative-decode backend vLLM resolves with its default ``kda_spec_decode_backend`` ``"auto"``:
    ``"flashinfer"`` or ``"native"`` (``vllm/models/kimi_k3/nvidia/kda.py: resolve_kda_spec_decode_backend``).

    FlashInfer's packed fused kernel needs its API installed (target feature ``flashinfer``), the SM 10.x family,
    heads per rank in :data:`FLASHINFER_DECODE_HEADS`, head_dim 128, conv width 4, 1..7 speculative tokens, bf16,
    a gate lower bound, RecoverSSM off (``is_flashinfer_fused_kda_spec_decode_supported``: ``not use_recoverssm``;
    :func:`warmreg_kimi_k3.recoverssm.use_recoverssm`, ``serving.use_replayssm``) and the default conv-state layout.
    Even then it runs only for batches of speculative rows alone: a batch that mixes speculative rows with
    prefills takes the ``"native"`` path (Triton conv update and ``fused_recurrent_kda``), so both run in such a
    deployment. Under RecoverSSM ``"native"`` means the RecoverSSM verify for every speculative row. Without
    speculative tokens this is ``"native"`` and nothing launches for it. ROCm: ``"native"``.

    :raises warmreg.ConfigError: for an invalid ``serving.use_replayssm``
        (:func:`~warmreg_kimi_k3.recoverssm.use_recoverssm`).
    """
    has_flashinfer = warmreg.has_feature("flashinfer")(platform)
    layout = kda_layout(model, config)
    if use_recoverssm(config, layout):
        return "native"
    packed = (
        layout is not None and _cuda_family(platform, 10) and layout.num_heads in FLASHINFER_DECODE_HEADS
        and layout.head_dim == _FUSED_HEAD_DIM and layout.conv_width == _FUSED_CONV_WIDTH
        and 1 <= layout.num_speculative_tokens <= 7 and model.dtype == "bfloat16" and layout.lower_bound is not None
    )  # fmt: skip
    return "flashinfer" if packed and has_flashinfer else "native"


# -- the KV block size vLLM runs (vllm/platforms/interface.py: Platform.update_block_size_for_backend) --------------
#: The kernel block sizes of vLLM 0.33's MLA backends (``get_supported_kernel_block_sizes``): FlashMLA ``[64]``,
#: CUTLASS ``[128]``, FlashInfer ``[32, 64]``, Triton any multiple of 16 (each a size, or the base of a
#: ``MultipleOf``). The block size vLLM aligns to reads only these numbers of the backend.
MLA_KERNEL_BLOCK_SIZES: Mapping[str, tuple[int, ...]] = {
    "FLASHMLA": (64,),
    "CUTLASS_MLA": (128,),
    "FLASHINFER_MLA": (32, 64),
    "TRITON_MLA": (16,),
}
#: ``CacheConfig.DEFAULT_BLOCK_SIZE``: the block size vLLM starts from when ``--block-size`` is not given.
_DEFAULT_BLOCK_SIZE = 16
#: A hybrid MLA model's manager block is a multiple of 128 ("TRTLLM/FlashInfer MLA decode kernels require the
#: physical number of kernel blocks to be aligned to 128 / kernel_block_size", ``_align_hybrid_block_size``).
_HYBRID_MLA_BLOCK_ALIGNMENT = 128
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _model_itemsize(model: KimiK3) -> int:
    if model.dtype not in ("bfloat16", "float16", "float32"):
        raise warmreg.ConfigError(
            "serving.dtype", f"is {model.dtype!r}, not bfloat16, float16 or float32", plugin=PLUGIN
        )  # fmt: skip
    return _ITEMSIZE[model.dtype]


def mla_token_bytes(model: KimiK3, config: warmreg.WarmConfig) -> int:
    """Bytes one token takes in an MLA layer's KV page: ``(kv_lora_rank + qk_rope_head_dim) * itemsize`` of the KV
    cache dtype (vLLM's ``MLAAttentionSpec(block_size=1, num_kv_heads=1, head_size=...)``: ``auto`` is the model
    dtype, the FP8 names one byte).

    :raises warmreg.ConfigError: for a missing head size or a ``serving.kv_cache_dtype`` outside ``auto``,
        ``bfloat16``, ``float16``, ``fp8``, ``fp8_e4m3``, ``fp8_e5m2``.
    """
    choices = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")
    cache = config.get("serving.kv_cache_dtype", str, plugin=PLUGIN, default="auto", choices=choices)
    itemsize = _model_itemsize(model) if cache == "auto" else _ITEMSIZE[cache]
    head = config.get("text.kv_lora_rank", int, plugin=PLUGIN, check=positive) + config.get(
        "text.qk_rope_head_dim", int, plugin=PLUGIN, check=positive
    )
    return head * itemsize


def kda_state_page_bytes(layout: KDALayout) -> int:
    """Bytes of one request's KDA state page on a rank (vLLM's ``MambaSpec.page_size_bytes`` of
    ``MambaStateShapeCalculator.kda_state_shape`` and ``kda_state_dtype``): the conv state,
    ``(conv_width - 1 + num_speculative_tokens) * 3 * heads * head_dim`` values in the model dtype, plus the recurrent
    state, ``heads * head_dim * head_dim`` float32 values.

    :raises warmreg.ConfigError: for a ``serving.dtype`` other than bfloat16, float16 or float32.
    """
    conv = (layout.conv_width - 1 + layout.num_speculative_tokens) * 3 * layout.projection_size
    recurrent = layout.num_heads * layout.head_dim * layout.head_dim
    return conv * _model_itemsize(KimiK3(dtype=layout.dtype)) + recurrent * _ITEMSIZE[RECURRENT_STATE_DTYPE]


def kv_block_size(model: KimiK3, config: warmreg.WarmConfig) -> int:
    """The MLA layers' KV block size vLLM 0.33 runs: ``serving.block_size`` (``--block-size``; unset, the MLA
    backend's preferred size from 16) raised as ``Platform._align_hybrid_block_size`` raises it once the model is
    loaded, so that one attention page holds one KDA state page (:func:`kda_state_page_bytes`)::

        align = max(min(kernel sizes), block_size, 128)
        block = max(block_size, round_up(align * cdiv(state_page, align * token_bytes), lcm(min(kernel sizes))))

    (the state page is then padded to the attention page). Idempotent: the block size of a started engine maps to
    itself. Without KDA layers the model is not hybrid and the block size is the requested one. Assumed, as
    everywhere in this plugin: ``mamba_cache_dtype`` / ``mamba_ssm_cache_dtype`` ``auto`` (conv state in the model
    dtype, recurrent state float32) and one MLA backend for every MLA layer.

    :raises warmreg.ConfigError: naming ``serving.attention_backend`` when it is missing or not one of
        :data:`MLA_KERNEL_BLOCK_SIZES` (the kernel block sizes decide the alignment), or any field the sizes read.
    """
    requested = config.get("serving.block_size", int, plugin=PLUGIN, default=None, check=positive)
    layout = kda_layout(model, config)
    if layout is None and requested is not None:
        return requested
    backend = config.get(
        "serving.attention_backend", str, plugin=PLUGIN, choices=tuple(MLA_KERNEL_BLOCK_SIZES),
        fix="set serving.attention_backend to the MLA backend vLLM runs: its kernel block sizes decide the block size",
    )  # fmt: skip
    smallest = min(MLA_KERNEL_BLOCK_SIZES[backend])
    block = requested
    if block is None:  # Phase 1: the backend's preferred size (get_preferred_block_size(16))
        fits = any(_DEFAULT_BLOCK_SIZE % size == 0 for size in MLA_KERNEL_BLOCK_SIZES[backend])
        block = _DEFAULT_BLOCK_SIZE if fits else smallest
    if layout is None:
        return block
    align = max(smallest, block, _HYBRID_MLA_BLOCK_ALIGNMENT)
    raised = align * _cdiv(kda_state_page_bytes(layout), align * mla_token_bytes(model, config))
    raised = _cdiv(raised, smallest) * smallest  # a multiple of every backend's smallest kernel block (one backend)
    return max(block, raised)
