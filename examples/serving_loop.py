"""An engine-shaped step loop: build the config, warm, arm the monitor, then serve steps.

On a GPU it warms the local GPU, arms the monitor in ``error`` mode (any runtime compile raises
before it is paid for) and runs steps of randomized decode-first batches (decode-only, prefill-only
and mixed) through DeepSeek-V4's per-step metadata kernels: the block-table slot mapping of the
SWA and compressed KV-cache groups, the C128A top-k metadata, the C4 global top-k indices, the
decode SWA indices and the Q/KV RMSNorm. It prints the warm report and the monitor counters.

On a machine without a GPU it plans and cross-compiles for ``--target`` (default ``cuda:90``) and
prints the report: the same start-up an engine's build step would run.

    python examples/serving_loop.py [examples/deepseek_v4_flash.json] [--steps 50] [--target cuda:90]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch
from warmreg_deepseek_v4.global_topk import GlobalTopkIndices
from warmreg_deepseek_v4.sparse_mla import C128ATopkMetadata, c128_active_width
from warmreg_deepseek_v4.swa_indices import DecodeSwaIndices

import warmreg
from warmreg.ops import BlockTableSlotMapping, FusedQKVRMSNorm, block_table_width

HERE = Path(__file__).resolve().parent


def _kernel(plan: warmreg.Plan, cls: type) -> object:
    return plan.kernel(cls.name).kernel


def make_batch(rng: random.Random, kind: str, cfg: warmreg.WarmConfig) -> tuple[list[tuple[int, int]], int]:
    """``(seq_len, query_len)`` per request, decode requests first (what an engine's scheduler
    emits), and the number of decode requests."""
    budget = cfg.serving["max_num_batched_tokens"]
    max_len = cfg.serving["max_model_len"]
    n_dec = 0 if kind == "prefill" else rng.randint(1, min(64, cfg.serving["max_num_seqs"]))
    reqs = [(rng.randint(1, max_len), 1) for _ in range(n_dec)]
    if kind != "decode":
        left = budget - n_dec
        while left > 0 and len(reqs) < cfg.serving["max_num_seqs"]:
            q = min(left, rng.randint(1, 2048))
            reqs.append((rng.randint(q, min(max_len, q + 100_000)), q))
            left -= q
    return reqs, n_dec


def step(plan: warmreg.Plan, reqs: list[tuple[int, int]], n_dec: int, dev: torch.device) -> int:
    """One engine step through the metadata kernels; returns the number of tokens.

    Decode requests come first and have one token each, so ``n_dec`` is also the decode token count.
    """
    cfg = plan.config
    text = cfg.text
    max_len = cfg.serving["max_model_len"]
    qlens = torch.tensor([q for _, q in reqs], dtype=torch.int32)
    seqs = torch.tensor([s for s, _ in reqs], dtype=torch.int32)
    qsl = torch.zeros(len(reqs) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(qlens, 0)
    T = int(qsl[-1])
    tok_req = torch.repeat_interleave(torch.arange(len(reqs), dtype=torch.int32), qlens)
    offs = torch.arange(T, dtype=torch.int64) - qsl[:-1].long()[tok_req.long()]
    positions = (seqs.long() - qlens.long())[tok_req.long()] + offs
    qsl, positions, tok_req = qsl.to(dev), positions.to(dev), tok_req.to(dev)

    slot_mapping_op = _kernel(plan, BlockTableSlotMapping)
    for block in (64, 256):  # the SWA group and the compressed groups' uncompressed slots
        width = block_table_width(max_len, block)
        table = torch.randint(0, 1 << 16, (cfg.serving["max_num_seqs"], width), dtype=torch.int32, device=dev)
        slots = slot_mapping_op(qsl, positions, table, block_size=block)
    valid = slots[:T] >= 0

    c4_table = torch.randint(0, 1 << 12, (len(reqs), -(-max_len // 256)), dtype=torch.int32, device=dev)
    if "deepseek_v4.c128a_topk_metadata" in {k.name for k in plan.kernels}:
        width = c128_active_width(int(seqs.max()), max_len)
        _kernel(plan, C128ATopkMetadata)(
            positions, tok_req, c4_table, slots, num_decode_tokens=n_dec, max_compressed_tokens=width, block_size=2
        )
    if "deepseek_v4.global_topk_indices" in {k.name for k in plan.kernels} and n_dec:
        topk = torch.randint(-1, 4096, (n_dec, text["index_topk"]), dtype=torch.int32, device=dev)
        _kernel(plan, GlobalTopkIndices)(topk, tok_req, c4_table, valid, block_size=64)
    if "deepseek_v4.decode_swa_indices" in {k.name for k in plan.kernels} and n_dec:
        swa_table = torch.randint(0, 1 << 12, (len(reqs), -(-max_len // 64)), dtype=torch.int32, device=dev)
        replay = torch.zeros(len(reqs), dtype=torch.int32, device=dev)
        window = text["sliding_window"]
        _kernel(plan, DecodeSwaIndices)(
            positions, tok_req, valid, swa_table, replay, num_tokens=n_dec, window_size=window, index_width=window, block_size=64
        )
    norm = _kernel(plan, FusedQKVRMSNorm)
    q, kv = text["q_lora_rank"], text["head_dim"]
    proj = torch.randn(T, q + kv, device=dev, dtype=torch.bfloat16)
    norm(proj[:, :q], proj[:, q:], torch.ones(q, device=dev, dtype=torch.bfloat16), torch.ones(kv, device=dev, dtype=torch.bfloat16), 1e-6)
    return T


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", default=str(HERE / "deepseek_v4_flash.json"))
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--target", default="cuda:90", help="cross-compile target on a machine without a GPU")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    cfg = warmreg.WarmConfig.load(args.config)
    if not torch.cuda.is_available():
        report = warmreg.warm(cfg, target=args.target)
        print(report.summary())
        print("no GPU here: planned and cross-compiled only; run on a GPU host to serve steps")
        return
    report = warmreg.warm(cfg, monitor="error")  # the monitor is armed once warm has finished
    print(report.summary())
    plan = warmreg.plan(cfg)
    rng = random.Random(args.seed)
    tokens = 0
    for i in range(args.steps):
        kind = ("decode", "prefill", "mixed")[i % 3]
        reqs, n_dec = make_batch(rng, kind, cfg)
        tokens += step(plan, reqs, n_dec, torch.device("cuda"))
    torch.cuda.synchronize()
    from warmreg.monitoring import current

    mon = current()
    print(f"served {args.steps} steps, {tokens} tokens; runtime misses: {len(mon.misses) if mon else 'n/a'}")
    for name, row in (mon.counters() if mon else {}).items():
        print(f"  {name}: {row}")
    warmreg.disarm()


if __name__ == "__main__":
    main()
