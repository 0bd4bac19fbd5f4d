"""ROCm aiter MegaMoE with the fused shared expert: the routes re-laid for the per-rank (routed + shared) experts and
a weight-1 route to the rank's shared slot appended (vLLM 0.34 ``models/deepseek_v4/amd/mega_moe.py``:
``_append_shared_expert_kernel``, launched by ``DeepseekV4AiterMegaMoEExperts.append_shared_expert``).

With the shared expert fused, every expert-parallel rank holds ``R = n_routed_experts / ep_size`` routed experts and
then its shared one, so global expert ``e`` of the router moves to ``e + e // R`` (one shared slot per earlier rank),
and each token gains a last route to its own rank's shared slot ``s = ep_rank * (R + 1) + R``. For token ``t < T``
and ``k < K`` (the router's top-k)::

    out_ids[t, k]     = ids[t, k] >= 0 ? ids[t, k] + ids[t, k] // R : ids[t, k]
    out_weights[t, k] = weights[t, k]
    out_ids[t, K]     = s
    out_weights[t, K] = 1.0

``ids`` int32 and ``weights`` float32 ``[T, K]`` (what ``fused_topk_bias`` returns; vLLM's ``.to(torch.float32)``
is then a no-op), the outputs contiguous ``[T, K + 1]`` of the same dtypes. Grid ``cdiv(T, 64)``, a program 64
tokens, as in vLLM; an empty batch launches nothing.

Where it runs: ``DeepseekV4AiterMegaMoEExperts.forward`` when ``fuse_shared_expert``, every MoE layer of every step
(the MTP and DSpark draft layers too: the same key). ``DeepseekV4MoE.__init__`` (``amd/model.py``) builds those
experts when ``kernel_config.moe_backend`` is ``aiter_mega_moe`` (``serving.moe_backend``), and
``_validate_aiter_mega_moe_config`` refuses it unless aiter's MoE is on (``rocm:gfx950+aiter``), experts are
expert-parallel (``serving.enable_expert_parallel``) at tensor-parallel size 1, the all-to-all is MoRI
(``serving.all2all_backend`` ``mori``, ``mori_high_throughput`` or ``mori_low_latency``) and the experts are FP4
(``expert_dtype``). It fuses the shared expert when the model has exactly one and
``resolve_layer_fused_shared_expert(..., moe_backend="aiter_mega_moe")`` holds: the environment variable
``VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS=1``, read here only from warmreg's ``serving.aiter_fusion_shared_experts``
(it is not in a ``VllmConfig``), with the shared experts requantized to MXFP4 (``--quantization-config`` targets;
vLLM refuses the fusion otherwise, so the setting means both). DeepSeek-V4.1's ROCm MoE sets ``use_mega_moe = False``
(``models/deepseek_v41/amd/model.py``): V4 only. The expert-parallel group is the data-parallel times the
tensor-parallel ranks (``serving.data_parallel_size``, TP 1), so ``R = n_routed_experts / data_parallel_size``.

Key: ``K`` and ``R`` (vLLM's constexprs ``TOPK`` and ``ROUTED_PER_RANK``), the 64-token tile and the warps. ``T``,
the shared slot and the input row strides are runtime ints (``do_not_specialize``: vLLM specializes the token count
and the rank's slot, one binary here serves every rank and batch), and no pointer is specialized on alignment.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._checks import out_parts
from .model import DSV4, PLUGIN

__all__ = ["MORI_BACKENDS", "RocmMegaMoeAppendShared", "RocmMegaMoeAppendSharedKey", "append_shared_expert_reference",
           "register"]  # fmt: skip

#: The all-to-all backends ``_validate_aiter_mega_moe_config`` accepts (MoRI EPv1 shmem).
MORI_BACKENDS = ("mori", "mori_high_throughput", "mori_low_latency")
_BLOCK_M = 64
_NUM_WARPS = 4


@triton.jit(
    do_not_specialize=["num_tokens", "shared_expert_id", "ids_stride", "weights_stride"],
    do_not_specialize_on_alignment=["ids_ptr", "weights_ptr", "out_ids_ptr", "out_weights_ptr"],
)
def _append_shared_expert_kernel(
    ids_ptr,
    weights_ptr,
    out_ids_ptr,
    out_weights_ptr,
    num_tokens,
    shared_expert_id,
    ids_stride,
    weights_stride,
    TOPK: tl.constexpr,  # the router's routes a token (num_experts_per_tok): unrolled
    ROUTED_PER_RANK: tl.constexpr,  # routed experts a rank: the divisor of the re-layout
    BLOCK_M: tl.constexpr,  # tokens a program
):
    t = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    live = t < num_tokens
    t64 = t.to(tl.int64)
    out_row = t64 * (TOPK + 1)
    for k in tl.static_range(TOPK):
        e = tl.load(ids_ptr + t64 * ids_stride + k, mask=live, other=0)
        w = tl.load(weights_ptr + t64 * weights_stride + k, mask=live, other=0.0)
        tl.store(out_ids_ptr + out_row + k, tl.where(e >= 0, e + e // ROUTED_PER_RANK, e), mask=live)
        tl.store(out_weights_ptr + out_row + k, w, mask=live)
    tl.store(out_ids_ptr + out_row + TOPK, tl.full([BLOCK_M], 0, tl.int32) + shared_expert_id, mask=live)
    tl.store(out_weights_ptr + out_row + TOPK, tl.full([BLOCK_M], 1.0, tl.float32), mask=live)


@attrs.frozen(kw_only=True)
class RocmMegaMoeAppendSharedKey(warmreg.CompileKey):
    """What changes the binary: the routes a token, the routed experts a rank, the token tile and the warps."""

    topk: int
    routed_per_rank: int
    block_m: int
    num_warps: int


class RocmMegaMoeAppendShared(warmreg.TritonKernel[RocmMegaMoeAppendSharedKey]):
    """Re-lay a token's routes for the fused shared expert and append its route; see the module docstring.

    :param topk: the router's routes a token (``num_experts_per_tok``; domains only).
    :param routed_per_rank: routed experts a rank (domains only).
    """

    name = "deepseek_v4.rocm_mega_moe_append_shared"
    key_type = RocmMegaMoeAppendSharedKey
    jit = _append_shared_expert_kernel

    def __init__(self, *, topk: int = 1, routed_per_rank: int = 1) -> None:
        self.topk, self.routed_per_rank = topk, routed_per_rank

    def dispatch(self, *, topk_ids: torch.Tensor, routed_per_rank: int) -> RocmMegaMoeAppendSharedKey:
        return RocmMegaMoeAppendSharedKey(
            topk=topk_ids.shape[-1], routed_per_rank=routed_per_rank, block_m=_BLOCK_M, num_warps=_NUM_WARPS
        )

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        return {"topk_ids": [warmreg.meta((1, self.topk), torch.int32)], "routed_per_rank": [self.routed_per_rank]}

    def warmup_inputs(self, key: RocmMegaMoeAppendSharedKey) -> Mapping[str, Any]:
        return {
            "topk_weights": warmreg.meta((1, key.topk), torch.float32),
            "topk_ids": warmreg.meta((1, key.topk), torch.int32),
            "routed_per_rank": key.routed_per_rank,
            "shared_expert_id": key.routed_per_rank,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        routed_per_rank: int,
        shared_expert_id: int,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> warmreg.LaunchSpec[RocmMegaMoeAppendSharedKey]:
        """``(out_weights, out_ids)``, ``[T, K + 1]`` each, as vLLM's ``append_shared_expert`` returns them.

        :param topk_weights: float32 ``[T, K]``, contiguous within a row (any row stride).
        :param topk_ids: int32 ``[T, K]``, contiguous within a row (any row stride); ``-1`` for no route.
        :param routed_per_rank: routed experts a rank (``n_routed_experts / ep_size``, ``> 0``).
        :param shared_expert_id: this rank's shared slot, ``ep_rank * (routed_per_rank + 1) + routed_per_rank``.
        :param out: the two outputs to write instead of fresh ones: exactly float32 and int32 ``[T, K + 1]``.
        :raises warmreg.LaunchError: for wrong dtypes, ranks, shapes or layouts, or an ``out`` unlike the fresh
            outputs.
        """
        self._check(topk_weights, topk_ids, routed_per_rank, shared_expert_id)
        rows, topk = topk_ids.shape
        out_weights, out_ids = out_parts(self.name, out, 2)
        device = topk_ids.device
        weights = warmreg.output(self.name, "out[0]", out_weights, (rows, topk + 1), torch.float32, device)
        ids = warmreg.output(self.name, "out[1]", out_ids, (rows, topk + 1), torch.int32, device)
        key = self.dispatch(topk_ids=topk_ids, routed_per_rank=routed_per_rank)
        kwargs = dict(
            ids_ptr=topk_ids, weights_ptr=topk_weights, out_ids_ptr=ids, out_weights_ptr=weights, num_tokens=rows,
            shared_expert_id=shared_expert_id, ids_stride=topk_ids.stride(0), weights_stride=topk_weights.stride(0),
            TOPK=key.topk, ROUTED_PER_RANK=key.routed_per_rank, BLOCK_M=key.block_m,
        )  # fmt: skip
        grid = (triton.cdiv(rows, key.block_m),) if rows else None
        return warmreg.LaunchSpec(key, grid, kwargs, (weights, ids))

    def _check(self, weights: torch.Tensor, ids: torch.Tensor, routed_per_rank: int, shared_expert_id: int) -> None:
        def rows_ok(t: torch.Tensor) -> bool:
            return t.ndim == 2 and (t.shape[1] <= 1 or t.stride(1) == 1)

        if ids.dtype != torch.int32 or not rows_ok(ids) or ids.shape[1] < 1:
            raise warmreg.LaunchError(self.name, f"topk_ids must be int32 [T, K >= 1] with contiguous rows (got "
                                      f"{ids.dtype} {tuple(ids.shape)}, strides {ids.stride()})")  # fmt: skip
        if weights.dtype != torch.float32 or not rows_ok(weights) or weights.shape != ids.shape:
            raise warmreg.LaunchError(self.name, f"topk_weights must be float32 {tuple(ids.shape)} with contiguous "
                                      f"rows (got {weights.dtype} {tuple(weights.shape)})")  # fmt: skip
        if weights.device != ids.device:
            raise warmreg.LaunchError(self.name, f"inputs on {weights.device} and {ids.device}: use one device")
        if routed_per_rank < 1 or not 0 <= shared_expert_id < 2**31:
            raise warmreg.LaunchError(self.name, f"routed_per_rank must be >= 1 (got {routed_per_rank}) and "
                                      f"shared_expert_id a non-negative int32 (got {shared_expert_id})")  # fmt: skip


def append_shared_expert_reference(
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, *, routed_per_rank: int, shared_expert_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of :class:`RocmMegaMoeAppendShared`: ``(float32, int32)`` ``[T, K + 1]``."""
    ids = topk_ids.long()
    moved = torch.where(ids >= 0, ids + torch.div(ids, routed_per_rank, rounding_mode="floor"), ids)
    rows = topk_ids.shape[0]
    shared = torch.full((rows, 1), shared_expert_id, dtype=torch.long, device=topk_ids.device)
    ones = torch.ones((rows, 1), dtype=torch.float32, device=topk_weights.device)
    return torch.cat([topk_weights.float(), ones], 1), torch.cat([moved, shared], 1).to(torch.int32)


def mega_moe_shared_fused(config: warmreg.WarmConfig, model: DSV4) -> bool:
    """Whether vLLM builds DeepSeek-V4's aiter MegaMoE experts with the fused shared expert (the module docstring
    lists the conditions; the target's own, gfx950 with aiter, are the predicate's).

    :raises warmreg.ConfigError: for a malformed setting or model field.
    """

    def serving(name: str, kind: type, default: Any) -> Any:
        return config.get(f"serving.{name}", kind, plugin=PLUGIN, default=default)

    return (
        not model.v41
        and serving("moe_backend", str, "auto") == "aiter_mega_moe"
        and serving("enable_expert_parallel", bool, False)
        and serving("tensor_parallel_size", int, 1) == 1
        and serving("all2all_backend", str, "allgather_reducescatter") in MORI_BACKENDS
        and serving("aiter_fusion_shared_experts", bool, False)
        and config.get("model.expert_dtype", str, plugin=PLUGIN, default="fp4") == "fp4"
        and config.get("model.n_shared_experts", int, plugin=PLUGIN, default=0) == 1
    )


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the shared-expert routes on ``rocm:gfx950+aiter`` where :func:`mega_moe_shared_fused` holds.

    :raises warmreg.ConfigError: for a malformed setting or model field, or ``n_routed_experts`` that the
        expert-parallel ranks do not divide.
    """
    when = warmreg.rocm_arch_in("gfx950") & warmreg.has_feature("aiter")  # names the feature on every target
    if not (platform.is_rocm and mega_moe_shared_fused(config, model)):
        return
    experts = config.get("model.n_routed_experts", int, plugin=PLUGIN)
    ranks = config.get("serving.data_parallel_size", int, plugin=PLUGIN, default=1)
    if experts < 1 or experts % ranks:
        raise warmreg.ConfigError(
            "serving.data_parallel_size", f"must divide model.n_routed_experts ({experts}) for expert-parallel "
            f"MegaMoE (got {ranks})", plugin=PLUGIN,
        )  # fmt: skip
    kernel = RocmMegaMoeAppendShared(
        topk=config.get("model.num_experts_per_tok", int, plugin=PLUGIN), routed_per_rank=experts // ranks
    )
    registry.add(kernel, when=when)
