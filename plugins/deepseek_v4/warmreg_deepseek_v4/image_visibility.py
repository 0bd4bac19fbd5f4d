"""In-image visibility of a vision checkpoint's prefill tokens (vLLM 0.34 ``v1/attention/backends/mla/sparse_swa.py``:
``_compute_image_visibility_kernel``, launched by ``DeepseekSparseSWAMetadataBuilder._build_image_visibility``).

A vision checkpoint's image spans are attended bidirectionally: a token inside a span sees, besides its causal
sliding window, the span's tokens to its left and right. The builder uploads each request's spans as a CSR
(``span_indptr [R + 1]``, inclusive positions ``span_starts`` / ``span_ends``) and this kernel counts, for each
prefill token, the extra tokens it sees. For token ``t = token_offset + i`` (``i < num_tokens``), its request
``r = token_to_req[t]`` and position ``pos = seq_lens[r] - (qsl[r + 1] - qsl[r]) + t - qsl[r]``, with
``M = max_image_tokens``::

    for each span s of r, in order, with start <= pos <= end:     (the last such span wins)
        left[t]  = min(pos - start, M - 1)
        right[t] = min(end - pos, M)
    left[t] = right[t] = 0 where no span holds pos

Both outputs are int32, indexed by absolute (decode-first) token: the kernel writes ``[token_offset, token_offset
+ num_tokens)`` only (vLLM's persistent ``left_visible`` / ``right_visible`` buffers, of which the builder hands
``[:token_offset + num_tokens]`` to the SWA-indices kernels). Grid ``(num_tokens,)``, one program a token.

Where it runs: the sparse-SWA metadata builder of a vision checkpoint (``max_image_tokens``: the config's
``vision_max_n_token`` when ``vision_n_layers > 0``, else 0 and nothing runs), on a step with prefill tokens and
image spans, on every platform (the builder is shared). A batch without spans never launches it, but any
deployment of a vision checkpoint can see one, so it is registered whenever the checkpoint is one.

Key: nothing but the warps. ``M``, ``token_offset``, the sizes and the span counts are runtime integers that are
not specialized (vLLM specializes ``M``), and no pointer is specialized on alignment (each program reads scalars).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from ._checks import check_int32_vector, out_parts
from .model import DSV4

__all__ = ["ImageVisibility", "ImageVisibilityKey", "image_visibility_reference", "register"]

_PTRS = [
    "span_indptr_ptr", "span_starts_ptr", "span_ends_ptr", "query_start_loc_ptr", "seq_lens_ptr", "token_to_req_ptr",
    "left_ptr", "right_ptr",
]  # fmt: skip


@triton.jit(do_not_specialize=["max_image_tokens", "token_offset"], do_not_specialize_on_alignment=_PTRS)
def _image_visibility_kernel(
    span_indptr_ptr,  # [R + 1]
    span_starts_ptr,
    span_ends_ptr,
    query_start_loc_ptr,  # [R + 1]
    seq_lens_ptr,  # [R]
    token_to_req_ptr,  # [>= token_offset + num_tokens]
    left_ptr,  # [>= token_offset + num_tokens]
    right_ptr,
    max_image_tokens,
    token_offset,
):
    t = tl.program_id(0) + token_offset
    r = tl.load(token_to_req_ptr + t)
    q0 = tl.load(query_start_loc_ptr + r)
    q1 = tl.load(query_start_loc_ptr + r + 1)
    pos = tl.load(seq_lens_ptr + r) - (q1 - q0) + (t - q0)
    left = tl.zeros((), dtype=tl.int32)
    right = tl.zeros((), dtype=tl.int32)
    s = tl.load(span_indptr_ptr + r)
    last = tl.load(span_indptr_ptr + r + 1)
    while s < last:  # a runtime bound: a while loop (see warmreg_deepseek_v4.sparse_mla)
        start = tl.load(span_starts_ptr + s)
        end = tl.load(span_ends_ptr + s)
        inside = (start <= pos) & (pos <= end)
        left = tl.where(inside, tl.minimum(pos - start, max_image_tokens - 1), left)
        right = tl.where(inside, tl.minimum(end - pos, max_image_tokens), right)
        s += 1
    tl.store(left_ptr + t, left)
    tl.store(right_ptr + t, right)


@attrs.frozen(kw_only=True)
class ImageVisibilityKey(warmreg.CompileKey):
    """What changes the binary of the image visibility: every size, offset and pointer is unspecialized."""

    num_warps: int


class ImageVisibility(warmreg.TritonKernel[ImageVisibilityKey]):
    """Extra visible tokens left and right of each prefill token inside an image span (module docstring)."""

    name = "deepseek_v4.image_visibility"
    key_type = ImageVisibilityKey
    jit = _image_visibility_kernel

    def dispatch(self) -> ImageVisibilityKey:
        return ImageVisibilityKey(num_warps=4)

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        return {}

    def warmup_inputs(self, key: ImageVisibilityKey) -> Mapping[str, Any]:
        one, two = warmreg.meta((1,), torch.int32), warmreg.meta((2,), torch.int32)
        return {
            "span_indptr": two, "span_starts": one, "span_ends": one, "query_start_loc": two, "seq_lens": one,
            "token_to_req": one, "num_tokens": 1, "max_image_tokens": 1024,
        }  # fmt: skip

    @warmreg.kernel_launcher
    def __call__(
        self,
        span_indptr: torch.Tensor,
        span_starts: torch.Tensor,
        span_ends: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        token_to_req: torch.Tensor,
        *,
        num_tokens: int,
        max_image_tokens: int,
        token_offset: int = 0,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> warmreg.LaunchSpec[ImageVisibilityKey]:
        """``(left, right)``, int32 ``[token_offset + num_tokens]`` each (fresh, or ``out``), of which the kernel
        writes ``[token_offset, token_offset + num_tokens)``; the rows before are left as they are.

        :param span_indptr: int32 ``[>= R + 1]``: request ``r``'s spans are ``[span_indptr[r], span_indptr[r + 1])``.
        :param span_starts: int32, each span's first position; ``span_ends`` its last (inclusive).
        :param query_start_loc: int32 ``[>= R + 1]``; ``seq_lens`` int32 ``[>= R]``.
        :param token_to_req: int32 ``[>= token_offset + num_tokens]``.
        :param num_tokens: the prefill tokens (the grid); ``token_offset`` the decode tokens before them.
        :param max_image_tokens: the checkpoint's ``vision_max_n_token`` (``>= 1``).
        :param out: the two buffers to write instead of fresh ones: exactly int32 ``[token_offset + num_tokens]``,
            contiguous, 16-byte aligned (vLLM's ``left_visible[:end]`` and ``right_visible[:end]``).
        :raises warmreg.LaunchError: for inputs that are not contiguous 1-D int32, too short a ``token_to_req``,
            a negative size, ``max_image_tokens < 1``, or an ``out`` unlike the fresh outputs.
        """
        check_int32_vector(
            self.name, span_indptr=span_indptr, span_starts=span_starts, span_ends=span_ends,
            query_start_loc=query_start_loc, seq_lens=seq_lens, token_to_req=token_to_req,
        )  # fmt: skip
        end = token_offset + num_tokens
        if num_tokens < 0 or token_offset < 0 or token_to_req.shape[0] < end:
            raise warmreg.LaunchError(
                self.name,
                f"token_to_req ({token_to_req.shape[0]} tokens) must cover tokens [{token_offset}, {end}) "
                "with num_tokens and token_offset >= 0",
            )
        if max_image_tokens < 1:
            raise warmreg.LaunchError(self.name, f"max_image_tokens must be >= 1 (got {max_image_tokens})")
        key = self.dispatch()
        out_left, out_right = out_parts(self.name, out, 2)
        device = token_to_req.device
        left = warmreg.output(self.name, "out[0]", out_left, (end,), torch.int32, device)
        right = warmreg.output(self.name, "out[1]", out_right, (end,), torch.int32, device)
        kwargs = dict(
            span_indptr_ptr=span_indptr, span_starts_ptr=span_starts, span_ends_ptr=span_ends,
            query_start_loc_ptr=query_start_loc, seq_lens_ptr=seq_lens, token_to_req_ptr=token_to_req,
            left_ptr=left, right_ptr=right, max_image_tokens=max_image_tokens, token_offset=token_offset,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (num_tokens,) if num_tokens else None, kwargs, (left, right))


def image_visibility_reference(
    span_indptr: torch.Tensor,
    span_starts: torch.Tensor,
    span_ends: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    token_to_req: torch.Tensor,
    *,
    num_tokens: int,
    max_image_tokens: int,
    token_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of :class:`ImageVisibility`: ``(left, right)`` int32 ``[num_tokens]``, the rows
    ``[token_offset, token_offset + num_tokens)`` of the op's outputs."""
    t = torch.arange(token_offset, token_offset + num_tokens, device=token_to_req.device)
    r = token_to_req[t].long()
    q0, q1 = query_start_loc.long()[r], query_start_loc.long()[r + 1]
    pos = seq_lens.long()[r] - (q1 - q0) + (t - q0)
    left, right = torch.zeros_like(pos), torch.zeros_like(pos)
    indptr, starts, ends = span_indptr.long(), span_starts.long(), span_ends.long()
    for i in range(num_tokens):  # the spans in order: the last one holding pos wins
        for s in range(int(indptr[r[i]]), int(indptr[r[i] + 1])):
            if starts[s] <= pos[i] <= ends[s]:
                left[i] = min(int(pos[i] - starts[s]), max_image_tokens - 1)
                right[i] = min(int(ends[s] - pos[i]), max_image_tokens)
    return left.to(torch.int32), right.to(torch.int32)


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the image visibility on every platform for a vision checkpoint (:attr:`DSV4.image_tokens` > 0,
    vLLM 0.34's ``max_image_tokens > 0``)."""
    registry.add(ImageVisibility(), when=model.image_tokens > 0)
