"""The KV-balanced MLA decode's device plan: per-request split counts and the work list of one decode step (vLLM 0.34
``models/kimi_k3/nvidia/kv_balanced_mla/core.py``: ``_plan_work_list_kernel``, ``KvBalancedMla.plan``).

For ``B`` requests of KV lengths ``L`` (int32), ``T_b = max(cdiv(L_b, 128), 1)`` KV tiles, ``Q`` query tiles a
request, ``C`` clusters, capacity ``K`` and shortest chunk ``m`` tiles, one program searches, for each wave count
``W = 1 .. Wmax``, the smallest chunk ``c >= m`` (20 bisection steps in fp32) whose splits ``min(ceil(T_b / c), K)``
fit ``W * C`` clusters; then::

    n_b  = min(ceil(T_b / c_W), K) >= 1;  per_b = max(ceil(T_b / n_b), 1);  n_b = ceil(T_b / per_b)
    t_W  = ceil(sum_b n_b * Q / C) * (max_b per_b + 6)              # waves used x (longest chunk + overhead)
    W*   = first argmin t_W;  counts[b] = n_b(W*)
    work = [(q_tile * B + b) << 8 | split  for b, split-major then q_tile]  then -1 up to the list length

Where it runs: the specialized decode (``serving.decode_backend: latency_specialized``, SM100 family) in the
attention cores of the MLA layers (``PreparedMla``: core "balanced" for verify steps, q = 1 + k, and for plain
steps of at least 8 rows), once per step by the step's first MLA layer. Not under DEP (TP 1: the MLA layers run
stock), not on sm_100 for ``heads * q <= 64`` (M64 tiles: ``supports``). One core per (q, capacity)
(``balanced.CAPACITY``: 64 splits for one request, 32 up to 12, 8 up to 64; 16 / 8 under DCP), sized for its
batch's largest request count.

Key: ``BLOCK_W = next_pow2(Wmax)``, ``BLOCK_B = next_pow2(max(16, B_max))``, ``BLOCK_R = next_pow2(K * Q)``, the
tiles and the search steps. Unlike vLLM's kernel, no integer is specialized and no pointer on its alignment.
Assumed, not configurable: vLLM's default CUDA-graph capture sizes (1, 2, 4 and the multiples of 8: the verify
batches), at least ``MIN_CLUSTERS`` 2-CTA clusters (B200: 74; then ``Wmax`` is 8 for every planned core), no expert
parallelism (its TP > 1 hybrid step is not planned).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg

from .model import PLUGIN, KimiK3, positive_text_int, tensor_parallel_size
from .specialized import SM100_FAMILY, decode_context_parallel_size, specialized_decode

__all__ = ["BalancedCore", "KvBalancedPlan", "KvBalancedPlanKey", "kv_balanced_cores", "register"]

KV_TILE, ROWS, MAX_WAVES, OVERHEAD_TILES = 128, 128, 8, 6
#: The specialized decode's shortest split (``balanced.MIN_SPLIT_TOKENS``).
MIN_SPLIT_TOKENS = 256
#: 2-CTA clusters of the smallest SM100-family GPU (B200, 148 SMs).
MIN_CLUSTERS = 74
#: ``balanced.CAPACITY``: (requests up to, splits) without and with DCP.
CAPACITY = {False: ((1, 64), (12, 32), (64, 8)), True: ((1, 16), (64, 8))}
_BATCHES = (*range(1, 9), 16, 32, 64)
_CAPTURE = (1, 2, 4, *range(8, 65, 8))
_INTS = ["num_reqs", "q_tiles", "clusters", "max_waves", "capacity", "min_tiles", "overhead_tiles", "list_len"]


@triton.jit(do_not_specialize=_INTS, do_not_specialize_on_alignment=["seq_lens_ptr", "counts_ptr", "work_ptr"])
def _plan_kernel(
    seq_lens_ptr, counts_ptr, work_ptr,  # [B] lengths in, [>= B] split counts and [list_len] work list out
    num_reqs, q_tiles, clusters, max_waves, capacity, min_tiles, overhead_tiles, list_len,
    KV_TILE: tl.constexpr,  # KV tokens a tile
    BLOCK_W: tl.constexpr,  # wave counts searched at once: next_pow2(max_waves)
    BLOCK_B: tl.constexpr,  # requests held at once
    BLOCK_R: tl.constexpr,  # entries of one request: next_pow2(capacity * q_tiles)
    BLOCK_T: tl.constexpr,  # -1 entries a store
    SEARCH_STEPS: tl.constexpr,  # bisection steps of the chunk search
):  # fmt: skip
    b = tl.arange(0, BLOCK_B)
    live = b < num_reqs
    lens = tl.load(seq_lens_ptr + b, live, other=0)
    tiles_i = tl.where(live, tl.maximum((lens + KV_TILE - 1) // KV_TILE, 1), 0)
    tiles = tiles_i.to(tl.float32)[None, :]
    waves = tl.arange(0, BLOCK_W) + 1
    budget = (waves * clusters).to(tl.float32)
    low = tl.zeros([BLOCK_W], tl.float32) + tl.maximum(min_tiles.to(tl.float32), 1.0)
    high = tl.maximum(tl.zeros([BLOCK_W], tl.float32) + tl.max(tiles, 1), low)
    for _ in tl.static_range(SEARCH_STEPS):
        mid = 0.5 * (low + high)
        n = tl.minimum(tl.ceil(tiles / mid[:, None]), capacity)
        fits = tl.sum(tl.where(live[None, :], n, 0.0), 1) * q_tiles <= budget
        high = tl.where(fits, mid, high)
        low = tl.where(fits, low, mid)
    n = tl.maximum(tl.minimum(tl.ceil(tiles / high[:, None]), capacity), 1.0).to(tl.int32)
    per = tl.maximum((tiles_i[None, :] + n - 1) // n, 1)
    n = tl.where(live[None, :], (tiles_i[None, :] + per - 1) // per, 0)
    chunk = tl.max(tl.where(live[None, :], per, 0), 1)
    used = tl.sum(n, 1) * q_tiles
    estimate = ((used + clusters - 1) // clusters) * (chunk + overhead_tiles)
    best = tl.argmin(tl.where(waves <= max_waves, estimate, 1 << 30), 0)
    best_n = tl.sum(tl.where(tl.arange(0, BLOCK_W)[:, None] == best, n, 0), 0)
    tl.store(counts_ptr + b, best_n, live)
    work = best_n * q_tiles
    starts = tl.cumsum(work, 0) - work
    total = tl.sum(work, 0)
    for base in range(0, list_len, BLOCK_T):
        idx = base + tl.arange(0, BLOCK_T)
        tl.store(work_ptr + idx, -1, (idx >= total) & (idx < list_len))
    r = tl.arange(0, BLOCK_R)[None, :]
    split = r // q_tiles
    q_tile = r - split * q_tiles
    idx = starts[:, None] + r
    entry = ((q_tile * num_reqs + b[:, None]) << 8) | split
    tl.store(work_ptr + idx, entry, live[:, None] & (r < work[:, None]) & (idx < list_len))


@attrs.frozen(kw_only=True)
class BalancedCore:
    """One ``KvBalancedMla`` core's plan geometry (``KvBalancedMla.__init__``'s derived values).

    Build it with :meth:`create`.
    """

    q_tiles: int
    clusters: int
    max_waves: int
    capacity: int
    min_tiles: int
    list_len: int
    max_requests: int

    @classmethod
    def create(cls, *, heads: int, q: int, max_requests: int, clusters: int, capacity: int,
               min_split_tokens: int = MIN_SPLIT_TOKENS) -> BalancedCore:  # fmt: skip
        """The core of ``heads`` decode heads x ``q`` query tokens for up to ``max_requests`` requests."""
        q_tiles = -(-heads * q // ROWS)
        waves = max(MAX_WAVES, -(-max_requests * q_tiles // clusters))
        return cls(q_tiles=q_tiles, clusters=clusters, max_waves=waves, capacity=capacity,
                   min_tiles=min_split_tokens // KV_TILE, list_len=(waves + 1) * clusters,
                   max_requests=max_requests)  # fmt: skip


def kv_balanced_cores(*, heads: int, q: int, dcp: bool, sm: int, clusters: int = MIN_CLUSTERS) -> list[BalancedCore]:
    """The balanced cores ``PreparedMla`` prepares for ``heads`` decode heads and verify length ``q`` (1: none)."""
    verify = {-(-s // q) * q for s in _CAPTURE} if q > 1 else set()
    batches = sorted(b for b in {*_BATCHES, *verify} if b <= 64)
    largest: dict[tuple[int, int], int] = {}
    for qq in (1, q) if q > 1 else (1,):
        if sm == 100 and heads * qq <= 64:  # M64 tiles on sm_100: tokenspeed
            continue
        for b in batches:
            if b % qq or not (qq > 1 or b >= 8):
                continue
            requests = b // qq
            capacity = next(c for most, c in CAPACITY[dcp] if requests <= most)
            largest[qq, capacity] = max(largest.get((qq, capacity), 0), requests)
    return [BalancedCore.create(heads=heads, q=qq, max_requests=r, clusters=clusters, capacity=c)
            for (qq, c), r in sorted(largest.items())]  # fmt: skip


@attrs.frozen(kw_only=True)
class KvBalancedPlanKey(warmreg.CompileKey):
    """What changes the binary of the plan: its tiles."""

    lens_dtype: str
    kv_tile: int
    block_w: int
    block_b: int
    block_r: int
    block_t: int
    search_steps: int
    num_warps: int


class KvBalancedPlan(warmreg.TritonKernel[KvBalancedPlanKey]):
    """A step's split counts and work list (the module docstring has the math).

    :param heads: the decode heads (local, or every DCP rank's), ``q``: the verify length, ``dcp``: DCP > 1
        (domains only: :func:`kv_balanced_cores` on the platform's arch).
    """

    name = "kimi_k3.kv_balanced_plan"
    key_type = KvBalancedPlanKey
    jit = _plan_kernel

    def __init__(self, *, heads: int, q: int, dcp: bool) -> None:
        self.heads, self.q, self.dcp = heads, q, dcp

    def dispatch(self, *, seq_lens: torch.Tensor, core: BalancedCore) -> KvBalancedPlanKey:
        return KvBalancedPlanKey(
            lens_dtype=warmreg.dtype_name(seq_lens.dtype), kv_tile=KV_TILE, block_w=warmreg.next_pow2(core.max_waves),
            block_b=warmreg.next_pow2(max(16, core.max_requests)),
            block_r=warmreg.next_pow2(core.capacity * core.q_tiles), block_t=1024, search_steps=20, num_warps=4,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        return {
            "seq_lens": [warmreg.meta((1,), torch.int32)],
            "core": kv_balanced_cores(heads=self.heads, q=self.q, dcp=self.dcp, sm=platform.sm),
        }

    def warmup_inputs(self, key: KvBalancedPlanKey) -> Mapping[str, Any]:
        core = BalancedCore(q_tiles=1, clusters=MIN_CLUSTERS, max_waves=key.block_w, capacity=key.block_r, min_tiles=2,
                            list_len=(key.block_w + 1) * MIN_CLUSTERS, max_requests=key.block_b)  # fmt: skip
        return {"seq_lens": warmreg.meta((1,), getattr(torch, key.lens_dtype)), "core": core,
                "counts": warmreg.meta((key.block_b,), torch.int32),
                "work": warmreg.meta((core.list_len,), torch.int32)}  # fmt: skip

    @warmreg.kernel_launcher
    def __call__(
        self, seq_lens: torch.Tensor, counts: torch.Tensor, work: torch.Tensor, *, core: BalancedCore
    ) -> warmreg.LaunchSpec[KvBalancedPlanKey]:
        """``KvBalancedMla.plan``: the split counts into ``counts[:B]`` and the work list into ``work`` (returned).

        :param seq_lens: int32 ``[B]`` contiguous, ``B <= core.max_requests``: this rank's KV lengths.
        :param counts: int32 ``[>= core.max_requests]``; ``work``: int32 ``[>= core.list_len]``.
        :raises warmreg.LaunchError: for shapes, dtypes or sizes the plan cannot take.
        """
        if seq_lens.ndim != 1 or seq_lens.dtype != torch.int32 or seq_lens.stride(0) != 1:
            raise warmreg.LaunchError(self.name, f"seq_lens must be contiguous int32 [B] (got {seq_lens.dtype} "
                                                 f"{tuple(seq_lens.shape)})")  # fmt: skip
        if seq_lens.shape[0] > core.max_requests:
            raise warmreg.LaunchError(self.name, f"seq_lens holds {seq_lens.shape[0]} requests: the core plans at "
                                                 f"most {core.max_requests}")  # fmt: skip
        for arg, t, n in (("counts", counts, core.max_requests), ("work", work, core.list_len)):
            if t.ndim != 1 or t.dtype != torch.int32 or t.shape[0] < n or t.stride(0) != 1:
                raise warmreg.LaunchError(self.name, f"{arg} must be contiguous int32 [>= {n}] (got {t.dtype} "
                                                     f"{tuple(t.shape)})")  # fmt: skip
        key = self.dispatch(seq_lens=seq_lens, core=core)
        kwargs = dict(
            seq_lens_ptr=seq_lens, counts_ptr=counts, work_ptr=work, num_reqs=seq_lens.shape[0], q_tiles=core.q_tiles,
            clusters=core.clusters, max_waves=core.max_waves, capacity=core.capacity, min_tiles=core.min_tiles,
            overhead_tiles=OVERHEAD_TILES, list_len=core.list_len, KV_TILE=key.kv_tile, BLOCK_W=key.block_w,
            BLOCK_B=key.block_b, BLOCK_R=key.block_r, BLOCK_T=key.block_t, SEARCH_STEPS=key.search_steps,
        )  # fmt: skip
        return warmreg.LaunchSpec(key, (1,), kwargs, (counts, work))


def register(registry: warmreg.Registry, m: KimiK3, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the plan on the SM100 family under the specialized decode with TP > 1 (the module docstring).

    :raises warmreg.ConfigError: for malformed settings, or a missing ``text.num_attention_heads``.
    """
    tp = tensor_parallel_size(config)
    if not specialized_decode(config) or tp <= 1:
        return
    dcp = decode_context_parallel_size(config) > 1
    heads = positive_text_int(config, "num_attention_heads") // tp * (tp if dcp else 1)
    drafts = config.get("serving.num_speculative_tokens", int, plugin=PLUGIN, default=0)
    kernel = KvBalancedPlan(heads=heads, q=1 + max(drafts, 0), dcp=dcp)
    if kv_balanced_cores(heads=kernel.heads, q=kernel.q, dcp=dcp, sm=platform.sm):  # none: sm_100's M64 shapes
        registry.add(kernel, when=SM100_FAMILY)
