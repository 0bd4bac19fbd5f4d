"""DeepSeek-V4.1's global top-k indices and lens: DeepSeek-V4's op (:mod:`.global_topk`) with V4.1's domains.

vLLM 0.34's V4.1 copy (``models/deepseek_v41/common/ops/cache_utils.py``: ``compute_global_topk_indices_and_lens`` and
``_compute_global_topk_indices_and_lens_kernel``) has V4's math, layout and launch: one program per token, the
indexer's local top-k mapped through the compressed cache's block table, ``-1`` kept, ``lens = 0`` for invalid
tokens. :class:`.global_topk.GlobalTopkIndices` serves it; what differs is where V4.1 launches it and with which
sizes, read here:

* the attention classes: FlashMLA's split-KV decode (``nvidia/flashmla.py: _forward_decode``), mega attention's
  decode (``nvidia/flash_mla_mega_attn.py: _decode_compressed_kv_and_topk``) and FlashInfer's SM120 class, on its
  decode and its prefill rows (``nvidia/flashinfer_sparse.py: DeepseekV4FlashInferSM120Attention``); FlashInfer's
  SM10x class maps its top-k inside the mixed sparse indices (:mod:`.v41_flashinfer_indices`) instead;
* every compressed layer (ratios 1 and 2; SWA-only layers launch nothing), with ``block_size =
  attn_metadata.block_size // ratio``: compressed tokens per kernel page. The compressed cache's builder gets the
  attention backend's kernel block size (``v1/worker/utils.py: AttentionGroup.create_metadata_builders`` with
  ``select_common_block_size``): 128 for FlashMLA (64 on SM90, ``sparse_mla.py``), mega attention and FlashInfer on
  SM10x, 64 for FlashInfer on SM12x, when ``serving.block_size`` is a multiple of it;
* the block table's row width, a key field of the op: ``get_block_table_width(cdiv(max_model_len, block_size),
  block_size)`` (aligned to 128 tokens) times ``block_size // kernel_block`` (the same function);
* the top-k rows: prefixes of the shared ``[max_num_batched_tokens, index_topk]`` buffer (decode), and for
  FlashInfer SM120's prefill its rows from the decode count on (offset views).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import triton

import warmreg

from ._serving import max_model_len, serving_int
from .global_topk import GlobalTopkIndices
from .model import DSV4, PLUGIN

__all__ = ["V41GlobalTopkIndices", "block_table_width", "kernel_block_size", "register"]

#: The attention classes (:data:`.v41.ATTENTION_KINDS`) that launch the global top-k.
KINDS = ("flashmla", "mega", "flashinfer_sm120")


def kernel_block_size(config: warmreg.WarmConfig, kind: str, platform: warmreg.Platform) -> int:
    """The compressed cache's kernel block size (tokens a page) under attention class ``kind`` on a CUDA ``platform``.

    :raises warmreg.ConfigError: naming ``serving.block_size`` when it is not a multiple of the backend's size.
    """
    kernel = 64 if (kind == "flashinfer_sm120" or (kind == "flashmla" and platform.sm // 10 == 9)) else 128
    block = serving_int(config, "block_size", 256)
    if block % kernel:
        raise warmreg.ConfigError(
            "serving.block_size", f"is {block}, which the {kind} attention's {kernel}-token kernel pages do not divide",
            plugin=PLUGIN, fix=f"use a multiple of {kernel} (256)",
        )  # fmt: skip
    return kernel


def block_table_width(config: warmreg.WarmConfig, kernel_block: int) -> int:
    """Row width of the compressed cache's kernel block table (see the module docstring)."""
    block = serving_int(config, "block_size", 256)
    alignment = 128 // math.gcd(128, block)
    blocks = triton.cdiv(triton.cdiv(max_model_len(config), block), alignment) * alignment
    return blocks * (block // kernel_block)


class V41GlobalTopkIndices(GlobalTopkIndices):
    """:class:`.global_topk.GlobalTopkIndices` (same kernel, key and launch) with a V4.1 deployment's domains.

    :param block_sizes: compressed tokens a kernel page, one per compressed layer ratio.
    :param table_width: the kernel block table's row width.
    :param prefill_rows: whether prefill rows (offset views of the top-k buffer) launch it too (FlashInfer SM120).
    """

    name = GlobalTopkIndices.name  # the same kernel: a V4.1 plan names it as V4's does

    def __init__(self, *, block_sizes: Iterable[int] = (), table_width: int = 1, prefill_rows: bool = False) -> None:
        self.block_sizes = tuple(sorted(set(block_sizes)))
        self.table_width, self.prefill_rows = table_width, prefill_rows

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        model = DSV4.from_config(config)
        tokens = warmreg.token_counts(config, plugin=PLUGIN)
        buffer = warmreg.meta((tokens[-1] + 3, model.index_topk), torch.int32)
        views = [buffer[:t] for t in tokens]
        if self.prefill_rows:
            views += [buffer[nd : nd + t] for nd in (1, 2, 3) for t in tokens]
        max_reqs = config.get("serving.max_num_seqs", int, plugin=PLUGIN, default=1)
        return {
            "topk_indices": views,
            "block_table": [warmreg.meta((max_reqs, self.table_width), torch.int32)],
            "block_size": list(self.block_sizes),
        }


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the global top-k for a V4.1 deployment on CUDA whose attention class launches it (:data:`KINDS`) and
    whose model has compressed layers.

    :raises warmreg.ConfigError: from :func:`.v41.attention_kind` or :func:`kernel_block_size`.
    """
    from .v41 import attention_kind  # v41 imports this module

    ratios = sorted({r for r in model.ratios if r > 0})
    if not platform.is_cuda or not model.v41 or not ratios:
        return
    kind = attention_kind(config, model, platform)
    if kind not in KINDS:
        registry.add(V41GlobalTopkIndices(), when=False)
        return
    kernel = kernel_block_size(config, kind, platform)
    op = V41GlobalTopkIndices(
        block_sizes=[kernel // r for r in ratios], table_width=block_table_width(config, kernel),
        prefill_rows=kind == "flashinfer_sm120",
    )  # fmt: skip
    registry.add(op, when=warmreg.is_cuda)
