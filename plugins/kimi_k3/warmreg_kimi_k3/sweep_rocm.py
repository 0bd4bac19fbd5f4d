"""The Kimi-K3 sweep's ROCm-only launches: what vLLM's ROCm layers add to a step.

Part of the sweep driver (:mod:`warmreg_kimi_k3.sweep`), never imported by registration. On ROCm the KDA metadata
builder (``KimiK3ROCmKDAMetadataBuilder``) builds the chunked prefill's chunk metadata on the device
(:mod:`warmreg_kimi_k3.rocm_chunk_metadata`) on every step with prefills, from the prefill requests' query start
offsets rebased past the decodes; and where the KDA decode backend is Triton, a batch of plain one-token decodes
runs the packed decode step (:mod:`warmreg_kimi_k3.kda_packed_decode`) on the conv update's fresh ``[B, 3P]`` output;
the KDA recurrent step (:mod:`warmreg_kimi_k3.rocm_kda_recurrent`) runs the speculative rows of a step and the plain
decodes a mixed batch peels off before its prefills.
"""

from __future__ import annotations

from typing import Any

import torch

from warmreg.testing.sweep import Step

from .causal_conv1d import projection_row_stride
from .kda import kda_recurrent_reference
from .kda_packed_decode import kda_packed_decode_reference
from .rocm_chunk_metadata import rocm_chunk_metadata_reference

__all__ = [
    "KDA_PACKED", "ROCM_CHUNK_METADATA", "ROCM_RECURRENT", "rocm_chunk_metadata_step", "rocm_packed_decode_step",
    "rocm_recurrent_step",
]  # fmt: skip

ROCM_CHUNK_METADATA = "kimi_k3.rocm_chunk_metadata"
KDA_PACKED = "kimi_k3.kda_packed_decode"
ROCM_RECURRENT = "kimi_k3.rocm_kda_recurrent"


def rocm_chunk_metadata_step(sweep: Any, st: Step) -> None:
    """The builder's chunk metadata of the step's prefill requests (decode-first: their starts past the decodes,
    rebased to 0, a fresh tensor, and its host copy), checked exactly against the reference.

    :param sweep: the running :class:`~warmreg_kimi_k3.sweep.KimiSweep` (its plan kernels and ``launch``).
    :param st: the step.
    """
    b = st.batch
    if not b.num_prefills:
        return
    nd = b.num_decodes
    cu = st.qsl[nd:] - st.qsl[nd]
    cu_cpu = cu.cpu()
    kernel = sweep.kernel(ROCM_CHUNK_METADATA)
    sweep.launch(
        ROCM_CHUNK_METADATA,
        f"{b.num_prefills} prefills",
        lambda: kernel(cu, cu_cpu),
        ref=lambda: rocm_chunk_metadata_reference(cu),
    )


def rocm_packed_decode_step(sweep: Any, st: Step) -> None:
    """A pure plain-decode batch (one-token rows, no prefill) on ROCm: the packed decode on the conv update's fresh
    ``[B, 3P]`` output, the gate projection's rows, beta a column of the packed projection, each request's conv
    state line as its state slot (now and then the null slot 0: zeros out), checked against the reference.

    :param sweep: the running :class:`~warmreg_kimi_k3.sweep.KimiSweep` (its state pool, gate and ``launch``).
    :param st: the step.
    """
    b = st.batch
    if b.num_prefills or not all(q == 1 for q in b.qlens):
        return
    kernel = sweep.kernel(KDA_PACKED)
    lay, (h, dk, _), t = kernel.layout, sweep.hkv, b.tokens
    p = lay.projection_size
    mixed = sweep.randn(t, 3 * p)
    raw_g = sweep.randn(1, t, h, dk, dtype=sweep.raw_dtypes[0])
    raw_beta = sweep.randn(t, projection_row_stride(lay))[:, 4 * p + dk : 4 * p + dk + h].unsqueeze(0)
    slots = torch.randperm(sweep.pool.shape[0] - 1, generator=sweep.gen, device=sweep.dev)[:t].add_(1).to(torch.int32)
    if sweep.rng.random() < 0.1:
        slots[-1] = 0  # CUDA-graph padding: the null slot
    a_log, dt_bias, bound = sweep.gate
    bias = dt_bias if dt_bias is not None else torch.zeros(h * dk, dtype=torch.float32, device=sweep.dev)
    args = (mixed, raw_g, raw_beta, a_log, bias, bound, sweep.pool, slots)
    sweep.launch(
        KDA_PACKED,
        f"{t} plain decode rows",
        lambda: kernel(*args),
        ref=lambda: kda_packed_decode_reference(*args)[0],
        tol=(1e-2, 1.6e-2),  # the plugin's tests: bf16 o, fp32 recurrences in different orders
    )


def rocm_recurrent_step(sweep: Any, st: Step) -> None:
    """ROCm's KDA recurrent step: with speculation over the step's decode requests (``[N, 1 + spec]`` distinct state
    slots, accepted counts, the uniform length when every request has the same, now and then left out), and on a
    step with prefills over its plain decodes (at least one: 1-D slots, one token each), q/k/v column slices of a
    ``[T, 3P]`` conv output, checked against the reference.

    :param sweep: the running :class:`~warmreg_kimi_k3.sweep.KimiSweep` (its generator, device and ``launch``).
    :param st: the step.
    """
    b, kernel, spec = st.batch, sweep.kernel(ROCM_RECURRENT), sweep.lim.spec
    if spec and b.num_decodes:
        lens = list(b.qlens[: b.num_decodes])
        uniform = lens[0] if len(set(lens)) == 1 and sweep.rng.random() < 0.8 else None
        _recurrent(sweep, kernel, lens, spec=True, uniform=uniform)
    if b.num_prefills:
        _recurrent(sweep, kernel, [1] * max(1, b.num_decodes), spec=False, uniform=None)


def _recurrent(sweep: Any, kernel: Any, lens: list[int], *, spec: bool, uniform: int | None) -> None:
    h, kd, vd, cols = kernel.num_heads, kernel.head_k_dim, kernel.head_v_dim, 1 + sweep.lim.spec
    n, t, dev, gen = len(lens), sum(lens), sweep.dev, sweep.gen
    conv = sweep.randn(t, h * (2 * kd + vd))
    q, k, v = (conv[:, c : c + h * w].view(1, t, h, w) for c, w in ((0, kd), (h * kd, kd), (2 * h * kd, vd)))
    pool = torch.randn(n * cols + 1, h, vd, kd, generator=gen, device=dev).mul_(0.1)
    slots = torch.randperm(n * cols, generator=gen, device=dev).add_(1).to(torch.int32)
    indices = slots.view(n, cols) if spec else slots[:n]
    accepted = torch.tensor([sweep.rng.randint(1, cols) for _ in lens], dtype=torch.int32, device=dev) if spec else None
    a_log = torch.rand(h, generator=gen, device=dev).mul_(1.5).add_(0.5).log_()
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    args = dict(
        q=q, k=k, v=v, raw_g=sweep.randn(1, t, h, kd), raw_beta=sweep.randn(t, h + 8)[:, 8:].unsqueeze(0), A_log=a_log,
        dt_bias=sweep.randn(h * kd, dtype=torch.float32, scale=0.5) if kernel.has_dt_bias else None,
        lower_bound=kernel.lower_bound, initial_state=pool, cu_seqlens=qsl, ssm_state_indices=indices,
        num_accepted_tokens=accepted,
    )  # fmt: skip
    sweep.launch(
        ROCM_RECURRENT,
        f"{n} {'speculative' if spec else 'plain decode'} sequences, {t} tokens, uniform {uniform}",
        lambda: kernel(**args, uniform_sequence_length=uniform),
        ref=lambda: kda_recurrent_reference(**args)[0],
        tol=(1e-2, 1.6e-2),  # the plugin's tests: bf16 o, fp32 recurrences in different orders
    )
