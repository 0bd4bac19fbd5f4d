"""The DSpark draft of a DeepSeek-V4 deployment (vLLM 0.33 ``config/speculative.py``: ``use_dspark``,
``models/deepseek_v4/nvidia/dspark.py``: ``DSparkDraftModel``, ``v1/worker/gpu/spec_decode/dspark/speculator.py``).

DSpark is on only when ``serving.speculative_method`` is ``"dspark"`` (vLLM's ``SpeculativeConfig.method``); the
``dspark_*`` fields of a DeepSeek-V4 ``config.json`` give its sizes, never the switch. A draft step then runs
``n_mtp_layers`` (default 3) decoder layers named ``layers.{num_hidden_layers + i}``, each SWA-only (compress ratio
1: vLLM's ``DeepseekV4Attention`` gives every layer past ``num_hidden_layers`` ratio 1, whatever ``compress_ratios``
lists; a real ``DeepseekV4Config`` lists 43 + 1 MTP entries, the legacy list of DeepSeek-V4-Flash-0731 ends ``4,0,0,0``), on
``N`` query tokens per request (the anchor and ``N - 1`` noise tokens, ``sample_from_anchor`` True by default;
``1 + N`` without it), ``N = num_speculative_tokens``, which defaults to ``dspark_block_size``. Its attention
metadata is built non-causal: every query token of a request sees the ``window`` context tokens before the block
and the whole block, in rows ``round_up(window + N, 64)`` wide (``compressor_utils.get_dspark_swa_index_width``).

DeepSeek-V4.1 (vLLM 0.34 ``models/deepseek_v41/nvidia/dspark.py`` and ``amd/dspark.py``: ``DSparkDeepseekV4Model``)
drafts the same way through the same speculator (``v1/worker/gpu/spec_decode/dspark/speculator.py``) and SWA builder
(``v1/attention/backends/mla/sparse_swa.py``). Its draft reads the target's ``hf_config``, which
``DeepseekV41Config`` flattens from ``text_config``: warmreg reads those fields as ``text.<field>``
(:attr:`warmreg.WarmConfig.text`). Its draft layer count is ``n_mtp_layers or num_nextn_predict_layers or 3``, and its
SWA cache pages hold 32 tokens (``DeepseekV4SWACache(block_size=32)`` in V4.1's ``DeepseekV4Attention.__init__``)
where V4's hold 64.
"""

from __future__ import annotations

import attrs
import triton

import warmreg

from ._serving import serving_int
from .model import DSV4, PLUGIN, SWA_PAGE_SIZE, V41_MODEL_TYPE

__all__ = [
    "DSPARK",
    "SPECULATIVE_METHODS",
    "V41_SWA_PAGE_SIZE",
    "DSparkDraft",
    "dspark_swa_index_width",
    "mtp_drafts",
    "num_speculative_tokens",
    "speculative_method",
]

DSPARK = "dspark"
#: ``serving.speculative_method`` values this plugin knows (vLLM 0.33 ``SpeculativeMethod``; the per-model MTP
#: names such as ``deepseek_mtp`` are normalized to ``mtp`` by vLLM and warmreg's engine readers). Only
#: ``dspark`` adds kernels; with ``mtp`` the checkpoint's MTP layers draft; the others draft with a model (or
#: none) outside this plugin, so the target's kernels are what this plugin plans.
SPECULATIVE_METHODS = (
    "mtp", DSPARK, "eagle", "eagle3", "dflash", "draft_model", "ngram", "ngram_gpu", "suffix",
    "extract_hidden_states", "custom_class",
)  # fmt: skip
#: ``get_dspark_swa_index_width`` pads non-causal rows to a multiple of this.
SWA_INDEX_ALIGNMENT = 64
#: DeepSeek-V4.1's SWA cache page (``DeepseekV4SWACache(block_size=32)``, ``models/deepseek_v41/attention.py``).
V41_SWA_PAGE_SIZE = 32


def _field(config: warmreg.WarmConfig, name: str) -> str:
    """The config path of a draft field: ``model.<name>`` for DeepSeek-V4, ``text.<name>`` for V4.1 (its draft's
    ``hf_config`` is the flattened ``text_config``)."""
    return f"text.{name}" if config.model_type == V41_MODEL_TYPE else f"model.{name}"


def speculative_method(config: warmreg.WarmConfig) -> str | None:
    """``serving.speculative_method`` (None when unset), one of :data:`SPECULATIVE_METHODS`.

    :raises warmreg.ConfigError: for any other value, naming the accepted ones.
    """
    return config.get("serving.speculative_method", str, plugin=PLUGIN, default=None, choices=SPECULATIVE_METHODS)


def mtp_drafts(config: warmreg.WarmConfig) -> bool:
    """Whether the checkpoint's MTP layers draft: ``speculative_method`` ``mtp`` or unset (vLLM picks ``mtp`` for a
    DeepSeek-V4 target without a draft model; with no speculation the MTP kernels are warmed as before).

    :raises warmreg.ConfigError: for an unknown method.
    """
    return speculative_method(config) in (None, "mtp")


def num_speculative_tokens(config: warmreg.WarmConfig) -> int:
    """Draft tokens per step: ``serving.num_speculative_tokens``; unset with DSpark, the model's
    ``dspark_block_size`` (vLLM's default for a DSpark draft; V4.1: the text model's); else 0.

    :raises warmreg.ConfigError: for DSpark with neither set, or an unknown method.
    """
    if speculative_method(config) != DSPARK:
        return serving_int(config, "num_speculative_tokens", 0)
    if config.serving.get("num_speculative_tokens") is not None:
        return serving_int(config, "num_speculative_tokens")
    return config.get(
        _field(config, "dspark_block_size"), int, plugin=PLUGIN, check=_positive,
        fix="set serving.num_speculative_tokens or the model's dspark_block_size",
    )  # fmt: skip


def dspark_swa_index_width(window: int, num_tokens: int) -> int:
    """The width of a non-causal DSpark SWA row: ``round_up(window + N, 64)``."""
    return triton.cdiv(max(window, 0) + max(num_tokens, 0), SWA_INDEX_ALIGNMENT) * SWA_INDEX_ALIGNMENT


def _positive(value: int) -> str | None:
    return None if value > 0 else f"must be > 0 (got {value})"


@attrs.frozen(kw_only=True)
class DSparkDraft:
    """The sizes of a DSpark draft step, read once per config (:meth:`from_config`)."""

    #: ``N``: draft tokens per step (``num_speculative_tokens``)
    num_tokens: int
    #: query tokens per request: ``N`` with ``sample_from_anchor``, else ``1 + N``
    num_query_per_req: int
    sample_from_anchor: bool
    #: the input id of the non-anchor query slots (vLLM's ``parallel_drafting_token_id``)
    noise_token_id: int
    #: compress ratios of the draft layers, in layer order: all 1 (sliding window only), as vLLM builds them
    ratios: tuple[int, ...]
    #: the sliding window and the non-causal row width ``round_up(window + N, 64)``
    window: int
    index_width: int
    #: tokens a page of the SWA cache group the draft's inputs and rows address: 64 (V4), 32 (V4.1)
    swa_block_size: int = SWA_PAGE_SIZE

    @classmethod
    def from_config(cls, config: warmreg.WarmConfig, model: DSV4) -> DSparkDraft | None:
        """The draft of a deployment with ``speculative_method == "dspark"``, else ``None``.

        :raises warmreg.ConfigError: for an unknown method, or DSpark fields that are missing or do not fit
            ``compress_ratios``.
        """
        if speculative_method(config) != DSPARK:
            return None
        n = num_speculative_tokens(config)
        if n < 1:
            raise warmreg.ConfigError(
                "serving.num_speculative_tokens", f"must be >= 1 with DSpark (got {n})", plugin=PLUGIN
            )
        fields = config.text if model.v41 else config.model
        if model.v41:  # DSparkDeepseekV4Model: n_mtp_layers or num_nextn_predict_layers or 3
            drafts = fields.get("n_mtp_layers") or fields.get("num_nextn_predict_layers") or 3
            if isinstance(drafts, bool) or not isinstance(drafts, int) or drafts < 1:
                raise warmreg.ConfigError(
                    "text.n_mtp_layers", f"must be a positive int (got {drafts!r})", plugin=PLUGIN
                )
        else:
            drafts = config.get("model.n_mtp_layers", int, plugin=PLUGIN, default=3, check=_positive)
        anchor = config.get(_field(config, "sample_from_anchor"), bool, plugin=PLUGIN, default=True)
        if fields.get("mask_token_id") is not None:  # get_parallel_drafting_token_id's order
            noise = config.get(_field(config, "mask_token_id"), int, plugin=PLUGIN)
        else:
            noise = config.get(_field(config, "dspark_noise_token_id"), int, plugin=PLUGIN)
        return cls(
            num_tokens=n,
            num_query_per_req=n if anchor else 1 + n,
            sample_from_anchor=anchor,
            noise_token_id=noise,
            # vLLM builds the draft layers as layers num_hidden_layers + i, and DeepseekV4Attention gives every layer
            # at or past num_hidden_layers compress ratio 1 (vllm/models/deepseek_v4/attention.py), whatever the
            # config lists there: transformers' DeepseekV4Config lists no draft layers at all (get_compress_ratios
            # appends one 0 per MTP layer), the legacy compress_ratios list may.
            ratios=(1,) * drafts,
            window=model.sliding_window,
            index_width=dspark_swa_index_width(model.sliding_window, n),
            swa_block_size=V41_SWA_PAGE_SIZE if model.v41 else SWA_PAGE_SIZE,
        )
