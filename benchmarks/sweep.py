"""The zero-JIT sweep: every registered kernel of a deployment, driven like an engine, with the monitor in ``error``.

For each config: ``warmreg.warm(config)``, arm the JIT monitor in ``error`` mode, then run engine steps of a
randomized request mix through EVERY kernel of ``warmreg.plan(config).kernels``. A plan kernel without a driver
here stops the sweep before anything runs (:class:`SweepError` names it); a driver whose kernel the plan lacks
(the combine under Pro's FlashInfer backend) is skipped.

Steps are decode-only, prefill-only or mixed (the first three one of each, then 5:2:3 at random), decode requests
first as engines schedule them. A decode request carries ``1 + num_speculative_tokens`` tokens (70% of steps), 1
(15%) or either (15%: no uniform decode), and the first step's mix ``1 + num_speculative_tokens`` and 1 (unequal
decode lengths: the C4 indexer's padded decode path); token counts run from 1 to ``max_num_batched_tokens`` and sequence
lengths to ``max_model_len`` (each step first draws its longest sequence: log-uniform and uniform draws and both
extremes); a fifth of the requests replay a bounded SWA window. Inputs are built as an engine builds them and go
through the plugins' launchers (``plan.kernel(name).kernel``): ``query_start_loc``/``seq_lens``/``positions`` from
the batch; persistent block tables ``[max_num_seqs, width(max_model_len)]`` of random, valid block ids of caches of
a few hundred pages; ``fp8_ds_mla`` pages of e4m3 bytes, bf16 RoPE parts and UE8M0 scales; FP8 indexer pages at
the allocator's page stride; fp32 compressor states; random bf16/fp32 activations; and each kernel's outputs feed
the next. A launch that raises :class:`warmreg.JitMissError` (error mode refuses the compile) or fails is recorded
with its batch and the step goes on; the metadata it should have produced is then computed in PyTorch for the
kernels downstream.

Per step, once: the block-table slot mapping of each KV-cache group of the plan (DeepSeek-V4: SWA 64, compressed
and indexer caches 256, compressor states 4 and 8; Kimi-K3: MLA 64), the compressed slot mappings (sparse-MLA
builder per ratio, and the C4 indexer's site), the C128A metadata, the decode SWA indices, the sparse-SWA prefill
metadata and the uniform-decode flattening. Then ONE launch per layer TYPE, not per layer (the layers of a type
launch the same keys):

- DeepSeek-V4, each type: Q/KV RMSNorm, its sparse prefill chunk by chunk (dequant-gather of its compressed cache
  and of the SWA cache, then the combine), inverse RoPE + FP8 quant. C4 adds its compressor's save, and the
  indexer (save, compress + insert, Q RoPE + quant, global top-k of the decode tokens (and of the prefill tokens
  under FlashInfer), on decode batches of unequal lengths the pack of the FP8 Q and the unpack of the top-k,
  prefill chunk metadata, cut along M above the logits budget); C128 adds its compressor's
  save. The MTP layer's two norms run around the attention type of the MTP layer (SWA-only: with the SWA-only
  layers when the model has them, else as a type of its own). With DSpark (``speculative_method`` ``dspark``) a
  draft step follows each target step: its inputs (decode requests rejected some drafts, prefill chunks sampled a
  token or none), its non-causal SWA indices over ``Nq`` query tokens a request, and the SWA-only draft layers'
  Q/KV RMSNorm and inverse RoPE + quant on those tokens.
- Kimi-K3: the MLA layers' Q/KV RMSNorm (over either registered projection width); the KDA metadata builder's
  aligned state indices (every step) and, on decode-only steps under speculation, its staging of the metadata into
  graph buffers padded past the step's requests; the KDA layers' short convolutions (the prefill conv1d of q, k and
  v, column slices of the packed projection, when the step has prefills; the conv update of the speculative decode
  rows, varlen with accepted counts; the plain-decode update on decode steps of one-token rows where the plan holds
  it, followed by the packed KDA decode step on its output), the initial-state gather of the prefill requests,
  the speculative recurrent step over the decode requests (vLLM's convention: q, k, v column views of the conv
  update's output, [N, 1 + spec] state indices with accepted counts, a null slot now and then; prefill requests take the six stages of the chunked KDA prefill (initial states mixed) where vLLM's prefill
  backend is Triton)
  and the gated RMSNorm of the output over every token (the gate a column view of the fused projection, at its
  usual width or the overlap path's).

Reported per config and kernel: launches, misses (explanations), failures, the monitor's counters as a cross-check,
and every key launched that the plan does not hold; plus steps, tokens and the mix of step kinds.

``--device cpu`` runs the same drivers on CPU tensors through Triton's interpreter: no warm (nothing compiles
there), the plan for ``cuda:90`` (the H200), sizes capped (``--max-tokens``, ``--max-seq-len``, ``--max-seqs``),
and the first launch of each kernel that has a PyTorch reference checked against it.

    python benchmarks/sweep.py [configs...] [--steps 60] [--seed 0] [--tag h200] [--pack CONFIG=PACK]
    python benchmarks/sweep.py --device cpu [--steps 3] [--max-tokens 4] [--max-seq-len 256] [--max-seqs 4]
"""

from __future__ import annotations

import abc
import argparse
import math
import random
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write
from warmreg_deepseek_v4 import DSV4
from warmreg_deepseek_v4.combine_indices import combine_topk_swa_indices_reference
from warmreg_deepseek_v4.compressed_slot_mapping import compressed_slot_mapping_reference
from warmreg_deepseek_v4.dspark import DSparkDraft, num_speculative_tokens
from warmreg_deepseek_v4.dspark_inputs import DraftInputs, prepare_dspark_inputs_reference
from warmreg_deepseek_v4.dspark_swa_indices import dspark_swa_indices_reference
from warmreg_deepseek_v4.fp8_ds_mla import FP8_MAX, HEAD_DIM, NOPE_DIM, ROPE_DIM, SCALE_BYTES, TOKEN_BYTES, page_bytes
from warmreg_deepseek_v4.global_topk import global_topk_indices_reference
from warmreg_deepseek_v4.indexer import (
    compress_pool_reference,
    indexer_page_stride,
    indexer_q_rope_mxfp4_reference,
    mxfp4_indexer,
    token_bytes,
)
from warmreg_deepseek_v4.inv_rope_quant import fp8_checkpoint
from warmreg_deepseek_v4.metadata import C4_STATE_BLOCK_SIZE, C128_STATE_BLOCK_SIZE
from warmreg_deepseek_v4.model import SPARSE_BLOCK_SIZE, SWA_PAGE_SIZE
from warmreg_deepseek_v4.pack_seq import pack_seq_reference
from warmreg_deepseek_v4.sparse_mla import (
    FLASHINFER_SPARSE,
    attention_backend,
    c128_active_width,
    c128_max_width,
    c128_topk_metadata_reference,
    compressed_block_size,
)
from warmreg_deepseek_v4.swa_indices import decode_swa_indices_reference
from warmreg_deepseek_v4.swa_prefill_metadata import sparse_swa_prefill_metadata_reference
from warmreg_deepseek_v4.unpack_seq import unpack_seq_reference
from warmreg_kimi_k3.attn_res import attn_res_reference
from warmreg_kimi_k3.causal_conv1d import causal_conv1d_reference, conv1d_chunks, projection_row_stride
from warmreg_kimi_k3.causal_conv1d_update import causal_conv1d_update_reference
from warmreg_kimi_k3.gated_rmsnorm import gated_rmsnorm_reference, projection_width
from warmreg_kimi_k3.gather_initial_states import gather_initial_states_reference
from warmreg_kimi_k3.kda import KDARecurrent, kda_recurrent_reference
from warmreg_kimi_k3.kda_chunk import STAGES as KDA_CHUNK_STAGES
from warmreg_kimi_k3.kda_chunk_base import chunk_metadata
from warmreg_kimi_k3.kda_chunk_intra import platform_solve_precision
from warmreg_kimi_k3.kda_chunk_l2norm import l2norm_reference
from warmreg_kimi_k3.kda_packed_decode import kda_packed_decode_reference
from warmreg_kimi_k3.kda_spec_metadata import stage_spec_decode_metadata_reference
from warmreg_kimi_k3.kda_state_indices import aligned_state_indices_reference

import warmreg
from warmreg.ops import block_table_slot_mapping_reference, block_table_width, fused_qkv_rmsnorm_reference

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = tuple(
    str(ROOT / "examples" / f"{n}.json")
    for n in ("deepseek_v4_flash", "deepseek_v4_pro", "kimi_k3", "kimi_k3_full", "deepseek_v4_flash_0731_dspark")
)
KINDS = ("decode", "prefill", "mixed")
CPU_TARGET = "cuda:90"  # the plan a CPU run drives: the H200's
I32, I64, BF16, F32, U8 = torch.int32, torch.int64, torch.bfloat16, torch.float32, torch.uint8

SLOTS, NORM = "warmreg.ops.block_table_slot_mapping", "warmreg.ops.fused_qkv_rmsnorm"
KDA, ATTN_RES = "kimi_k3.kda_recurrent", "kimi_k3.attn_res"
CONV, CONV_UPDATE = "kimi_k3.causal_conv1d", "kimi_k3.causal_conv1d_update"
KDA_NORM, KDA_GATHER = "kimi_k3.gated_rmsnorm", "kimi_k3.gather_initial_states"
KDA_ALIGNED, KDA_STAGE = "kimi_k3.aligned_state_indices", "kimi_k3.stage_spec_decode_metadata"
KDA_PACKED = "kimi_k3.kda_packed_decode"
#: The chunked KDA prefill's stages, in launch order (l2norm, gate, intra, wu, h, o).
KDA_CHUNK = tuple(stage.name for stage in KDA_CHUNK_STAGES)
DSV4_PREFIX = "deepseek_v4."
CSLOTS, GATHER, COMBINE, SAVE = (
    DSV4_PREFIX + n
    for n in ("compressed_slot_mapping", "dequant_gather_k_cache", "combine_topk_swa_indices", "save_partial_states")
)
#: Every kernel the sweep can drive.
DRIVERS = frozenset(
    [SLOTS, NORM, KDA, ATTN_RES, CONV, CONV_UPDATE, KDA_NORM, KDA_GATHER, KDA_ALIGNED, KDA_STAGE, KDA_PACKED, CSLOTS, GATHER, COMBINE, SAVE, *KDA_CHUNK]
    + [
        DSV4_PREFIX + n
        for n in (
            "c128a_topk_metadata",
            "compress_pool",
            "decode_swa_indices",
            "dspark_noncausal_swa_indices",
            "global_topk_indices",
            "indexer_kv_compress_insert",
            "indexer_prefill_chunk_metadata",
            "indexer_q_rope_mxfp4",
            "indexer_q_rope_quant",
            "inv_rope_fp8_quant",
            "mtp_input_rmsnorm",
            "mtp_shared_head_rmsnorm",
            "pack_seq",
            "prepare_dspark_inputs",
            "prepare_uniform_decode",
            "sparse_swa_prefill_metadata",
            "unpack_seq",
        )
    ]
)
#: DeepSeek-V4 KV-cache groups by block size: the SWA cache (64-token pages), the compressed and indexer caches
#: (256 raw tokens a block: their uncompressed slots) and the compressor states of C4 and C128 layers.
SWA, KV, STATE = SWA_PAGE_SIZE, SPARSE_BLOCK_SIZE, {4: C4_STATE_BLOCK_SIZE, 128: C128_STATE_BLOCK_SIZE}
#: Key fields a CPU run takes from its own (absent) platform rather than from the planned target.
PLATFORM_FIELDS = frozenset({"launch_pdl"})


class SweepError(RuntimeError):
    """The sweep cannot run a config: a plan kernel without a driver, or ``--device cuda`` without a GPU."""


# -- sizes and request mixes ---------------------------------------------------------------------------------------
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
        cls, cfg: warmreg.WarmConfig, cuda: bool, max_tokens: int | None, max_seq_len: int | None, max_seqs: int | None
    ) -> Limits:
        """The config's serving values, capped by the arguments (CPU defaults: 4 tokens, 4 requests, length 256;
        and small workspace and logits budgets, so that chunking and cuts along M happen at those sizes)."""
        serving, big = cfg.serving, 1 << 62
        mml = int(serving["max_model_len"])
        spec = num_speculative_tokens(cfg) if cfg.model_type == "deepseek_v4" else int(serving.get("num_speculative_tokens") or 0)
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
        return sum(self.qlens)

    @property
    def decode_tokens(self) -> int:
        return sum(self.qlens[: self.num_decodes])

    @property
    def num_prefills(self) -> int:
        return len(self.qlens) - self.num_decodes

    @property
    def uniform_decode_len(self) -> int | None:
        """``D`` when every decode request has ``D`` tokens (the uniform-decode flattening applies), else None."""
        lens = set(self.qlens[: self.num_decodes])
        return lens.pop() if len(lens) == 1 else None

    def describe(self) -> str:
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
    and the sparse-prefill workspace follow a step's longest sequence). ``mix_decode``: the decode requests carry
    ``1 + num_speculative_tokens`` tokens, then 1 (at least one of each, where the limits leave room for both).
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


def _chunks(rows: list[int], budget: int) -> list[tuple[int, int]]:
    """Chunks ``[a, b)`` of consecutive requests with ``count * max(rows) <= budget`` (one request always fits)."""
    out: list[tuple[int, int]] = []
    start, widest = 0, 0
    for i, r in enumerate(rows):
        if i > start and (i - start + 1) * max(widest, r) > budget:
            out.append((start, i))
            start, widest = i, 0
        widest = max(widest, r)
    if rows:
        out.append((start, len(rows)))
    return out


# -- per-kernel accounting -----------------------------------------------------------------------------------------
@dataclass
class KernelStats:
    """What one kernel did in a config's sweep."""

    launches: int = 0
    misses: dict[str, dict[str, Any]] = field(default_factory=dict)  # explanation -> count, first batch
    failures: dict[str, dict[str, Any]] = field(default_factory=dict)  # error -> count, first batch
    checks: list[str] = field(default_factory=list)

    @staticmethod
    def note(where: dict[str, dict[str, Any]], text: str, batch: str) -> None:
        where.setdefault(text, {"count": 0, "first_batch": batch})["count"] += 1

    def to_json(self, monitor: dict[str, int] | None) -> dict[str, Any]:
        misses = sum(e["count"] for e in self.misses.values())
        return {
            "launches": self.launches,
            "misses": misses,
            "failures": sum(e["count"] for e in self.failures.values()),
            "miss_explanations": [{"explain": k, **v} for k, v in self.misses.items()],
            "failure_messages": [{"error": k, **v} for k, v in self.failures.items()],
            "checks": self.checks,
            "monitor": monitor,  # launches counted before Triton compiles, so a miss is a launch there too
            "monitor_agrees": monitor is not None and monitor["launches"] == self.launches + misses,
        }


def _compare(got: Any, want: Any, atol: float, rtol: float) -> str | None:
    """None when the outputs equal the reference's: integers exactly, floats within ``atol``/``rtol``."""
    pairs = list(zip(got, want)) if isinstance(got, tuple) else [(got, want)]
    for i, (g, w) in enumerate(pairs):
        if g is None:
            continue
        g, w = g.cpu(), w.cpu()
        if g.dtype.is_floating_point:
            try:
                torch.testing.assert_close(g, w, atol=atol, rtol=rtol)
            except AssertionError as exc:
                return f"output {i}: {str(exc).splitlines()[0]}"
        elif g.shape != w.shape or not torch.equal(g, w):
            return f"output {i} differs from the reference (shapes {tuple(g.shape)} and {tuple(w.shape)})"
    return None


# -- what an engine keeps and builds -------------------------------------------------------------------------------
def fp8_ds_mla_cache(pages: int, block_size: int, gen: torch.Generator, dev: torch.device) -> torch.Tensor:
    """``fp8_ds_mla`` pages (uint8 ``[pages, page_bytes]``): e4m3 NoPE bytes, bf16 RoPE part, UE8M0 scales near 1."""
    cache = torch.zeros(pages, page_bytes(block_size), dtype=U8, device=dev)
    tokens = cache[:, : block_size * TOKEN_BYTES].view(pages, block_size, TOKEN_BYTES)
    nope = torch.randn(pages, block_size, NOPE_DIM, generator=gen, device=dev).mul_(64)
    tokens[..., :NOPE_DIM] = nope.clamp_(-FP8_MAX[False], FP8_MAX[False]).to(torch.float8_e4m3fn).view(U8)
    tokens[..., NOPE_DIM:] = torch.randn(pages, block_size, ROPE_DIM, generator=gen, device=dev).to(BF16).view(U8)
    scales = cache[:, block_size * TOKEN_BYTES : block_size * (TOKEN_BYTES + SCALE_BYTES)]
    exponents = torch.randint(117, 137, (pages, block_size, SCALE_BYTES - 1), generator=gen, device=dev)
    scales.view(pages, block_size, SCALE_BYTES)[..., :-1] = exponents.to(U8)  # the pad byte stays 0
    return cache


def rope_cache(rows: int, rope_dim: int, theta: float, dev: torch.device) -> torch.Tensor:
    """float32 ``[rows, rope_dim]``: cosines, then sines, of ``p * theta**(-2i / rope_dim)``.

    YaRN's scaling of the compressed layers' cache is left out: it changes the values, not the shapes.
    """
    inv = theta ** (-torch.arange(0, rope_dim, 2, dtype=F32, device=dev) / rope_dim)
    angles = torch.arange(rows, dtype=F32, device=dev)[:, None] * inv[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=1)


@dataclass
class Step:
    """One step's device tensors and the per-step metadata its layers share."""

    batch: Batch
    qsl: torch.Tensor  # int32 [R + 1] query_start_loc
    seq_lens: torch.Tensor  # int32 [R]
    positions: torch.Tensor  # int64 [T]
    token_to_req: torch.Tensor  # int32 [T]
    replay: torch.Tensor  # int32 [R] first position SWA may replay (0: no bounded replay)
    gather_host: list[int]  # the prefills' sparse-SWA gather lens (the builder's CPU copy)
    slots: dict[int, torch.Tensor] = field(default_factory=dict)  # KV-group block size -> int64 [T]
    cslots: dict[str, torch.Tensor] = field(default_factory=dict)  # call site -> compressed slots, int64 [T]
    gather_lens: torch.Tensor | None = None  # int32 [num_prefills]
    prefill_local: torch.Tensor | None = None  # C128A local indices of the prefill tokens, int32 [T - nd, W]
    topk: torch.Tensor | None = None  # the C4 indexer's local top-k, int32 [T, index_topk]


def step_tensors(b: Batch, window: int, dev: torch.device) -> Step:
    """``query_start_loc``, ``seq_lens``, ``positions`` and ``token_to_req`` of a batch, as an engine builds them."""
    qlens, seqs = torch.tensor(b.qlens, dtype=I64), torch.tensor(b.seqs, dtype=I64)
    qsl = torch.zeros(len(b.qlens) + 1, dtype=I64)
    qsl[1:] = torch.cumsum(qlens, 0)
    req = torch.repeat_interleave(torch.arange(len(b.qlens)), qlens)
    positions = (seqs - qlens)[req] + torch.arange(b.tokens) - qsl[:-1][req]
    nd = b.num_decodes
    gather = [q + min(max(s - q - r, 0), window - 1) for s, q, r in zip(b.seqs[nd:], b.qlens[nd:], b.replay[nd:])]
    return Step(
        batch=b,
        qsl=qsl.to(I32).to(dev),
        seq_lens=seqs.to(I32).to(dev),
        positions=positions.to(dev),
        token_to_req=req.to(I32).to(dev),
        replay=torch.tensor(b.replay, dtype=I32).to(dev),
        gather_host=gather,
    )


# -- the engine: persistent state, launches and their accounting ---------------------------------------------------
class Sweep(abc.ABC):
    """One config's engine: the plan, persistent tables, caches and buffers, and what each kernel did.

    A model family subclasses it: its constructor sets up the family's caches and ``layers`` (the layer types),
    and :meth:`run` launches one step.
    """

    def __init__(self, plan: warmreg.Plan, dev: torch.device, lim: Limits, seed: int) -> None:
        self.plan, self.cfg, self.dev, self.lim = plan, plan.config, dev, lim
        self.cuda = dev.type == "cuda"
        self.gen = torch.Generator(device=dev).manual_seed(seed)
        self.rng = random.Random(seed + 1)
        self.names = frozenset(kp.name for kp in plan.kernels)
        self.stats = {name: KernelStats() for name in sorted(self.names)}
        self.where, self.window = "", 128
        self.step_failures: list[str] = []
        self.layers: list[tuple[str, int]] = []
        keys = plan.kernel(SLOTS).keys if SLOTS in self.names else ()
        self.groups = sorted({k.block_size for k in keys})  # type: ignore[attr-defined]
        self.tables = {bs: self.block_table(block_table_width(lim.max_model_len, bs)) for bs in self.groups}
        self.slot_buf = {bs: torch.full((lim.max_tokens,), -1, dtype=I64, device=dev) for bs in self.groups}

    @abc.abstractmethod
    def run(self, st: Step) -> None:
        """Launch every kernel of one step."""

    def layer_types(self) -> list[str]:
        """The layer types a step launches (each once)."""
        return [kind for kind, _ in self.layers]

    # -- helpers -------------------------------------------------------------------------------------------------
    def kernel(self, name: str) -> Any:
        return self.plan.kernel(name).kernel

    def randn(self, *shape: int, dtype: torch.dtype = BF16, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen, device=self.dev).mul_(scale).to(dtype)

    def block_table(self, width: int) -> torch.Tensor:
        """A persistent block table ``[max_seqs, width]`` of random, valid page ids (request ``r`` owns row ``r``)."""
        shape = (self.lim.max_seqs, width)
        return torch.randint(0, self.lim.num_blocks, shape, generator=self.gen, device=self.dev, dtype=I32)

    def launch(
        self,
        name: str,
        what: str,
        fn: Callable[[], Any],
        *,
        fallback: Callable[[], Any] | None = None,
        ref: Callable[[], Any] | None = None,
        tol: tuple[float, float] = (0.0, 2**-7),
    ) -> Any:
        """Launch ``name`` through ``fn``; on a miss or a failure record it and return ``fallback()`` (or None).

        On the CPU the first launch of a kernel with a reference ``ref`` is checked against it. The reference runs
        first (some kernels update inputs in place); floats must agree within ``tol = (atol, rtol)`` (default: one
        bf16 rounding, both sides computing in fp32 in different orders).
        """
        stat, batch = self.stats[name], f"{self.where}; {what}"
        want = None
        if ref is not None and not self.cuda and not stat.checks:
            try:
                want = ref()
            except Exception as exc:  # a reference that cannot take the inputs is a finding, not a launch failure
                stat.checks.append(f"{batch}: the reference raised {type(exc).__name__}: {exc}"[:800])
        try:
            out = fn()
            if self.cuda:
                torch.cuda.synchronize()  # an asynchronous fault is charged to this launch, not a later one
        except warmreg.JitMissError as exc:
            KernelStats.note(stat.misses, exc.miss.explain(), batch)
            return fallback() if fallback is not None else None
        except Exception as exc:  # anything else fails the sweep: recorded, and the step goes on
            KernelStats.note(stat.failures, f"{type(exc).__name__}: {exc}"[:800], batch)
            return fallback() if fallback is not None else None
        stat.launches += 1
        if want is not None:
            stat.checks.append(f"{batch}: " + (_compare(out, want, *tol) or "matches the PyTorch reference"))
        return out

    def step(self, b: Batch, index: int) -> None:
        """One engine step; an error outside a launch (inputs, a fallback) is recorded as a step failure."""
        self.where = f"step {index} ({b.describe()})"
        try:
            self.run(step_tensors(b, self.window, self.dev))
        except Exception as exc:
            self.step_failures.append(f"{self.where}: {type(exc).__name__}: {exc}"[:800])

    # -- kernels of both families --------------------------------------------------------------------------------
    def slot_mapping(self, st: Step, bs: int) -> None:
        """The block-table slot mapping of one KV-cache group, into its persistent (graph-padded) buffer."""
        table, buf, T = self.tables[bs], self.slot_buf[bs], st.batch.tokens

        def torch_slots() -> torch.Tensor:
            buf[:T] = table.long()[st.token_to_req.long(), st.positions // bs] * bs + st.positions % bs
            buf[T:] = -1
            return buf

        out = self.launch(
            SLOTS,
            f"KV group of block size {bs}",
            lambda: self.kernel(SLOTS)(st.qsl, st.positions, table, buf, block_size=bs),
            fallback=torch_slots,
            ref=lambda: block_table_slot_mapping_reference(
                st.qsl, st.positions, table, block_size=bs, max_num_tokens=buf.shape[0]
            ),
        )
        st.slots[bs] = out[:T]

    def qkv_norm(self, st: Step, layer: str, q: int, kv: int, width: int, eps: float) -> None:
        """The Q/KV RMSNorm of one layer type: ``qr`` and ``kv`` are column views of one fused projection (not
        planned on ROCm with aiter, whose fused op runs instead)."""
        if NORM not in self.names:
            return
        proj = self.randn(st.batch.tokens, width, scale=2.0)
        args = (proj[:, :q], proj[:, q : q + kv], self.randn(q).add_(1), self.randn(kv).add_(1), eps)
        self.launch(
            NORM,
            f"{layer} layer, projection width {width}",
            lambda: self.kernel(NORM)(*args),
            ref=lambda: fused_qkv_rmsnorm_reference(*args),
        )

    # -- results -------------------------------------------------------------------------------------------------
    def results(self, mon: warmreg.Monitor) -> dict[str, Any]:
        """Per kernel: launches, misses, failures, checks and the monitor's counters; keys outside the plan."""
        counters = mon.counters()
        kernels = {name: s.to_json(counters.get(name)) for name, s in self.stats.items()}
        return {
            "kernels": kernels,
            "not_launched": [n for n, k in kernels.items() if not k["launches"] and not k["misses"]],
            "keys_outside_plan": self.outside_plan(mon),
            "step_failures": self.step_failures,
        }

    def outside_plan(self, mon: warmreg.Monitor) -> list[dict[str, Any]]:
        """Every key launched that the plan does not hold, with the fields that differ from the nearest planned key.

        ``platform_only`` marks keys of a CPU run that differ only in fields set from the CPU's platform.
        """
        out = []
        for name in sorted(self.names):
            planned = set(self.plan.kernel(name).keys)
            for key in sorted(mon.used_keys(name) - planned, key=lambda k: k.sort_key()):
                nearest = min(planned, key=lambda p: (len(p.diff(key)), p.sort_key()), default=None)
                diff = nearest.diff(key) if nearest is not None else ()
                out.append(
                    {
                        "kernel": name,
                        "key": str(key),
                        "differs_from_plan_in": [str(d) for d in diff],
                        "platform_only": not self.cuda and bool(diff) and all(d.field in PLATFORM_FIELDS for d in diff),
                    }
                )
        return out


class DSV4Sweep(Sweep):
    """DeepSeek-V4: per-step metadata, then its SWA-only, C4, C128 and MTP layer types (those the config has)."""

    def __init__(self, plan: warmreg.Plan, dev: torch.device, lim: Limits, seed: int) -> None:
        super().__init__(plan, dev, lim, seed)
        m = self.m = DSV4.from_config(self.cfg)
        self.window = m.sliding_window
        self.tp = int(self.cfg.serving.get("tensor_parallel_size", 1))
        self.flashinfer = attention_backend(self.cfg) == FLASHINFER_SPARSE
        self.quantize = fp8_checkpoint(self.cfg)
        self.ratios = sorted({r for r in m.ratios if r > 1})
        n_main, kinds = int(self.cfg.model["num_hidden_layers"]), {1: "swa", 4: "c4", 128: "c128"}
        main = sorted(set(m.ratios[:n_main]))
        self.layers = [(kinds[r], r) for r in main]
        # The MTP layer follows the main ones in compress_ratios (ratio 0, SWA-only, in both examples): its
        # attention is of a main type when one has its ratio (Flash), else a type of its own (Pro).
        self.mtp_kind = None
        if m.num_nextn_predict_layers > 0:
            mtp_ratio = m.ratios[n_main] if len(m.ratios) > n_main else 1
            self.mtp_kind = kinds[mtp_ratio] if mtp_ratio in main else "mtp"
            self.layers += [("mtp", mtp_ratio)] * (mtp_ratio not in main)
        self._caches()
        self._buffers()
        self.draft = DSparkDraft.from_config(self.cfg, m) if self.has("prepare_dspark_inputs") else None
        if self.draft is not None:
            self._draft_buffers(self.draft)

    def _draft_buffers(self, d: DSparkDraft) -> None:
        """The DSpark speculator's persistent buffers, sized by the config (their sizes are key fields), and the
        target's request states (last sampled and next prefill tokens, sampling parameters)."""
        srv, dev = self.cfg.serving, self.dev
        self.draft_reqs, self.draft_tokens = int(srv["max_num_seqs"]), int(srv["max_num_batched_tokens"])
        self.draft_buf = DraftInputs.zeros(self.draft_reqs, self.draft_tokens, d.num_tokens, dev)
        reqs, gen = self.draft_reqs, self.gen
        self.req_states = (
            torch.randint(0, 1 << 17, (reqs, 1), generator=gen, device=dev, dtype=I64),  # last sampled
            torch.randint(0, 1 << 17, (1, reqs), generator=gen, device=dev, dtype=I32),  # next prefill tokens
            torch.rand(reqs, generator=gen, device=dev),  # temperature
            torch.randint(0, 1 << 40, (reqs,), generator=gen, device=dev, dtype=I64),  # seeds
        )
        rows = max(self.lim.max_tokens, self.lim.max_seqs * d.num_query_per_req)
        self.draft_swa = (
            torch.zeros(rows, 1, d.index_width, dtype=I32, device=dev),  # decode_swa_indices_noncausal
            torch.zeros(rows, dtype=I32, device=dev),  # decode_swa_lens
        )

    def _caches(self) -> None:
        """Compressed caches' tables, fp8_ds_mla and indexer pages, compressor states, RoPE caches, weights."""
        m, pages, width = self.m, self.lim.num_blocks, block_table_width(self.lim.max_model_len, KV)
        c4 = self.tables[KV] if KV in self.tables else self.block_table(width)  # the slot-mapped group
        self.ctables = {"c4": c4, "c128": self.block_table(width), "indexer": self.block_table(width)}
        self.page = {r: compressed_block_size(self.cfg, r) for r in self.ratios}  # compressed tokens per page
        self.fp8 = {r: fp8_ds_mla_cache(pages, self.page[r], self.gen, self.dev) for r in self.ratios}
        self.fp8[1] = fp8_ds_mla_cache(pages, SWA, self.gen, self.dev)  # ratio 1: the SWA cache
        # FP8: K bytes + a 4-byte scale; MXFP4 (serving.indexer_kv_dtype): packed E2M1 + a UE8M0 byte per 32 dims
        self.fp4 = mxfp4_indexer(self.cfg, m, self.plan.platform)
        per_page, row = compressed_block_size(self.cfg, 4), token_bytes(m.index_head_dim, self.fp4)
        stride = indexer_page_stride(self.cfg, per_page, m.index_head_dim, fp4=self.fp4)
        backing = torch.zeros(pages * stride, dtype=U8, device=self.dev)
        self.index_cache = backing.as_strided((pages, per_page, row), (stride, row, 1))
        # compressor states: head (coff * head_dim; coff 2 for C4's overlapping windows), ratio, state page size
        heads = {
            "c4": (2 * m.head_dim, 4, STATE[4]),
            "index": (2 * m.index_head_dim, 4, STATE[4]),
            "c128": (m.head_dim, 128, STATE[128]),
        }
        self.states = {k: self.randn(pages, page, 2 * h, dtype=F32) for k, (h, _, page) in heads.items()}
        self.ape = {k: self.randn(r, h, dtype=F32, scale=0.1) for k, (h, r, _) in heads.items()}
        rows, model = self.lim.max_seq_len, self.cfg.model
        main = rope_cache(rows, m.qk_rope_head_dim, float(model.get("rope_theta", 10000)), self.dev)
        compress = rope_cache(rows, m.qk_rope_head_dim, float(model.get("compress_rope_theta", 160000)), self.dev)
        self.rope = {1: main, **{r: compress for r in self.ratios}}  # SWA-only layers: plain RoPE
        self.index_norm = self.randn(m.index_head_dim).add_(1)
        self.mtp_w = [self.randn(m.hidden_size, scale=0.1).add_(1) for _ in range(3)]

    def _buffers(self) -> None:
        """The metadata builders' persistent buffers (stable addresses for CUDA graphs)."""
        rows, dev, wmax = self.lim.max_tokens, self.dev, c128_max_width(self.lim.max_model_len)
        self.cbuf = {site: torch.full((rows,), -1, dtype=I64, device=dev) for site in ("c4", "c128", "indexer")}
        self.c128_buf = {
            "global_decode": torch.empty(rows, wmax, dtype=I32, device=dev),
            "decode_lens": torch.empty(rows, dtype=I32, device=dev),
            "prefill_local": torch.empty(rows, wmax, dtype=I32, device=dev),
        }
        self.topk_buf = torch.full((rows, self.m.index_topk), -1, dtype=I32, device=dev)
        self.pooled_k = torch.zeros(rows, self.m.index_head_dim, dtype=BF16, device=dev)  # ROCm MXFP4's workspace
        self.uniform_buf = {
            "decode_seq_lens": torch.empty(rows, dtype=I32, device=dev),
            "expanded_block_table": torch.empty(rows, self.ctables["indexer"].shape[1], dtype=I32, device=dev),
            "decode_lens": torch.empty(rows, dtype=I32, device=dev),
        }

    def has(self, short: str) -> bool:
        return DSV4_PREFIX + short in self.names

    def k(self, short: str) -> Any:
        return self.kernel(DSV4_PREFIX + short)

    def layer_types(self) -> list[str]:
        mtp = {self.mtp_kind: ", and the MTP layer"} if self.mtp_kind != "mtp" else {}
        return [f"{kind} (ratio {r}{mtp.get(kind, '')})" for kind, r in self.layers]

    # -- the step ------------------------------------------------------------------------------------------------
    def run(self, st: Step) -> None:
        for bs in self.groups:
            self.slot_mapping(st, bs)
        self.compressed_slots(st)
        self.c128a(st)
        self.decode_swa(st)
        self.swa_prefill_metadata(st)
        self.uniform_decode(st)
        for kind, ratio in self.layers:
            self.layer(st, kind, ratio)
        if self.draft is not None:
            self.dspark_draft(st, self.draft)

    def dspark_draft(self, st: Step, d: DSparkDraft) -> None:
        """The DSpark draft step after the target step: its inputs (one launch for the SWA group), its non-causal
        SWA metadata, then the draft layers on ``Nq`` query tokens a request. Decode requests rejected some of their
        drafts; a prefill chunk sampled a token (its last chunk) or none (chunked prefill)."""
        b, rng = st.batch, self.rng
        reqs = len(b.qlens)
        nrej = [rng.randint(0, q - 1) if i < b.num_decodes else 0 for i, q in enumerate(b.qlens)]
        sampled = [q - r if i < b.num_decodes else rng.randint(0, 1) for i, (q, r) in enumerate(zip(b.qlens, nrej))]
        states = torch.randperm(self.draft_reqs, generator=self.gen, device=self.dev)[:reqs].to(I64)
        args = (
            st.positions, st.qsl, states, self.req_states[0], self.req_states[1],
            torch.tensor(sampled, dtype=I32, device=self.dev), torch.tensor(nrej, dtype=I32, device=self.dev),
            self.req_states[2], self.req_states[3], self.tables[SWA],
        )  # fmt: skip
        kw: dict[str, Any] = dict(
            num_reqs=reqs, block_size=SWA, parallel_drafting_token_id=d.noise_token_id,
            num_query_per_req=d.num_query_per_req, num_speculative_steps=d.num_tokens, max_num_reqs=self.draft_reqs,
            max_num_tokens=self.draft_tokens, max_model_len=self.lim.max_model_len,
            sample_from_anchor=d.sample_from_anchor,
        )  # fmt: skip
        out = self.launch(
            DSV4_PREFIX + "prepare_dspark_inputs",
            f"{reqs} requests, max_q {max(b.qlens)}",
            lambda: self.k("prepare_dspark_inputs")(*args, **kw, max_query_len=max(b.qlens), out=self.draft_buf),
            fallback=lambda: prepare_dspark_inputs_reference(self.draft_buf, *args, **kw),
            ref=lambda: prepare_dspark_inputs_reference(self.draft_buf, *args, **kw),
        )
        nq = d.num_query_per_req
        T = reqs * nq
        qsl, seqs = out.query_start_loc[: reqs + 1], out.seq_lens[:reqs]
        tok2req = torch.arange(reqs, dtype=I32, device=self.dev).repeat_interleave(nq)
        valid = out.query_slot_mapping[:T] >= 0
        sw_args = (qsl, seqs, tok2req, valid, self.tables[SWA])
        sw_kw = dict(num_tokens=T, window_size=self.window, index_width=d.index_width, block_size=SWA)
        self.draft_swa[1][T:] = 0  # the builder zeroes the lens past the decode tokens first
        self.launch(
            DSV4_PREFIX + "dspark_noncausal_swa_indices",
            f"draft: {reqs} requests x {nq} tokens, W={d.index_width}",
            lambda: self.k("dspark_noncausal_swa_indices")(*sw_args, **sw_kw, out=self.draft_swa),
            ref=lambda: dspark_swa_indices_reference(*sw_args, **sw_kw),
        )
        seq_host = seqs.tolist()
        draft = Batch("draft", tuple(seq_host), (nq,) * reqs, (0,) * reqs, reqs)
        dst = step_tensors(draft, self.window, self.dev)
        m = self.m
        for ratio in sorted(set(d.ratios)):  # the SWA-only draft layers run as an SWA-only layer on the draft tokens
            if ratio == 1:
                self.layer(dst, "dspark draft", 1)
            else:
                self.qkv_norm(dst, "dspark draft", m.q_lora_rank, m.head_dim, m.q_lora_rank + m.head_dim, m.rms_norm_eps)

    def layer(self, st: Step, kind: str, ratio: int) -> None:
        """One layer of a type: Q/KV norm, compressor and indexer, sparse prefill, inverse RoPE; for the type of the
        MTP layer's attention, the MTP input norm before and the shared-head norm after."""
        m, T = self.m, st.batch.tokens
        if kind == self.mtp_kind and self.has("mtp_input_rmsnorm"):
            embeds, residual = self.randn(T, m.hidden_size, scale=3), self.randn(T, m.hc_mult * m.hidden_size, scale=3)
            args = (embeds, st.positions, residual, self.mtp_w[0], self.mtp_w[1], m.rms_norm_eps)
            self.launch(DSV4_PREFIX + "mtp_input_rmsnorm", "mtp layer", lambda: self.k("mtp_input_rmsnorm")(*args))
        self.qkv_norm(st, kind, m.q_lora_rank, m.head_dim, m.q_lora_rank + m.head_dim, m.rms_norm_eps)
        if ratio > 1:
            self.save_states(st, f"c{ratio}")
        if ratio == 4:
            self.indexer(st)
        self.sparse_prefill(st, kind, ratio)
        if self.has("inv_rope_fp8_quant"):
            o = self.randn(T, m.num_attention_heads // self.tp, m.head_dim, scale=3)
            inv_args = (o, st.positions, self.rope[ratio], m.o_groups // self.tp)
            self.launch(
                DSV4_PREFIX + "inv_rope_fp8_quant",
                f"{kind} layer",
                lambda: self.k("inv_rope_fp8_quant")(*inv_args, quantize=self.quantize),
            )
        if kind == self.mtp_kind and self.has("mtp_shared_head_rmsnorm"):
            x = self.randn(T, m.hidden_size, scale=3)
            self.launch(
                DSV4_PREFIX + "mtp_shared_head_rmsnorm",
                "mtp layer",
                lambda: self.k("mtp_shared_head_rmsnorm")(x, self.mtp_w[2], m.rms_norm_eps),
            )

    # -- per-step metadata ---------------------------------------------------------------------------------------
    def compressed_slots(self, st: Step) -> None:
        """Compressed slots: the sparse-MLA builder's per ratio (no DCP) and the C4 indexer's (the config's DCP)."""
        if CSLOTS not in self.names or KV not in st.slots:
            return
        dcp = int(self.cfg.serving.get("decode_context_parallel_size", 1) or 1)
        interleave = int(self.cfg.serving.get("cp_kv_cache_interleave_size", 1) or 1)
        sites = [(f"c{r}", r, 1, 1) for r in self.ratios] + [("indexer", 4, dcp, interleave)] * (4 in self.ratios)
        for site, ratio, world, inter in sites:
            self._compressed_site(st, site, ratio, world, inter)

    def _compressed_site(self, st: Step, site: str, ratio: int, world: int, interleave: int) -> None:
        b, uncompressed, bs = st.batch, st.slots[KV], self.page[ratio]
        table, buf = self.ctables[site][: len(b.qlens)], self.cbuf[site]  # the grid is the table's rows

        def torch_cslots() -> torch.Tensor:  # without DCP, which the DeepSeek-V4 indexer rejects
            state = st.positions // ratio
            ok = ((st.positions + 1) % ratio == 0) & (uncompressed != -1)
            slots = table.long()[st.token_to_req.long(), state // bs] * bs + state % bs
            buf[:] = -1
            buf[: b.tokens] = torch.where(ok, slots, -1)
            return buf[: b.tokens]

        kw = dict(
            num_tokens=b.tokens, block_size=bs, compress_ratio=ratio, dcp_world_size=world, cp_interleave=interleave
        )
        st.cslots[site] = self.launch(
            CSLOTS,
            f"{site} site (ratio {ratio})",
            lambda: self.kernel(CSLOTS)(uncompressed, st.qsl, st.seq_lens, table, out=buf, **kw),
            fallback=torch_cslots,
            ref=lambda: compressed_slot_mapping_reference(uncompressed, st.qsl, st.seq_lens, table, **kw),
        )

    def c128a(self, st: Step) -> None:
        """C128A top-k metadata (decode global slots and lens, prefill local indices) at the step's C128 width."""
        if 128 not in self.ratios:
            return
        b = st.batch
        nd, width = b.decode_tokens, c128_active_width(max(b.seqs), self.lim.max_model_len)
        args = (st.positions, st.token_to_req, self.ctables["c128"][: b.num_decodes], st.slots[KV])
        kw = dict(num_decode_tokens=nd, max_compressed_tokens=width, block_size=self.page[128])

        def torch_local() -> tuple[None, None, torch.Tensor]:
            n = ((st.positions[nd:] + 1) // 128).clamp(max=width)
            j = torch.arange(width, device=self.dev)[None, :]
            return None, None, torch.where(j < n[:, None], j, -1).to(I32)

        if not self.has("c128a_topk_metadata"):
            st.prefill_local = torch_local()[2]
            return
        st.prefill_local = self.launch(
            DSV4_PREFIX + "c128a_topk_metadata",
            f"W={width}",
            lambda: self.k("c128a_topk_metadata")(*args, **kw, **self.c128_buf),
            fallback=torch_local,
            ref=lambda: c128_topk_metadata_reference(*args, **kw),
        )[2]

    def decode_swa(self, st: Step) -> None:
        """The decode tokens' SWA-cache slots and lens (both sparse backends)."""
        b = st.batch
        if not self.has("decode_swa_indices") or not b.decode_tokens or SWA not in st.slots:
            return
        args = (st.positions, st.token_to_req, st.slots[SWA] >= 0, self.tables[SWA], st.replay)
        kw = dict(num_tokens=b.decode_tokens, window_size=self.window, index_width=self.window, block_size=SWA)
        self.launch(
            DSV4_PREFIX + "decode_swa_indices",
            "decode tokens",
            lambda: self.k("decode_swa_indices")(*args, **kw),
            ref=lambda: decode_swa_indices_reference(*args, **kw),
        )

    def swa_prefill_metadata(self, st: Step) -> None:
        """The prefills' sparse-SWA gather lens, which the gathers and the combines read."""
        b = st.batch
        if not b.num_prefills:
            return
        host = torch.tensor(st.gather_host, dtype=I32, device=self.dev)
        if not self.has("sparse_swa_prefill_metadata"):
            st.gather_lens = host
            return
        args = (st.seq_lens, st.qsl, st.replay)
        kw = dict(num_decodes=b.num_decodes, num_prefills=b.num_prefills, window_size=self.window)
        st.gather_lens = self.launch(
            DSV4_PREFIX + "sparse_swa_prefill_metadata",
            f"{b.num_prefills} prefills",
            lambda: self.k("sparse_swa_prefill_metadata")(*args, **kw),
            fallback=lambda: host,
            ref=lambda: sparse_swa_prefill_metadata_reference(*args, **kw),
        )

    def uniform_decode(self, st: Step) -> None:
        """The C4 indexer's uniform-decode flattening (only when every decode request has D tokens)."""
        b, d = st.batch, st.batch.uniform_decode_len
        if not self.has("prepare_uniform_decode") or not d or not b.num_decodes:
            return
        seq_lens, table = st.seq_lens[: b.num_decodes], self.ctables["indexer"]
        self.launch(
            DSV4_PREFIX + "prepare_uniform_decode",
            f"D={d}",
            lambda: self.k("prepare_uniform_decode")(seq_lens, table, max_decode_len=d, **self.uniform_buf),
        )

    # -- per layer type ------------------------------------------------------------------------------------------
    def save_states(self, st: Step, state: str) -> None:
        """A compressor's save of ``kv`` and ``score + ape`` (column views of its fp32 projection) into its states."""
        cache, ape = self.states[state], self.ape[state]
        head, page, T = ape.shape[1], cache.shape[1], st.batch.tokens
        if SAVE not in self.names or page not in st.slots:
            return
        kv_score = self.randn(T, 2 * head, dtype=F32)
        args = (kv_score[:, :head], kv_score[:, head:], ape, st.positions, st.slots[page], cache)
        self.launch(SAVE, f"{state} compressor (head {head})", lambda: self.kernel(SAVE)(*args))

    def indexer(self, st: Step) -> None:
        """The C4 indexer: its compressor (save, compress + insert), Q RoPE + quant, top-k, prefill metadata."""
        b, T = st.batch, st.batch.tokens
        self.save_states(st, "index")
        self._index_insert(st)
        self._compress_pool(st)
        self._q_mxfp4(st)
        if self.has("indexer_q_rope_quant"):
            h, d = self.m.index_n_heads, self.m.index_head_dim
            args = (st.positions, self.randn(T, h, d, scale=2), self.rope[4], self.randn(T, h), d**-0.5, h**-0.5)
            q = self.launch(
                DSV4_PREFIX + "indexer_q_rope_quant", "c4 indexer", lambda: self.k("indexer_q_rope_quant")(*args)
            )
            if q is not None:
                self.pack_q(st, q[0])
        st.topk = self.local_topk(st)
        self.unpack_topk(st)
        if self.has("global_topk_indices") and KV in st.slots:
            valid = st.slots[KV] >= 0
            spans = [(0, b.decode_tokens, "decode")] + [(b.decode_tokens, T, "FlashInfer prefill")] * self.flashinfer
            for lo, hi, what in spans:
                if hi > lo:
                    self._global_topk(st.topk[lo:hi], st.token_to_req[lo:], valid[lo:], what)
        if self.has("indexer_prefill_chunk_metadata"):
            for a, e, cuts in self.indexer_chunks(b):
                for qs0, qs1 in cuts:
                    self._chunk_metadata(st, a, e, qs0, qs1)

    def decode_lens(self, st: Step) -> tuple[list[int], torch.Tensor] | None:
        """The decode lengths (host and device) when they differ: the native decode's padded path, else None."""
        lens = list(st.batch.qlens[: st.batch.num_decodes])
        return (lens, torch.tensor(lens, dtype=I32, device=self.dev)) if len(set(lens)) > 1 else None

    def pack_q(self, st: Step, q_fp8: torch.Tensor) -> None:
        """The padded decode's pack of the FP8 Q ``q_fp8[:Td]`` (``[Td, H * D]``) into ``[B, Lmax, H, D]``."""
        dec = self.decode_lens(st)
        if dec is None or not self.has("pack_seq"):
            return
        x = q_fp8[: st.batch.decode_tokens].reshape(st.batch.decode_tokens, -1)
        self.launch(
            DSV4_PREFIX + "pack_seq",
            f"decode lens {dec[0]}",
            lambda: self.k("pack_seq")(x, dec[1], lengths_host=dec[0]).view(len(dec[0]), max(dec[0]), *q_fp8.shape[1:]),
        )  # no reference check: the -inf pad has no e4m3fn encoding (the plugin's tests mask those slots)

    def unpack_topk(self, st: Step) -> None:
        """The padded decode's unpack of the top-k of the ``B * next_n`` packed rows back into the buffer's ``[:Td]``."""
        dec = self.decode_lens(st)
        if dec is None or st.topk is None or not self.has("unpack_seq"):
            return
        nd, next_n = st.batch.decode_tokens, 1 + self.lim.spec
        # what the top-k of the padded rows writes: the decode rows' indices, -1 in the pad rows
        packed = torch.full((len(dec[0]), next_n, self.m.index_topk), -1, dtype=I32, device=self.dev)
        packed[:, : max(dec[0])] = pack_seq_reference(st.topk[:nd], dec[1], pad_value=-1)
        out = self.launch(
            DSV4_PREFIX + "unpack_seq",
            f"decode lens {dec[0]}",
            lambda: self.k("unpack_seq")(packed, dec[1], lengths_host=dec[0]),
            fallback=lambda: unpack_seq_reference(packed, dec[1]),
            ref=lambda: unpack_seq_reference(packed, dec[1]),
        )
        st.topk[:nd].copy_(out)

    def _index_insert(self, st: Step) -> None:
        """The indexer compressor's fused compress + RMSNorm + RoPE + FP8 quant + insert (of closing windows)."""
        if not self.has("indexer_kv_compress_insert") or STATE[4] not in st.slots or "indexer" not in st.cslots:
            return
        args = (
            self.states["index"], self.tables[STATE[4]], st.token_to_req, st.positions, st.slots[STATE[4]],
            st.cslots["indexer"], self.index_norm, self.rope[4], self.index_cache, self.m.rms_norm_eps,
        )  # fmt: skip
        self.launch(
            DSV4_PREFIX + "indexer_kv_compress_insert",
            "c4 indexer" + " (MXFP4)" * self.fp4,
            lambda: self.k("indexer_kv_compress_insert")(*args, compress_ratio=4, use_fp4_cache=self.fp4),
        )

    def _compress_pool(self, st: Step) -> None:
        """ROCm's MXFP4 indexer compressor: the pooling of closing windows into the persistent bf16 workspace."""
        if not self.has("compress_pool") or STATE[4] not in st.slots or "indexer" not in st.cslots:
            return
        T = st.batch.tokens
        args = (self.states["index"], st.token_to_req, st.positions, st.cslots["indexer"], self.tables[STATE[4]], STATE[4])
        self.launch(
            DSV4_PREFIX + "compress_pool",
            "c4 indexer (ROCm MXFP4)",
            lambda: self.k("compress_pool")(*args, self.pooled_k[:T]),
            ref=lambda: compress_pool_reference(*args, self.pooled_k[:T].clone()),
        )

    def _q_mxfp4(self, st: Step) -> None:
        """The C4 indexer's Q RoPE + MXFP4 quant (CUDA SM10x without CuTeDSL); SM10x never pads, so no pack."""
        if not self.has("indexer_q_rope_mxfp4"):
            return
        T, h, d = st.batch.tokens, self.m.index_n_heads, self.m.index_head_dim
        args = (st.positions, self.randn(T, h, d, scale=2), self.rope[4], self.randn(T, h), d**-0.5, h**-0.5)

        def flat(out: Any) -> tuple[torch.Tensor, ...]:
            (packed, scale), w = out
            return packed, scale, w

        self.launch(
            DSV4_PREFIX + "indexer_q_rope_mxfp4",
            "c4 indexer",
            lambda: flat(self.k("indexer_q_rope_mxfp4")(*args)),
            ref=lambda: flat(indexer_q_rope_mxfp4_reference(*args)),
            tol=(0.0, 0.0),  # bit-exact: the same fp32 RoPE, exact E2M1 and UE8M0 on both sides
        )

    def local_topk(self, st: Step) -> torch.Tensor:
        """What the indexer's top-k writes into its buffer: ``min((pos+1)//4, topk)`` causal local indices, then -1."""
        T, k = st.batch.tokens, self.m.index_topk
        n = (st.positions + 1) // 4
        vals = (torch.rand(T, k, generator=self.gen, device=self.dev) * n[:, None]).long()
        live = torch.arange(k, device=self.dev)[None, :] < n.clamp(max=k)[:, None]
        return self.topk_buf[:T].copy_(torch.where(live, vals, -1))

    def _global_topk(self, topk: torch.Tensor, token_to_req: torch.Tensor, valid: torch.Tensor, what: str) -> None:
        args, bs = (topk, token_to_req, self.ctables["c4"], valid), self.page[4]
        self.launch(
            DSV4_PREFIX + "global_topk_indices",
            what,
            lambda: self.k("global_topk_indices")(*args, block_size=bs),
            ref=lambda: global_topk_indices_reference(*args, block_size=bs),
        )

    def indexer_chunks(self, b: Batch) -> list[tuple[int, int, list[tuple[int, int]]]]:
        """The indexer's prefill chunks ``(a, e, query slices)``: requests packed while their compressed K rows fit
        the workspace and the logits (``tokens * rows * 4`` bytes) the budget."""
        out = []
        start, rows, toks = b.num_decodes, 0, 0
        for r in range(b.num_decodes, len(b.qlens)):
            k, q = b.seqs[r] // 4, b.qlens[r]
            over = rows + k > self.lim.workspace_rows or (toks + q) * (rows + k) * 4 > self.lim.logits_bytes
            if r > start and over:
                out.append(self._cut(start, r, toks, rows))
                start, rows, toks = r, 0, 0
            rows, toks = rows + k, toks + q
        if len(b.qlens) > start:
            out.append(self._cut(start, len(b.qlens), toks, rows))
        return out

    def _cut(self, a: int, e: int, toks: int, rows: int) -> tuple[int, int, list[tuple[int, int]]]:
        """A chunk's query slices: all of it, or (one request alone over the logits budget) cuts along M."""
        if toks * rows * 4 <= self.lim.logits_bytes:
            return a, e, [(0, toks)]
        m = max(1, self.lim.logits_bytes // (4 * rows))
        return a, e, [(s, min(s + m, toks)) for s in range(0, toks, m)]

    def _chunk_metadata(self, st: Step, a: int, e: int, qs0: int, qs1: int) -> None:
        qsl = st.qsl[a : e + 1] - st.qsl[a]  # rebased to the chunk: a fresh tensor
        compressed = [0] + [s // 4 for s in st.batch.seqs[a:e]]
        cu = torch.tensor(compressed, dtype=I64).cumsum(0).to(I32).to(self.dev)
        interleave = int(self.cfg.serving.get("cp_kv_cache_interleave_size", 1) or 1)
        kw = dict(
            num_compressed_rows=sum(compressed), query_slice_start=qs0, query_slice_stop=qs1, compress_ratio=4,
            dcp_interleave=interleave,
        )  # fmt: skip
        self.launch(
            DSV4_PREFIX + "indexer_prefill_chunk_metadata",
            f"requests [{a}, {e}), query slice [{qs0}, {qs1})",
            lambda: self.k("indexer_prefill_chunk_metadata")(qsl, st.seq_lens[a:e], cu, **kw),
        )

    def sparse_prefill(self, st: Step, kind: str, ratio: int) -> None:
        """Sparse prefill of one layer type, chunk by chunk: gather the compressed entries (rows ``[0, N)``) and the
        SWA rows (from row ``N``) into a bf16 workspace of ``M`` rows per request, then combine the indices."""
        b = st.batch
        if not b.num_prefills or st.gather_lens is None or not ({GATHER, COMBINE} & self.names):
            return
        nd, densest = b.num_decodes, min(self.ratios, default=0)  # the chunks fit the layer type with most rows
        rows = [(s // densest if densest else 0) + g for s, g in zip(b.seqs[nd:], st.gather_host)]
        for a, e in _chunks(rows, self.lim.workspace_rows):
            a, e = a + nd, e + nd
            n = max(s // ratio for s in b.seqs[a:e]) if ratio > 1 else 0
            m = n + max(st.gather_host[a - nd : e - nd])
            lens = st.gather_lens[a - nd : e - nd]
            where = f"{kind} layer, requests [{a}, {e}), M={m}, N={n}"
            if GATHER in self.names:
                self._gathers(st, where, ratio, a, e, (n, m), lens)
            if COMBINE in self.names:
                self._combine(st, where, ratio, a, e, (n, m), lens)

    def _gathers(
        self, st: Step, where: str, ratio: int, a: int, e: int, nm: tuple[int, int], lens: torch.Tensor
    ) -> None:
        (n, m), gather = nm, self.kernel(GATHER)
        out = torch.empty(e - a, m, HEAD_DIM, dtype=BF16, device=self.dev)  # the chunk's workspace
        if ratio > 1:
            seqs, table, cache = st.seq_lens[a:e] // ratio, self.ctables[f"c{ratio}"][a:e], self.fp8[ratio]
            self.launch(
                GATHER,
                f"{where}, compressed cache",
                lambda: gather(out, cache, seqs, table, block_size=self.page[ratio]),
            )
        args = (out, self.fp8[1], st.seq_lens[a:e], self.tables[SWA][a:e])
        self.launch(GATHER, f"{where}, SWA cache", lambda: gather(*args, block_size=SWA, offset=n, gather_lens=lens))

    def _combine(
        self, st: Step, where: str, ratio: int, a: int, e: int, nm: tuple[int, int], lens: torch.Tensor
    ) -> None:
        b, (n, m) = st.batch, nm
        t0, t1, nd = sum(b.qlens[:a]), sum(b.qlens[:e]), b.decode_tokens
        topk = {1: None, 4: st.topk, 128: st.prefill_local}[ratio]
        if topk is not None:  # rows of the chunk's tokens (C128A's prefill rows start after the decode tokens)
            shift = nd if ratio == 128 else 0
            topk = topk[t0 - shift : t1 - shift]
        elif ratio > 1:
            return
        args = (topk, st.qsl[a : e + 1], st.seq_lens[a:e], lens)
        kw = dict(num_tokens=t1 - t0, compress_ratio=ratio, M=m, N=n)
        self.launch(
            COMBINE,
            where,
            lambda: self.kernel(COMBINE)(*args, **kw),
            ref=lambda: combine_topk_swa_indices_reference(*args, **kw, window_size=self.window),
        )


class KimiSweep(Sweep):
    """Kimi-K3: the MLA layers' slot mapping and Q/KV RMSNorm, the KDA layers' recurrent decode step, and the
    attention residuals of the decoder layers (each distinct call site of the forward once a step)."""

    def __init__(self, plan: warmreg.Plan, dev: torch.device, lim: Limits, seed: int) -> None:
        super().__init__(plan, dev, lim, seed)
        text = self.cfg.text
        self.q, self.kv, rope = int(text["q_lora_rank"]), int(text["kv_lora_rank"]), int(text["qk_rope_head_dim"])
        self.eps = float(text.get("rms_norm_eps", 1e-6))
        self.widths = [self.q + self.kv + rope]  # the qkv_a projection: [q_lora | kv_lora | rope]
        if text.get("mla_use_output_gate"):  # ... and the output gate's local heads * v_head_dim when it shares it
            tp = int(self.cfg.serving.get("tensor_parallel_size", 1))
            self.widths.append(self.widths[0] + int(text["num_attention_heads"]) // tp * int(text["v_head_dim"]))
        self.layers = [("mla", 0)] * (NORM in self.names) + [("kda", 0)] * (KDA in self.names)
        self.conv_names = [n for n in (CONV, CONV_UPDATE) if n in self.names]
        if self.conv_names:
            self.layers.append(("conv", 0))
            lay = self.kernel(self.conv_names[0]).layout
            self.conv_layout, self.conv_row = lay, projection_row_stride(lay)
            rows = lay.conv_width - 1 + lay.num_speculative_tokens
            # One KDA layer's conv state in vLLM's default (state_len, dim) layout, as the layer transposes it;
            # line 0 is the null block, so requests take lines 1.. (a line a request).
            packed = self.randn(lim.max_seqs + 1, rows, 3 * lay.projection_size)
            self.conv_state = packed.transpose(1, 2)
            self.conv_weight = self.randn(3 * lay.projection_size, lay.conv_width, dtype=F32, scale=0.5)
        self.layers += [("kda_chunk", 0)] * (KDA_CHUNK[0] in self.names)
        if KDA in self.names or KDA_PACKED in self.names:  # the speculative step's, or the plain decode's, layout
            kda = self.kernel(KDA) if KDA in self.names else KDARecurrent.from_layout(
                self.kernel(KDA_PACKED).layout, max_num_seqs=lim.max_seqs)  # fmt: skip
            self.hkv = (kda.num_heads, kda.head_k_dim, kda.head_v_dim)
            # vLLM's recurrent pool [slots, H, V, K]: a slot per state column of a request (1 + spec), slot 0 the null
            self.pool = self.randn(lim.max_seqs * (1 + lim.spec) + 1, kda.num_heads, kda.head_v_dim, kda.head_k_dim,
                                   dtype=F32, scale=0.1)  # fmt: skip
            # The layer's fp32 parameters (A_log [H], dt_bias [H * K]) and the configured gate lower bound.
            h, dk = kda.num_heads, kda.head_k_dim
            a_log = torch.rand(h, generator=self.gen, device=self.dev).mul_(1.5).add_(0.5).log_()  # exp in [0.5, 2)
            dt_bias = self.randn(h * dk, dtype=F32, scale=0.5) if kda.has_dt_bias else None
            self.gate = (a_log, dt_bias, kda.lower_bound)
            self.raw_dtypes = (kda.gate_dtype, kda.beta_dtype)
        self.kda_tables()
        if KDA_CHUNK[0] in self.names:  # the chunked prefill shares the decode step's pool and parameters
            stage = self.kernel(KDA_CHUNK[0])
            self.chunk_hkv = (stage.num_heads, stage.head_dim, stage.head_dim)
            if KDA not in self.names:
                self.pool = self.randn(lim.max_seqs + 1, *self.chunk_hkv, dtype=F32, scale=0.1)
                a_log = torch.rand(stage.num_heads, generator=self.gen, device=self.dev).mul_(1.5).add_(0.5).log_()
                self.gate = (
                    a_log,
                    self.randn(stage.num_heads * stage.head_dim, dtype=F32, scale=0.5),
                    stage.lower_bound,
                )
        if ATTN_RES in self.names:
            self.layers.append(("attn_res", 0))
            ar = self.kernel(ATTN_RES)
            d = ar.hidden_size
            # The engine's persistent buffers, sliced to a step's tokens: the running block sum [T, D] and the
            # residual buffer [T, max_blocks, D]; the layers' norm weights and pseudo-query (one set: pointers).
            self.ar_prefix = self.randn(lim.max_tokens, d)
            self.ar_blocks = self.randn(lim.max_tokens, ar.max_blocks, d)
            self.ar_weights = (self.randn(d, scale=0.1).add_(1), self.randn(d, scale=0.02), self.randn(d).add_(1))

    def kda_tables(self) -> None:
        """The KDA group's persistent block table (one state block per ``block_size`` tokens, plus the drafts'),
        the graph buffers the spec-decode metadata is staged into, and the layer's state pool and norm weight."""
        lim, spec = self.lim, self.lim.spec
        self.kda_bs = int(self.cfg.serving["block_size"])
        self.kda_table = self.block_table(block_table_width(lim.max_model_len, self.kda_bs) + spec)
        rows = lim.max_seqs * (1 + spec)  # the builder's decode_cudagraph_max_bs
        self.staged = (
            torch.zeros(rows, 1 + spec, dtype=I32, device=self.dev),
            torch.zeros(rows + 1, dtype=I32, device=self.dev),
            torch.ones(rows, dtype=I32, device=self.dev),
        )
        if KDA_GATHER in self.names or KDA_NORM in self.names:
            norm = self.kernel(KDA_NORM if KDA_NORM in self.names else KDA_GATHER)
            h, d = norm.num_heads, norm.head_dim
            if KDA not in self.names:
                self.pool = self.randn(lim.max_seqs + 1, h, d, d, dtype=F32, scale=0.1)
            self.o_norm_w = self.randn(d, scale=0.2).add_(1)

    def run(self, st: Step) -> None:
        for bs in self.groups:
            self.slot_mapping(st, bs)
        state = self.aligned_state_indices(st)
        self.stage_spec_metadata(st, state)
        for kind, _ in self.layers:
            if kind == "mla":
                self.qkv_norm(st, kind, self.q, self.kv, self.rng.choice(self.widths), self.eps)
            elif kind == "kda":
                self.kda(st)
            elif kind == "conv":
                self.conv(st)
            elif kind == "kda_chunk":
                self.kda_chunk(st)
            else:
                self.attn_res(st)
        self.gather_initial_states(st, state)
        self.kda_gated_norm(st)

    def aligned_state_indices(self, st: Step) -> torch.Tensor:
        """The V1 builder's align-mode state slots ``[R, 1 + spec]``: each request's block of its last token on."""
        b, slots = st.batch, 1 + self.lim.spec
        table = self.kda_table[: len(b.qlens)]

        def torch_indices() -> torch.Tensor:
            return aligned_state_indices_reference(table, st.seq_lens, block_size=self.kda_bs, num_state_slots=slots)

        if KDA_ALIGNED not in self.names:
            return torch_indices()
        return self.launch(
            KDA_ALIGNED,
            f"{len(b.qlens)} requests, block size {self.kda_bs}",
            lambda: self.kernel(KDA_ALIGNED)(table, st.seq_lens, block_size=self.kda_bs, num_state_slots=slots),
            fallback=torch_indices,
            ref=torch_indices,
        )

    def stage_spec_metadata(self, st: Step, state: torch.Tensor) -> None:
        """A decode-only speculative step: its requests' metadata into the graph buffers, padded to a captured
        batch size (the next power of two, within the buffers)."""
        b = st.batch
        if KDA_STAGE not in self.names or b.num_prefills or not b.num_decodes:
            return
        n, rows = b.num_decodes, self.staged[0].shape[0]
        padded = min(rows, warmreg.next_pow2(n))
        accepted = torch.randint(1, 2 + self.lim.spec, (n,), generator=self.gen, device=self.dev, dtype=I32)
        staged = (self.staged[0][:padded], self.staged[1][: padded + 1], self.staged[2][:padded])
        args = (state[:n], st.qsl[: n + 1], accepted, *staged)
        self.launch(
            KDA_STAGE,
            f"{n} speculative decodes padded to {padded}",
            lambda: self.kernel(KDA_STAGE)(*args, num_spec_decodes=n),
            ref=lambda: stage_spec_decode_metadata_reference(*args, num_spec_decodes=n),
        )

    def gather_initial_states(self, st: Step, state: torch.Tensor) -> None:
        """The prefill requests' initial states: their slots are column 0 of their aligned state indices, and
        a request has one when it has computed tokens before this chunk."""
        b = st.batch
        if KDA_GATHER not in self.names or not b.num_prefills:
            return
        nd = b.num_decodes
        slots = state[nd:, 0] % self.pool.shape[0]  # the sweep's random table ids, folded into the pool
        has = torch.tensor([s > q for s, q in zip(b.seqs[nd:], b.qlens[nd:])], device=self.dev)
        args = (self.pool, slots, has)
        self.launch(
            KDA_GATHER,
            f"{b.num_prefills} prefill requests",
            lambda: self.kernel(KDA_GATHER)(*args),
            ref=lambda: gather_initial_states_reference(*args),
        )

    def kda_gated_norm(self, st: Step) -> None:
        """The KDA output's gated RMSNorm over every token; the gate a column view of the fused projection."""
        if KDA_NORM not in self.names:
            return
        norm, t = self.kernel(KDA_NORM), st.batch.tokens
        h, d = norm.num_heads, norm.head_dim
        width = self.rng.choice((projection_width(h, d), 4 * h * d))  # the usual projection, the overlap path's
        g = self.randn(t, width, scale=2.0)[:, 3 * h * d : 4 * h * d].view(t, h, d)
        args = (self.randn(1, t, h, d, scale=3.0), g, self.o_norm_w)
        self.launch(
            KDA_NORM,
            f"{t} tokens, projection width {width}",
            lambda: norm(*args),
            ref=lambda: gated_rmsnorm_reference(*args),
            tol=(1e-2, 1.6e-2),  # the plugin's tests: bf16 output, fp32 sums in different orders
        )

    def attn_res(self, st: Step) -> None:
        """Every distinct call site of the forward (before attention with its block writes, before the MLP, the
        model output), sorted by block count, on the step's tokens; the sublayer outputs are random deltas."""
        ar, t = self.kernel(ATTN_RES), st.batch.tokens
        norm_w, qk_w, out_w = self.ar_weights
        prefix, blocks = self.ar_prefix[:t], self.ar_blocks[:t]
        for site in ar.call_sites:
            args: dict[str, Any] = dict(
                prefix=prefix, delta=self.randn(t, ar.hidden_size, scale=0.1) if site.has_delta else None,
                blocks=blocks, norm_weight=norm_w, qk_weight=qk_w,
                num_blocks=site.num_blocks, block_write_idx=site.block_write_idx, eps=ar.eps,
                output_norm_weight=out_w if site.apply_output_norm else None,
                output_norm_eps=ar.output_norm_eps if site.apply_output_norm else None,
            )  # fmt: skip
            what = f"{site.num_blocks} blocks, write {site.block_write_idx}, norm {site.apply_output_norm}"
            self.attn_res_site(ar, what, args)

    def attn_res_site(self, ar: Any, what: str, args: dict[str, Any]) -> None:
        """One ``attn_res`` launch; the reference runs on copies first, then the launch updates the buffers."""
        self.launch(
            ATTN_RES,
            what,
            lambda: ar(**args),
            ref=lambda: attn_res_reference(**args)[0],
            tol=(1e-2, 1.6e-2),  # the plugin's tests: bf16 output from fp32 sums in different orders
        )

    def conv(self, st: Step) -> None:
        """The KDA layer's short convolutions on the step's packed projection ``[T, row]`` (vLLM's ``_forward``):
        the speculative rows (the decode requests, first) through the varlen update, the prefills through three
        prefill conv1d launches (q, k, v); a decode step of one-token rows through the plain-decode update when
        the plan holds it (vLLM's builder then classifies them as decodes)."""
        b, lay = st.batch, self.conv_layout
        p, spec, t = lay.projection_size, lay.num_speculative_tokens, b.tokens
        proj = self.randn(t, self.conv_row)
        perm = torch.randperm(self.conv_state.shape[0] - 1, generator=self.gen, device=self.dev)
        lines = perm[: len(b.qlens)].add_(1).to(I32)
        one_token = b.num_prefills == 0 and all(q == 1 for q in b.qlens)
        upd = self.kernel(CONV_UPDATE) if CONV_UPDATE in self.names else None
        if upd is not None and upd.plain_decode and one_token and (not spec or self.rng.random() >= 0.5):
            width = self.rng.choice([self.conv_row, 4 * p] if upd.overlap_rows else [self.conv_row])
            x = self.randn(t, width)[:, : 3 * p]
            stride = self.rng.choice(sorted({1, 1 + spec}))
            indices = self._conv_lines(lines, stride)
            conv_out = self._conv_update(f"{t} plain decode rows", x, indices)
            if KDA_PACKED in self.names:
                self.kda_packed_decode(proj, width, None if conv_out is None else conv_out[0], indices)
        elif upd is not None and spec and b.num_decodes:
            n, d = b.num_decodes, b.decode_tokens
            x = proj[:d, : 3 * p] if self.rng.random() < 0.5 else proj[:d, : 3 * p].contiguous()  # slice or gathered
            qsl = st.qsl[: n + 1].to(I32)
            accepted = torch.tensor([self.rng.randint(1, 1 + spec) for _ in range(n)], dtype=I32, device=self.dev)
            spec_args = {"num_accepted_tokens": accepted, "query_start_loc": qsl}
            self._conv_update(f"{n} speculative rows", x, self._conv_lines(lines[:n], 1 + spec), 1 + spec, spec_args)
        if b.num_prefills and CONV in self.names:
            start = b.decode_tokens if spec else 0  # without speculation the decodes are prefill rows of one token
            first = b.num_decodes if spec else 0
            rows = proj[start:]
            if spec and self.rng.random() < 0.5:
                rows = rows[:, : 3 * p].contiguous()  # a mixed batch's gathered non-speculative rows (index_select)
            qsl = (st.qsl[first:] - st.qsl[first]).to(I32)
            stride = 1 if spec and b.num_decodes else 1 + spec  # gathered rows, or block_table[:, 0]
            indices = self._conv_lines(lines[first:], stride)
            init = torch.rand(len(b.qlens) - first, generator=self.gen, device=self.dev) < 0.7
            chunks = conv1d_chunks(qsl.cpu(), device=self.dev)
            for c, name in enumerate("qkv"):
                cols = slice(c * p, (c + 1) * p)
                args = (rows[:, cols], self.conv_weight[cols], None, self.conv_state[:, cols], qsl, indices, init)
                self._conv_prefill(f"{b.num_prefills} prefills, {name}", args, chunks)

    def _conv_prefill(self, what: str, args: tuple[Any, ...], chunks: Any) -> None:
        def run() -> tuple[torch.Tensor, torch.Tensor]:
            return self.kernel(CONV)(*args, chunks=chunks), args[3]  # the output and the updated state slice

        # The plugin's tests: fp32 sums in one order, one bf16 step apart (the interpreter truncates).
        self.launch(CONV, what, run, ref=lambda: causal_conv1d_reference(*args), tol=(1e-6, 2**-7))

    def _conv_lines(self, lines: torch.Tensor, stride: int) -> torch.Tensor:
        """Cache lines as ``block_table[:, 0]`` of a table ``stride`` wide (a gathered copy when 1)."""
        table = torch.zeros((lines.shape[0], stride), dtype=I32, device=self.dev)
        table[:, 0] = lines
        return table[:, 0]

    def _conv_update(
        self, what: str, x: torch.Tensor, indices: torch.Tensor, max_len: int = -1, spec: dict[str, Any] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One conv update launch; returns ``(output, conv_state)``, or None on a miss or a failure."""
        kw = spec or {}
        args = (x, self.conv_state, self.conv_weight, None)
        def run() -> tuple[torch.Tensor, torch.Tensor]:
            out = self.kernel(CONV_UPDATE)(*args, conv_state_indices=indices, max_query_len=max_len, **kw)
            return out, self.conv_state

        return self.launch(  # type: ignore[no-any-return]
            CONV_UPDATE,
            what,
            run,
            ref=lambda: causal_conv1d_update_reference(*args, indices, **kw),
            tol=(1e-6, 2**-7),
        )

    def kda_packed_decode(
        self, proj: torch.Tensor, width: int, conv_out: torch.Tensor | None, indices: torch.Tensor
    ) -> None:
        """vLLM's plain-decode step after the conv update (``kda.py: _forward``, pure non-speculative decode): the
        packed decode on the conv's output (its ``empty_like``: ``[B, 3P]`` rows, or for a batch of one the
        projection's row stride, plain or the overlap path's ``4P``), the gate projection's rows, beta a column of
        the projection, the state indices of the conv update (now and then a padded slot 0: zeros out)."""
        lay, (h, dk, _) = self.conv_layout, self.hkv
        p, t = lay.projection_size, indices.shape[0]
        mixed = self.randn(t, 3 * p) if conv_out is None else conv_out
        if t == 1:
            row = self.randn(1, width)
            row[:, : 3 * p] = mixed
            mixed = row[:, : 3 * p]
        raw_g = self.randn(1, t, h, dk, dtype=self.raw_dtypes[0])
        raw_beta = proj[:t, 4 * p + dk : 4 * p + dk + h].unsqueeze(0)
        slots = indices.clone()
        if self.rng.random() < 0.1:
            slots[-1] = 0  # CUDA-graph padding: the null slot
        a_log, dt_bias, bound = self.gate
        bias = dt_bias if dt_bias is not None else torch.zeros(h * dk, dtype=F32, device=self.dev)
        args = (mixed, raw_g, raw_beta, a_log, bias, bound, self.pool, slots)
        self.launch(
            KDA_PACKED,
            f"{t} plain decode rows",
            lambda: self.kernel(KDA_PACKED)(*args),
            ref=lambda: kda_packed_decode_reference(*args)[0],
            tol=(1e-2, 1.6e-2),  # the plugin's tests: bf16 o, fp32 recurrences in different orders
        )

    def kda(self, st: Step) -> None:
        """vLLM's speculative-decode step over the decode requests (``kda.py: _forward``; the kernel is planned only
        under speculation): q, k, v rearranged column slices of the conv update's ``[T, 3P]`` output (for one token
        the projection row it keeps), the gate projection's rows, beta a column of the packed projection, the
        ``[N, 1 + spec]`` state indices a view of a wider table (now and then a padded request on the null slot 0,
        or a column 0: no write), accepted counts ``1 .. 1 + spec``, ``out`` a view of core_attn_out or none."""
        b, kda = st.batch, self.kernel(KDA)
        if not b.num_decodes:
            return
        (h, dk, dv), t, n, cols = self.hkv, b.decode_tokens, b.num_decodes, 1 + self.lim.spec
        width = h * (2 * dk + dv)
        conv = self.randn(t, self.rng.choice(kda.projection_rows) if t == 1 and kda.projection_rows else width)
        q, k, v = (conv[:, c : c + h * w].view(1, t, h, w) for c, w in ((0, dk), (h * dk, dk), (2 * h * dk, dv)))
        raw_g = self.randn(1, t, h, dk, dtype=self.raw_dtypes[0])  # the raw projections: gate and beta in the kernel
        row = max(width + h, *kda.projection_rows)
        raw_beta = self.randn(t, row, dtype=self.raw_dtypes[1], scale=2.0)[:, row - h :].unsqueeze(0)
        table = torch.zeros(n, cols + 2, dtype=I32, device=self.dev)
        slots = torch.randperm(self.pool.shape[0] - 1, generator=self.gen, device=self.dev)[: n * cols].add(1)
        table[:, :cols] = slots.view(n, cols)  # distinct slots: no two tokens write one
        if self.rng.random() < 0.2:
            table[self.rng.randrange(n), self.rng.randrange(cols)] = 0  # the null slot in some column: no state there
        accepted = torch.randint(1, cols + 1, (n,), generator=self.gen, device=self.dev, dtype=I32)
        out = torch.empty(1, t + 1, h, dv, dtype=q.dtype, device=self.dev)[:, :t] if self.rng.random() < 0.5 else None
        args = (q, k, v, raw_g, raw_beta, *self.gate, self.pool, st.qsl[: n + 1], table[:, :cols], accepted)
        self.launch(
            KDA,
            f"{n} speculative sequences, {t} tokens",
            lambda: kda(*args, out=out),
            ref=lambda: kda_recurrent_reference(*args)[0],
            tol=(1e-2, 1.6e-2),  # the plugin's tests: bf16 o, fp32 recurrences in different orders
        )

    def kda_chunk(self, st: Step) -> None:
        """The chunked KDA prefill over the step's prefill requests, stage by stage as
        ``warmreg_kimi_k3.kda_chunk.chunk_kda_prefill`` chains them, between the layer's gather of the initial
        states from the pool (mixed: zeros without one) and its scatter of the final states back. On the CPU
        only the L2 norm is checked against its reference: Triton 3.8.0's interpreter multiplies bf16 ``tl.dot``
        operands as raw bits, so the bf16 chain is checked by the plugin's GPU test instead."""
        b = st.batch
        if not b.num_prefills:
            return
        (h, dk, dv), nd = self.chunk_hkv, b.num_decodes
        t = b.tokens - b.decode_tokens
        q, k, v = self.randn(t, h, dk), self.randn(t, h, dk), self.randn(t, h, dv)
        raw_g, raw_beta = self.randn(t, h, dk), self.randn(t, h, scale=2.0)
        cu = (st.qsl[nd:] - st.qsl[nd]).contiguous()
        n = b.num_prefills
        slots = torch.randperm(self.pool.shape[0] - 1, generator=self.gen, device=self.dev)[:n].add_(1).to(I32)
        has_state = torch.rand(n, generator=self.gen, device=self.dev) < 0.5  # continuing chunked prefills
        initial_state = gather_initial_states_reference(self.pool, slots, has_state)  # [N, H, V, K], as vLLM's
        l2, gate, intra, wu, hs, out = (self.kernel(name) for name in KDA_CHUNK)
        what = f"{n} prefill sequences, {t} tokens"
        chunks, offsets = chunk_metadata(cu)
        qn = self.launch(KDA_CHUNK[0], what, lambda: l2(q), ref=lambda: l2norm_reference(q), tol=(1e-2, 1.6e-2))
        kn = self.launch(KDA_CHUNK[0], what, lambda: l2(k))
        gb = self.launch(
            KDA_CHUNK[1], what, lambda: gate(raw_g, raw_beta, self.gate[0], self.gate[1], self.gate[2], cu, chunks)
        )
        if qn is None or kn is None or gb is None:
            return
        g, beta = gb
        solve = platform_solve_precision(self.plan.platform)  # the planned target's (vLLM: tf32 on sm >= 80)
        aa = self.launch(
            KDA_CHUNK[2],
            what,
            lambda: intra(qn, kn, g, beta, cu, chunks, safe_gate=self.gate[2] is not None, solve_precision=solve),
        )
        wuk = self.launch(KDA_CHUNK[3], what, lambda: wu(kn, v, beta, aa[1], g, cu, chunks)) if aa is not None else None
        if wuk is None:
            return
        hv = self.launch(
            KDA_CHUNK[4], what, lambda: hs(wuk[2], wuk[0], wuk[1], g, cu, offsets, initial_state, chunks.shape[0])
        )
        if hv is None:
            return
        self.pool[slots] = hv[2]  # the layer's scatter: recurrent_state[indices] = final_state
        self.launch(KDA_CHUNK[5], what, lambda: out(qn, hv[1], g, hv[0], aa[0], cu, chunks, out=v))


# -- one config, the CLI -------------------------------------------------------------------------------------------
def run_config(
    config: str,
    *,
    steps: int,
    seed: int,
    device: str,
    max_tokens: int | None,
    pack: str | None = None,
    max_seq_len: int | None = None,
    max_seqs: int | None = None,
    target: str = CPU_TARGET,
) -> dict[str, Any]:
    """Warm ``config`` (CUDA), arm the monitor in ``error`` mode and sweep ``steps`` engine steps.

    :param device: ``"cuda"`` (warm, then the local GPU) or ``"cpu"`` (no warm, Triton's interpreter, the plan for
        ``target``).
    :param target: the plan a CPU run drives (default ``cuda:90``, the H200's; e.g. ``cuda:100`` for a config whose
        kernels only that target plans, such as an MXFP4 indexer). A CUDA run plans for its own GPU.
    :param max_tokens: cap on tokens per step (default: ``max_num_batched_tokens`` on CUDA, 4 on the CPU).
    :param pack: warm from this pack (CUDA).
    :param max_seq_len: cap on sequence lengths (default: ``max_model_len`` on CUDA, 256 on the CPU).
    :param max_seqs: cap on requests per step (default: ``max_num_seqs`` on CUDA, 4 on the CPU).
    :returns: the config's results (see the module docstring).
    :raises SweepError: for a plan kernel without a driver, or CUDA requested without a GPU.
    """
    t0, dev = time.perf_counter(), torch.device(device)
    cuda = dev.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SweepError("--device cuda needs a GPU; --device cpu runs the kernels through Triton's interpreter")
    plan = warmreg.plan(config) if cuda else warmreg.plan(config, target=target)
    undriven = sorted({kp.name for kp in plan.kernels} - DRIVERS)
    if undriven:
        raise SweepError(f"{config}: the plan has kernels this sweep has no driver for: {', '.join(undriven)}")
    warm: dict[str, Any] | str = "skipped on the CPU: kernels run through Triton's interpreter, nothing compiles"
    if cuda:
        t = time.perf_counter()
        report = warmreg.warm(config, pack=pack, on_error="continue")
        failed = [(r.kernel, str(r.key), r.error) for r in report.failed]
        warm = {"summary": report.summary(), "wall_s": time.perf_counter() - t, "failed": failed, "tuning": list(report.tuning), "tuning_s": report.tuning_seconds}
    lim = Limits.of(plan.config, cuda, max_tokens, max_seq_len, max_seqs)
    sweep = (DSV4Sweep if plan.config.model_type == "deepseek_v4" else KimiSweep)(plan, dev, lim, seed)
    rng, batches = random.Random(seed), []
    mon = warmreg.arm("error")
    try:
        for i in range(steps):
            kind = KINDS[i] if i < len(KINDS) else rng.choices(KINDS, weights=(5, 2, 3))[0]
            batches.append(make_batch(rng, kind, lim, mix_decode=i == 0))
            sweep.step(batches[-1], i)
        if cuda:
            torch.cuda.synchronize()
    finally:
        warmreg.disarm(mon)
    head = {"config": config, "device": device, "platform": plan.platform.target, "pack": pack, "warm": warm}
    body = {"limits": vars(lim), "layer_types": sweep.layer_types(), **_mix(batches), **sweep.results(mon)}
    return {**head, **body, "monitor_misses": len(mon.misses), "wall_s": time.perf_counter() - t0}


def _mix(batches: list[Batch]) -> dict[str, Any]:
    """Steps, tokens, requests and the distribution of step kinds."""
    kinds = Counter(b.kind for b in batches)
    tokens = [b.tokens for b in batches]
    return {
        "steps": len(batches),
        "tokens": sum(tokens),
        "step_kinds": dict(kinds),
        "tokens_per_kind": {k: sum(b.tokens for b in batches if b.kind == k) for k in kinds},
        "step_tokens": {"min": min(tokens, default=0), "max": max(tokens, default=0)},
        "requests": sum(len(b.qlens) for b in batches),
        "max_seq_len_seen": max((max(b.seqs) for b in batches), default=0),
        "uniform_decode_steps": sum(1 for b in batches if b.num_decodes and b.uniform_decode_len),
    }


def _summary(run: dict[str, Any]) -> str:
    k = run["kernels"].values()
    launches, misses, failures = (sum(x[f] for x in k) for f in ("launches", "misses", "failures"))
    kinds = ", ".join(f"{n} {c}" for n, c in run["step_kinds"].items())
    return (
        f"{run['config']}: {run['steps']} steps ({kinds}), {run['tokens']} tokens; {launches} launches of "
        f"{len(run['kernels'])} kernels, {misses} misses, {failures} failures, {len(run['step_failures'])} step "
        f"failures, {len(run['not_launched'])} kernels never launched ({run['wall_s']:.1f} s)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("configs", nargs="*", default=list(EXAMPLES))
    ap.add_argument("--steps", type=int, default=None, help="engine steps per config (default 60; 3 on cpu)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default=None, help='results file suffix (default "h200"; "cpu" with --device cpu)')
    ap.add_argument("--pack", action="append", default=[], help="CONFIG=PACK: warm that config from a pack")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--max-tokens", type=int, help="cap on tokens per step (default: the config's; 4 on cpu)")
    ap.add_argument("--max-seq-len", type=int, help="cap on sequence lengths (default: the config's; 256 on cpu)")
    ap.add_argument("--max-seqs", type=int, help="cap on requests per step (default: the config's; 4 on cpu)")
    args = ap.parse_args()
    packs = dict(p.split("=", 1) for p in args.pack)
    sizes = dict(max_tokens=args.max_tokens, max_seq_len=args.max_seq_len, max_seqs=args.max_seqs)
    steps = args.steps or (60 if args.device == "cuda" else 3)
    runs: list[dict[str, Any]] = []
    crashed: list[dict[str, str]] = []
    name = f"sweep_{args.tag or ('h200' if args.device == 'cuda' else 'cpu')}"
    for config in args.configs:
        try:
            run = run_config(config, steps=steps, seed=args.seed, device=args.device, pack=packs.get(config), **sizes)
        except SweepError as exc:
            sys.exit(f"sweep: {exc}")
        except Exception as exc:  # recorded, and the other configs still run (a CUDA fault may stop them too)
            crashed.append(
                {"config": config, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
            )
            print(f"{config}: crashed: {type(exc).__name__}: {exc}", flush=True)
            continue
        runs.append(run)
        print(_summary(run), flush=True)
        write(name, {"configs": runs, "crashed": crashed})  # after each config: a later crash loses nothing
    path = write(name, {"configs": runs, "crashed": crashed})
    for run in runs:
        print(run["config"])
        for name, k in run["kernels"].items():
            print(f"  {name}: {k['launches']} launches, {k['misses']} misses, {k['failures']} failures")
    print("->", path)
    bad = sum(k["misses"] + k["failures"] for run in runs for k in run["kernels"].values())
    sys.exit(1 if bad or crashed or any(run["step_failures"] or run["not_launched"] for run in runs) else 0)


if __name__ == "__main__":
    main()
