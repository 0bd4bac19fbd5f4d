"""``warmreg-vllm build``: a pack of vLLM's own Triton kernels for a deployment, on a machine without a GPU.

::

    warmreg-vllm build --profile h200 -o flash-tp4-h200.tar.gz -- --model deepseek-ai/DeepSeek-V4-Flash \\
        --tensor-parallel-size 4 --kv-cache-dtype fp8_ds_mla ...      # vLLM's engine arguments, as `vllm serve`
    warmreg pack install flash-tp4-h200.tar.gz                         # on the serving host (or into its image)

The engine arguments are parsed by vLLM's own parser (``EngineArgs.add_cli_args``, ``EngineArgs.from_cli_args``);
``--profile`` is a shipped profile's name (``h200``) or a profile JSON file. The report lists vLLM's registered
kernels and keys, which the pack holds, and which it cannot hold and why (``--json`` writes it as JSON too).
Run once per deployment: each build is one process (:func:`~warmreg_vllm.vllm_pack.build_vllm_pack`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from warmreg import WarmregError

if TYPE_CHECKING:
    from .profile import GpuProfile

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="warmreg-vllm", description="warmreg for vLLM's own kernels")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser(
        "build", help="pack every Triton key vLLM's registry warms for a deployment on a profiled GPU",
        description="Arguments after `--` (or any this command does not know) are vLLM's engine arguments.",
    )  # fmt: skip
    b.add_argument("--profile", required=True, help="a shipped GPU profile (h200) or a profile JSON file")
    b.add_argument("-o", "--output", required=True, help="a directory, or a .tar / .tar.gz / .zip file")
    b.add_argument("--workers", type=int, default=None, help="compile threads (default: this machine's CPUs)")
    b.add_argument("--force", action="store_true", help="replace an existing output")
    b.add_argument("--json", default=None, metavar="FILE", help="also write the report as JSON")
    return parser


def _profile(spec: str) -> GpuProfile:
    from .profile import GpuProfile

    return GpuProfile.load(Path(spec)) if spec.endswith(".json") or os.sep in spec else GpuProfile.named(spec)


def _engine_args(argv: Sequence[str]) -> object:
    """vLLM's ``EngineArgs`` from ``vllm serve``-style arguments, by vLLM's own parser."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="warmreg-vllm build --"))
    return EngineArgs.from_cli_args(parser.parse_args(list(argv)))


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``warmreg-vllm``; returns the exit status (1 with one line on stderr for a warmreg error)."""
    args, engine = _parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    engine = [a for a in engine if a != "--"]
    # The build never uses a GPU, and vLLM keeps Triton on only with no visible device (emulation.py, point 1)
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    # Nor does it serve: vLLM's loader runs the start-up plugin while parsing the arguments, and with WARMREG_WARM
    # on it would import vLLM's GPU worker (and the model packages) under the CPU platform, before the emulation
    os.environ.pop("WARMREG_WARM", None)
    from .vllm_pack import build_vllm_pack

    try:
        report = build_vllm_pack(
            _engine_args(engine), _profile(args.profile), args.output, workers=args.workers, force=args.force
        )  # type: ignore[arg-type]
    except WarmregError as e:
        print(f"warmreg-vllm: {e}", file=sys.stderr)
        return 1
    print(report.summary())
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_dict(), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
