"""The DeepSeek-V4.1 sweep's in-tree prefill K gathers on ROCm (vLLM 0.34 ``models/deepseek_v41/amd/rocm.py:
DeepseekV41ROCMAiterMLAAttention._forward_prefill``), called once a step by :func:`._sweep_v41_rocm.drive_rocm41`: a
step with prefill requests gathers them as one chunk into a bf16 workspace ``[prefills, N + max(gather lens), 512]``
for each layer kind: an SWA-only layer (``N = 0``) its SWA rows; a compressed layer (ratio 1 or 2) first its compressed
rows (``seq_lens // ratio`` from the compressed cache at ``256 // ratio`` tokens a page, ``gather_lens=None``,
``offset=0``, OCP bytes, ``max_gather_len=N``), then its SWA rows at ``offset=N`` (the chunk's gather lens, the SWA
cache at V4.1's 32 tokens a page, FNUZ bytes where the platform's FP8 is). The pages are random ``fp8_ds_mla`` records
without NaN codes; every launch is checked against :func:`.v41_rocm_gather_k.v41_rocm_gather_k_reference` (exact).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .fp8_ds_mla import HEAD_DIM, NOPE_DIM, TOKEN_BYTES
from .sweep_inputs import BF16, DSV4_PREFIX, I32, KV, U8, DSV4Step
from .v41_rocm_gather_k import RECORD_BYTES, v41_rocm_gather_k_reference

if TYPE_CHECKING:
    from .sweep_v41 import DSV41Sweep

__all__ = ["ROCM_GATHER_DRIVES", "drive_rocm_prefill_gather", "random_fp8_ds_mla_pages"]

GATHER = DSV4_PREFIX + "v41_rocm_gather_k_cache"
#: The kernels :func:`drive_rocm_prefill_gather` launches.
ROCM_GATHER_DRIVES = frozenset({GATHER})
_SWA_BLOCK = 32  # V4.1's sliding-window cache block (sweep_v41.SWA41)


def random_fp8_ds_mla_pages(
    pages: int, block_size: int, gen: torch.Generator, dev: torch.device, page_pad: int = 0
) -> torch.Tensor:
    """Random ``fp8_ds_mla`` pages ``[pages, block_size, 584]`` (a page stride ``page_pad`` bytes past the records):
    e4m3 bytes of either sign without the NaN codes of e4m3fn or e4m3fnuz (0x7F, 0xFF, 0x80), scales 2^-7..2^7, bf16
    RoPE values from a normal draw."""
    size, data = block_size * RECORD_BYTES, block_size * TOKEN_BYTES
    page = torch.randint(0, 256, (pages, size + page_pad), generator=gen, device=gen.device, dtype=U8)[:, :size]
    nope = page[:, :data].view(pages, block_size, TOKEN_BYTES)[:, :, :NOPE_DIM]
    nope[(nope & 0x7F) == 0x7F] = 0x7E
    nope[nope == 0x80] = 0
    rope = torch.randn(pages, block_size, HEAD_DIM - NOPE_DIM, generator=gen, device=gen.device).to(BF16)
    page[:, :data].view(pages, block_size, TOKEN_BYTES)[:, :, NOPE_DIM:] = rope.view(U8)
    page[:, data:] = torch.randint(120, 135, (pages, size - data), generator=gen, device=gen.device, dtype=U8)
    return page.view(pages, block_size, RECORD_BYTES).to(dev)


def drive_rocm_prefill_gather(s: DSV41Sweep, st: DSV4Step) -> None:
    """Each layer kind's gathers of the step's prefills (see the module docstring); nothing without prefills."""
    b = st.batch
    if GATHER not in s.names or not b.num_prefills:
        return
    a, e = b.num_decodes, len(b.qlens)
    glens, fnuz = torch.tensor(st.gather_host, dtype=I32, device=s.dev), s.plan.platform.fp8_fnuz
    seqs, swa_table = st.seq_lens[a:e], s.tables[_SWA_BLOCK][a:e]
    swa = random_fp8_ds_mla_pages(s.lim.num_blocks, _SWA_BLOCK, s.gen, s.dev, page_pad=64)
    for ratio in sorted({0, *s.ratios}):
        n = max(x // ratio for x in b.seqs[a:e]) if ratio else 0
        out = torch.zeros(e - a, n + max(st.gather_host), HEAD_DIM, dtype=BF16, device=s.dev)
        where = f"{'SWA-only' if not ratio else f'ratio {ratio}'} layer, {e - a} prefills, N={n}"
        if ratio:
            cache = random_fp8_ds_mla_pages(s.lim.num_blocks, KV // ratio, s.gen, s.dev)
            _launch(s, f"{where}, compressed cache", (out, cache, seqs // ratio, None, s.tables[KV][a:e]),
                    block_size=KV // ratio, max_gather_len=n)  # fmt: skip
        _launch(s, f"{where}, SWA cache", (out, swa, seqs, glens, swa_table), block_size=_SWA_BLOCK, offset=n,
                use_fnuz=fnuz)  # fmt: skip


def _launch(s: DSV41Sweep, where: str, args: tuple[Any, ...], **kw: Any) -> None:
    """One gather into the workspace ``args[0]``, checked against the reference on its first launch."""
    ref_kw = {k: v for k, v in kw.items() if k != "max_gather_len"}
    s.launch(
        GATHER, where, lambda: s.k("v41_rocm_gather_k_cache")(*args, **kw),
        ref=lambda: v41_rocm_gather_k_reference(*args, **ref_kw),
    )  # fmt: skip
