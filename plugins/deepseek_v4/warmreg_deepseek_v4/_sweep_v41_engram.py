"""The DeepSeek-V4.1 sweep's engram launches (vLLM 0.34 ``nvidia/model.py: DeepseekV4Model.forward`` and
``common/engram.py``), called once a step by :class:`~warmreg_deepseek_v4.sweep_v41.DSV41Sweep`: the V2 runner's
gather of each request's look-back ids (``DeepseekV41ModelState._fill_lookback``, from a stand-in token history,
the batch's requests in reversed state rows), the n-gram hash of the flattened step, then for each engram layer the
lookup of tensor-parallel rank 0's heads from its hash columns (a strided view, as vLLM passes
``gathered_hashes[:, layer]``) into its bf16 staging rows, and the gate of the ``hc_mult`` streams by the ``wkv``
output (random: the GEMM is not a Triton kernel).

The tables are small stand-ins (prime head ranges near 1,000 rows instead of the checkpoint's millions): the keys do
not depend on the table's size, and every lookup row is owned or a zero row as in the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .sweep_inputs import BF16, DSV4_PREFIX, I32, I64, U8, DSV4Step
from .v41_engram_gate import engram_gate_reference
from .v41_engram_hash import engram_hash_reference
from .v41_engram_lookup import engram_lookup_reference
from .v41_lookback import gather_lookback_reference

if TYPE_CHECKING:
    from .sweep_v41 import DSV41Sweep

__all__ = ["ENGRAM_DRIVES", "drive_engram"]

#: The kernels :func:`drive_engram` launches.
ENGRAM_DRIVES = frozenset(
    DSV4_PREFIX + n for n in ("v41_gather_lookback", "v41_engram_hash", "v41_engram_lookup", "v41_engram_gate")
)
_VOCAB = 1024  # the stand-in compressed vocab and token ids


def _primes(count: int, start: int = 1000) -> list[int]:
    found: list[int] = []
    n = start
    while len(found) < count:
        n += 1
        if all(n % p for p in range(2, int(n**0.5) + 1)):
            found.append(n)
    return found


def drive_engram(sweep: DSV41Sweep, st: DSV4Step) -> None:
    """One step's engram launches (see the module docstring); nothing without engram layers."""
    layout, dev, gen = sweep.m.engram, sweep.dev, sweep.gen
    if layout is None or not sweep.has("v41_engram_hash"):
        return
    n, h, t = layout.max_ngram_size, layout.n_heads, st.batch.tokens
    layers = len(layout.layer_ids)
    primes = torch.tensor(_primes(layers * (n - 1) * h), dtype=I64, device=dev).reshape(layers, n - 1, h)
    flat = primes.reshape(layers, -1)
    offsets = torch.cumsum(flat, 1) - flat
    params: dict[str, Any] = dict(
        token_map=torch.randint(0, _VOCAB, (_VOCAB,), generator=gen, device=dev, dtype=I32),
        multipliers=torch.randint(0, 2**40, (layers, n), generator=gen, device=dev, dtype=I64).mul_(2).add_(1),
        primes=primes, offsets=offsets, pad_id=2,
    )  # fmt: skip
    ids = torch.randint(0, _VOCAB, (t,), generator=gen, device=dev, dtype=I32)
    dead = torch.rand(t, generator=gen, device=dev).lt(0.05)  # image-span tokens
    lookback = _lookback(sweep, st, n - 1)
    lb_dead = torch.zeros_like(lookback, dtype=torch.bool)
    args = (ids, st.positions, st.qsl, dead, lookback, lb_dead)
    name = DSV4_PREFIX + "v41_engram_hash"
    hashes = sweep.launch(
        name, "the step's n-grams", lambda: sweep.k("v41_engram_hash")(*args, **params),
        ref=lambda: engram_hash_reference(*args, **params),
    )  # fmt: skip
    if hashes is None:
        return
    heads = layout.local_heads(sweep.tp)
    for layer in range(layers):
        _lookup_and_gate(sweep, hashes[:, layer], flat[layer], heads, ~dead, f"engram layer {layout.layer_ids[layer]}")


def _lookback(sweep: DSV41Sweep, st: DSV4Step, depth: int) -> torch.Tensor:
    """The runner's look-back buffer (int32 ``[max_seqs, depth]``): gathered by the op where planned, from a
    history of each request's ids up to its sequence length, else random ids and -1."""
    dev, gen, reqs = sweep.dev, sweep.gen, len(st.batch.qlens)
    rows = sweep.lim.max_seqs
    if not sweep.has("v41_gather_lookback"):
        return torch.randint(-1, _VOCAB, (rows, depth), generator=gen, device=dev, dtype=I32)
    history = torch.randint(0, _VOCAB, (rows, max(st.batch.seqs, default=1)), generator=gen, device=dev, dtype=I32)
    idx = torch.arange(reqs - 1, -1, -1, dtype=I64, device=dev)
    buf = torch.full((rows, depth), 7777, dtype=I32, device=dev)  # rows a larger batch wrote before
    args = (buf, idx, st.qsl, st.positions, history)
    return sweep.launch(
        DSV4_PREFIX + "v41_gather_lookback", f"{depth} ids back", lambda: sweep.k("v41_gather_lookback")(*args),
        fallback=lambda: gather_lookback_reference(*args), ref=lambda: gather_lookback_reference(*args),
    )  # fmt: skip


def _lookup_and_gate(
    sweep: DSV41Sweep, ids: torch.Tensor, sizes: torch.Tensor, heads: int, mask: torch.Tensor, what: str
) -> None:
    """Rank 0's lookup of one layer's rows (rows ``[0, sum(sizes[:heads]))`` owned) and that layer's gate."""
    layout, dev, gen, t = sweep.m.engram, sweep.dev, sweep.gen, ids.shape[0]
    assert layout is not None
    d, rows = layout.head_dim, int(sizes[:heads].sum())
    weight = torch.randn(rows, d, generator=gen, device=dev).mul_(4).to(torch.float8_e4m3fn)
    scales = torch.randint(120, 134, (rows, d // 32), generator=gen, device=dev, dtype=U8)
    staged = torch.empty(t, heads, d, dtype=BF16, device=dev)
    if sweep.has("v41_engram_lookup"):
        table: dict[str, Any] = dict(weight=weight, scales=scales, vocab_start=0)
        sweep.launch(
            DSV4_PREFIX + "v41_engram_lookup", what, lambda: sweep.k("v41_engram_lookup")(ids, staged, head_start=0, **table),
            ref=lambda: engram_lookup_reference(ids, head_start=0, local_heads=heads, **table),
        )  # fmt: skip
    if not sweep.has("v41_engram_gate"):
        return
    m = sweep.m
    hidden = sweep.randn(t, m.hc_mult, m.hidden_size)
    kv = sweep.randn(t, (m.hc_mult + 1) * m.hidden_size)
    q, k = sweep.randn(m.hc_mult, m.hidden_size), sweep.randn(m.hc_mult, m.hidden_size)
    weights: dict[str, Any] = dict(q_weight=q, k_weight=k, eps=m.rms_norm_eps)
    sweep.launch(
        DSV4_PREFIX + "v41_engram_gate", what, lambda: sweep.k("v41_engram_gate")(hidden, kv, mask, t, **weights),
        ref=lambda: engram_gate_reference(hidden, kv, mask, t, **weights),
        tol=(2**-5, 2**-7),  # x + gate * v cancels: one bf16 rounding of operands up to ~4 in size
    )  # fmt: skip
