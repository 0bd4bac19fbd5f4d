"""The launch checks and PyTorch references of :mod:`.rocm_compress_two_stage`'s two stages (split out to keep that module short)."""

from __future__ import annotations

import torch

import warmreg

__all__ = ["check_ids", "check_scratch", "rocm_compress_finalize_reference", "rocm_compress_gather_reference"]

_HEAD, _ROPE, _QB, _TOKEN, _SCALE, _RATIO = 512, 64, 64, 576, 8, 128
_NOPE = _HEAD - _ROPE


def _closing(positions: torch.Tensor, slot_mapping: torch.Tensor) -> list[int]:
    return [
        t for t in range(slot_mapping.shape[0]) if int(slot_mapping[t]) >= 0 and (int(positions[t]) + 1) % _RATIO == 0
    ]


def rocm_compress_gather_reference(
    state_cache: torch.Tensor, token_to_req_indices: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
    block_table: torch.Tensor, scratch: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """PyTorch reference of :class:`RocmCompressGatherSplit` (any split count): a copy of ``scratch`` with the
    closing rows' pooled windows written."""
    out, bs = scratch.clone(), state_cache.shape[1]
    for t in _closing(positions, slot_mapping):
        pos, req = int(positions[t]), int(token_to_req_indices[t])
        rows = torch.stack([state_cache[int(block_table[req, p // bs]), p % bs] for p in range(pos - _RATIO + 1, pos + 1)
                            if p >= 0])  # fmt: skip
        out[t] = (rows[:, :_HEAD] * torch.softmax(rows[:, _HEAD:], dim=0)).sum(0)
    return out


def rocm_compress_finalize_reference(
    scratch: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, norm_weight: torch.Tensor,
    cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor, kv_slot_mapping: torch.Tensor, eps: float, *,
    sanitize_nans: bool = False,
) -> torch.Tensor:  # fmt: skip
    """PyTorch reference of :class:`RocmCompressFinalize`: a copy of ``kv_cache``'s pages (uint8
    ``[pages, page_stride]``) with the entries written (bf16 and e4m3fn rounded to nearest even)."""
    f32, bs = torch.float32, kv_cache.shape[1]
    pages = torch.as_strided(kv_cache, (kv_cache.shape[0], kv_cache.stride(0)), (kv_cache.stride(0), 1)).clone()
    for t in _closing(positions, slot_mapping):
        if int(kv_slot_mapping[t]) < 0:
            continue
        c, pos = scratch[t].to(f32), int(positions[t])
        n = c * torch.rsqrt((c * c).sum() / _HEAD + eps) * norm_weight.to(f32)
        x = n.to(torch.bfloat16).to(f32).reshape(-1, _QB)
        e = torch.ceil(torch.log2(x.abs().amax(1).clamp_min(1e-4) / 448.0))
        codes = (x * torch.exp2(-e)[:, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
        pairs, cs = n.reshape(-1, 2)[_NOPE // 2 :], cos_sin_cache[(pos // _RATIO) * _RATIO].to(f32)
        cos, sin = cs[: _ROPE // 2], cs[_ROPE // 2 :]
        rope = torch.stack([pairs[:, 0] * cos - pairs[:, 1] * sin, pairs[:, 1] * cos + pairs[:, 0] * sin], 1)
        rope = rope.reshape(-1).to(torch.bfloat16)
        if sanitize_nans:
            rope = torch.nan_to_num(rope, nan=0.0)
        page, j = divmod(int(kv_slot_mapping[t]), bs)
        pages[page, j * _TOKEN : j * _TOKEN + _NOPE] = codes.reshape(-1)[:_NOPE]
        pages[page, j * _TOKEN + _NOPE : (j + 1) * _TOKEN] = rope.view(torch.uint8)
        scales = (e[: _NOPE // _QB] + 127).clamp(0, 254 if sanitize_nans else 255).to(torch.uint8)
        pages[page, bs * _TOKEN + j * _SCALE : bs * _TOKEN + (j + 1) * _SCALE] = torch.cat(
            [scales, scales.new_zeros(1)]
        )
    return pages


def check_ids(name: str, positions: torch.Tensor, slots: torch.Tensor, **more: torch.Tensor) -> int:
    """The row count ``S`` (``slot_mapping``'s length), after checking the step's id vectors."""
    s = slots.shape[0] if slots.ndim == 1 else -1
    problems = []
    if slots.dtype != torch.int64 or s < 0:
        problems.append(f"slot_mapping must be int64 [S] (got {slots.dtype} {tuple(slots.shape)})")
    for n, ids in {"positions": positions, **more}.items():
        dtype = torch.int32 if n == "token_to_req_indices" else torch.int64
        if ids.dtype != dtype or ids.ndim != 1 or ids.shape[0] < s or (ids.shape[0] > 1 and ids.stride(0) != 1):
            problems.append(f"{n} must be contiguous {dtype} [>= {s}] (got {ids.dtype} {tuple(ids.shape)})")
    if problems:
        raise warmreg.LaunchError(name, "; ".join(problems))
    return s


def check_scratch(name: str, scratch: torch.Tensor, s: int) -> None:
    """Check the float32 ``[>= s, 512]`` scratch with contiguous rows."""
    if scratch.dtype != torch.float32 or scratch.ndim != 2 or scratch.shape[0] < s or scratch.shape[1] != _HEAD or (
        scratch.stride(1) != 1
    ):  # fmt: skip
        raise warmreg.LaunchError(name, f"scratch must be float32 [>= {s}, {_HEAD}] with contiguous rows (got "
                                  f"{scratch.dtype} {tuple(scratch.shape)})")  # fmt: skip
