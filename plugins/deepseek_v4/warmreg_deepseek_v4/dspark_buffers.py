"""The DSpark draft step's persistent buffers (:class:`DraftInputs`), which
:class:`~warmreg_deepseek_v4.dspark_inputs.DSparkInputs` writes and its PyTorch reference updates: their fields,
dtypes and lengths."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

__all__ = ["DTYPES", "DraftInputs", "sizes"]


class DraftInputs(NamedTuple):
    """The draft step's persistent buffers the kernel writes (vLLM: the speculator's ``InputBuffers``, the
    group's slot-mapping row, the context and sample buffers, the sampling state)."""

    input_ids: torch.Tensor  # int32 [max_num_tokens]
    positions: torch.Tensor  # int64 [max_num_tokens]
    is_padding: torch.Tensor  # bool [max_num_tokens]
    query_start_loc: torch.Tensor  # int32 [max_num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [max_num_reqs]
    query_slot_mapping: torch.Tensor  # int64 [max_num_tokens]
    context_positions: torch.Tensor  # int64 [max_num_tokens]
    context_slot_mapping: torch.Tensor  # int64 [max_num_tokens]
    sample_indices: torch.Tensor  # int64 [max_num_reqs * N]
    sample_pos: torch.Tensor  # int64 [max_num_reqs * N]
    sample_idx_mapping: torch.Tensor  # int64 [max_num_reqs * N]
    temperature: torch.Tensor  # float32 [max_num_reqs]
    seeds: torch.Tensor  # int64 [max_num_reqs]

    @classmethod
    def zeros(cls, max_num_reqs: int, max_num_tokens: int, num_steps: int, device: Any = "cpu") -> DraftInputs:
        """Fresh buffers (zeros; the sample mapping -1, as the speculator allocates it)."""
        i32, i64 = torch.int32, torch.int64
        z = lambda n, dt: torch.zeros(n, dtype=dt, device=device)  # noqa: E731
        samples = max_num_reqs * num_steps
        return cls(
            z(max_num_tokens, i32), z(max_num_tokens, i64), z(max_num_tokens, torch.bool), z(max_num_reqs + 1, i32),
            z(max_num_reqs, i32), z(max_num_tokens, i64), z(max_num_tokens, i64), z(max_num_tokens, i64),
            z(samples, i64), z(samples, i64), torch.full((samples,), -1, dtype=i64, device=device),
            z(max_num_reqs, torch.float32), z(max_num_reqs, i64),
        )  # fmt: skip


_I32, _I64 = torch.int32, torch.int64
#: Each buffer's dtype, by field.
DTYPES = dict(
    zip(
        DraftInputs._fields,
        (_I32, _I64, torch.bool, _I32, _I32, _I64, _I64, _I64, _I64, _I64, _I64, torch.float32, _I64),
    )
)


def sizes(reqs: int, tokens: int, steps: int) -> tuple[int, ...]:
    """Lengths of the :class:`DraftInputs` buffers."""
    return (
        tokens,
        tokens,
        tokens,
        reqs + 1,
        reqs,
        tokens,
        tokens,
        tokens,
        reqs * steps,
        reqs * steps,
        reqs * steps,
        reqs,
        reqs,
    )
