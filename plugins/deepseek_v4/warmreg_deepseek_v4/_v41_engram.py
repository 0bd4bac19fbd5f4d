"""DeepSeek-V4.1's engram layers: the checkpoint fields the engram kernels read (vLLM 0.34
``models/deepseek_v41/common/engram.py: EngramLayout``, ``config/engram.py: model_has_engram_layers``).

vLLM decides a V4.1 checkpoint has engram layers when its text config's ``engram_layer_ids`` is non-empty
(``_NGRAM_LAYER_FIELDS["DeepseekV41ForCausalLM"]``); it then builds an ``EngramConfig`` (CPU offload on by default)
and one ``Engram`` module on each listed backbone layer. Each position is hashed as ``engram_max_ngram_size - 1``
n-grams (2-gram .. max) over ``engram_n_heads`` heads, so a layer looks up ``n_hash_cols = (max - 1) * n_heads`` FP8
rows of ``engram_head_dim`` values (with one ue8m0 scale byte per 32) from its table.

Tensor parallelism splits a table by heads: ``part = cdiv(n_hash_cols, tp)`` heads a rank
(``ParallelEngramEmbedding.__init__``, with no engram DP group; warmreg has no data-parallel setting).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

import warmreg

__all__ = ["EngramLayout", "engram_layout"]


@attrs.frozen(kw_only=True)
class EngramLayout:
    """The engram fields of a V4.1 text config that change what its engram kernels launch."""

    #: the backbone layers with an engram module (``engram_layer_ids`` in the config's order: a layer's index here is its hash column block)
    layer_ids: tuple[int, ...] = attrs.field(converter=tuple)
    #: the longest n-gram hashed (``engram_max_ngram_size``); ``max_ngram_size - 1`` tokens of look-back
    max_ngram_size: int
    #: hash heads an n-gram size (``engram_n_heads``)
    n_heads: int
    #: values a table row (``engram_head_dim``)
    head_dim: int

    @property
    def n_hash_cols(self) -> int:
        """Rows a token looks up in one layer's table: ``(max_ngram_size - 1) * n_heads``."""
        return (self.max_ngram_size - 1) * self.n_heads

    def local_heads(self, tensor_parallel_size: int) -> int:
        """Hash heads a tensor-parallel rank owns: ``cdiv(n_hash_cols, tp)`` (``part_n_hash_cols``)."""
        return -(-self.n_hash_cols // tensor_parallel_size)


def engram_layout(config: warmreg.WarmConfig, plugin: str) -> EngramLayout | None:
    """The engram layout of a V4.1 config (``text.engram_*``), or None without ``engram_layer_ids``.

    :raises warmreg.ConfigError: naming a field that is missing or invalid once ``engram_layer_ids`` is set: the
        head dim must be a multiple of 32 (one scale a 32-value block) and a power of two (the kernels' tile).
    """
    raw = config.text.get("engram_layer_ids")
    if not raw:
        return None
    if not isinstance(raw, Sequence) or isinstance(raw, str):
        raise warmreg.ConfigError("text.engram_layer_ids", "must be a list of layer ids", plugin=plugin)
    for i, v in enumerate(raw):
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
            raise warmreg.ConfigError(
                f"text.engram_layer_ids[{i}]", f"must be a layer id >= 0 (got {v!r})", plugin=plugin
            )

    def at_least(low: int) -> Callable[[int], str | None]:
        return lambda v: None if v >= low else f"must be >= {low} (got {v})"

    def head_dim_ok(v: int) -> str | None:
        return None if v >= 32 and v & (v - 1) == 0 else f"must be a power of two >= 32 (got {v})"

    return EngramLayout(
        layer_ids=tuple(raw),
        max_ngram_size=config.get("text.engram_max_ngram_size", int, plugin=plugin, check=at_least(2)),
        n_heads=config.get("text.engram_n_heads", int, plugin=plugin, check=at_least(1)),
        head_dim=config.get("text.engram_head_dim", int, plugin=plugin, check=head_dim_ok),
    )
