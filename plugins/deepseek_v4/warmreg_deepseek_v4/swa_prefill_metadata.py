"""Sparse-SWA prefill metadata: the rows each prefill gathers for sparse-SWA attention (vLLM 0.33
``v1/attention/backends/mla/sparse_swa.py``: ``ComputePrefillMetadataKernel``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._checks import check_int32_vector
from ._serving import serving_int
from .model import DSV4

__all__ = [
    "SWAPrefillMetadataKey",
    "SparseSWAPrefillMetadata",
    "register",
    "sparse_swa_prefill_metadata_reference",
]

_I32 = torch.int32


@triton.jit(
    do_not_specialize=["num_decodes", "num_prefills", "window_size"],
    do_not_specialize_on_alignment=["seq_lens_ptr", "query_start_loc_ptr", "replay_start_ptr", "gather_lens_ptr"],
)
def _sparse_swa_prefill_metadata_kernel(
    seq_lens_ptr,
    query_start_loc_ptr,
    replay_start_ptr,
    gather_lens_ptr,
    num_decodes,
    num_prefills,
    window_size,
    BLOCK_SIZE: tl.constexpr,  # next_pow2(num_prefills): one program covers every prefill
):
    offs = tl.arange(0, BLOCK_SIZE)
    req = num_decodes + tl.minimum(offs, num_prefills - 1)  # clamped, not masked (SM12x workaround)
    qlen = tl.load(query_start_loc_ptr + req + 1) - tl.load(query_start_loc_ptr + req)
    prefix = tl.load(seq_lens_ptr + req) - qlen
    visible = tl.maximum(prefix - tl.load(replay_start_ptr + req), 0)
    tl.store(gather_lens_ptr + offs, qlen + tl.minimum(visible, window_size - 1), mask=offs < num_prefills)


@attrs.frozen(kw_only=True)
class SWAPrefillMetadataKey(warmreg.CompileKey):
    """What changes the binary of the sparse-SWA prefill metadata."""

    block_size: int  # next_pow2(num_prefills)
    num_warps: int


class SparseSWAPrefillMetadata(warmreg.TritonKernel[SWAPrefillMetadataKey]):
    """``gather_lens`` of the prefills of a decode-first batch. For prefill ``i``,
    request ``r = num_decodes + i``::

        qlen = qsl[r+1] - qsl[r];  prefix = seq_lens[r] - qlen
        gather_lens[i] = qlen + min(max(prefix - replay_start[r], 0), window_size - 1)

    Warm space: one binary per power of two up to ``min(max_num_seqs, max_num_batched_tokens)``.
    """

    name = "deepseek_v4.sparse_swa_prefill_metadata"
    key_type = SWAPrefillMetadataKey
    jit = _sparse_swa_prefill_metadata_kernel

    def dispatch(self, *, num_prefills: int) -> SWAPrefillMetadataKey:
        return SWAPrefillMetadataKey(block_size=warmreg.next_pow2(num_prefills), num_warps=4)

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        top = min(serving_int(config, "max_num_seqs"), serving_int(config, "max_num_batched_tokens"))
        return {"num_prefills": range(1, top + 1)}

    def warmup_inputs(self, key: SWAPrefillMetadataKey) -> Mapping[str, Any]:
        n = key.block_size
        return {
            "seq_lens": warmreg.meta((n,), _I32),
            "query_start_loc": warmreg.meta((n + 1,), _I32),
            "replay_start": warmreg.meta((n,), _I32),
            "num_decodes": 0,
            "num_prefills": n,
            "window_size": 128,
        }

    @warmreg.kernel_launcher
    def __call__(
        self,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        replay_start: torch.Tensor | None = None,
        *,
        num_decodes: int,
        num_prefills: int,
        window_size: int,
        out: torch.Tensor | None = None,
    ) -> warmreg.LaunchSpec[SWAPrefillMetadataKey]:
        """Returns ``gather_lens``, int32 ``[num_prefills]`` (fresh, or ``out``).

        :param seq_lens: int32 ``[>= num_reqs]``, context plus this step's tokens.
        :param query_start_loc: int32 ``[>= num_reqs + 1]``.
        :param replay_start: int32 ``[>= num_reqs]`` first position SWA may replay, or ``None`` (zeros, a fresh
            tensor: pass it to allocate nothing).
        :param out: ``gather_lens`` to write instead of a fresh one: exactly int32 ``[num_prefills]`` on
            ``seq_lens``' device, contiguous, 16-byte aligned.
        :raises LaunchError: for wrong dtypes, tensors shorter than ``num_decodes + num_prefills``, or an ``out``
            unlike the fresh output.
        """
        num_reqs = num_decodes + num_prefills
        if replay_start is None:
            replay_start = seq_lens.new_zeros(num_reqs)
        check_int32_vector(self.name, seq_lens=seq_lens, query_start_loc=query_start_loc, replay_start=replay_start)
        if min(num_decodes, num_prefills) < 0 or window_size < 1:
            raise warmreg.LaunchError(self.name, f"bad counts {num_decodes}/{num_prefills} or window {window_size}")
        if min(seq_lens.shape[0], replay_start.shape[0], query_start_loc.shape[0] - 1) < num_reqs:
            raise warmreg.LaunchError(
                self.name, f"seq_lens, replay_start or query_start_loc hold fewer than {num_reqs} requests"
            )
        key = self.dispatch(num_prefills=num_prefills)
        gather_lens = warmreg.output(self.name, "out", out, (num_prefills,), _I32, seq_lens.device)
        kwargs = dict(
            seq_lens_ptr=seq_lens, query_start_loc_ptr=query_start_loc, replay_start_ptr=replay_start,
            gather_lens_ptr=gather_lens, num_decodes=num_decodes, num_prefills=num_prefills,
            window_size=window_size, BLOCK_SIZE=key.block_size,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (1,) if num_prefills else None, kwargs, gather_lens)


def sparse_swa_prefill_metadata_reference(
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    replay_start: torch.Tensor | None,
    *,
    num_decodes: int,
    num_prefills: int,
    window_size: int,
) -> torch.Tensor:
    """PyTorch reference of :class:`SparseSWAPrefillMetadata`."""
    reqs = slice(num_decodes, num_decodes + num_prefills)
    qlen = query_start_loc[num_decodes + 1 : num_decodes + num_prefills + 1] - query_start_loc[reqs]
    replay = torch.zeros_like(qlen) if replay_start is None else replay_start[reqs]
    visible = (seq_lens[reqs] - qlen - replay).clamp(min=0)
    return (qlen + visible.clamp(max=window_size - 1)).to(_I32)


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the sparse-SWA prefill metadata: every DeepSeek-V4 deployment, every platform."""
    registry.add(SparseSWAPrefillMetadata())
