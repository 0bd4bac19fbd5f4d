"""DeepSeek-V4.1's compressor-state ring slots (vLLM 0.34 ``models/deepseek_v41/compressor.py``:
``_ring_slot_mapping_kernel``, launched by ``CompressorMetadataBuilder.build``).

A V4.1 ratio-2 compressor keeps each request's open group of ``[kv, score]`` rows in a ring of ``C`` rows, one
KV-cache block a request (``CompressorStateCache``: ``C = max(8, next_pow2(num_speculative_tokens + 2))``, the
group's block size). For token ``t`` of a step with ``A`` actual tokens, padded to ``T``::

    b = block_table[token_to_req[t], 0]
    slot[t] = b * C + pos[t] % C      if t < A and b != 0
    slot[t] = -1                      if t < A and b == 0 (the null block: a dummy or padding request), or t >= A

``slot`` is int64 ``[T]`` (a prefix of the builder's persistent buffer); ``block_table`` int32 ``[reqs, width]`` read
at column 0 through its row stride; ``token_to_req`` int32 and ``positions`` int64 ``[>= A]``. Grid
``(cdiv(T, 256),)``, 256 tokens a program, Triton's default four warps, as in vLLM.

Where it runs: every step of a V4.1 deployment with a ratio-2 kv-source layer (the only ones with a state cache),
once per compressor-state KV-cache group, on every platform (the builder is shared; this plugin plans V4.1 on CUDA).

Key: ``C`` and the tile (constexprs, as in vLLM) and the warps; ``T``, ``A`` and the row stride are
``do_not_specialize`` as in vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from .dspark import num_speculative_tokens
from .model import DSV4

__all__ = ["RingSlotMapping", "RingSlotMappingKey", "register", "ring_capacity", "ring_slot_mapping_reference"]

_BLOCK = 256
_NUM_WARPS = 4


def ring_capacity(num_speculative: int) -> int:
    """Rows of a request's compressor-state ring (``CompressorStateCache.block_size``): the drafts, the bonus token
    and the previous row, as a power of two >= 8."""
    return max(8, 1 << (num_speculative + 1).bit_length())


@triton.jit(do_not_specialize=["block_table_stride", "num_actual_tokens", "num_tokens"])
def _ring_slot_mapping_kernel(
    slot_ptr,  # int64 [T]
    block_table_ptr,  # int32 [reqs, width]
    block_table_stride,
    token_to_req_ptr,  # int32 [>= A]
    positions_ptr,  # int64 [>= A]
    num_actual_tokens,
    num_tokens,
    CAPACITY: tl.constexpr,  # ring rows a request: a serving constant
    BLOCK: tl.constexpr,  # tokens a program
):
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = t < num_actual_tokens
    req = tl.load(token_to_req_ptr + t, mask=live, other=0).to(tl.int64)
    block = tl.load(block_table_ptr + req * block_table_stride, mask=live, other=0)
    pos = tl.load(positions_ptr + t, mask=live, other=0)
    slot = block.to(tl.int64) * CAPACITY + pos % CAPACITY
    tl.store(slot_ptr + t, tl.where(live & (block != 0), slot, -1), mask=t < num_tokens)


@attrs.frozen(kw_only=True)
class RingSlotMappingKey(warmreg.CompileKey):
    """What changes the binary of the ring slots: the ring size, the tile and the warps."""

    capacity: int
    block: int
    num_warps: int


class RingSlotMapping(warmreg.TritonKernel[RingSlotMappingKey]):
    """Each token's compressor-state ring slot (the module docstring has the math).

    :param capacity: the ring's rows (:func:`ring_capacity`; domains only).
    """

    name = "deepseek_v4.v41_ring_slot_mapping"
    key_type = RingSlotMappingKey
    jit = _ring_slot_mapping_kernel

    def __init__(self, *, capacity: int) -> None:
        self.capacity = capacity

    def dispatch(self, *, capacity: int) -> RingSlotMappingKey:
        return RingSlotMappingKey(capacity=capacity, block=_BLOCK, num_warps=_NUM_WARPS)

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        return {"capacity": [self.capacity]}

    def warmup_inputs(self, key: RingSlotMappingKey) -> Mapping[str, Any]:
        return {
            "block_table": warmreg.meta((1, 1), torch.int32),
            "token_to_req": warmreg.meta((1,), torch.int32),
            "positions": warmreg.meta((1,), torch.int64),
            "num_actual_tokens": 1,
            "num_tokens": 1,
            "capacity": key.capacity,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        block_table: torch.Tensor,
        token_to_req: torch.Tensor,
        positions: torch.Tensor,
        *,
        num_actual_tokens: int,
        num_tokens: int,
        capacity: int,
        out: torch.Tensor | None = None,
    ) -> warmreg.LaunchSpec[RingSlotMappingKey]:
        """The int64 ``[num_tokens]`` ring slots (``out``, or a fresh tensor).

        :param block_table: int32 ``[reqs, width]``, unit column stride (the group's block table).
        :param token_to_req: int32 ``[>= num_actual_tokens]``, contiguous.
        :param positions: int64 ``[>= num_actual_tokens]``, contiguous.
        :param num_actual_tokens: the scheduled tokens; the rest up to ``num_tokens`` get -1.
        :param num_tokens: the padded step size (``>= num_actual_tokens``).
        :param capacity: the ring rows (``>= 1``).
        :param out: a buffer instead of a fresh one: exactly int64 ``[num_tokens]``, contiguous, 16-byte aligned.
        :raises warmreg.LaunchError: for inputs of another dtype or layout, too few entries, or bad sizes.
        """
        _check(self.name, block_table, token_to_req, positions, num_actual_tokens, num_tokens, capacity)
        key = self.dispatch(capacity=capacity)
        out = warmreg.output(self.name, "out", out, (num_tokens,), torch.int64, positions.device)
        kwargs = dict(
            slot_ptr=out, block_table_ptr=block_table, block_table_stride=block_table.stride(0),
            token_to_req_ptr=token_to_req, positions_ptr=positions, num_actual_tokens=num_actual_tokens,
            num_tokens=num_tokens, CAPACITY=key.capacity, BLOCK=key.block,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (triton.cdiv(num_tokens, key.block),) if num_tokens else None, kwargs, out)


def _check(
    name: str, block_table: torch.Tensor, token_to_req: torch.Tensor, positions: torch.Tensor, actual: int, tokens: int,
    capacity: int,
) -> None:  # fmt: skip
    """Raise :class:`warmreg.LaunchError` naming the argument the kernel cannot read as vLLM's builder passes it."""
    if (
        block_table.dtype != torch.int32
        or block_table.ndim != 2
        or block_table.shape[1] < 1
        or block_table.stride(1) != 1
    ):
        raise warmreg.LaunchError(
            name,
            f"block_table must be int32 [reqs, >= 1] with unit column stride (got "
            f"{block_table.dtype} {tuple(block_table.shape)}, stride {block_table.stride()})",
        )
    for arg, t, dtype in (("token_to_req", token_to_req, torch.int32), ("positions", positions, torch.int64)):
        if t.dtype != dtype or t.ndim != 1 or t.shape[0] < actual or (t.shape[0] > 1 and t.stride(0) != 1):
            raise warmreg.LaunchError(
                name, f"{arg} must be contiguous 1-D {dtype} of >= {actual} entries (got {t.dtype} {tuple(t.shape)})"
            )
    if not 0 <= actual <= tokens or capacity < 1:
        raise warmreg.LaunchError(
            name, f"need 0 <= num_actual_tokens ({actual}) <= num_tokens ({tokens}) and capacity ({capacity}) >= 1"
        )


def ring_slot_mapping_reference(
    block_table: torch.Tensor, token_to_req: torch.Tensor, positions: torch.Tensor, *, num_actual_tokens: int,
    num_tokens: int, capacity: int,
) -> torch.Tensor:  # fmt: skip
    """PyTorch reference of :class:`RingSlotMapping`: int64 ``[num_tokens]``."""
    a = num_actual_tokens
    block = block_table[token_to_req[:a].long(), 0].long()
    slot = torch.where(block != 0, block * capacity + positions[:a].long() % capacity, -1)
    out = torch.full((num_tokens,), -1, dtype=torch.int64, device=positions.device)
    out[:a] = slot
    return out


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the ring slots for a V4.1 deployment with a ratio-2 kv-source layer; the ring's rows from
    ``serving.num_speculative_tokens`` (:func:`ring_capacity`).

    :raises warmreg.ConfigError: for a malformed speculative setting.
    """
    used = model.v41 and 2 in model.v41_compressed_ratios
    capacity = ring_capacity(num_speculative_tokens(config)) if used else 8
    registry.add(RingSlotMapping(capacity=capacity), when=used)
