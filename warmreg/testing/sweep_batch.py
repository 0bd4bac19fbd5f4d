"""Request mixes of the zero-JIT sweep: serving limits, one step's batch, and its engine-built tensors.

A step is decode-only, prefill-only or mixed, decode requests first as engines schedule them. The draws are
part of the sweep's contract: a driver's results stay comparable between runs only while :func:`make_batch`
draws the same numbers in the same order for the same seed.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

import warmreg

__all__ = ["KINDS", "Batch", "Limits", "Step", "make_batch"]

#: The step kinds, in the order of the first steps of a sweep.
KINDS = ("decode", "prefill", "mixed")
_I32, _I64 = torch.int32, torch.int64
_S = TypeVar("_S", bound="Step")


@dataclass(frozen=True)
class Limits:
    """Sizes of one run: the serving limits, capped for the CPU; block tables keep ``max_model_len``'s width."""

    max_tokens: int  # tokens per step
    max_seqs: int  # requests per step
    max_seq_len: int  # longest sequence drawn
    max_model_len: int  # the configured one: table widths and C128 buffers, so that keys are the deployment's
    spec: int  # num_speculative_tokens
    num_blocks: int  # pages of each KV / state cache
    workspace_rows: int  # sparse-prefill gather workspace per chunk, in rows of 512 bf16
    logits_bytes: int  # indexer logits budget of a prefill chunk (a request over it alone is cut along M)

    @classmethod
    def of(
        cls,
        cfg: warmreg.WarmConfig,
        *,
        cuda: bool,
        spec: int,
        max_tokens: int | None = None,
        max_seq_len: int | None = None,
        max_seqs: int | None = None,
    ) -> Limits:
        """The config's serving values, capped by the arguments.

        :param cuda: whether the run is on a GPU. The CPU defaults are 4 tokens, 4 requests, length 256, and small
            workspace and logits budgets, so that chunking and cuts along M happen at those sizes.
        :param spec: draft tokens per decode request (the driver's :meth:`~warmreg.testing.sweep.Sweep.speculative_tokens`).
        :param max_tokens: cap on tokens per step.
        :param max_seq_len: cap on sequence lengths (raised to ``2 + spec``: room for a decode).
        :param max_seqs: cap on requests per step.
        """
        serving, big = cfg.serving, 1 << 62
        mml = int(serving["max_model_len"])
        return cls(
            max_tokens=min(int(serving["max_num_batched_tokens"]), max_tokens or (big if cuda else 4)),
            max_seqs=min(int(serving["max_num_seqs"]), max_seqs or (big if cuda else 4)),
            max_seq_len=min(mml, max(max_seq_len or (big if cuda else 256), 2 + spec)),  # room for a decode
            max_model_len=mml,
            spec=spec,
            num_blocks=256 if cuda else 16,
            workspace_rows=1 << 19 if cuda else 512,
            logits_bytes=512 << 20 if cuda else 512,
        )


@dataclass(frozen=True)
class Batch:
    """One step's requests, decode requests first: sequence and query lengths, and SWA replay starts."""

    kind: str
    seqs: tuple[int, ...]
    qlens: tuple[int, ...]
    replay: tuple[int, ...]
    num_decodes: int

    @property
    def tokens(self) -> int:
        """Tokens of the step (``T``)."""
        return sum(self.qlens)

    @property
    def decode_tokens(self) -> int:
        """Tokens of the decode requests (the first ``decode_tokens`` rows)."""
        return sum(self.qlens[: self.num_decodes])

    @property
    def num_prefills(self) -> int:
        """Prefill requests (after the decode requests)."""
        return len(self.qlens) - self.num_decodes

    @property
    def uniform_decode_len(self) -> int | None:
        """``D`` when every decode request has ``D`` tokens (the uniform-decode flattening applies), else None."""
        lens = set(self.qlens[: self.num_decodes])
        return lens.pop() if len(lens) == 1 else None

    def describe(self) -> str:
        """One line for reports: the kind, decode and prefill requests and tokens, the longest sequence."""
        d = self.uniform_decode_len or "mixed"
        return (
            f"{self.kind}: {self.num_decodes} decode reqs ({self.decode_tokens} tok, D={d}) + {self.num_prefills} "
            f"prefill reqs ({self.tokens - self.decode_tokens} tok), T={self.tokens}, max seq {max(self.seqs)}"
        )


def _count(rng: random.Random, lo: int, hi: int) -> int:
    """An integer in ``[lo, hi]``: each extreme 10% of the time, else log-uniform."""
    r = rng.random()
    if hi <= lo or r < 0.1:
        return lo
    if r < 0.2:
        return hi
    return min(hi, max(lo, int(math.exp(rng.uniform(math.log(lo + 1), math.log(hi + 2)))) - 1))


def _length(rng: random.Random, lo: int, hi: int) -> int:
    """A sequence length in ``[lo, hi]``: 10% the longest, half log-uniform, 40% uniform."""
    r = rng.random()
    if hi <= lo or r < 0.1:
        return hi
    return _count(rng, lo, hi) if r < 0.6 else rng.randint(lo, hi)


def make_batch(rng: random.Random, kind: str, lim: Limits, *, mix_decode: bool = False) -> Batch:
    """A decode-first batch of ``kind`` within the limits, as an engine's scheduler emits it.

    The step first draws its longest sequence, so that steps of short sequences only occur too (the C128 width
    and the sparse-prefill workspace follow a step's longest sequence). A decode request carries
    ``1 + spec`` tokens (70% of steps), 1 (15%) or either (15%). A prefill is a chunk of a prompt after a context
    (none for a fifth of them); a fifth of the requests replay a bounded SWA window.

    :param kind: one of :data:`KINDS` (a mixed step needs room for two requests, else it is a decode step).
    :param mix_decode: the decode requests carry ``1 + spec`` tokens, then 1 (at least one of each, where the
        limits leave room for both).
    """
    if kind == "mixed" and (lim.max_tokens < 2 or lim.max_seqs < 2):
        kind = "decode"
    d, seqs, qlens = 1 + lim.spec, [], []
    cap = _length(rng, min(d + 1, lim.max_seq_len), lim.max_seq_len)  # this step's longest: W varies by step
    if kind != "prefill":
        room = lim.max_tokens - (kind == "mixed")
        n_dec = _count(rng, 1, max(1, min(lim.max_seqs - (kind == "mixed"), room // d)))
        mode = rng.random()
        mix = mix_decode and d > 1 and room > d and lim.max_seqs - (kind == "mixed") > 1
        if mix:
            n_dec = min(max(n_dec, 2), room - d + 1)
        for i in range(n_dec):
            if mix:
                qlens.append(d if i == 0 else 1)
            else:
                qlens.append(min(room, d if mode < 0.7 else 1 if mode < 0.85 else rng.randint(1, d)))
            seqs.append(_length(rng, qlens[-1] + 1, cap))  # some context before the drafts
    n_dec = len(qlens)
    if kind != "decode":
        left = _count(rng, 1, lim.max_tokens - sum(qlens))
        while left > 0 and len(qlens) < lim.max_seqs:  # chunks of prompts, after a context (none for a fifth)
            q = min(left, _count(rng, 1, lim.max_tokens), cap)
            qlens.append(q)
            seqs.append(q + _length(rng, 0, cap - q) if rng.random() < 0.8 else q)
            left -= q
    replay = tuple(0 if rng.random() < 0.8 else rng.randint(0, s - q) for s, q in zip(seqs, qlens))
    return Batch(kind, tuple(seqs), tuple(qlens), replay, n_dec)


@dataclass(kw_only=True)
class Step:
    """One step's device tensors, as an engine builds them, and the per-step metadata its layers share.

    A model family whose layers share more per-step metadata subclasses it (keyword-only fields) and builds it
    with :meth:`of` and the extra fields.
    """

    batch: Batch
    qsl: torch.Tensor  # int32 [R + 1] query_start_loc
    seq_lens: torch.Tensor  # int32 [R]
    positions: torch.Tensor  # int64 [T]
    token_to_req: torch.Tensor  # int32 [T]
    replay: torch.Tensor  # int32 [R] first position SWA may replay (0: no bounded replay)
    slots: dict[int, torch.Tensor] = field(default_factory=dict)  # KV-group block size -> int64 [T]

    @classmethod
    def of(cls: type[_S], b: Batch, dev: torch.device, **extra: Any) -> _S:
        """``query_start_loc``, ``seq_lens``, ``positions`` and ``token_to_req`` of a batch on ``dev``.

        :param extra: the fields a subclass adds.
        """
        qlens, seqs = torch.tensor(b.qlens, dtype=_I64), torch.tensor(b.seqs, dtype=_I64)
        qsl = torch.zeros(len(b.qlens) + 1, dtype=_I64)
        qsl[1:] = torch.cumsum(qlens, 0)
        req = torch.repeat_interleave(torch.arange(len(b.qlens)), qlens)
        positions = (seqs - qlens)[req] + torch.arange(b.tokens) - qsl[:-1][req]
        return cls(
            batch=b,
            qsl=qsl.to(_I32).to(dev),
            seq_lens=seqs.to(_I32).to(dev),
            positions=positions.to(dev),
            token_to_req=req.to(_I32).to(dev),
            replay=torch.tensor(b.replay, dtype=_I32).to(dev),
            **extra,
        )
