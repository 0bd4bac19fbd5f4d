"""RecoverSSM's align-mode postprocess: after the commit, each speculative request's running state column and its
neutral accepted count (vLLM 0.34 ``v1/worker/gpu/model_states/recoverssm.py``: ``RecoverSSMState.commit_step``,
``_postprocess_recoverssm_align_kernel``).

Math, per speculative request ``s < B`` (its batch row ``r = request_indices[s]`` in a mixed step, else ``r = s``),
with ``Bm`` the Mamba block size and ``W`` the block-table width::

    i = idx_mapping[r];  skip if i < 0
    state_idx[i]    = min(max(num_computed[r] + num_sampled[r] - 1, 0) // Bm, W - 1)
    num_accepted[i] = 1                     # the commit restored the accepted state: the next step copies nothing

Grid ``(B,)``, Triton's default four warps, as vLLM launches it.

Where it runs: the V2 runner's ``MambaHybridModelState.postprocess_state`` calls ``commit_step`` after every sampled
step; for each KV-cache group whose ``commit_recoverssm_state`` returned align metadata (``KimiK3KDAMetadata``: only
under ``mamba_cache_mode`` ``"align"``, prefix caching of the Mamba state), it launches this kernel with the batch's
``idx_mapping`` (int64), the sampler's int32 ``num_sampled``, the int32 speculative request indices (or None), the
int32 ``compute_num_computed_tokens()``, and the runner's int32 ``_mamba_state_idx_gpu`` and
``num_accepted_tokens_gpu``. ``mamba_cache_mode`` is not a warmreg setting, so no deployment plans this op
(:func:`register` registers nothing); it is here so that a plugin or engine that serves align mode can plan it.

Key: the six dtypes (request indices None when absent) and four warps. vLLM makes ``Bm`` and ``W`` constexprs; here
they are runtime integers, so one binary serves every block size and table width.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from .model import KimiK3

__all__ = ["AlignPostprocess", "AlignPostprocessKey", "align_postprocess_reference", "register"]

_POINTERS = ["idx_mapping_ptr", "sampled_ptr", "req_ptr", "computed_ptr", "state_idx_ptr", "accepted_ptr"]


@triton.jit(do_not_specialize=["block_size", "width"], do_not_specialize_on_alignment=_POINTERS)
def _align_postprocess_kernel(
    idx_mapping_ptr, sampled_ptr, req_ptr, computed_ptr,  # [rows] each (req: [>= B], read with HAS_REQ only)
    state_idx_ptr, accepted_ptr,  # [request slots]: written
    block_size, width,
    HAS_REQ: tl.constexpr,  # speculative request s is batch row req[s], else row s
):  # fmt: skip
    s = tl.program_id(0)
    r = s
    if HAS_REQ:
        r = tl.load(req_ptr + s)
    i = tl.load(idx_mapping_ptr + r)
    if i < 0:
        return
    end = tl.load(computed_ptr + r) + tl.load(sampled_ptr + r) - 1
    tl.store(state_idx_ptr + i, tl.minimum(tl.maximum(end, 0) // block_size, width - 1))
    tl.store(accepted_ptr + i, 1)


@attrs.frozen(kw_only=True)
class AlignPostprocessKey(warmreg.CompileKey):
    """What changes the binary of the align postprocess: the dtypes and the warps."""

    index_dtype: str  # idx_mapping
    sampled_dtype: str
    request_dtype: str | None  # None: every row of the step is speculative
    computed_dtype: str
    state_idx_dtype: str
    accepted_dtype: str
    num_warps: int


class AlignPostprocess(warmreg.TritonKernel[AlignPostprocessKey]):
    """The align-mode postprocess of RecoverSSM's commit step (the module docstring has the math and vLLM's call
    site).

    :param max_num_seqs: requests in a step (domains only).
    """

    name = "kimi_k3.recoverssm_align_postprocess"
    key_type = AlignPostprocessKey
    jit = _align_postprocess_kernel

    def __init__(self, *, max_num_seqs: int) -> None:
        self.max_num_seqs = max_num_seqs

    def dispatch(
        self, *, idx_mapping: torch.Tensor, num_sampled: torch.Tensor, request_indices: torch.Tensor | None,
        num_computed_tokens: torch.Tensor, state_indices: torch.Tensor, num_accepted_tokens: torch.Tensor,
    ) -> AlignPostprocessKey:  # fmt: skip
        return AlignPostprocessKey(
            index_dtype=warmreg.dtype_name(idx_mapping.dtype), sampled_dtype=warmreg.dtype_name(num_sampled.dtype),
            request_dtype=None if request_indices is None else warmreg.dtype_name(request_indices.dtype),
            computed_dtype=warmreg.dtype_name(num_computed_tokens.dtype),
            state_idx_dtype=warmreg.dtype_name(state_indices.dtype),
            accepted_dtype=warmreg.dtype_name(num_accepted_tokens.dtype), num_warps=4,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        """vLLM's tensors (module docstring): a step of speculative rows alone or mixed with prefills."""
        n = self.max_num_seqs

        def v(dtype: torch.dtype) -> torch.Tensor:
            return warmreg.meta((n,), dtype)

        return {
            "idx_mapping": [v(torch.int64)], "num_sampled": [v(torch.int32)],
            "request_indices": [None, v(torch.int32)], "num_computed_tokens": [v(torch.int32)],
            "state_indices": [v(torch.int32)], "num_accepted_tokens": [v(torch.int32)],
        }  # fmt: skip

    def warmup_inputs(self, key: AlignPostprocessKey) -> Mapping[str, Any]:
        def t(dtype: str | None) -> torch.Tensor | None:
            return None if dtype is None else warmreg.meta((1,), getattr(torch, dtype))

        return {
            "idx_mapping": t(key.index_dtype), "num_sampled": t(key.sampled_dtype),
            "request_indices": t(key.request_dtype), "num_computed_tokens": t(key.computed_dtype),
            "state_indices": t(key.state_idx_dtype), "num_accepted_tokens": t(key.accepted_dtype),
            "num_spec_decodes": 1, "mamba_block_size": 16, "block_table_width": 1,
        }  # fmt: skip

    @warmreg.kernel_launcher
    def __call__(
        self, idx_mapping: torch.Tensor, num_sampled: torch.Tensor, num_computed_tokens: torch.Tensor,
        state_indices: torch.Tensor, num_accepted_tokens: torch.Tensor, *, num_spec_decodes: int,
        mamba_block_size: int, block_table_width: int, request_indices: torch.Tensor | None = None,
    ) -> warmreg.LaunchSpec[AlignPostprocessKey]:  # fmt: skip
        """Write the running column and the count of each speculative request's slot (in place; returns None).

        :param idx_mapping: int ``[rows]``: batch row -> request slot (< 0: skipped).
        :param num_sampled: int ``[rows]``: the sampler's counts; ``num_computed_tokens`` int ``[rows]`` likewise.
        :param state_indices: int ``[slots]``: each request slot's running state column (written).
        :param num_accepted_tokens: int ``[slots]``: each request slot's accepted count (written).
        :param num_spec_decodes: ``B``, the speculative requests (the grid).
        :param mamba_block_size: ``Bm >= 1``; ``block_table_width``: ``W >= 1``.
        :param request_indices: int ``[>= B]``: the batch row of each speculative request, or None (row ``s``).
        :raises warmreg.LaunchError: for non-integer or non-contiguous vectors, too few rows, sizes below 1, or
            tensors on different devices.
        """
        rows = {"idx_mapping": idx_mapping, "num_sampled": num_sampled, "num_computed_tokens": num_computed_tokens,
                "request_indices": request_indices}  # fmt: skip
        batch = num_spec_decodes
        for name, t in {**rows, "state_indices": state_indices, "num_accepted_tokens": num_accepted_tokens}.items():
            if t is None:
                continue
            if (
                t.ndim != 1
                or t.dtype.is_floating_point
                or t.dtype == torch.bool
                or (t.stride(0) != 1 and t.numel() > 1)
            ):
                raise warmreg.LaunchError(self.name, f"{name} must be a contiguous 1-D integer tensor "
                                          f"(got {t.dtype} {tuple(t.shape)})")  # fmt: skip
            if t.device != idx_mapping.device:
                raise warmreg.LaunchError(self.name, f"{name} must be on {idx_mapping.device} (got {t.device})")
        # Batch rows: request_indices' first B values when given (rows the kernel cannot check), else 0..B-1.
        addressed = (
            (request_indices,) if request_indices is not None else (idx_mapping, num_sampled, num_computed_tokens)
        )
        if batch < 0 or any(t.shape[0] < batch for t in addressed if t is not None):
            raise warmreg.LaunchError(self.name, f"num_spec_decodes ({batch}) exceeds the rows given")
        if mamba_block_size < 1 or block_table_width < 1:
            raise warmreg.LaunchError(self.name, f"mamba_block_size ({mamba_block_size}) and block_table_width "
                                      f"({block_table_width}) must be >= 1")  # fmt: skip
        key = self.dispatch(idx_mapping=idx_mapping, num_sampled=num_sampled, request_indices=request_indices,
                            num_computed_tokens=num_computed_tokens, state_indices=state_indices,
                            num_accepted_tokens=num_accepted_tokens)  # fmt: skip
        kwargs = dict(
            idx_mapping_ptr=idx_mapping, sampled_ptr=num_sampled,
            req_ptr=idx_mapping if request_indices is None else request_indices, computed_ptr=num_computed_tokens,
            state_idx_ptr=state_indices, accepted_ptr=num_accepted_tokens, block_size=mamba_block_size,
            width=block_table_width, HAS_REQ=key.request_dtype is not None,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (batch,) if batch else None, kwargs, None)


def align_postprocess_reference(
    idx_mapping: torch.Tensor, num_sampled: torch.Tensor, num_computed_tokens: torch.Tensor,
    state_indices: torch.Tensor, num_accepted_tokens: torch.Tensor, *, num_spec_decodes: int,
    mamba_block_size: int, block_table_width: int, request_indices: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """PyTorch reference of :class:`AlignPostprocess`: writes ``state_indices`` and ``num_accepted_tokens``."""
    for s in range(num_spec_decodes):
        r = s if request_indices is None else int(request_indices[s])
        i = int(idx_mapping[r])
        if i < 0:
            continue
        end = int(num_computed_tokens[r]) + int(num_sampled[r]) - 1
        state_indices[i] = min(max(end, 0) // mamba_block_size, block_table_width - 1)
        num_accepted_tokens[i] = 1


def register(registry: warmreg.Registry, m: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register nothing: vLLM launches the postprocess only under ``mamba_cache_mode`` ``"align"`` (module
    docstring), which no warmreg setting expresses; a deployment that serves it registers :class:`AlignPostprocess`
    itself."""
