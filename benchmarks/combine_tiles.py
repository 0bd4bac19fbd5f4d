"""DeepSeek-V4's FlashMLA prefill combine of top-k and SWA indices with one column tile a row (``next_pow2(width)``
lanes: the kernel before, 16,384 lanes for a C128 row at a 1M context) against tiles of at most 1,024 lanes (the
kernel now): each variant's first launch in a fresh Triton cache (its compile and load), its kernel time
(``triton.testing.do_bench``) and the outputs, which must be equal, at the Flash example's row widths.

The same ``@triton.jit`` function runs both: with ``TILE = next_pow2(width)`` its column loop takes one step, which is
the kernel as it was. Writes ``benchmarks/results/combine_tiles_<tag>.json``.

    python benchmarks/combine_tiles.py [--tag h100] [--tokens 2048]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="combine-tiles-")  # every variant compiles here, once

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write
from warmreg_deepseek_v4 import combine_indices

WINDOW = 128  # DeepSeek-V4's sliding window (config.json: sliding_window)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tag", default="h100")
    ap.add_argument("--tokens", type=int, default=2048, help="prefill tokens of the chunk (4 requests)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("combine_tiles.py times kernels on a CUDA GPU")
    dev = torch.device("cuda")
    op = combine_indices.CombineTopkSwaIndices(window_size=WINDOW)
    rows = []
    for ratio, top_k in [(1, 0), (4, 512), (128, 2048), (128, 4096), (128, 8192)]:
        requests, seq = 4, 1 << 20  # a 1M context: every C128 row has its full top-k
        per = args.tokens // requests
        qsl = torch.arange(0, requests + 1, dtype=torch.int32, device=dev) * per
        seq_lens = torch.full((requests,), seq, dtype=torch.int32, device=dev)
        gather = torch.full((requests,), per + WINDOW - 1, dtype=torch.int32, device=dev)
        n_rows = seq // ratio if ratio > 1 else 0
        topk = torch.randint(0, max(n_rows, 1), (args.tokens, top_k), dtype=torch.int32, device=dev) if top_k else None
        key = op.dispatch(top_k=top_k, compress_ratio=ratio, image_width=0)
        out = (
            torch.empty(args.tokens, key.width, dtype=torch.int32, device=dev),
            torch.empty(args.tokens, dtype=torch.int32, device=dev),
        )
        common = dict(
            topk_ptr=topk, query_start_loc_ptr=qsl, seq_lens_ptr=seq_lens, gather_lens_ptr=gather, left_visible_ptr=None,
            right_visible_ptr=None, topk_stride=top_k, M=n_rows + per + WINDOW, N=n_rows, TOP_K=top_k,
            COMPRESS_RATIO=ratio, WINDOW_SIZE=WINDOW, HAS_IMAGE=False, WIDTH=key.width, num_warps=key.num_warps,
        )  # fmt: skip
        grid = (requests, op.workers)
        results = {}
        for name, tile in (("one_tile", triton.next_power_of_2(key.width)), ("tiles", key.tile)):
            idx, lens = torch.full_like(out[0], -7), torch.full_like(out[1], -7)
            kw = dict(common, out_ptr=idx, lens_ptr=lens, out_stride=idx.stride(0), TILE=tile)

            def launch(kw: dict = kw, grid: tuple[int, int] = grid) -> None:
                combine_indices._combine_topk_swa_indices_kernel[grid](**kw)

            torch.cuda.synchronize()
            start = time.perf_counter()
            launch()  # compile, load and run
            torch.cuda.synchronize()
            first = time.perf_counter() - start
            results[name] = {
                "tile": tile,
                "first_launch_s": first,
                "kernel_ms": triton.testing.do_bench(launch),
                "out": (idx, lens),
            }
        a, b = results["one_tile"].pop("out"), results["tiles"].pop("out")
        equal = torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        if not equal:
            raise SystemExit(f"top_k {top_k}: the tiled kernel's output differs from the one-tile kernel's")
        rows.append(
            {
                "compress_ratio": ratio,
                "top_k": top_k,
                "width": key.width,
                "tokens": args.tokens,
                "equal": equal,
                **results,
            }
        )
        print(f"top_k {top_k:5d} width {key.width:5d}: first launch {results['one_tile']['first_launch_s']:.3f} -> "
              f"{results['tiles']['first_launch_s']:.3f} s, kernel {results['one_tile']['kernel_ms']:.4f} -> {results['tiles']['kernel_ms']:.4f} ms")  # fmt: skip
    print("->", write(f"combine_tiles_{args.tag}", {"rows": rows}))


if __name__ == "__main__":
    main()
